"""Case 9: one large merge in bounded memory, at any number of runs, and one merge
spread over a real Spark standalone cluster.

The data: ``N`` updates (16-byte keys, 64-byte values, diffs of +-1) of four sorted
sources whose keys overlap by half, dealt at random into ``R`` sorted batches of 64 MiB
Parquet parts (:func:`persist_pipeline.examples.merge_data.write_runs`): whatever ``R``,
the merge has the same output, so only the number of runs changes.

- **ours**: :func:`persist_pipeline.compaction.run_merge` at the default
  ``compaction_memory_bound_bytes`` (256 MiB), one process, one core;
- **DuckDB** (``memory_limit='2GB'``, its default threads (2), spilling to a temp
  folder): the same consolidation of the same Parquet parts in one SQL statement
  (``GROUP BY k, v, greatest(t, since) HAVING sum(d) <> 0 ORDER BY k, v, t``, zstd
  Parquet out): the same output, sorted.

Each runs in a fresh process whose peak RSS (``VmHWM``) is reported: the merges of the
scale's cases, and a curve of rows/s against the number of runs at one size.

Then a shard of the Spark size (4 batches) is written through the API once and its
location (SQLite consensus, parts in a folder, hard-linked) cloned: one copy is compacted
by ``client.compact()`` (one process), the others by ``spark.compact_shards`` on a
standalone cluster started here (``spark-class`` master and 2 workers x 1 core on
loopback), which splits the merge by key range into several tasks and commits it once:
the first job of a fresh application without :func:`~persist_pipeline.spark.prestart_workers`
(Spark's cold start), and the first and second jobs of an application with it (as
``local_spark_session`` builds it). A fresh process also streams ``snapshot_batches`` of a
copy before compaction (its peak RSS).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.cluster import StandaloneCluster
from bench.cluster_run import SPLIT_BYTES
from bench.common import CaseResult, Scale, Table, Target, ratio, si
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.examples.merge_data import run_table_from_ids, write_runs
from persist_pipeline.internal.sync import inline_workers

TITLE = ("One large merge at any number of runs (rows/s, peak RSS) and split over a Spark "
         "standalone cluster (cold and warm)")
GIB = 1 << 30
RUNS = 4

_DUCKDB = textwrap.dedent("""
    import json, sys, time
    import duckdb
    from persist_pipeline.examples.merge_data import peak_rss_bytes
    files, since, out, tmp = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    con = duckdb.connect()
    con.execute("SET memory_limit='2GB'")
    con.execute(f"SET temp_directory='{tmp}'")
    listing = ", ".join(f"'{f}'" for f in files)
    started = time.perf_counter()
    con.execute(f"COPY (SELECT k, v, greatest(t, {since}) AS t, sum(d)::BIGINT AS d "
                f"FROM read_parquet([{listing}]) GROUP BY k, v, greatest(t, {since}) "
                f"HAVING sum(d) <> 0 ORDER BY k, v, t) TO '{out}' "
                f"(FORMAT parquet, COMPRESSION zstd)")
    seconds = time.perf_counter() - started
    rows_out = con.execute(f"SELECT count(*) FROM read_parquet('{out}')").fetchone()[0]
    print(json.dumps({"seconds": seconds, "rows_out": rows_out,
                      "peak_rss_bytes": peak_rss_bytes()}))
""")

_SNAPSHOT = textwrap.dedent("""
    import json, sys, time
    from persist_pipeline import PersistClient
    from persist_pipeline.examples.merge_data import peak_rss_bytes
    client = PersistClient.open(sys.argv[1], sys.argv[2])
    reader = client.open_reader(sys.argv[3])
    started = time.perf_counter()
    rows = 0
    for batch in reader.snapshot_batches(int(sys.argv[4])):
        rows += batch.num_rows
    seconds = time.perf_counter() - started
    reader.expire()
    print(json.dumps({"seconds": seconds, "rows": rows,
                      "peak_rss_bytes": peak_rss_bytes()}))
""")


def _json_of(args: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          check=False, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"{args[:2]} failed: {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _files(folder: Path) -> list[str]:
    manifest = json.loads((folder / "manifest.json").read_text())
    return [str(folder / "blobs" / key) for b in manifest["batches"] for key, *_ in b["parts"]]


def _write_shard(client: PersistClient, n: int, seed: int) -> str:
    """A shard of ``n`` updates in :data:`RUNS` blob batches (as :func:`write_runs`), its
    since advanced past them (``RUNS - 1``), so a merge consolidates like the merges
    beside DuckDB."""
    shard = ShardId.new()
    writer = client.open_writer(shard)
    per_run = n // RUNS
    for r in range(RUNS):
        rng = np.random.default_rng(seed * 1000 + r)
        ids = np.flatnonzero(rng.random(2 * per_run) < 0.5).astype(np.uint64)
        table = run_table_from_ids(ids, np.where(rng.random(len(ids)) < 0.7, 1, -1), r)
        writer.compare_and_append(table, r, r + 1)
        del table
    writer.expire()
    reader = client.open_reader(shard)
    reader.downgrade_since(RUNS - 1)
    reader.expire()
    return str(shard)


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    result = CaseResult("case9", TITLE)
    _merges(svc, scale, result, log)
    _spark_split(svc, scale, result, log)
    return result


def _merge_point(svc: Services, n: int, runs: int,
                 log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    folder = Path(svc.folder(f"c9-runs-{n}-{runs}"))
    log(f"  {si(n)} updates in {runs} runs: writing")
    manifest = write_runs(folder, n, runs)
    rows_in = int(manifest["rows"])  # type: ignore[call-overload]
    log(f"  {si(n)} updates in {runs} runs: ours")
    ours = _json_of(["-m", "persist_pipeline.examples.merge_data", "merge", str(folder), "256"])
    log(f"  {si(n)} updates in {runs} runs: DuckDB")
    duck = _json_of(["-c", _DUCKDB, json.dumps(_files(folder)), str(runs - 1),
                     str(folder / "duckdb-out.parquet"), svc.folder(f"c9-duck-tmp-{n}")])
    duck["rows_per_s"] = rows_in / duck["seconds"]
    shutil.rmtree(folder, ignore_errors=True)
    return {"ours": ours, "duckdb": duck, "rows_in": {"n": rows_in}}


def _merges(svc: Services, scale: Scale, result: CaseResult,
            log: Callable[[str], None]) -> None:
    curve_n, curve_runs = scale.merge_curve
    wanted = dict.fromkeys([*scale.merge_cases, *((curve_n, r) for r in curve_runs)])
    points = {key: _merge_point(svc, *key, log) for key in wanted}
    table = Table("One merge of N updates in R sorted runs: ours (bound 256 MiB, 1 core) "
                  "beside DuckDB (2 GB, 2 threads)",
                  ["updates", "runs", "engine", "seconds", "rows/s", "vs DuckDB",
                   "peak RSS", "rows out"])
    rows: list[dict[str, Any]] = []
    for (_, runs), point in points.items():
        rows_in = point["rows_in"]["n"]
        for engine in ("ours", "duckdb"):
            m = point[engine]
            rows.append({"n": rows_in, "runs": runs, "engine": engine, "seconds": m["seconds"],
                         "rows_per_s": m["rows_per_s"], "peak_rss": m["peak_rss_bytes"],
                         "rows_out": m["rows_out"], "cpu_s": m.get("cpu_seconds")})
    for n, runs in scale.merge_cases:
        ours, duck = points[(n, runs)]["ours"], points[(n, runs)]["duckdb"]
        rows_in = points[(n, runs)]["rows_in"]["n"]
        for engine, m in (("ours", ours), ("duckdb", duck)):
            table.add(si(rows_in), runs, {"ours": "ours: run_merge, 1 process, bound 256 MiB",
                                          "duckdb": "DuckDB, memory_limit 2 GB"}[engine],
                      f"{m['seconds']:.2f}", si(m["rows_per_s"]),
                      ratio(m["rows_per_s"], duck["rows_per_s"]),
                      f"{m['peak_rss_bytes'] / GIB:.2f} GiB", si(m["rows_out"]))
        same = ours["rows_out"] == duck["rows_out"]
        result.targets.append(Target(
            "9", f"peak RSS of one merge of {si(rows_in)} updates in {runs} runs <= 1 GiB",
            "<= 1 GiB", f"{ours['peak_rss_bytes'] / GIB:.2f} GiB",
            ours["peak_rss_bytes"] <= GIB, "met" if ours["peak_rss_bytes"] <= GIB else "over"))
        r = ours["rows_per_s"] / duck["rows_per_s"]
        result.targets.append(Target(
            "9", f"merge rows/s of {si(rows_in)} updates in {runs} runs >= DuckDB (2 GB)",
            ">= 1.00x", f"{r:.2f}x ({si(ours['rows_per_s'])} vs {si(duck['rows_per_s'])})",
            r >= 1.0 and same,
            "met" if r >= 1.0 and same else f"missed ({'same' if same else 'DIFFERENT'} "
            f"output row count)"))
    table.notes += [
        "Each engine ran once in a fresh process; rows/s = input updates / wall time; "
        "both write sorted zstd Parquet. The output row counts must match (and do not "
        "depend on the number of runs: the same updates are dealt into more batches).",
        "Ours is one merge (one task of compaction; Spark spreads merges over cores): "
        "it merges on one thread while a reader thread decodes its inputs and a writer "
        "thread encodes its output (reported: CPU seconds); DuckDB uses both cores of "
        "this machine.",
    ]
    result.tables.append(table)
    curve = Table(f"Rows/s of one merge of {si(curve_n)} updates against the number of "
                  "sorted runs", ["runs", "ours rows/s", "ours CPU s", "ours peak RSS",
                                  "DuckDB rows/s", "ours vs DuckDB"])
    data_curve = []
    for runs in curve_runs:
        ours, duck = points[(curve_n, runs)]["ours"], points[(curve_n, runs)]["duckdb"]
        curve.add(runs, si(ours["rows_per_s"]), f"{ours.get('cpu_seconds', 0.0):.2f}",
                  f"{ours['peak_rss_bytes'] / GIB:.2f} GiB", si(duck["rows_per_s"]),
                  ratio(ours["rows_per_s"], duck["rows_per_s"]))
        data_curve.append({"runs": runs, "ours": ours["rows_per_s"],
                           "duckdb": duck["rows_per_s"], "ours_rss": ours["peak_rss_bytes"]})
    fastest = max(p["ours"] for p in data_curve)
    slowest = min(p["ours"] for p in data_curve)
    curve.notes.append(f"Ours from {si(slowest)} to {si(fastest)} rows/s across "
                       f"{curve_runs[0]}-{curve_runs[-1]} runs (slowest/fastest "
                       f"{slowest / fastest:.2f}); one pass at every count (the fan-in at "
                       "256 MiB is 128 runs).")
    result.tables.append(curve)
    result.data = {"rows": rows, "curve": data_curve, "curve_n": curve_n}


def _clone(source: Path, dest: Path) -> None:
    """A copy of a persist location: the SQLite consensus copied, the parts hard-linked
    (parts are immutable: compaction writes new files, never changes one)."""
    dest.mkdir(parents=True)
    shutil.copy2(source / "consensus.db", dest / "consensus.db")
    for folder, _, files in os.walk(source / "blob"):
        target = dest / "blob" / Path(folder).relative_to(source / "blob")
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.link(Path(folder) / name, target / name)


def _uris(where: Path) -> tuple[str, str]:
    """The consensus and blob URIs of a location cloned under ``where``."""
    return f"sqlite:///{where}/consensus.db", f"file://{where}/blob"


def _client_of(where: Path) -> PersistClient:
    """A client of the location under ``where``, configured as the split merge is run
    (no inlining, the cluster's split size)."""
    consensus, blob = _uris(where)
    return PersistClient.open(consensus, blob, config=PersistConfig(
        inline_policy=InlinePolicy(0, 0), compaction_split_bytes=SPLIT_BYTES))


def _spark_split(svc: Services, scale: Scale, result: CaseResult,
                 log: Callable[[str], None]) -> None:
    n = scale.scale_spark_size
    root = Path(svc.folder("c9-spark"))
    base = root / "L0"
    (base / "blob").mkdir(parents=True)

    table = Table(f"One merge of {si(n)} updates: one process beside a Spark standalone "
                  "cluster (master + 2 workers x 1 core, loopback)",
                  ["what", "seconds", "rows/s", "vs one process", "detail"])
    log(f"  Spark split: writing a shard of {si(n)} updates, cloning its location")
    client = _client_of(base)
    shard = _write_shard(client, n, seed=1)
    rows_in = sum(b.num_updates for b in client._machine(shard).fetch_latest().batches.values())
    client.close()
    clones = {name: root / name for name in ("nostart", "first", "second", "snap",
                                             "onethread")}
    for where in clones.values():
        _clone(base, where)

    log("  Spark split: snapshot_batches in a fresh process")
    streamed = _json_of(["-c", _SNAPSHOT, *_uris(clones["snap"]), shard, str(RUNS - 1)])

    log("  Spark split: client.compact (one process)")
    client = _client_of(base)
    started, cpu = time.perf_counter(), time.process_time()
    one = client.compact(shard)
    one_s, one_cpu = time.perf_counter() - started, time.process_time() - cpu
    expected = client.open_reader(shard).snapshot_fingerprint(RUNS - 1)
    client.close()
    log("  Spark split: client.compact (one process, no reader or writer thread)")
    client = _client_of(clones["onethread"])
    started, cpu = time.perf_counter(), time.process_time()
    with inline_workers():
        alone = client.compact(shard)
    alone_s, alone_cpu = time.perf_counter() - started, time.process_time() - cpu
    same_alone = client.open_reader(shard).snapshot_fingerprint(RUNS - 1) == expected
    client.close()

    def location(where: Path) -> str:
        return "|".join([*_uris(where), shard])

    log("  Spark split: starting a standalone cluster")
    with StandaloneCluster(str(root / "cluster"), workers=2, cores=1) as cluster:
        if scale.name == "smoke":
            # Every code path, one application (a Spark application costs about 14 s
            # of this machine's two cores): its first job runs cold, then the workers
            # are prestarted for the other two. The figures mean nothing at this size.
            log(f"  Spark split: cluster up in {cluster.started_s:.1f} s; one application")
            both = _json_of(["-m", "bench.cluster_run", cluster.master_url, "after-first",
                             *(location(clones[n]) for n in ("nostart", "first", "second"))])
            cold = {"session_s": both["session_s"], "jobs": both["jobs"][:1]}
            warm = {**both, "jobs": both["jobs"][1:]}
            table.notes.append("Smoke run: one application ran the three jobs (the workers "
                               "prestarted after the first).")
        else:
            log(f"  Spark split: cluster up in {cluster.started_s:.1f} s; a cold application")
            cold = _json_of(["-m", "bench.cluster_run", cluster.master_url, "0",
                             location(clones["nostart"])])
            log("  Spark split: a prestarted application, two jobs")
            warm = _json_of(["-m", "bench.cluster_run", cluster.master_url, "1",
                             location(clones["first"]), location(clones["second"])])
    same = True
    for name in ("nostart", "first", "second"):
        c = _client_of(clones[name])
        same = same and c.open_reader(shard).snapshot_fingerprint(RUNS - 1) == expected
        c.close()
    same = same and same_alone
    jobs = {"nostart": cold["jobs"][0], "first": warm["jobs"][0], "second": warm["jobs"][1]}
    table.add("client.compact(): one merge, one process", f"{one_s:.2f}", si(rows_in / one_s),
              "1.00x", f"{one['parts_out']} parts out; {one_cpu:.1f} CPU-s "
              f"({one_cpu / one_s:.2f} cores)")
    table.add("the same on one thread (no reader or writer thread)", f"{alone_s:.2f}",
              si(rows_in / alone_s), ratio(one_s, alone_s),
              f"{alone['parts_out']} parts out; {alone_cpu:.1f} CPU-s; same snapshot: "
              f"{same_alone}")
    labels = {
        "nostart": f"cluster, first job of an application without prestart (session "
                   f"{cold['session_s']:.1f} s)",
        "first": f"cluster, first job after prestart_workers (session "
                 f"{warm['session_s']:.1f} s + prestart {warm['prestart_s']:.1f} s)",
        "second": "cluster, second job of that application",
    }
    for name, label in labels.items():
        job = jobs[name]
        table.add(label, f"{job['seconds']:.2f}", si(rows_in / job["seconds"]),
                  ratio(one_s, job["seconds"]),
                  f"{job['tasks']} tasks ({job['task_s']:.1f} task-s, "
                  f"{job['task_cpu_s']:.1f} CPU-s), 1 commit; plan {job['plan_s']:.2f} s, "
                  f"Spark job {job['run_s']:.2f} s, commit {job['commit_s']:.2f} s")
    table.add("snapshot_batches() before compaction, fresh process",
              f"{streamed['seconds']:.2f}", si(streamed["rows"] / streamed["seconds"]), "-",
              f"peak RSS {streamed['peak_rss_bytes'] / GIB:.2f} GiB, "
              f"{si(streamed['rows'])} rows")
    for name, what in (("first", "first (prestarted) job"), ("second", "second job")):
        speedup = one_s / jobs[name]["seconds"]
        result.targets.append(Target(
            "9", f"Spark split merge of {si(rows_in)} updates, {what}, >= 1.6x one process "
                 "(standalone, 2 x 1 core)", ">= 1.60x", f"{speedup:.2f}x",
            speedup >= 1.6 and same,
            "met" if speedup >= 1.6 and same else
            f"missed by {1.6 / speedup:.2f}x" + ("" if same else " (snapshots DIFFER)")))
    result.targets.append(Target(
        "9", f"snapshot_batches of {si(rows_in)} updates <= 1 GiB peak RSS", "<= 1 GiB",
        f"{streamed['peak_rss_bytes'] / GIB:.2f} GiB", streamed["peak_rss_bytes"] <= GIB,
        "met" if streamed["peak_rss_bytes"] <= GIB else "over"))
    result.data["spark"] = {"n": rows_in, "one_process_s": one_s,
                            "jobs": {k: v["seconds"] for k, v in jobs.items()},
                            "session_s": {"nostart": cold["session_s"],
                                          "first": warm["session_s"]},
                            "prestart_s": warm["prestart_s"], "same": same,
                            "cluster_start_s": cluster.started_s,
                            "snapshot_rss": streamed["peak_rss_bytes"],
                            "snapshot_s": streamed["seconds"]}
    first_commit = {"nostart": cold["session_s"] + jobs["nostart"]["seconds"],
                    "first": warm["session_s"] + warm["prestart_s"] + jobs["first"]["seconds"]}
    result.data["spark"]["first_commit_s"] = first_commit
    table.notes += [
        f"From an application's start to its first commit: {first_commit['nostart']:.1f} s "
        f"without prestart (session + first job), {first_commit['first']:.1f} s with it "
        "(session + prestart + first job): prestart moves Spark's cold start out of the "
        "first job, into the session's start.",
        f"One process merges on one thread while a reader thread decodes its inputs and "
        f"a writer thread encodes its output: it used {one_cpu / one_s:.2f} of this "
        f"machine's 2 cores, so 2 workers x 1 core can gain at most about "
        f"{2 / max(one_cpu / one_s, 1.0):.2f}x over it here; against the same merge on "
        f"one thread the cluster's jobs ran at "
        + ", ".join(f"{alone_s / jobs[k]['seconds']:.2f}x" for k in ("nostart", "first",
                                                                       "second"))
        + " (without prestart, prestarted, second job).",
        "All copies hold the same data (one location cloned); every compacted copy's "
        f"snapshot fingerprint equals the one-process result: {same}.",
        "Each application runs in a process of its own (a fresh driver); session times are "
        "the driver's start and the executors' registration, before any job. Sessions are "
        "local_spark_session's (its JVM options: persist_pipeline.spark.JIT_OPTIONS).",
    ]
    result.tables.append(table)
    shutil.rmtree(root, ignore_errors=True)
