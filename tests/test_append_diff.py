"""An append's record written from its transition's note (``State.note_appended``) is
byte for byte the diff the general path finds by comparing the two states' maps, and
applies to exactly the appended state: over generated states and append arguments
(inline, hollow, empty and no batch; new and known writers; closing appends; Spines
fused as the batch goes or step by step), single appends and chains of them with
merges, readers and rollups between; and a note that no longer describes every change
(a folded rollup, a reader, a schema, another old state) is not used."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist_pipeline.frontier import MAX_TIME
from persist_pipeline.internal import state_codec as sc
from persist_pipeline.internal import transitions
from persist_pipeline.internal.state import (
    Batch,
    Description,
    HollowPart,
    InlinePart,
    LeasedReader,
    Rollup,
    State,
)
from persist_pipeline.internal.trace import MergeRes, merge_requests
from persist_pipeline.proto import persist_pb2 as pb
from tests.helpers import examples
from tests.test_state_codec_entries import SHARD, states


def reference_batch(batch: Batch) -> bytes:
    msg = pb.Batch()
    sc._batch_to(batch, msg)
    return msg.SerializeToString()


def general_diff(old: State, new: State) -> bytes:
    """``encode_diff`` by comparing the maps: ``replace`` carries no notes."""
    plain = replace(new)
    assert plain.appended is None and plain.batch_added is None
    return sc.encode_diff(old, plain)


def check_commit(old: State, new: State, *, direct: bool) -> None:
    """``new``'s record from ``old`` is the general one, applies to ``new``, and was
    written from the append's note when ``direct``; its batch's kept bytes are the
    message-built ones."""
    note = new.appended
    assert (note is not None and sc._note_describes(note, old, new)) == direct
    data = sc.encode_diff(old, new)
    assert data == general_diff(old, new)
    assert sc.apply_diff(old, sc.decode_diff(data, "t"), "t") == new
    for batch in new.batches.values():
        if batch.encoded is not None:
            assert batch.encoded == reference_batch(batch)


def _inline_batch(rng: random.Random, lower: int, upper: int | None, since: int) -> Batch:
    n = rng.choice([1, 2, 10, 127, 128, 1000])
    parts = tuple(InlinePart(rng.choice(["", "p", "é" * 70]) + str(i),
                             rng.randbytes(rng.choice([0, 1, 127, 128, 20_000])), n)
                  for i in range(rng.choice([1, 1, 1, 2])))
    return Batch(f"b{lower}-{rng.random()}", Description(lower, upper, since), parts, n)


def _hollow_batch(rng: random.Random, lower: int, upper: int | None, since: int) -> Batch:
    part = HollowPart(f"k{lower}", rng.choice(["main", "wal"]), 100, 7, lower, lower,
                      rng.choice([None, b"a"]), rng.choice([None, b"z" * 200]),
                      rng.choice([None, 0, (1 << 32) - 1]), rng.choice([None, 5]))
    return Batch(f"h{lower}-{rng.random()}", Description(lower, upper, since), (part,), 7)


def _append(state: State, rng: random.Random, *, closes: bool = False,
            batch_kind: str | None = None) -> tuple[State, transitions.AppendResult]:
    assert state.upper is not None
    lower = state.upper
    upper = None if closes else lower + rng.choice([1, 2, 1 << 30])
    kind = batch_kind or rng.choice(["inline", "inline", "inline", "hollow", "none", "empty"])
    since = state.since if state.since is not None else 0
    batch = None if kind == "none" else (_inline_batch if kind != "hollow" else _hollow_batch)(
        rng, lower, upper, since)
    if kind == "empty":
        assert batch is not None
        batch = replace(batch, num_updates=0)
    writer = rng.choice(["w1", "w2", "wé", "w" * 150])
    return transitions.compare_and_append(
        state, batch, writer_id=writer, token=rng.choice(["t", "", "é" * 20]) + str(lower),
        expected_upper=lower, new_upper=upper,
        now_ms=rng.choice([0, 5, 1_764_403_200_123, (1 << 63) - 1]),
        lease_ms=rng.choice([0, 60_000]), inline_max_bytes=rng.choice([0, 1 << 40]),
        fell_back=rng.random() < 0.2, records_inline_max=rng.random() < 0.8,
        encoded_with=state.schema)


def _bumped(new: State, rng: random.Random) -> State:
    """As the machine's bump leaves it: perhaps a later walltime."""
    return new if rng.random() < 0.5 else new.evolve(walltime_ms=new.walltime_ms + 1)


@settings(max_examples=examples(300), deadline=None)
@given(states(), st.integers(0, 1 << 32), st.integers(0, MAX_TIME - (1 << 31)),
       st.booleans())
def test_an_appends_record_is_the_general_diff(state: State, seed: int, upper: int,
                                               past_the_spine: bool) -> None:
    rng = random.Random(seed)
    # Arbitrary states: Spines in any order, with counts of any size, writers with any
    # fields; the batch lands past the Spine's entries (fused as it goes) or not (fused
    # step by step, when the note names no Spine change and the maps are compared).
    # Spine counts that fusion adds up stay within 64 bits (as they do in any shard).
    small = 1 << 58
    spine = {lo: replace(e, num_batches=e.num_batches % small,
                         num_inline_parts=e.num_inline_parts % small,
                         num_wal_parts=e.num_wal_parts % small)
             for lo, e in state.spine.items() if lo < MAX_TIME - (1 << 31)}
    if past_the_spine and spine:
        upper = max(upper, max(spine) + 1)
    # Counters an append adds to stay within 64 bits (beyond, both paths refuse: below).
    state = replace(state, upper=upper, seqno=state.seqno % (1 << 40), spine=spine,
                    inline_fallbacks=state.inline_fallbacks % (1 << 63),
                    inline_bytes=state.inline_bytes % (1 << 63))
    new, result = _append(state, rng)
    if new is state:
        assert not isinstance(result, transitions.Appended)
        return
    new = _bumped(new, rng)
    note = new.appended
    direct = note is not None
    check_commit(state, new, direct=direct)
    if direct:
        # A rollup folded into the commit, or any other map changed since the note:
        # the general path, with the same bytes as ever.
        # A seqno without a rollup yet (a recorded rollup is never replaced).
        seqno = next(s for s in range(len(new.rollups) + 1) if s not in new.rollups)
        folded = new.evolve(rollups={**new.rollups, seqno: Rollup(seqno, "r", 9)})
        check_commit(state, folded, direct=False)
        readers = new.evolve(leased_readers={"r": LeasedReader("r", 0, 1, 2, 3)})
        check_commit(state, readers, direct=False)
        schema = new.evolve(schema=new.schema + b"x")
        check_commit(state, schema, direct=False)
        # Diffed from another state than the one it was appended to: the note is ignored.
        other = state.evolve(writers=dict(state.writers))
        assert not sc._note_describes(note, other, new)  # type: ignore[arg-type]
        assert sc.encode_diff(other, new) == general_diff(other, new)


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(0, 1 << 32), st.integers(1, 120))
def test_chains_of_appends_with_merges_readers_and_rollups(seed: int, n: int) -> None:
    rng = random.Random(seed)
    state = transitions.create(State(shard_id=SHARD), 1000, 3_600_000,
                               rng.choice([None, 0, 1 << 20])).evolve(seqno=1)
    for i in range(n):
        roll = rng.random()
        if roll < 0.05:
            state, _ = transitions.register_leased_reader(state, f"r{i}", 5, 60_000)
            state = state.evolve(seqno=state.seqno + 1)
            continue
        if roll < 0.1:
            state, _ = transitions.add_rollup(state, Rollup(state.seqno, f"r{i}", 9,
                                                            rng.choice([None, 7])), 5)
            state = state.evolve(seqno=state.seqno + 1)
            continue
        if roll < 0.2 and merge_requests(state):
            req = merge_requests(state)[0]
            part = HollowPart(f"m{i}", "main", 10, req.num_updates, 0, 1)
            out = Batch(f"m{i}", req.desc, (part,), req.num_updates)
            state, _ = transitions.apply_merge(state, MergeRes(req.input_ids, out), 5)
            state = state.evolve(seqno=state.seqno + 1)
            continue
        new, result = _append(state, rng, batch_kind=rng.choice(["inline", "inline", "none"]))
        if new is state:  # the shard's inline budget turned it away
            assert isinstance(result, transitions.InlineBudgetExceeded)
            continue
        new = _bumped(new, rng)
        check_commit(state, new, direct=True)
        state = new


def test_a_closing_append_and_the_first_append_of_a_shard() -> None:
    rng = random.Random(3)
    state = transitions.create(State(shard_id=SHARD), 1000, 3_600_000, None).evolve(seqno=1)
    new, _ = _append(state, rng, batch_kind="inline")
    check_commit(state, new, direct=True)
    closed, _ = _append(new, rng, closes=True, batch_kind="inline")
    assert closed.upper is None
    check_commit(new, closed, direct=True)


def test_a_counter_beyond_64_bits_is_refused_by_both_paths() -> None:
    state = transitions.create(State(shard_id=SHARD), 1000, 3_600_000, None).evolve(
        seqno=1, inline_fallbacks=(1 << 64) - 1)
    new, _ = transitions.compare_and_append(
        state, None, writer_id="w", token="t", expected_upper=0, new_upper=1, now_ms=5,
        lease_ms=5, inline_max_bytes=5, fell_back=True)
    assert new.appended is not None
    with pytest.raises(ValueError):
        sc.encode_diff(state, new)
    with pytest.raises(ValueError):
        general_diff(state, new)
