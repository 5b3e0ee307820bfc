"""Seams of read holds with other processes' maintenance: a read plan the CLI holds for
``--hold-seconds`` while a GC whose wall clock runs ahead (by more than the reader's
lease) expires its reader and, after a compaction, deletes the plan's files.

Leases are the one place where two processes' wall clocks meet: such a GC may expire a
live reader (documented), but the command that promised to keep the files for the hold
must then say so, never exit as if they had been kept.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.blob import open_blob
from persist_pipeline.consensus import open_consensus
from persist_pipeline.exceptions import CorruptPart, LeaseExpired, PersistError
from persist_pipeline.internal.clock import SystemClock
from tests.fixtures.location import Location
from tests.helpers import SkewedClock, run_cli

BLOB = InlinePolicy(0, 0)
LEASE_S = 15 * 60.0  # the default reader lease, which the CLI's reader has


def _skewed_client(location: Location, wall_offset_s: float) -> PersistClient:
    """A client of ``location`` in a process whose wall clock is ``wall_offset_s`` ahead."""
    cfg = PersistConfig(inline_policy=BLOB, heartbeat_interval_s=0,
                        background_maintenance=False, blob_cache_bytes=0)
    wal = open_blob(location.wal_blob_uri) if location.wal_blob_uri else None
    return PersistClient(open_consensus(location.consensus_uri), open_blob(location.blob_uri),
                         wal, cfg, SkewedClock(wall_offset_s))


def _shard_of_four_parts(location: Location) -> str:
    client = location.client(BLOB, PersistConfig(background_maintenance=False))
    shard = str(ShardId.new())
    with client.open_writer(shard) as writer:
        for t in range(4):
            writer.compare_and_append([(b"k", b"v%d" % t, t, 1)], t, t + 1)
    client.close()
    return shard


def _plan_held_while_a_peer_compacts_and_collects(
        location: Location, monkeypatch: pytest.MonkeyPatch, gc_clock_ahead_s: float
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], dict[str, Any]]:
    """``plan SHARD --hold-seconds 0.3`` on a shard of four parts; during the hold, a peer
    whose wall clock is ``gc_clock_ahead_s`` ahead compacts the shard (replacing the
    four parts) and runs GC. Returns the command's outcome, its plan and GC's metrics."""
    shard = _shard_of_four_parts(location)
    gc_client = _skewed_client(location, gc_clock_ahead_s)
    ran: list[dict[str, Any]] = []
    real_sleep = SystemClock.sleep

    def sleep(self: SystemClock, seconds: float) -> None:
        if not ran:  # the command's hold: the peer's maintenance happens meanwhile
            gc_client.compact(shard)
            ran.append(gc_client.gc(shard))
        real_sleep(self, seconds)

    monkeypatch.setattr(SystemClock, "sleep", sleep)
    env = {**os.environ, "PERSIST_CONSENSUS_URI": location.consensus_uri,
           "PERSIST_BLOB_URI": location.blob_uri}
    if location.wal_blob_uri:
        env["PERSIST_WAL_BLOB_URI"] = location.wal_blob_uri
    try:
        out = run_cli(env, "plan", shard, "--hold-seconds", "0.3")
    finally:
        gc_client.close()
    assert ran, (out.returncode, out.stderr)
    plan = json.loads(out.stdout)
    assert len(plan["files"]) == 4, plan
    return out, plan, ran[0]


def test_a_plan_held_against_a_gc_on_a_true_clock_keeps_its_files(
        durable_location: Location, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hold itself: GC during it deletes none of the plan's files (compaction
    replaced them), and the command ends with exit 0."""
    out, _, metrics = _plan_held_while_a_peer_compacts_and_collects(
        durable_location, monkeypatch, 0.0)
    assert metrics["blobs_deleted"] == 0, metrics
    assert out.returncode == 0, out.stderr


def test_a_plan_hold_lost_to_a_gc_with_a_fast_clock_is_reported(
        durable_location: Location, monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan --hold-seconds`` prints the plan, then keeps its files from GC for the hold.
    During the hold, a GC in a process whose wall clock is two leases ahead expires the
    command's reader (its heartbeats look stale to it) and, after a compaction replaced
    the plan's parts, deletes them. The command must not exit 0 as if it had held them:
    it fails with LeaseExpired (exit 1), so whoever read the plan's files under its hold
    knows that the read was not covered."""
    out, _, metrics = _plan_held_while_a_peer_compacts_and_collects(
        durable_location, monkeypatch, 2 * LEASE_S)
    # The hold was really lost: GC deleted the four parts the command had printed.
    assert metrics["blobs_deleted"] >= 4, metrics
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "LeaseExpired" in out.stderr and "--hold-seconds 0.3" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_spark_read_whose_planner_lost_its_lease_while_splitting_is_lease_expired(
        durable_location: Location, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark source's planner holds its plan's files with its reader, then reads
    their footers for split points. A GC whose wall clock runs two leases ahead expires
    that reader right after it took its plan (after a compaction replaced the parts),
    and deletes them before the footers are read: the read fails as its executors fail
    when the lease ran out (LeaseExpired: re-run it), not with PartMissing, a
    CorruptPart that says the shard lost data it never lost (no Spark needed)."""
    from persist_pipeline import ReadHandle
    from persist_pipeline.spark_source import make_read_plan

    location = durable_location
    shard = _shard_of_four_parts(location)
    gc_client = _skewed_client(location, 2 * LEASE_S)
    ran: list[dict[str, Any]] = []
    downgrade = ReadHandle.downgrade_since

    def downgrade_then_peer_maintenance(self: ReadHandle, new_since: Any) -> None:
        downgrade(self, new_since)
        gc_client.compact(shard)
        ran.append(gc_client.gc(shard))

    monkeypatch.setattr(ReadHandle, "downgrade_since", downgrade_then_peer_maintenance)
    opts = {"consensus": location.consensus_uri, "blob": location.blob_uri,
            "shard": shard, "partition_bytes": "1"}
    if location.wal_blob_uri:
        opts["wal_blob"] = location.wal_blob_uri
    try:
        with pytest.raises(PersistError) as refused:
            make_read_plan(opts)
    finally:
        gc_client.close()
    assert ran and ran[0]["blobs_deleted"] >= 4, ran
    assert isinstance(refused.value, LeaseExpired), repr(refused.value)
    assert not isinstance(refused.value, CorruptPart)


def test_a_renewal_failing_for_a_moment_does_not_end_a_plan_hold_early(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hold's renewals that fail for another reason than an expired reader
    (consensus away for a moment) end nothing early: leaving would release the files
    while they may still be read. Only a failure of the last renewal leaves the hold
    unconfirmed, and is raised after the whole hold."""
    import time

    from persist_pipeline import ReadHandle
    from persist_pipeline.cli import _hold
    from persist_pipeline.exceptions import ConsensusUnavailable

    location = Location("embedded", f"sqlite:///{tmp_path / 'c.db'}",
                        f"file://{tmp_path / 'b'}")
    shard = _shard_of_four_parts(location)
    client = location.client(BLOB, PersistConfig(heartbeat_interval_s=0.05))
    beat = ReadHandle.heartbeat
    failing = {"left": 1}

    def flaky(self: ReadHandle) -> None:
        if failing["left"]:
            failing["left"] -= 1
            raise ConsensusUnavailable("consensus away for a moment")
        beat(self)

    with client.open_reader(shard) as reader, reader.snapshot_plan(3):
        monkeypatch.setattr(ReadHandle, "heartbeat", flaky)
        started = time.monotonic()
        _hold(client, reader, 0.3)  # the first renewal fails, the later ones pass
        assert time.monotonic() - started >= 0.3
        failing["left"] = 1000
        with pytest.raises(ConsensusUnavailable):
            _hold(client, reader, 0.12)
    client.close()
