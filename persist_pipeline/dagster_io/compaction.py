"""Compacting IO-managed shards on Spark, for projects that prefer it to the IO
manager's own in-process compaction (``PersistIOManager(maintenance="external")``).

:func:`compaction_definitions` returns a sensor and a job: the sensor reads every shard's
summary in one consensus query and, when shards registered under a name have pending
merges, requests one run of the job, which compacts them all as the tasks of ONE Spark
job (:func:`persist_pipeline.spark.compact_shards`) and commits from the driver::

    import dagster as dg
    from dagster_pyspark import PySparkResource
    from persist_pipeline.dagster_io import PersistIOManager, compaction_definitions

    io_manager = PersistIOManager(consensus_uri=..., blob_uri=..., maintenance="external")
    defs = dg.Definitions.merge(
        dg.Definitions(assets=[...], resources={"io_manager": io_manager,
                                                "pyspark": PySparkResource(spark_config={})}),
        compaction_definitions())
"""


import json
import time
from typing import Any

import dagster as dg

from persist_pipeline.dagster_io.io_manager import PersistIOManager
from persist_pipeline.dagster_io.templates import expand_env
from persist_pipeline.exceptions import InvalidConfig, LocationNotFound

#: The job and sensor names (prefixed, so they do not clash with a project's own).
JOB_NAME = "persist_io_compaction"
SENSOR_NAME = "persist_io_compaction_sensor"
#: The tag Dagster puts the run key of a sensor's run under.
_RUN_KEY_TAG = "dagster/run_key"


def _run_in_flight(instance: dg.DagsterInstance, run_key: str) -> bool:
    runs = instance.get_runs(filters=dg.RunsFilter(tags={_RUN_KEY_TAG: run_key}), limit=1)
    return bool(runs) and not runs[0].is_finished


def pending_named_shards(io_manager: PersistIOManager) -> dict[str, int]:
    """Shards registered under a name that have pending merges: ``{shard_id: seqno}``.

    Raises:
        LocationNotFound: nothing is stored at the IO manager's URIs (nothing is created:
            a sensor ticking on a mistyped URI must not leave an empty store there).
    """
    client = io_manager.client(create=False)
    named = {str(shard) for shard in client.shard_names().values()}
    return {shard: summary.seqno for shard, summary in client.shard_summaries().items()
            if shard in named and summary.pending_merges}


def compaction_definitions(*, io_manager_key: str = "io_manager",
                           spark_resource_key: str = "pyspark",
                           minimum_interval_seconds: int = 60,
                           retry_after_seconds: int = 600) -> dg.Definitions:
    """A sensor and a Spark job that compact the shards a :class:`PersistIOManager`
    (under ``io_manager_key``) writes, using the ``PySparkResource`` under
    ``spark_resource_key``. Merge the returned ``Definitions`` into the project's.

    A run is keyed by the shards and their seqnos, so the daemon launches it once. When
    the same shards are still pending at the same seqnos ``retry_after_seconds`` after
    it was requested and no run of it is queued or running (it failed before changing
    them), the sensor asks again under a numbered key (``...~1``).

    Raises:
        InvalidConfig: ``minimum_interval_seconds`` is not a positive int or
            ``retry_after_seconds`` is not an int of at least 0.
    """
    for what, value, least in (("minimum_interval_seconds", minimum_interval_seconds, 1),
                               ("retry_after_seconds", retry_after_seconds, 0)):
        # A bool is an int, and a float or a negative number would silently turn the
        # retry of a failed run into a retry on every tick (or none at all).
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidConfig(f"compaction_definitions: {what} must be an int of at least "
                                f"{least}, got {value!r}")

    @dg.op(name=f"{JOB_NAME}_op", required_resource_keys={io_manager_key, spark_resource_key},
           config_schema={"shards": [str]})
    def compact(context: dg.OpExecutionContext) -> dict[str, Any]:
        from persist_pipeline.spark import compact_shards

        io_manager: PersistIOManager = getattr(context.resources, io_manager_key)
        spark = getattr(context.resources, spark_resource_key).spark_session
        client = io_manager.client()
        blob = expand_env(io_manager.blob_uri, what="io_manager.blob_uri").strip()
        wal = expand_env(io_manager.wal_blob_uri, what="io_manager.wal_blob_uri").strip()
        results = compact_shards(spark, client, context.op_config["shards"], blob_uri=blob,
                                 wal_blob_uri=wal or None)
        applied = sum(int(m.get("applied", 0)) for m in results.values())
        context.add_output_metadata({"persist/shards": len(results),
                                     "persist/merges_applied": applied})
        return {shard: {k: v for k, v in m.items() if isinstance(v, int | float | str)}
                for shard, m in results.items()}

    @dg.job(name=JOB_NAME, description="Compact IO-managed persist shards on Spark")
    def job() -> None:
        compact()

    @dg.sensor(name=SENSOR_NAME, job=job, minimum_interval_seconds=minimum_interval_seconds,
               required_resource_keys={io_manager_key},
               description="Requests a Spark compaction of the IO-managed shards with "
                           "pending merges (one summary query per tick)")
    def sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        io_manager: PersistIOManager = getattr(context.resources, io_manager_key)
        try:
            pending = pending_named_shards(io_manager)
        except LocationNotFound as e:
            return dg.SkipReason(f"nothing is stored at the IO manager's URIs yet ({e}): "
                                 "check them if assets were materialized")
        if not pending:
            return dg.SkipReason("no IO-managed shard has pending merges")
        shards = sorted(pending)
        pending_key = ",".join(f"{s}@{pending[s]}" for s in shards)
        last = json.loads(context.cursor) if context.cursor else {}
        now_ms = int(time.time() * 1000)
        attempt = 0
        if last.get("pending") == pending_key:
            # Nothing was written or compacted since the last request: its run is still
            # to come, running, or failed before changing the shards.
            if now_ms - int(last["at_ms"]) < retry_after_seconds * 1000 or \
                    _run_in_flight(context.instance, str(last["run_key"])):
                return dg.SkipReason(f"compaction of these shards requested as "
                                     f"{last['run_key']}; asking again after "
                                     f"{retry_after_seconds} s if it has not changed them")
            attempt = int(last["attempt"]) + 1
        run_key = pending_key + (f"~{attempt}" if attempt else "")
        cursor = json.dumps({"pending": pending_key, "run_key": run_key, "at_ms": now_ms,
                             "attempt": attempt})
        return dg.SensorResult(run_requests=[dg.RunRequest(
            run_key=run_key, run_config={"ops": {f"{JOB_NAME}_op": {"config": {
                "shards": shards}}}})], cursor=cursor)

    return dg.Definitions(jobs=[job], sensors=[sensor])
