"""The Spine (after Materialize persist's Spine): batches in size-tiered levels, and merge
requests derived from it.

Each Spine entry is a merge group covering a time range. A new non-empty batch enters as
its own entry at level ``floor(log2(len))``; while the newest entry's level is at least
its predecessor's, the two fuse into one entry a level up (a binary counter, so there
are O(log n) entries). An entry holding several batches, any inline part or a WAL part, is a
pending merge request: compaction replaces its batches with one hollow output batch.
These are pure functions over the state's maps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from persist_pipeline.internal.state import Batch, Description, SpineEntry, State


@dataclass(frozen=True, slots=True)
class MergeReq:
    """A unit of compaction work: consolidate ``inputs`` into one batch of ``desc``."""

    spine_lower: int
    inputs: tuple[Batch, ...]
    desc: Description
    #: The shard's encoded schema when the request was made (typed shards' output parts
    #: carry typed columns); empty for untyped shards.
    schema: bytes = b""

    @property
    def input_ids(self) -> tuple[str, ...]:
        return tuple(b.id for b in self.inputs)

    @property
    def num_updates(self) -> int:
        return sum(b.num_updates for b in self.inputs)

    @property
    def encoded_bytes(self) -> int:
        return sum(b.encoded_size for b in self.inputs)


@dataclass(frozen=True, slots=True)
class MergeRes:
    """The outcome of a :class:`MergeReq`: the batch that replaces ``input_ids``."""

    input_ids: tuple[str, ...]
    output: Batch


ApplyMergeOutcome = Literal["applied", "already_applied", "no_match", "deadline_exceeded"]


def _level_for(num_updates: int) -> int:
    return max(0, num_updates.bit_length() - 1)


def push_batch(
    spine: dict[int, SpineEntry], batch: Batch
) -> tuple[SpineEntry, tuple[int, ...]] | None:
    """Add a new (latest, non-empty) batch to ``spine`` in place, fusing levels.

    The new entry fuses with its predecessor while its level is at least the
    predecessor's, one level up each time; the fused entry is computed as it goes and
    made once, at the key of the oldest entry it absorbed (where each step of the
    fusion would have left it), rather than one entry per step.

    Returns the change: the entry made and the keys removed (those of absorbed entries
    other than the one at the entry's key); None when the batch was fused step by step
    (a batch not past the newest entry), whose change the caller does not learn."""
    desc = batch.desc
    lower = desc.lower
    level = max(0, batch.num_updates.bit_length() - 1)  # _level_for
    num_batches, num_inline, num_wal = 1, batch.num_inline_parts, batch.num_wal_parts
    removed: tuple[int, ...] = ()
    if spine:
        lowers = sorted(spine)
        if lowers[-1] >= lower:
            # Never the case for a new latest batch (its lower is past every entry's):
            # fused step by step, as the newest entry then is.
            _push_stepwise(spine, batch)
            return None
        n = len(lowers)
        while n:
            n -= 1
            prev = spine[lowers[n]]
            if level < prev.level:
                break
            if lower != desc.lower:
                del spine[lower]  # absorbed by an earlier step: its key goes too
                removed += (lower,)
            lower = prev.lower
            level += 1
            num_batches += prev.num_batches
            num_inline += prev.num_inline_parts
            num_wal += prev.num_wal_parts
    entry = spine[lower] = SpineEntry(lower, desc.upper, level, num_batches, num_inline,
                                      num_wal)
    return entry, removed


def _push_stepwise(spine: dict[int, SpineEntry], batch: Batch) -> None:
    """:func:`push_batch` one fusion step at a time (an entry made per step)."""
    desc = batch.desc
    spine[desc.lower] = SpineEntry(desc.lower, desc.upper,
                                   max(0, batch.num_updates.bit_length() - 1),
                                   1, batch.num_inline_parts, batch.num_wal_parts)
    lowers = sorted(spine)
    n = len(lowers) - 1
    last = spine[lowers[n]]
    while n:
        prev = spine[lowers[n - 1]]
        if last.level < prev.level:
            break
        del spine[last.lower]
        n -= 1
        last = SpineEntry(prev.lower, last.upper, last.level + 1,
                          prev.num_batches + last.num_batches,
                          prev.num_inline_parts + last.num_inline_parts,
                          prev.num_wal_parts + last.num_wal_parts)
        spine[prev.lower] = last


def merge_requests(state: State) -> list[MergeReq]:
    """Every pending merge request, oldest first."""
    reqs = []
    since = state.since if state.since is not None else 0
    for entry in state.ordered_spine:
        if not entry.pending:
            continue
        inputs = state.spine_members(entry)
        if not inputs:
            continue
        desc = Description(inputs[0].desc.lower, inputs[-1].desc.upper,
                           max(since, max(b.desc.since for b in inputs)))
        reqs.append(MergeReq(entry.lower, inputs, desc, state.schema))
    return reqs


def apply_merge_res(
    batches: dict[str, Batch], spine: dict[int, SpineEntry], ordered: tuple[Batch, ...],
    res: MergeRes,
) -> ApplyMergeOutcome:
    """Replace the result's inputs with its output, in place, if they are still there.

    Applies when the inputs are a contiguous run of the current batches inside one Spine
    entry (all of an entry's batches, or a contiguous subset of them when later batches
    joined the entry). Otherwise it is a no-op: the inputs were already replaced.
    """
    if res.output.id in batches:
        return "already_applied"
    if not res.input_ids or any(i not in batches for i in res.input_ids):
        return "no_match"
    position = {b.id: n for n, b in enumerate(ordered)}
    first = position[res.input_ids[0]]
    run = ordered[first:first + len(res.input_ids)]
    if tuple(b.id for b in run) != res.input_ids:
        return "no_match"
    entry = next((e for e in spine.values() if e.contains(run[0].desc.lower)), None)
    if entry is None or not entry.contains(run[-1].desc.lower):
        return "no_match"
    out = res.output
    if out.desc.lower != run[0].desc.lower or out.desc.upper != run[-1].desc.upper:
        return "no_match"
    for b in run:
        del batches[b.id]
    batches[out.id] = out
    removed_inline = sum(b.num_inline_parts for b in run)
    removed_wal = sum(b.num_wal_parts for b in run)
    spine[entry.lower] = SpineEntry(
        entry.lower, entry.upper, entry.level,
        entry.num_batches - len(run) + 1,
        entry.num_inline_parts - removed_inline + out.num_inline_parts,
        entry.num_wal_parts - removed_wal + out.num_wal_parts)
    return "applied"
