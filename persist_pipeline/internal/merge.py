"""The streaming k-way merge of sorted runs, in bounded memory.

Every batch is a sorted run (its parts are sorted by ``(k, v, t)``, in key order), and
advancing times to a since, or to a snapshot's ``as_of``, keeps that order. So a merge
never needs all of its inputs at once: each run is read a chunk at a time, and each
*round* takes, from every run, the rows that sort below the smallest last row any
unfinished run has buffered. Nothing at or above that bound can be missing from the
round, so the round is sorted and consolidated (vectorized, in Arrow) and emitted, and
rounds come out in order. Memory is the runs' buffers plus one round.

:func:`memory_plan` turns ``compaction_memory_bound_bytes`` into a chunk size and a
fan-in (how many runs one pass merges); a merge of more runs than that is done in
passes (see :mod:`persist_pipeline.compaction`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.exceptions import CorruptPart
from persist_pipeline.updates import (
    OverflowMode,
    consolidate,
    consolidate_sorted,
    empty_table,
)

#: The least bytes of updates a run reads at a time (smaller chunks cost more rounds).
MIN_CHUNK_BYTES = 256 << 10
#: Bytes a run costs beyond its chunks: one Parquet row group, compressed and decoded.
RUN_OVERHEAD_BYTES = 8 << 20
#: A round's working set is about this many times the rows it takes (the concatenation,
#: the sort's permutation and the consolidated copy), on top of the runs' buffers.
_ROUND_COPIES = 3


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """How a merge stays within its memory bound.

    Attributes:
        chunk_bytes: bytes of updates each run reads at a time.
        fan_in: the most runs merged in one pass.
        part_bytes: the target size of one output part (it is buffered until written).
    """

    chunk_bytes: int
    fan_in: int
    part_bytes: int


def memory_plan(bound_bytes: int, num_runs: int, target_part_bytes: int) -> MemoryPlan:
    """Split ``bound_bytes`` between output buffering, the runs' chunks and one round.

    A quarter (at most ``target_part_bytes``) buffers the output part being written;
    each run costs :data:`RUN_OVERHEAD_BYTES` plus 1.5 chunks of buffer and a round's
    share (:data:`_ROUND_COPIES` copies of what it takes).
    """
    part_bytes = max(64 << 10, min(target_part_bytes, bound_bytes // 4))
    for_runs = max(0, bound_bytes - part_bytes)
    per_run_min = RUN_OVERHEAD_BYTES + MIN_CHUNK_BYTES * (2 + _ROUND_COPIES)
    fan_in = max(2, for_runs // per_run_min)
    runs = max(1, min(num_runs, fan_in))
    chunk = (for_runs // runs - RUN_OVERHEAD_BYTES) // (2 + _ROUND_COPIES)
    return MemoryPlan(max(MIN_CHUNK_BYTES, chunk), int(fan_in), int(part_bytes))


class _Cursor:
    """One run's buffered, not yet merged rows (a sorted table) and the rest of the run."""

    __slots__ = ("_chunks", "_k", "_t", "_v", "buf", "done")

    def __init__(self, chunks: Iterator[pa.Table]) -> None:
        self._chunks = chunks
        self.buf = empty_table()
        self.done = False
        self._set(empty_table())

    def _set(self, table: pa.Table) -> None:
        self.buf = table.combine_chunks() if table.column("k").num_chunks > 1 else table
        cols = [self.buf.column(c) for c in ("k", "v", "t")]
        self._k, self._v, self._t = (c.chunk(0) if c.num_chunks else c for c in cols)

    def fill(self, min_bytes: int) -> None:
        """Read chunks until ``min_bytes`` of updates are buffered or the run is over."""
        if self.done or self.buf.nbytes >= min_bytes:
            return
        tables = [self.buf] if self.buf.num_rows else []
        have = self.buf.nbytes
        while have < min_bytes:
            chunk = next(self._chunks, None)
            if chunk is None:
                self.done = True
                break
            if chunk.num_rows:
                tables.append(chunk)
                have += chunk.nbytes
        self._set(pa.concat_tables(tables) if tables else empty_table())

    def row(self, i: int) -> tuple[bytes, bytes, int]:
        return self._k[i].as_py(), self._v[i].as_py(), self._t[i].as_py()

    def last(self) -> tuple[bytes, bytes, int]:
        return self.row(self.buf.num_rows - 1)

    def count_below(self, bound: tuple[bytes, bytes, int]) -> int:
        """How many buffered rows sort strictly below ``bound`` (a binary search)."""
        return bisect.bisect_left(range(self.buf.num_rows), bound, key=self.row)

    def take(self, n: int) -> pa.Table:
        head = self.buf.slice(0, n)
        self._set(self.buf.slice(n))
        return head




def merge_runs(runs: Iterable[tuple[Iterator[pa.Table], str]], chunk_bytes: int,
               check_order: bool = True, overflow: OverflowMode = "raise"
               ) -> Iterator[pa.Table]:
    """Merge sorted runs into consolidated, sorted tables, in order.

    Args:
        runs: ``(chunks, description)`` per run: the run's rows as tables in
            ``(k, v, t)`` order (times already advanced), and what to name in errors.
        chunk_bytes: bytes of updates a run buffers at a time.
        check_order: verify each run really is sorted (a corrupt or foreign part that is
            not would otherwise be merged wrongly, silently).
        overflow: what to do with a sum beyond 64 bits (reads raise, merges split).

    Raises:
        CorruptPart: a run is not sorted.
    """
    cursors = [_Cursor(_checked(chunks, where) if check_order else chunks)
               for chunks, where in runs]
    low = max(1, chunk_bytes // 2)
    while True:
        for c in cursors:
            c.fill(low)
        cursors = [c for c in cursors if c.buf.num_rows or not c.done]
        if not cursors:
            return
        open_runs = [c for c in cursors if not c.done]
        bound = min(c.last() for c in open_runs) if open_runs else None
        pieces = []
        for c in cursors:
            n = c.buf.num_rows if bound is None else c.count_below(bound)
            if n:
                pieces.append(c.take(n))
        if not pieces:
            # A run's whole buffer equals the bound (one (k, v, t) repeated past its
            # chunk, e.g. many times advanced to one since): read more of it.
            for c in open_runs:
                if c.last() == bound:
                    c.fill(c.buf.nbytes + chunk_bytes)
            continue
        out = consolidate_sorted(pieces[0], overflow) if len(pieces) == 1 else \
            consolidate(pa.concat_tables(pieces), overflow=overflow)
        if out.num_rows:
            yield out


def _checked(chunks: Iterator[pa.Table], where: str) -> Iterator[pa.Table]:
    """Pass ``chunks`` through, raising :class:`CorruptPart` where they are not in
    ``(k, v, t)`` order (within a chunk or across chunks)."""
    previous: tuple[bytes, bytes, int] | None = None
    for chunk in chunks:
        if not chunk.num_rows:
            continue
        k, v, t = (chunk.column(c) for c in ("k", "v", "t"))
        first = (k[0].as_py(), v[0].as_py(), t[0].as_py())
        if previous is not None and first < previous:
            raise CorruptPart(f"{where} is not sorted by (k, v, t)")
        if chunk.num_rows > 1 and not _is_sorted(k, v, t):
            raise CorruptPart(f"{where} is not sorted by (k, v, t)")
        previous = (k[-1].as_py(), v[-1].as_py(), t[-1].as_py())
        yield chunk


def _is_sorted(k: pa.ChunkedArray, v: pa.ChunkedArray, t: pa.ChunkedArray) -> bool:
    k0, k1 = k[:-1], k[1:]
    k_lt = pc.less(k0, k1)
    k_eq = pc.equal(k0, k1)
    v0, v1 = v[:-1], v[1:]
    v_lt = pc.less(v0, v1)
    v_eq = pc.equal(v0, v1)
    t_le = pc.less_equal(t[:-1], t[1:])
    ok = pc.or_(k_lt, pc.and_(k_eq, pc.or_(v_lt, pc.and_(v_eq, t_le))))
    return bool(pc.all(ok).as_py())


#: The fewest rows decoded from a part at a time.
MIN_BATCH_ROWS = 1024


def batch_rows(chunk_bytes: int, encoded_size: int, num_updates: int) -> int:
    """Rows to decode at a time from a part so a batch stays near ``chunk_bytes`` even
    if the part compressed its updates fourfold (at least :data:`MIN_BATCH_ROWS`)."""
    per_row = 4 * encoded_size / max(1, num_updates)
    return max(MIN_BATCH_ROWS, int(chunk_bytes / max(1.0, per_row)))
