"""How a table is stored in a shard of ``(key, val, ts, diff)`` updates, and read back.

This is the one place that knows the encoding, so it can be swapped for typed shards
(Arrow columns stored natively) without touching the IO manager. Version 1, on today's
bytes shards:

- **schema record**: key ``b"\\x00schema"``, value the Arrow IPC serialization of the
  table's schema (field types, nullability, field and schema metadata, e.g. pandas'),
  diff 1. Exactly one per shard, so a load returns exactly the stored types, also for an
  empty table.
- **row records**: key ``b"\\x01"`` followed by each column's value, in schema order, as a
  4-byte little-endian length then the bytes (length ``0xFFFFFFFF`` for null); value
  ``b""``; diff the number of times the row occurs. A column's bytes are:

  - fixed-width types (integers, floats, decimals, dates, times, timestamps, durations,
    fixed-size binary): the value's little-endian bytes as Arrow lays them out;
  - booleans: one byte, 0 or 1;
  - binary and string types (also large and view variants): the value's bytes;
  - anything else (lists, structs, maps, unions, ...): the Arrow IPC body of a one-row,
    one-column record batch, read back with the stored field type.

  Dictionary-encoded columns are stored as their values and cast back on load.

A shard therefore holds a *collection* of rows, like a SQL table: equal rows are one
record with a diff equal to their count, and **row order is not kept** (loads return
rows sorted by their encoding; sort on load when order matters). Encoding is a pure
function of the row and the schema, so writing a table next to its previous version
only adds and retracts the rows that changed.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from persist_pipeline.exceptions import CorruptData, InvalidInput

#: Version of this encoding; part of the schema record's key so a future one can coexist.
SCHEMA_KEY = b"\x00schema"
ROW_TAG = b"\x01"
_NULL = 0xFFFFFFFF
_LEN = struct.Struct("<I")


class UnsupportedTable(InvalidInput):
    """A table the encoding cannot store (e.g. a dictionary nested inside a struct)."""


def _is_bytes_like(t: Any) -> bool:
    return bool(pat.is_binary(t) or pat.is_string(t) or pat.is_large_binary(t)
                or pat.is_large_string(t) or pat.is_binary_view(t) or pat.is_string_view(t))


def _is_fixed_width(t: Any) -> bool:
    return bool(pat.is_integer(t) or pat.is_floating(t) or pat.is_decimal(t)
                or pat.is_temporal(t) or pat.is_fixed_size_binary(t))


def _contains_dictionary(t: Any) -> bool:
    if pat.is_dictionary(t):
        return True
    return any(_contains_dictionary(t.field(i).type) for i in range(t.num_fields))


def storage_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with top-level dictionary columns replaced by their value types."""
    fields = []
    for f in schema:
        t = f.type.value_type if pat.is_dictionary(f.type) else f.type
        if _contains_dictionary(t):
            raise UnsupportedTable(f"column {f.name!r}: a dictionary nested inside {t} cannot "
                                   "be stored; decode it first (pyarrow.compute.cast)")
        fields.append(pa.field(f.name, t, f.nullable, f.metadata))
    return pa.schema(fields, metadata=schema.metadata)


def _column_pieces(arr: Any, t: Any) -> list[bytes | None]:
    """Every value of the (non-chunked) array ``arr`` as bytes, None for null."""
    n = len(arr)
    valid = arr.is_valid().to_pylist() if arr.null_count else [True] * n
    if pat.is_boolean(t):
        return [(b"\x01" if v else b"\x00") if ok else None
                for v, ok in zip(arr.to_pylist(), valid, strict=True)]
    if _is_bytes_like(t):
        return [v if ok else None
                for v, ok in zip(arr.cast(pa.large_binary()).to_pylist(), valid, strict=True)]
    if _is_fixed_width(t):
        width = t.bit_width // 8
        data = arr.buffers()[1].to_pybytes()
        start = arr.offset * width
        return [data[start + i * width:start + (i + 1) * width] if valid[i] else None
                for i in range(n)]
    schema = pa.schema([pa.field("c", t)])
    return [pa.record_batch([arr.slice(i, 1)], schema=schema).serialize().to_pybytes()
            if valid[i] else None for i in range(n)]


def _one_chunk(column: Any, t: Any) -> Any:
    return column.combine_chunks() if column.num_chunks else pa.array([], t)


def encode_rows(table: pa.Table) -> list[bytes]:
    """Each row of ``table`` (already in :func:`storage_schema`) as a row record key."""
    columns = [_column_pieces(_one_chunk(table.column(i), f.type), f.type)
               for i, f in enumerate(table.schema)]
    rows = []
    for values in zip(*columns, strict=True):
        out = [ROW_TAG]
        for v in values:
            if v is None:
                out.append(_LEN.pack(_NULL))
            else:
                out.append(_LEN.pack(len(v)))
                out.append(v)
        rows.append(b"".join(out))
    return rows


def _split(row: bytes, ncols: int) -> list[bytes | None]:
    if not row.startswith(ROW_TAG):
        raise CorruptData(f"row record with unknown tag {row[:1]!r}")
    pos = 1
    out: list[bytes | None] = []
    for _ in range(ncols):
        if pos + 4 > len(row):
            raise CorruptData("row record truncated")
        (n,) = _LEN.unpack_from(row, pos)
        pos += 4
        if n == _NULL:
            out.append(None)
            continue
        if pos + n > len(row):
            raise CorruptData("row record truncated")
        out.append(row[pos:pos + n])
        pos += n
    if pos != len(row):
        raise CorruptData(f"row record has {len(row) - pos} trailing bytes: the schema record "
                          "does not match the rows")
    return out


def _column_from_pieces(pieces: list[bytes | None], f: Any) -> Any:
    t = f.type
    n = len(pieces)
    if pat.is_boolean(t):
        return pa.array([None if p is None else p != b"\x00" for p in pieces], t)
    if _is_bytes_like(t):
        return pa.array(pieces, pa.large_binary()).cast(t)
    if _is_fixed_width(t):
        width = t.bit_width // 8
        if any(p is not None and len(p) != width for p in pieces):
            raise CorruptData(f"column {f.name!r}: a value is not {width} bytes wide")
        data = pa.py_buffer(b"".join(p if p is not None else b"\x00" * width for p in pieces))
        nulls = sum(p is None for p in pieces)
        validity = (pa.array([p is not None for p in pieces], pa.bool_()).buffers()[1]
                    if nulls else None)
        return pa.Array.from_buffers(t, n, [validity, data], null_count=nulls)
    schema = pa.schema([pa.field("c", t)])
    arrays = [pa.ipc.read_record_batch(pa.py_buffer(p), schema).column(0) if p is not None
              else pa.nulls(1, t) for p in pieces]
    return pa.concat_arrays(arrays) if arrays else pa.array([], t)


def decode_rows(rows: Iterable[tuple[bytes, int]], schema: pa.Schema) -> pa.Table:
    """The table of ``(row record key, count)`` pairs in ``schema`` (the stored one)."""
    stored = storage_schema(schema)
    split: list[list[bytes | None]] = []
    for key, count in sorted(rows):
        if count < 0:
            raise CorruptData(f"a row has a negative count {count}: not a collection")
        split.extend([_split(key, len(stored))] * count)
    columns = [_column_from_pieces([r[i] for r in split], f) for i, f in enumerate(stored)]
    table = pa.Table.from_arrays(columns, schema=stored)
    return table.cast(schema) if stored != schema else table


def serialize_schema(schema: pa.Schema) -> bytes:
    return bytes(schema.serialize().to_pybytes())


def deserialize_schema(data: bytes) -> pa.Schema:
    try:
        return pa.ipc.read_schema(pa.py_buffer(data))
    except (pa.ArrowInvalid, OSError) as e:
        raise CorruptData(f"schema record is not an Arrow schema: {e}") from None


def contents_for(table: pa.Table) -> Counter[tuple[bytes, bytes]]:
    """The ``(key, val) -> count`` contents a shard must hold to store ``table``."""
    schema = table.schema
    if not len(schema):
        raise UnsupportedTable("a table without columns cannot be stored")
    stored = storage_schema(schema)
    data = table.cast(stored) if stored != schema else table
    contents: Counter[tuple[bytes, bytes]] = Counter((row, b"") for row in encode_rows(data))
    contents[(SCHEMA_KEY, serialize_schema(schema))] = 1
    return contents


def diff(current: Counter[tuple[bytes, bytes]], desired: Counter[tuple[bytes, bytes]]
         ) -> Iterator[tuple[bytes, bytes, int]]:
    """The ``(key, val, diff)`` updates that turn ``current`` into ``desired``."""
    for kv in sorted(set(current) | set(desired)):
        delta = desired.get(kv, 0) - current.get(kv, 0)
        if delta:
            yield kv[0], kv[1], delta


def table_from_contents(contents: Iterable[tuple[bytes, bytes, int]], where: str) -> pa.Table:
    """Decode a shard's consolidated ``(key, val, count)`` contents into the stored table.

    Raises:
        CorruptData: no (or more than one) schema record, or a malformed row.
    """
    schemas, rows = [], []
    for key, val, count in contents:
        if key == SCHEMA_KEY:
            schemas.append((val, count))
        else:
            rows.append((key, count))
    if len(schemas) != 1 or schemas[0][1] != 1:
        raise CorruptData(f"{where}: expected one schema record, found {len(schemas)}: the "
                          "shard was not written by PersistIOManager")
    try:
        return decode_rows(rows, deserialize_schema(schemas[0][0]))
    except CorruptData as e:
        raise CorruptData(f"{where}: {e}") from None
