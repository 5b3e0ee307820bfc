"""Leases: live handles heartbeat in the background; dropped ones stop and expire."""

from __future__ import annotations

import gc
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.exceptions import CommitDeadlineExceeded, LeaseExpired
from persist_pipeline.ids import batch_id as batch_id_of
from persist_pipeline.ids import new_token
from persist_pipeline.internal.blobs import write_parts
from tests.fixtures.location import Location
from tests.helpers import WAIT_S, HandClock, client_on_clock, rows, wait_until

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


# --- a writer that was expired and reappears -----------------------------------------------

WRITER_CFG = PersistConfig(reader_lease_duration_s=30, heartbeat_interval_s=0,
                           gc_orphan_min_age_s=120, blob_cache_bytes=0,
                           background_maintenance=False)
BLOB_ONLY = InlinePolicy(0, 0)


def test_a_writer_gc_expired_mid_write_commits_and_loses_nothing(location: Location):
    """A writer pauses past its lease between uploading its part and committing it; GC
    (its clock past the lease) expires it and sweeps orphans meanwhile. The part is young
    on the store's clock, so it survives; the writer's commit lands (it registers again),
    and a retry with its token is settled as committed though the token went with the
    lease."""
    clock = HandClock()
    client = client_on_clock(location, clock, BLOB_ONLY, WRITER_CFG)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    real_transition = writer._transition
    expired: list[bool] = []

    def paused(staged):  # type: ignore[no-untyped-def]
        if not expired:
            clock.advance(WRITER_CFG.reader_lease_duration_s + 1)  # within the deadline
            client.gc(shard)
            expired.append(writer.writer_id not in client._machine(shard).fetch_latest()
                           .writers)
        return real_transition(staged)

    writer._transition = paused  # type: ignore[method-assign]
    token = new_token()
    result = writer.compare_and_append([(b"b", b"2", 1, 1)], 1, 2, idempotency_token=token)
    writer._transition = real_transition  # type: ignore[method-assign]
    assert expired == [True] and not result.already_committed
    assert writer.writer_id in client._machine(shard).fetch_latest().writers
    # Expired again (and with it the token); a retry is settled by the batch's id.
    clock.advance(WRITER_CFG.reader_lease_duration_s + 1)
    client.gc(shard)
    again = writer.compare_and_append([(b"b", b"2", 1, 1)], 1, 2, idempotency_token=token)
    assert again.already_committed
    fresh = location.client(BLOB_ONLY)
    assert rows(fresh.open_reader(shard).snapshot(1), 1) == [(b"a", b"1", 1), (b"b", b"2", 1)]
    fresh.close()
    client.close()


def _upload_one_row(client: PersistClient, shard: ShardId, key: bytes,
                    time: int) -> tuple[str, float, list[Any]]:
    """A Spark task's upload of one row at ``time``: its token, when it started on the
    shard's clock, and its parts (not committed)."""
    token = new_token()
    started_s = client._machine(shard).monotonic()
    parts = write_parts(pa.table({"k": [key], "v": [b"1"], "t": [time], "d": [1]}),
                        str(shard), batch_id_of(token), client.blobs.main, "main",
                        WRITER_CFG.blob_target_size_bytes)
    return token, started_s, parts


def test_an_expired_writer_gets_a_typed_error_and_its_parts_go_to_gc(location: Location):
    """expire()d, a handle refuses every write with LeaseExpired and changes nothing.
    Parts uploaded for it (a Spark write's) are not deleted on the refusal (another
    handle may still commit them with their token, within the deadline) and not left
    forever: past the shard's orphan age GC sweeps them, and a commit of them after
    their deadline is refused instead of referencing what GC swept."""
    clock = HandClock()
    client = client_on_clock(location, clock, BLOB_ONLY, WRITER_CFG)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    token, started_s, parts = _upload_one_row(client, shard, b"s", 1)
    writer.expire()
    before = client._machine(shard).fetch_latest()
    with pytest.raises(LeaseExpired):
        writer.compare_and_append([(b"b", b"2", 1, 1)], 1, 2)
    with pytest.raises(LeaseExpired):
        writer.compare_and_append_parts(parts, 1, 1, 2, idempotency_token=token,
                                        upload_started_s=started_s, schema=None)
    after = client._machine(shard).fetch_latest()
    assert (after.seqno, after.upper) == (before.seqno, before.upper)
    assert writer.writer_id not in after.writers
    assert all(client.blobs.main.get(p.key) is not None for p in parts)
    # Another handle commits them in time.
    retry = client.open_writer(shard)
    assert not retry.compare_and_append_parts(parts, 1, 1, 2, idempotency_token=token,
                                              upload_started_s=started_s,
                                              schema=None).already_committed
    # Parts a refused handle leaves, nobody commits: GC sweeps them once old enough.
    token, started_s, late = _upload_one_row(client, shard, b"t", 2)
    retry.expire()
    with pytest.raises(LeaseExpired):
        retry.compare_and_append_parts(late, 1, 2, 3, idempotency_token=token,
                                       upload_started_s=started_s, schema=None)
    clock.advance(WRITER_CFG.gc_orphan_min_age_s + client.blobs.main.stamp_resolution_s + 1)
    assert client.gc(shard)["orphans_deleted"] >= len(late)
    assert all(client.blobs.main.get(p.key) is None for p in late)
    with pytest.raises(CommitDeadlineExceeded):
        client.open_writer(shard).compare_and_append_parts(
            late, 1, 2, 3, idempotency_token=token, upload_started_s=started_s, schema=None)
    assert rows(client.open_reader(shard).snapshot(1), 1) == [(b"a", b"1", 1), (b"s", b"1", 1)]
    client.close()


def test_a_heartbeat_landing_after_expire_does_not_bring_the_writer_back(location: Location):
    """A heartbeat in flight when ``expire()`` commits (its thread not stopped in time:
    consensus slow) lands afterwards: it must not register the expired writer again,
    which would then sit in the state until its lease ran out."""
    client = location.client(BLOB_ONLY, WRITER_CFG)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    writer.expire()
    writer._beat()  # the beat that was on its way
    assert writer.writer_id not in client._machine(shard).fetch_latest().writers
    client.close()


def test_every_call_of_a_reader_expired_by_another_clients_gc_is_lease_expired(
        durable_location: Location):
    """A reader paused past its lease, expired by another client's GC (which then
    compacts and collects what the reader held), thinks it is alive: every later call
    of it and of what it opened before the pause (a listen, an unstarted snapshot
    iterator) is LeaseExpired, never rows of a state GC no longer keeps."""
    cfg = PersistConfig(reader_lease_duration_s=0.5, heartbeat_interval_s=0,
                        background_maintenance=False)
    clock = HandClock()
    client = client_on_clock(durable_location, clock, BLOB_ONLY, cfg)
    other = client_on_clock(durable_location, clock, BLOB_ONLY, cfg)
    shard = str(ShardId.new())
    writer = client.open_writer(shard)
    for t in range(4):
        writer.compare_and_append([(b"k", b"v%d" % t, t, 1)], t, t + 1)
    reader = client.open_reader(shard)
    listen = reader.listen(1)
    pending = reader.snapshot_batches(3)
    clock.advance(1.0)  # two leases without a heartbeat: the pause
    writer.compare_and_append([(b"k", b"z", 4, 1)], 4, 5)
    other.gc(shard)  # expires the reader
    other.compact(shard)
    assert other.gc(shard)["blobs_deleted"] >= 4  # what the reader held is gone
    calls: dict[str, Any] = {
        "snapshot": lambda: reader.snapshot(3),
        "snapshot_batches": lambda: list(pending),
        "snapshot_fingerprint": lambda: reader.snapshot_fingerprint(3),
        "listen": lambda: reader.listen(3),
        "poll": lambda: listen.poll(),
        "snapshot_plan": lambda: reader.snapshot_plan(3),
        "downgrade_since": lambda: reader.downgrade_since(2),
        "heartbeat": lambda: reader.heartbeat(),
    }
    for what, call in calls.items():
        with pytest.raises(LeaseExpired):
            call()
            pytest.fail(f"{what} of an expired reader did not raise")
    assert reader.reader_id not in other.inspect(shard)["readers"]
    reader.expire()  # harmless after the expiry
    client.close()
    other.close()
