"""Leases: live handles heartbeat in the background; dropped ones stop and expire."""

from __future__ import annotations

import gc
import time

import pytest

from persist_pipeline import PersistClient, PersistConfig, ShardId
from persist_pipeline.exceptions import LeaseExpired

FAST = PersistConfig(reader_lease_duration_s=0.5, heartbeat_interval_s=0.05)


def test_live_reader_keeps_its_lease_and_a_dropped_one_expires():
    client = PersistClient.open("mem://", "mem://", config=FAST)
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"a", b"b", 0, 1)], 0, 10)
    keeper = client.open_reader(shard)
    dropped = client.open_reader(shard)
    keeper.downgrade_since(5)
    dropped_id = dropped.reader_id
    del dropped
    gc.collect()
    time.sleep(1.0)  # two lease durations: only the heartbeating reader survives
    client.gc(shard)  # expires stale leases
    info = client.inspect(shard)
    assert keeper.reader_id in info["readers"] and dropped_id not in info["readers"]
    assert info["since"] == 5  # the dropped reader no longer holds since back
    assert keeper.snapshot(5).num_rows == 1
    client.close()


def test_a_reader_expired_by_someone_else_gets_a_typed_error():
    cfg = PersistConfig(reader_lease_duration_s=0.2, heartbeat_interval_s=0)
    client = PersistClient.open("mem://", "mem://", config=cfg)
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"a", b"b", 0, 1)], 0, 10)
    reader = client.open_reader(shard)
    time.sleep(0.4)
    client.gc(shard)
    with pytest.raises(LeaseExpired):
        reader.snapshot(5)
    client.close()
