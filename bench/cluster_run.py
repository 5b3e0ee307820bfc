"""``python -m bench.cluster_run MASTER PRESTART LOCATION...``: one Spark application
against a standalone ``MASTER``, compacting the shards of the given locations one job
each, in order; prints JSON with the session's start (and prestart) time and each job's.

Each ``LOCATION`` is ``consensus_uri|blob_uri|shard_id``. ``PRESTART`` is ``1`` to
prestart the Python workers (:func:`persist_pipeline.spark.prestart_workers`) before the
first job, ``0`` for the same session without it, or ``after-first`` to run the first job
cold and prestart before the others (the smoke run's one application covers both paths).
A process of its own, so the application (and its driver) is fresh: its first job is
Spark's cold start. Each job
reports its wall time on the driver split into planning (states, split points), the
Spark job and the commit.
"""

from __future__ import annotations

import json
import sys
import time

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig
from persist_pipeline.spark import (
    JIT_OPTIONS,
    compact_shards,
    local_spark_session,
    prestart_workers,
)

#: What a split merge's tasks need: at most ``2 x cores`` key ranges of 64 MiB or more.
SPLIT_BYTES = 64 << 20


def main(argv: list[str]) -> int:
    master, prestart, locations = argv[0], argv[1], argv[2:]
    if prestart not in ("0", "1", "after-first"):
        raise SystemExit(f"PRESTART must be 0, 1 or after-first, not {prestart!r}")
    extra = {"spark.executor.memory": "1g", "spark.driver.host": "127.0.0.1",
             "spark.driver.bindAddress": "127.0.0.1"}
    if prestart == "after-first":
        # The smoke run (its figures mean nothing at its size): its driver and executors
        # compile with C1 only, sparing the CPU C2 spends on code that then runs a few
        # times, in a test suite whose other worker shares the two cores.
        jvm = f"{JIT_OPTIONS} -XX:TieredStopAtLevel=1"
        extra |= {"spark.driver.extraJavaOptions": jvm, "spark.executor.extraJavaOptions": jvm}
    started = time.perf_counter()
    spark = local_spark_session(master, app_name="persist-bench-cluster", prestart=False,
                                extra=extra)
    spark.sparkContext.setLogLevel("ERROR")
    session_s = time.perf_counter() - started
    prestart_s = prestart_workers(spark) if prestart == "1" else 0.0
    jobs = []
    for i, location in enumerate(locations):
        if i == 1 and prestart == "after-first":
            prestart_s = prestart_workers(spark)
        consensus, blob, shard = location.split("|")
        client = PersistClient.open(consensus, blob, inline_policy=InlinePolicy(0, 0),
                                    config=PersistConfig(compaction_split_bytes=SPLIT_BYTES))
        try:
            job_started = time.perf_counter()
            metrics = compact_shards(spark, client, [shard], blob_uri=blob)[shard]
            jobs.append({"seconds": time.perf_counter() - job_started,
                         "tasks": metrics["spark_tasks"], "task_s": metrics["task_s"],
                         "task_cpu_s": metrics["task_cpu_s"],
                         "applied": metrics["applied"],
                         **{k: metrics[k] for k in ("plan_s", "run_s", "commit_s")}})
        finally:
            client.close()
    spark.stop()
    print(json.dumps({"session_s": session_s, "prestart_s": prestart_s, "jobs": jobs}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
