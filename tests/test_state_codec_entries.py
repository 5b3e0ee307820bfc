"""Rollups assembled from each batch's kept encoding are byte for byte what the
protobuf encoder gives for the whole message, and decode to the same state; diffs that
keep a batch's encoding are unchanged. Checked against a reference encoder (the whole
message built field by field) on random states, and end to end through rollups that a
fresh client and GC read back."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.internal import state_codec as sc
from persist_pipeline.internal import transitions
from persist_pipeline.internal.state import (
    Batch,
    CriticalReader,
    Description,
    HollowPart,
    InlinePart,
    LeasedReader,
    Rollup,
    SpineEntry,
    State,
    Writer,
)
from persist_pipeline.proto import persist_pb2 as pb
from tests.helpers import examples, expected_snapshot, rows

SHARD = "s00000000-0000-4000-8000-000000000000"


def reference_state(state: State) -> bytes:
    """The rollup encoding as one message built field by field (no kept encodings)."""
    msg = pb.State(format_version=1, shard_id=state.shard_id, seqno=state.seqno)
    sc._scalars_to(state, msg.scalars)
    for k in sorted(state.batches):
        sc._batch_to(state.batches[k], msg.batches.add())
    for lo in sorted(state.spine):
        sc._spine_to(state.spine[lo], msg.spine.add())
    for k in sorted(state.leased_readers):
        sc._reader_to(state.leased_readers[k], msg.leased_readers.add())
    for k in sorted(state.critical_readers):
        sc._critical_to(state.critical_readers[k], msg.critical_readers.add())
    for k in sorted(state.writers):
        sc._writer_to(state.writers[k], msg.writers.add())
    for s in sorted(state.rollups):
        sc._rollup_to(state.rollups[s], msg.rollups.add())
    msg.schema = state.schema
    return msg.SerializeToString(deterministic=True)


def reference_diff(old: State, new: State) -> bytes:
    """The diff encoding as one message built field by field (no kept encodings), with
    the codec's own choice of entries (and their order) for each map."""
    msg = pb.StateDiff(format_version=1, shard_id=new.shard_id, seqno=new.seqno)
    sc._scalars_to(new, msg.scalars)
    changes = [("batches", "batch_upserts", "batch_deletes", sc._batch_to,
                sc._batch_diff(old, new)),
               ("spine", "spine_upserts", "spine_deletes", sc._spine_to,
                sc._map_diff(old.spine, new.spine)),
               ("leased_readers", "reader_upserts", "reader_deletes", sc._reader_to,
                sc._map_diff(old.leased_readers, new.leased_readers)),
               ("critical_readers", "critical_upserts", "critical_deletes", sc._critical_to,
                sc._map_diff(old.critical_readers, new.critical_readers)),
               ("writers", "writer_upserts", "writer_deletes", sc._writer_to,
                sc._map_diff(old.writers, new.writers)),
               ("rollups", "rollup_upserts", "rollup_deletes", sc._rollup_to,
                sc._immutable_map_diff(old.rollups, new.rollups))]
    for field, ups, dels, to, (upserted, deleted) in changes:
        if getattr(old, field) is getattr(new, field):
            continue
        for value in upserted:
            to(value, getattr(msg, ups).add())
        getattr(msg, dels).extend(deleted)
    if new.schema != old.schema:
        msg.schema = new.schema
    return msg.SerializeToString()


_sizes = st.sampled_from([0, 1, 5, 127, 128, 129, 300, 16_383, 16_384, 70_000])
_u64 = st.sampled_from([0, 1, 127, 128, 1 << 21, (1 << 63) - 1, (1 << 64) - 1])
_text = st.text(min_size=0, max_size=140)


@st.composite
def parts(draw: st.DrawFn) -> InlinePart | HollowPart:
    if draw(st.booleans()):
        n = draw(_sizes)
        return InlinePart(draw(_text), bytes(random.Random(n).randbytes(n)), draw(_u64))
    maybe_key = st.one_of(st.none(), st.binary(max_size=200))
    return HollowPart(draw(_text), draw(st.sampled_from(["main", "wal"])), draw(_u64),
                      draw(_u64), draw(_u64), draw(_u64), draw(maybe_key), draw(maybe_key))


@st.composite
def batches(draw: st.DrawFn, bid: str) -> Batch:
    upper = draw(st.one_of(st.none(), _u64))
    return Batch(bid, Description(draw(_u64), upper, draw(_u64)),
                 tuple(draw(st.lists(parts(), max_size=4))), draw(_u64))


@st.composite
def states(draw: st.DrawFn) -> State:
    ids = draw(st.lists(st.text(min_size=1, max_size=40), max_size=12, unique=True))
    frontier = st.one_of(st.none(), _u64)
    return State(
        shard_id=SHARD, seqno=draw(st.integers(0, 1 << 62)), walltime_ms=draw(_u64),
        created_ms=draw(_u64),
        upper=draw(frontier), since=draw(frontier), inline_bytes=draw(_u64),
        inline_fallbacks=draw(_u64), orphan_sweep_ms=draw(_u64),
        orphan_min_age_ms=draw(_u64),
        batches={i: draw(batches(i)) for i in ids},
        spine={lo: SpineEntry(lo, draw(frontier), draw(st.integers(0, 63)), draw(_u64),
                              draw(_u64), draw(_u64))
               for lo in draw(st.lists(_u64, max_size=4, unique=True))},
        leased_readers={r: LeasedReader(r, draw(frontier), draw(_u64), draw(_u64), draw(_u64),
                                        draw(_text))
                        for r in draw(st.lists(_text, max_size=3, unique=True))},
        critical_readers={r: CriticalReader(r, draw(frontier), draw(st.binary(max_size=20)),
                                            draw(_text))
                          for r in draw(st.lists(_text, max_size=2, unique=True))},
        writers={w: Writer(w, draw(_u64), draw(_u64), draw(_text), draw(frontier), draw(_text),
                           draw(st.none() | _u64))
                 for w in draw(st.lists(_text, max_size=3, unique=True))},
        rollups={s: Rollup(s, draw(_text), draw(_u64))
                 for s in draw(st.lists(_u64, max_size=3, unique=True))},
        schema=draw(st.binary(max_size=300)),
    )


@settings(max_examples=examples(200), deadline=None)
@given(states())
def test_rollup_is_the_whole_message_encoding(state: State) -> None:
    encoded = sc.encode_state(state)
    assert encoded == reference_state(state)
    assert sc.decode_state(encoded, "t") == state
    # Again with every batch's encoding already kept (the usual case for a rollup).
    assert sc.encode_state(state) == encoded
    fresh = replace(state, batches={k: replace(b) for k, b in state.batches.items()})
    assert all(b.encoded is None for b in fresh.batches.values())
    assert sc.encode_state(fresh) == encoded


@settings(max_examples=examples(200), deadline=None)
@given(states(), states(), st.data())
def test_diff_is_the_whole_message_encoding(old: State, other: State,
                                            data: st.DataObject) -> None:
    # ``new`` keeps some of old's batches (the very objects, as transitions do), drops
    # the others and adds other's: upserts and deletes in one diff.
    kept = {k: b for k, b in old.batches.items() if data.draw(st.booleans())}
    added = {k: b for k, b in other.batches.items() if k not in old.batches}
    # Rollups, like batches, never change once written: a kept seqno keeps its entry.
    rollups = {s: old.rollups.get(s, r) for s, r in other.rollups.items()}
    new = replace(other, shard_id=old.shard_id, seqno=old.seqno + 1, batches={**kept, **added},
                  rollups=rollups)
    encoded = sc.encode_diff(old, new)
    assert encoded == reference_diff(old, new)
    assert sc.apply_diff(old, sc.decode_diff(encoded, "t"), "t") == new


def test_one_kept_encoding_serves_diffs_and_rollups() -> None:
    state = State(shard_id=SHARD, seqno=1)
    for i in range(40):
        n = [1, 10, 200, 5000][i % 4]
        b = Batch(f"b{i}", Description(i, i + 1, 0), (InlinePart(f"p{i}", b"u" * n, n),), n)
        new = replace(state, seqno=state.seqno + 1, upper=i + 1,
                      batches={**state.batches, b.id: b})
        diff = sc.encode_diff(state, new)
        assert b.encoded is not None  # kept by the diff, reused by the rollup
        assert diff == reference_diff(state, new)
        assert sc.encode_state(new) == reference_state(new)
        state = new
    assert sc.decode_state(sc.encode_state(state), "t") == state


def test_a_pickled_batch_leaves_its_kept_encoding_behind() -> None:
    b = Batch("b", Description(0, 1, 0), (InlinePart("p", b"u" * 300, 3),), 3)
    sc.batch_bytes(b)
    assert b.encoded is not None
    copy = pickle.loads(pickle.dumps(b))
    assert copy == b and copy.encoded is None
    assert sc.batch_bytes(copy) == b.encoded


def test_rollups_read_back_by_a_fresh_client_and_gc() -> None:
    consensus, blob = f"mem://codec-{ShardId.new()}", f"mem://codec-{ShardId.new()}"
    cfg = PersistConfig(rollup_threshold=4, background_maintenance=False)
    client = PersistClient.open(consensus, blob, inline_policy=InlinePolicy(), config=cfg)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    written = []
    for t in range(60):
        batch = [(b"k%d" % (t % 9), b"v" * (t * 7), t, 1)]
        writer.compare_and_append(batch, t, t + 1)
        written += batch
    machine = client._machine(shard)
    state = machine.fetch_latest()
    assert state.rollups
    for rollup in state.rollups.values():
        data = machine.blobs.main.get(rollup.key)
        assert data is not None
        assert data == reference_state(sc.decode_state(data, rollup.key))
    client.gc(shard)
    fresh = PersistClient.open(consensus, blob, inline_policy=InlinePolicy(), config=cfg)
    assert fresh._machine(shard).fetch_latest() == client._machine(shard).fetch_latest()
    assert rows(fresh.open_reader(shard).snapshot(59), 59) == expected_snapshot(written, 59)
    writer.expire()
    client.close()
    fresh.close()


#: A state as the version before writers recorded their last write's lower encoded it:
#: writer ``w1``'s last write carried token ``tok-1`` and reached upper 2.
_NO_LOWER_STATE = bytes.fromhex(
    "080112257330303030303030302d303030302d343030302d383030302d30303030303030303030303018"
    "032208120208021a0208004a160a02773110e80718e0d4032205746f6b2d312a020802")


def _append_no_rows(state: State, token: str, expected: int, new: int
                    ) -> tuple[State, transitions.AppendResult]:
    return transitions.compare_and_append(
        state, None, writer_id="w1", token=token, expected_upper=expected, new_upper=new,
        now_ms=2000, lease_ms=60000, inline_max_bytes=1 << 20, fell_back=False)


def test_a_writer_recorded_without_its_last_writes_lower_still_decodes() -> None:
    """States written before the lower was recorded decode, re-encode to the same bytes,
    and answer a write reusing the token as before (the lower is unknown: it cannot be
    told from a retry); the writer's next write records its lower."""
    state = sc.decode_state(_NO_LOWER_STATE, "old")
    writer = state.writers["w1"]
    assert (writer.most_recent_write_token, writer.most_recent_write_upper,
            writer.most_recent_write_lower) == ("tok-1", 2, None)
    assert sc.encode_state(state) == _NO_LOWER_STATE
    assert _append_no_rows(state, "tok-1", 0, 2) == (state, transitions.Appended(True))
    assert _append_no_rows(state, "tok-1", 1, 2) == (state, transitions.Appended(True))
    new, result = _append_no_rows(state, "tok-2", 2, 3)
    assert result == transitions.APPENDED and new.writers["w1"].most_recent_write_lower == 2
    new = replace(new, seqno=state.seqno + 1)
    again = sc.apply_diff(state, sc.decode_diff(sc.encode_diff(state, new), "t"), "t")
    assert again == new and sc.decode_state(sc.encode_state(new), "t") == new
    # Now known, the lower tells the retry from a new write reusing the token.
    assert _append_no_rows(again, "tok-2", 2, 3) == (again, transitions.Appended(True))
    assert _append_no_rows(again, "tok-2", 1, 3) == (
        again, transitions.TokenReusedResult(2, 3))


def _wal_part(key: str) -> HollowPart:
    return HollowPart(key, "wal", 100, 10, 0, 0, None, None)


def test_spine_entries_recorded_before_wal_parts_were_counted_are_counted_on_decode() -> None:
    """A Spine entry holding a WAL part is work for compaction (the WAL store holds
    fresh write parts only). Entries recorded before the entry counted its WAL parts
    get the count from the state's batches, in a rollup and in a diff, so a lone WAL
    batch recorded then is moved to the main store too; entries that have a count keep
    it as recorded."""
    wal = Batch("b1", Description(0, 5, 0), (_wal_part("p1"), _wal_part("p2")), 20)
    main = Batch("b2", Description(5, 6, 0), (HollowPart("p3", "main", 1, 1, 5, 5, None,
                                                        None),), 1)
    state = State(shard_id=SHARD, seqno=3, upper=6, since=0,
                  batches={"b1": wal, "b2": main},
                  spine={0: SpineEntry(0, 5, 4, 1, 0, 2), 5: SpineEntry(5, 6, 0, 1, 0, 0)})
    assert [e.pending for e in state.ordered_spine] == [True, False]

    rollup = pb.State()
    rollup.ParseFromString(sc.encode_state(state))
    for entry in rollup.spine:
        assert entry.HasField("num_wal_parts")  # written even when 0
        entry.ClearField("num_wal_parts")
    decoded = sc.decode_state(rollup.SerializeToString(), "old rollup")
    assert decoded.spine == state.spine
    assert [e.pending for e in decoded.ordered_spine] == [True, False]

    grown = Batch("b3", Description(6, 7, 0), (_wal_part("p4"),), 1)
    new = replace(state, seqno=4, upper=7, batches={**state.batches, "b3": grown},
                  spine={**state.spine, 6: SpineEntry(6, 7, 0, 1, 0, 1)})
    diff = sc.decode_diff(sc.encode_diff(state, new), "t")
    [upsert] = diff.spine_upserts
    upsert.ClearField("num_wal_parts")
    assert sc.apply_diff(state, diff, "old diff") == new
