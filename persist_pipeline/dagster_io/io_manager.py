"""``PersistIOManager``: Dagster assets stored in typed, named persist shards.

An asset's output (a pyarrow ``Table``, a pandas or a polars ``DataFrame``) is stored in
a typed shard named after the asset key (``sales/orders``); each partition of a
partitioned asset has a shard of its own (``sales/orders/_partitions/eu``); an asset
whose definition metadata declares ``dagster/table_name`` is stored in and loaded from
the shard of that name instead (:func:`table_name`). What is
stored is an ordinary shard that every other entry point reads by that name: the CLI,
read plans in DuckDB and polars, Spark's ``format("persist")``. How tables map to
shards, names, keys and schema generations: :mod:`persist_pipeline.tables`.

Each materialization is ONE ``compare_and_append``
(:meth:`~persist_pipeline.WriteHandle.replace_contents`) that makes the shard's contents
equal to the output: rows no longer there are retracted, new rows added, unchanged rows
left alone, at one new time; the shard's upper advances by one. Output metadata
``{"primary_key": ["id"]}`` makes it a keyed shard (a row per key). Concurrent
materializations of one shard serialize on the upper, so the shard always equals one
of the outputs, never a mix. After a write the IO manager keeps the shard compacted
itself (or leaves it to a Spark job: :func:`compaction_definitions`).

Downstream inputs load the latest version, or the one a materialization reported as
``persist/upper == N``, with the columns it was stored with (input metadata
``{"upper": N}``; refused as ambiguous when a
schema change started a generation that also reached ``N``); input metadata ``{"columns":
[...]}`` loads only those columns. Shards written by versions of the library before
typed shards (:func:`asset_shard_id`) are read until the asset is stored again.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import dagster as dg
import pyarrow as pa
from pydantic import Field, PrivateAttr

from persist_pipeline import tables
from persist_pipeline.blob import redact_uri
from persist_pipeline.client import PersistClient
from persist_pipeline.config import (
    INLINE_UPDATE_MAX_BYTES,
    INLINE_UPDATE_THRESHOLD_BYTES,
    InlinePolicy,
)
from persist_pipeline.dagster_io import encoding
from persist_pipeline.dagster_io.locations import make_local_dirs
from persist_pipeline.dagster_io.templates import expand_env
from persist_pipeline.exceptions import (
    InvalidConfig,
    InvalidInput,
    LocationNotFound,
    NotYetAvailable,
    PersistError,
    ShardNameNotFound,
)
from persist_pipeline.ids import ShardId
from persist_pipeline.internal import paths
from persist_pipeline.plan import file_uri
from persist_pipeline.tables import (
    UnsupportedOutput,
    asset_shard_name,
    pandas_index_columns,
)

#: Shard ids of IO-managed assets live in this UUID namespace: the same asset key (and
#: partition) maps to the same shard on every machine, so concurrent first writes agree.
ASSET_SHARD_NAMESPACE = uuid.UUID("0b6d9f3e-8a57-4c1e-9d2f-5e3a1c7b4f60")

#: How often a write re-reads and re-diffs when another writer moved the upper.
MAX_ATTEMPTS = 20


class AssetNotStored(PersistError, LookupError):
    """An input asset (or partition) has never been stored by the IO manager."""


def asset_shard_id(asset_key: dg.AssetKey, partition_key: str | None = None) -> str:
    """Where versions of the library before typed shards stored ``asset_key`` (and
    ``partition_key``): a UUIDv5 of both. Read until the asset is stored again (or
    :meth:`PersistIOManager.migrate`); new writes go to the shard named by
    :func:`~persist_pipeline.tables.asset_shard_name`."""
    name = json.dumps(list(asset_key.path))
    if partition_key is not None:
        name += "\n" + partition_key  # a partition key never contains a newline
    return str(ShardId(uuid.uuid5(ASSET_SHARD_NAMESPACE, name)))


#: Definition metadata naming the table an asset is stored under, when it is not the one
#: named after its key: Dagster's own table-name entry (ingestion declares its shard's).
TABLE_NAME = "dagster/table_name"


def declared_table_name(metadata: Mapping[str, Any] | None, key: dg.AssetKey) -> str | None:
    """The table name ``key``'s definition metadata declares (:data:`TABLE_NAME`), if any.

    Raises:
        InvalidInput: the declared name is not a non-empty string.
    """
    declared = (metadata or {}).get(TABLE_NAME)
    if declared is None:
        return None
    value = getattr(declared, "value", declared)  # a raw string or a MetadataValue
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{key.to_user_string()}: definition metadata {TABLE_NAME} must "
                           f"be a table name (a non-empty string), got {value!r}")
    return value


def table_name(key: dg.AssetKey, partition: str | None,
               metadata: Mapping[str, Any] | None) -> str:
    """The table (shard name) an asset (partition) is stored under: the name its
    definition metadata declares as :data:`TABLE_NAME`, else the one named after its
    key (:func:`~persist_pipeline.tables.asset_shard_name`).

    Raises:
        UnsupportedOutput: a partitioned asset declares a table name (one table would
            hold every partition, and storing one partition would replace the others).
        InvalidInput: the declared name is not a string.
    """
    declared = declared_table_name(metadata, key)
    if declared is None:
        return asset_shard_name(key.path, partition)
    if partition is not None:
        raise UnsupportedOutput(
            f"{key.to_user_string()}: a partitioned asset's partitions are stored in shards "
            f"of their own, named after its key; its definition metadata {TABLE_NAME}="
            f"{declared!r} would make each partition replace the others (remove it)")
    return declared


def to_arrow(obj: object) -> pa.Table:
    """``obj`` as a pyarrow Table: a Table, RecordBatch, pandas or polars DataFrame.

    Raises:
        UnsupportedOutput: anything else, or a frame pyarrow cannot convert.
    """
    if isinstance(obj, pa.Table):
        return obj
    if isinstance(obj, pa.RecordBatch):
        return pa.Table.from_batches([obj])
    module = type(obj).__module__.split(".")[0]
    name = type(obj).__name__
    try:
        if module == "pandas" and name == "DataFrame":
            return pa.Table.from_pandas(obj)
        if module == "polars" and name == "DataFrame":
            return obj.to_arrow()  # type: ignore[attr-defined]
    except (pa.ArrowException, TypeError, ValueError) as e:
        # Bad input, refused before anything is stored: a column name twice, an object
        # column mixing ints and text (pyarrow's own errors are no PersistError).
        raise UnsupportedOutput(f"the {module} DataFrame cannot be stored as an Arrow "
                                f"table: {e}") from None
    raise UnsupportedOutput(
        f"PersistIOManager stores a pyarrow Table, a pandas or a polars DataFrame; got "
        f"{type(obj).__module__}.{type(obj).__qualname__}")


def from_arrow(table: pa.Table, typing_type: object) -> Any:
    """``table`` as the type an input asks for (pandas / polars DataFrame, else Arrow)."""
    module = getattr(typing_type, "__module__", "").split(".")[0]
    name = getattr(typing_type, "__name__", "")
    if _is_pandas_frame(typing_type):
        return table.to_pandas()
    if module == "polars" and name == "DataFrame":
        import polars as pl

        return pl.from_arrow(table)
    return table


def _concat_partitions(loaded: list[pa.Table], partitions: list[str | None],
                       what: str) -> pa.Table:
    """The partitions' tables as one: a column of nulls only in one partition (Arrow's
    null type, e.g. an all-None pandas column) takes the others' type, and a column
    missing from one is null there. Types that do not combine are a typed error."""
    try:
        return pa.concat_tables(loaded, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise InvalidInput(f"{what}: its partitions {partitions} were stored with schemas "
                           f"that do not combine into one table ({e}); load them one "
                           f"partition at a time") from None


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
    maintenance: Literal["inline", "external"] = Field(
        default="inline",
        description="inline: after a write, compact the shard in this process when it has "
                    "pending merges (bounded memory) and run GC every gc_every writes. "
                    "external: leave it to a compaction job (compaction_definitions).")
    gc_every: int = Field(default=16, ge=1, description="With inline maintenance, run GC "
                                                        "on a shard every this many writes.")

    _client: PersistClient | None = PrivateAttr(default=None)

    # --- the client ----------------------------------------------------------------------

    def client(self, create: bool = True) -> PersistClient:
        """This run's client (opened on first use, closed when the run ends).

        ``create=False`` (loads) opens an existing location only: a load never creates a
        store, so a mistyped URI is reported as such instead of leaving an empty one.

        Raises:
            LocationNotFound: ``create`` is False and nothing is stored at the URIs.
        """
        if self._client is None:
            consensus = expand_env(self.consensus_uri, what="io_manager.consensus_uri").strip()
            blob = expand_env(self.blob_uri, what="io_manager.blob_uri").strip()
            wal = expand_env(self.wal_blob_uri, what="io_manager.wal_blob_uri").strip()
            if create:  # as the persist resource does with the same URIs
                for uri in (consensus, blob, wal):
                    make_local_dirs(uri)
            self._client = PersistClient.open(
                consensus, blob, wal or None, create=create,
                inline_policy=InlinePolicy(self.persist_inline_update_threshold_bytes,
                                           self.persist_inline_update_max_bytes))
        return self._client

    def _existing_client(self, what: str) -> PersistClient:
        """The client, for a read: a read never creates the store.

        Raises:
            AssetNotStored: no persist store exists at the URIs (nothing was created).
        """
        try:
            return self.client(create=False)
        except LocationNotFound as e:
            raise AssetNotStored(f"{what}: nothing stored yet, and no persist store exists "
                                 f"at this IO manager's URIs ({e}); check them, or "
                                 "materialize it first (its first store creates the "
                                 "store)") from None

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
        declared = (context.definition_metadata or {}).get("primary_key")
        name = table_name(context.asset_key, partition, context.definition_metadata)
        metadata = self.store(name, table, primary_key=_key_columns(declared),
                              debug=f"dagster run {context.run_id}")
        reason = metadata.get("persist/new_generation")
        if reason:
            # A new generation is a new shard that loads read from now on: say so, as
            # a flip between two shapes of one asset (a filtered frame one run, an
            # unfiltered one the next) would otherwise start shard after shard unseen.
            context.log.warning(f"{name}: stored in a new generation, "
                                f"{metadata['dagster/table_name']}, because its schema "
                                f"changed: {reason}. Loads read it from now on; earlier "
                                f"generations stay readable by their names.")
        context.add_output_metadata(metadata)

    def store(self, name: str, table: pa.Table, *, primary_key: Sequence[str] | None = None,
              debug: str = "") -> dict[str, Any]:
        """Make the shard named ``name`` hold exactly ``table``, in one write (see
        :mod:`persist_pipeline.tables`); then keep it compacted (unless ``maintenance``
        is ``"external"``).
        Returns the materialization's metadata.

        Raises:
            UnsupportedOutput: a column type cannot be stored.
            InvalidInput: ``primary_key`` does not name columns of the table, or a key
                appears twice.
        """
        client = self.client()
        started = time.perf_counter()
        stored = tables.store_table(client, name, table, primary_key, debug=debug)
        latency_ms = (time.perf_counter() - started) * 1000
        return self._metadata(client, table, primary_key, stored, latency_ms)

    def store_many(self, outputs: Mapping[str, object], *,
                   primary_keys: Mapping[str, Sequence[str]] | None = None,
                   debug: str = "") -> dict[str, dict[str, Any]]:
        """Store several tables in ONE transaction: every shard named in ``outputs``
        holds its table afterwards, or none changed. For a multi-asset whose outputs
        must change together: store them here and return a ``MaterializeResult`` per
        asset with the metadata returned for it (see the README).

        Args:
            outputs: each shard name (:func:`~persist_pipeline.tables.asset_shard_name`
                of an asset key) and its table (anything :meth:`handle_output` takes).
            primary_keys: the key columns of some of the tables.

        Returns:
            Each name's materialization metadata, as :meth:`store` returns it.
        """
        keys = primary_keys or {}
        converted = {name: (to_arrow(obj), _key_columns(keys.get(name)))
                     for name, obj in outputs.items()}
        client = self.client()
        started = time.perf_counter()
        stored = tables.store_tables(client, converted, debug=debug)
        latency_ms = (time.perf_counter() - started) * 1000
        return {name: self._metadata(client, converted[name][0], converted[name][1],
                                     stored[name], latency_ms) for name in outputs}

    def _metadata(self, client: PersistClient, table: pa.Table,
                  primary_key: Sequence[str] | None, stored: tables.Stored,
                  latency_ms: float) -> dict[str, Any]:
        result, generation_of, shard = stored.result, stored.name, stored.shard
        maintenance = self._maintain(client, shard, result.upper)
        upper = result.upper if result.upper is not None else -1
        return {
            "dagster/table_name": generation_of,
            "dagster/uri": _data_uri(client, shard),
            "dagster/row_count": table.num_rows,
            "dagster/column_schema": column_schema(table.schema),
            "persist/shard_id": str(shard),
            "persist/upper": upper,
            "persist/primary_key": list(primary_key or []),
            "persist/rows_added": result.rows_added,
            "persist/rows_retracted": result.rows_retracted,
            "persist/placement": result.placement,
            "persist/stored_bytes": result.encoded_bytes,
            "persist/write_latency_ms": round(latency_ms, 3),
            **({"persist/new_generation": stored.new_generation}
               if stored.new_generation else {}),
            **maintenance,
        }

    def _maintain(self, client: PersistClient, shard: ShardId,
                  upper: int | None) -> dict[str, Any]:
        """Compact the shard in this process when it has pending merges (bounded memory),
        and run GC every ``gc_every`` writes (also right after a compaction that merged);
        nothing when maintenance is external (a Spark compaction sensor does it)."""
        if self.maintenance == "external":
            return {}
        out: dict[str, Any] = {"persist/merges_applied": 0}
        state = client.inspect(shard)
        # Merges of several batches keep the part count logarithmic; inline data alone is
        # flushed only as the shard's inline budget fills (small writes stay one SQL
        # round trip, without a synchronous flush after each).
        merging = any(entry["batches"] > 1 for entry in state["spine"])
        # This process's writes fall through at its effective max (its own, never beyond
        # the shard's recorded one): compact at half of it.
        if merging or state["inline_bytes"] * 2 >= max(1, state["inline_max_bytes_effective"]):
            metrics = client.compact(shard)
            out["persist/merges_applied"] = metrics["applied"]
        if out["persist/merges_applied"] or (upper is not None and upper % self.gc_every == 0):
            out["persist/blobs_deleted"] = client.gc(shard)["blobs_deleted"]
        return out

    # --- inputs --------------------------------------------------------------------------

    def load_input(self, context: dg.InputContext) -> Any:
        key = context.asset_key
        wanted = (context.definition_metadata or {}).get("upper")
        columns = (context.definition_metadata or {}).get("columns")
        partitions: list[str | None] = (list(context.asset_partition_keys)
                                        if context.has_asset_partitions else [None])
        upstream = context.upstream_output
        declared = declared_table_name(upstream.definition_metadata if upstream else None,
                                       key)
        if declared is not None:
            # The asset declares the one table it is stored under (ingestion's
            # ``ingest/NAME`` is shard NAME): all of its partitions are in it.
            partitions = [None]
            loaded = [self.load(declared, upper=wanted, what=key.to_user_string())]
        else:
            loaded = [self.load(asset_shard_name(key.path, p), upper=wanted,
                                what=key.to_user_string() + (f" partition {p}" if p else ""),
                                legacy_shard=asset_shard_id(key, p))
                      for p in partitions]
        table = loaded[0] if len(loaded) == 1 else _concat_partitions(
            loaded, partitions, key.to_user_string())
        typing_type = context.dagster_type.typing_type
        if columns is not None:
            table = _project(table, columns, key.to_user_string(),
                             keep_pandas_index=_is_pandas_frame(typing_type))
        return from_arrow(table, typing_type)

    def load(self, name: str, *, upper: int | None = None, what: str = "",
             legacy_shard: str | None = None) -> pa.Table:
        """The table stored under ``name`` (its newest generation): its latest version,
        or the one its materialization reported as ``persist/upper == upper``.

        ``legacy_shard``: where a version of the library before typed shards stored it
        (read when ``name`` has no generation yet; the next materialization moves it).

        Raises:
            AssetNotStored: nothing was ever stored there (also a name whose store died
                before its write).
            InvalidInput: ``upper`` is beyond the shard's upper or not positive.
            SinceViolation: ``upper`` is so old that compaction merged it away.
            NotATable: other writers' appends left the shard holding what no table is
                (a key twice, a row retracted that was never stored).
            ResourceExhausted: other writers' counts make a table of more rows than
                this process can hold.
        """
        what = what or name
        client = self._existing_client(what)
        try:
            return tables.load_table(client, name, upper, what=what)
        except ShardNameNotFound:
            if legacy_shard is not None and legacy_shard in client.list_shards():
                return self._load_legacy(client, legacy_shard, upper, what)
            raise AssetNotStored(f"{what}: nothing stored yet (no shard is named {name!r}): "
                                 "materialize it first") from None
        except NotYetAvailable:
            # Named by a store that died before its write (or by resolve(create=True)):
            # nothing stored yet either, whatever step it died at.
            raise AssetNotStored(f"{what}: nothing stored yet (shard {name!r} holds no "
                                 "table): materialize it first") from None

    def _load_legacy(self, client: PersistClient, shard: str, upper: int | None,
                     what: str) -> pa.Table:
        snap = _snapshot(client, shard, tables.as_of_upper(client, shard, upper, what))
        return encoding.table_from_contents(
            zip(snap.column("k").to_pylist(), snap.column("v").to_pylist(),
                snap.column("d").to_pylist(), strict=True), what)

    def migrate(self, asset_key: dg.AssetKey, partition: str | None = None) -> dict[str, Any]:
        """Store the latest version of an asset (partition) that an earlier version of
        the library kept in its UUIDv5 shard, in the typed shard named after the asset.
        Nothing is deleted; run it once per asset that will not be materialized again
        soon (the next materialization migrates an asset by itself).

        Raises:
            AssetNotStored: there is no earlier shard for this asset (partition).
        """
        name = asset_shard_name(asset_key.path, partition)
        legacy = asset_shard_id(asset_key, partition)
        client = self._existing_client(asset_key.to_user_string())
        if legacy not in client.list_shards():
            raise AssetNotStored(f"{asset_key.to_user_string()}: no shard {legacy} from an "
                                 f"earlier version of the library")
        table = self._load_legacy(client, legacy, None, asset_key.to_user_string())
        return self.store(name, table, debug="PersistIOManager.migrate")


def _key_columns(declared: object) -> list[str] | None:
    if declared is None:
        return None
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list | tuple) and all(isinstance(c, str) for c in declared):
        return list(declared)
    raise InvalidInput(f"output metadata primary_key must be a column name or a list of "
                       f"them, got {declared!r}")


def _is_pandas_frame(typing_type: object) -> bool:
    return (getattr(typing_type, "__module__", "").split(".")[0] == "pandas"
            and getattr(typing_type, "__name__", "") == "DataFrame")


def _project(table: pa.Table, columns: object, what: str, *,
             keep_pandas_index: bool = False) -> pa.Table:
    if not isinstance(columns, list | tuple) or not all(isinstance(c, str) for c in columns):
        raise InvalidInput(f"{what}: input metadata columns must be a list of column names, "
                           f"got {columns!r}")
    unknown = [c for c in columns if c not in table.column_names]
    if unknown:
        raise InvalidInput(f"{what}: input metadata columns {unknown} are not columns of the "
                           f"stored table {table.column_names}")
    # A pandas input keeps the index stored as columns; any other input gets exactly the
    # columns it asked for.
    index = [c for c in pandas_index_columns(table.schema)
             if keep_pandas_index and c in table.column_names and c not in columns]
    return table.select([*columns, *index])


def _snapshot(client: PersistClient, shard_id: str, as_of: int) -> pa.Table:
    reader = client.open_reader(shard_id, debug="PersistIOManager")
    try:
        return reader.snapshot(as_of)
    finally:
        reader.expire()


def _data_uri(client: PersistClient, shard: ShardId) -> str:
    """The URI of the folder or S3 prefix holding ``shard``'s parts (``s3://bucket/...``
    or ``file:///...``: a URI a user can open, no endpoint or secret in it)."""
    try:
        uri, _ = file_uri(client.blobs.main, paths.shard_prefix(str(shard)))
    except InvalidConfig:  # an in-memory store: no URI outside this process
        return f"{redact_uri(client.blobs.main.describe())}/{shard}"
    return uri.rstrip("/")
