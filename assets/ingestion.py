"""Ingestion assets: one per shard (``shards/NAME``), each materialization one write.

A materialization appends to the shard with ``compare_and_append`` at the shard's current
upper (retrying if another writer moved it) and reports what the write did: rows,
encoded bytes, placement (inline / wal / blob, decided by the ``inline_policy``
resource's policy inside the library), blob PUTs, write latency, the shard's upper and
inline bytes. Sources:

- ``files``: the run config names one landed file (the landing sensor does that). The
  file is read and validated before anything touches the shard, so a bad file fails
  its run with a message naming the file and line and writes nothing.
- ``synthetic``: the built-in change stream (:mod:`assets.change_stream`).
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from assets.asset_keys import INGESTION_GROUP, shard_key
from assets.change_stream import ChangeStream
from assets.pipeline_config import FileSource, ShardConfig, SyntheticSource
from assets.sources import display_name, read_landed
from persist_pipeline import PersistClient, UpperMismatch, WriteHandle, WriteResult
from persist_pipeline.blob import redact_uri
from persist_pipeline.exceptions import InvalidUpdates
from resources.inline_policy import InlinePolicyResource
from resources.persist import PersistResource

#: How often a write is re-planned when another writer moved the shard's upper.
MAX_ATTEMPTS = 20


class FileIngestConfig(dg.Config):
    """Run config of a ``files`` ingestion asset."""

    file: str = Field(
        default="",
        description="The landed file to ingest, relative to the landing folder / S3 prefix. "
                    "The landing sensor sets it.")


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


def append(writer: WriteHandle, plan: Callable[[int], Planned]) -> tuple[WriteResult, Planned,
                                                                         float]:
    """Write ``plan(upper)`` at the shard's upper, re-planning on an upper mismatch.

    Returns the result, the plan that was written and the write latency in ms.
    """
    upper = writer.fetch_recent_upper()
    for _ in range(MAX_ATTEMPTS):
        if upper is None:
            raise dg.Failure(f"shard {writer.shard_id} is closed: it takes no more writes")
        planned = plan(upper)
        started = time.perf_counter()
        try:
            result = writer.compare_and_append(planned.table, upper, planned.new_upper)
        except UpperMismatch as mismatch:
            upper = mismatch.current
            continue
        return result, planned, (time.perf_counter() - started) * 1000
    raise dg.Failure(f"shard {writer.shard_id}: the upper kept moving; gave up after "
                     f"{MAX_ATTEMPTS} attempts")


def write_metadata(client: PersistClient, shard: ShardConfig, result: WriteResult,
                   planned: Planned, latency_ms: float) -> dict[str, Any]:
    """What a materialization reports (numbers are plotted by the UI)."""
    info = client.inspect(shard.shard_id)
    return {
        "rows": planned.table.num_rows,
        "updates_stored": result.num_updates,
        "encoded_bytes": result.encoded_bytes,
        "placement": result.placement,
        "inline": int(result.placement == "inline"),
        "blob_puts": result.num_parts,
        "fell_back": result.fell_back,
        "write_latency_ms": round(latency_ms, 3),
        "shard_upper": result.upper if result.upper is not None else -1,
        "shard_inline_bytes": info["inline_bytes"],
        "inline_max_bytes": client.inline_policy.max_bytes,
        "seqno": result.seqno,
        "shard_id": shard.shard_id,
        **planned.metadata,
    }


def _write(context: dg.AssetExecutionContext, client: PersistClient, shard: ShardConfig,
           plan: Callable[[int], Planned]) -> dg.MaterializeResult:
    writer = client.open_writer(shard.shard_id, debug=f"dagster run {context.run.run_id}")
    try:
        try:
            result, planned, latency_ms = append(writer, plan)
        except InvalidUpdates as e:
            raise dg.Failure(description=str(e), metadata={"shard": shard.name}) from None
    finally:
        writer.expire()
    metadata = write_metadata(client, shard, result, planned, latency_ms)
    context.log.info(
        f"shard {shard.name}: {planned.table.num_rows} rows, {result.encoded_bytes} bytes "
        f"-> {result.placement}{' (inline budget full: fell through)' if result.fell_back else ''}"
        f" in {latency_ms:.2f} ms; upper {result.upper}, inline bytes "
        f"{metadata['shard_inline_bytes']}")
    return dg.MaterializeResult(metadata=metadata)


def _restamp(table: pa.Table, t: int) -> pa.Table:
    return table.set_column(2, "t", pa.array([t] * table.num_rows, pa.int64()))


def file_plan(table: pa.Table, source: FileSource, shown: str) -> Callable[[int], Planned]:
    """How a landed file is written at a given upper (see :class:`FileSource`.times)."""
    extra = {"file": shown}

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
            "inserts": changes.inserts, "updates": changes.updates, "deletes": changes.deletes})

    return plan


def change_stream(source: SyntheticSource) -> ChangeStream:
    return ChangeStream(source.keys, source.events_per_write, source.seed, source.value_bytes)


def _describe_source(shard: ShardConfig) -> str:
    src = shard.source
    if isinstance(src, FileSource):
        where = redact_uri(src.uri)  # as configured: templates are not expanded here
        return f"files ({', '.join(src.formats)}) landing in {where}; times: {src.times}"
    return (f"synthetic change stream: {src.keys} keys, {src.events_per_write} changes per "
            f"write, seed {src.seed}")


def build_ingestion_asset(shard: ShardConfig) -> dg.AssetsDefinition:
    """The ingestion asset ``shards/NAME`` of one shard."""
    key = shard_key(shard.name)
    description = (shard.description or f"Shard {shard.name}.") + \
        f" Each materialization is one compare_and_append. Source: {_describe_source(shard)}."
    common: dict[str, Any] = dict(
        key=key, group_name=INGESTION_GROUP, description=description, kinds={"persist"},
        metadata={"shard_id": shard.shard_id, "source": _describe_source(shard)})
    source = shard.source

    if isinstance(source, FileSource):
        file_source = source

        @dg.asset(**common)
        def ingest_file(context: dg.AssetExecutionContext, config: FileIngestConfig,
                        persist: PersistResource,
                        inline_policy: InlinePolicyResource) -> dg.MaterializeResult:
            if not config.file:
                raise dg.Failure(f"shard {shard.name}: no file given; set the run config "
                                 "'file' (the landing sensor does)")
            shown = display_name(file_source, config.file)
            try:
                table = read_landed(file_source, config.file)  # before touching the shard
            except InvalidUpdates as e:
                raise dg.Failure(description=str(e),
                                 metadata={"file": shown, "shard": shard.name}) from None
            client = persist.client(inline_policy.policy())
            return _write(context, client, shard, file_plan(table, file_source, shown))

        return ingest_file

    stream = change_stream(source)

    @dg.asset(**common)
    def ingest_synthetic(context: dg.AssetExecutionContext, config: SyntheticIngestConfig,
                         persist: PersistResource,
                         inline_policy: InlinePolicyResource) -> dg.MaterializeResult:
        client = persist.client(inline_policy.policy())
        return _write(context, client, shard, synthetic_plan(stream, config.events))

    return ingest_synthetic


def build_ingestion_assets(shards: tuple[ShardConfig, ...]) -> Iterator[dg.AssetsDefinition]:
    for shard in shards:
        yield build_ingestion_asset(shard)
