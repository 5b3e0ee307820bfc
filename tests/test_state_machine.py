"""Pure logic: the Spine, transitions, and the state/diff codecs (no backends)."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist_pipeline.exceptions import CorruptState, InvalidInput
from persist_pipeline.internal import state_codec, transitions
from persist_pipeline.internal.state import Batch, Description, HollowPart, InlinePart, State
from persist_pipeline.internal.trace import MergeRes, merge_requests
from tests.helpers import examples

SHARD = "s00000000-0000-4000-8000-000000000000"


def batch(i: int, lo: int, hi: int, n: int = 1, inline: bool = True) -> Batch:
    part = (InlinePart(f"p{i}", b"x" * 10, n) if inline
            else HollowPart(f"{SHARD}/p/b{i}.parquet", "main", 100, n, lo, hi - 1))
    return Batch(f"b{i}", Description(lo, hi, 0), (part,), n)


def append(state: State, b: Batch | None, lo: int, hi: int, token: str = "",
           max_bytes: int = 1 << 20) -> tuple[State, transitions.AppendResult]:
    return transitions.compare_and_append(
        state, b, writer_id="w1", token=token or f"t{lo}", expected_upper=lo, new_upper=hi,
        now_ms=1, lease_ms=1000, inline_max_bytes=max_bytes, fell_back=False)


def grow(n: int, inline: bool = True, sizes: list[int] | None = None) -> State:
    state = State(shard_id=SHARD, seqno=1)
    for i in range(n):
        state, res = append(state, batch(i, i, i + 1, (sizes or [1] * n)[i], inline), i, i + 1)
        assert isinstance(res, transitions.Appended)
        state = replace(state, seqno=state.seqno + 1)
    return state


def test_spine_stays_logarithmic_and_covers_every_batch():
    state = grow(1000)
    assert len(state.spine) <= 11
    members = [b.id for e in state.ordered_spine for b in state.spine_members(e)]
    assert sorted(members) == sorted(state.batches)
    assert sum(e.num_batches for e in state.spine.values()) == 1000
    levels = [e.level for e in state.ordered_spine]
    assert levels == sorted(levels, reverse=True)


def test_every_inline_batch_is_in_some_merge_request():
    state = grow(37)
    requested = {i for r in merge_requests(state) for i in r.input_ids}
    assert requested == set(state.batches)


def test_transitions_never_mutate_their_input():
    state = grow(20)
    frozen = copy.deepcopy(state)
    append(state, batch(99, 20, 21), 20, 21)
    transitions.register_leased_reader(state, "r1", 5, 100)
    req = merge_requests(state)[0]
    out = Batch("bout", req.desc, (HollowPart("k", "main", 1, 1, 0, 0),), 1)
    transitions.apply_merge(state, MergeRes(req.input_ids, out), 5)
    assert state == frozen


def test_upper_mismatch_and_idempotent_retry():
    state = grow(3)
    same, res = append(state, batch(9, 1, 2), 1, 2)
    assert same is state and res == transitions.UpperMismatchResult(3)
    new, res = append(state, batch(10, 3, 4), 3, 4, token="tok")
    assert isinstance(res, transitions.Appended) and not res.already_committed
    again, res = append(new, batch(10, 3, 4), 3, 4, token="tok")
    assert again is new and res == transitions.Appended(already_committed=True)


def test_inline_budget_is_checked_inside_the_transition():
    state = grow(2)  # 2 x 10 inline bytes
    same, res = append(state, batch(5, 2, 3), 2, 3, max_bytes=25)
    assert same is state and isinstance(res, transitions.InlineBudgetExceeded)
    new, res = append(state, batch(5, 2, 3), 2, 3, max_bytes=30)
    assert isinstance(res, transitions.Appended) and new.inline_bytes == 30


def test_merge_result_applies_exactly_or_as_contiguous_subset_or_not_at_all():
    state = grow(4)  # one spine entry of 4 batches
    (req,) = merge_requests(state)
    out = Batch("o1", Description(0, 2, 0), (HollowPart("o1", "main", 5, 2, 0, 1),), 2)
    # a contiguous subset still present: b0, b1
    new, outcome = transitions.apply_merge(state, MergeRes(("b0", "b1"), out), 5)
    assert outcome == "applied"
    assert set(new.batches) == {"o1", "b2", "b3"} and new.inline_bytes == 20
    # applying again is recognised (a lost CaS reply retried)
    same, outcome = transitions.apply_merge(new, MergeRes(("b0", "b1"), out), 5)
    assert same is new and outcome == "already_applied"
    # a stale result for inputs that were replaced is a no-op
    stale = Batch("o2", req.desc, (HollowPart("o2", "main", 5, 4, 0, 3),), 4)
    same, outcome = transitions.apply_merge(new, MergeRes(req.input_ids, stale), 5)
    assert same is new and outcome == "no_match"
    # non-contiguous inputs never apply
    gap = Batch("o3", Description(0, 3, 0), (), 0)
    same, outcome = transitions.apply_merge(state, MergeRes(("b0", "b2"), gap), 5)
    assert same is state and outcome == "no_match"


def test_compaction_output_may_not_be_inline():
    state = grow(2)
    (req,) = merge_requests(state)
    bad = Batch("o", req.desc, (InlinePart("x", b"", 0),), 0)
    with pytest.raises(InvalidInput, match="never be inlined"):
        transitions.apply_merge(state, MergeRes(req.input_ids, bad), 1)


def test_the_orphan_age_is_the_shards_whatever_each_process_is_configured_with():
    created = transitions.create(State(shard_id=SHARD), 1, 60_000)
    assert created.orphan_min_age_ms == 60_000
    # A GC configured shorter sweeps with the shard's age; one configured longer keeps
    # its own (it only keeps more). Neither changes the shard's.
    for configured, sweeps_with in ((10_000, 60_000), (600_000, 600_000)):
        fenced, age = transitions.fence_orphan_sweep(created, 2, configured)
        assert (age, fenced.orphan_min_age_ms) == (sweeps_with, 60_000)
    # A commit's deadline is half the shard's age, or of the committer's own if shorter.
    for own, half in ((600_000, 30_000), (20_000, 10_000)):
        assert not transitions.CommitDeadline(0, own, half).passed_in(created)
        assert transitions.CommitDeadline(0, own, half + 1).passed_in(created)
    # A shard from before the age was recorded gets the first sweeper's; until then a
    # committer goes by its own.
    legacy = replace(created, orphan_min_age_ms=0)
    assert transitions.CommitDeadline(0, 600_000, 300_000).passed_in(legacy) is False
    fenced, age = transitions.fence_orphan_sweep(legacy, 2, 10_000)
    assert (age, fenced.orphan_min_age_ms) == (10_000, 10_000)
    assert transitions.CommitDeadline(0, 600_000, 5_001).passed_in(fenced)


def test_since_is_the_meet_of_readers_and_never_regresses():
    state = grow(1)
    state, _ = transitions.register_leased_reader(state, "r1", 1, 1000)
    state, _ = transitions.register_leased_reader(state, "r2", 1, 1000)
    state, _ = transitions.downgrade_since(state, "r1", 5, 1, 0)
    assert state.since == 0
    state, _ = transitions.downgrade_since(state, "r2", 3, 1, 0)
    assert state.since == 3
    state, _ = transitions.expire_leased_reader(state, "r2", 1)
    assert state.since == 5
    state, _ = transitions.expire_leased_reader(state, "r1", 1)
    assert state.since == 5  # no readers: since stays
    state, _ = transitions.register_leased_reader(state, "r3", 1, 1000)
    assert state.leased_readers["r3"].since == 5


def test_stale_leases_expire():
    state = grow(1)
    state, _ = transitions.register_leased_reader(state, "r1", 1000, 100)
    state, _ = transitions.register_leased_reader(state, "r2", 1000, 10_000)
    state, gone = transitions.expire_stale_leases(state, 1200)
    assert gone == ["r1", "w1"]  # w1 last wrote at t=1 with a 1000 ms lease
    assert "r1" not in state.leased_readers and "r2" in state.leased_readers


def _roundtrip(old: State, new: State) -> State:
    data = state_codec.encode_diff(old, new)
    return state_codec.apply_diff(old, state_codec.decode_diff(data, "t"), "t")


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "reader", "since", "merge", "expire"]),
                          st.integers(0, 5)), min_size=1, max_size=40))
def test_diffs_and_rollups_reproduce_every_state(ops):
    state = State(shard_id=SHARD, seqno=0)
    state = replace(transitions.create(state, 1, 60_000), seqno=1)
    rebuilt = state_codec.apply_diff(State(shard_id=SHARD),
                                     state_codec.decode_diff(state_codec.encode_diff(
                                         State(shard_id=SHARD), state), "t"), "t")
    rng = random.Random(len(ops))
    n = 0
    for op, arg in ops:
        if op == "append":
            n += 1
            lo = state.upper
            new, _ = append(state, batch(n, lo, lo + 1 + arg, 1 + arg, inline=arg % 2 == 0),
                            lo, lo + 1 + arg, token=f"tok{n}")
        elif op == "reader":
            new, _ = transitions.register_leased_reader(state, f"r{arg}", 1, 100)
        elif op == "since" and state.leased_readers:
            rid = rng.choice(sorted(state.leased_readers))
            cur = state.leased_readers[rid].since or 0
            new, _ = transitions.downgrade_since(state, rid, cur + arg, 1, state.seqno)
        elif op == "merge" and merge_requests(state):
            req = merge_requests(state)[0]
            out = Batch(f"o{n}", req.desc, (HollowPart(f"o{n}", "main", 1, 1, 0, 0),), 1)
            n += 1
            new, _ = transitions.apply_merge(state, MergeRes(req.input_ids, out), 1)
        elif op == "expire" and state.leased_readers:
            new, _ = transitions.expire_leased_reader(state, sorted(state.leased_readers)[0], 1)
        else:
            continue
        if new is state:
            continue
        new = replace(new, seqno=state.seqno + 1)
        rebuilt = _roundtrip(rebuilt, new)
        assert rebuilt == new
        assert state_codec.decode_state(state_codec.encode_state(new), "t") == new
        state = new


def test_corrupt_records_raise_corrupt_state_naming_where():
    with pytest.raises(CorruptState, match="seqno 7"):
        state_codec.decode_diff(b"\xff\xff\xff garbage", "shard x seqno 7")
    with pytest.raises(CorruptState, match="rollup k"):
        state_codec.decode_state(b"\x0a\xff", "rollup k")
    good = state_codec.encode_diff(State(shard_id=SHARD), replace(State(shard_id=SHARD), seqno=1))
    with pytest.raises(CorruptState, match="cannot follow"):
        state_codec.apply_diff(replace(State(shard_id=SHARD), seqno=5),
                               state_codec.decode_diff(good, "x"), "x")
