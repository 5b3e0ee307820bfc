"""Compaction on Spark: one Spark job per compaction run, across every shard that needs it.

The driver reads each shard's pending merge requests (:func:`merge_requests`), ships
every ``(shard, MergeReq)`` pair to the cluster as one task of a single Spark job
(``parallelize(...).map(...).collect()``), and commits each :class:`MergeRes` it gets
back with :func:`apply_merge_result`. Only the driver talks to consensus. Tasks open the
blob stores themselves from their URIs with :func:`~persist_pipeline.blob.open_blob` and
run the engine-agnostic :func:`run_merge`, so S3, MinIO and local folders all work
without any Hadoop S3 connector, and the same code runs in ``local[*]`` and on a cluster.

PySpark is imported lazily inside functions: the rest of the library (and this module)
stays importable without it.

On this kind of machine Spark must bind to loopback and run the virtualenv's Python:
:func:`local_spark_session` (or :func:`prepare_spark_environment` plus
:func:`spark_conf` for a session built elsewhere) takes care of it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persist_pipeline.blob import open_blob, redact_uri
from persist_pipeline.blob.base import Blob
from persist_pipeline.compaction import (
    CompactionMetrics,
    MergeReq,
    MergeRes,
    apply_merge_result,
    inputs_replaced,
    merge_requests,
)
from persist_pipeline.compaction import run_merge as _run_merge
from persist_pipeline.exceptions import InvalidConfig, PersistError, ShardNotFound
from persist_pipeline.ids import ShardId

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from persist_pipeline.client import PersistClient

log = logging.getLogger(__name__)

__all__ = [
    "LOOPBACK",
    "SparkCompactionFailed",
    "compact_shards",
    "drive_compaction",
    "is_local_master",
    "local_spark_session",
    "prepare_spark_environment",
    "register",
    "spark_conf",
]

#: The address a local Spark driver binds to (the machine's other interfaces may be
#: unreachable or firewalled).
LOOPBACK = "127.0.0.1"


class SparkCompactionFailed(PersistError):
    """Some merge tasks failed; the results of the others were committed.

    Attributes:
        failures: ``{shard_id: [error message, ...]}`` of the failed tasks.
        metrics: the per-shard metrics of the whole run (as :func:`compact_shards`).
    """

    def __init__(self, failures: Mapping[str, list[str]],
                 metrics: Mapping[str, dict[str, Any]]) -> None:
        shown = "; ".join(f"shard {s}: {msgs[0]}" + (f" (+{len(msgs) - 1} more)"
                                                      if len(msgs) > 1 else "")
                          for s, msgs in sorted(failures.items()))
        super().__init__(f"{sum(len(m) for m in failures.values())} compaction task(s) "
                         f"failed: {shown}")
        self.failures = dict(failures)
        self.metrics = dict(metrics)


# --- building a session ------------------------------------------------------------------


def is_local_master(master: str) -> bool:
    """Whether ``master`` runs Spark inside this machine (``local``, ``local[*]``, ...)."""
    return master.strip().lower().startswith("local")


def prepare_spark_environment(master: str = "local[*]", python: str | None = None) -> None:
    """Set the environment a Spark driver reads when it starts (before the first session).

    ``PYSPARK_PYTHON`` / ``PYSPARK_DRIVER_PYTHON`` default to ``python`` (this
    interpreter), so Python workers can import what is installed in this environment; for
    a local master, ``SPARK_LOCAL_IP`` defaults to loopback. Variables already set are
    kept.
    """
    python = python or sys.executable
    os.environ.setdefault("PYSPARK_PYTHON", python)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", python)
    if is_local_master(master):
        os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)


def spark_conf(master: str = "local[*]", app_name: str = "persist-pipeline",
               python: str | None = None,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Spark configuration of a compaction session for ``master``.

    A local master binds the driver to loopback; a cluster master (``spark://``,
    ``k8s://``, ``yarn``) keeps Spark's defaults so executors can reach the driver.
    ``extra`` is applied last.
    """
    python = python or os.environ.get("PYSPARK_PYTHON") or sys.executable
    conf = {
        "spark.master": master,
        "spark.app.name": app_name,
        "spark.pyspark.python": python,
        "spark.pyspark.driver.python": python,
        "spark.python.worker.reuse": "true",
        "spark.ui.showConsoleProgress": "false",
    }
    if is_local_master(master):
        conf["spark.driver.bindAddress"] = LOOPBACK
        conf["spark.driver.host"] = LOOPBACK
        conf["spark.ui.enabled"] = "false"
    conf.update(extra or {})
    return conf


def local_spark_session(master: str = "local[*]", app_name: str = "persist-pipeline",
                        extra: Mapping[str, str] | None = None) -> SparkSession:
    """Get or create a SparkSession configured by :func:`spark_conf` for ``master``.

    An existing session in this process is returned as is (Spark allows one per
    process), which is how tests share one session.
    """
    from pyspark.sql import SparkSession

    prepare_spark_environment(master)
    builder = SparkSession.builder
    for key, value in spark_conf(master, app_name, extra=extra).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


# --- the tasks ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Task:
    """One merge request of one shard, with what an executor needs to run it."""

    index: int
    shard_id: str
    req: MergeReq
    main_uri: str
    wal_uri: str | None
    target_size_bytes: int


@dataclass(frozen=True, slots=True)
class _TaskResult:
    index: int
    shard_id: str
    res: MergeRes | None
    error: str | None
    duration_s: float


#: Blob stores opened by this (executor) process, by URI; Python workers are reused.
_OPEN_BLOBS: dict[str, Blob] = {}


def _blob(uri: str) -> Blob:
    blob = _OPEN_BLOBS.get(uri)
    if blob is None:
        blob = _OPEN_BLOBS[uri] = open_blob(uri)
    return blob


def _run_task(task: _Task) -> _TaskResult:
    """Run on an executor: fetch the inputs, consolidate, write the output parts.

    Persist errors (a missing or corrupt part, an unreachable store) are returned, not
    raised, so one bad shard does not fail the others' results.
    """
    started = time.monotonic()
    try:
        wal = _blob(task.wal_uri) if task.wal_uri else None
        res = _run_merge(task.req, task.shard_id, _blob(task.main_uri), wal,
                         task.target_size_bytes)
    except PersistError as e:
        return _TaskResult(task.index, task.shard_id, None, f"{type(e).__name__}: {e}",
                           time.monotonic() - started)
    return _TaskResult(task.index, task.shard_id, res, None, time.monotonic() - started)


def _check_uri(uri: str, what: str) -> None:
    if uri.strip().lower().startswith("mem://"):
        raise InvalidConfig(
            f"{what} {redact_uri(uri)!r} is an in-memory store, which Spark tasks (other "
            "processes) cannot reach: use file:///absolute/dir or s3://bucket/prefix")


# --- the driver --------------------------------------------------------------------------


def compact_shards(
    spark: SparkSession,
    client: PersistClient,
    shards: Iterable[ShardId | str],
    *,
    blob_uri: str,
    wal_blob_uri: str | None = None,
    num_slices: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Compact ``shards`` with one Spark job; commit every result from this driver.

    Every pending merge request of every shard (which includes flushing each inline
    part to the main blob store) becomes one task. Shards without pending work, and
    shards that do not exist, start no task. No job is started when nothing is pending.

    Args:
        spark: the session whose SparkContext runs the job.
        client: the persist location (the driver's consensus and blob stores).
        shards: the shards to compact.
        blob_uri: the URI of ``client``'s main blob store, re-opened by the tasks.
        wal_blob_uri: the URI of its WAL blob store, if it has one.
        num_slices: Spark partitions (default: one per task, at most twice the default
            parallelism).

    Returns:
        ``{shard_id: metrics}``, each like :func:`~persist_pipeline.compaction.compact_shard`'s
        dict (``duration_s`` and ``rows_per_s`` are of the whole run) plus
        ``spark_tasks``, ``task_s`` (seconds spent in this shard's tasks),
        ``spark_jobs`` (0 or 1, the same for every shard: one job serves them all),
        ``spark_job_group`` (the Spark job group of that job, "" if none),
        ``failed_tasks`` and ``found`` (False for a shard that does not exist).

    Raises:
        InvalidConfig: a blob URI is ``mem://`` (unreachable from executors).
        SparkCompactionFailed: some tasks failed; the others' results were committed.
    """
    _check_uri(blob_uri, "blob URI")
    if wal_blob_uri:
        _check_uri(wal_blob_uri, "WAL blob URI")

    def on_spark(tasks: list[_Task]) -> tuple[list[_TaskResult], str]:
        sc = spark.sparkContext
        slices = num_slices or min(len(tasks), max(1, 2 * sc.defaultParallelism))
        group = f"persist-compaction-{uuid.uuid4().hex[:12]}"
        sc.setJobGroup(group, f"persist compaction: {len(tasks)} merge(s) over "
                              f"{len({t.shard_id for t in tasks})} shard(s)")
        try:
            results = sc.parallelize(tasks, numSlices=slices).map(_run_task).collect()
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        log.info("compaction job %s: %d task(s) in %d slice(s)", group, len(tasks), slices)
        return results, group

    return drive_compaction(on_spark, client, shards, blob_uri=blob_uri,
                            wal_blob_uri=wal_blob_uri)


TaskRunner = Callable[[list[_Task]], tuple[list[_TaskResult], str]]


def drive_compaction(
    run_tasks: TaskRunner,
    client: PersistClient,
    shards: Iterable[ShardId | str],
    *,
    blob_uri: str,
    wal_blob_uri: str | None = None,
) -> dict[str, dict[str, Any]]:
    """The driver's side of :func:`compact_shards`, for any way of running the tasks.

    Plans one task per pending merge request, hands them all to ``run_tasks`` (which
    returns their results and a job label), and commits each result from here.
    """
    started = time.monotonic()
    started_ms = client.clock.now_ms()  # before any output exists: their commit deadline
    target = client.config.blob_target_size_bytes
    metrics: dict[str, CompactionMetrics] = {}
    extra: dict[str, dict[str, Any]] = {}
    tasks: list[_Task] = []
    for shard in shards:
        shard_id = str(ShardId.parse(shard))
        if shard_id in metrics:
            continue
        try:
            state = client.machine(shard_id).fetch_latest()
        except ShardNotFound:
            metrics[shard_id] = CompactionMetrics()
            extra[shard_id] = {"found": False, "spark_tasks": 0, "task_s": 0.0}
            continue
        reqs = merge_requests(state)
        metrics[shard_id] = CompactionMetrics(requests=len(reqs),
                                              inline_bytes_before=state.inline_bytes)
        extra[shard_id] = {"found": True, "spark_tasks": len(reqs), "task_s": 0.0}
        for req in reqs:
            tasks.append(_Task(len(tasks), shard_id, req, blob_uri, wal_blob_uri or None,
                               target))

    results: list[_TaskResult] = []
    group = ""
    if tasks:
        results, group = run_tasks(tasks)

    failures: dict[str, list[str]] = {}
    for result in sorted(results, key=lambda r: r.index):
        task = tasks[result.index]
        extra[task.shard_id]["task_s"] += result.duration_s
        if result.res is None:
            if (result.error or "").startswith("CorruptPart") and \
                    inputs_replaced(client.machine(task.shard_id), task.req):
                metrics[task.shard_id].obsolete += 1
                continue
            failures.setdefault(task.shard_id, []).append(result.error or "unknown error")
            continue
        try:
            outcome = apply_merge_result(client.machine(task.shard_id), result.res, started_ms)
        except PersistError as e:  # this result only; the other shards' still commit
            failures.setdefault(task.shard_id, []).append(f"{type(e).__name__}: {e}")
            continue
        metrics[task.shard_id].record(task.req, result.res, outcome)

    duration = time.monotonic() - started
    out: dict[str, dict[str, Any]] = {}
    for shard_id, m in metrics.items():
        if extra[shard_id]["found"]:
            m.inline_bytes_after = client.machine(shard_id).fetch_latest().inline_bytes
        m.duration_s = duration
        out[shard_id] = {**m.as_dict(), **extra[shard_id], "spark_jobs": 1 if tasks else 0,
                         "spark_job_group": group,
                         "failed_tasks": len(failures.get(shard_id, []))}
    if failures:
        raise SparkCompactionFailed(failures, out)
    return out


def register(spark: SparkSession) -> None:
    """Register the ``persist`` data source (read and write) on ``spark``: see
    :mod:`persist_pipeline.spark_source`."""
    from persist_pipeline.spark_source import register as register_source

    register_source(spark)
