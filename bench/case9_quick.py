"""``python -m bench.case9_quick N REPS [SPLIT_MAX]``: a quick, interleaved variant of
case 9's Spark split merge, for iterating on it (not part of the report).

Writes one shard of ``N`` updates (case 9's data), clones its location ``2 x REPS + 1``
times, starts a standalone cluster (2 workers x 1 core) and one prestarted application,
then alternates ``client.compact()`` in this (driver) process with one split-merge job on
the cluster, ``REPS`` times each, so both see the same load. Prints one JSON line per
run and, per task of a cluster job: its key range's wall and CPU seconds, its start
and end relative to the job's start (idle gaps), its worker process, and the load
average; and checks every compacted copy's fingerprint against the first.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.case9_scale import RUNS, _client_of, _clone, _uris, _write_shard
from bench.cluster import StandaloneCluster
from persist_pipeline import spark as ps


def _timed(task: Any) -> tuple[Any, dict[str, Any]]:
    started = time.time()
    result = ps._run_task(task)
    return result, {"index": task.index, "pid": os.getpid(), "t0": started,
                    "t1": time.time(), "cpu": result.cpu_s, "wall": result.duration_s,
                    "rows": result.res.output.num_updates if result.res else None,
                    "err": result.error}


def _one(spark: Any, kind: str, where: Path, shard: str, app: str, rep: int) -> str:
    c = _client_of(where)
    load = os.getloadavg()[0]
    cpu0 = os.times()
    t0 = time.perf_counter()
    info: list[dict[str, Any]] = []
    if kind.startswith("one"):
        from numpy._core import multiarray
        before = multiarray._set_madvise_hugepage(kind == "one")
        m = c.compact(shard)
        multiarray._set_madvise_hugepage(before)
    else:
        def run_tasks(tasks: list[Any]) -> tuple[list[Any], str]:
            sc = spark.sparkContext
            out = sc.parallelize(tasks, len(tasks)).map(_timed).collect()
            info.extend(i for _, i in out)
            return [r for r, _ in out], "q"
        m = ps.drive_compaction(run_tasks, c, [shard], blob_uri=_uris(where)[1],
                                max_splits=int(os.environ.get("C9Q_SPLITS", "4")))[shard]
    s = time.perf_counter() - t0
    cpu1 = os.times()
    fp: str = c.open_reader(shard).snapshot_fingerprint(RUNS - 1)
    c.close()
    row: dict[str, Any] = {"app": app, "rep": rep, "kind": kind, "s": round(s, 3),
                           "load1": round(load, 2), "drv_cpu": round(
                               cpu1.user + cpu1.system - cpu0.user - cpu0.system, 2)}
    if kind == "cluster":
        base_t = min(i["t0"] for i in info)
        row.update(plan=round(m["plan_s"], 3), run=round(m["run_s"], 3),
                   commit=round(m["commit_s"], 3),
                   task_cpu=round(sum(i["cpu"] for i in info), 2), tasks=[
                       (i["pid"] % 1000, round(i["t0"] - base_t, 2),
                        round(i["t1"] - base_t, 2), round(i["cpu"], 2), i["rows"])
                       for i in sorted(info, key=lambda x: x["index"])])
    print(json.dumps(row), flush=True)
    return fp


def main(argv: list[str]) -> int:
    n, reps = int(argv[0]), int(argv[1])
    root = Path(tempfile.mkdtemp(prefix="c9q-", dir=os.environ.get("C9Q_DIR")))
    base = root / "L0"
    (base / "blob").mkdir(parents=True)

    t = time.perf_counter()
    client = _client_of(base)
    shard = _write_shard(client, n, seed=1)
    client.close()
    print(f"# wrote {n} in {time.perf_counter() - t:.1f} s at {root}", flush=True)
    apps = os.environ.get("C9Q_APPS", "old,new,old,new").split(",")
    clones = [root / f"c{i}" for i in range(len(apps) * 3 * reps)]
    for c in clones:
        _clone(base, c)
    fps = []
    left = iter(clones)
    with StandaloneCluster(str(root / "cluster"), workers=2, cores=1) as cluster:
        for app in apps:
            t0 = time.perf_counter()
            spark = ps.local_spark_session(cluster.master_url, app_name="c9q", prestart=False,
                                           extra={"spark.executor.memory": "1g",
                                                  "spark.driver.host": "127.0.0.1",
                                                  "spark.driver.bindAddress": "127.0.0.1",
                                                  **({"spark.executorEnv.NUMPY_MADVISE_HUGEPAGE":
                                                      "1"} if app in ("old", "base") else {})})
            spark.sparkContext.setLogLevel("ERROR")
            session = time.perf_counter() - t0
            pre = ps.prestart_workers(spark, heap_bytes=0 if app in ("cold", "base") else 256 << 20)
            print(f"# app {app}: session {session:.1f} s prestart {pre:.1f} s", flush=True)
            for rep in range(reps):
                for kind in ("one", "cluster", "one_nohp"):
                    where = next(left)
                    fps.append(_one(spark, kind, where, shard, app, rep))
            spark.stop()
            del spark
            from pyspark import SparkContext
            SparkContext._active_spark_context = None
        print(json.dumps({"same": all(f == fps[0] for f in fps)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
