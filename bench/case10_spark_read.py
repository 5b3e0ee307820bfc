"""Case 10: reading a shard from Spark, the ``persist`` data source beside plain Parquet.

One shard of ``N`` updates (case 5's data: ``N/4`` keys, diffs +1/-1 that partly cancel)
written as many blob batches and compacted into parts of 8 MiB, plus a few inline
writes; consensus PostgreSQL, parts in a local folder. The same live files (the shard's
read plan at ``as_of``) are read by:

- ours: ``spark.read.format("persist")...load()``: the consolidated collection at
  ``as_of``, key-range partitions read by executors (one per core);
- ``spark.read.parquet`` of the plan's files: the raw rows, NOT consolidated (the floor
  of what reading those files costs in Spark);
- ``spark.read.parquet`` + ``groupBy(k, v).sum(d)``: the same consolidated answer as ours,
  computed by Spark SQL (a shuffle), inline rows excluded.

Every read is forced in full with Spark's ``noop`` sink. rows/s = rows in the plan's
files / wall time. Best of a few runs on a warm session; ours is also checked equal to
``snapshot(as_of)``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from bench.case5_compaction import make_parts
from bench.common import CaseResult, Scale, Table, ratio, si
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId

TITLE = "Spark reads of a shard: the persist data source vs spark.read.parquet (rows/s)"

_SIZES = {"smoke": 4_000, "quick": 300_000, "full": 2_000_000}
_REPS = {"smoke": 1, "quick": 2, "full": 3}


def _build(client: PersistClient, n: int, rows_per_part: int) -> tuple[str, int]:
    """A shard with ``n`` updates compacted into parts, plus inline rows; its as_of."""
    shard = str(ShardId.new())
    parts = make_parts(n, rows_per_part)
    with client.open_writer(shard) as writer:
        for i, part in enumerate(parts):
            writer.compare_and_append(part, i, i + 1)
        client.compact(shard)
        upper = len(parts)
        for t in range(upper, upper + 3):
            writer.compare_and_append([(b"inline-%d" % t, b"x", t, 1)], t, t + 1)
    return shard, upper + 2


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 9 (see the module docstring)."""
    from pyspark.sql import functions as F

    from persist_pipeline.spark import local_spark_session, register

    result = CaseResult("case10", TITLE)
    n = _SIZES[scale.name]
    reps = _REPS[scale.name]
    table = Table(f"Case 10: {TITLE}",
                  ["updates", "files", "engine", "partitions", "seconds", "rows/s",
                   "vs parquet", "output rows"])
    spark = local_spark_session("local[*]", app_name="persist-bench", extra={
        "spark.sql.shuffle.partitions": str(2 * (os.cpu_count() or 1))})
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    master = spark.sparkContext.master
    parallelism = spark.sparkContext.defaultParallelism
    data: list[dict[str, Any]] = []
    with svc.pg.database("c9") as url:
        blob_uri = f"file://{svc.folder('c9-blob')}"
        config = replace(PersistConfig(), blob_target_size_bytes=8 << 20)
        client = PersistClient.open(url, blob_uri, inline_policy=InlinePolicy(),
                                    config=config)
        try:
            log(f"  {si(n)} updates: writing and compacting")
            shard, as_of = _build(client, n, max(1, n // 64))
            reader = client.open_reader(shard)
            plan = reader.snapshot_plan(as_of)
            files = [f.path for f in plan.file_details]
            file_rows = sum(f.num_updates for f in plan.file_details)
            total_bytes = sum(f.size for f in plan.file_details)
            options = {"consensus": url, "blob": blob_uri, "shard": shard,
                       "as_of": str(as_of), "partitions": str(parallelism),
                       "partition_bytes": str(max(1 << 16, total_bytes // parallelism))}

            def ours() -> tuple[Any, int]:
                df = spark.read.format("persist").options(**options).load()
                return df, df.rdd.getNumPartitions()

            def parquet() -> tuple[Any, int]:
                df = spark.read.parquet(*files)
                return df, df.rdd.getNumPartitions()

            def parquet_grouped() -> tuple[Any, int]:
                df = (spark.read.parquet(*files).filter(F.col("t") <= as_of)
                      .groupBy("k", "v").agg(F.sum("d").alias("d")).filter(F.col("d") != 0))
                return df, spark.read.parquet(*files).rdd.getNumPartitions()

            engines = {"ours": ours, "parquet": parquet, "parquet_grouped": parquet_grouped}
            for fn in engines.values():  # warm-up: JVM, Python workers, code paths
                df, _ = fn()
                df.write.format("noop").mode("overwrite").save()
            best: dict[str, tuple[float, int]] = {}
            for rep in range(reps):
                log(f"  {si(n)} updates: run {rep + 1}/{reps}")
                for key, fn in engines.items():
                    started = time.perf_counter()
                    df, partitions = fn()
                    df.write.format("noop").mode("overwrite").save()
                    elapsed = time.perf_counter() - started
                    if key not in best or elapsed < best[key][0]:
                        best[key] = (elapsed, partitions)
            ours_rows = spark.read.format("persist").options(**options).load().collect()
            snap = reader.snapshot(as_of)
            same = sorted((bytes(r.k), bytes(r.v), r.t, r.d) for r in ours_rows) == sorted(
                (r["k"], r["v"], r["t"], r["d"]) for r in snap.to_pylist())
            out_rows = {"ours": len(ours_rows), "parquet": file_rows,
                        "parquet_grouped": parquet_grouped()[0].count()}
            plan.close()
            reader.expire()
        finally:
            client.close()
    labels = {
        "ours": f"ours: format('persist') at as_of, consolidated ({master})",
        "parquet": "spark.read.parquet of the same live files (raw rows, not consolidated)",
        "parquet_grouped": "spark.read.parquet + groupBy(k, v).sum(d) (consolidated, "
                           "files only)",
    }
    base = best["parquet"][0]
    for key in engines:
        seconds, partitions = best[key]
        table.add(si(n), len(files), labels[key], partitions, f"{seconds:.2f}",
                  si(file_rows / seconds), ratio(base, seconds), out_rows[key])
        data.append({"engine": key, "seconds": seconds, "rows_per_s": file_rows / seconds,
                     "partitions": partitions})
    table.notes += [
        f"Spark master {master} (default parallelism {parallelism}); the session was warm. "
        f"Best of {reps} run(s); every read forced in full by the noop sink. {len(files)} "
        f"live Parquet files ({total_bytes / 1e6:.1f} MB, {file_rows} rows) plus 3 inline "
        "rows; rows/s counts the files' rows for every engine.",
        f"Ours equals snapshot(as_of): {'yes' if same else 'NO'}. Our partitions are key "
        "ranges cut at the files' row-group start keys (their footers; a small file's k "
        "column is sampled), and each task streams only the files whose recorded key "
        "range overlaps its own through the bounded k-way merge.",
    ]
    result.tables.append(table)
    result.data = {"rows": data, "same": same}
    return result
