"""The streaming k-way merge of sorted runs, in bounded memory.

Every batch is a sorted run (its parts are sorted by ``(k, v, t)``, in key order), and
advancing times to a since, or to a snapshot's ``as_of``, keeps that order. So a merge
never needs all of its inputs at once: each run is read a chunk at a time, and each
*round* takes, from every run, the rows that sort below the smallest last row any
unfinished run has buffered. Nothing at or above that bound can be missing from the
round, so the round is merged, consolidated (vectorized) and emitted, and rounds come
out in order. Memory is the runs' buffers plus one round.

A round is merged without sorting again what is already sorted: each row gets an
8-byte integer, the bytes of its key after the prefix every key of the round shares,
and a stable sort of those integers (numpy's timsort, which finds the runs and merges
them) orders the round. The comparisons of neighbours that consolidation needs anyway
then check the order on the whole ``(k, v, t)``; only rows whose integers tie and are
out of order are sorted on the whole key. The output is checked to rise strictly from
round to round, so a run that is not sorted is reported as corrupt
(:class:`CorruptPart`), never merged wrongly.

:func:`memory_plan` turns ``compaction_memory_bound_bytes`` into a chunk size, a read
buffer size and a fan-in (how many runs one pass merges); a merge of more runs than
that is done in passes (see :mod:`persist_pipeline.compaction`).
"""

from __future__ import annotations

import bisect
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.exceptions import CorruptPart, DiffOverflow
from persist_pipeline.internal.sync import new_worker
from persist_pipeline.updates import (
    SCHEMA,
    OverflowMode,
    empty_table,
    exact_segment_sums,
    int64_array,
    numpy_values,
    split_beyond,
)

#: The least bytes of updates a run buffers at a time (smaller chunks cost more rounds).
MIN_CHUNK_BYTES = 128 << 10
#: The smallest and largest read buffer of a run (per column of a large part; smaller
#: parts are fetched whole): more runs get smaller buffers, so more, smaller reads.
MIN_READ_BYTES = 64 << 10
MAX_READ_BYTES = 4 << 20
#: Bytes a run costs beyond its chunks and read buffers: the Parquet pages of ``k`` and
#: ``v`` being decoded (compressed and decompressed) and the reader's state.
RUN_OVERHEAD_BYTES = 512 << 10
#: Read buffers a run holds (``k`` and ``v`` of a large part; a small part, fetched
#: whole, compressed and decoded, counts as several).
_READ_BUFFERS = 4
#: Merged rounds' outputs a compaction holds beyond the round being merged: the one its
#: writer thread is encoding as Parquet (each round waits for the one before).
ROUNDS_IN_FLIGHT = 1
#: A round's working set is about this many times the rows it takes (the concatenation,
#: the merged copy and the consolidated output), on top of the runs' buffers.
_ROUND_COPIES = 3


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """How a merge stays within its memory bound.

    Attributes:
        chunk_bytes: bytes of updates each run buffers at a time.
        read_bytes: each run's read buffer (a part up to this size is fetched whole).
        fan_in: the most runs merged in one pass.
        part_bytes: the target size of one output part (it is buffered until written).
    """

    chunk_bytes: int
    read_bytes: int
    fan_in: int
    part_bytes: int


#: Chunks of updates a run costs: two buffered (what a round leaves, refilled on the
#: merge's reader thread while the round is merged), its share of the round being merged
#: and of the output in flight.
_CHUNKS_PER_RUN = 2 + _ROUND_COPIES + ROUNDS_IN_FLIGHT


def _per_run(chunk_bytes: int, read_bytes: int) -> int:
    return RUN_OVERHEAD_BYTES + _READ_BUFFERS * read_bytes + _CHUNKS_PER_RUN * chunk_bytes


def memory_plan(bound_bytes: int, num_runs: int, target_part_bytes: int) -> MemoryPlan:
    """Split ``bound_bytes`` between output buffering, the runs' buffers and one round.

    A quarter (at most ``target_part_bytes``) buffers the output part being written; the
    rest is shared by the runs merged at once, each costing :data:`RUN_OVERHEAD_BYTES`,
    its read buffers and :data:`_CHUNKS_PER_RUN` chunks. The fan-in is how many runs fit
    at the smallest chunk and read buffer; fewer runs get larger ones.
    """
    part_bytes = max(64 << 10, min(target_part_bytes, bound_bytes // 4))
    for_runs = max(0, bound_bytes - part_bytes)
    fan_in = max(2, for_runs // _per_run(MIN_CHUNK_BYTES, MIN_READ_BYTES))
    runs = max(1, min(num_runs, fan_in))
    budget = max(0, for_runs // runs - RUN_OVERHEAD_BYTES)
    read = min(MAX_READ_BYTES, max(MIN_READ_BYTES, budget // 16))
    chunk = (budget - _READ_BUFFERS * read) // _CHUNKS_PER_RUN
    return MemoryPlan(max(MIN_CHUNK_BYTES, chunk), read, int(fan_in), int(part_bytes))


Row = tuple[bytes, bytes, int]


class _Chunk:
    """One buffered table of a run, with its columns for row access."""

    __slots__ = ("k", "nbytes", "rows", "t", "table", "v")

    def __init__(self, table: pa.Table, nbytes: int | None = None) -> None:
        if table.column(0).num_chunks != 1:
            table = table.combine_chunks()
        self.table = table
        self.rows = table.num_rows
        # A fresh table owns its buffers: their total is its size, and cheap to ask for
        # (Table.nbytes costs microseconds, a chunk at a time).
        self.nbytes = table.get_total_buffer_size() if nbytes is None else nbytes
        self.k, self.v, self.t = (table.column(i).chunk(0) for i in range(3))

    def row(self, i: int) -> Row:
        return self.k[i].as_py(), self.v[i].as_py(), self.t[i].as_py()

    def count_below(self, bound: Row) -> int:
        """How many rows sort strictly below ``bound`` (binary searches: on the key,
        then, among rows of the bound's key, on the whole row)."""
        key = self.k
        lo = bisect.bisect_left(range(self.rows), bound[0], key=lambda i: key[i].as_py())
        if lo == self.rows or key[lo].as_py() != bound[0]:
            return lo
        return bisect.bisect_left(range(lo, self.rows), bound, key=self.row) + lo


class _Cursor:
    """One run's buffered, not yet merged rows (sorted tables) and the rest of the run."""

    __slots__ = ("_chunks", "buffered", "done", "nbytes", "rows", "taken_last", "where")

    def __init__(self, chunks: Iterator[pa.Table], where: str) -> None:
        self._chunks = chunks
        self.where = where
        self.buffered: list[_Chunk] = []
        self.rows = 0
        self.nbytes = 0
        self.done = False
        self.taken_last: Row | None = None

    def fill(self, min_bytes: int) -> None:
        """Read chunks until ``min_bytes`` of updates are buffered or the run is over."""
        while not self.done and self.nbytes < min_bytes:
            table = next(self._chunks, None)
            if table is None:
                self.done = True
            elif table.num_rows:
                chunk = _Chunk(table)
                self.buffered.append(chunk)
                self.rows += chunk.rows
                self.nbytes += chunk.nbytes

    def last(self) -> Row:
        chunk = self.buffered[-1]
        return chunk.row(chunk.rows - 1)

    def count_below(self, bound: Row) -> int:
        """How many buffered rows sort strictly below ``bound``."""
        n = 0
        for chunk in self.buffered:
            if chunk.row(chunk.rows - 1) >= bound:
                return n + chunk.count_below(bound)
            n += chunk.rows
        return n

    def take(self, n: int) -> list[pa.Table]:
        """The first ``n`` buffered rows (as tables), no longer buffered.

        Raises:
            CorruptPart: they sort below rows this run gave before (the run is not
                sorted).
        """
        first = self.buffered[0].row(0)
        if self.taken_last is not None and first < self.taken_last:
            raise _not_sorted(self.where)
        out: list[pa.Table] = []
        while n:
            chunk = self.buffered[0]
            if chunk.rows <= n:
                out.append(chunk.table)
                self.buffered.pop(0)
                n -= chunk.rows
                self.rows -= chunk.rows
                self.nbytes -= chunk.nbytes
                self.taken_last = chunk.row(chunk.rows - 1)
            else:
                out.append(chunk.table.slice(0, n))
                self.taken_last = chunk.row(n - 1)
                # Counted in proportion: Table.nbytes of a slice costs microseconds.
                rest = _Chunk(chunk.table.slice(n), chunk.nbytes * (chunk.rows - n) // chunk.rows)
                self.buffered[0] = rest
                self.rows -= n
                self.nbytes += rest.nbytes - chunk.nbytes
                n = 0
        return out


def _not_sorted(where: str) -> CorruptPart:
    return CorruptPart(f"{where} is not sorted by (k, v, t)")


def merge_runs(runs: Iterable[tuple[Iterator[pa.Table], str]], chunk_bytes: int,
               overflow: OverflowMode = "raise") -> Generator[pa.Table, None, None]:
    """Merge sorted runs into consolidated, sorted tables, in order.

    The runs' next chunks are read and decoded on a worker thread while this one merges
    a round (they are what the round leaves buffered, refilled, so within the memory
    plan): a merge overlaps its reads with its work, one hand-off per round. The reader
    is idle whenever this generator is suspended: a caller that stops iterating, forks
    or exits never leaves a read running on another thread.

    Args:
        runs: ``(chunks, description)`` per run: the run's rows as tables in
            ``(k, v, t)`` order (times already advanced), and what to name in errors.
        chunk_bytes: bytes of updates a run buffers at a time.
        overflow: what to do with a sum beyond 64 bits (reads raise, merges split).

    Raises:
        CorruptPart: a run is not sorted (found when its rows would come out of order).
    """
    cursors = [_Cursor(chunks, where) for chunks, where in runs]
    low = max(1, chunk_bytes // 2)
    emitted: Row | None = None
    with new_worker(1, "persist-merge-reader") as reader:
        # The cursors are the reader's between a submit and the wait that follows it.
        reader.submit(partial(_fill, cursors, low))
        while True:
            reader.wait()  # the first fill, and the refill of a round that took nothing
            cursors = [c for c in cursors if c.rows or not c.done]
            if not cursors:
                return
            open_runs = [c for c in cursors if not c.done]
            bound = min(c.last() for c in open_runs) if open_runs else None
            taken: list[tuple[_Cursor, list[pa.Table]]] = []
            for c in cursors:
                n = c.rows if bound is None else c.count_below(bound)
                if n:
                    taken.append((c, c.take(n)))
            if not taken:
                # A run's whole buffer equals the bound (one (k, v, t) repeated past its
                # chunk, e.g. many times advanced to one since): read more of it.
                for c in open_runs:
                    if c.last() == bound:
                        c.fill(c.nbytes + chunk_bytes)
                reader.submit(partial(_fill, cursors, low))
                continue
            reader.submit(partial(_fill, cursors, low))
            out = _merge_round(taken, overflow)
            reader.wait()  # done before the yield (an error here leaves through the with)
            if out.num_rows:
                first = _row(out, 0)
                if emitted is not None and first <= emitted:
                    raise CorruptPart("rows came out of order merging "
                                      f"{', '.join(c.where for c, _ in taken)}: one of "
                                      "them is not sorted by (k, v, t)")
                emitted = _row(out, out.num_rows - 1)
                yield out


def _fill(cursors: list[_Cursor], min_bytes: int) -> None:
    for c in cursors:
        c.fill(min_bytes)


def _row(table: pa.Table, i: int) -> Row:
    return table.column(0)[i].as_py(), table.column(1)[i].as_py(), table.column(2)[i].as_py()


# --- one round: merge sorted pieces, consolidate ------------------------------------------

_SORT_KEYS = [("k", "ascending"), ("v", "ascending"), ("t", "ascending")]


def _merge_round(taken: list[tuple[_Cursor, list[pa.Table]]],
                 overflow: OverflowMode = "raise") -> pa.Table:
    """Merge the sorted pieces the runs gave to one round and consolidate them (sums
    never wrap: see :data:`~persist_pipeline.updates.OverflowMode`).

    Raises:
        CorruptPart: the round holds one run's rows, and they are not sorted.
        DiffOverflow: a sum leaves 64 bits and ``overflow`` is ``"raise"``.
    """
    tables = [t for _, pieces in taken for t in pieces]
    if len(taken) == 1 and len(tables) > 1:
        as_they_are = _consolidated_pieces(tables)
        if as_they_are is not None:
            return as_they_are
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables).combine_chunks()
    n = table.num_rows
    k, v, t, d = (table.column(i).chunk(0) for i in range(4))
    order: np.ndarray | None = None
    prefixes: np.ndarray | None = None
    if len(taken) > 1:
        lowest = min(pieces[0].column(0)[0].as_py() for _, pieces in taken)
        highest = max(pieces[-1].column(0)[-1].as_py() for _, pieces in taken)
        prefixes = _key_prefixes(k, _common_prefix(lowest, highest))
        order = np.argsort(prefixes, kind="stable")
    for attempt in range(3):
        if order is None:
            ks, vs, ts = k, v, t
        else:
            index = int64_array(order)
            ks, vs, ts = k.take(index), v.take(index), t.take(index)
        same, disorder = neighbours(ks, vs, ts)
        if not len(disorder):
            break
        if order is None:
            raise _not_sorted(taken[0][0].where)
        assert prefixes is not None
        fixed = _sort_ties(table, order, prefixes, disorder) if attempt == 0 else None
        order = fixed if fixed is not None else numpy_values(pc.sort_indices(
            table.select(["k", "v", "t"]), sort_keys=_SORT_KEYS)).astype(np.int64)
    diffs = numpy_values(d)
    if order is not None:
        diffs = diffs[order]
    starts = np.flatnonzero(~same) + 1
    if len(starts) == n - 1:  # no equal neighbours: nothing to sum
        keep = np.flatnonzero(diffs)
        sums = diffs[keep]
    else:
        starts = np.concatenate([np.zeros(1, np.int64), starts])
        sums, beyond = exact_segment_sums(diffs, starts)
        if beyond and overflow == "raise":
            segment, total = beyond[0]
            row = int(starts[segment])
            raise DiffOverflow(ks[row].as_py(), vs[row].as_py(), ts[row].as_py(), total)
        if beyond:
            starts, sums = split_beyond(starts, sums, beyond)
        nonzero = np.flatnonzero(sums)
        keep, sums = starts[nonzero], sums[nonzero]
    if not len(keep):
        return empty_table()
    if len(keep) < n:
        index = int64_array(keep)
        ks, vs, ts = ks.take(index), vs.take(index), ts.take(index)
    return pa.Table.from_arrays([ks, vs, ts, int64_array(sums)], schema=SCHEMA)


def _consolidated_pieces(pieces: list[pa.Table]) -> pa.Table | None:
    """One run's pieces of a round as one table of them as they are (not copied into
    one chunk) when there is nothing to merge or consolidate: every row sorts strictly
    above the one before it, within a piece and across two, and no diff is zero (a
    compacted batch, read as of a time its rows are at). None otherwise: the round is
    merged as any other (which then finds the disorder, or sums the equal rows)."""
    before: Row | None = None
    for piece in pieces:
        if not piece.num_rows:
            continue
        k, v, t, d = (piece.column(i).combine_chunks() if piece.column(i).num_chunks != 1
                      else piece.column(i).chunk(0) for i in range(4))
        same, disorder = neighbours(k, v, t)
        if len(disorder) or same.any() or not numpy_values(d).all():
            return None
        if before is not None and _row(piece, 0) <= before:
            return None
        before = _row(piece, piece.num_rows - 1)
    return pa.concat_tables(pieces)


def neighbours(k: pa.Array, v: pa.Array, t: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """For each row but the last: whether the next row equals it on ``(k, v, t)``; and
    the positions where the next row sorts below it (empty when the rows are sorted)."""
    if len(k) < 2:
        return np.zeros(0, bool), np.zeros(0, np.int64)
    k0, k1, v0, v1, t0, t1 = k[:-1], k[1:], v[:-1], v[1:], t[:-1], t[1:]
    k_eq, v_eq, t_eq = pc.equal(k0, k1), pc.equal(v0, v1), pc.equal(t0, t1)
    below = pc.or_(pc.greater(k0, k1), pc.and_(k_eq, pc.or_(
        pc.greater(v0, v1), pc.and_(v_eq, pc.greater(t0, t1)))))
    disorder = np.zeros(0, np.int64)
    if pc.any(below).as_py():
        disorder = np.flatnonzero(numpy_values(below))
    same = numpy_values(pc.and_(pc.and_(k_eq, v_eq), t_eq))
    return same, disorder


def _sort_ties(table: pa.Table, order: np.ndarray, prefixes: np.ndarray,
               disorder: np.ndarray) -> np.ndarray | None:
    """``order`` with every group of rows whose prefixes tie and that holds a row out
    of order sorted on ``(k, v, t)``; None when rows with different prefixes are out of
    order (a run is not sorted: only a full sort orders the round)."""
    ordered = prefixes[order]
    if np.any(ordered[disorder] != ordered[disorder + 1]):
        return None
    group = np.concatenate([np.zeros(1, np.int64), np.cumsum(ordered[1:] != ordered[:-1])])
    bad = np.zeros(int(group[-1]) + 1, bool)
    bad[group[disorder]] = True
    rows = np.flatnonzero(bad[group])
    index = order[rows]
    sub = table.select(["k", "v", "t"]).take(int64_array(index))
    sub = sub.append_column("g", int64_array(group[rows]))
    within = numpy_values(pc.sort_indices(sub, sort_keys=[("g", "ascending"), *_SORT_KEYS]))
    fixed = order.copy()
    fixed[rows] = index[within]
    return fixed


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _key_prefixes(k: pa.Array, skip: int) -> np.ndarray:
    """The 8 bytes of every key after its first ``skip``, as big-endian integers (zero
    past the key's end): their order is the keys' order when every key starts with the
    same ``skip`` bytes, and ties only where keys agree on those 8 bytes."""
    n = len(k)
    offsets = np.frombuffer(k.buffers()[1], np.int32, n + 1, k.offset * 4).astype(np.int64)
    buffer = k.buffers()[2]
    data = np.frombuffer(buffer, np.uint8) if buffer is not None else np.zeros(0, np.uint8)
    width = int(offsets[1] - offsets[0]) if n else 0
    if n and width >= skip + 8 and offsets[-1] - offsets[0] == n * width and \
            np.all(np.diff(offsets) == width):
        # Keys of one width (ids, hashes, UUIDs): the 8 bytes are a column of a matrix.
        matrix = data[offsets[0]:offsets[-1]].reshape(n, width)
        fixed: np.ndarray = np.ascontiguousarray(matrix[:, skip:skip + 8]).view(">u8")
        return fixed.ravel().astype(np.uint64)
    padded = np.concatenate([data[:offsets[-1]], np.zeros(8, np.uint8)])
    starts = offsets[:-1] + skip
    lengths = np.clip(offsets[1:] - starts, 0, 8)
    # Every position of ``padded`` read as the big-endian integer of the 8 bytes there.
    words = np.ndarray((len(padded) - 7,), dtype=">u8", buffer=padded, strides=(1,))
    values = words[np.minimum(starts, len(padded) - 8)].astype(np.uint64)
    keep = np.left_shift(np.uint64(0xFFFFFFFFFFFFFFFF),
                         ((8 - lengths) * 8).astype(np.uint64))
    result: np.ndarray = np.where(lengths > 0, values & keep, np.uint64(0))
    return result
