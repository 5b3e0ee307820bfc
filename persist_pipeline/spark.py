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

import functools
import itertools
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persist_pipeline.blob import open_blob, redact_uri
from persist_pipeline.blob.base import Blob
from persist_pipeline.compaction import (
    CompactionMetrics,
    KeyRange,
    MergeReq,
    MergeRes,
    apply_merge_result,
    inputs_replaced,
    merge_requests,
)
from persist_pipeline.compaction import run_merge as _run_merge
from persist_pipeline.config import COMPACTION_MEMORY_BOUND_BYTES
from persist_pipeline.exceptions import (
    InvalidConfig,
    PersistError,
    ShardNotFound,
    VersionMismatch,
)
from persist_pipeline.ids import ShardId, new_token
from persist_pipeline.ids import batch_id as batch_id_of
from persist_pipeline.internal.blobs import ShardBlobs, key_starts, split_keys
from persist_pipeline.internal.compat import check_same_code, code_fingerprint
from persist_pipeline.internal.state import Batch, HollowPart

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from persist_pipeline.client import PersistClient

log = logging.getLogger(__name__)

__all__ = [
    "JIT_OPTIONS",
    "LOOPBACK",
    "SparkCompactionFailed",
    "compact_shards",
    "drive_compaction",
    "is_local_master",
    "local_spark_session",
    "prepare_spark_environment",
    "prestart_workers",
    "register",
    "spark_conf",
]

#: The address a local Spark driver binds to (the machine's other interfaces may be
#: unreachable or firewalled).
LOOPBACK = "127.0.0.1"

#: JVM options of a session's driver and executors: HotSpot's optimizing compiler (C2)
#: only for code that runs hot (tens of thousands of calls, millions of loop
#: iterations), not for Spark's start-up and scheduling code, which runs a few thousand
#: times and is done before C2's work pays off. A compaction session's JVMs only move
#: pickled tasks and results, so on a small machine C2 compiling them competed with the
#: Python workers for the cores: on 2 cores, starting a standalone application (driver
#: and 2 executors) took 11-13 s and 13-14 JVM CPU-s with the defaults and 7-8 s and 9
#: CPU-s with these, and a compaction job's JVM CPU went from 0.5-0.8 to 0.3 CPU-s; a
#: JVM-bound query (an aggregation of 60M rows) ran as fast, its hot loops still
#: reaching C2. Unknown to a non-HotSpot JVM, they are ignored there.
JIT_OPTIONS = ("-XX:+IgnoreUnrecognizedVMOptions -XX:Tier4InvocationThreshold=100000 "
               "-XX:Tier4MinInvocationThreshold=50000 -XX:Tier4CompileThreshold=120000 "
               "-XX:Tier4BackEdgeThreshold=2000000")


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


# --- building a session -------------------------------------------------------------------


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
    The driver's and executors' JVMs take :data:`JIT_OPTIONS` (applied when the JVMs
    start: to a session not started yet); Python workers run numpy without huge pages
    (``NUMPY_MADVISE_HUGEPAGE=0``). ``extra`` is applied last: its own
    ``spark.driver.extraJavaOptions`` or ``spark.executor.extraJavaOptions`` replaces
    them (add :data:`JIT_OPTIONS` to yours to keep them).
    """
    python = python or os.environ.get("PYSPARK_PYTHON") or sys.executable
    conf = {
        "spark.master": master,
        "spark.app.name": app_name,
        "spark.pyspark.python": python,
        "spark.pyspark.driver.python": python,
        "spark.python.worker.reuse": "true",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.extraJavaOptions": JIT_OPTIONS,
        "spark.executor.extraJavaOptions": JIT_OPTIONS,
        # numpy asks the kernel for transparent huge pages for each array of 4 MiB or
        # more; a merge allocates and frees such arrays every round, and each fresh one
        # faulted 2 MiB pages in (compacting memory for them on the spot). Without:
        # 0.2 fewer kernel CPU-s per quarter of an 8M-update merge (1.10 against 1.23
        # CPU-s a task, 15 runs each, alternated).
        "spark.executorEnv.NUMPY_MADVISE_HUGEPAGE": "0",
    }
    if is_local_master(master):
        conf["spark.driver.bindAddress"] = LOOPBACK
        conf["spark.driver.host"] = LOOPBACK
        conf["spark.ui.enabled"] = "false"
    conf.update(extra or {})
    return conf


def local_spark_session(master: str = "local[*]", app_name: str = "persist-pipeline",
                        extra: Mapping[str, str] | None = None,
                        prestart: bool = True) -> SparkSession:
    """Get or create a SparkSession configured by :func:`spark_conf` for ``master`` (any
    master: ``local[*]`` or a cluster's), with its Python workers started
    (:func:`prestart_workers`) unless ``prestart`` is False.

    An existing session in this process is returned as is (Spark allows one per
    process), which is how tests share one session.
    """
    from pyspark.sql import SparkSession

    prepare_spark_environment(master)
    builder = SparkSession.builder
    for key, value in spark_conf(master, app_name, extra=extra).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if prestart:
        prestart_workers(session)
    return session


#: SparkContexts (by application id) whose workers :func:`prestart_workers` started.
_PRESTARTED: set[str] = set()


def prestart_workers(spark: SparkSession, timeout_s: float = 60.0,
                     heap_bytes: int = COMPACTION_MEMORY_BOUND_BYTES) -> float:
    """Pay Spark's cold start before the first compaction: wait for the executors to
    register, then run one small job that starts a Python worker on every executor
    core (workers are reused: ``spark.python.worker.reuse``) and runs a tiny merge in
    each (the imports of pyarrow and this library, the Parquet codecs, and the
    executors' JVM path of Python tasks, all paid once), then has each worker's Arrow
    memory pool grow to ``heap_bytes`` (a merge's memory bound) and give it back.

    Measured on a standalone cluster (2 workers x 1 core) on 2 cores, a 20M-update split
    merge: without this, the first job of a fresh application took 3-5 s longer than the
    next ones: 1.9 s before its first task ran (0.7 s until the executor started the
    Python daemon, 0.5 s until the daemon forked a worker, 0.7 s of the worker's imports
    and unpickling), 1.5 CPU-s of the executors' JVMs on their first Python tasks, and
    0.5 CPU-s more in each worker's first merge. After the tiny merge alone, the first
    job's first task in each worker still took 1.9-2.4 CPU-s against 1.0-1.6 for the
    tasks after it (8M updates, 4 key ranges): kernel time, zeroing the pages (huge
    pages included) that Arrow's allocator (mimalloc) maps for the first time, and keeps
    for later merges. Growing the pool to 256 MiB here (0.35 CPU-s) brought those first
    tasks to 1.1-1.3 CPU-s, and a merge run alone 5 s after it paid no more than later ones
    did. Idempotent per SparkContext; returns the seconds it took (0 when done
    before).
    """
    sc = spark.sparkContext
    app = str(sc.applicationId)
    if app in _PRESTARTED:
        return 0.0
    started = time.monotonic()
    if not is_local_master(str(sc.master)):
        _wait_for_executors(sc, started + timeout_s)
    slots = 2 * max(1, int(sc.defaultParallelism))
    sc.parallelize(range(slots), slots).map(
        functools.partial(_prestart_task, heap_bytes=heap_bytes)).collect()
    _PRESTARTED.add(app)
    return time.monotonic() - started


def _wait_for_executors(sc: Any, deadline: float) -> None:
    """Until some executor registered and none joined for a second (or the deadline):
    a standalone application's executors register after its session is returned."""
    def registered() -> int:
        # The driver counts itself among the block managers.
        return int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1

    seen, since = registered(), time.monotonic()
    while time.monotonic() < deadline and (seen < 1 or time.monotonic() - since < 1.0):
        time.sleep(0.1)
        now = registered()
        if now != seen:
            seen, since = now, time.monotonic()


#: The pieces a prestarted worker grows its memory pool by: the size of a decoded chunk.
_HEAP_CHUNK_BYTES = 4 << 20


def _prestart_task(index: int, heap_bytes: int = 0) -> int:
    """Run on an executor: merge two tiny sorted runs through Parquet in memory, then
    grow the Arrow memory pool to ``heap_bytes``, written to (so mapped), and free it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from persist_pipeline.blob.memory import MemoryBlob
    from persist_pipeline.internal.blobs import PartWriter
    from persist_pipeline.internal.state import Batch, Description
    from persist_pipeline.updates import Updates

    blob = MemoryBlob()
    batches = []
    for n in range(2):
        writer = PartWriter("s0", f"b{n}", blob, "main", 1 << 20)
        writer.write(Updates.coerce([(b"k%d" % i, b"v", n, 1) for i in range(n, 64, 2)]).table())
        parts = writer.finish()
        batches.append(Batch(f"b{n}", Description(n, n + 1, 0), parts, 32))
    res = _run_merge(MergeReq(0, tuple(batches), Description(0, 2, 1)), "s0", blob, None,
                     1 << 20)
    if pa.default_memory_pool().max_memory() < heap_bytes:
        # Allocated by the pool and written by the kernel that fills them: every page is
        # touched once here rather than in the first merge (once a worker: it runs
        # several of these tasks).
        zeros = pa.array(np.zeros(_HEAP_CHUNK_BYTES // 8, dtype=np.int64))
        held = [pc.add(zeros, 1) for _ in range(max(1, heap_bytes // _HEAP_CHUNK_BYTES))]
        del held
    return index + res.output.num_updates


# --- the tasks ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Task:
    """One merge request of one shard (or one key range of it), with what an executor
    needs to run it."""

    index: int
    shard_id: str
    req: MergeReq
    main_uri: str
    wal_uri: str | None
    target_size_bytes: int
    memory_bound_bytes: int = COMPACTION_MEMORY_BOUND_BYTES
    key_range: KeyRange | None = None
    batch_id: str | None = None
    #: Which request of the run this task belongs to (the tasks of a split merge share it).
    request: int = -1
    #: The driver's persist-pipeline (:func:`code_fingerprint`): an executor running
    #: another refuses the task.
    fingerprint: str = ""


@dataclass(frozen=True, slots=True)
class _TaskResult:
    index: int
    shard_id: str
    res: MergeRes | None
    error: str | None
    duration_s: float
    cpu_s: float = 0.0
    #: The executor's persist-pipeline: the driver refuses a result from another.
    fingerprint: str = ""


#: Blob stores opened by this (executor) process, by URI; Python workers are reused.
_OPEN_BLOBS: dict[str, Blob] = {}


def _blob(uri: str) -> Blob:
    blob = _OPEN_BLOBS.get(uri)
    if blob is None:
        blob = _OPEN_BLOBS[uri] = open_blob(uri)
    return blob


def _run_task(task: _Task) -> _TaskResult:
    """Run on an executor: stream the inputs through the merge, write the output parts.

    Every error (a missing or corrupt part, an unreachable store, running out of
    memory, a bug) is returned, not raised, with its type and message, so it fails
    this merge only and the other shards' results still commit.
    """
    started, cpu = time.monotonic(), time.process_time()
    try:
        check_same_code(task.fingerprint, "driver", "executor")
        wal = _blob(task.wal_uri) if task.wal_uri else None
        res = _run_merge(task.req, task.shard_id, _blob(task.main_uri), wal,
                         task.target_size_bytes, task.memory_bound_bytes,
                         key_range=task.key_range, batch_id=task.batch_id)
    except Exception as e:
        return _TaskResult(task.index, task.shard_id, None, f"{type(e).__name__}: {e}",
                           time.monotonic() - started, time.process_time() - cpu,
                           code_fingerprint())
    return _TaskResult(task.index, task.shard_id, res, None, time.monotonic() - started,
                       time.process_time() - cpu, code_fingerprint())


#: Parquet footers the driver reads at once to choose a split merge's key ranges.
_FOOTER_READERS = 8


def split_points(req: MergeReq, splits: int, blobs: ShardBlobs | None = None) -> list[bytes]:
    """Up to ``splits - 1`` keys that cut ``req``'s inputs into key ranges of about equal
    bytes, chosen among the lowest keys of its parts' row groups (read from the Parquet
    footers when ``blobs`` is given, else of the parts), weighted by size; none when a
    part does not record its key bounds (written before they were recorded)."""
    if splits < 2:
        return []
    parts = [(batch.id, part) for batch in req.inputs for part in batch.hollow_parts()]
    if any(part.min_key is None for _, part in parts):
        return []
    if blobs is None:
        return split_keys([(part.min_key or b"", part.encoded_size) for _, part in parts],
                          splits)

    def starts_of(item: tuple[str, HollowPart]) -> list[tuple[bytes, int]]:
        return key_starts(blobs, item[1], f"batch {item[0]}")

    # A footer is one or two ranged reads, and no task starts before the driver has
    # them all: read one after the other from S3 (20-50 ms a request) the footers of 20
    # parts took 0.45-0.95 s of every split merge's job, read 8 at a time 0.1-0.17 s.
    with ThreadPoolExecutor(max_workers=_FOOTER_READERS,
                            thread_name_prefix="persist-split") as pool:
        starts = [s for found in pool.map(starts_of, parts) for s in found]
    return split_keys(starts, splits)


def _check_uri(uri: str, what: str) -> None:
    if uri.strip().lower().startswith("mem://"):
        raise InvalidConfig(
            f"{what} {redact_uri(uri)!r} is an in-memory store, which Spark tasks (other "
            "processes) cannot reach: use file:///absolute/dir or s3://bucket/prefix")


# --- the driver ---------------------------------------------------------------------------


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
        ``spark_tasks``, ``task_s`` (seconds spent in this shard's tasks), ``task_cpu_s``
        (the CPU seconds of those tasks' processes meanwhile),
        ``spark_jobs`` (0 or 1, the same for every shard: one job serves them all),
        ``spark_job_group`` (the Spark job group of that job, "" if none),
        ``plan_s`` / ``run_s`` / ``commit_s`` (the run's wall time on the driver:
        reading states and split points, the Spark job, committing; the same for every
        shard), ``failed_tasks`` and ``found`` (False for a shard that does not exist).

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
            try:
                results = sc.parallelize(tasks, numSlices=slices).map(_run_task).collect()
            except Exception as e:
                # The job failed as a whole: run each task as its own job, so only the
                # merges whose own task kills its executor fail.
                log.warning("compaction job %s failed (%s); running its %d task(s) one job "
                            "each", group, str(e).splitlines()[0][:300], len(tasks))
                results = [_run_alone(sc, task) for task in tasks]
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        log.info("compaction job %s: %d task(s) in %d slice(s)", group, len(tasks), slices)
        return results, group

    return drive_compaction(on_spark, client, shards, blob_uri=blob_uri,
                            wal_blob_uri=wal_blob_uri,
                            max_splits=max(1, 2 * spark.sparkContext.defaultParallelism))


#: How a task's error starts when an input could not be read: CorruptPart and its
#: subclasses (as returned by :func:`_run_task`: the type's name first).
_UNREADABLE_INPUT = ("CorruptPart", "PartMissing", "PartChecksumMismatch")


def _foreign(result: _TaskResult) -> str | None:
    """Why the driver refuses ``result``: an executor of another persist-pipeline ran
    it (its parts are then deleted, never committed); None when it did not."""
    try:
        # Unset in a result from a version without the field: getattr's default.
        check_same_code(getattr(result, "fingerprint", None), "executor", "driver")
    except VersionMismatch as e:
        return f"VersionMismatch: {e}"
    return None


def _run_alone(sc: Any, task: _Task) -> _TaskResult:
    """One task as its own Spark job; a failed job becomes this task's error."""
    try:
        result: _TaskResult = sc.parallelize([task], numSlices=1).map(_run_task).collect()[0]
        return result
    except Exception as e:
        first = next((line for line in str(e).splitlines() if "Error" in line),
                     str(e).splitlines()[0] if str(e) else type(e).__name__)
        return _TaskResult(task.index, task.shard_id, None,
                           f"SparkTaskFailed: the executor running this merge failed: "
                           f"{first.strip()[:500]}", 0.0)


TaskRunner = Callable[[list[_Task]], tuple[list[_TaskResult], str]]


def _split_or_not(req: MergeReq, splits: int, blobs: ShardBlobs) -> list[bytes]:
    """:func:`split_points`, or no split when an input part cannot be read (replaced
    and collected meanwhile, or unreachable): the task then meets the same problem and
    reports it for this merge alone."""
    try:
        return split_points(req, splits, blobs)
    except PersistError as e:
        log.info("not splitting a merge of %s: %s", req.input_ids, e)
        return []


def _combine(req: MergeReq, outputs: list[MergeRes]) -> MergeRes:
    """One merge result from the results of a request's key-range tasks (in key order:
    their ranges are disjoint and ascending, so their parts form one sorted run)."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0].output
    parts = tuple(p for res in outputs for p in res.output.parts)
    return MergeRes(req.input_ids, Batch(first.id, req.desc, parts,
                                         sum(res.output.num_updates for res in outputs)))


def _delete_parts(client: PersistClient, res: MergeRes) -> None:
    for part in res.output.hollow_parts():
        try:
            client.blobs.main.delete(part.key)
        except PersistError as e:  # GC's orphan sweep removes it later
            log.warning("could not delete unused compaction output %s: %s", part.key, e)


def drive_compaction(
    run_tasks: TaskRunner,
    client: PersistClient,
    shards: Iterable[ShardId | str],
    *,
    blob_uri: str,
    wal_blob_uri: str | None = None,
    max_splits: int = 1,
) -> dict[str, dict[str, Any]]:
    """The driver's side of :func:`compact_shards`, for any way of running the tasks.

    Plans one task per pending merge request, or, for a request of more than
    ``compaction_split_bytes`` of input, one per key range (at most ``max_splits``),
    hands them all to ``run_tasks`` (which returns their results and a job label), and
    commits each request's result from here, once: the outputs of a split request's
    tasks are disjoint sorted runs in key order and form one batch. A request any of
    whose tasks failed commits nothing, and its other tasks' outputs are deleted.
    """
    started = time.monotonic()
    # On the driver's monotonic clock, before any output exists: their commit deadline.
    started_s = client.clock.monotonic()
    target = client.config.blob_target_size_bytes
    metrics: dict[str, CompactionMetrics] = {}
    extra: dict[str, dict[str, Any]] = {}
    tasks: list[_Task] = []
    requests: list[tuple[str, MergeReq]] = []
    config = client.config
    for shard in shards:
        shard_id = str(ShardId.parse(shard))
        if shard_id in metrics:
            continue
        try:
            state = client._machine(shard_id).fetch_latest()
        except ShardNotFound:
            metrics[shard_id] = CompactionMetrics()
            extra[shard_id] = {"found": False, "spark_tasks": 0, "task_s": 0.0,
                               "task_cpu_s": 0.0}
            continue
        reqs = merge_requests(state)
        metrics[shard_id] = CompactionMetrics(requests=len(reqs),
                                              inline_bytes_before=state.inline_bytes)
        extra[shard_id] = {"found": True, "spark_tasks": 0, "task_s": 0.0, "task_cpu_s": 0.0,
                           "split_requests": 0}
        for req in reqs:
            request = len(requests)
            requests.append((shard_id, req))
            splits = min(max_splits, -(-req.encoded_bytes // config.compaction_split_bytes))
            points = _split_or_not(req, splits, client.blobs) if splits > 1 else []
            bounds: list[bytes | None] = [None, *points, None]
            batch_id = batch_id_of(new_token())
            for lower, upper in itertools.pairwise(bounds):
                tasks.append(_Task(len(tasks), shard_id, req, blob_uri, wal_blob_uri or None,
                                   target, config.compaction_memory_bound_bytes,
                                   KeyRange(lower, upper) if points else None,
                                   batch_id if points else None, request,
                                   code_fingerprint()))
            extra[shard_id]["spark_tasks"] += len(points) + 1
            extra[shard_id]["split_requests"] += 1 if points else 0

    results: list[_TaskResult] = []
    group = ""
    planned = time.monotonic()
    if tasks:
        results, group = run_tasks(tasks)
    ran = time.monotonic()

    failures: dict[str, list[str]] = {}
    by_request: dict[int, list[_TaskResult]] = {}
    for result in sorted(results, key=lambda r: r.index):
        extra[result.shard_id]["task_s"] += result.duration_s
        extra[result.shard_id]["task_cpu_s"] += result.cpu_s
        by_request.setdefault(tasks[result.index].request, []).append(result)
    for request, (shard_id, req) in enumerate(requests):
        parts = by_request.get(request, [])
        errors = [r.error or "unknown error" for r in parts if r.res is None]
        errors += [why for r in parts if r.res is not None and (why := _foreign(r))]
        if len(parts) != sum(1 for t in tasks if t.request == request):
            errors.append("Spark returned no result for some of its tasks")
        outputs = [r.res for r in parts if r.res is not None]
        if errors:
            # Never committed, so certainly unreferenced: the finished ranges' parts go.
            for res in outputs:
                _delete_parts(client, res)
            # Unreadable inputs (missing or corrupt parts, as the in-process merge's
            # ``except CorruptPart`` catches them) whose batches a newer state no longer
            # holds: the request is obsolete, not failed.
            if all(e.startswith(_UNREADABLE_INPUT) for e in errors) and \
                    inputs_replaced(client._machine(shard_id), req):
                metrics[shard_id].obsolete += 1
                continue
            failures.setdefault(shard_id, []).extend(errors)
            continue
        res = _combine(req, outputs)
        try:
            outcome = apply_merge_result(client._machine(shard_id), res, started_s)
        except PersistError as e:  # this result only; the other shards' still commit
            failures.setdefault(shard_id, []).append(f"{type(e).__name__}: {e}")
            continue
        metrics[shard_id].record(req, res, outcome)

    finished = time.monotonic()
    duration = finished - started
    # Where the run's wall time went, the same for every shard (like duration_s).
    phases = {"plan_s": planned - started, "run_s": ran - planned, "commit_s": finished - ran}
    out: dict[str, dict[str, Any]] = {}
    for shard_id, m in metrics.items():
        if extra[shard_id]["found"]:
            m.inline_bytes_after = client._machine(shard_id).fetch_latest().inline_bytes
        m.duration_s = duration
        out[shard_id] = {**m.as_dict(), **extra[shard_id], "spark_jobs": 1 if tasks else 0,
                         "spark_job_group": group, **phases,
                         "failed_tasks": len(failures.get(shard_id, []))}
    if failures:
        raise SparkCompactionFailed(failures, out)
    return out


def register(spark: SparkSession) -> None:
    """Register the ``persist`` data source (read and write) on ``spark``: see
    :mod:`persist_pipeline.spark_source`."""
    from persist_pipeline.spark_source import register as register_source

    register_source(spark)
