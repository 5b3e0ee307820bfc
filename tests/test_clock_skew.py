"""Deadlines and GC's orphan sweep are safe under clock skew between processes.

No clock is compared with another machine's: GC measures a blob's age on the blob
store's own clock (a probe it writes), and a commit deadline is measured on the
committing process's monotonic clock from before its first upload (the Spark driver's,
for Spark writes). Each process below has its own skewed clock; each scenario is
deterministic and fails without its fix (the GC one also under the negative control).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.blob import open_blob
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import Consensus
from persist_pipeline.exceptions import CommitDeadlineExceeded
from persist_pipeline.sim import controls
from persist_pipeline.spark_datasource import PersistCommitMessage
from persist_pipeline.spark_source import (
    _abort,
    _commit,
    _Location,
    _write_task,
    plan_write,
)
from tests.fixtures.location import Location
from tests.helpers import BeforeNextCas, SkewedClock, expected_snapshot, rows

AGE_S = 60.0  # gc_orphan_min_age_s: commits must land within 30 s of their first upload
BLOB = InlinePolicy(0, 0)


@dataclass
class Processes:
    """Clients of one location, each a process with its own clock."""

    location: Location
    opened: list[PersistClient] = field(default_factory=list)

    def client(self, clock: SkewedClock, consensus: Consensus | None = None) -> PersistClient:
        cfg = PersistConfig(inline_policy=BLOB, gc_orphan_min_age_s=AGE_S,
                            heartbeat_interval_s=0, background_maintenance=False,
                            blob_cache_bytes=0)
        wal = (open_blob(self.location.wal_blob_uri) if self.location.wal_blob_uri
               else None)
        client = PersistClient(consensus or open_consensus(self.location.consensus_uri),
                               open_blob(self.location.blob_uri), wal, cfg, clock)
        self.opened.append(client)
        return client


@pytest.fixture
def processes(durable_location: Location) -> Iterator[Processes]:
    p = Processes(durable_location)
    yield p
    for client in p.opened:
        client.close()


FIRST = [(b"a", b"1", 0, 1)]
LATE = [(b"b", b"2", 1, 1)]


def _gc_ahead_while_a_write_is_in_flight(processes: Processes) -> tuple[
        PersistClient, str, Any, list[dict[str, object]]]:
    """A writer (true clock) uploads its part; before it commits, GC runs in a process
    whose wall clock is two orphan ages ahead. Returns (writer's client, shard, writer,
    GC's metrics); the write itself (of LATE) is left to the caller."""
    writer_consensus = BeforeNextCas(open_consensus(processes.location.consensus_uri))
    writer_client = processes.client(SkewedClock(0.0), writer_consensus)
    gc_client = processes.client(SkewedClock(wall_offset_s=2 * AGE_S, mono_origin_s=5.0))
    shard = str(ShardId.new())
    writer = writer_client.open_writer(shard)
    writer.compare_and_append(FIRST, 0, 1)
    metrics: list[dict[str, object]] = []
    writer_consensus.arm(lambda: metrics.append(gc_client.gc(shard)))
    return writer_client, shard, writer, metrics


def test_gc_with_a_fast_clock_does_not_sweep_a_write_in_flight(processes: Processes):
    _, shard, writer, metrics = _gc_ahead_while_a_write_is_in_flight(processes)
    result = writer.compare_and_append(LATE, 1, 2)
    assert result.placement in ("blob", "wal") and metrics
    assert metrics[0]["orphans_deleted"] == 0
    fresh = processes.client(SkewedClock(-3 * AGE_S))  # any clock reads the same
    assert rows(fresh.open_reader(shard).snapshot(1), 1) == expected_snapshot(FIRST + LATE, 1)


def test_control_gc_on_its_own_clock_sweeps_a_write_in_flight(processes: Processes):
    """The negative control: ages measured on GC's own clock delete the fresh part,
    and the write then commits a reference to a deleted blob."""
    writer_client, shard, writer, metrics = _gc_ahead_while_a_write_is_in_flight(processes)
    with controls.gc_sweeps_on_its_own_clock():
        writer.compare_and_append(LATE, 1, 2)
    assert metrics and int(metrics[0]["orphans_deleted"]) >= 1  # type: ignore[call-overload]
    state = writer_client._machine(shard).fetch_latest()
    missing = [key for store, key in state.referenced_blobs()
               if writer_client.blobs.store(store).get(key) is None]
    assert missing  # the shard now references a deleted part


def test_a_wall_clock_step_back_does_not_stretch_a_commit_deadline(processes: Processes):
    """The writer pauses past its deadline while its wall clock is stepped back an hour
    (NTP): measured on the monotonic clock, the deadline has still passed."""
    clock = SkewedClock(0.0)
    consensus = BeforeNextCas(open_consensus(processes.location.consensus_uri))
    client = processes.client(clock, consensus)
    shard = str(ShardId.new())
    writer = client.open_writer(shard)
    writer.compare_and_append(FIRST, 0, 1)

    gc_client = processes.client(SkewedClock(0.0, mono_origin_s=7.0))

    def pause_with_a_step_back() -> None:
        clock.advance(AGE_S / 2 + 1)
        clock.step_wall(-3600.0)
        gc_client.gc(shard)  # its fence makes the writer's CaS fail and re-check

    consensus.arm(pause_with_a_step_back)
    with pytest.raises(CommitDeadlineExceeded):
        writer.compare_and_append(LATE, 1, 2)
    assert writer.fetch_recent_upper() == 1
    leftovers = [m.key for m in client.blobs.main.list_keys(f"{shard}/p/")
                 if m.key not in {k for _, k in client._machine(shard).fetch_latest()
                                  .referenced_blobs()}]
    assert leftovers == []  # certainly not committed: its parts were deleted


def _spark_write(processes: Processes, driver: PersistClient, shard: str
                 ) -> tuple[object, PersistCommitMessage]:
    loc = processes.location
    location = _Location(loc.consensus_uri, loc.blob_uri, loc.wal_blob_uri, shard)
    job = plan_write(location, driver, 1, 2)
    table = pa.table({"k": [b"s"], "v": [b"1"], "t": [1], "d": [1]})
    return job, PersistCommitMessage(*_write_task(job, iter(table.to_batches())))


def test_spark_write_deadline_is_measured_on_the_driver_from_planning(processes: Processes):
    """Executors' clocks play no part: a write whose job outlived the deadline on the
    driver's monotonic clock is refused, whatever any wall clock says; its parts are
    left to GC's orphan sweep (a refusal for the deadline fences no other commit of
    them)."""
    driver_clock = SkewedClock(wall_offset_s=-7200.0)  # a driver an hour or two behind
    driver = processes.client(driver_clock)
    shard = str(ShardId.new())
    driver.open_writer(shard).compare_and_append(FIRST, 0, 1)
    job, message = _spark_write(processes, driver, shard)
    driver_clock.advance(AGE_S / 2 + 1)  # the tasks ran long
    with pytest.raises(CommitDeadlineExceeded):
        _commit(job, [message], driver)  # type: ignore[arg-type]
    state = driver._machine(shard).fetch_latest()
    assert state.upper == 1
    assert not {p.key for p in message.parts} & {k for _, k in state.referenced_blobs()}
    # In time, the same path commits.
    job, message = _spark_write(processes, driver, shard)
    _commit(job, [message], driver)  # type: ignore[arg-type]
    assert rows(driver.open_reader(shard).snapshot(1), 1) == [(b"a", b"1", 1), (b"s", b"1", 1)]


def test_spark_write_planned_on_another_host_is_refused(processes: Processes):
    driver = processes.client(SkewedClock(0.0))
    shard = str(ShardId.new())
    driver.open_writer(shard).compare_and_append(FIRST, 0, 1)
    job, message = _spark_write(processes, driver, shard)
    from dataclasses import replace

    elsewhere = replace(job, planned_on="another-boot")  # type: ignore[type-var]
    with pytest.raises(CommitDeadlineExceeded, match="another host"):
        _commit(elsewhere, [message], driver)
    _abort(elsewhere, [message])  # Spark aborts after a failed commit
    assert all(driver.blobs.main.get(p.key) is None for p in message.parts)
    assert driver._machine(shard).fetch_latest().upper == 1
