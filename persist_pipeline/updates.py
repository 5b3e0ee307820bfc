"""Updates ``(key, val, ts, diff)``: validation, consolidation and the two part encodings.

Hollow parts are Parquet files with columns ``k`` (binary), ``v`` (binary), ``t`` (int64)
and ``d`` (int64), sorted by ``(k, v, t)`` and consolidated, so Spark, DuckDB and pandas
read them directly. Inline parts are the same columns as an ``InlineUpdates`` protobuf.

:func:`consolidate` is the engine-agnostic merge function: the local compaction executor
and the Spark executor both call it.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from google.protobuf.message import DecodeError

from persist_pipeline.exceptions import (
    CorruptPart,
    DiffOverflow,
    InvalidUpdates,
    ResourceExhausted,
)
from persist_pipeline.frontier import MAX_TIME
from persist_pipeline.proto import persist_pb2 as pb

#: The schema of every snapshot and hollow part.
SCHEMA = pa.schema(
    [
        pa.field("k", pa.binary(), nullable=False),
        pa.field("v", pa.binary(), nullable=False),
        pa.field("t", pa.int64(), nullable=False),
        pa.field("d", pa.int64(), nullable=False),
    ],
    metadata={b"persist_pipeline.format": b"1"},
)
_MIN_DIFF = -(1 << 63)
_MAX_DIFF = (1 << 63) - 1
#: Below this many rows, sequences are validated and consolidated in plain Python,
#: which is faster than building Arrow arrays for a handful of updates.
_SMALL_WRITE_ROWS = 256


_EMPTY: pa.Table | None = None


def empty_table() -> pa.Table:
    """An empty k/v/t/d table (built once, on first use: building one imports pandas)."""
    global _EMPTY
    if _EMPTY is None:
        _EMPTY = SCHEMA.empty_table()
    return _EMPTY


def _bad(index: int, what: str) -> InvalidUpdates:
    return InvalidUpdates(f"update #{index}: {what}")


def _text_hint(value: object) -> str:
    """For text where bytes belong: how to encode it."""
    if isinstance(value, str):
        return f" (encode text as UTF-8 first: {value[:20]!r}.encode())"
    return ""


def _from_rows(rows: Iterable[Any]) -> tuple[list[bytes], list[bytes], list[int], list[int]]:
    sums: dict[tuple[bytes, bytes, int], int] = {}
    for i, row in enumerate(rows):
        try:
            k, v, t, d = row
        except (TypeError, ValueError):
            raise _bad(i, "expected a (key, val, ts, diff) tuple") from None
        if type(k) is not bytes:
            raise _bad(i, f"key must be bytes, got {type(k).__name__}{_text_hint(k)}")
        if type(v) is not bytes:
            raise _bad(i, f"val must be bytes, got {type(v).__name__}{_text_hint(v)}")
        if type(t) is not int or not 0 <= t <= MAX_TIME:
            raise _bad(i, f"ts must be a non-negative int in [0, 2**63-1], got {t!r}")
        if type(d) is not int or not _MIN_DIFF <= d <= _MAX_DIFF:
            raise _bad(i, f"diff must be a signed 64-bit int, got {d!r}")
        key = (k, v, t)
        sums[key] = sums.get(key, 0) + d
    return _sorted_sums(sums)


def _from_columns(ks: list[bytes], vs: list[bytes], ts: list[int], ds: list[int]
                  ) -> tuple[list[bytes], list[bytes], list[int], list[int]]:
    """:func:`_from_rows` of columns whose types are already right (read from non-null
    binary and int64 Arrow columns, or encoded by a shard schema): only the sign of the
    times is left to check."""
    if ts and min(ts) < 0:
        i = next(i for i, t in enumerate(ts) if t < 0)
        raise _bad(i, f"ts must be a non-negative int in [0, 2**63-1], got {ts[i]!r}")
    sums: dict[tuple[bytes, bytes, int], int] = {}
    for k, v, t, d in zip(ks, vs, ts, ds, strict=True):
        key = (k, v, t)
        sums[key] = sums.get(key, 0) + d
    return _sorted_sums(sums)


def _sorted_sums(sums: dict[tuple[bytes, bytes, int], int]
                 ) -> tuple[list[bytes], list[bytes], list[int], list[int]]:
    ks: list[bytes] = []
    vs: list[bytes] = []
    ts: list[int] = []
    ds: list[int] = []
    for key in sorted(sums):  # the keys alone: (k, v, t) are distinct, diffs never compared
        d = sums[key]
        if d != 0:
            k, v, t = key
            if not _MIN_DIFF <= d <= _MAX_DIFF:
                raise InvalidUpdates(f"the write's {DiffOverflow(k, v, t, d).what}")
            ks.append(k)
            vs.append(v)
            ts.append(t)
            ds.append(d)
    return ks, vs, ts, ds


def _is_text(type_: pa.DataType) -> bool:
    if pa.types.is_dictionary(type_):
        return _is_text(type_.value_type)
    return bool(pa.types.is_string(type_) or pa.types.is_large_string(type_)
                or pa.types.is_string_view(type_))


def _check_table(table: pa.Table) -> pa.Table:
    names = set(table.column_names)
    if names != {"k", "v", "t", "d"}:
        raise InvalidUpdates(f"a table of updates needs exactly columns k, v, t, d; got "
                             f"{sorted(names)}")
    for name in ("k", "v"):
        if _is_text(table.schema.field(name).type):
            # As for tuples: keys and values are bytes, text is never guessed at.
            raise InvalidUpdates(
                f"column {name} holds text ({table.schema.field(name).type}); keys and "
                f"values are bytes: encode them as UTF-8 first (pyarrow: "
                f"pc.cast(col, pa.binary()); pandas: df[{name!r}].str.encode('utf-8'); "
                f"polars: pl.col({name!r}).cast(pl.Binary))")
    for name, what in (("t", "time"), ("d", "diff")):
        type_ = table.schema.field(name).type
        if pa.types.is_dictionary(type_):
            type_ = type_.value_type
        if not pa.types.is_integer(type_):
            # As for tuples, whose times and diffs must be ints: a bool, float, decimal
            # or temporal column is not cast into int64 (True taken as a diff of 1, a
            # timestamp as its count of nanoseconds), it is refused.
            raise InvalidUpdates(
                f"updates table has wrong column types: column {name} (the {what}) must "
                f"hold integers, as a tuple's {what} is an int; got "
                f"{table.schema.field(name).type}"
                + (": convert times to integers yourself (for example epoch "
                   "milliseconds)" if name == "t" and pa.types.is_temporal(type_) else ""))
    for name in SCHEMA.names:
        if table.column(name).null_count:
            raise InvalidUpdates(f"column {name} contains nulls")
    if table.schema.equals(SCHEMA, check_metadata=False):
        return table  # already k, v, t, d in order and type (t >= 0 is checked later)
    try:
        table = table.select(["k", "v", "t", "d"]).cast(SCHEMA, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, ValueError) as e:
        raise InvalidUpdates(f"updates table has wrong column types (want k, v binary; "
                             f"t, d int64): {e}") from None
    return table


def frame_to_table(obj: object) -> object:
    """A pandas/polars DataFrame or an Arrow stream as a pyarrow Table; anything else
    unchanged. Neither pandas nor polars is imported here."""
    if isinstance(obj, pa.RecordBatchReader):
        return obj.read_all()
    module = type(obj).__module__.split(".")[0]
    name = type(obj).__name__
    try:
        if module == "pandas" and name == "DataFrame":
            return pa.Table.from_pandas(obj, preserve_index=False)
        if module == "polars" and name == "DataFrame":
            return obj.to_arrow()  # type: ignore[attr-defined]
        if module == "polars" and name == "LazyFrame":
            raise InvalidUpdates("a polars LazyFrame is a query, not data: pass "
                                 "frame.collect()")
        if hasattr(obj, "__arrow_c_stream__"):
            return pa.table(obj)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise InvalidUpdates(f"cannot read the {name} as a k/v/t/d table: {e}") from None
    return obj


class Updates:
    """A validated, consolidated set of updates, as Python lists or an Arrow table.

    Small writes stay as lists (cheap to inline); large ones are Arrow tables.
    """

    __slots__ = ("_lists", "_table")

    def __init__(self, lists: tuple[list[bytes], list[bytes], list[int], list[int]] | None,
                 table: pa.Table | None) -> None:
        self._lists = lists
        self._table = table

    @classmethod
    def coerce(cls, updates: object) -> Updates:
        """Validate and consolidate user input.

        Accepted: an iterable of ``(key, val, ts, diff)`` tuples, or a k/v/t/d table as a
        ``pyarrow.Table``, ``RecordBatch`` or ``RecordBatchReader``, a pandas or polars
        ``DataFrame``, or any object exporting an Arrow stream (``__arrow_c_stream__``).
        Keys and values must be bytes (binary columns): text is refused, in tuples and
        tables alike, with a hint to encode it.
        """
        if isinstance(updates, Updates):
            return updates
        if type(updates) is list and len(updates) <= _SMALL_WRITE_ROWS:
            return cls(_from_rows(updates), None)  # the common small write, checked as below
        if isinstance(updates, pa.RecordBatch):
            updates = pa.Table.from_batches([updates])
        elif not isinstance(updates, pa.Table):
            updates = frame_to_table(updates)
        if isinstance(updates, pa.Table):
            table = _check_table(updates)
            if table.num_rows <= _SMALL_WRITE_ROWS:  # as for tuples: plain Python is faster
                return cls.from_columns(*(table.column(c).to_pylist() for c in SCHEMA.names))
            if pc.min(table.column("t")).as_py() < 0:
                raise InvalidUpdates("ts must be non-negative")
            try:
                return cls(None, consolidate(table))
            except DiffOverflow as e:  # the same refusal as the tuple path's
                raise InvalidUpdates(f"the write's {e.what}") from None
        if isinstance(updates, str | bytes | dict) or not isinstance(updates, Iterable):
            raise InvalidUpdates("updates must be an iterable of (key, val, ts, diff) tuples "
                                 f"or a pyarrow Table with columns k, v, t, d; got "
                                 f"{type(updates).__name__}")
        rows = updates if isinstance(updates, Sequence) else list(updates)
        if len(rows) <= _SMALL_WRITE_ROWS:
            return cls(_from_rows(rows), None)
        lists = _from_rows(rows)
        return cls(None, pa.Table.from_arrays(
            [pa.array(lists[0], pa.binary()), pa.array(lists[1], pa.binary()),
             pa.array(lists[2], pa.int64()), pa.array(lists[3], pa.int64())], schema=SCHEMA))

    @classmethod
    def from_columns(cls, ks: list[bytes], vs: list[bytes], ts: list[int], ds: list[int]
                     ) -> Updates:
        """A small write given as columns of the right types (bytes keys and values,
        64-bit int times and diffs: what non-null binary/int64 Arrow columns and a shard
        schema's encoder give), consolidated; negative times are refused as in
        :meth:`coerce`."""
        return cls(_from_columns(ks, vs, ts, ds), None)

    def __len__(self) -> int:
        return len(self._lists[0]) if self._lists is not None else self.table().num_rows

    def table(self) -> pa.Table:
        if self._table is None:
            assert self._lists is not None
            ks, vs, ts, ds = self._lists
            self._table = pa.Table.from_arrays(
                [pa.array(ks, pa.binary()), pa.array(vs, pa.binary()),
                 pa.array(ts, pa.int64()), pa.array(ds, pa.int64())], schema=SCHEMA)
        return self._table

    def diff_bound(self) -> int:
        """The largest ``|d|`` of these (consolidated) updates; 0 when there are none."""
        if not len(self):
            return 0
        if self._lists is not None:
            return max(abs(d) for d in self._lists[3])
        mm = pc.min_max(self.table().column("d")).as_py()
        return max(abs(int(mm["min"])), abs(int(mm["max"])))

    def time_bounds(self) -> tuple[int, int] | None:
        if self._lists is not None:  # without len(self): a Python call of its own
            ts = self._lists[2]
            return (min(ts), max(ts)) if ts else None
        if not self.table().num_rows:
            return None
        mm = pc.min_max(self.table().column("t")).as_py()
        return int(mm["min"]), int(mm["max"])

    def filter_times(self, lower: int) -> Updates:
        """Only the updates with ``t >= lower``."""
        if self._lists is not None:
            ks, vs, ts, ds = self._lists
            keep = [i for i, t in enumerate(ts) if t >= lower]
            return Updates(([ks[i] for i in keep], [vs[i] for i in keep], [ts[i] for i in keep],
                            [ds[i] for i in keep]), None)
        table = self.table()
        return Updates(None, table.filter(pc.greater_equal(table.column("t"), lower)))

    def encode_inline(self) -> bytes:
        """The ``InlineUpdates`` protobuf encoding (its size decides inline vs blob)."""
        if self._lists is not None:
            ks, vs, ts, ds = self._lists
        else:
            t = self.table()
            ks, vs = t.column("k").to_pylist(), t.column("v").to_pylist()
            ts, ds = t.column("t").to_pylist(), t.column("d").to_pylist()
        # Filled column by column (slice assignment converts a list a little faster
        # than the constructor's keywords do; the same message, the same bytes).
        msg = pb.InlineUpdates()
        msg.keys[:] = ks
        msg.vals[:] = vs
        msg.times[:] = ts
        msg.diffs[:] = ds
        return msg.SerializeToString()

    def estimated_inline_size(self) -> int:
        """An upper-bound guess of the inline encoding's size without encoding it."""
        if self._lists is not None:
            ks, vs, _, _ = self._lists
            return sum(map(len, ks)) + sum(map(len, vs)) + 24 * len(ks)
        t = self.table()
        return int(t.column("k").nbytes + t.column("v").nbytes + 20 * t.num_rows)


def decode_inline(data: bytes, where: str) -> pa.Table:
    """Decode an inline part into a k/v/t/d table; raises :class:`CorruptPart`."""
    msg = pb.InlineUpdates()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise CorruptPart(f"corrupt inline part {where}: {e}") from None
    n = len(msg.keys)
    if not (len(msg.vals) == len(msg.times) == len(msg.diffs) == n):
        raise CorruptPart(f"corrupt inline part {where}: column lengths differ")
    if any(t > MAX_TIME for t in msg.times):
        raise CorruptPart(f"corrupt inline part {where}: time beyond 2**63-1")
    return pa.Table.from_arrays(
        [pa.array(list(msg.keys), pa.binary()), pa.array(list(msg.vals), pa.binary()),
         pa.array(list(msg.times), pa.int64()), pa.array(list(msg.diffs), pa.int64())],
        schema=SCHEMA)


#: Rows per Parquet row group are chosen so a row group holds about this many bytes of
#: updates (a streaming reader holds a read buffer and a page per column, not a row
#: group; statistics per row group let readers skip key ranges).
PARQUET_ROW_GROUP_BYTES = 4 << 20
#: Pages of about this many bytes: a streaming reader holds the page of each column it
#: is decoding (compressed and decompressed), so a merge of many runs, one reader
#: each, stays small (pyarrow's default, 1 MiB, costs 4 MiB a run; size and decoding
#: speed are unchanged, measured).
PARQUET_PAGE_BYTES = 64 << 10
_SORT_KEYS = [("k", "ascending"), ("v", "ascending"), ("t", "ascending")]


def parquet_write_options(table: pa.Table) -> dict[str, Any]:
    """How every part is encoded: zstd, row groups of about
    :data:`PARQUET_ROW_GROUP_BYTES` in pages of :data:`PARQUET_PAGE_BYTES`, statistics
    on ``k`` and ``t`` (key-range and time pruning by other engines) and dictionaries
    only for ``t`` and ``d``: sorted keys are nearly all distinct, and building a
    dictionary that is then abandoned cost half of the write time of random values
    (measured). Every page carries its CRC-32, which every read of ours checks: a
    part read in row groups (not whole, so not against the part's own CRC-32) still
    finds rotted pages instead of decoding them."""
    per_row = max(1, table.nbytes // max(1, table.num_rows))
    return {"compression": "zstd", "use_dictionary": ["t", "d"],
            "write_statistics": ["k", "t"], "data_page_size": PARQUET_PAGE_BYTES,
            "write_page_checksum": True,
            "row_group_size": max(1024, PARQUET_ROW_GROUP_BYTES // per_row)}


def encode_parquet(table: pa.Table) -> bytes:
    """Encode a consolidated k/v/t/d table as one Parquet file (see
    :func:`parquet_write_options`)."""
    buf = io.BytesIO()
    table = table.cast(SCHEMA)
    pq.write_table(table, buf, **parquet_write_options(table))
    return buf.getvalue()


def decode_parquet(data: bytes, where: str) -> pa.Table:
    """Decode a Parquet part; raises :class:`CorruptPart` naming ``where``."""
    try:
        # Read on this thread, not by pq.read_table: its dataset scan leaves tasks on
        # Arrow's thread pools after it returns, holding Python buffers of ``data``; one
        # still holding the last at interpreter exit took the GIL during finalization and
        # aborted the process ("terminate called without an active exception").
        with pq.ParquetFile(pa.BufferReader(data), pre_buffer=False,
                            page_checksum_verification=True) as reader:
            # Only the storage columns: a typed shard's parts also carry its typed columns.
            table = reader.read(columns=SCHEMA.names, use_threads=False)
        return table.select(["k", "v", "t", "d"]).cast(SCHEMA)
    except (pa.ArrowMemoryError, MemoryError) as e:
        raise ResourceExhausted(f"out of memory decoding Parquet part {where} "
                                f"({len(data)} bytes): {e}") from None
    except (pa.ArrowException, KeyError, ValueError, OSError) as e:
        raise CorruptPart(f"corrupt Parquet part {where}: {e}") from None


def sums_may_wrap(diff_bounds: Iterable[int]) -> bool:
    """Whether one ``(k, v, t)`` may sum beyond 64 bits across consolidated runs whose
    largest ``|d|`` are ``diff_bounds`` (each run holds it at most once): only then must
    the runs be merged to tell (see :data:`OverflowMode`)."""
    return sum(diff_bounds) > _MAX_DIFF


#: What consolidation does with a ``(k, v, t)`` whose diffs sum beyond 64 bits:
#: ``"raise"`` :class:`DiffOverflow` (reads: the count cannot be returned), or
#: ``"split"`` it into several rows whose diffs add up to the exact sum (compaction:
#: nothing is lost, and a later compensating update still cancels it).
OverflowMode = Literal["raise", "split"]


def consolidate(table: pa.Table, since: int | None = None, as_of: int | None = None,
                overflow: OverflowMode = "raise") -> pa.Table:
    """Sum the diffs of equal ``(k, v, t)``, drop zeros, sort by ``(k, v, t)``.

    Args:
        table: updates with columns k, v, t, d.
        since: if given, times below it are first advanced to it (compaction).
        as_of: if given, updates with ``t > as_of`` are dropped and the rest are
            advanced to ``as_of`` (a snapshot at ``as_of``).
        overflow: see :data:`OverflowMode`.
    """
    table = advance_times(table, since=since, as_of=as_of)
    if table.num_rows == 0:
        return empty_table()
    if table.num_rows > 1:
        table = table.take(pc.sort_indices(table, sort_keys=_SORT_KEYS))
    return consolidate_sorted(table, overflow)


def advance_times(table: pa.Table, since: int | None = None,
                  as_of: int | None = None) -> pa.Table:
    """Times advanced as :func:`consolidate` does (the order by ``(k, v, t)`` is kept:
    both are monotone in ``t``). Vectorized in numpy: a merge calls it for every chunk
    it reads, and Arrow's kernels cost more to call than to run on a chunk."""
    if not table.num_rows or (since is None and as_of is None):
        return table
    times = numpy_values(table.column(2))
    if as_of is not None:
        if int(times.max()) > as_of:
            table = table.filter(pc.less_equal(table.column("t"), as_of))
        elif int(times.min()) == as_of:
            return table  # every time is as_of already (a batch compacted up to it)
        return table.set_column(2, SCHEMA.field("t"),
                                int64_array(np.full(table.num_rows, as_of, np.int64)))
    assert since is not None
    if int(times.min()) >= since:
        return table
    return table.set_column(2, SCHEMA.field("t"), int64_array(np.maximum(times, since)))


def numpy_values(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The values of an int64, uint64 or boolean array without nulls as numpy (zero-copy
    for one chunk of integers), without the pandas import ``to_numpy`` does on first use
    (a third of a second in every fresh process, e.g. a Spark worker)."""
    boolean = pa.types.is_boolean(array.type)
    dtype = bool if boolean else np.uint64 if pa.types.is_uint64(array.type) else np.int64
    if isinstance(array, pa.ChunkedArray):
        if array.num_chunks != 1:
            return np.concatenate([np.zeros(0, dtype), *map(numpy_values, array.chunks)])
        array = array.chunk(0)
    n, offset = len(array), array.offset
    data = array.buffers()[1]
    if data is None or not n:
        return np.zeros(n, dtype)
    if boolean:
        bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
        return bits[offset:offset + n].astype(bool)
    return np.frombuffer(data, dtype, n, offset * 8)


def int64_array(values: np.ndarray) -> pa.Array:
    """An Arrow int64 array of ``values``, zero-copy when they are int64 already (and
    without the pandas import ``pa.array`` does on first use)."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def consolidate_sorted(table: pa.Table, overflow: OverflowMode = "raise") -> pa.Table:
    """Consolidate a table already sorted by ``(k, v, t)``: sum the diffs of adjacent
    equal rows and drop zeros, in one vectorized pass (no hashing, no re-sort). Sums
    never wrap (see :data:`OverflowMode`)."""
    n = table.num_rows
    if n == 0:
        return empty_table()
    table = table.select(["k", "v", "t", "d"]).combine_chunks()
    if n == 1:
        out = table
    else:
        k, v, t = (table.column(c).chunk(0) for c in ("k", "v", "t"))
        changed = pc.or_(pc.or_(pc.not_equal(k[1:], k[:-1]), pc.not_equal(v[1:], v[:-1])),
                         pc.not_equal(t[1:], t[:-1]))
        starts = np.flatnonzero(numpy_values(changed)) + 1
        if len(starts) == n - 1:  # nothing to sum: already consolidated
            out = table
        else:
            starts = np.concatenate([np.zeros(1, np.int64), starts])
            sums, beyond = exact_segment_sums(numpy_values(table.column("d")), starts)
            if beyond and overflow == "raise":
                segment, total = beyond[0]
                row = int(starts[segment])
                key, val, time = (table.column(c)[row].as_py() for c in ("k", "v", "t"))
                raise DiffOverflow(key, val, time, total)
            if beyond:
                starts, sums = split_beyond(starts, sums, beyond)
            out = table.take(pa.array(starts)).set_column(3, "d", pa.array(sums, pa.int64()))
    if pc.any(pc.equal(out.column("d"), 0)).as_py():
        out = out.filter(pc.not_equal(out.column("d"), 0))
    return out.cast(SCHEMA)


def split_beyond(starts: np.ndarray, sums: np.ndarray, beyond: list[tuple[int, int]]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Each segment of ``beyond`` as several rows (its first row repeated) whose diffs
    lie in 64 bits and add up to its exact total; order is kept."""
    pieces: dict[int, list[int]] = {}
    for segment, total in beyond:
        parts = []
        step = _MAX_DIFF if total > 0 else _MIN_DIFF
        while not _MIN_DIFF <= total <= _MAX_DIFF:
            parts.append(step)
            total -= step
        pieces[segment] = [*parts, total] if total else parts
    counts = np.ones(len(starts), np.int64)
    for segment, parts in pieces.items():
        counts[segment] = len(parts)
    out_sums = np.repeat(sums, counts)
    positions = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)[:-1]])
    for segment, parts in pieces.items():
        at = int(positions[segment])
        out_sums[at:at + len(parts)] = parts
    return np.repeat(starts, counts), out_sums


@contextmanager
def naming_shard(shard_id: str) -> Iterator[None]:
    """Re-raise a :class:`DiffOverflow` met inside with the shard it was met in."""
    try:
        yield
    except DiffOverflow as e:
        if e.shard is not None:
            raise
        raise e.in_shard(shard_id) from None


def exact_segment_sums(diffs: np.ndarray, starts: np.ndarray
                       ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The sums of ``diffs`` over the segments beginning at ``starts``, never wrapped.

    numpy's int64 sums wrap silently (guarantee: diffs never wrap). When no segment can
    overflow (the usual ``d = +-1``: the largest ``|d|`` times the longest segment
    fits), the plain sums are exact. Otherwise each diff is split into a high and a low
    32-bit half, whose segment sums cannot overflow; the exact sum fits in 64 bits iff
    its normalized high half does, and then equals the wrapped sum.

    Returns:
        The sums (wrapped where they do not fit), and ``(segment, exact total)`` of each
        segment whose total leaves ``[-2**63, 2**63)``, in order.
    """
    sums = np.add.reduceat(diffs, starts)
    largest = max(-int(diffs.min()), int(diffs.max()))
    longest = int(np.diff(np.append(starts, len(diffs))).max())
    if largest * longest <= _MAX_DIFF:
        return sums, []
    high = np.add.reduceat(diffs >> 32, starts)
    low = np.add.reduceat(diffs & 0xFFFFFFFF, starts)
    high = high + (low >> 32)
    outside = np.flatnonzero((high < -(1 << 31)) | (high >= (1 << 31)))
    beyond = [(int(i), (int(high[i]) << 32) + int(low[i] & 0xFFFFFFFF)) for i in outside]
    return sums, beyond


def split_by_size(table: pa.Table, target_bytes: int) -> list[pa.Table]:
    """Split a table into slices of roughly ``target_bytes`` of Arrow data each."""
    if table.num_rows == 0:
        return []
    per_row = max(1, table.nbytes // max(1, table.num_rows))
    rows = max(1, target_bytes // per_row)
    return [table.slice(i, rows) for i in range(0, table.num_rows, rows)]
