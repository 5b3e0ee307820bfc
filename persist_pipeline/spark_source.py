"""The ``persist`` data source for PySpark 4 (the Python Data Source API): read and write.

It needs PySpark (the ``spark`` extra), imported where Spark types are built; its
PySpark classes are in :mod:`persist_pipeline.spark_datasource`, which :func:`register`
imports. The functions here import without PySpark, so the deterministic simulation
(``persist-pipeline simulate``, no extra needed) runs the data source's write path.

Register it once per session with :func:`register` (also ``persist_pipeline.spark.register``)::

    from persist_pipeline.spark import register
    register(spark)

    df = (spark.read.format("persist")
          .option("consensus", "postgresql://...").option("blob", "s3://bucket/prefix?...")
          .option("shard", shard_id).option("as_of", 41)      # default: upper - 1
          .load())                           # columns k, v, t, d (typed: its columns, t, d)

    (df.write.format("persist")
       .options(consensus=..., blob=..., shard=shard_id, expected_upper=42, new_upper=50)
       .mode("append").save())

**Reading.** The planner (a Python worker of the driver) opens a leased reader, takes a
:class:`~persist_pipeline.plan.SnapshotPlan` at ``as_of`` and splits the key space into
ranges; each Spark partition reads, from the plan's Parquet parts and inline rows, the
updates of its key range and consolidates them, so the result is exactly
``snapshot(as_of)`` (every ``t == as_of``) and partitions are read by executors in
parallel. With more than one partition the planner first reads the ``k`` column of every
part (for its first and last key, and split points), so that a partition reads only
the parts that overlap its range. ``partition_bytes`` (default 128 MiB of Parquet) sets
how many partitions; ``partitions`` caps them (default 64).

The files stay undeleted while the reader's lease lasts (``lease_seconds``, default the
location's reader lease, 15 minutes): Spark has no hook that ends a read, so the reader
stops heartbeating when planning ends and GC expires it once the lease runs out. A read
that outlasts its lease may fail on a part GC has deleted (never return wrong data): raise
``lease_seconds`` for such reads. Its executors, and its planner reading split points
(whose reader a GC with a clock ahead by more than the lease may expire), then fail with
``LeaseExpired``, not ``PartMissing``. The reader holds ``since`` at ``as_of`` only.

**Typed shards** read as their key and value columns plus ``t`` and ``d`` (Spark's types:
timestamps in microseconds; unsigned integers, ``date64`` and ``time32``, which Spark has
not, as the types that hold their values: :data:`_SPARK_READS_AS`), and writes take
those columns (``d`` optional, 1). A
DataFrame's columns are fixed by ``load()``, its plan by the action that reads it: a
schema that appended nullable value columns in between still reads the loaded columns;
any other change (a shard typed since) is refused with ``SchemaMismatch``. A read at an
``as_of`` before columns were appended has the current columns (those null), as
``snapshot(as_of)``; only a table load pinned to an upper has the columns stored then.

**Writing.** The driver checks the DataFrame's columns as a task checks its rows before
it creates the shard, so a write whose columns the shard cannot
take (text ``k``/``v``, a typed shard's column missing) changes nothing. A new shard
name is created in the driver's commit, in the compare-and-set of the write's batch, so
a write refused earlier (a row only a task meets: a time outside the bounds, a null key)
or by its commit leaves no name behind; a name another writer registered meanwhile
refuses the commit with ``UpperMismatch``, and so does a write to a new name expecting
an upper other than 0 (where its fresh shard starts), when it is planned, before
anything is created. Each task
validates its rows (``k``, ``v`` binary; ``t``, ``d`` long, ``d`` optional: 1 when the
DataFrame has no ``d`` column, as in the CLI's append and ingestion; every
``t`` in ``[expected_upper, new_upper)``), consolidates them and writes Parquet parts to
the blob store (the WAL store if ``wal_blob`` is given); a task holds its partition's
rows in memory while it does (repartition a large DataFrame to bound that). Diffs never
wrap: equal ``(k, v, t)`` in different tasks whose diffs sum beyond 64 bits refuse the
write with ``InvalidUpdates``, as one write holding them would be. The driver
then commits every task's parts as ONE batch with one ``compare_and_append``: all rows
become visible at once, or none. When the driver knows for certain nothing was committed
and nothing can commit the parts any more (the shard's upper moved past
``expected_upper``, a failed task), it deletes them; after a refusal that fences no other
commit of them (the commit deadline passed, the upper still below ``expected_upper``) or
when the outcome cannot be known (a lost reply), the parts are left to GC's orphan
sweep, which deletes them only if no state references them. Only ``mode("append")`` is
accepted.

**Retrying a write.** Each save draws a fresh idempotency token when it is planned: a
save run again is a new write. With option ``idempotency_token`` (1-128 characters
``[A-Za-z0-9_-]``), a save run again with the same token and bounds retries the one
that used it: if that one landed (even merged away by compaction since), the save
succeeds and appends nothing; a token that named a write at another ``expected_upper``
is refused with ``TokenReused``. A commit's refusal is always settled by the batch's
history before any part is deleted (a commit cannot know that no earlier commit of the
same write landed).

Options: ``consensus``, ``blob``, ``wal_blob`` (default to ``PERSIST_CONSENSUS_URI``,
``PERSIST_BLOB_URI``, ``PERSIST_WAL_BLOB_URI`` of the Spark driver's environment),
``shard`` (a shard id or a registered name; a write that commits registers a name that
has no shard yet); reads: ``as_of`` (a time or ``latest``, the default), ``partitions``,
``partition_bytes``, ``lease_seconds``; writes: ``expected_upper``, ``new_upper`` (a
time or ``closed``), ``idempotency_token`` (see *Retrying a write*). Any other option
is refused (``InvalidConfig`` listing the valid ones), never ignored. ``mem://`` stores
are refused: executors are other processes. A read creates nothing: a store that does
not exist (a mistyped URI) is refused with ``ConsensusLocationNotFound`` or
``BlobLocationNotFound``, as by the CLI's reads.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_pipeline.blob import redact_uri
from persist_pipeline.compaction import KeyRange
from persist_pipeline.config import COMPACTION_MEMORY_BOUND_BYTES
from persist_pipeline.consensus.base import CasWrite
from persist_pipeline.exceptions import (
    CommitDeadlineExceeded,
    DiffOverflow,
    InvalidConfig,
    InvalidFrontier,
    InvalidInput,
    InvalidShardId,
    InvalidUpdates,
    LeaseExpired,
    PartMissing,
    PersistError,
    SchemaMismatch,
    ShardNotFound,
)
from persist_pipeline.frontier import Frontier, check_frontier
from persist_pipeline.ids import ShardId, check_token, new_token
from persist_pipeline.ids import batch_id as batch_id_of
from persist_pipeline.ingest import with_default_diff
from persist_pipeline.internal import history
from persist_pipeline.internal.blobs import ShardBlobs, key_starts, split_keys
from persist_pipeline.internal.compat import check_same_code, code_fingerprint
from persist_pipeline.internal.machine import RecordTaken
from persist_pipeline.internal.merge import memory_plan, merge_runs
from persist_pipeline.internal.state import Batch, Description, HollowPart, Store
from persist_pipeline.names import name_record, refuse_new_generation_name
from persist_pipeline.plan import LATEST, PlanFile, SnapshotPlan
from persist_pipeline.schema import ShardSchema, replace_leaf_types
from persist_pipeline.transaction import name_taken
from persist_pipeline.updates import Updates, consolidate, naming_shard, sums_may_wrap
from persist_pipeline.write import check_append_bounds, check_new_shard_bounds, check_times

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

    from persist_pipeline.client import PersistClient

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "SPARK_SCHEMA", "register"]

#: The format name: ``spark.read.format("persist")``.
FORMAT = "persist"
#: The columns of every read and write, as Spark DDL.
SPARK_SCHEMA = "k binary, v binary, t long, d long"
#: What a read partition yields (nullable: Spark's own view of the DDL above).
_ARROW_SCHEMA = pa.schema([("k", pa.binary()), ("v", pa.binary()), ("t", pa.int64()),
                           ("d", pa.int64())])
_DEFAULT_PARTITION_BYTES = 128 << 20
_DEFAULT_MAX_PARTITIONS = 64
_ROWS_PER_BATCH = 65536
#: Keys sampled from a small part to choose split points between partitions.
_SAMPLES_PER_SMALL_PART = 64


#: The Spark setting that makes a Python data source's error one line (the exception's
#: type and message) rather than a Python traceback after Spark's own preamble.
HIDE_TRACEBACK_CONF = "spark.sql.execution.pyspark.udf.hideTraceback.enabled"


def register(spark: SparkSession, *, one_line_errors: bool = True) -> None:
    """Register the ``persist`` format on ``spark`` (idempotent).

    Args:
        one_line_errors: set ``spark.sql.execution.pyspark.udf.hideTraceback.enabled``
            so that the first line of a failed read or write carries persist's message
            (e.g. ``InvalidConfig: unknown option(s) ['asof'] ...``) instead of a
            Python traceback. It applies to the session's Python UDFs too; pass False
            to keep their tracebacks.

    Raises:
        InvalidConfig: a local session's Python workers run an interpreter that cannot
            import pyarrow and this library (build the session with
            :func:`persist_pipeline.spark.local_spark_session`, or set
            ``PYSPARK_PYTHON`` before it starts).
    """
    from persist_pipeline.spark_datasource import PersistDataSource

    _check_local_workers_python(spark.sparkContext.master or "",
                                getattr(spark.sparkContext, "pythonExec", None))
    spark.dataSource.register(PersistDataSource)
    if one_line_errors:
        spark.conf.set(HIDE_TRACEBACK_CONF, "true")


#: What a Spark Python worker must import to run this data source's reads and writes.
_WORKER_IMPORTS = "import pyarrow, persist_pipeline.spark_datasource"


def _check_local_workers_python(master: str, python: str | None) -> None:
    """Refuse, at registration, a local session whose Python workers run an interpreter
    that cannot import this library (a session built without ``PYSPARK_PYTHON``: Spark
    then runs ``python3`` from PATH). Its first read or write would otherwise fail deep
    in Spark with ``No module named 'pyarrow'``. Only a local master is checked: a
    cluster's workers run on other machines, and only an interpreter other than this one
    is started to look (this one imports both).

    Raises:
        InvalidConfig: the workers' interpreter is missing, or cannot import them.
    """
    import shutil
    import subprocess
    import sys

    if not python or not master.startswith("local"):
        return
    found = shutil.which(python)
    if found is not None and os.path.abspath(found) == os.path.abspath(sys.executable):
        return
    how = (f"create the session with persist_pipeline.spark.local_spark_session(), or set "
           f"PYSPARK_PYTHON={sys.executable} before the session starts")
    if found is None:
        raise InvalidConfig(f"this Spark session's Python workers run {python!r}, which is "
                            f"not found: {how}")
    probe = subprocess.run([found, "-c", _WORKER_IMPORTS], capture_output=True, text=True,
                           timeout=120, check=False)
    if probe.returncode != 0:
        missing = (probe.stderr.strip().splitlines() or ["it failed"])[-1]
        raise InvalidConfig(f"this Spark session's Python workers run {found}, which "
                            f"cannot import this library ({missing}): {how}")


# --- options ------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class _Location:
    """Where a shard lives, from a read's or write's options (URIs may hold secrets:
    its repr redacts them)."""

    consensus_uri: str
    blob_uri: str
    wal_blob_uri: str | None
    shard_id: str
    #: A write's new shard name, registered for ``shard_id`` only when the write commits
    #: (names are registered for good: a write refused before then leaves none behind);
    #: empty when the name was registered already or the option was a shard id.
    new_name: str = ""

    def __repr__(self) -> str:
        wal = f", wal_blob={redact_uri(self.wal_blob_uri)!r}" if self.wal_blob_uri else ""
        return (f"_Location(consensus={redact_uri(self.consensus_uri)!r}, "
                f"blob={redact_uri(self.blob_uri)!r}{wal}, shard={self.shard_id})")

    @classmethod
    def from_options(cls, options: Mapping[str, str], *, writing: bool = False,
                     columns: pa.Schema | None = None) -> _Location:
        """The location and shard the options name. ``shard`` is a shard id or a
        registered name (resolved here; for a write, a name that has no shard yet gets a
        fresh shard id and is kept as ``new_name``, registered when the write commits).

        ``columns``: a write's columns, checked as its tasks check their rows before
        the shard is created: a write the shard cannot take changes nothing.

        Raises:
            InvalidConfig: an option this data source does not take (the message lists
                the valid ones), or a missing or in-memory store.
            ShardNameNotFound: a read of a name that no shard has.
            InvalidUpdates / SchemaMismatch: ``columns`` cannot be a write of the shard.
        """
        check_options(options, writing=writing)
        if writing:
            # Before the name is resolved (and created: names are registered for good),
            # so that a write refused for its bounds or token leaves nothing behind.
            write_bounds(options)
            write_token(options)
        opts = {k.lower(): v for k, v in options.items()}
        consensus = opts.get("consensus") or os.environ.get("PERSIST_CONSENSUS_URI")
        blob = opts.get("blob") or os.environ.get("PERSIST_BLOB_URI")
        wal = opts.get("wal_blob") or os.environ.get("PERSIST_WAL_BLOB_URI") or None
        if not consensus or not blob:
            raise InvalidConfig("the persist data source needs options consensus and blob "
                                "(or PERSIST_CONSENSUS_URI / PERSIST_BLOB_URI)")
        for uri, what in ((consensus, "consensus"), (blob, "blob"), (wal, "wal_blob")):
            if uri and uri.strip().lower().startswith("mem://"):
                raise InvalidConfig(f"option {what} names an in-memory store, which Spark "
                                    "executors (other processes) cannot reach: use "
                                    "file:///absolute/dir or s3://bucket/prefix")
        shard = opts.get("shard")
        if not shard:
            raise InvalidConfig("the persist data source needs option shard (a shard id or "
                                "a registered name)")
        try:
            shard_id: str | None = str(ShardId.parse(shard))
        except InvalidShardId:
            shard_id = None
        check = writing and columns is not None
        if shard_id is not None and not check:
            return cls(consensus, blob, wal, shard_id)
        location = cls(consensus, blob, wal, "")
        client = location.client(create=writing)
        new_name = ""
        try:
            if shard_id is None and writing:
                found = client.name_registry.lookup(shard)
                if found is None:
                    # Refused now if it may never be registered; registered at commit.
                    refuse_new_generation_name(client.name_registry, shard)
                    new_name, found = shard, ShardId.new()
                shard_id = str(found)
            if check:
                assert columns is not None
                # Before the shard is created (for good).
                check_write_columns(client, None if new_name else shard_id, columns)
            if shard_id is None:
                shard_id = str(client.resolve(shard))
        finally:
            client.close()
        return cls(consensus, blob, wal, shard_id, new_name)

    def client(self, lease_s: float | None = None, *, create: bool = False
               ) -> PersistClient:
        """A client of the location; only a write creates a missing one (``create``): a
        read of a mistyped URI is reported as no store there, leaving nothing behind.

        Raises:
            ConsensusLocationNotFound / BlobLocationNotFound: no store there and not
                ``create``.
        """
        from persist_pipeline.client import PersistClient
        from persist_pipeline.config import PersistConfig

        config = PersistConfig()
        if lease_s is not None:
            config = replace(config, reader_lease_duration_s=lease_s)
        # Handles of this client live only as long as one planning or commit step:
        # no background heartbeats (a read's lease is renewed by nobody, on purpose).
        config = replace(config, heartbeat_interval_s=0)
        return PersistClient.open(self.consensus_uri, self.blob_uri, self.wal_blob_uri,
                                  config=config, create=create)


#: Every option a read and a write take (Spark passes option names lower-cased or not).
_COMMON_OPTIONS = ("consensus", "blob", "wal_blob", "shard")
READ_OPTIONS = (*_COMMON_OPTIONS, "as_of", "partitions", "partition_bytes", "lease_seconds")
WRITE_OPTIONS = (*_COMMON_OPTIONS, "expected_upper", "new_upper", "idempotency_token")


def check_options(options: Mapping[str, str], *, writing: bool) -> None:
    """Refuse options this data source does not take, rather than ignore them (``asof``
    for ``as_of`` would otherwise read the latest time silently).

    Raises:
        InvalidConfig: naming the unknown options and listing the valid ones.
    """
    valid = WRITE_OPTIONS if writing else READ_OPTIONS
    unknown = sorted(k for k in options if k.lower() not in valid)
    if unknown:
        what = "write" if writing else "read"
        hint = (" (a path: use option shard with a shard id or name)" if "path" in
                [k.lower() for k in unknown] else "")
        raise InvalidConfig(f"unknown option(s) {unknown} for a persist {what}{hint}; the "
                            f"valid ones are: {', '.join(valid)}")


def _int_option(options: Mapping[str, str], name: str, default: int, low: int = 1) -> int:
    text = {k.lower(): v for k, v in options.items()}.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise InvalidConfig(f"option {name} must be an integer, got {text!r}") from None
    if value < low:
        raise InvalidConfig(f"option {name} must be at least {low}, got {value}")
    return value


def write_bounds(options: Mapping[str, str]) -> tuple[int, Frontier]:
    """A write's ``(expected_upper, new_upper)`` options.

    Raises:
        InvalidFrontier: one is missing or malformed, expected_upper is closed, or
            new_upper is not beyond it.
    """
    return check_append_bounds(_frontier_option(options, "expected_upper"),
                               _frontier_option(options, "new_upper"))


def write_token(options: Mapping[str, str]) -> str | None:
    """A write's ``idempotency_token`` option (None: not given, a fresh token).

    Raises:
        InvalidConfig: not 1-128 characters ``[A-Za-z0-9_-]``.
    """
    text = {k.lower(): v for k, v in options.items()}.get("idempotency_token")
    if text is None:
        return None
    try:
        return check_token(text)
    except InvalidInput as e:
        raise InvalidConfig(f"option {e}") from None


def _frontier_option(options: Mapping[str, str], name: str) -> Frontier:
    text = {k.lower(): v for k, v in options.items()}.get(name)
    if text is None:
        raise InvalidFrontier(f"a persist write needs option {name}")
    if text.strip().lower() in ("closed", "none"):
        return None
    try:
        return check_frontier(int(text), name)
    except ValueError:
        raise InvalidFrontier(f"option {name} must be a time or 'closed', got "
                              f"{text!r}") from None


# --- reading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ReadPartition:
    """One key range ``[lower, upper)`` (None: unbounded) and what it must read."""

    index: int
    lower: bytes | None
    upper: bytes | None
    parts: tuple[PlanFile, ...]
    inline: pa.Table


def plan_partitions(plan: SnapshotPlan, blobs: ShardBlobs,
                    partition_bytes: int = _DEFAULT_PARTITION_BYTES,
                    max_partitions: int = _DEFAULT_MAX_PARTITIONS) -> list[_ReadPartition]:
    """Split a plan into key ranges that together read every row exactly once.

    Split points are chosen, weighted by size, among the lowest keys of the parts' row
    groups (their Parquet footers, read through ``blobs``) and samples of small parts'
    keys (:func:`~persist_pipeline.internal.blobs.split_keys`, as Spark compaction's
    key ranges); a partition reads only the parts whose recorded key range overlaps
    its own.
    """
    total = sum(f.size for f in plan.file_details) + plan.inline.nbytes
    n = max(1, min(max_partitions, math.ceil(total / partition_bytes)))
    every = tuple(plan.file_details)
    if n == 1 or not plan.file_details:
        return [_ReadPartition(0, None, None, every, plan.inline)]
    where = f"shard {plan.shard_id}"

    def starts_of(f: PlanFile) -> list[tuple[bytes, int]]:
        return key_starts(blobs, f.hollow_part(), where, _SAMPLES_PER_SMALL_PART)

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="persist-plan") as pool:
        starts = [s for found in pool.map(starts_of, plan.file_details) for s in found]
    splits = split_keys(starts, n)
    ranges = list(zip([None, *splits], [*splits, None], strict=True))
    out = []
    inline = consolidate(plan.inline)  # sorted, as the range filter expects
    for i, (lo, hi) in enumerate(ranges):
        parts = tuple(f for f in plan.file_details if f.hollow_part().may_hold_keys(lo, hi))
        out.append(_ReadPartition(i, lo, hi, parts, KeyRange(lo, hi).filter(inline)))
    return out


def _read_partition(location: _Location, as_of: int, partition: _ReadPartition,
                    lease_s: float, schema: bytes = b"",
                    columns: int | None = None, reader_id: str = ""
                    ) -> Iterator[pa.RecordBatch]:
    """Run on an executor: this key range's rows of every part, consolidated at as_of,
    streamed through the k-way merge in bounded memory (each batch's parts are sorted
    runs, read row group by row group). ``reader_id``: the planner's reader, whose
    hold keeps the plan's files."""
    from persist_pipeline.spark import _blob

    main = _blob(location.blob_uri)
    wal = _blob(location.wal_blob_uri) if location.wal_blob_uri else None
    blobs = ShardBlobs(main, wal, main, wal)
    keys = KeyRange(partition.lower, partition.upper)
    where = f"shard {location.shard_id}"
    by_batch: dict[str, list[PlanFile]] = {}
    for f in partition.parts:
        by_batch.setdefault(f.batch_id, []).append(f)
    runs: list[tuple[Iterator[pa.Table], str]] = []
    if partition.inline.num_rows:
        with naming_shard(location.shard_id):
            inline = consolidate(partition.inline, as_of=as_of)
        runs.append((iter([inline]), f"inline rows of {where}"))
    sorted_runs = []
    for batch_id, files in by_batch.items():
        files.sort(key=lambda f: f.index)
        batch = Batch(batch_id, Description(0, None, 0),
                      tuple(f.hollow_part() for f in files), 0)
        sorted_runs += [(run, f"batch {batch_id} of {where}") for run in batch.runs()]
    plan = memory_plan(COMPACTION_MEMORY_BOUND_BYTES, len(runs) + len(sorted_runs),
                       COMPACTION_MEMORY_BOUND_BYTES)
    runs += [(blobs.stream_run(run, described, plan.chunk_bytes // 2, plan.read_bytes,
                               key_lower=keys.lower, key_upper=keys.upper, as_of=as_of),
              described) for run, described in sorted_runs]
    typed = ShardSchema.from_bytes(schema) if schema else None
    out_schema = _ARROW_SCHEMA if typed is None else spark_arrow_schema(typed)
    # The first ``columns`` key and value columns (and t, d): those the DataFrame
    # declared before the shard's schema appended nullable value columns.
    keep = None if typed is None or columns is None else [
        *typed.columns[:columns], "t", "d"]
    try:
        with naming_shard(location.shard_id):
            for table in merge_runs(runs, plan.chunk_bytes):
                if typed is not None:
                    table = _to_spark_types(typed.decode(table, where), out_schema)
                table = table.cast(out_schema)
                if keep is not None:
                    table = table.select(keep)
                yield from table.to_batches(max_chunksize=_ROWS_PER_BATCH)
    except PartMissing as e:
        if reader_id and _reader_registered(location, reader_id):
            # The planner's reader still holds the plan's state version, so GC kept
            # every file of it: the lease is not why this part is missing.
            raise PartMissing(f"{e}, while this read's reader still holds it: is the "
                              f"blob option the location's own store?") from None
        raise LeaseExpired(
            f"a part of shard {location.shard_id} is gone: this Spark read ran longer than "
            f"its reader's lease ({lease_s:g} s) and GC collected it; re-run the read, or "
            f"give it a longer option lease_seconds ({e})") from None


def _reader_registered(location: _Location, reader_id: str) -> bool:
    """Whether ``reader_id`` is still a leased reader of the shard, asked of consensus
    (False when that cannot be told)."""
    try:
        client = location.client()
    except PersistError:
        return False
    try:
        return reader_id in client._machine(location.shard_id).fetch_latest().leased_readers
    except PersistError:
        return False
    finally:
        client.close()


def _as_of_option(options: Mapping[str, str]) -> int | str:
    """Option ``as_of``: a time, or ``latest`` (upper - 1; also when the option is not
    given)."""
    text = {k.lower(): v for k, v in options.items()}.get("as_of")
    if text is None or text.strip().lower() == LATEST:
        return LATEST
    try:
        value = int(text)
    except ValueError:
        raise InvalidFrontier(f"option as_of must be a time or 'latest', got {text!r}") from None
    t = check_frontier(value, "as_of")
    assert t is not None
    return t


def make_read_plan(options: Mapping[str, str], declared: StructType | None = None
                   ) -> tuple[_Location, int, list[_ReadPartition], float, bytes, str,
                              int | None]:
    """The planner's side of a read: a leased reader (left to expire), its plan at
    ``as_of``, the partitions, the shard's encoded schema (empty: untyped), the
    reader's id and how many of its columns the read yields (:func:`declared_columns`
    of ``declared``, the DataFrame's columns).

    Raises:
        SchemaMismatch: the planned columns cannot be the declared ones (the reader is
            expired: a refused read holds nothing).
    """
    location = _Location.from_options(options)
    as_of = _as_of_option(options)
    partition_bytes = _int_option(options, "partition_bytes", _DEFAULT_PARTITION_BYTES)
    max_partitions = _int_option(options, "partitions", _DEFAULT_MAX_PARTITIONS)
    lease_text = {k.lower(): v for k, v in options.items()}.get("lease_seconds")
    lease_s: float | None = None
    if lease_text is not None:
        try:
            lease_s = float(lease_text)
        except ValueError:
            raise InvalidConfig(f"option lease_seconds must be a number, got "
                                f"{lease_text!r}") from None
        if not 0 < lease_s < math.inf:
            raise InvalidConfig(f"option lease_seconds must be positive, got {lease_text!r}")
    client = location.client(lease_s)
    try:
        lease = client.config.reader_lease_duration_s
        reader = client.open_reader(location.shard_id, debug="spark read")
        try:
            plan = reader.snapshot_plan(as_of)
            # Hold since only where this read needs it. The seqno hold this publishes is
            # at most the plan's (the plan is open), and it stays so: the plan is left
            # open on purpose, since closing it would publish a newer hold and free the
            # plan's files before the executors read them. The hold ends when the
            # reader's lease runs out and GC expires it.
            reader.downgrade_since(plan.as_of)
            try:
                partitions = plan_partitions(plan, client.blobs, partition_bytes,
                                             max_partitions)
            except PartMissing as e:
                # A part of the held plan gone while the split points are read: GC may
                # collect it only once the reader was expired (a GC whose clock runs
                # ahead by more than the lease, a pause past it). The read fails as its
                # executors do then (LeaseExpired: run it again), not as a shard that
                # lost data (PartMissing is a CorruptPart).
                reader._raise_if_expired(e)
                raise
            schema = plan.schema.to_bytes() if plan.schema is not None else b""
            # Checked before the reader is left to its lease: a read refused here must
            # not hold since and the plan's files for a whole lease.
            columns = declared_columns(declared, schema, location.shard_id)
            return (location, plan.as_of, partitions, lease, schema, reader.reader_id,
                    columns)
        except BaseException:
            with contextlib.suppress(PersistError):
                reader.expire()
            raise
    finally:
        client.close()


def _untyped_struct() -> StructType:
    """:data:`SPARK_SCHEMA` as a StructType (built without a session)."""
    from pyspark.sql.types import BinaryType, LongType, StructField, StructType

    return StructType([StructField("k", BinaryType()), StructField("v", BinaryType()),
                       StructField("t", LongType()), StructField("d", LongType())])


#: Types Spark has no Arrow conversion for, and the type each is read as (every value
#: exactly; a write casts back, refusing what does not fit).
_SPARK_READS_AS = {
    pa.uint8(): pa.int16(), pa.uint16(): pa.int32(), pa.uint32(): pa.int64(),
    pa.uint64(): pa.decimal128(20, 0), pa.date64(): pa.date32(),
    pa.time32("s"): pa.time64("us"), pa.time32("ms"): pa.time64("us"),
}


def _spark_readable(type_: pa.DataType) -> pa.DataType:
    """``type_`` with every part Spark cannot hold replaced by one that holds its values
    (see :data:`_SPARK_READS_AS`), so a shard any entry point stored (a pandas frame's
    unsigned columns through the IO manager) reads in Spark too."""
    return replace_leaf_types(type_, lambda leaf: _SPARK_READS_AS.get(leaf, leaf))


def spark_struct(schema: ShardSchema) -> StructType:
    """A typed shard's read schema as Spark sees it (unsigned integers, 64-bit dates and
    32-bit times as the wider types that hold them: see :data:`_SPARK_READS_AS`).

    Raises:
        InvalidConfig: a column type Spark cannot hold (e.g. decimals of more than 38
            digits).
    """
    from pyspark.sql.pandas.types import from_arrow_schema

    arrow = schema.arrow_schema()
    readable = pa.schema([f.with_type(_spark_readable(f.type)) for f in arrow],
                         metadata=arrow.metadata)
    try:
        struct: StructType = from_arrow_schema(readable)
    except (TypeError, ValueError, AssertionError) as e:
        raise InvalidConfig(f"the shard's schema {schema!r} has a type Spark cannot read: "
                            f"{e}") from None
    return struct


def spark_arrow_schema(schema: ShardSchema) -> pa.Schema:
    """The Arrow schema of the batches a typed read yields (Spark's own conversion of
    :func:`spark_struct`: timestamps in microseconds)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(spark_struct(schema), timezone="UTC")


def _to_spark_types(table: pa.Table, schema: pa.Schema) -> pa.Table:
    try:
        return table.cast(schema, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise InvalidConfig(f"the shard's rows do not fit Spark's types ({e}); e.g. "
                            f"nanosecond timestamps with sub-microsecond digits") from None


def declared_columns(declared: StructType | None, encoded: bytes,
                     shard_id: str) -> int | None:
    """How many of the planned shard schema's key and value columns a read yields, to
    match the columns the DataFrame ``declared`` when it was loaded (None: all of them).

    ``load()`` fixes a DataFrame's columns; the reader plans later, when an action runs.
    A schema evolved in between (nullable value columns appended) still yields the
    declared columns.

    Raises:
        SchemaMismatch: the declared columns are not a prefix of the planned ones (the
            shard was typed after ``load()``, or the read declared other columns).
    """
    if declared is None:
        return None
    typed = ShardSchema.from_bytes(encoded) if encoded else None
    planned = _untyped_struct() if typed is None else spark_struct(typed)
    want = [(f.name, f.dataType) for f in declared.fields]
    have = [(f.name, f.dataType) for f in planned.fields]
    if want == have:
        return None
    n = len(want) - 2
    if typed is not None and len(typed.key) <= n < len(have) - 2 and \
            want[:n] == have[:n] and want[n:] == have[-2:]:
        return n
    raise SchemaMismatch(
        f"shard {shard_id}: its columns are now {[name for name, _ in have]}, but this "
        f"read was loaded with {[name for name, _ in want]} (the shard's schema changed "
        f"in between): load the DataFrame again")


def _shard_schema(location: _Location, *, writing: bool = False) -> ShardSchema | None:
    client = location.client(create=writing)
    try:
        return client.schema(location.shard_id)
    except ShardNotFound:
        return None
    finally:
        client.close()


# --- writing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _WriteJob:
    """What every task and the driver share about one write (picklable)."""

    location: _Location
    expected_upper: int
    new_upper: Frontier
    token: str
    target_size_bytes: int
    #: The shard's encoded schema when the write was planned: tasks encode with it and
    #: the commit carries it (a schema recorded since refuses the commit).
    schema: bytes = b""
    #: The driver's monotonic clock when the write was planned, before any task could
    #: upload: the commit deadline starts here (a task's own clock is never compared).
    planned_s: float = 0.0
    #: Which boot of which host that clock belongs to (a monotonic clock means nothing
    #: elsewhere): a commit on another host is refused.
    planned_on: str = ""
    #: This plan's own id: runs of a save retried with one ``idempotency_token`` share
    #: the token, never their commit markers (each run's abort judges its own commit).
    plan_id: str = ""
    #: The planner's persist-pipeline (:func:`code_fingerprint`): a task on an executor
    #: running another refuses to write.
    fingerprint: str = ""

    @property
    def store(self) -> Store:
        return "wal" if self.location.wal_blob_uri else "main"

    @property
    def batch_id(self) -> str:
        return batch_id_of(self.token)


def _write_job(options: Mapping[str, str], overwrite: bool,
               columns: pa.Schema | None = None) -> _WriteJob:
    """The driver's plan of a write of a DataFrame with ``columns`` (when known)."""
    if overwrite:
        raise InvalidConfig("persist shards are append-only: write with mode('append') "
                            "and options expected_upper / new_upper")
    location = _Location.from_options(options, writing=True, columns=columns)
    expected, upper = write_bounds(options)
    token = write_token(options)
    if location.new_name:
        # Before the name is registered for good (and its shard created here).
        check_new_shard_bounds(expected, location.new_name)
    client = location.client(create=True)
    try:
        return plan_write(location, client, expected, upper, token)
    finally:
        client.close()


def plan_write(location: _Location, client: PersistClient, expected: int,
               upper: Frontier, token: str | None = None) -> _WriteJob:
    """The driver's plan of one write: the token, and the schema its tasks encode with.

    ``token``: the user's ``idempotency_token`` (the write may retry an earlier one with
    it); None draws a fresh one, for this write alone. The shard is created if it does
    not exist, before any task uploads: the parts of a task attempt that never commits
    (a retried task, an aborted job) are then swept by GC's orphan sweep of that shard.
    """
    client.create_shard(location.shard_id)
    typed = client.schema(location.shard_id)
    return _WriteJob(location, expected, upper, new_token() if token is None else token,
                     client.config.blob_target_size_bytes,
                     typed.to_bytes() if typed is not None else b"",
                     planned_s=client.clock.monotonic(), planned_on=_this_boot(),
                     plan_id=new_token(), fingerprint=code_fingerprint())


def _this_boot() -> str:
    """This host's current boot (the domain of its monotonic clock)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


def _write_task(job: _WriteJob, batches: Iterator[pa.RecordBatch]) -> tuple[
        tuple[HollowPart, ...], int, int]:
    """Run on an executor: validate, consolidate and upload this task's rows.

    Returns ``(parts, updates, diff_bound)``: the parts (one sorted run), how many
    updates they hold and their largest ``|d|`` (for the driver's check that the
    write's sums across tasks fit in 64 bits).
    """
    from persist_pipeline.internal.blobs import write_parts
    from persist_pipeline.spark import _blob

    # Unset in a job planned by a version without the field: getattr's default.
    check_same_code(getattr(job, "fingerprint", None), "driver", "executor")
    collected = list(batches)
    if not collected:
        return (), 0, 0
    typed = ShardSchema.from_bytes(job.schema) if job.schema else None
    data = _task_updates(typed, pa.Table.from_batches(collected))
    check_times(data, job.expected_upper, job.new_upper)
    if not len(data):
        return (), 0, 0
    uri = job.location.wal_blob_uri if job.store == "wal" else job.location.blob_uri
    assert uri is not None
    parts = write_parts(data.table(), job.location.shard_id, job.batch_id, _blob(uri),
                        job.store, job.target_size_bytes, schema=typed)
    return parts, len(data), data.diff_bound()


def _task_updates(typed: ShardSchema | None, table: pa.Table) -> Updates:
    """A task's rows as the shard's updates: validated (as an API write's), encoded for
    a typed shard, consolidated; ``d`` defaults to 1, as in every other write of rows.

    Raises:
        InvalidUpdates / SchemaMismatch: the rows cannot be a write of the shard.
    """
    return Updates.coerce(with_default_diff(table) if typed is None else typed.encode(table))


def check_write_columns(client: PersistClient, shard: str | None,
                        columns: pa.Schema) -> None:
    """Refuse, on the driver and before anything is created, a write whose columns
    none of its rows could pass in a task (text keys, a typed shard's columns missing
    or of other types): the checks of :func:`_task_updates`, of no rows.

    Raises:
        InvalidUpdates / SchemaMismatch: as a task would.
    """
    typed = None
    if shard is not None:
        with contextlib.suppress(ShardNotFound):
            typed = client.schema(shard)
    _task_updates(typed, columns.empty_table())


#: Where commit markers live (None: the driver host's temporary directory).
MARKER_DIR: Path | None = None


def _commit_marker(job: _WriteJob) -> Path:
    """A file on the driver's host that says a commit of this write was attempted (commit
    and abort run in separate Python workers of the driver; abort must know)."""
    folder = MARKER_DIR if MARKER_DIR is not None else Path(tempfile.gettempdir())
    return folder / f"persist-spark-commit-{job.token}-{job.plan_id}"


def _abort_marker(job: _WriteJob) -> Path:
    """A file on the driver's host that says an abort of this write may delete its parts.

    Commit and abort each create their own marker, then look for the other's: if they
    overlap, at least one sees the other, so an abort never deletes the parts of a commit
    that goes on to reference them (the commit refuses; or the abort leaves the parts
    to GC). An abort that deletes the parts leaves its marker: a commit of this write
    that starts later must refuse too; one that deletes nothing removes it.
    """
    return _commit_marker(job).with_name(f"persist-spark-abort-{job.token}-{job.plan_id}")


def _was_aborted(job: _WriteJob) -> bool:
    """Whether an abort of this write has run or is running (its marker exists)."""
    return _abort_marker(job).exists()


def _commit(job: _WriteJob, messages: Sequence[Any],
            client: PersistClient | None = None) -> None:
    """Run on the driver: commit every task's parts as one batch, atomically (with
    ``client``, or one opened on the job's location)."""
    if job.planned_on and job.planned_on != _this_boot():
        # Raised before the commit marker exists: the abort that follows deletes parts.
        raise CommitDeadlineExceeded(
            "this write was planned on another host (or before a reboot), so its commit "
            "deadline cannot be measured here; nothing was written")
    parts = tuple(p for m in messages for p in m.parts)
    updates = sum(m.num_updates for m in messages)
    own = client is None
    if client is None:
        client = job.location.client(create=True)
    try:
        # Refused before the commit marker exists: the abort that follows deletes parts.
        for message in messages:
            check_same_code(getattr(message, "fingerprint", None), "executor", "driver")
        _refuse_wrapping_sums(client, job, messages)
        _refuse_taken_name(client, job)
        marker = _commit_marker(job)
        marker.touch()
        if _was_aborted(job):
            # An abort of this write ran (or runs) and may have deleted its parts.
            marker.unlink(missing_ok=True)
            raise CommitDeadlineExceeded(
                "this write was aborted while its commit had not started; nothing was "
                "written (run the write again)")
        name = job.location.new_name
        # A new name is created in the commit's own compare-and-set: registered exactly
        # when the write lands, never by a commit that is then refused.
        created: tuple[CasWrite, ...] = ()
        if name:
            key, record = name_record(name, ShardId.parse(job.location.shard_id))
            created = (CasWrite(key, None, record),)
        with client.open_writer(job.location.shard_id, debug="spark write") as writer:
            # The schema the tasks encoded with, fixed when the write was planned: a
            # schema recorded since (another client typing the shard) refuses the commit.
            try:
                result = writer.compare_and_append_parts(
                    parts, updates, job.expected_upper, job.new_upper,
                    idempotency_token=job.token, upload_started_s=job.planned_s,
                    schema=ShardSchema.from_bytes(job.schema) if job.schema else None,
                    created=created)
            except RecordTaken:
                assert name  # the only record a Spark write creates
                raise name_taken(client, name, job.expected_upper) from None
        log.info("persist spark write: %d update(s) in %d part(s) committed at seqno %d",
                 updates, len(parts), result.seqno)
    finally:
        if own:
            client.close()
    marker.unlink(missing_ok=True)


def _refuse_taken_name(client: PersistClient, job: _WriteJob) -> None:
    """Refuse the commit, before its marker exists (so the abort that follows deletes
    the parts), when another writer registered the write's new shard name (for another
    shard) since the write was planned. A registration racing the commit itself is
    refused by the commit's compare-and-set instead (the parts are then left to GC).

    Raises:
        UpperMismatch: the name names another shard; nothing committed.
    """
    name = job.location.new_name
    if name and client.name_registry.lookup(name) is not None:
        raise name_taken(client, name, job.expected_upper)


def _refuse_wrapping_sums(client: PersistClient, job: _WriteJob,
                          messages: Sequence[Any]) -> None:
    """Diffs never wrap, whichever entry point writes: a write whose sums leave 64 bits
    is refused, also when its equal ``(k, v, t)`` came to different tasks (each task
    consolidated only its own rows).

    Each task's parts are one consolidated sorted run, so no sum can leave 64 bits
    unless the tasks' largest ``|d|`` add up beyond them; only then are the runs merged
    (in bounded memory, as a read merges them) to find out exactly.

    Raises:
        InvalidUpdates: a ``(k, v, t)``'s diffs sum beyond 64 bits; nothing committed.
    """
    runs = [m.parts for m in messages if m.parts]
    if len(runs) < 2 or not sums_may_wrap(m.diff_bound for m in messages):
        return
    machine = client._machine(job.location.shard_id)
    where = f"the Spark write to shard {job.location.shard_id}"
    bound = machine.config.compaction_memory_bound_bytes
    plan = memory_plan(bound, len(runs), bound)
    streams = [(machine.blobs.stream_run(run, where, plan.chunk_bytes // 2, plan.read_bytes),
                f"task {n} of {where}") for n, run in enumerate(runs)]
    try:
        for _ in merge_runs(streams, plan.chunk_bytes):
            pass
    except DiffOverflow as e:
        raise InvalidUpdates(f"the write's {e.what}; nothing was written") from None


def _abort(job: _WriteJob, messages: Sequence[Any],
           client: PersistClient | None = None) -> None:
    """Run on the driver after a failed task or a failed commit (with ``client``, or one
    opened on the job's location when it must ask consensus)."""
    parts = [part for message in messages if message is not None
             for part in getattr(message, "parts", ())]
    marker = _commit_marker(job)
    if not parts:
        marker.unlink(missing_ok=True)
        return
    aborting = _abort_marker(job)
    aborting.touch()  # before looking for the commit's marker (see _abort_marker)
    deleting = False
    try:
        if marker.exists():
            # A commit was attempted: it deleted the parts itself if it knew for certain
            # nothing was committed; otherwise they may be referenced, and are GC's to
            # judge.
            marker.unlink(missing_ok=True)
            return
        # No marker: no commit was attempted, or one finished (a commit removes its
        # marker once it landed) and Spark never learnt it (the worker that ran it died
        # before replying): Spark then aborts a write whose parts the shard references.
        # Only consensus tells the two apart; deleting on a guess would lose
        # acknowledged rows.
        if _may_have_landed(job, client):
            log.warning("persist spark write aborted after its batch %s was committed "
                        "(or when that could not be told): its parts are left to GC",
                        job.batch_id)
            return
        deleting = True
    finally:
        if not deleting:  # nothing deleted: a commit of these parts may still land
            aborting.unlink(missing_ok=True)
    from persist_pipeline.spark import _blob

    for part in parts:
        uri = job.location.wal_blob_uri if part.store == "wal" else job.location.blob_uri
        try:
            _blob(uri or job.location.blob_uri).delete(part.key)
        except PersistError as e:  # GC's orphan sweep gets it later
            log.warning("could not delete uncommitted part %s: %s", part.key, e)


def _may_have_landed(job: _WriteJob, client: PersistClient | None) -> bool:
    """Whether the write's batch may be in the shard (False only if consensus says for
    certain it never was): its token's batch found in the state or its kept history,
    history truncated by GC, or consensus out of reach all count as may."""
    own = client is None
    try:
        if client is None:
            client = job.location.client()
        landed = history.batch_landed(client._machine(job.location.shard_id),
                                      job.batch_id, job.expected_upper, job.token)
    except ShardNotFound:
        return False  # no shard, nothing in it references the parts
    except PersistError:
        return True  # (TokenReused: another write's token; the parts are GC's to judge)
    finally:
        if own and client is not None:
            client.close()
    return landed is not False
