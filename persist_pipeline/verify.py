"""Verify a shard's data: is everything its latest state references still stored intact?

A check reads and changes nothing. It takes the shard's latest state, then:

- lists the shard's prefix in each blob store once, and finds every Parquet part and
  state rollup the state references there, at the size recorded when it was written;
- decodes every inline part the state holds (they live in consensus, at no blob cost);
- ``deep``: also fetches every Parquet part and rollup, checks its bytes against the
  CRC-32 recorded when it was written (parts and rollups written before CRCs were
  recorded have none), decodes it with the codec every read uses, and checks its
  contents against what the state records of it (update count, time bounds, key
  bounds) and the order every part is written in: sorted by ``(k, v, t)`` and
  consolidated (no two rows on one ``(k, v, t)``, no zero diff).

Compaction and GC may run while a check does: a part merged away and collected between
the state read and the listing is gone for good reason. So a blob found missing, of the
wrong size or unreadable is reported only if the shard's state, read again *after* it
was found so, still references it; otherwise it is counted as ``replaced``. The blob
stores are read without the part cache, which could hide a lost blob.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.exceptions import ChecksumMismatch, CorruptData, PartMissing
from persist_pipeline.internal import paths
from persist_pipeline.internal.machine import Machine
from persist_pipeline.internal.merge import neighbours
from persist_pipeline.internal.state import (
    Batch,
    HollowPart,
    InlinePart,
    Rollup,
    State,
    Store,
)

__all__ = ["IntegrityProblem", "VerifyReport", "verify_shard"]

#: The counts one diff holds.
_SIGNED_64_BIT = range(-(1 << 63), 1 << 63)

ProblemKind = Literal["missing", "size", "checksum", "unreadable", "contents", "state"]


@dataclass(frozen=True)
class IntegrityProblem:
    """One thing the shard's state references that is not stored as recorded.

    Attributes:
        kind: ``missing`` (no such blob), ``size`` (a blob of another size than
            recorded), ``checksum`` (its bytes' CRC-32 is not the one recorded when it
            was written: they changed since), ``unreadable`` (it does not decode),
            ``contents`` (it decodes,
            but not to what the state records of it, or not in the order parts are
            written in) or ``state`` (the shard's state itself cannot be rebuilt from
            its consensus records and rollup: nothing else could be checked).
        store: ``main``, ``wal`` or ``consensus`` (an inline part, or the state).
        key: the blob's key, the inline part's id, or the shard's id.
        batch: the id of the batch holding the part ("" for a rollup).
        detail: what was found.
    """

    kind: ProblemKind
    store: str
    key: str
    batch: str
    detail: str


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_shard` checked and found.

    Attributes:
        shard_id: the shard.
        seqno: the state version checked.
        deep: whether part contents were fetched and decoded.
        parts: Parquet parts checked.
        inline_parts: inline parts decoded.
        rollups: state rollups checked.
        bytes_checked: the recorded size of the Parquet parts and rollups checked.
        replaced: blobs found missing or damaged that a newer state no longer
            references (compaction replaced them and GC collected them meanwhile): not
            problems.
        problems: what is not stored as the state records it; empty when all is well.
        duration_s: how long the check took.
    """

    shard_id: str
    seqno: int
    deep: bool
    parts: int = 0
    inline_parts: int = 0
    rollups: int = 0
    bytes_checked: int = 0
    replaced: int = 0
    problems: tuple[IntegrityProblem, ...] = field(default=())
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether nothing the state references was found lost or damaged."""
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``ok`` included)."""
        return {**asdict(self), "ok": self.ok,
                "problems": [asdict(p) for p in self.problems]}


def verify_shard(machine: Machine, *, deep: bool = False) -> VerifyReport:
    """Check the shard's latest state against its stores (see the module doc).

    Raises:
        InvalidConfig: the state references parts in the WAL blob store and this
            client was opened without it (nothing was checked).
        BlobError / ConsensusError: a store could not be read (retried first); no
            problem is reported on a guess.
    """
    started = time.monotonic()
    try:
        state = machine.fetch_latest()
    except CorruptData as e:
        # The state's rollup lost or a record damaged: the one finding there can be, a
        # report (so that a check of every shard goes on to the next), not an error.
        problem = IntegrityProblem("state", "consensus", machine.shard_id, "",
                                   f"{type(e).__name__}: {e}")
        return VerifyReport(machine.shard_id, 0, deep, problems=(problem,),
                            duration_s=time.monotonic() - started)
    return _verify_state(machine, state, deep=deep)


@dataclass
class _Found:
    """A problem found, before a newer state says whether it still matters."""

    problem: IntegrityProblem
    ref: tuple[Store, str] | None  # None: an inline part (in the state, never collected)


def _verify_state(machine: Machine, state: State, *, deep: bool) -> VerifyReport:
    started = time.monotonic()
    found: list[_Found] = []
    hollow = [(b, p) for b in state.batches.values() for p in b.parts
              if isinstance(p, HollowPart)]
    stores: set[Store] = {p.store for _, p in hollow}
    stores.add("main")
    listed = {store: {m.key: m.size for m in machine.blobs.store(store).list_keys(
        paths.shard_prefix(machine.shard_id))} for store in sorted(stores)}
    for batch, part in hollow:
        problem = _check_blob(machine, listed[part.store], part.store, part.key,
                              part.encoded_size, batch.id)
        if problem is None and deep:
            problem = _check_contents(machine, batch, part)
        if problem is not None:
            found.append(_Found(problem, (part.store, part.key)))
    inline = 0
    for batch in state.batches.values():
        for p in batch.parts:
            if isinstance(p, InlinePart):
                inline += 1
                problem = _check_contents(machine, batch, p)
                if problem is not None:
                    found.append(_Found(problem, None))
    for rollup in state.rollups.values():
        problem = _check_blob(machine, listed["main"], "main", rollup.key,
                              rollup.encoded_size, "")
        if problem is None and deep:
            problem = _check_rollup(machine, state, rollup)
        if problem is not None:
            found.append(_Found(problem, ("main", rollup.key)))
    problems, replaced = _still_referenced(machine, found)
    return VerifyReport(
        shard_id=machine.shard_id, seqno=state.seqno, deep=deep, parts=len(hollow),
        inline_parts=inline, rollups=len(state.rollups),
        bytes_checked=sum(p.encoded_size for _, p in hollow)
        + sum(r.encoded_size for r in state.rollups.values()),
        replaced=replaced, problems=tuple(problems),
        duration_s=time.monotonic() - started)


def _still_referenced(machine: Machine, found: list[_Found]
                      ) -> tuple[list[IntegrityProblem], int]:
    """The problems among ``found`` that the shard's state, read now, still references,
    and how many it no longer does (replaced and collected while the check ran)."""
    if all(f.ref is None for f in found):
        return [f.problem for f in found], 0
    # Read after every blob was found missing or damaged: a blob that a state this new
    # still references is one that no GC may ever have deleted.
    now = machine.fetch_latest().referenced_blobs()
    problems = [f.problem for f in found if f.ref is None or f.ref in now]
    return problems, len(found) - len(problems)


def _check_blob(machine: Machine, listed: dict[str, int], store: Store, key: str,
                size: int, batch: str) -> IntegrityProblem | None:
    found = listed.get(key)
    if found is None:
        # Listed once, before: a blob written after the listing is checked directly.
        data = machine.blobs.store(store).get(key)
        if data is None:
            return IntegrityProblem("missing", store, key, batch,
                                    f"not in the {store} blob store")
        found = len(data)
    if found != size:
        return IntegrityProblem("size", store, key, batch,
                                f"{found} bytes stored, {size} recorded")
    return None


def _check_contents(machine: Machine, batch: Batch, part: HollowPart | InlinePart
                    ) -> IntegrityProblem | None:
    """Fetch and decode ``part`` as every read does (bypassing the part cache) and check
    what it holds; inline parts hold a write's updates consolidated, as Parquet parts do."""
    store, key = (part.store, part.key) if isinstance(part, HollowPart) else \
        ("consensus", part.part_id)
    try:
        table = machine.blobs.fetch_part(part, f"batch {batch.id}", cached=False)
    except PartMissing:
        return IntegrityProblem("missing", store, key, batch.id,
                                f"not in the {store} blob store")
    except ChecksumMismatch as e:
        return IntegrityProblem("checksum", store, key, batch.id, str(e))
    except CorruptData as e:
        return IntegrityProblem("unreadable", store, key, batch.id, str(e))
    wrong = _contents_problem(table, part.num_updates,
                              part if isinstance(part, HollowPart) else None)
    if wrong is None:
        return None
    return IntegrityProblem("contents", store, key, batch.id, wrong)


def _contents_problem(table: pa.Table, num_updates: int, part: HollowPart | None
                      ) -> str | None:
    """What in ``table`` contradicts the part's record, or the order parts are written
    in; None when nothing does."""
    if table.num_rows != num_updates:
        return f"{table.num_rows} updates stored, {num_updates} recorded"
    if not table.num_rows:
        return None
    k, v, t, d = (table.column(name).combine_chunks() for name in ("k", "v", "t", "d"))
    same, disorder = neighbours(k, v, t)
    if len(disorder):
        return f"rows out of (k, v, t) order at row {int(disorder[0]) + 1}"
    if same.any() and not _sums_beyond_64_bits(same, d):
        return "two rows on one (k, v, t) whose diffs fit one: not consolidated"
    if pc.any(pc.equal(d, 0)).as_py():
        return "an update with diff 0: not consolidated"
    if part is None:
        return None
    low, high = pc.min_max(t).values()
    if low.as_py() < part.min_time or high.as_py() > part.max_time:
        return (f"times {low.as_py()}..{high.as_py()} stored, {part.min_time}.."
                f"{part.max_time} recorded")
    first, last = k[0].as_py(), k[len(k) - 1].as_py()
    if part.min_key is not None and first < part.min_key:
        return "a key below the part's recorded key bounds"
    if part.max_key is not None and last > part.max_key:
        return "a key above the part's recorded key bounds"
    return None


def _sums_beyond_64_bits(same: np.ndarray, d: pa.Array) -> bool:
    """Whether every run of rows on one ``(k, v, t)`` (``same[i]``: row ``i + 1`` is on
    row ``i``'s) sums beyond 64 bits: the one way a merge writes a count it cannot hold
    in one row (see *Diff counts* in docs/design.md). Runs are rare: summed exactly."""
    diffs = d.to_pylist()
    start = 0
    for i in range(len(diffs)):
        if i < len(same) and same[i]:
            continue  # row i + 1 continues this run
        if i > start and sum(diffs[start:i + 1]) in _SIGNED_64_BIT:
            return False
        start = i + 1
    return True


def _check_rollup(machine: Machine, state: State, rollup: Rollup
                  ) -> IntegrityProblem | None:
    seqno, key = rollup.seqno, rollup.key
    try:
        rolled = machine.blobs.fetch_rollup(key, rollup.crc32, f"rollup {key}")
    except ChecksumMismatch as e:
        return IntegrityProblem("checksum", "main", key, "", str(e))
    except CorruptData as e:
        return IntegrityProblem("unreadable", "main", key, "", str(e))
    if rolled is None:
        return IntegrityProblem("missing", "main", key, "", "not in the main blob store")
    if rolled.seqno != seqno or rolled.shard_id != state.shard_id:
        return IntegrityProblem("contents", "main", key, "",
                                f"a state of shard {rolled.shard_id} at seqno "
                                f"{rolled.seqno}, recorded as seqno {seqno} of this shard")
    return None

