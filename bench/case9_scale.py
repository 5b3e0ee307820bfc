"""Case 9: one large merge in bounded memory, and one merge spread over Spark tasks.

The data: ``N`` updates (16-byte keys, 64-byte values, diffs of +-1) in 4 sorted batches
of 64 MiB Parquet parts whose keys overlap by half
(:mod:`persist_pipeline.examples.merge_data`), so the merge consolidates and cancels.

- **ours**: :func:`persist_pipeline.compaction.run_merge` at the default
  ``compaction_memory_bound_bytes`` (256 MiB), one process, one core;
- **DuckDB** (``memory_limit='2GB'``, its default threads, spilling to a temp folder):
  the same consolidation of the same Parquet parts in one SQL statement
  (``GROUP BY k, v, greatest(t, since) HAVING sum(d) <> 0 ORDER BY k, v, t``, zstd
  Parquet out): the same output, sorted.

Each runs in a fresh process whose peak RSS (``VmHWM``) is reported. Then a shard of
the Spark size is written through the API twice: one copy is compacted by
``client.compact()`` (one process), the other by ``spark.compact_shards`` on ``local[2]``,
which splits the merge by key range into several tasks and commits it once; and a fresh
process streams ``snapshot_batches`` of a copy before compaction (its peak RSS).
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

from bench.common import CaseResult, Scale, Table, Target, ratio, si
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.examples.merge_data import run_table_from_ids, write_runs

TITLE = "One large merge in bounded memory (peak RSS, rows/s) and split over Spark tasks"
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


def _import_library(_: int) -> int:
    """Run on every Python worker before timing: the import is a one-off cost."""
    import persist_pipeline.spark  # noqa: F401

    return 0


def _write_shard(client: PersistClient, n: int, seed: int) -> str:
    """A shard of ``n`` updates in :data:`RUNS` blob batches (as :func:`write_runs`)."""
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
    return str(shard)


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    result = CaseResult("case9", TITLE)
    table = Table("One merge of N updates: ours (bound 256 MiB) beside DuckDB (2 GB)",
                  ["updates", "engine", "seconds", "rows/s", "vs DuckDB", "peak RSS",
                   "rows out"])
    rows: list[dict[str, Any]] = []
    for n in scale.scale_sizes:
        folder = Path(svc.folder(f"c9-runs-{n}"))
        log(f"  {si(n)} updates: writing {RUNS} sorted runs")
        manifest = write_runs(folder, n, RUNS)
        rows_in = int(manifest["rows"])  # type: ignore[call-overload]
        log(f"  {si(n)} updates: ours")
        ours = _json_of(["-m", "persist_pipeline.examples.merge_data", "merge", str(folder),
                         "256"])
        log(f"  {si(n)} updates: DuckDB")
        duck = _json_of(["-c", _DUCKDB, json.dumps(_files(folder)), str(RUNS - 1),
                         str(folder / "duckdb-out.parquet"), svc.folder(f"c9-duck-tmp-{n}")])
        os.remove(folder / "duckdb-out.parquet")
        duck["rows_per_s"] = rows_in / duck["seconds"]
        for engine, m in (("ours", ours), ("duckdb", duck)):
            table.add(si(rows_in), {"ours": "ours: run_merge, 1 process, bound 256 MiB",
                                    "duckdb": "DuckDB, memory_limit 2 GB"}[engine],
                      f"{m['seconds']:.2f}", si(m["rows_per_s"]),
                      ratio(m["rows_per_s"], duck["rows_per_s"]),
                      f"{m['peak_rss_bytes'] / GIB:.2f} GiB", si(m["rows_out"]))
            rows.append({"n": rows_in, "engine": engine, "seconds": m["seconds"],
                         "rows_per_s": m["rows_per_s"], "peak_rss": m["peak_rss_bytes"],
                         "rows_out": m["rows_out"]})
        same = ours["rows_out"] == duck["rows_out"]
        result.targets.append(Target(
            "9", f"peak RSS of one merge of {si(rows_in)} updates <= 1 GiB", "<= 1 GiB",
            f"{ours['peak_rss_bytes'] / GIB:.2f} GiB", ours["peak_rss_bytes"] <= GIB,
            "met" if ours["peak_rss_bytes"] <= GIB else "over"))
        r = ours["rows_per_s"] / duck["rows_per_s"]
        result.targets.append(Target(
            "9", f"merge rows/s of {si(rows_in)} updates >= DuckDB (2 GB)", ">= 1.00x",
            f"{r:.2f}x", r >= 1.0 and same,
            "met" if r >= 1.0 and same else f"missed ({'same' if same else 'DIFFERENT'} "
            f"output row count)"))
        shutil.rmtree(folder, ignore_errors=True)
    rsses = [r["peak_rss"] for r in rows if r["engine"] == "ours"]
    table.notes += [
        f"Peak RSS of ours across sizes: {min(rsses) / GIB:.2f}-{max(rsses) / GIB:.2f} GiB "
        "(flat: the merge holds chunks of runs, one round and the part being written).",
        "Each engine ran once in a fresh process; rows/s = input updates / wall time; "
        "both write sorted zstd Parquet. The output row counts must match.",
    ]
    result.tables.append(table)
    result.data = {"rows": rows}
    _spark_split(svc, scale, result, log)
    return result


def _spark_split(svc: Services, scale: Scale, result: CaseResult,
                 log: Callable[[str], None]) -> None:
    from persist_pipeline.spark import compact_shards, local_spark_session

    n = scale.scale_spark_size
    spark = local_spark_session("local[2]", app_name="persist-bench-scale")
    spark.sparkContext.setLogLevel("ERROR")
    root = Path(svc.folder("c9-spark"))
    (root / "blob").mkdir(exist_ok=True)
    consensus, blob = f"sqlite:///{root}/consensus.db", f"file://{root}/blob"
    # Merges over 64 MiB of input split (the default is 256 MiB): the quick run's
    # 2M-update merge splits too. Tasks per merge: at most twice Spark's parallelism.
    client = PersistClient.open(consensus, blob, config=PersistConfig(
        inline_policy=InlinePolicy(0, 0), compaction_split_bytes=64 << 20))
    table = Table(f"One merge of {si(n)} updates: one process beside Spark key-range tasks",
                  ["what", "seconds", "rows/s", "vs one process", "detail"])
    try:
        log(f"  Spark split: writing three shards of {si(n)} updates")
        local, split, snap = (_write_shard(client, n, seed=s) for s in (1, 1, 1))
        rows_in = sum(b.num_updates for b in client.machine(local).fetch_latest().batches.values())

        log("  Spark split: snapshot_batches in a fresh process")
        streamed = _json_of(["-c", _SNAPSHOT, consensus, blob, snap, str(RUNS - 1)])

        log("  Spark split: client.compact (one process)")
        started = time.perf_counter()
        one = client.compact(local)
        one_s = time.perf_counter() - started

        log("  Spark split: compact_shards on local[2]")
        warm = _write_shard(client, 40_000, seed=9)  # JVM and Python workers warm
        compact_shards(spark, client, [warm], blob_uri=blob)
        parallelism = spark.sparkContext.defaultParallelism
        spark.sparkContext.parallelize(range(4 * parallelism), 4 * parallelism).map(
            _import_library).collect()
        started = time.perf_counter()
        metrics = compact_shards(spark, client, [split], blob_uri=blob)[split]
        split_s = time.perf_counter() - started
        same = client.open_reader(local).snapshot_fingerprint(RUNS - 1) == \
            client.open_reader(split).snapshot_fingerprint(RUNS - 1)
        speedup = one_s / split_s
        table.add("client.compact(): one merge, one process", f"{one_s:.2f}",
                  si(rows_in / one_s), "1.00x", f"{one['parts_out']} parts out")
        table.add("compact_shards() on local[2], split by key range", f"{split_s:.2f}",
                  si(rows_in / split_s), ratio(one_s, split_s),
                  f"{metrics['spark_tasks']} tasks, 1 commit; snapshots equal: {same}")
        table.add("snapshot_batches() before compaction, fresh process",
                  f"{streamed['seconds']:.2f}", si(streamed["rows"] / streamed["seconds"]),
                  "-", f"peak RSS {streamed['peak_rss_bytes'] / GIB:.2f} GiB, "
                       f"{si(streamed['rows'])} rows")
        result.targets.append(Target(
            "9", f"Spark split merge of {si(rows_in)} updates >= 1.6x one process (local[2])",
            ">= 1.60x", f"{speedup:.2f}x", speedup >= 1.6 and same,
            "met" if speedup >= 1.6 and same else f"missed by {1.6 / speedup:.2f}x"))
        result.targets.append(Target(
            "9", f"snapshot_batches of {si(rows_in)} updates <= 1 GiB peak RSS", "<= 1 GiB",
            f"{streamed['peak_rss_bytes'] / GIB:.2f} GiB", streamed["peak_rss_bytes"] <= GIB,
            "met" if streamed["peak_rss_bytes"] <= GIB else "over"))
        result.data["spark"] = {"n": rows_in, "one_process_s": one_s, "split_s": split_s,
                                "tasks": metrics["spark_tasks"], "speedup": speedup,
                                "snapshot_rss": streamed["peak_rss_bytes"],
                                "snapshot_s": streamed["seconds"]}
    finally:
        client.close()
    table.notes.append("The three shards hold the same data; the split run's snapshot "
                       "fingerprint is compared with the one-process run's.")
    result.tables.append(table)
