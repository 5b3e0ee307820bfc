"""``PersistIOManager``: Dagster assets stored in persist shards.

An asset's output (a pyarrow ``Table``, a pandas or a polars ``DataFrame``) is stored in
a shard named after the asset key; each partition of a partitioned asset has a shard of
its own. Each materialization is ONE ``compare_and_append`` that makes the shard's
contents equal to the output: rows no longer there are retracted (diff -1), new rows
added, unchanged rows left alone, at one new time; the shard's upper advances by one.
Concurrent materializations of the same shard serialize on the upper (the loser re-reads
and re-diffs), so the shard always equals one of the outputs, never a mix.

Downstream inputs load the latest snapshot, or the contents as of a given ``upper``
(input metadata ``{"upper": N}``: what the materialization that reported
``shard_upper == N`` stored). How rows are encoded: :mod:`persist_pipeline.dagster_io.encoding`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from typing import Any

import dagster as dg
import pyarrow as pa
from pydantic import Field, PrivateAttr

from persist_pipeline.client import PersistClient
from persist_pipeline.config import (
    INLINE_UPDATE_MAX_BYTES,
    INLINE_UPDATE_THRESHOLD_BYTES,
    InlinePolicy,
)
from persist_pipeline.dagster_io import encoding
from persist_pipeline.dagster_io.templates import expand_env
from persist_pipeline.exceptions import InvalidInput, PersistError, ShardNotFound, UpperMismatch
from persist_pipeline.ids import ShardId

#: Shard ids of IO-managed assets live in this UUID namespace: the same asset key (and
#: partition) maps to the same shard on every machine, so concurrent first writes agree.
ASSET_SHARD_NAMESPACE = uuid.UUID("0b6d9f3e-8a57-4c1e-9d2f-5e3a1c7b4f60")

#: How often a write re-reads and re-diffs when another writer moved the upper.
MAX_ATTEMPTS = 20


class AssetNotStored(PersistError, LookupError):
    """An input asset (or partition) has never been stored by the IO manager."""


class UnsupportedOutput(InvalidInput, TypeError):
    """An output the IO manager cannot store (not a table or data frame)."""


def asset_shard_id(asset_key: dg.AssetKey, partition_key: str | None = None) -> str:
    """The shard of ``asset_key`` (and ``partition_key``): a UUIDv5 of both, stable."""
    name = json.dumps(list(asset_key.path))
    if partition_key is not None:
        name += "\n" + partition_key  # a partition key never contains a newline
    return str(ShardId(uuid.uuid5(ASSET_SHARD_NAMESPACE, name)))


def to_arrow(obj: object) -> pa.Table:
    """``obj`` as a pyarrow Table: a Table, RecordBatch, pandas or polars DataFrame."""
    if isinstance(obj, pa.Table):
        return obj
    if isinstance(obj, pa.RecordBatch):
        return pa.Table.from_batches([obj])
    module = type(obj).__module__.split(".")[0]
    if module == "pandas" and type(obj).__name__ == "DataFrame":
        return pa.Table.from_pandas(obj)
    if module == "polars" and type(obj).__name__ == "DataFrame":
        return obj.to_arrow()  # type: ignore[attr-defined]
    raise UnsupportedOutput(
        f"PersistIOManager stores a pyarrow Table, a pandas or a polars DataFrame; got "
        f"{type(obj).__module__}.{type(obj).__qualname__}")


def from_arrow(table: pa.Table, typing_type: object) -> Any:
    """``table`` as the type an input asks for (pandas / polars DataFrame, else Arrow)."""
    module = getattr(typing_type, "__module__", "").split(".")[0]
    name = getattr(typing_type, "__name__", "")
    if module == "pandas" and name == "DataFrame":
        return table.to_pandas()
    if module == "polars" and name == "DataFrame":
        import polars as pl

        return pl.from_arrow(table)
    return table


def column_schema(schema: pa.Schema) -> dg.TableSchema:
    """The Arrow schema as Dagster's ``dagster/column_schema`` (a field's ``description``
    metadata, if any, becomes the column's description)."""
    columns = []
    for f in schema:
        raw = (f.metadata or {}).get(b"description")
        columns.append(dg.TableColumn(
            f.name, str(f.type), description=raw.decode("utf-8", "replace") if raw else None,
            constraints=dg.TableColumnConstraints(nullable=f.nullable)))
    return dg.TableSchema(columns=columns)


class PersistIOManager(dg.ConfigurableIOManager):
    """Stores asset outputs in persist shards; loads inputs from them.

    Configure the location like the ``persist`` resource (``${VAR}`` templates are
    expanded when a client is opened, so secrets never show in the UI)::

        defs = dg.Definitions(assets=[...], resources={"io_manager": PersistIOManager(
            consensus_uri="postgresql://app@db/persist", blob_uri="s3://bucket/prefix")})
    """

    consensus_uri: str = Field(
        description="Consensus URI: postgresql://, cockroachdb://, sqlite:///PATH. "
                    "${VAR} / ${VAR:-default} are expanded at run time.")
    blob_uri: str = Field(
        description="Main blob store: s3://bucket/prefix?endpoint_url=..., file:///dir. "
                    "Templates are expanded at run time.")
    wal_blob_uri: str = Field(default="", description="Optional low-latency blob store for "
                                                      "fresh write parts; empty for none.")
    persist_inline_update_threshold_bytes: int = Field(
        default=INLINE_UPDATE_THRESHOLD_BYTES, ge=0,
        description="A write whose encoded size is strictly below this may be inlined.")
    persist_inline_update_max_bytes: int = Field(
        default=INLINE_UPDATE_MAX_BYTES, ge=0,
        description="The most inline bytes one shard may hold.")

    _client: PersistClient | None = PrivateAttr(default=None)

    # --- the client ----------------------------------------------------------------------

    def client(self) -> PersistClient:
        """This run's client (opened on first use, closed when the run ends)."""
        if self._client is None:
            consensus = expand_env(self.consensus_uri, what="io_manager.consensus_uri").strip()
            blob = expand_env(self.blob_uri, what="io_manager.blob_uri").strip()
            wal = expand_env(self.wal_blob_uri, what="io_manager.wal_blob_uri").strip()
            self._client = PersistClient.open(
                consensus, blob, wal or None,
                inline_policy=InlinePolicy(self.persist_inline_update_threshold_bytes,
                                           self.persist_inline_update_max_bytes))
        return self._client

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._client = None  # this run's own client, never a copy's

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            client.close()

    # --- outputs -------------------------------------------------------------------------

    def handle_output(self, context: dg.OutputContext, obj: object) -> None:
        if not context.has_asset_key:
            raise UnsupportedOutput("PersistIOManager stores asset outputs only (an op output "
                                    "has no asset key to name its shard)")
        table = to_arrow(obj)
        partition = None
        if context.has_asset_partitions:
            keys = context.asset_partition_keys
            if len(keys) != 1:
                raise UnsupportedOutput(
                    f"{context.asset_key.to_user_string()}: one output covers {len(keys)} "
                    "partitions; PersistIOManager stores one partition per run (launch a "
                    "backfill with one run per partition)")
            partition = keys[0]
        shard_id = asset_shard_id(context.asset_key, partition)
        metadata = self.store(shard_id, table, debug=f"dagster run {context.run_id}")
        context.add_output_metadata(metadata)

    def store(self, shard_id: str, table: pa.Table, *, debug: str = "") -> dict[str, Any]:
        """Make ``shard_id`` hold exactly ``table``, in one write; returns its metadata."""
        desired = encoding.contents_for(table)
        client = self.client()
        writer = client.open_writer(shard_id, debug=debug)
        try:
            upper = writer.fetch_recent_upper()
            for _ in range(MAX_ATTEMPTS):
                if upper is None:
                    raise InvalidInput(f"shard {shard_id} is closed: it takes no more writes")
                current = self._contents(client, shard_id, upper)
                updates = list(encoding.diff(current, desired))
                data = pa.table({
                    "k": pa.array([u[0] for u in updates], pa.binary()),
                    "v": pa.array([u[1] for u in updates], pa.binary()),
                    "t": pa.array([upper] * len(updates), pa.int64()),
                    "d": pa.array([u[2] for u in updates], pa.int64())})
                started = time.perf_counter()
                try:
                    result = writer.compare_and_append(data, upper, upper + 1)
                except UpperMismatch as mismatch:
                    upper = mismatch.current
                    continue
                latency_ms = (time.perf_counter() - started) * 1000
                break
            else:
                raise PersistError(f"shard {shard_id}: the upper kept moving; gave up after "
                                   f"{MAX_ATTEMPTS} attempts")
        finally:
            writer.expire()
        added = sum(d for k, _, d in updates if d > 0 and k != encoding.SCHEMA_KEY)
        retracted = -sum(d for k, _, d in updates if d < 0 and k != encoding.SCHEMA_KEY)
        return {
            "dagster/row_count": table.num_rows,
            "dagster/column_schema": column_schema(table.schema),
            "shard_upper": result.upper if result.upper is not None else -1,
            "rows_added": added,
            "rows_retracted": retracted,
            "placement": result.placement,
            "encoded_bytes": result.encoded_bytes,
            "write_latency_ms": round(latency_ms, 3),
            "shard_id": shard_id,
        }

    @staticmethod
    def _contents(client: PersistClient, shard_id: str, upper: int
                  ) -> Counter[tuple[bytes, bytes]]:
        if upper == 0:
            return Counter()
        snap = _snapshot(client, shard_id, upper - 1)
        return Counter({(k, v): d for k, v, d in zip(
            snap.column("k").to_pylist(), snap.column("v").to_pylist(),
            snap.column("d").to_pylist(), strict=True)})

    # --- inputs --------------------------------------------------------------------------

    def load_input(self, context: dg.InputContext) -> Any:
        key = context.asset_key
        wanted = (context.definition_metadata or {}).get("upper")
        partitions: list[str | None] = (list(context.asset_partition_keys)
                                        if context.has_asset_partitions else [None])
        tables = [self.load(asset_shard_id(key, p), upper=wanted,
                            what=key.to_user_string() + (f" partition {p}" if p else ""))
                  for p in partitions]
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        return from_arrow(table, context.dagster_type.typing_type)

    def load(self, shard_id: str, *, upper: int | None = None, what: str = "") -> pa.Table:
        """The table stored in ``shard_id``: its latest version, or as of ``upper``.

        Raises:
            AssetNotStored: nothing was ever stored there.
            InvalidInput: ``upper`` is beyond the shard's upper or not positive.
            SinceViolation: ``upper`` is so old that compaction merged it away.
        """
        client = self.client()
        what = what or shard_id
        try:
            current = client.inspect(shard_id)["upper"]
        except ShardNotFound:
            raise AssetNotStored(f"{what}: nothing stored yet (shard {shard_id} does not "
                                 "exist): materialize it first") from None
        if current in (None, 0):
            raise AssetNotStored(f"{what}: nothing stored yet (shard {shard_id})")
        if upper is not None:
            if isinstance(upper, bool) or not isinstance(upper, int) or upper < 1 \
                    or upper > current:
                raise InvalidInput(f"{what}: input metadata upper={upper!r} must be an "
                                   f"integer in [1, {current}] (the shard's upper)")
            current = upper
        snap = _snapshot(client, shard_id, current - 1)
        return encoding.table_from_contents(
            zip(snap.column("k").to_pylist(), snap.column("v").to_pylist(),
                snap.column("d").to_pylist(), strict=True), what)


def _snapshot(client: PersistClient, shard_id: str, as_of: int) -> pa.Table:
    reader = client.open_reader(shard_id, debug="PersistIOManager")
    try:
        return reader.snapshot(as_of)
    finally:
        reader.expire()
