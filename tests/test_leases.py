"""Leases: live handles heartbeat in the background; dropped ones stop and expire."""

from __future__ import annotations

import gc

import pytest

from persist_pipeline import PersistClient, PersistConfig, ShardId
from persist_pipeline.exceptions import LeaseExpired
from tests.fixtures.location import Location
from tests.helpers import WAIT_S, HandClock, client_on_clock, wait_until

FAST = PersistConfig(reader_lease_duration_s=0.5, heartbeat_interval_s=0.05)
#: A fresh in-memory location (each ``mem://`` without a name is its own).
MEM = Location("mem", "mem://", "mem://")


def _last_heartbeat_ms(client: PersistClient, shard: ShardId, reader_id: str) -> int:
    return client._machine(shard).fetch_latest().leased_readers[reader_id].last_heartbeat_ms


def test_live_reader_keeps_its_lease_and_a_dropped_one_expires():
    clock = HandClock()
    client = client_on_clock(MEM, clock, config=FAST)
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"a", b"b", 0, 1)], 0, 10)
    keeper = client.open_reader(shard)
    dropped = client.open_reader(shard)
    keeper.downgrade_since(5)
    dropped_id = dropped.reader_id
    dropped_beats = dropped._heartbeat._thread
    del dropped
    gc.collect()
    # A dropped handle's heartbeat thread ends at its next beat; once it has, no renewal
    # of the dropped lease can land after the clock moves.
    dropped_beats.join(WAIT_S)
    assert not dropped_beats.is_alive(), "the dropped reader still heartbeats"
    clock.advance(1.0)  # two lease durations: only the heartbeating reader survives
    moved_ms = clock.now_ms()
    wait_until(lambda: _last_heartbeat_ms(client, shard, keeper.reader_id) >= moved_ms,
               "a background heartbeat of the live reader after the clock moved")
    client.gc(shard)  # expires stale leases
    info = client.inspect(shard)
    assert keeper.reader_id in info["readers"] and dropped_id not in info["readers"]
    assert info["since"] == 5  # the dropped reader no longer holds since back
    assert keeper.snapshot(5).num_rows == 1
    client.close()


def test_a_reader_expired_by_someone_else_gets_a_typed_error():
    cfg = PersistConfig(reader_lease_duration_s=0.2, heartbeat_interval_s=0)
    clock = HandClock()
    client = client_on_clock(MEM, clock, config=cfg)
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"a", b"b", 0, 1)], 0, 10)
    reader = client.open_reader(shard)
    clock.advance(0.4)  # two lease durations without a heartbeat
    client.gc(shard)
    with pytest.raises(LeaseExpired):
        reader.snapshot(5)
    client.close()
