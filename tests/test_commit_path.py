"""The append's commit path made cheaper without changing what it commits: state
evolution, the diff codec's notes, fast record constructors, argument checks, tokens,
the funnel's group of one and the SQL statement plumbing. Each shortcut is checked
against the general path it stands in for."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import pickle
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from persist_pipeline import InlinePolicy, PersistClient, ShardId
from persist_pipeline.consensus import CasWrite, SqlConsensus, VersionedData
from persist_pipeline.consensus._checks import check_cas, check_shard
from persist_pipeline.consensus._sql_statements import Rendered
from persist_pipeline.exceptions import InvalidInput, InvalidUpdates, UpperMismatch
from persist_pipeline.ids import new_token, seeded_ids
from persist_pipeline.internal import state_codec, transitions
from persist_pipeline.internal.records import TWIN_MIN_FIELDS, quick_init
from persist_pipeline.internal.state import (
    Batch,
    Description,
    InlinePart,
    SpineEntry,
    State,
    Writer,
)
from persist_pipeline.internal.trace import _level_for, _push_stepwise, push_batch
from persist_pipeline.updates import Updates
from persist_pipeline.write import Staged, WriteResult

SHARD = "s00000000-0000-4000-8000-000000000000"


def _batch(lower: int, n: int, inline: bool = True) -> Batch:
    part = InlinePart(f"p{lower}", b"x" * n, n)
    return Batch(f"b{lower}", Description(lower, lower + 1, 0), (part,) if inline else (), n)


def _append(state: State, lower: int, n: int, writer: str = "w1") -> State:
    new, result = transitions.compare_and_append(
        state, _batch(lower, n), writer_id=writer, token=f"t{lower}", expected_upper=lower,
        new_upper=lower + 1, now_ms=1000 + lower, lease_ms=60_000,
        inline_max_bytes=1 << 30, fell_back=False)
    assert result == transitions.Appended()
    return new.evolve(seqno=state.seqno + 1)


def _roundtrip(old: State, new: State) -> State:
    data = state_codec.encode_diff(old, new)
    return state_codec.apply_diff(old, state_codec.decode_diff(data, "test"), "test")


def _without_notes(state: State) -> State:
    """The same state built by dataclasses.replace (which carries no notes)."""
    return dataclasses.replace(state)


# --- State.evolve --------------------------------------------------------------------------


def test_evolve_equals_replace_and_forgets_cached_properties() -> None:
    state = State(shard_id=SHARD, seqno=1)
    for i in range(3):
        state = _append(state, i, 3)
    assert len(state.ordered_batches) == 3  # cached now
    batches = {k: v for k, v in state.batches.items() if k != "b0"}
    evolved = state.evolve(batches=batches, upper=7)
    assert evolved == dataclasses.replace(state, batches=batches, upper=7)
    assert [b.id for b in evolved.ordered_batches] == ["b1", "b2"]
    assert evolved.spine is state.spine and evolved.writers is state.writers
    with pytest.raises(TypeError, match="uper"):
        state.evolve(uper=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolved.upper = 3  # type: ignore[misc]


# --- the diff codec's note of an appended batch --------------------------------------------


def test_appends_encode_the_same_diff_with_and_without_the_note() -> None:
    rng = random.Random(7)
    state = State(shard_id=SHARD, seqno=1)
    for i in range(300):
        new = _append(state, i, rng.choice([1, 2, 3, 10, 100, 1000]))
        assert new.batch_added is not None and new.batch_added[0] is state.batches
        noted = state_codec.decode_diff(state_codec.encode_diff(state, new), "noted")
        plain = state_codec.decode_diff(state_codec.encode_diff(state, _without_notes(new)),
                                        "plain")
        assert noted == plain
        assert [b.id for b in noted.batch_upserts] == [f"b{i}"]
        assert _roundtrip(state, new) == new
        state = new


def test_a_note_is_used_only_while_it_names_both_maps() -> None:
    state = _append(State(shard_id=SHARD, seqno=1), 0, 3)
    new = _append(state, 1, 3)
    # A later state made from the noted one with other batches carries the note along,
    # but it no longer describes its batches: the diff compares the maps instead.
    merged = {"m": Batch("m", Description(0, 2, 0), (), 6)}
    other = new.evolve(batches=merged, seqno=new.seqno)
    diff = state_codec.decode_diff(state_codec.encode_diff(state, other), "other")
    assert [b.id for b in diff.batch_upserts] == ["m"]
    assert sorted(diff.batch_deletes) == ["b0"]
    # Diffed from an unrelated state, the note is ignored too.
    unrelated = State(shard_id=SHARD, seqno=new.seqno - 1, batches={"b9": _batch(9, 1)})
    diff = state_codec.decode_diff(state_codec.encode_diff(unrelated, new), "unrelated")
    assert sorted(b.id for b in diff.batch_upserts) == ["b0", "b1"]
    assert list(diff.batch_deletes) == ["b9"]


def _push_batch_reference(spine: dict[int, SpineEntry], batch: Batch) -> None:
    """The Spine's binary counter as first written (sorting at every step)."""
    spine[batch.desc.lower] = SpineEntry(batch.desc.lower, batch.desc.upper,
                                         _level_for(batch.num_updates), 1,
                                         batch.num_inline_parts)
    while len(spine) >= 2:
        lowers = sorted(spine)[-2:]
        prev, last = spine[lowers[0]], spine[lowers[1]]
        if last.level < prev.level:
            break
        del spine[last.lower]
        spine[prev.lower] = SpineEntry(prev.lower, last.upper, max(prev.level, last.level) + 1,
                                       prev.num_batches + last.num_batches,
                                       prev.num_inline_parts + last.num_inline_parts)


def test_push_batch_fuses_as_the_reference() -> None:
    rng = random.Random(3)
    ours: dict[int, SpineEntry] = {}
    reference: dict[int, SpineEntry] = {}
    for i in range(2000):
        batch = _batch(i, rng.choice([1, 5, 10, 64, 1000, 70_000]), inline=rng.random() < 0.5)
        push_batch(ours, batch)
        _push_batch_reference(reference, batch)
        assert ours == reference


def test_push_batch_makes_the_entries_of_stepwise_fusion_in_the_same_order() -> None:
    # One entry made per push (not per fusion step): the same entries, at the same keys
    # and in the same dict order, as fusing step by step; a batch that is not past the
    # newest entry (never an append's) goes the stepwise way itself.
    rng = random.Random(7)
    ours: dict[int, SpineEntry] = {}
    stepwise: dict[int, SpineEntry] = {}
    lower = 0
    for _ in range(3000):
        if rng.random() < 0.02 and ours:
            at = rng.choice(sorted(ours))  # a lower not past the newest entry
        else:
            lower += rng.randint(1, 3)
            at = lower
        batch = _batch(at, rng.choice([1, 5, 10, 64, 1000, 70_000]),
                       inline=rng.random() < 0.5)
        push_batch(ours, batch)
        _push_stepwise(stepwise, batch)
        assert list(ours.items()) == list(stepwise.items())


def test_summary_counts_the_spine() -> None:
    state = State(shard_id=SHARD, seqno=1)
    for i in range(37):
        state = _append(state, i, 1 + i % 5)
    summary = state_codec.decode_summary(state_codec.encode_summary(state), "test")
    assert summary.num_inline_parts == state.num_inline_parts()
    assert summary.pending_merges == state.pending_merges()
    assert summary.num_batches == 37 and summary.upper.time == 37
    # An entry whose only work is a part in the WAL store is pending too.
    lone = {0: SpineEntry(0, 10, 9, 1, 0, 1), 10: SpineEntry(10, 11, 0, 1, 0, 0)}
    state = dataclasses.replace(state, spine=lone)
    summary = state_codec.decode_summary(state_codec.encode_summary(state), "test")
    assert summary.pending_merges == state.pending_merges() == 1


# --- quick_init ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Description, InlinePart, Batch, SpineEntry, Writer,
                                 Staged, WriteResult, VersionedData, CasWrite])
def test_quick_init_keeps_signature_defaults_and_immutability(cls: type[Any]) -> None:
    # Fields outside __init__ (a batch's kept encoding) start at their default, as the
    # generated __init__ sets them.
    fields = [f for f in dataclasses.fields(cls) if f.init]
    hidden = [f for f in dataclasses.fields(cls) if not f.init]
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        assert p.default == (inspect.Parameter.empty if f.default is dataclasses.MISSING
                             else f.default)
    values = {f.name: object() for f in fields}
    made = cls(**values)
    assert all(getattr(made, name) is value for name, value in values.items())
    assert all(getattr(made, f.name) is f.default for f in hidden)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, fields[0].name, 1)
    with pytest.raises(TypeError):
        cls()


@pytest.mark.parametrize("cls", [Description, InlinePart, Batch, SpineEntry, Writer,
                                 Staged, WriteResult, VersionedData, CasWrite])
def test_quick_init_instances_copy_pickle_and_replace_as_dataclasses(cls: type[Any]) -> None:
    # Classes of many fields are built through a slotted twin (a __new__, no __init__):
    # copies, pickles and replace() still rebuild them whole, equal to the original.
    fields = [f for f in dataclasses.fields(cls) if f.init]
    made = cls(**{f.name: (f.name, n) for n, f in enumerate(fields)})
    assert type(made) is cls
    built_through_twin = len(dataclasses.fields(cls)) >= TWIN_MIN_FIELDS
    assert ("__new__" in vars(cls)) == built_through_twin
    for again in (copy.copy(made), copy.deepcopy(made), pickle.loads(pickle.dumps(made)),
                  dataclasses.replace(made)):
        assert type(again) is cls and again == made and hash(again) == hash(made)
    changed = dataclasses.replace(made, **{fields[-1].name: "changed"})
    assert getattr(changed, fields[-1].name) == "changed"
    assert all(getattr(changed, f.name) == getattr(made, f.name) for f in fields[:-1])


def test_quick_init_twin_sets_hidden_fields_to_their_defaults() -> None:
    @quick_init
    @dataclasses.dataclass(frozen=True, slots=True)
    class Wide:
        a: int
        b: int
        c: int = 3
        d: int = 4
        e: int = 5
        hidden: bytes | None = dataclasses.field(default=None, init=False, compare=False)

    made = Wide(1, 2, e=9)
    assert "__new__" in vars(Wide)
    assert (made.a, made.b, made.c, made.d, made.e, made.hidden) == (1, 2, 3, 4, 9, None)
    assert copy.deepcopy(made) == made and copy.deepcopy(made).hidden is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.hidden = b""  # type: ignore[misc]
    with pytest.raises(TypeError):
        Wide(1, 2, 3, 4, 5, 6)  # type: ignore[call-arg]


def test_quick_init_refuses_what_it_cannot_keep() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class HiddenWithoutDefault:
        a: int = dataclasses.field(init=False)

    for cls in (NoSlots, NotFrozen, Factory, HiddenWithoutDefault):
        with pytest.raises(TypeError):
            quick_init(cls)


# --- tokens, argument checks, statements ---------------------------------------------------


def test_new_token_is_a_uuid4_hex_and_seeded_tokens_repeat() -> None:
    tokens = {new_token() for _ in range(1000)}
    assert len(tokens) == 1000
    for token in tokens:
        parsed = uuid.UUID(hex=token)
        assert parsed.hex == token and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    with seeded_ids(random.Random(5)):
        first = [new_token() for _ in range(3)]
    with seeded_ids(random.Random(5)):
        assert [new_token() for _ in range(3)] == first


def test_a_forked_child_never_repeats_its_parents_tokens() -> None:
    # Tokens are drawn from the OS in bulk: a child forked while its parent still holds
    # undrawn ones must not hand out the same (two writes would share a batch id).
    new_token()  # the parent now holds draws it has not handed out
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next tokens, to the parent
        try:
            os.write(write, "".join(new_token() for _ in range(50)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read().decode()
    os.waitpid(pid, 0)
    child = {data[i:i + 32] for i in range(0, len(data), 32)}
    parent = {new_token() for _ in range(50)}
    assert len(child) == 50 and not child & parent


class _Record(VersionedData):
    __slots__ = ()


@pytest.mark.parametrize("expected, new, ok", [
    (1, VersionedData(2, b"d", b"s"), True),
    (None, VersionedData(1, b"d"), True),
    (1, _Record(2, b"d", b"s"), True),
    (True, VersionedData(2, b"d"), False),
    (1, VersionedData(2.0, b"d"), False),  # type: ignore[arg-type]
    (1, VersionedData(3, b"d"), False),
    (0, VersionedData(1, b"d"), False),
    (2**63 - 1, VersionedData(2**63, b"d"), False),
    (1, VersionedData(2, "d"), False),  # type: ignore[arg-type]
    (1, VersionedData(2, b"d", bytearray(b"s")), False),  # type: ignore[arg-type]
    (1, (2, b"d", b""), False),
])
def test_check_cas_refuses_exactly_what_it_refused(expected: Any, new: Any, ok: bool) -> None:
    if ok:
        check_cas(expected, new)
    else:
        with pytest.raises(InvalidInput):
            check_cas(expected, new)


@pytest.mark.parametrize("shard, ok", [("s", True), ("", False), ("a\x00b", False),
                                        (b"s", False), (1, False)])
def test_check_shard(shard: Any, ok: bool) -> None:
    if ok:
        assert check_shard(shard) == shard
    else:
        with pytest.raises(InvalidInput):
            check_shard(shard)


def test_rendered_args_take_defaults_when_a_name_is_missing() -> None:
    rendered = Rendered("q", ("a", "b", "c"), {"a": None, "b": None, "c": 0})
    assert rendered.args({"a": 1, "b": 2, "c": 3}) == (1, 2, 3)
    assert rendered.args({"a": 1, "b": 2}) == (1, 2, 0)
    assert Rendered("q", ("a",), {"a": 9}).args({}) == (9,)
    assert Rendered("q", ("a",), {"a": 9}).args({"a": 1}) == (1,)
    assert Rendered("q", (), {}).args({"x": 1}) == ()


def test_small_lists_of_updates_are_checked_and_consolidated_as_other_iterables() -> None:
    rows = [(b"b", b"", 3, 1), (b"a", b"v", 3, 2), (b"a", b"v", 3, -2), (b"c", b"", 4, 1)]
    assert Updates.coerce(rows).table() == Updates.coerce(iter(rows)).table()
    assert Updates.coerce(rows).table().column("k").to_pylist() == [b"b", b"c"]
    for bad in ([("k", b"", 1, 1)], [(b"k", b"", -1, 1)], [(b"k", b"", 1)],
                [(b"k", b"", True, 1)]):
        with pytest.raises(InvalidUpdates) as from_list:
            Updates.coerce(bad)
        with pytest.raises(InvalidUpdates) as from_iter:
            Updates.coerce(iter(bad))
        assert str(from_list.value) == str(from_iter.value)


# --- the funnel's group of one -------------------------------------------------------------


@pytest.fixture
def client() -> Iterator[PersistClient]:
    c = PersistClient.open("mem://", "mem://", inline_policy=InlinePolicy())
    yield c
    c.close()


def test_a_lone_append_is_a_group_of_one(client: PersistClient) -> None:
    writer = client.open_writer(ShardId.new())
    before = (client.metrics.group_commits, client.metrics.group_commit_appends)
    result = writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    assert result.placement == "inline" and result.upper == 1
    assert (client.metrics.group_commits, client.metrics.group_commit_appends) == (
        before[0] + 1, before[1] + 1)
    # A refused lone append raises its own confirmed answer, as in a group.
    with pytest.raises(UpperMismatch) as info:
        writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    assert info.value.current == 1
    assert writer.compare_and_append([(b"k", b"v", 1, 1)], 1, 2).seqno == result.seqno + 1


# --- PostgreSQL: the cursor kept for statements that return no rows ------------------------


@pytest.mark.postgres
def test_kept_cursor_survives_a_lost_multi_shard_race(pg_url: str) -> None:
    store = SqlConsensus(pg_url)
    try:
        for shard in ("a", "b"):
            assert store.compare_and_set(shard, None, VersionedData(1, b"1"))
        assert store.compare_and_set("a", 1, VersionedData(2, b"2"))
        # b's head is 1 but a's is 2: the multi-shard insert hits a's seqno 2 and fails.
        lost = [CasWrite("a", 1, VersionedData(2, b"x")), CasWrite("b", 1, VersionedData(2, b"x"))]
        assert store.compare_and_set_many(lost) is False
        for seqno in range(2, 6):
            assert store.compare_and_set("b", seqno - 1, VersionedData(seqno, b"%d" % seqno))
        assert [r.seqno for r in store.scan("b", 0)] == [1, 2, 3, 4, 5]
        assert store.compare_and_set("b", 3, VersionedData(4, b"stale")) is False
    finally:
        store.close()


# --- the machine's bump of an append's state -----------------------------------------------


class _FixedClock:
    def __init__(self, now: int) -> None:
        self.now = now

    def now_ms(self) -> int:
        return self.now

    def monotonic(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        raise AssertionError("no sleep expected")


@pytest.mark.parametrize("now", [999, 1000, 1001])
def test_bump_of_an_append_equals_the_general_bump(now: int) -> None:
    from persist_pipeline.internal.machine import Machine

    base = State(shard_id=SHARD, seqno=4)
    new, result = transitions.compare_and_append(
        base, _batch(0, 3), writer_id="w", token="t", expected_upper=0, new_upper=1,
        now_ms=1000, lease_ms=60_000, inline_max_bytes=1 << 30, fell_back=False)
    assert result == transitions.Appended() and new.seqno == 5
    machine = Machine.__new__(Machine)
    machine.clock = _FixedClock(now)  # type: ignore[assignment]
    bumped = machine._bump(new, base)
    general = dataclasses.replace(new, seqno=base.seqno + 1,
                                  walltime_ms=max(new.walltime_ms, now))
    assert bumped == general
    # Committed as it is when nothing is left to change (no second copy).
    assert (bumped is new) == (now <= 1000)
