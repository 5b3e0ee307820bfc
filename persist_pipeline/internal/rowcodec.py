"""The row encoding of typed shards: Arrow columns <-> the ``k``/``v`` bytes of the core.

A typed shard stores every update with its key columns encoded into ``k`` and its value
columns into ``v``, so compaction, consolidation and every guarantee of the untyped core
apply unchanged; the typed columns are decoded from ``k``/``v`` on the way out (and
written beside them in Parquet parts for other engines).

The encoding is canonical: two rows encode to the same bytes exactly when every column
is equal, nulls included (floats: all NaNs are one value and ``-0.0`` is ``0.0``). Each
column's encoding is prefix-free given its type, and a row is the concatenation of its
columns', so decoding is unambiguous:

- fixed width ``w`` (integers, floats, booleans, dates, times, timestamps, durations,
  decimals, fixed-size binary): a validity byte (1 valid, 0 null) and ``w`` bytes,
  big-endian with the sign flipped (so single fixed-width keys sort numerically), all
  zero when null;
- strings and binary: a validity byte, a 4-byte big-endian length, the bytes;
- structs: a validity byte, then every child (a null struct's children encode as null);
- lists: a validity byte, a 4-byte big-endian element count, then the elements.

A value row stops after its last non-null column, which makes a row written before
nullable value columns were added encode exactly like the same row with nulls in them.

Encoding and decoding are vectorized with numpy column by column; nested lists decode
one element position at a time across all rows.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.exceptions import CorruptPart, InvalidUpdates

_U8 = np.uint8
# The empty separator of binary_join_element_wise, built from buffers: converting a
# Python object (pa.scalar) would import pandas, a third of a second at every start.
_SEP = pa.Array.from_buffers(pa.large_binary(), 1, [None, pa.py_buffer(bytes(16)),
                                                    pa.py_buffer(b"")])[0]


def _validity(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return np.asarray(pc.is_valid(arr).to_numpy(zero_copy_only=False), dtype=bool)


_WIDTHS: dict[pa.DataType, int | None] = {}


def _fixed_width(type_: pa.DataType) -> int | None:
    """The byte width of a fixed-width type this codec stores as such, else None."""
    try:
        return _WIDTHS[type_]
    except KeyError:
        width = _compute_fixed_width(type_)
        if len(_WIDTHS) < 1024:
            _WIDTHS[type_] = width
        return width


def _compute_fixed_width(type_: pa.DataType) -> int | None:
    if pa.types.is_boolean(type_):
        return 1
    if pa.types.is_fixed_size_binary(type_) or pa.types.is_decimal(type_):
        return int(type_.byte_width)
    if (pa.types.is_integer(type_) or pa.types.is_floating(type_)
            or pa.types.is_temporal(type_)):
        return int(type_.bit_width) // 8
    return None


def _is_signed(type_: pa.DataType) -> bool:
    return bool(pa.types.is_signed_integer(type_) or pa.types.is_temporal(type_)
                or pa.types.is_decimal(type_))


def _is_varwidth(type_: pa.DataType) -> bool:
    return bool(pa.types.is_string(type_) or pa.types.is_large_string(type_)
                or pa.types.is_binary(type_) or pa.types.is_large_binary(type_))


@functools.lru_cache(maxsize=256)
def _known_time_zone(tz: str) -> bool:
    """Whether Arrow can convert timestamps in ``tz`` (its tz database, or an offset)."""
    try:
        pc.local_timestamp(pa.array([0], pa.timestamp("s", tz)))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True


def check_new_type(type_: pa.DataType, where: str) -> None:
    """Raise :class:`InvalidUpdates` if ``type_`` (recursively) holds what Arrow takes
    as a type but cannot carry through: a timestamp naming a time zone Arrow does not
    know (Arrow takes any text as a zone, then fails on every conversion of the column:
    its CSV and pandas output, casts), or a decimal whose scale is negative or beyond its
    precision (Parquet cannot hold it: compaction could never flush the shard's inline
    rows, and a write too large to inline failed). A shard of either would take rows
    that reads or maintenance cannot handle."""
    if pa.types.is_timestamp(type_) and type_.tz and not _known_time_zone(type_.tz):
        raise InvalidUpdates(f"{where}: unknown time zone {type_.tz!r} (a name of the tz "
                             f"database such as 'UTC' or 'Europe/Paris', or an offset "
                             f"such as '+05:30')")
    if pa.types.is_decimal(type_) and not 0 <= type_.scale <= type_.precision:
        raise InvalidUpdates(f"{where}: {type_} has a scale outside [0, its precision], "
                             f"which Parquet parts cannot hold")
    if pa.types.is_struct(type_):
        for i in range(type_.num_fields):
            check_new_type(type_.field(i).type, f"{where}.{type_.field(i).name}")
    elif pa.types.is_list(type_) or pa.types.is_large_list(type_):
        check_new_type(type_.value_type, f"{where}[]")


def check_type(type_: pa.DataType, where: str) -> None:
    """Raise :class:`InvalidUpdates` unless the codec supports ``type_`` (recursively)."""
    if pa.types.is_float16(type_):
        raise InvalidUpdates(f"{where}: float16 is not supported (use float32)")
    if pa.types.is_interval(type_):
        raise InvalidUpdates(f"{where}: interval types are not supported (use a duration)")
    if _fixed_width(type_) is not None or _is_varwidth(type_):
        return
    if pa.types.is_struct(type_):
        if type_.num_fields == 0:
            raise InvalidUpdates(f"{where}: a struct needs at least one field")
        for i in range(type_.num_fields):
            check_type(type_.field(i).type, f"{where}.{type_.field(i).name}")
        return
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        check_type(type_.value_type, f"{where}[]")
        return
    raise InvalidUpdates(
        f"{where}: type {type_} is not supported in a shard schema (supported: integers, "
        f"float32/64, booleans, decimals, strings, binary, fixed-size binary, dates, "
        f"times, timestamps, durations, and lists and structs of these)")


# --- encoding -----------------------------------------------------------------------------


def _binary_offsets(arr: pa.Array) -> np.ndarray:
    """The n+1 offsets of a ``large_binary`` array into its data buffer."""
    return np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset:arr.offset + len(arr) + 1]


def _binary_data(arr: pa.Array) -> np.ndarray:
    data = arr.buffers()[2]
    return np.frombuffer(data, dtype=_U8) if data is not None else np.zeros(0, _U8)


def _binary_from(data: np.ndarray, offsets: np.ndarray) -> pa.Array:
    return pa.Array.from_buffers(pa.large_binary(), len(offsets) - 1,
                                 [None, pa.py_buffer(offsets.astype(np.int64)),
                                  pa.py_buffer(data)])


def _fixed_rows(rows: np.ndarray) -> pa.Array:
    """A (n, w) uint8 matrix as a large_binary array of n w-byte values."""
    n, w = rows.shape
    return _binary_from(np.ascontiguousarray(rows).reshape(-1),
                        np.arange(n + 1, dtype=np.int64) * w)


def _raw_le(arr: pa.Array, w: int) -> np.ndarray:
    """The little-endian value bytes of a fixed-width array as an (n, w) matrix."""
    n = len(arr)
    if pa.types.is_boolean(arr.type):
        bits = pc.fill_null(arr, False).to_numpy(zero_copy_only=False)
        return np.asarray(bits, dtype=_U8).reshape(n, 1)
    buf = arr.buffers()[1]
    raw = np.frombuffer(buf, dtype=_U8) if buf is not None else np.zeros(0, _U8)
    return raw[arr.offset * w:(arr.offset + n) * w].reshape(n, w)


def _encode_fixed(arr: pa.Array, w: int) -> pa.Array:
    return _fixed_rows(_encode_fixed_matrix(arr, w))


def _encode_fixed_matrix(arr: pa.Array, w: int) -> np.ndarray:
    """Each row's encoding of a fixed-width column, as an (n, 1 + w) matrix."""
    type_ = arr.type
    valid = _validity(arr)
    raw = _raw_le(arr, w)
    if pa.types.is_floating(type_):
        floats = raw.copy().view(np.float64 if w == 8 else np.float32).reshape(-1)
        floats[floats == 0] = 0.0  # -0.0 is 0.0
        floats[np.isnan(floats)] = np.nan  # one NaN
        bits = floats.view(np.uint64 if w == 8 else np.uint32).astype(np.uint64)
        sign = np.uint64(1 << (8 * w - 1))
        mask = np.uint64((1 << (8 * w)) - 1)
        # Negative floats: every bit flipped; others: the sign bit set (order-preserving).
        bits = np.where((bits & sign) != 0, ~bits & mask, bits | sign)
        be = bits.astype(">u8").view(_U8).reshape(-1, 8)[:, 8 - w:]
    elif pa.types.is_fixed_size_binary(type_) or pa.types.is_boolean(type_):
        be = raw.copy()
    else:
        be = raw[:, ::-1].copy()
        if _is_signed(type_):
            be[:, 0] ^= 0x80
    be[~valid] = 0
    rows = np.empty((len(arr), 1 + w), dtype=_U8)
    rows[:, 0] = valid
    rows[:, 1:] = be
    return rows


def _header(valid: np.ndarray, counts: np.ndarray) -> pa.Array:
    """Validity byte plus a 4-byte big-endian count per row."""
    if len(counts) and int(counts.max()) >= 1 << 32:
        raise InvalidUpdates("a value of 4 GiB or more cannot be stored")
    rows = np.empty((len(valid), 5), dtype=_U8)
    rows[:, 0] = valid
    rows[:, 1:] = counts.astype(">u4").view(_U8).reshape(-1, 4)
    return _fixed_rows(rows)


def _encode_varwidth(arr: pa.Array) -> pa.Array:
    valid = _validity(arr)
    as_bytes = pc.fill_null(arr.cast(pa.large_binary()), _SEP)
    lengths = np.asarray(pc.binary_length(as_bytes).to_numpy(zero_copy_only=False), np.int64)
    return pc.binary_join_element_wise(_header(valid, lengths), as_bytes, _SEP)


def _encode_struct(arr: pa.StructArray) -> pa.Array:
    valid = _validity(arr)
    flags = _fixed_rows(valid.astype(_U8).reshape(-1, 1))
    children = [encode_column(child) for child in arr.flatten()]
    return pc.binary_join_element_wise(flags, *children, _SEP)


def _encode_list(arr: pa.Array) -> pa.Array:
    valid = _validity(arr)
    offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), np.int64)
    counts = np.where(valid, offsets[1:] - offsets[:-1], 0)
    elements = encode_column(arr.values)
    element_offsets = _binary_offsets(elements)
    byte_offsets = element_offsets[offsets]
    # Null lists may cover elements in Arrow; their payload is dropped.
    byte_offsets[1:] = np.where(valid, byte_offsets[1:], byte_offsets[:-1])
    starts = np.where(valid, byte_offsets[:-1], 0)
    lengths = np.where(valid, element_offsets[offsets[1:]] - element_offsets[offsets[:-1]], 0)
    payload = _gather(_binary_data(elements), starts, lengths)
    return pc.binary_join_element_wise(_header(valid, counts), payload, _SEP)


def _gather(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """``flat[starts[i]:starts[i]+lengths[i]]`` for every ``i``, as a binary array."""
    out_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out_offsets[1:])
    total = int(out_offsets[-1])
    index = np.repeat(starts - out_offsets[:-1], lengths) + np.arange(total, dtype=np.int64)
    return _binary_from(flat[index], out_offsets)


def encode_column(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each row's encoding of one column, as a ``large_binary`` array."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    type_ = arr.type
    width = _fixed_width(type_)
    if width is not None:
        return _encode_fixed(arr, width)
    if _is_varwidth(type_):
        return _encode_varwidth(arr)
    if pa.types.is_struct(type_):
        return _encode_struct(arr)
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return _encode_list(arr)
    raise InvalidUpdates(f"type {type_} is not supported in a shard schema")


#: Up to this many rows, :func:`encode_rows_list` encodes in plain Python over numpy
#: views: for a small write, a dozen Arrow kernel calls per column cost more than the
#: rows themselves.
SMALL_ROWS = 256


#: Up to this many rows, integer, temporal, float and boolean columns are encoded value
#: by value in Python (numpy's per-call cost dominates below it).
_PER_VALUE_ROWS = 32


def _python_values(arr: pa.Array, w: int) -> list[Any] | None:
    """The values of a small integer-like, float or boolean column as Python numbers
    (raw integers for temporal types), or None for other types."""
    type_ = arr.type
    if pa.types.is_boolean(type_):
        return list(arr.to_pylist())
    if pa.types.is_decimal(type_) or pa.types.is_fixed_size_binary(type_):
        return None
    if pa.types.is_floating(type_):
        dtype = np.dtype(f"<f{w}")
    elif pa.types.is_unsigned_integer(type_):
        dtype = np.dtype(f"<u{w}")
    else:
        dtype = np.dtype(f"<i{w}")
    data = arr.buffers()[1]
    if data is None:
        return None
    values: list[Any] = np.frombuffer(data, dtype=dtype, count=len(arr),
                                      offset=arr.offset * w).tolist()
    if arr.null_count:
        valid = _validity(arr)
        values = [v if ok else None for v, ok in zip(values, valid, strict=True)]
    return values


#: ``struct`` format letters of the little-endian integers a fixed-width column holds,
#: by (signed, width); temporal types are signed integers of their width.
_INT_FORMATS = {(True, 1): "b", (True, 2): "h", (True, 4): "i", (True, 8): "q",
                (False, 1): "B", (False, 2): "H", (False, 4): "I", (False, 8): "Q"}
_SIGN_FLIP = {1: 1 << 7, 2: 1 << 15, 4: 1 << 31, 8: 1 << 63}
_FLOAT_FORMATS = {4: ("f", "I"), 8: ("d", "Q")}
_SMALL_FIXED: dict[pa.DataType, tuple[str, str, int] | None] = {}


def _small_fixed_kind(type_: pa.DataType, w: int) -> tuple[str, str, int] | None:
    """How :func:`_small_fixed_list` reads a column of ``type_``: ("int", format,
    offset added before the big-endian write) or ("float", format, 0); None for the
    general path (booleans, decimals, fixed-size binary)."""
    try:
        return _SMALL_FIXED[type_]
    except KeyError:
        pass
    kind: tuple[str, str, int] | None = None
    if pa.types.is_floating(type_) and w in _FLOAT_FORMATS:
        kind = ("float", _FLOAT_FORMATS[w][0], 0)
    elif ((pa.types.is_integer(type_) or pa.types.is_temporal(type_))
          and (_is_signed(type_), w) in _INT_FORMATS):
        signed = _is_signed(type_)
        kind = ("int", _INT_FORMATS[signed, w], _SIGN_FLIP[w] if signed else 0)
    if len(_SMALL_FIXED) < 1024:
        _SMALL_FIXED[type_] = kind
    return kind


def _small_fixed_list(arr: pa.Array, width: int) -> list[bytes] | None:
    """The per-value encoding of a small fixed-width column without nulls, read straight
    from its data buffer (the bytes :func:`_fixed_values` gives); None where that path
    is not this one's: nulls, booleans, decimals, fixed-size binary, NaN or zero floats
    (which the general path canonicalizes)."""
    if arr.null_count:
        return None
    kind = _small_fixed_kind(arr.type, width)
    data = arr.buffers()[1]
    if kind is None or data is None:
        return None
    n = len(arr)
    what, letter, offset = kind
    values = struct.unpack_from(f"<{n}{letter}", data, arr.offset * width)
    if what == "int":
        return [b"\x01" + (v + offset).to_bytes(width, "big") for v in values]
    if any(v != v or v == 0 for v in values):
        return None
    sign = _SIGN_FLIP[width]
    mask = (sign << 1) - 1
    bits = struct.unpack(f">{n}{_FLOAT_FORMATS[width][1]}",
                         struct.pack(f">{n}{letter}", *values))
    # Negative floats: every bit flipped; others: the sign bit set (order-preserving).
    return [b"\x01" + ((~b & mask) if b & sign else (b | sign)).to_bytes(width, "big")
            for b in bits]


def _fixed_list(arr: pa.Array, width: int) -> list[bytes]:
    if len(arr) <= _PER_VALUE_ROWS:
        fast = _small_fixed_list(arr, width)
        if fast is not None:
            return fast
        values = _python_values(arr, width)
        if values is not None:
            return _fixed_values(arr.type, width, values)
    rows = _encode_fixed_matrix(arr, width)
    flat = rows.tobytes()
    step = 1 + width
    return [flat[i:i + step] for i in range(0, len(flat), step)]


def _fixed_values(type_: pa.DataType, w: int, values: list[Any]) -> list[bytes]:
    null = bytes(1 + w)
    out = []
    if pa.types.is_boolean(type_):
        return [null if v is None else (b"\x01\x01" if v else b"\x01\x00") for v in values]
    if pa.types.is_floating(type_):
        fmt, sign, mask = (">d", 1 << 63, (1 << 64) - 1) if w == 8 else (">f", 1 << 31,
                                                                       (1 << 32) - 1)
        for v in values:
            if v is None:
                out.append(null)
                continue
            if math.isnan(v):
                v = math.nan
            elif v == 0:
                v = 0.0
            bits = int.from_bytes(struct.pack(fmt, v), "big")
            bits = (~bits & mask) if bits & sign else (bits | sign)
            out.append(b"\x01" + bits.to_bytes(w, "big"))
        return out
    offset = 0 if pa.types.is_unsigned_integer(type_) else 1 << (8 * w - 1)
    return [null if v is None else b"\x01" + (v + offset).to_bytes(w, "big") for v in values]


def _varwidth_list(arr: pa.Array) -> list[bytes]:
    out = []
    text = pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
    for value in arr.to_pylist():
        if value is None:
            out.append(b"\x00\x00\x00\x00\x00")
            continue
        data = value.encode() if text else value
        if len(data) >= 1 << 32:
            raise InvalidUpdates("a value of 4 GiB or more cannot be stored")
        out.append(b"\x01" + len(data).to_bytes(4, "big") + data)
    return out


def _column_list(arr: pa.Array | pa.ChunkedArray) -> list[bytes]:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()
    width = _fixed_width(arr.type)
    if width is not None:
        return _fixed_list(arr, width)
    if _is_varwidth(arr.type):
        return _varwidth_list(arr)
    return list(encode_column(arr).to_pylist())


def encode_rows_list(columns: Sequence[pa.Array | pa.ChunkedArray], num_rows: int, *,
                     strip_trailing_nulls: bool) -> list[bytes]:
    """:func:`encode_rows` as a list of ``bytes``, computed in plain Python for small
    inputs (identical bytes: the tests compare both on random tables)."""
    if num_rows > SMALL_ROWS:
        return list(encode_rows(columns, num_rows,
                                strip_trailing_nulls=strip_trailing_nulls).to_pylist())
    encoded = [_column_list(c) for c in columns]
    if not encoded:
        return [b""] * num_rows
    if len(encoded) == 1 and not (strip_trailing_nulls and columns[0].null_count):
        return encoded[0]
    if strip_trailing_nulls and any(c.null_count for c in columns):
        valid = [_validity(c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c)
                 for c in columns]
        out = []
        for i in range(num_rows):
            last = len(columns)
            while last and not valid[last - 1][i]:
                last -= 1
            out.append(b"".join(encoded[j][i] for j in range(last)))
        return out
    return [b"".join(row) for row in zip(*encoded, strict=True)]


def _empty_rows(n: int) -> pa.Array:
    return _binary_from(np.zeros(0, _U8), np.zeros(n + 1, dtype=np.int64))


def encode_rows(columns: Sequence[pa.Array | pa.ChunkedArray], num_rows: int, *,
                strip_trailing_nulls: bool) -> pa.Array:
    """The encoding of whole rows (the ``k`` or ``v`` column), as ``binary``.

    Args:
        columns: the row's columns, in schema order.
        num_rows: the number of rows (columns may be empty for a value without columns).
        strip_trailing_nulls: end each row after its last non-null column (values).
    """
    if not columns:
        return _empty_rows(num_rows).cast(pa.binary())
    encoded = [encode_column(c) for c in columns]
    if strip_trailing_nulls:
        later_valid = np.zeros(num_rows, dtype=bool)
        for i in range(len(columns) - 1, -1, -1):
            column = columns[i]
            later_valid |= _validity(column.combine_chunks()
                                     if isinstance(column, pa.ChunkedArray) else column)
            if not later_valid.all():
                encoded[i] = pc.if_else(pa.array(later_valid), encoded[i],
                                        pa.scalar(b"", pa.large_binary()))
    joined = encoded[0] if len(encoded) == 1 else pc.binary_join_element_wise(*encoded, _SEP)
    try:
        return joined.cast(pa.binary())
    except pa.ArrowInvalid:
        raise InvalidUpdates("the encoded rows of one write exceed 2 GiB: split the "
                             "write") from None


# --- decoding -----------------------------------------------------------------------------


class _Reader:
    """The encoded rows of one ``k`` or ``v`` column as one flat byte array."""

    def __init__(self, rows: pa.Array | pa.ChunkedArray, where: str) -> None:
        if isinstance(rows, pa.ChunkedArray):
            rows = rows.combine_chunks()
        rows = rows.cast(pa.large_binary())
        offsets = _binary_offsets(rows)
        self.data = _binary_data(rows)
        self.starts = offsets[:-1]
        self.ends = offsets[1:]
        self.where = where

    def corrupt(self, what: str) -> CorruptPart:
        return CorruptPart(f"corrupt typed row in {self.where}: {what}")

    def take(self, pos: np.ndarray, ends: np.ndarray, width: int) -> np.ndarray:
        """``width`` bytes at each position, as an (m, width) matrix; bounds-checked."""
        if len(pos) and bool(np.any(pos + width > ends)):
            raise self.corrupt("a row ends inside a column")
        return self.data[pos[:, None] + np.arange(width, dtype=np.int64)]

    def header(self, pos: np.ndarray, ends: np.ndarray, what: str
               ) -> tuple[np.ndarray, np.ndarray]:
        """The validity flags and 4-byte big-endian counts at ``pos`` (a null has 0)."""
        valid = self.flags(pos, ends)
        counts = self.take(pos + 1, ends, 4).copy().view(">u4").reshape(-1).astype(np.int64)
        if bool(np.any(counts[~valid])):
            raise self.corrupt(f"a null {what} is not empty")
        return valid, counts

    def flags(self, pos: np.ndarray, ends: np.ndarray) -> np.ndarray:
        flags = self.take(pos, ends, 1)[:, 0]
        if len(flags) and int(flags.max()) > 1:
            raise self.corrupt("a validity byte is neither 0 nor 1")
        return np.asarray(flags == 1)


def _validity_buffer(valid: np.ndarray) -> pa.Buffer | None:
    if valid.all():
        return None
    return pa.py_buffer(np.packbits(valid, bitorder="little"))


def _decode_fixed(r: _Reader, type_: pa.DataType, w: int, pos: np.ndarray,
                  ends: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    valid = r.flags(pos, ends)
    be = r.take(pos + 1, ends, w)
    n = len(pos)
    if pa.types.is_floating(type_):
        bits = be.copy().view(">u8" if w == 8 else ">u4").reshape(-1).astype(np.uint64)
        sign = np.uint64(1 << (8 * w - 1))
        mask = np.uint64((1 << (8 * w)) - 1)
        bits = np.where((bits & sign) != 0, bits & ~sign & mask, ~bits & mask)
        bits[~valid] = 0
        native = bits.astype(np.uint64 if w == 8 else np.uint32)
        raw = native.view(_U8).reshape(n, w)
    elif pa.types.is_fixed_size_binary(type_) or pa.types.is_boolean(type_):
        raw = be
    else:
        raw = be.copy()
        if _is_signed(type_):
            raw[:, 0] ^= 0x80
        raw = raw[:, ::-1]
        raw[~valid] = 0
    if pa.types.is_boolean(type_):
        data = pa.py_buffer(np.packbits(raw[:, 0].astype(bool), bitorder="little"))
    else:
        data = pa.py_buffer(np.ascontiguousarray(raw).reshape(-1))
    arr = pa.Array.from_buffers(type_, n, [_validity_buffer(valid), data])
    return arr, pos + 1 + w


def _decode_varwidth(r: _Reader, type_: pa.DataType, pos: np.ndarray,
                     ends: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    valid, lengths = r.header(pos, ends, "string")
    starts = pos + 5
    if len(pos) and bool(np.any(starts + lengths > ends)):
        raise r.corrupt("a value runs past the end of its row")
    values = _gather(r.data, starts, lengths)
    large = pa.types.is_large_string(type_) or pa.types.is_large_binary(type_)
    offsets = _binary_offsets(values)
    if not large and int(offsets[-1]) >= 1 << 31:
        raise CorruptPart(f"{r.where}: decoded column exceeds 2 GiB")
    arr = pa.Array.from_buffers(
        type_, len(pos),
        [_validity_buffer(valid),
         pa.py_buffer(np.asarray(offsets, np.int64 if large else np.int32)),
         values.buffers()[2]])
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        try:
            arr.validate(full=True)
        except pa.ArrowInvalid as e:
            raise r.corrupt(f"invalid UTF-8: {e}") from None
    return arr, starts + lengths


def _decode_struct(r: _Reader, type_: pa.StructType, pos: np.ndarray,
                   ends: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    valid = r.flags(pos, ends)
    pos = pos + 1
    children = []
    for i in range(type_.num_fields):
        child, pos = decode_column(r, type_.field(i).type, pos, ends)
        children.append(child)
    fields = [type_.field(i) for i in range(type_.num_fields)]
    mask = None if valid.all() else pa.array(~valid)
    return pa.StructArray.from_arrays(children, fields=fields, mask=mask), pos


def _decode_list(r: _Reader, type_: pa.DataType, pos: np.ndarray,
                 ends: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    valid, counts = r.header(pos, ends, "list")
    offsets = np.zeros(len(pos) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    cursor = pos + 5
    pieces: list[pa.Array] = []
    destinations: list[np.ndarray] = []
    # Element k of every row that has one, for k = 0, 1, ...: positions within a row
    # depend on the sizes of the elements before, so rows advance together.
    for k in range(int(counts.max()) if len(counts) else 0):
        rows = np.flatnonzero(counts > k)
        piece, cursor[rows] = decode_column(r, type_.value_type, cursor[rows], ends[rows])
        pieces.append(piece)
        destinations.append(offsets[rows] + k)
    if pieces:
        order = np.argsort(np.concatenate(destinations), kind="stable")
        values = pa.concat_arrays(pieces).take(pa.array(order))
    else:
        values = pa.array([], type_.value_type)
    mask = None if valid.all() else pa.array(~valid)
    builder = pa.LargeListArray if pa.types.is_large_list(type_) else pa.ListArray
    offsets_array = pa.array(offsets, pa.int64() if pa.types.is_large_list(type_)
                             else pa.int32())
    arr = builder.from_arrays(offsets_array, values, type=type_, mask=mask)
    return arr, cursor


def decode_column(r: _Reader, type_: pa.DataType, pos: np.ndarray,
                  ends: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    """Decode one column at ``pos`` of each row; returns it and the positions after."""
    width = _fixed_width(type_)
    if width is not None:
        return _decode_fixed(r, type_, width, pos, ends)
    if _is_varwidth(type_):
        return _decode_varwidth(r, type_, pos, ends)
    if pa.types.is_struct(type_):
        return _decode_struct(r, type_, pos, ends)
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return _decode_list(r, type_, pos, ends)
    raise CorruptPart(f"{r.where}: type {type_} cannot be decoded")


def decode_rows(rows: pa.Array | pa.ChunkedArray, schema: pa.Schema, *, where: str,
                allow_missing_trailing: bool) -> list[pa.Array]:
    """Decode ``k`` or ``v`` bytes into the columns of ``schema``.

    Args:
        rows: the encoded rows.
        schema: the columns to decode, in order.
        where: names the data in errors.
        allow_missing_trailing: a row may end before a column (values): it is null.

    Raises:
        CorruptPart: the bytes are not rows of ``schema``.
    """
    r = _Reader(rows, where)
    n = len(r.starts)
    pos = r.starts.copy()
    out: list[pa.Array] = []
    for field in schema:
        present = pos < r.ends
        if present.all():
            column, pos = decode_column(r, field.type, pos, r.ends)
        elif not allow_missing_trailing:
            raise r.corrupt(f"a row ends before column {field.name!r}")
        else:
            rows_here = np.flatnonzero(present)
            piece, pos[rows_here] = decode_column(r, field.type, pos[rows_here],
                                                  r.ends[rows_here])
            index = np.zeros(n, dtype=np.int64)
            index[rows_here] = np.arange(len(rows_here), dtype=np.int64)
            column = piece.take(pa.array(index, mask=~present))
        out.append(column)
    if n and bool(np.any(pos != r.ends)):
        raise r.corrupt("a row has bytes after its last column (a column the schema lacks?)")
    return out
