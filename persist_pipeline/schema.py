"""Typed shards: :class:`ShardSchema`, the Arrow schema of a shard's keys and values.

A typed shard is an ordinary shard whose ``k`` and ``v`` bytes are the canonical row
encoding of its key and value columns (:mod:`persist_pipeline.internal.rowcodec`), so
compaction, consolidation and every guarantee apply unchanged. The schema is recorded in
the shard's state when the shard is created; writers and readers convert between typed
tables (the key and value columns plus ``t`` and ``d``) and the encoded updates.

Evolution: value columns may be appended later if they are nullable; rows written before
read with nulls there (a row's encoding ends after its last non-null value column, so the
old and new encodings of the same row are identical). Keys never change.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.exceptions import (
    InvalidInput,
    InvalidUpdates,
    SchemaMismatch,
    UntypedUpdates,
)
from persist_pipeline.internal import rowcodec

if TYPE_CHECKING:
    from persist_pipeline.updates import Updates

#: Column names the storage format uses itself; typed columns may not take them.
RESERVED_COLUMNS = frozenset({"k", "v", "t", "d"})
_KEY_COLUMNS_META = b"persist_pipeline.key_columns"
#: The schemas a recorded schema evolved from (see :attr:`ShardSchema.history`).
_HISTORY_META = b"persist_pipeline.schema_history"
#: The categories of a column that holds only them, in their order (a table's ordered
#: dictionary column, by its storage name): an IPC stream of one column. Typed writes
#: refuse other values (see :meth:`ShardSchema.categories`).
DICTIONARY_META = b"persist_pipeline.dictionary."
#: A table's original Arrow schema (an IPC schema message), kept by a table store
#: (:mod:`persist_pipeline.tables`) in its shard schema's metadata.
ARROW_SCHEMA_META = b"persist_pipeline.arrow_schema"
#: The storage name of each of a table's original columns, in the original order (JSON).
COLUMNS_META = b"persist_pipeline.columns"


def categories_bytes(categories: pa.Array) -> bytes:
    """``categories`` as kept under :data:`DICTIONARY_META` in a schema's metadata."""
    batch = pa.record_batch([categories], names=["dictionary"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as stream:
        stream.write_batch(batch)
    return bytes(sink.getvalue().to_pybytes())


def _as_schema(obj: object, what: str) -> pa.Schema:
    if isinstance(obj, pa.Schema):
        return obj
    if isinstance(obj, Mapping):
        obj = list(obj.items())
    try:
        return pa.schema(obj)
    except (TypeError, ValueError, pa.ArrowException) as e:
        raise InvalidInput(f"the {what} schema must be a pyarrow.Schema (or a list of "
                           f"fields / a name -> type mapping): {e}") from None


def _describe(field: pa.Field) -> str:
    return f"{field.name}: {field.type}{'' if field.nullable else ' not null'}"


def _same_field(a: pa.Field, b: pa.Field) -> bool:
    return bool(a.name == b.name and a.type.equals(b.type) and a.nullable == b.nullable)


@dataclass(frozen=True)
class ShardSchema:
    """The Arrow schemas of a typed shard's keys and values.

    Args:
        key: the key columns (at least one). Rows with equal keys are the same key.
        value: the value columns (may be empty: a set of keys).
        metadata: schema-level metadata kept with the schema (e.g. how a writer maps
            the columns back to its own types); not part of the row encoding.

    Raises:
        InvalidInput: no key column, a repeated or reserved name (``k``, ``v``, ``t``,
            ``d``), or an unsupported type.
    """

    key: pa.Schema
    value: pa.Schema
    metadata: Mapping[bytes, bytes]
    #: The schemas this one evolved from, oldest first, each with the time below which
    #: a shard's rows were written with it: ``((until, schema bytes), ...)``. Kept by
    #: :func:`~persist_pipeline.internal.transitions.record_schema`; not part of
    #: equality (it says when a schema was recorded, not what it is).
    history: tuple[tuple[int, bytes], ...] = dataclasses.field(init=False, compare=False,
                                                               repr=False)

    def __init__(self, key: pa.Schema | Iterable[Any] | Mapping[str, Any],
                 value: pa.Schema | Iterable[Any] | Mapping[str, Any] = (),
                 metadata: Mapping[bytes, bytes] | Mapping[str, str] | None = None, *,
                 _recorded: bool = False) -> None:
        object.__setattr__(self, "key", _as_schema(key, "key").remove_metadata())
        object.__setattr__(self, "value", _as_schema(value, "value").remove_metadata())
        meta = {_as_bytes(k): _as_bytes(v) for k, v in (metadata or {}).items()}
        for reserved in (_KEY_COLUMNS_META, _HISTORY_META):
            if reserved in meta:
                raise InvalidInput(f"schema metadata key {reserved!r} is reserved")
        object.__setattr__(self, "metadata", meta)
        object.__setattr__(self, "history", ())
        if len(self.key) == 0:
            raise InvalidInput("a shard schema needs at least one key column")
        names = self.key.names + self.value.names
        for name in names:
            if names.count(name) > 1:
                raise InvalidInput(f"column {name!r} appears twice in the shard schema")
            if name in RESERVED_COLUMNS:
                raise InvalidInput(f"column name {name!r} is reserved (k, v, t and d are the "
                                   f"storage columns): rename it")
        try:
            for field in [*self.key, *self.value]:
                rowcodec.check_type(field.type, f"column {field.name!r}")
                if not _recorded:
                    # A schema a shard recorded reads as it was, whatever this host's
                    # time zone database knows.
                    rowcodec.check_new_type(field.type, f"column {field.name!r}")
        except InvalidUpdates as e:
            raise InvalidInput(str(e)) from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardSchema):
            return NotImplemented
        return (len(self.key) == len(other.key) and len(self.value) == len(other.value)
                and all(_same_field(a, b) for a, b in zip(self.key, other.key, strict=True))
                and all(_same_field(a, b) for a, b in zip(self.value, other.value,
                                                          strict=True))
                and self.metadata == other.metadata)

    def __hash__(self) -> int:
        return hash((tuple(self.key.names), tuple(self.value.names)))

    def __repr__(self) -> str:
        keys = ", ".join(_describe(f) for f in self.key)
        values = ", ".join(_describe(f) for f in self.value)
        return f"ShardSchema(key=[{keys}], value=[{values}])"

    @property
    def columns(self) -> list[str]:
        """Key then value column names."""
        return [*self.key.names, *self.value.names]

    def categories(self, column: str) -> pa.Array | None:
        """The only values ``column`` may hold (besides null), in their order, if the
        schema's metadata restricts it (:data:`DICTIONARY_META`: a table's ordered
        categorical), else None."""
        return self._categories.get(column)

    @cached_property
    def _categories(self) -> dict[str, pa.Array]:
        out = {}
        for key, raw in self.metadata.items():
            if key.startswith(DICTIONARY_META):
                stream = pa.ipc.open_stream(pa.py_buffer(raw))
                out[key[len(DICTIONARY_META):].decode()] = \
                    stream.read_all().column(0).combine_chunks()
        return out

    def _check_values(self, columns: Mapping[str, pa.Array | pa.ChunkedArray]) -> None:
        """Refuse values a table load could not give back (see the two checks)."""
        self._check_categories(columns)
        self._check_narrowed(columns)
        self._check_text(columns)

    @cached_property
    def _text_columns(self) -> tuple[str, ...]:
        """Columns holding strings, top-level or inside lists and structs."""
        return tuple(f.name for f in [*self.key, *self.value] if _holds_text(f.type))

    def _check_text(self, columns: Mapping[str, pa.Array | pa.ChunkedArray]) -> None:
        """Refuse strings that are not UTF-8 (Arrow checks none it reads from Parquet or
        IPC): the row codec encodes them, and every read would fail to decode them."""
        for name in self._text_columns:
            column = columns.get(name)
            if column is None:
                continue
            try:
                column.validate(full=True)
            except pa.ArrowInvalid as e:
                raise InvalidUpdates(f"column {name!r} holds text that is not valid "
                                     f"UTF-8: {e}") from None

    @cached_property
    def _narrowed(self) -> dict[str, pa.DataType]:
        """The storage columns of a table whose own type is narrower than the stored
        one somewhere (top-level or inside), with that type: ``float16`` (stored as
        ``float32``) and Arrow's ``null`` (nulls only, stored as ``int8``)."""
        raw, names = self.metadata.get(ARROW_SCHEMA_META), self.metadata.get(COLUMNS_META)
        if raw is None or names is None:
            return {}
        original = pa.ipc.read_schema(pa.py_buffer(raw))
        return {stored: f.type for f, stored in zip(original, json.loads(names), strict=True)
                if next(narrow_types(f.type), None) is not None}

    def _check_narrowed(self, columns: Mapping[str, pa.Array | pa.ChunkedArray]) -> None:
        """Refuse values that a table's narrower column type cannot hold: a load casts
        them back, and would return infinity or zero for a float16 out of range, and
        null for any value where the table holds nulls only (rounding to the nearest
        float16 is what a float16 column means)."""
        for name, type_ in self._narrowed.items():
            column = columns.get(name)
            if column is None or not len(column):
                continue
            chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
            for chunk in chunks:
                for values, narrow, where in _narrow_leaves(chunk, type_, name):
                    if not pa.types.is_null(narrow):
                        _check_in_range(values, values.cast(narrow), pa.field(where, narrow))
                    elif values.null_count != len(values):
                        raise SchemaMismatch(
                            f"column {where!r} holds only nulls in the stored table (its "
                            f"type is null): it cannot hold "
                            f"{pc.drop_null(values)[0].as_py()!r}")

    def _check_categories(self, columns: Mapping[str, pa.Array | pa.ChunkedArray]) -> None:
        """Refuse values outside a restricted column's categories: a table load could
        not give them back as its ordered categorical (a table store with other
        categories starts a new generation instead)."""
        for name, allowed in self._categories.items():
            column = columns.get(name)
            if column is None or not len(column):
                continue
            outside = pc.and_(pc.is_valid(column), pc.invert(pc.is_in(
                column, value_set=allowed.cast(column.type))))
            if pc.any(outside).as_py():
                value = column.filter(outside)[0].as_py()
                raise SchemaMismatch(f"column {name!r} holds {value!r}, which is not one of "
                                     f"its categories {allowed.to_pylist()[:20]} (an "
                                     f"ordered categorical: a table store with other "
                                     f"categories starts a new generation)")

    def arrow_schema(self) -> pa.Schema:
        """The schema of typed reads: key and value columns, then ``t`` and ``d``."""
        return pa.schema([*self.key, *self.value, pa.field("t", pa.int64(), nullable=False),
                          pa.field("d", pa.int64(), nullable=False)])

    # --- recording in the state --------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The schema as recorded in the shard's state (an Arrow IPC schema message)."""
        meta = {**self.metadata, _KEY_COLUMNS_META: str(len(self.key)).encode()}
        if self.history:
            meta[_HISTORY_META] = json.dumps(
                [[until, base64.b64encode(raw).decode()] for until, raw in self.history]
            ).encode()
        both = pa.schema([*self.key, *self.value], metadata=meta)
        return bytes(both.serialize().to_pybytes())

    def with_history(self, history: Iterable[tuple[int, bytes]]) -> ShardSchema:
        """This schema with ``history`` (see :attr:`history`)."""
        out = ShardSchema(self.key, self.value, self.metadata, _recorded=True)
        object.__setattr__(out, "history", tuple(history))
        return out

    def evolved_from(self, previous: ShardSchema, upper: int | None,
                     since: int | None = 0) -> ShardSchema:
        """This schema, recorded over ``previous`` at a shard whose upper is ``upper``:
        rows at times below ``upper`` were written with ``previous``, which joins the
        history (a shard with no times written yet keeps only ``previous``'s). Entries no
        read can ask for any more (their rows' times are all below ``since``) are left
        out, so the history stays as small as the reads it serves. One read reaches below
        since: a table load pinned to the upper when since reached (or passed) it reads
        every update's sum (the version at ``upper - 1``), so an entry ending at that
        upper stays while the upper is still there."""

        def needed(until: int) -> bool:
            return until == upper or (since is not None and until > since)

        kept = [(until, raw) for until, raw in previous.history if needed(until)]
        if upper and needed(upper):
            kept.append((upper, previous.with_history(()).to_bytes()))
        return self.with_history(kept)

    def as_of(self, time: int) -> ShardSchema:
        """The schema the shard's rows at ``time`` were written with: this one, or the
        one in :attr:`history` it evolved from that was recorded then. Evolutions only
        append value columns, so its columns are a prefix of this one's."""
        for until, raw in self.history:
            if time < until:
                return ShardSchema.from_bytes(raw)
        return self

    @staticmethod
    def from_bytes(data: bytes) -> ShardSchema:
        return _decode_schema(data)

    def evolve(self, requested: ShardSchema) -> ShardSchema:
        """The schema to record when a writer asks for ``requested`` on a shard that
        has this one: the same, or this one with nullable value columns appended; a
        request that lacks some trailing nullable value columns (an older writer) keeps
        this one.

        Raises:
            SchemaMismatch: anything else (nothing is changed).
        """
        if not (len(self.key) == len(requested.key)
                and all(_same_field(a, b) for a, b in zip(self.key, requested.key,
                                                          strict=True))):
            raise SchemaMismatch(
                f"the shard's key columns are [{', '.join(_describe(f) for f in self.key)}]"
                f", not [{', '.join(_describe(f) for f in requested.key)}]: keys cannot "
                f"change")
        common = min(len(self.value), len(requested.value))
        for a, b in zip(list(self.value)[:common], list(requested.value)[:common],
                        strict=True):
            if not _same_field(a, b):
                raise SchemaMismatch(
                    f"value column {a.name!r} is recorded as {_describe(a)}, asked for "
                    f"{_describe(b)}: only nullable value columns may be added, at the end")
        if len(requested.value) <= len(self.value):
            return self
        added = list(requested.value)[len(self.value):]
        for f in added:
            if not f.nullable:
                raise SchemaMismatch(f"added value column {f.name!r} must be nullable (rows "
                                     f"written before it read as null)")
        return requested

    @staticmethod
    def from_json(data: object) -> ShardSchema:
        """A schema written as JSON: ``{"key": {"id": "int64"}, "value": {"name":
        "string"}}``. Types are Arrow's names (``int64``, ``float64``, ``string``,
        ``binary``, ``bool``, ``date32``, ``time64[us]``, ``duration[s]``,
        ``timestamp[us]``, ``timestamp[us, tz=UTC]``, ``decimal128(10, 2)``), with
        `` not null`` after one for a column without nulls; nested types: take the
        schema of a Parquet file instead.

        Raises:
            InvalidInput: not of that shape, or a type name Arrow does not know.
        """
        if not isinstance(data, Mapping) or set(data) - {"key", "value"} or "key" not in data:
            raise InvalidInput('a schema as JSON is {"key": {column: type, ...}, "value": '
                               '{column: type, ...}}')
        parts = []
        for part in ("key", "value"):
            columns = data.get(part, {})
            if not isinstance(columns, Mapping):
                raise InvalidInput(f'"{part}" must map column names to type names')
            parts.append([_field_from_text(str(name), text) for name, text in columns.items()])
        return ShardSchema(parts[0], parts[1])

    # --- typed tables <-> updates ---------------------------------------------------------

    def encode(self, table: object, *, with_times: bool = True) -> pa.Table:
        """A typed table as k/v/t/d updates (``d`` defaults to 1).

        Args:
            table: a pyarrow Table or RecordBatch, a pandas or polars DataFrame, an Arrow
                stream, or a list of row dicts, with every key column, the value columns
                (nullable ones may be left out: null) and ``t`` (and optionally ``d``).
            with_times: False for upserts and deletes (no ``t``/``d`` columns; ``t`` and
                ``d`` are filled with 0 and 1).

        Raises:
            SchemaMismatch / InvalidUpdates: the table does not fit; nothing is written.
        """
        conformed = self.conform(table, with_times=with_times)
        n = conformed.num_rows
        k = _encoded([conformed.column(c) for c in self.key.names], n, strip=False)
        v = _encoded([conformed.column(c) for c in self.value.names], n, strip=True)
        if with_times:
            t, d = conformed.column("t"), conformed.column("d")
        else:
            t = pa.array([0] * n, pa.int64())
            d = pa.array([1] * n, pa.int64())
        return pa.Table.from_arrays([k, v, t, d], names=["k", "v", "t", "d"])

    def to_updates(self, table: object) -> Updates:
        """A typed table as validated, consolidated :class:`Updates` (what a write
        stores); small tables take a plain-Python path, as small untyped writes do."""
        from persist_pipeline.updates import Updates

        columns, n = self._columns(table, True)
        if n > rowcodec.SMALL_ROWS:
            conformed = pa.Table.from_arrays(list(columns.values()), schema=self._times_schema)
            return Updates.coerce(self.encode(conformed))
        k = rowcodec.encode_rows_list([columns[c] for c in self.key.names], n,
                                      strip_trailing_nulls=False)
        v = rowcodec.encode_rows_list([columns[c] for c in self.value.names], n,
                                      strip_trailing_nulls=True)
        t = columns["t"].to_pylist()
        d_column = columns["d"]
        d = [1] * n if d_column is _ONES.get(n) else d_column.to_pylist()
        return Updates.from_columns(k, v, t, d)

    def conform(self, table: object, *, with_times: bool = True) -> pa.Table:
        """The table with exactly the schema's columns (cast, missing nullable values
        filled with null) plus ``t`` and ``d`` when ``with_times``."""
        columns, _ = self._columns(table, with_times)
        schema = self._times_schema if with_times else self._columns_schema
        return pa.Table.from_arrays(list(columns.values()), schema=schema)

    @cached_property
    def _columns_schema(self) -> pa.Schema:
        return pa.schema([*self.key, *self.value])

    @cached_property
    def _times_schema(self) -> pa.Schema:
        return pa.schema([*self.key, *self.value, pa.field("t", pa.int64()),
                          pa.field("d", pa.int64())])

    def _exact_columns(self, given: pa.Table, with_times: bool
                       ) -> dict[str, pa.Array | pa.ChunkedArray] | None:
        """The columns of a table that already has exactly the schema's columns and
        types (the common case, checked cheaply), else None."""
        schema = given.schema
        expected = self._times_schema if with_times else self._columns_schema
        if schema.equals(expected, check_metadata=False):
            names = expected.names
        elif with_times and schema.equals(self._t_only_schema, check_metadata=False):
            names = self._t_only_schema.names
        else:
            return None
        columns = {name: given.column(i) for i, name in enumerate(names)}
        for name in self._required:
            column = columns.get(name)
            if column is not None and column.null_count:
                return None  # the slow path says which column
        if with_times and "d" not in columns:
            columns["d"] = _ones(given.num_rows)
        return columns

    @cached_property
    def _t_only_schema(self) -> pa.Schema:
        return pa.schema([*self.key, *self.value, pa.field("t", pa.int64())])

    @cached_property
    def _required(self) -> tuple[str, ...]:
        """Columns that must hold no nulls (non-nullable ones, t and d)."""
        return (*(f.name for f in [*self.key, *self.value] if not f.nullable), "t", "d")

    def _columns(self, table: object, with_times: bool
                 ) -> tuple[dict[str, pa.Array | pa.ChunkedArray], int]:
        if isinstance(table, list) and not table:
            # No rows (no row dicts to take column names from): an empty write.
            table = (self._times_schema if with_times else self._columns_schema).empty_table()
        given = _to_table(table, self)
        fast = self._exact_columns(given, with_times)
        if fast is not None:
            self._check_values(fast)
            return fast, given.num_rows
        names = given.column_names
        if len(set(names)) != len(names):
            raise SchemaMismatch(f"the table repeats a column: {names}")
        allowed = set(self.columns) | ({"t", "d"} if with_times else set())
        unknown = [c for c in names if c not in allowed]
        if unknown:
            hint = ("" if with_times or not {"t", "d"} & set(unknown)
                    else " (upsert and delete take the time as an argument)")
            # k and v can never be added (reserved): an untyped table or file was
            # handed to a typed shard, so say which columns it takes instead.
            advice = (f"k and v are an untyped shard's columns; this typed shard takes "
                      f"{', '.join([*self.columns, *(['t', 'd'] if with_times else [])])}"
                      if {"k", "v"} & set(unknown) else
                      "to add value columns, reopen the writer with a schema that "
                      "appends them (nullable)")
            raise SchemaMismatch(f"column(s) {unknown} are not in the shard's schema "
                                 f"{self!r}{hint}; {advice}")
        n = given.num_rows
        out: dict[str, pa.Array | pa.ChunkedArray] = {}
        for field in self._columns_schema:
            if field.name not in names:
                if field.nullable and field.name in self.value.names:
                    out[field.name] = pa.nulls(n, field.type)
                    continue
                raise SchemaMismatch(f"the table has no column {field.name!r} "
                                     f"({_describe(field)})")
            column = given.column(field.name)
            if not column.type.equals(field.type):
                column = _safe_cast(column, field)
            if not field.nullable and column.null_count:
                raise InvalidUpdates(f"column {field.name!r} is not nullable but holds "
                                     f"{column.null_count} null(s)")
            out[field.name] = column
        if with_times:
            if "t" not in names:
                raise InvalidUpdates("a typed write needs a t column (the update times)")
            out["t"] = _int64_column(given, "t")
            out["d"] = _int64_column(given, "d") if "d" in names else _ones(n)
        self._check_values(out)
        return out, n

    def decode(self, updates: pa.Table, where: str = "a read") -> pa.Table:
        """k/v/t/d updates as a typed table (:meth:`arrow_schema`).

        Raises:
            CorruptPart: the bytes are not rows of this schema.
        """
        keys = rowcodec.decode_rows(updates.column("k"), self.key, where=where,
                                    allow_missing_trailing=False)
        values = rowcodec.decode_rows(updates.column("v"), self.value, where=where,
                                      allow_missing_trailing=True)
        return pa.Table.from_arrays(
            [*keys, *values, updates.column("t").cast(pa.int64()),
             updates.column("d").cast(pa.int64())], schema=self.arrow_schema())

    def encode_keys(self, table: object) -> pa.Array:
        """The ``k`` bytes of a table of key columns (deletes); extra columns refused."""
        given = _to_table(table, self)
        extra = [c for c in given.column_names if c not in self.key.names]
        if extra:
            raise SchemaMismatch(f"delete takes only the key columns "
                                 f"{self.key.names}; got also {extra}")
        keys_only = ShardSchema(self.key, [], _recorded=True)
        conformed = keys_only.conform(given, with_times=False)
        return _encoded([conformed.column(c) for c in self.key.names], conformed.num_rows,
                        strip=False)


def _encoded(columns: list[pa.ChunkedArray], n: int, *, strip: bool) -> pa.Array:
    if n <= rowcodec.SMALL_ROWS:
        return pa.array(rowcodec.encode_rows_list(columns, n, strip_trailing_nulls=strip),
                        pa.binary())
    return rowcodec.encode_rows(columns, n, strip_trailing_nulls=strip)


#: Diff columns of all ones by length (a typed write without ``d``), built once each.
_ONES: dict[int, pa.Array] = {}


def _ones(n: int) -> pa.Array:
    ones = _ONES.get(n)
    if ones is None:
        ones = pa.array(np.ones(n, dtype=np.int64))
        if n <= 4096 and len(_ONES) < 4096:
            _ONES[n] = ones
    return ones


def _safe_cast(column: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    """``column`` cast to ``field``'s type, refused where a value would change beyond
    rounding. Arrow's safe cast checks integers and decimals, not floats: a float
    narrowed past its range (to infinity or zero) or into a decimal's scale (``0.125``
    into ``decimal(10, 2)``) would be stored as another number; nor time zones and
    days: a timestamp without a zone would be taken for UTC, one with a zone for its
    UTC wall clock, and one cut to a date would lose its time of day.

    Raises:
        SchemaMismatch: the column does not cast, or some value would change so.
    """
    source = column.type
    if pa.types.is_timestamp(source) and pa.types.is_timestamp(field.type) \
            and (source.tz is None) != (field.type.tz is None) \
            and column.null_count != len(column):
        # Arrow would take a wall-clock time for UTC (and drop an instant's zone): a
        # guess, which the CLI's CSV reading (Arrow's parser) refuses too.
        raise SchemaMismatch(
            f"column {field.name!r} is {source}, the shard stores {field.type}: a "
            f"timestamp {'without' if source.tz is None else 'with'} a time zone is not "
            f"one {'with' if source.tz is None else 'without'}; "
            + ("localize it first (pandas: tz_localize)" if source.tz is None else
               "convert it to the wall clock wanted and drop the zone first "
               "(pandas: tz_convert(...).tz_localize(None))"))
    try:
        cast = column.cast(field.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SchemaMismatch(f"column {field.name!r} is {source}, the shard stores "
                             f"{field.type}, and it does not cast safely: {e}") from None
    if pa.types.is_timestamp(source) and pa.types.is_date(field.type):
        _check_whole_days(column, cast, field)
        return cast
    if not pa.types.is_floating(source):
        return cast
    if pa.types.is_float16(source):  # compared as float32, which holds each exactly
        column, source = column.cast(pa.float32()), pa.float32()
    if pa.types.is_floating(field.type):
        if field.type.bit_width < source.bit_width:  # narrowed (widening is exact)
            _check_in_range(column, cast, field)
    elif pa.types.is_decimal(field.type):
        # A decimal is exact: the stored value must read back as the float written.
        _refuse_changed(column, cast, pc.not_equal(cast.cast(source), column), field)
    return cast


def _check_whole_days(column: pa.ChunkedArray, cast: pa.ChunkedArray,
                      field: pa.Field) -> None:
    """Refuse timestamps that a date column would cut to their day: a time of day is
    dropped, and an instant's day depends on the zone it is seen from (Arrow takes
    UTC's)."""
    if column.null_count == len(column):
        return
    if column.type.tz is not None:
        raise SchemaMismatch(f"column {field.name!r} is {column.type}, the shard stores "
                             f"{field.type}: which day an instant falls on depends on the "
                             f"time zone; convert it to dates first")
    _refuse_changed(column, cast, pc.not_equal(cast.cast(column.type), column), field)


def replace_leaf_types(type_: pa.DataType, leaf: Callable[[pa.DataType], pa.DataType]
                       ) -> pa.DataType:
    """``type_`` with ``leaf`` applied to every type that is not a struct or a list
    (inside structs, lists and large lists, at any depth; field names, nullability and
    the kind of list are kept)."""
    if pa.types.is_struct(type_):
        return pa.struct([f.with_type(replace_leaf_types(f.type, leaf)) for f in type_])
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        item = type_.value_field.with_type(replace_leaf_types(type_.value_type, leaf))
        return pa.list_(item) if pa.types.is_list(type_) else pa.large_list(item)
    return leaf(type_)


def narrow_types(type_: pa.DataType) -> Iterator[pa.DataType]:
    """The float16 and null types in a table's column type, at any depth."""
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    if pa.types.is_float16(type_) or pa.types.is_null(type_):
        yield type_
    elif pa.types.is_struct(type_):
        for field in type_:
            yield from narrow_types(field.type)
    elif pa.types.is_map(type_):
        yield from narrow_types(type_.key_type)
        yield from narrow_types(type_.item_type)
    elif pa.types.is_list(type_) or pa.types.is_large_list(type_):
        yield from narrow_types(type_.value_type)


def _narrow_leaves(values: pa.Array, type_: pa.DataType, where: str
                   ) -> Iterator[tuple[pa.Array, pa.DataType, str]]:
    """The stored values of ``values`` (a storage column of a table column of type
    ``type_``) where the table's type is float16 or null, with that type and a path
    naming them: only the values that are there (a null struct's or list's children
    are not)."""
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    if pa.types.is_float16(type_) or pa.types.is_null(type_):
        yield values, type_, where
    elif pa.types.is_struct(type_):
        for field, child in zip(type_, values.flatten(), strict=True):
            yield from _narrow_leaves(child, field.type, f"{where}.{field.name}")
    elif pa.types.is_map(type_):  # stored as a list of key/value structs
        key, item = values.flatten().flatten()
        yield from _narrow_leaves(key, type_.key_type, f"{where}.key")
        yield from _narrow_leaves(item, type_.item_type, f"{where}.value")
    elif pa.types.is_list(type_) or pa.types.is_large_list(type_):
        yield from _narrow_leaves(values.flatten(), type_.value_type, f"{where}[]")


def _check_in_range(column: pa.ChunkedArray | pa.Array, cast: pa.ChunkedArray | pa.Array,
                    field: pa.Field) -> None:
    """Refuse floats that ``cast`` (to a narrower float) took out of their range: a
    finite value to infinity, a non-zero one to zero. Rounding to the nearest value
    of the narrower type is what its column means."""
    if pa.types.is_float16(cast.type):  # compared as float32, which holds each exactly
        cast = cast.cast(pa.float32())
    changed = pc.or_(pc.and_(pc.is_finite(column), pc.invert(pc.is_finite(cast))),
                     pc.and_(pc.not_equal(column, 0), pc.equal(cast, 0)))
    _refuse_changed(column, cast, changed, field)


def _refuse_changed(column: pa.ChunkedArray | pa.Array, cast: pa.ChunkedArray | pa.Array,
                    changed: pa.ChunkedArray | pa.Array, field: pa.Field) -> None:
    if pc.any(changed).as_py():
        raise SchemaMismatch(f"column {field.name!r}: {column.filter(changed)[0].as_py()!r} "
                             f"({column.type}) does not fit {field.type}: it would be stored "
                             f"as {cast.filter(changed)[0].as_py()!r}; nothing was written")


def _int64_column(table: pa.Table, name: str) -> pa.ChunkedArray:
    column = table.column(name)
    if column.type == pa.int64() and not column.null_count:
        return column
    if column.null_count:
        raise InvalidUpdates(f"column {name} contains nulls")
    if not (pa.types.is_integer(column.type)):
        raise InvalidUpdates(f"column {name} must hold integers, got {column.type}")
    try:
        return column.cast(pa.int64(), safe=True)
    except pa.ArrowInvalid as e:
        raise InvalidUpdates(f"column {name} does not fit in int64: {e}") from None


def _to_table(obj: object, schema: ShardSchema) -> pa.Table:
    from persist_pipeline.updates import frame_to_table

    if isinstance(obj, pa.Table):
        return obj
    if isinstance(obj, pa.RecordBatch):
        return pa.Table.from_batches([obj])
    if isinstance(obj, list) and all(isinstance(row, dict) for row in obj):
        try:
            return pa.Table.from_pylist(obj)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            # OverflowError: pyarrow infers int64, so 2**63 and beyond (a uint64's upper
            # half) need a pyarrow Table of the column's type.
            raise InvalidUpdates(f"cannot read the rows as a table: {e} (pass a pyarrow "
                                 f"Table with the shard's column types)") from None
    if isinstance(obj, list | tuple) and obj and \
            all(isinstance(row, tuple | list) for row in obj):
        # The untyped update form: refused as the schema mismatch it is, as a raw
        # k/v/t/d table is.
        raise UntypedUpdates(f"the shard is typed ({schema!r}): it takes a table or row "
                             f"dicts with columns {schema.columns} (+ t, d), not untyped "
                             f"(key, val, ts, diff) tuples")
    table = frame_to_table(obj)
    if not isinstance(table, pa.Table):
        raise InvalidUpdates(f"a typed shard takes a pyarrow Table, a pandas or polars "
                             f"DataFrame, an Arrow stream or a list of row dicts with "
                             f"columns {schema.columns} (+ t, d); got {type(obj).__name__}")
    return table


def encoded_with_fits(recorded: bytes, encoded_with: bytes) -> bool:
    """Whether updates encoded with the schema ``encoded_with`` (empty: untyped) may be
    committed into a shard whose recorded schema is ``recorded`` (empty: untyped).

    Untyped fits untyped only; a typed encoding fits the recorded schema or any
    evolution of it (nullable value columns appended: an older row encoding is also a
    row of the newer schema, byte for byte). Pure and cached: it runs inside the append
    transition, where the recorded schema is known for sure.
    """
    if recorded == encoded_with:
        return True
    if not recorded or not encoded_with:
        return False
    return _evolves_from(recorded, encoded_with)


@lru_cache(maxsize=256)
def _evolves_from(recorded: bytes, encoded_with: bytes) -> bool:
    stored = _decode_schema(recorded)
    try:
        return stored.evolve(_decode_schema(encoded_with)) is stored
    except SchemaMismatch:
        return False


@lru_cache(maxsize=256)
def _decode_schema(data: bytes) -> ShardSchema:
    both = pa.ipc.read_schema(pa.py_buffer(data))
    meta = dict(both.metadata or {})
    num_keys = int(meta.pop(_KEY_COLUMNS_META))
    history = meta.pop(_HISTORY_META, None)
    fields = list(both)
    schema = ShardSchema(pa.schema(fields[:num_keys]), pa.schema(fields[num_keys:]), meta,
                         _recorded=True)
    if history is None:
        return schema
    return schema.with_history((int(until), base64.b64decode(raw))
                               for until, raw in json.loads(history))


_TIMESTAMP = re.compile(r"timestamp\[(s|ms|us|ns)(?:,\s*tz=([^\]]+))?\]")
_DECIMAL = re.compile(r"decimal(?:128)?\((\d+),\s*(-?\d+)\)")


def _holds_text(type_: pa.DataType) -> bool:
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return True
    if pa.types.is_struct(type_):
        return any(_holds_text(f.type) for f in type_)
    if pa.types.is_list(type_) or pa.types.is_large_list(type_) or \
            pa.types.is_fixed_size_list(type_):
        return _holds_text(type_.value_type)
    return False


def _field_from_text(name: str, text: object) -> pa.Field:
    if not isinstance(text, str):
        raise InvalidInput(f"column {name!r}: the type must be a name such as \"int64\", "
                           f"got {text!r}")
    spec = text.strip()
    nullable = True
    if spec.lower().endswith(" not null"):
        spec, nullable = spec[:-len(" not null")].strip(), False
    stamp = _TIMESTAMP.fullmatch(spec)
    decimal = _DECIMAL.fullmatch(spec)
    try:
        if stamp:
            type_ = pa.timestamp(stamp.group(1), stamp.group(2))
        elif decimal:
            type_ = pa.decimal128(int(decimal.group(1)), int(decimal.group(2)))
        else:
            type_ = pa.type_for_alias(spec)
    except (ValueError, KeyError, pa.ArrowInvalid) as e:
        raise InvalidInput(f"column {name!r}: unknown type {text!r} ({e})") from None
    try:
        return pa.field(name, type_, nullable)
    except UnicodeEncodeError:
        # JSON may escape a lone surrogate ("\ud800"), which no UTF-8 name holds.
        raise InvalidInput(f"column {name!r}: the name holds a lone surrogate, which is "
                           f"not UTF-8 text") from None


def _as_bytes(value: bytes | str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    raise InvalidInput(f"schema metadata keys and values are str or bytes, got "
                       f"{type(value).__name__}")

