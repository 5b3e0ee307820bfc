"""Ingestion assets: one per shard (``ingest/NAME``), each materialization one write.

They are computed by two multi-assets, ``synthetic_ingestion`` and ``file_ingestion``
(partitioned by landed file), so the code location has two ops whatever the number of
shards; a run selects the shards it writes.

A materialization appends to the shard with ``compare_and_append`` at the shard's current
upper (retrying if another writer moved it) and reports what the write did, most useful
first: the shard's inline bytes and limit, the placement (inline / wal / blob, decided
by the ``inline_policy`` resource's policy inside the library), the write's stored size
beside the inline encoding size the placement compared with the threshold, its latency,
the updates it wrote, the shard's upper, blob PUTs. Sources:

- ``files``: one dynamic partition per landed file (the partition key is
  ``SHARD/path``, the file's path in the landing location, with a long path shortened
  to ``SHARD/<head>~<digest>~<tail>`` so the key fits the UI; the run's ``persist/file``
  tag and the ``File`` metadata keep the full path; a long path's key from before keys
  were shortened still works: see :mod:`assets.landed_partitions`); all files shards
  share the ``landed_files`` partitions; the landing sensor adds partitions and requests
  their runs, and any partition can be re-run from the UI). A file is ingested exactly
  once whichever way its run was launched: a run whose file (same name, size and mtime)
  was already ingested writes nothing, of two runs of the same file at the same time
  the later one fails without writing, and a run that died between its commit and its
  materialization is settled by the next run from the write it recorded first
  (:func:`settle_intents`). A run that only seemed to die (paused past the moment
  Dagster declared it failed) and commits late is settled too: every commit attempt
  settles at the upper it commits at, so the later of the two writes fails on the
  earlier one's upper and finds it (:func:`_settle_before_commit`). The file is read
  and validated before anything touches the shard, so a bad file fails its run with a
  message naming the file and line and writes nothing.
- ``routed``: the rows of a *route*'s landed files whose route column names the shard.
  A route's file is a partition ``ROUTE/path`` of every shard routed from it, and one
  run writes it to all of them in one transaction (:meth:`PersistClient.transaction`):
  each shard gets its rows (none is a write of no rows that still advances its upper),
  and either every shard has the file or none has. A row naming no routed shard fails
  the file before anything is written. Exactly-once holds for the file as for a
  ``files`` shard's.
- ``synthetic``: the built-in change stream (:mod:`assets.change_stream`).

A landed file's run retries its step after a transient failure (a backend away for
longer than the library's own retries, a commit whose outcome could not be confirmed,
the upper moving on every attempt), with backoff, up to ``ingestion.retries`` times; a
bad file, a closed shard or another permanent failure fails once with its own message
(:mod:`assets.retries`). A retry goes through the same settling as a new run: after a
commit whose reply was lost, it finds that write committed and records it instead of
writing the file again. A synthetic write is not retried (the next run writes the next
step anyway).
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from assets.asset_keys import (
    FILES_PARTITIONS,
    INGESTION_GROUP,
    LANDING_JOB,
    file_partition_keys,
    shard_key,
    split_file_partition,
)
from assets.change_stream import ChangeStream
from assets.landed_partitions import landed_file_of
from assets.pipeline_config import (
    FileSource,
    IngestionConfig,
    RouteConfig,
    RoutedSource,
    ShardConfig,
    SyntheticSource,
    is_landed,
    register_shard_name,
)
from assets.retries import classified_failures, retry_policy
from assets.sources import display_name, read_landed, same_file_version, stat_landed
from persist_pipeline import PersistClient, UpperMismatch, WriteHandle, WriteResult
from persist_pipeline.blob import redact_uri
from persist_pipeline.dagster_io import TABLE_NAME
from persist_pipeline.exceptions import (
    Indeterminate,
    InvalidConfig,
    InvalidUpdates,
    PersistError,
    Unavailable,
)
from persist_pipeline.ids import new_token
from resources.inline_policy import InlinePolicyResource
from resources.persist import PersistResource

#: How often a write is re-planned when another writer moved the shard's upper.
MAX_ATTEMPTS = 20


#: Metadata labels of an ingestion materialization. The UI lists them in this order and
#: plots the numeric ones in alphabetical order, so the names put "Inline bytes" first.
INLINE_BYTES = "Inline bytes"
INLINE_LIMIT = "Inline limit (bytes)"
PLACEMENT = "Placement"
WRITE_BYTES = "Stored size (bytes)"
INLINE_SIZE = "Inline encoding size (bytes)"
WRITE_LATENCY = "Write latency (ms)"
UPDATES_WRITTEN = "Updates written"
UPPER = "Upper"
BLOB_PUTS = "PUTs to blob storage"
FELL_BACK = "Fell back to blob (inline budget full)"
SEQNO = "Seqno"
SHARD_ID = "Shard ID"
FILE = "File"
FILE_IDENTITY = "File identity"
ROUTE = "Route"
ROUTE_SHARDS = "Shards in the transaction"
WRITE_ID = "Write id"  # the write's idempotency token: names its batch
EXPECTED_UPPER = "Expected upper"
RECOVERED_FROM = "Committed by run"

#: The columns of every shard (the ingestion assets' ``dagster/column_schema``).
UPDATES_SCHEMA = dg.TableSchema(columns=[
    dg.TableColumn("k", "binary", description="key"),
    dg.TableColumn("v", "binary", description="value"),
    dg.TableColumn("t", "int64", description="time (>= 0)"),
    dg.TableColumn("d", "int64", description="diff: +n inserts, -n retracts"),
])

#: The partitions of every files shard (keys ``SHARD/path``, see :mod:`assets.asset_keys`).
LANDED_FILES = dg.DynamicPartitionsDefinition(name=FILES_PARTITIONS)

#: Run statuses of a run that may still write.
ACTIVE_STATUSES = [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.QUEUED,
                   dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]


class SyntheticIngestConfig(dg.Config):
    """Run config of a ``synthetic`` ingestion asset."""

    events: int = Field(default=0, ge=0,
                        description="Changes to write (0: the source's events_per_write).")


@dataclass(frozen=True)
class Planned:
    """A write planned for a given upper: its updates, the new upper, extra metadata."""

    table: pa.Table
    new_upper: int
    metadata: dict[str, Any] = field(default_factory=dict)


#: Called with (expected upper, idempotency token) just before each commit attempt.
Intent = Callable[[int, str], None]
#: An earlier run's recorded writes of the file found committed, recorded now (empty:
#: none): :func:`settle_intents` for one file.
Settle = Callable[[], list[dg.MaterializeResult]]


class SettledElsewhere(Exception):
    """A write loop found an earlier run's write of the same file committed: the file is
    not written again; ``results`` are that write's materializations, recorded now."""

    def __init__(self, results: list[dg.MaterializeResult]) -> None:
        super().__init__("settled by an earlier run's write")
        self.results = results


def _settle_before_commit(settle: Settle | None) -> None:
    """Settle the file at the upper an attempt is about to commit at, read before this
    call: an earlier run that only seemed to die (paused past the moment Dagster
    declared it failed) may commit its recorded write at any time. Landing before this
    check, it is found here; after, it moved the upper the attempt commits at, which then
    fails and checks again. Either way the file is written once.

    Raises:
        SettledElsewhere: an earlier run's write of the file committed.
    """
    if settle is not None:
        found = settle()
        if found:
            raise SettledElsewhere(found)


def append(writer: WriteHandle, plan: Callable[[int], Planned], intent: Intent | None = None,
           settle: Settle | None = None) -> tuple[WriteResult, Planned, float]:
    """Write ``plan(upper)`` at the shard's upper, re-planning on an upper mismatch; with
    ``settle``, each attempt first settles earlier runs' writes of the same file.

    Returns the result, the plan that was written and the write latency in ms.

    Raises:
        SettledElsewhere: an earlier run's write of the file committed (nothing written).
    """
    upper = writer.fetch_recent_upper()
    for _ in range(MAX_ATTEMPTS):
        # Settled first: a shard closed after an earlier attempt's commit landed unheard
        # still holds that write, which is recorded then rather than the file failed.
        _settle_before_commit(settle)
        if upper is None:
            raise dg.Failure(f"shard {writer.shard_id} is closed: it takes no more writes",
                             allow_retries=False)
        planned = plan(upper)
        # A token only for a recorded write: with one, a refused attempt also searches
        # the shard's history, which a write nobody will settle later does not need.
        token = None
        if intent is not None:
            token = new_token()
            intent(upper, token)
        started = time.perf_counter()
        try:
            result = writer.compare_and_append(planned.table, upper, planned.new_upper,
                                               idempotency_token=token)
        except UpperMismatch as mismatch:
            upper = mismatch.current
            continue
        return result, planned, (time.perf_counter() - started) * 1000
    raise dg.Failure(f"shard {writer.shard_id}: the upper kept moving; gave up after "
                     f"{MAX_ATTEMPTS} attempts")


def write_metadata(client: PersistClient, shard: ShardConfig, result: WriteResult,
                   planned: Planned, latency_ms: float) -> dict[str, Any]:
    """What a materialization reports (numbers are plotted by the UI)."""
    summary = client.shard_summaries().get(shard.shard_id)
    inline_bytes = summary.inline_bytes if summary is not None else 0
    return {
        INLINE_BYTES: inline_bytes,
        # The shard's recorded max, the one its inline bytes keep within.
        INLINE_LIMIT: summary.inline_bound(client.inline_policy.max_bytes)
        if summary is not None else client.inline_policy.max_bytes,
        PLACEMENT: result.placement,
        WRITE_BYTES: result.encoded_bytes,
        INLINE_SIZE: result.inline_size,
        WRITE_LATENCY: round(latency_ms, 3),
        UPDATES_WRITTEN: planned.table.num_rows,
        UPPER: result.upper if result.upper is not None else -1,
        BLOB_PUTS: result.num_parts,
        FELL_BACK: result.fell_back,
        **planned.metadata,
        SEQNO: result.seqno,
        SHARD_ID: shard.shard_id,
    }



@contextmanager
def released(context: dg.AssetExecutionContext,
             writers: Iterable[WriteHandle]) -> Iterator[None]:
    """Expire ``writers`` when the block ends, without hiding why it failed.

    After a clean exit each writer is expired (an error then is the step's). After a
    failure the step's own error is what the user must see and what decides a retry:
    a writer is not expired at all when consensus was away or a commit's outcome
    unknown (the expiry would wait out the library's retries against the same outage,
    and the writer's lease lapses on its own), and an expiry that fails otherwise is
    logged, not raised.
    """
    try:
        yield
    except BaseException as failure:
        if not isinstance(failure, Unavailable | Indeterminate):
            for writer in writers:
                try:
                    writer.expire()
                except PersistError as e:
                    context.log.warning(f"writer {writer.writer_id} of shard "
                                        f"{writer.shard_id} not expired ({e}); its lease "
                                        "lapses on its own")
        raise
    for writer in writers:
        writer.expire()


def _write(context: dg.AssetExecutionContext, client: PersistClient, shard: ShardConfig,
           plan: Callable[[int], Planned], intent: Intent | None = None,
           settle: Settle | None = None) -> dg.MaterializeResult:
    try:
        register_shard_name(client, shard)
    except InvalidConfig as e:  # the config name is another shard's
        raise dg.Failure(description=str(e), metadata={"shard": shard.name},
                         allow_retries=False) from None
    writer = client.open_writer(shard.shard_id, debug=f"dagster run {context.run.run_id}")
    with released(context, [writer]):
        try:
            result, planned, latency_ms = append(writer, plan, intent, settle)
        except InvalidUpdates as e:
            raise dg.Failure(description=str(e), metadata={"shard": shard.name},
                             allow_retries=False) from None
    metadata = write_metadata(client, shard, result, planned, latency_ms)
    context.log.info(
        f"shard {shard.name}: {planned.table.num_rows} rows, {result.encoded_bytes} bytes "
        f"-> {result.placement}{' (inline budget full: fell through)' if result.fell_back else ''}"
        f" in {latency_ms:.2f} ms; upper {result.upper}, inline bytes "
        f"{metadata[INLINE_BYTES]}")
    return dg.MaterializeResult(asset_key=shard_key(shard.name), metadata=metadata)


def _restamp(table: pa.Table, t: int) -> pa.Table:
    return table.set_column(2, "t", pa.array([t] * table.num_rows, pa.int64()))


def file_plan(table: pa.Table, source: FileSource, shown: str,
              identity: str = "") -> Callable[[int], Planned]:
    """How a landed file is written at a given upper (see :class:`FileSource`.times)."""
    extra = {FILE: shown, FILE_IDENTITY: identity}

    def plan(upper: int) -> Planned:
        if source.times == "ingest" or table.num_rows == 0:
            return Planned(_restamp(table, upper), upper + 1, extra)
        lo = int(pc.min(table.column("t")).as_py())
        hi = int(pc.max(table.column("t")).as_py())
        if lo < upper:
            raise InvalidUpdates(f"{shown}: times {lo}..{hi} start below the shard's upper "
                                 f"{upper} (source times must be new)")
        return Planned(table, hi + 1, extra)

    return plan


def synthetic_plan(stream: ChangeStream, events: int) -> Callable[[int], Planned]:
    """Step ``upper`` of the change stream, written at time ``upper``."""
    if events and events != stream.events_per_write:
        stream = ChangeStream(stream.keys, events, stream.seed, stream.value_bytes)

    def plan(upper: int) -> Planned:
        changes = stream.changes(upper)
        return Planned(changes.table, upper + 1, {
            "Stream inserts": changes.inserts, "Stream updates": changes.updates,
            "Stream deletes": changes.deletes})

    return plan


def change_stream(source: SyntheticSource) -> ChangeStream:
    return ChangeStream(source.keys, source.events_per_write, source.seed, source.value_bytes)


def _describe_files(src: FileSource) -> str:
    where = redact_uri(src.uri)  # as configured: templates are not expanded here
    return f"files ({', '.join(src.formats)}) landing in {where}; times: {src.times}"


def _describe_source(shard: ShardConfig) -> str:
    src = shard.source
    if isinstance(src, FileSource):
        return _describe_files(src)
    if isinstance(src, RoutedSource):
        return (f"rows of route {src.route} whose route column is "
                f"{src.value or shard.name!r}")
    return (f"synthetic change stream: {src.keys} keys, {src.events_per_write} changes per "
            f"write, seed {src.seed}")


def ingested_by(instance: dg.DagsterInstance, key: dg.AssetKey,
                partition: str | Sequence[str], identity: str) -> str | None:
    """The run that already ingested this version of a landed file, if any, under its
    partition (or any of its partitions: :func:`assets.asset_keys.file_partition_keys`)."""
    partitions = [partition] if isinstance(partition, str) else list(partition)
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=partitions),
        limit=1000).records
    for record in records:
        materialization = record.asset_materialization
        entry = materialization.metadata.get(FILE_IDENTITY) if materialization else None
        if entry is not None and same_file_version(getattr(entry, "value", None), identity):
            return record.run_id
    return None


def earlier_active_run(instance: dg.DagsterInstance, run_id: str, key: dg.AssetKey,
                       partition: str | Sequence[str]) -> str | None:
    """Another unfinished run ingesting the same file (under its partition, or any of its
    partitions) that was created before this one."""
    mine = instance.get_run_record_by_id(run_id)
    if mine is None:
        return None
    job = LANDING_JOB
    partitions = [partition] if isinstance(partition, str) else list(partition)
    records = [r for p in partitions for r in instance.get_run_records(filters=dg.RunsFilter(
        tags={"dagster/partition": p}, statuses=ACTIVE_STATUSES))]
    for record in records:
        run = record.dagster_run
        if run.run_id == run_id:
            continue
        if run.job_name != job and key not in (run.asset_selection or ()):
            continue
        if (record.create_timestamp, run.run_id) < (mine.create_timestamp, run_id):
            return run.run_id
    return None


def _spec(shard: ShardConfig) -> dg.AssetSpec:
    """The asset ``ingest/NAME`` of one shard."""
    source = shard.source
    what = ("Each landed file is one partition and one compare_and_append; a file is "
            "ingested exactly once." if isinstance(source, FileSource) else
            "Each landed file of the route is one partition, committed to every shard of "
            "the route in one transaction; a file is ingested exactly once."
            if isinstance(source, RoutedSource) else
            "Each materialization is one compare_and_append of the next step of the stream.")
    description = (shard.description or f"Shard {shard.name}.") + \
        f" {what} Source: {_describe_source(shard)}. Watch the 'Inline bytes' plot: the " \
        "inline pressure sensor starts a compaction when it nears the limit."
    # Dagster's freshness policy (shown on the asset; at least a minute, Dagster's floor);
    # the upper_advanced_recently check applies the exact limit.
    freshness = dg.FreshnessPolicy.time_window(
        fail_window=timedelta(seconds=max(60, shard.freshness_max_age_s)))
    return dg.AssetSpec(
        shard_key(shard.name), group_name=INGESTION_GROUP, description=description,
        kinds={"persist"}, freshness_policy=freshness,
        skippable=is_landed(shard),  # a file already ingested writes nothing
        # The shard's name as its table: what the IO manager loads for an asset whose
        # input is this one (all partitions: one landed file each, one shard).
        metadata={"shard_id": shard.shard_id, "source": _describe_source(shard),
                  TABLE_NAME: shard.name, "dagster/column_schema": UPDATES_SCHEMA})


def build_ingestion_assets(shards: Sequence[ShardConfig],
                           routes: Sequence[RouteConfig] = (),
                           ingestion: IngestionConfig | None = None
                           ) -> list[dg.AssetsDefinition]:
    """The ingestion assets ``ingest/NAME`` of every shard: one multi-asset for the
    synthetic shards and one (partitioned by landed file) for the files and routed
    shards.

    Two op definitions, whatever the number of shards: the code location loads in
    seconds with 1,000 shards (an op per shard cost a few milliseconds each, and every
    job pays for every op).
    """
    synthetic = [s for s in shards if not is_landed(s)]
    files = [s for s in shards if is_landed(s)]
    out = []
    if synthetic:
        out.append(_build_synthetic(synthetic))
    if files:
        out.append(_build_files(files, routes, ingestion or IngestionConfig()))
    return out


def _build_synthetic(shards: Sequence[ShardConfig]) -> dg.AssetsDefinition:
    by_key = {shard_key(s.name): s for s in shards}
    streams = {s.name: change_stream(s.source) for s in shards
               if isinstance(s.source, SyntheticSource)}

    @dg.multi_asset(name="synthetic_ingestion", specs=[_spec(s) for s in shards],
                    can_subset=True)
    def synthetic_ingestion(context: dg.AssetExecutionContext, config: SyntheticIngestConfig,
                            persist: PersistResource, inline_policy: InlinePolicyResource
                            ) -> Iterator[dg.MaterializeResult]:
        client = persist.client(inline_policy.policy())
        failed: dict[str, str] = {}
        for key in sorted(context.selected_asset_keys, key=str):
            shard = by_key[key]
            try:  # one shard's failure does not stop the others' writes
                yield _write(context, client, shard,
                             synthetic_plan(streams[shard.name], config.events))
            except (dg.Failure, PersistError) as e:
                context.log.error(f"shard {shard.name}: {e}")
                failed[shard.name] = str(e)
        if failed:
            raise dg.Failure(description=f"writes failed for shard(s) {', '.join(failed)}: "
                                         + "; ".join(failed.values()),
                             metadata={"failed_shards": ", ".join(failed)})

    return synthetic_ingestion


def _build_files(shards: Sequence[ShardConfig], routes: Sequence[RouteConfig],
                 ingestion: IngestionConfig) -> dg.AssetsDefinition:
    by_name = {s.name: s for s in shards}
    by_route = {r.name: r for r in routes}

    # A transient failure is retried with backoff, a bad file is not (assets.retries);
    # every attempt settles the writes earlier ones recorded, so none writes twice.
    @dg.multi_asset(name="file_ingestion", specs=[_spec(s) for s in shards],
                    partitions_def=LANDED_FILES, can_subset=True,
                    retry_policy=retry_policy(ingestion))
    def file_ingestion(context: dg.AssetExecutionContext, persist: PersistResource,
                       inline_policy: InlinePolicyResource) -> Iterator[dg.MaterializeResult]:
        with classified_failures(context, ingestion):
            yield from ingest_file(context, persist, inline_policy)

    def ingest_file(context: dg.AssetExecutionContext, persist: PersistResource,
                    inline_policy: InlinePolicyResource) -> Iterator[dg.MaterializeResult]:
        partition = context.partition_key
        owner, name = split_file_partition(partition)
        selected = {k.path[-1] for k in context.selected_asset_keys}
        if owner in by_route:
            route = by_route[owner]
            if selected & set(route.targets.values()):
                name = _landed_name(context, route.source, owner)
            client = persist.client(inline_policy.policy())
            yield from _ingest_routed(context, client, route, by_name, name, selected)
            return
        if owner not in selected or owner not in by_name:
            # All files shards share the landed_files partitions, so "Materialize all" of
            # ingest/NAME also covers other shards' files: nothing to do for those.
            wanted = ", ".join(f"ingest/{n}" for n in sorted(selected))
            context.log.warning(f"partition {partition} is a file of shard {owner}, not of "
                                f"{wanted}: nothing written (materialize it on "
                                f"ingest/{owner})")
            return
        for other in sorted(selected - {owner}):
            context.log.warning(f"partition {partition} is a file of shard {owner}: "
                                f"nothing for ingest/{other}")
        shard = by_name[owner]
        source = shard.source
        assert isinstance(source, FileSource)
        key = shard_key(owner)
        name = _landed_name(context, source, owner)
        shown = display_name(source, name)
        try:
            landed = stat_landed(source, name)
        except InvalidUpdates as e:
            raise dg.Failure(description=str(e),
                             metadata={"file": shown, "shard": shard.name},
                             allow_retries=False) from None
        # A long path's partition from before keys were shortened counts too: once.
        partitions = file_partition_keys(owner, name)
        done = ingested_by(context.instance, key, partitions, landed.identity)
        if done is not None:
            context.log.info(f"{shown} ({landed.identity}) was already ingested by run "
                             f"{done}: nothing written (each file is ingested once)")
            return
        other = earlier_active_run(context.instance, context.run.run_id, key, partitions)
        if other is not None:
            raise dg.Failure(description=f"run {other} is already ingesting {shown}: this "
                                         "run writes nothing, so the file is ingested once "
                                         "(re-run this partition if that run fails)",
                                         allow_retries=False)
        try:
            table = read_landed(source, name)  # before touching the shard
            if stat_landed(source, name).identity != landed.identity:
                raise InvalidUpdates(f"{shown}: changed while it was read; the landing "
                                     "sensor ingests the new version")
        except InvalidUpdates as e:
            raise dg.Failure(description=str(e),
                             metadata={"file": shown, "shard": shard.name},
                             allow_retries=False) from None
        client = persist.client(inline_policy.policy())
        try:
            yield _write(context, client, shard,
                         file_plan(table, source, shown, landed.identity),
                         intent=lambda upper, token: record_intent(
                             context, key, partition, landed.identity, token, upper),
                         settle=lambda: settle_intents(context, client, [shard], partitions,
                                                       landed.identity, shown))
        except SettledElsewhere as settled:
            yield from settled.results

    return file_ingestion


def _landed_name(context: dg.AssetExecutionContext, source: FileSource, owner: str) -> str:
    """The path of the run's partition's file (a shortened key is looked up)."""
    try:
        return landed_file_of(context.instance, context.run.tags, context.partition_key,
                              source)
    except InvalidUpdates as e:
        raise dg.Failure(description=str(e), metadata={
            "partition": context.partition_key, "owner": owner}, allow_retries=False) from None


def split_routed(table: pa.Table, route: RouteConfig, shown: str) -> dict[str, pa.Table]:
    """``{shard name: its k/v/t/d rows}`` of a route's file (every shard of the route,
    with no rows where the file has none).

    Raises:
        InvalidUpdates: a row's route column names no shard of the route.
    """
    column = table.column(route.column)
    unknown = pc.invert(pc.is_in(column, value_set=pa.array(list(route.targets),
                                                             pa.string())))
    bad = pc.sum(unknown).as_py() or 0
    if bad:
        first = unknown.to_pylist().index(True)
        values = sorted(set(pc.filter(column, unknown).to_pylist()))
        shown_values = ", ".join(repr(v) for v in values[:5]) + (", ..." if len(values) > 5
                                                                  else "")
        raise InvalidUpdates(
            f"{shown}: row {first + 1}: {bad} row(s) have a {route.column} that names no "
            f"shard of route {route.name} ({shown_values}); accepted: "
            f"{', '.join(repr(v) for v in route.targets)}")
    updates = table.drop_columns([route.column])
    return {shard: updates.filter(pc.equal(column, value))
            for value, shard in route.targets.items()}


def _ingest_routed(context: dg.AssetExecutionContext, client: PersistClient,
                   route: RouteConfig, by_name: Mapping[str, ShardConfig], name: str,
                   selected: set[str]) -> Iterator[dg.MaterializeResult]:
    """Write the route's landed file ``name`` to every shard of the route at once."""
    partition = context.partition_key
    shards = [by_name[s] for s in route.targets.values()]
    keys = [shard_key(s.name) for s in shards]
    wanted = ", ".join(f"ingest/{s.name}" for s in shards)
    if not selected & {s.name for s in shards}:
        context.log.warning(f"partition {partition} is a file of route {route.name}: "
                            f"nothing written (materialize it on {wanted})")
        return
    if not {s.name for s in shards} <= selected:
        # Writing some of the route's shards would break the file's atomicity.
        raise dg.Failure(description=f"partition {partition} is a file of route "
                                     f"{route.name}, committed to {wanted} together: "
                                     "select all of them", allow_retries=False)
    source = route.source
    shown = display_name(source, name)
    meta = {"file": shown, "route": route.name}
    try:
        landed = stat_landed(source, name)
    except InvalidUpdates as e:
        raise dg.Failure(description=str(e), metadata=meta, allow_retries=False) from None
    # The shards commit together, so one recorded materialization means all committed;
    # a run that died between its shards' records left the others to record now.
    partitions = file_partition_keys(route.name, name)
    done = {s.name: ingested_by(context.instance, k, partitions, landed.identity)
            for s, k in zip(shards, keys, strict=True)}
    by = next((run for run in done.values() if run is not None), None)
    if by is not None:
        context.log.info(f"{shown} ({landed.identity}) was already ingested by run "
                         f"{by}: nothing written (each file is ingested once)")
        missing = [s for s in shards if done[s.name] is None]
        if missing:
            context.log.warning(f"{shown}: run {by} stopped before recording "
                                f"{', '.join(s.name for s in missing)}; recorded now")
            yield from recovered_materializations(client, missing, shown,
                                                  landed.identity, by)
        return
    other = earlier_active_run(context.instance, context.run.run_id, keys[0], partitions)
    if other is not None:
        raise dg.Failure(description=f"run {other} is already ingesting {shown}: this "
                                     "run writes nothing, so the file is ingested once "
                                     "(re-run this partition if that run fails)",
                                     allow_retries=False)
    try:
        table = read_landed(source, name, route=route.column)  # before touching a shard
        if stat_landed(source, name).identity != landed.identity:
            raise InvalidUpdates(f"{shown}: changed while it was read; the landing "
                                 "sensor ingests the new version")
        parts = split_routed(table, route, shown)
    except InvalidUpdates as e:
        raise dg.Failure(description=str(e), metadata=meta, allow_retries=False) from None
    for shard in shards:
        try:
            register_shard_name(client, shard)
        except InvalidConfig as e:  # the config name is another shard's
            raise dg.Failure(description=str(e), metadata={"shard": shard.name},
                             allow_retries=False) from None
    writers = {s.name: client.open_writer(s.shard_id, debug=f"dagster run "
                                                           f"{context.run.run_id}")
               for s in shards}

    def intent(name: str, upper: int, token: str) -> None:
        record_intent(context, shard_key(name), partition, landed.identity, token, upper)

    def settle() -> list[dg.MaterializeResult]:
        return settle_intents(context, client, shards, partitions, landed.identity, shown)

    try:
        with released(context, writers.values()):
            try:
                results, plans, latency_ms = commit_routed(client, writers, parts, source,
                                                            shown, landed.identity, intent,
                                                            settle)
            except InvalidUpdates as e:
                raise dg.Failure(description=str(e), metadata=meta,
                                 allow_retries=False) from None
    except SettledElsewhere as settled:
        yield from settled.results
        return
    context.log.info(f"{shown}: route {route.name} committed "
                     f"{sum(p.table.num_rows for p in plans.values())} rows to "
                     f"{len(shards)} shards in one transaction in {latency_ms:.2f} ms")
    for shard in shards:
        metadata = write_metadata(client, shard, results[shard.name], plans[shard.name],
                                  latency_ms)
        metadata[ROUTE] = route.name
        metadata[ROUTE_SHARDS] = len(shards)
        yield dg.MaterializeResult(asset_key=shard_key(shard.name), metadata=metadata)


def commit_routed(client: PersistClient, writers: Mapping[str, WriteHandle],
                  parts: Mapping[str, pa.Table], source: FileSource, shown: str,
                  identity: str, intent: Callable[[str, int, str], None] | None = None,
                  settle: Settle | None = None
                  ) -> tuple[dict[str, WriteResult], dict[str, Planned], float]:
    """One transaction writing each shard's part at its upper, re-planned when another
    writer moved an upper; with ``settle``, each attempt first settles earlier runs'
    writes of the same file (:func:`append`). Returns the results and plans by shard
    name, and the commit's latency in ms.

    Raises:
        SettledElsewhere: an earlier run's write of the file committed (nothing written).
    """
    plans_of = {name: file_plan(parts[name], source, shown, identity) for name in writers}
    uppers = {name: w.fetch_recent_upper() for name, w in writers.items()}
    for _ in range(MAX_ATTEMPTS):
        # Settled first: a target closed after an earlier attempt's commit landed unheard
        # (a lost reply, a run that died) still holds that write, which is recorded then
        # rather than the file failed as written nowhere.
        _settle_before_commit(settle)
        closed = [name for name, upper in uppers.items() if upper is None]
        if closed:
            raise dg.Failure(f"shard(s) {', '.join(closed)} closed: they take no more "
                             "writes, so no shard of the route was written", allow_retries=False)
        plans = {name: plans_of[name](upper) for name, upper in uppers.items()
                 if upper is not None}
        txn = client.transaction()
        for name, planned in plans.items():
            upper = uppers[name]
            assert upper is not None
            token = new_token()
            if intent is not None:
                intent(name, upper, token)
            txn.compare_and_append(writers[name], planned.table, upper, planned.new_upper,
                                   idempotency_token=token)
        started = time.perf_counter()
        try:
            committed = txn.commit()
        except UpperMismatch:
            # Nothing committed: re-plan every shard at its current upper.
            uppers = {name: w.fetch_recent_upper() for name, w in writers.items()}
            continue
        latency_ms = (time.perf_counter() - started) * 1000
        results = {name: committed[str(w.shard_id)] for name, w in writers.items()}
        return results, plans, latency_ms
    raise dg.Failure(f"the uppers of {', '.join(writers)} kept moving; gave up after "
                     f"{MAX_ATTEMPTS} attempts")


# --- exactly once, across a run that died between its commit and its materialization --


def record_intent(context: dg.AssetExecutionContext, key: dg.AssetKey, partition: str,
                  identity: str, token: str, expected_upper: int) -> None:
    """Record, before a landed file's commit, which write it is (an observation in the
    event log): if the run dies after the commit and before Dagster stores the
    materialization, the next run of the file settles it (:func:`settle_intents`) instead
    of writing the file a second time."""
    context.log_event(dg.AssetObservation(
        asset_key=key, partition=partition,
        metadata={FILE_IDENTITY: identity, WRITE_ID: token,
                  EXPECTED_UPPER: expected_upper}))


def _intents(instance: dg.DagsterInstance, key: dg.AssetKey, partitions: Sequence[str],
             identity: str) -> list[tuple[str, str, int]]:
    """``(run id, token, expected upper)`` of every recorded write of this file version,
    under any of its partition keys."""
    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=list(partitions)),
        limit=1000).records
    out = []
    for record in records:
        observation = record.asset_observation
        meta = observation.metadata if observation is not None else {}
        values = {k: getattr(v, "value", v) for k, v in meta.items()}
        if same_file_version(values.get(FILE_IDENTITY), identity) and WRITE_ID in values:
            out.append((record.run_id, str(values[WRITE_ID]),
                        int(values[EXPECTED_UPPER])))
    return out


def settle_intents(context: dg.AssetExecutionContext, client: PersistClient,
                   shards: Sequence[ShardConfig], partitions: Sequence[str], identity: str,
                   shown: str) -> list[dg.MaterializeResult]:
    """The materializations an earlier run committed but never recorded (its process
    died in between), recorded now; empty when no earlier write of this file version
    committed, so the file is to be written.

    A file's shards commit together, so one committed write means all of them did.

    Raises:
        dg.Failure: an earlier run's write cannot be settled (GC truncated the history
            that would tell): writing again could duplicate the file.
    """
    pending = {s.name: _intents(context.instance, shard_key(s.name), partitions, identity)
               for s in shards}
    if not any(pending.values()):
        return []
    committed_by = None
    # An earlier write found committed settles the file, even when another intent's
    # history is gone: every intent is looked at before an unknown one fails the run.
    unknown: tuple[str, str] | None = None
    for shard in shards:
        if not pending[shard.name]:
            continue
        writer = client.open_writer(shard.shard_id, debug=f"dagster run {context.run.run_id}")
        with released(context, [writer]):
            for run_id, token, expected in pending[shard.name]:
                found = writer.committed(token, expected)
                if found is None and unknown is None:
                    unknown = (run_id, shard.name)
                if found:
                    committed_by = run_id
                    break
        if committed_by is not None:
            break
    if committed_by is None and unknown is not None:
        run_id, shard_name = unknown
        raise dg.Failure(
            description=f"{shown}: run {run_id} wrote it to shard {shard_name} and stopped "
                        "before recording the outcome, and the shard's history no longer "
                        "tells whether that write committed; nothing written, so the file "
                        "is not duplicated (check the shard, then land the file again "
                        "under a new name if it is missing)",
            metadata={"file": shown, "shard": shard_name}, allow_retries=False)
    if committed_by is None:
        return []
    if committed_by == context.run.run_id:  # a step retry after a lost commit reply
        context.log.warning(f"{shown}: an earlier attempt of this run committed it without "
                            "learning so; recorded now, nothing written again")
    else:
        context.log.warning(f"{shown}: run {committed_by} committed it and stopped before "
                            "recording it; recorded now, nothing written again")
    return recovered_materializations(client, shards, shown, identity, committed_by)


def recovered_materializations(client: PersistClient, shards: Sequence[ShardConfig],
                               shown: str, identity: str, committed_by: str
                               ) -> list[dg.MaterializeResult]:
    """The materializations of a file version that run ``committed_by`` committed to
    ``shards`` without recording them: recorded now, with nothing written again."""
    summaries = client.shard_summaries()
    out = []
    for shard in shards:
        summary = summaries.get(shard.shard_id)
        out.append(dg.MaterializeResult(asset_key=shard_key(shard.name), metadata={
            FILE: shown, FILE_IDENTITY: identity, RECOVERED_FROM: committed_by,
            UPPER: summary.upper if summary is not None and summary.upper is not None
            else -1,
            SHARD_ID: shard.shard_id}))
    return out
