"""The inline bound is the shard's, not each process's: a shard records its
``persist_inline_update_max_bytes`` when it is created, ``set_inline_max_bytes`` changes
it, and every process inlines only up to the smaller of its own max and the recorded
one, so processes configured differently never push a shard past the bound the others
(and the checks and sensors) go by. Shards recorded before the field existed decode as
"not recorded" and get a record at their first append."""

from __future__ import annotations

from dataclasses import replace

import pytest

from persist_pipeline import InlinePolicy, InvalidInput, PersistClient, ShardId
from persist_pipeline.consensus.base import VersionedData
from persist_pipeline.internal import state_codec as sc
from persist_pipeline.internal import transitions
from persist_pipeline.internal.state import State
from persist_pipeline.proto import persist_pb2 as pb
from tests.fixtures.location import Location
from tests.helpers import expected_snapshot, rows, state_history

SMALL = InlinePolicy(threshold_bytes=4096, max_bytes=2500)
BIG = InlinePolicy(threshold_bytes=4096, max_bytes=1 << 20)


def _write(client: PersistClient, shard: str, count: int, prefix: str = "k",
           size: int = 200) -> list[tuple[bytes, bytes, int, int]]:
    """``count`` appends of one update each at the shard's upper; returns them."""
    writer = client.open_writer(shard)
    upper = writer.fetch_recent_upper()
    assert isinstance(upper, int)
    written = []
    for i in range(count):
        update = (f"{prefix}-{i}".encode(), b"x" * size, upper, 1)
        writer.compare_and_append([update], upper, upper + 1)
        written.append(update)
        upper += 1
    writer.expire()
    return written


def _max_inline(client: PersistClient, shard: str) -> int:
    return max(s.inline_bytes for s in state_history(client, shard))


def _check_all_there(client: PersistClient, shard: str, written: list[tuple]) -> None:
    upper = client.inspect(shard)["upper"]
    assert rows(client.open_reader(shard).snapshot(upper - 1), upper - 1) == \
        expected_snapshot(written, upper - 1)


def test_bigger_process_stays_within_the_bound_the_creator_recorded(
        durable_location: Location) -> None:
    small, big = durable_location.client(SMALL), durable_location.client(BIG)
    shard = str(ShardId.new())
    small.open_writer(shard).expire()  # created by the process with the smaller max
    written = _write(big, shard, 40, "big") + _write(small, shard, 10, "small")
    assert _max_inline(big, shard) <= SMALL.max_bytes
    seen = big.inspect(shard)
    assert seen["inline_max_bytes_recorded"] == SMALL.max_bytes
    assert seen["inline_max_bytes_effective"] == SMALL.max_bytes
    assert seen["inline_max_bytes"] == SMALL.max_bytes
    assert seen["inline_fallbacks"] > 0
    assert big.shard_summaries()[shard].inline_max_bytes == SMALL.max_bytes
    _check_all_there(big, shard, written)
    small.close()
    big.close()


def test_smaller_process_keeps_its_own_max_on_a_bigger_shard(
        durable_location: Location) -> None:
    small, big = durable_location.client(SMALL), durable_location.client(BIG)
    shard = str(ShardId.new())
    big.open_writer(shard).expire()
    written = _write(small, shard, 30, "small")
    assert _max_inline(small, shard) <= SMALL.max_bytes
    seen = small.inspect(shard)
    assert seen["inline_max_bytes_recorded"] == BIG.max_bytes
    assert seen["inline_max_bytes_effective"] == SMALL.max_bytes
    # What the checks judge the shard by is its recorded bound.
    assert seen["inline_max_bytes"] == BIG.max_bytes
    _check_all_there(small, shard, written)
    small.close()
    big.close()


def test_set_inline_max_bytes_lowers_and_raises(durable_location: Location) -> None:
    client = durable_location.client(BIG)
    shard = str(ShardId.new())
    written = _write(client, shard, 10, "before")  # about 2.2 KB inline
    before = client.inspect(shard)
    assert before["inline_bytes"] > 1000
    assert client.set_inline_max_bytes(shard, 1000) == BIG.max_bytes
    assert client.inspect(shard)["inline_max_bytes_recorded"] == 1000
    # Below the current inline bytes: nothing is lost, later writes go to blob.
    written += _write(client, shard, 5, "lowered")
    after = client.inspect(shard)
    assert after["inline_bytes"] == before["inline_bytes"]
    assert after["inline_fallbacks"] == 5
    _check_all_there(client, shard, written)
    # Compaction flushes what is inline; then writes inline again up to the new bound.
    assert client.compact(shard)["inline_bytes_after"] == 0
    written += _write(client, shard, 10, "compacted")
    assert 0 < client.inspect(shard)["inline_bytes"] <= 1000
    # Raised again: writes inline beyond the lowered bound.
    assert client.set_inline_max_bytes(shard, 1 << 16) == 1000
    written += _write(client, shard, 10, "raised")
    assert client.inspect(shard)["inline_bytes"] > 1000
    _check_all_there(client, shard, written)
    client.close()


def test_a_raise_beyond_a_process_config_does_not_raise_its_writes(
        durable_location: Location) -> None:
    small = durable_location.client(SMALL)
    shard = str(ShardId.new())
    small.open_writer(shard).expire()
    small.set_inline_max_bytes(shard, 1 << 20)
    _write(small, shard, 30)
    assert _max_inline(small, shard) <= SMALL.max_bytes
    small.close()


def test_zero_turns_inlining_off_for_the_shard(durable_location: Location) -> None:
    client = durable_location.client(BIG)
    shard = str(ShardId.new())
    client.open_writer(shard).expire()
    client.set_inline_max_bytes(shard, 0)
    written = _write(client, shard, 3)
    seen = client.inspect(shard)
    assert (seen["inline_bytes"], seen["inline_max_bytes_recorded"]) == (0, 0)
    assert seen["inline_fallbacks"] == 3
    _check_all_there(client, shard, written)
    client.close()


@pytest.mark.parametrize("bad", [-1, True, 1.5, "10", None, 1 << 64])
def test_set_inline_max_bytes_refuses_bad_values(durable_location: Location,
                                                 bad: object) -> None:
    client = durable_location.client(BIG)
    shard = str(ShardId.new())
    client.open_writer(shard).expire()
    seqno = client.inspect(shard)["seqno"]
    with pytest.raises(InvalidInput, match="max_bytes"):
        client.set_inline_max_bytes(shard, bad)  # type: ignore[arg-type]
    seen = client.inspect(shard)
    assert (seen["seqno"], seen["inline_max_bytes_recorded"]) == (seqno, BIG.max_bytes)
    client.close()


def test_set_inline_max_bytes_of_a_missing_shard_creates_nothing(
        durable_location: Location) -> None:
    from persist_pipeline import ShardNotFound

    client = durable_location.client(BIG)
    shard = str(ShardId.new())
    with pytest.raises(ShardNotFound):
        client.set_inline_max_bytes(shard, 10)
    assert shard not in client.list_shards()
    client.close()


def test_setting_the_recorded_value_again_commits_nothing(durable_location: Location) -> None:
    client = durable_location.client(BIG)
    shard = str(ShardId.new())
    client.open_writer(shard).expire()
    seqno = client.inspect(shard)["seqno"]
    assert client.set_inline_max_bytes(shard, BIG.max_bytes) == BIG.max_bytes
    assert client.inspect(shard)["seqno"] == seqno
    client.close()


# --- shards recorded before the field existed -----------------------------------------------


def test_scalars_without_the_field_decode_as_not_recorded() -> None:
    old = pb.Scalars(walltime_ms=5, inline_bytes=7)
    assert not old.HasField("inline_max_bytes")
    state = State(shard_id="s", seqno=1)
    decoded = sc.decode_state(sc.encode_state(state), "test")
    assert decoded.inline_max_bytes is None
    for value in (0, 1, 1 << 20):
        recorded = replace(state, inline_max_bytes=value)
        assert sc.decode_state(sc.encode_state(recorded), "test").inline_max_bytes == value
        diff = sc.decode_diff(sc.encode_diff(state, replace(recorded, seqno=2)), "test")
        assert sc.apply_diff(state, diff, "test").inline_max_bytes == value
        # Diffs carry complete scalars: one without the field means "not recorded".
        back = sc.decode_diff(sc.encode_diff(recorded, replace(state, seqno=2)), "test")
        assert sc.apply_diff(recorded, back, "test").inline_max_bytes is None


def _create_as_an_older_build(client: PersistClient, shard: str) -> None:
    """The first record of ``shard`` as a build without the field wrote it."""
    empty = State(shard_id=shard)
    first = replace(transitions.create(empty, 1, 60_000, None), seqno=1)
    assert first.inline_max_bytes is None
    client.consensus.compare_and_set(shard, None, VersionedData(
        1, sc.encode_diff(empty, first), sc.encode_summary(first)))


def test_an_older_shard_is_recorded_by_its_first_append(durable_location: Location) -> None:
    small, big = durable_location.client(SMALL), durable_location.client(BIG)
    shard = str(ShardId.new())
    _create_as_an_older_build(big, shard)
    seen = big.inspect(shard)
    assert seen["inline_max_bytes_recorded"] is None
    # Not recorded: each process judges by its own config until one is.
    assert seen["inline_max_bytes"] == seen["inline_max_bytes_effective"] == BIG.max_bytes
    assert big.shard_summaries()[shard].inline_max_bytes is None
    written = _write(small, shard, 1, "first")
    assert big.inspect(shard)["inline_max_bytes_recorded"] == SMALL.max_bytes
    written += _write(big, shard, 30, "big")
    assert _max_inline(big, shard) <= SMALL.max_bytes
    _check_all_there(big, shard, written)
    small.close()
    big.close()


def test_a_process_with_inlining_off_records_no_max(durable_location: Location) -> None:
    """Inlining off (threshold 0): the process's max bounds none of its own writes, so
    neither creating the shard nor appending to it records one; the first process that
    inlines does."""
    off, on = durable_location.client(InlinePolicy(0, 0)), durable_location.client(BIG)
    shard = str(ShardId.new())
    off.open_reader(shard, create=True).expire()
    written = _write(off, shard, 2, "off")
    assert on.inspect(shard)["inline_max_bytes_recorded"] is None
    written += _write(on, shard, 2, "on")
    seen = on.inspect(shard)
    assert seen["inline_max_bytes_recorded"] == BIG.max_bytes
    assert seen["parts"]["inline"] == 2
    _check_all_there(on, shard, written)
    off.close()
    on.close()


def test_transactions_keep_within_each_shards_recorded_max(durable_location: Location) -> None:
    """A transaction's appends go by each shard's record too (a full shard's append
    falls through to blob; the transaction still commits all or none)."""
    small, big = durable_location.client(SMALL), durable_location.client(BIG)
    tight, roomy = str(ShardId.new()), str(ShardId.new())
    small.open_writer(tight).expire()
    big.open_writer(roomy).expire()
    written: dict[str, list[tuple]] = {tight: [], roomy: []}
    for t in range(20):
        updates = [(b"k%d" % t, b"x" * 200, t, 1)]
        with big.transaction() as txn:
            for shard in (tight, roomy):
                txn.compare_and_append(shard, updates, t, t + 1)
        for shard in (tight, roomy):
            written[shard] += updates
    assert _max_inline(big, tight) <= SMALL.max_bytes
    assert big.inspect(tight)["inline_fallbacks"] > 0
    assert big.inspect(roomy)["inline_bytes"] > SMALL.max_bytes
    for shard in (tight, roomy):
        _check_all_there(big, shard, written[shard])
    small.close()
    big.close()
