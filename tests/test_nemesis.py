"""The nemesis: a short run on real backends, regression cases from the peers' bug
history, and a negative control for every invariant the checker verifies."""

from __future__ import annotations

import threading
import time

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId, UpperMismatch
from persist_pipeline.compaction import apply_merge_result, merge_requests, run_merge
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import VersionedData
from persist_pipeline.consensus.retry import RetryingConsensus
from persist_pipeline.exceptions import ConsensusUnavailable
from persist_pipeline.internal import machine as machine_mod
from persist_pipeline.internal import state_codec, transitions
from persist_pipeline.nemesis import checker, runner, workload
from persist_pipeline.sim import controls
from tests.fixtures.location import Location
from tests.helpers import WAIT_S, HandClock, client_on_clock, expected_snapshot, rows

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow

# --- the nemesis itself -------------------------------------------------------------------


def test_short_nemesis_on_postgres_and_s3(pg_restartable, s3_uri, tmp_path):
    cluster = pg_restartable
    report = runner.run(runner.NemesisOptions(
        consensus_uri=cluster.server.url("postgres"), blob_uri=s3_uri, seconds=15, writers=3,
        readers=2, seed=11, fault_rate=0.02, pg_restart=" ".join(cluster.restart_command()),
        workdir=str(tmp_path / "nemesis")), out=print)
    assert report.check.violations == []
    assert (report.check.lost, report.check.duplicated, report.check.leaked_blobs) == (0, 0, 0)
    assert report.kills > 0 and report.faults > 0 and report.pg_restarts == 1
    assert report.check.acked > 0 and report.midrun_checks == 1


def test_short_nemesis_on_the_embedded_default_with_a_wal_store(tmp_path):
    report = runner.run(runner.NemesisOptions(
        consensus_uri=f"sqlite:///{tmp_path / 'c.db'}", blob_uri=f"file://{tmp_path / 'b'}",
        wal_blob_uri=f"file://{tmp_path / 'wal'}", seconds=10, writers=2, readers=1, seed=3,
        workdir=str(tmp_path / "nemesis")), out=print)
    assert report.check.violations == []
    assert report.kills > 0 and report.check.acked > 0


# --- regressions from the peers' bug history ----------------------------------------------


def _two_batches(client: PersistClient) -> ShardId:
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2)
    return shard


def test_stale_merge_result_cannot_resurrect_parts_gc_deletes(location: Location):
    """Materialize's regression_gc_stale_merge_res."""
    client = location.client(InlinePolicy(0, 0), PersistConfig(rollup_threshold=2))
    shard = _two_batches(client)
    machine = client._machine(shard)
    (req,) = merge_requests(machine.fetch_latest())
    blobs = client.blobs
    stale = run_merge(req, str(shard), blobs.main, blobs.wal, 1 << 20)
    client.compact(shard)  # another compaction replaces the same range first
    assert apply_merge_result(machine, stale, machine.monotonic()) == "no_match"
    assert all(blobs.main.get(p.key) is None for p in stale.output.hollow_parts())
    for t in range(2, 8):
        client.open_writer(shard).compare_and_append([], t, t + 1)
    client.gc(shard)
    assert rows(client.open_reader(shard).snapshot(1), 1) == [(b"a", b"1", 1), (b"b", b"1", 1)]
    result = checker.check_shard(client, str(shard), acked=[b"a", b"b"],
                                 attempted=[b"a", b"b"], inline_max_bytes=0)
    assert result.violations == []


class LoseOneCasReply(RetryingConsensus):
    """Applies the next compare_and_set, then reports it as failed (the lost reply)."""

    armed = False

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        ok = super().compare_and_set(shard, expected, new)
        if self.armed and ok:
            self.armed = False
            raise ConsensusUnavailable("injected: reply lost after commit")
        return ok


def test_compaction_whose_cas_reply_was_lost_keeps_its_outputs(location: Location):
    client = location.client(InlinePolicy(0, 0))
    shard = _two_batches(client)
    lossy = LoseOneCasReply(open_consensus(location.consensus_uri), 30)
    other = PersistClient(lossy, client.blobs.main.inner, client.blobs.wal and
                          client.blobs.wal.inner, PersistConfig(inline_policy=InlinePolicy(0, 0)))
    lossy.armed = True
    metrics = other.compact(shard)
    assert lossy.armed is False, "the reply was never lost"
    assert metrics["applied"] == 1 and metrics["not_applied"] == 0
    state = client._machine(shard).fetch_latest()
    (batch,) = state.batches.values()
    assert all(client.blobs.main.get(p.key) is not None for p in batch.hollow_parts())
    assert rows(client.open_reader(shard).snapshot(1), 1) == [(b"a", b"1", 1), (b"b", b"1", 1)]


# --- negative controls: a deliberately broken build is caught -----------------------------


def _check(client: PersistClient, shard: ShardId, keys: list[bytes], max_bytes: int,
           **kw: bool) -> checker.CheckResult:
    return checker.check_shard(client, str(shard), acked=keys, attempted=keys,
                               inline_max_bytes=max_bytes, **kw)


def test_control_gc_that_ignores_what_is_live_is_caught(location, monkeypatch):
    # Written with the default commit deadline (a loaded machine may take longer than the
    # half second a 1 s orphan age leaves), so the shard has the default orphan age;
    # collected by a GC configured with 1 s, which goes by the shard's.
    writing = location.client(InlinePolicy(0, 0), PersistConfig(rollup_threshold=2))
    shard = _two_batches(writing)
    for t in range(2, 6):
        writing.open_writer(shard).compare_and_append([], t, t + 1)
    clock = HandClock()  # GC's time: its store's clock is what ages the parts
    collecting = PersistConfig(rollup_threshold=2, gc_orphan_min_age_s=1)
    client = client_on_clock(location, clock, InlinePolicy(0, 0), collecting)
    # Every part is now old enough for the orphan sweep on the store's clock, whose
    # stamps may be rounded down (S3: to the second).
    clock.advance(writing.config.gc_orphan_min_age_s
                  + client.blobs.main.stamp_resolution_s + 0.1)
    from persist_pipeline import gc

    # The broken build: the orphan sweep believes no version references anything.
    monkeypatch.setattr(gc, "_referenced_by_kept", lambda machine, head: set())
    monkeypatch.setattr(gc.State, "referenced_blobs", lambda self: set())
    result = _check(client, shard, [b"a", b"b"], 0)
    # The broken sweep deletes every blob older than its age: the parts live versions
    # reference and, when the rollup at the earliest record is that old too (it depends
    # on when the last rollup was written), that rollup, so no version can be rebuilt.
    # Either way a live version needs a blob that is gone, and the checker must say so.
    gone = ("references missing blob", "no rollup at the earliest record",
            "state does not decode")
    assert any(g in v for v in result.violations for g in gone), result


def test_control_broken_idempotency_is_caught_as_duplicates(location, monkeypatch):
    real = transitions.compare_and_append

    def forgetful(state, batch, **kw):  # the broken build: the token is never matched
        return real(state, batch, **{**kw, "token": kw["token"] + str(time.monotonic())})

    monkeypatch.setattr(transitions, "compare_and_append", forgetful)
    # ... and lost replies are guessed lost, the batch's identity is not checked (the
    # fixes that would otherwise recognise the commit).
    monkeypatch.setattr(machine_mod.Machine, "_resolve", controls._guess_lost)
    monkeypatch.setattr(transitions, "batch_in_state", lambda state, batch: False)
    lossy = LoseOneCasReply(open_consensus(location.consensus_uri), 30)
    client = PersistClient(lossy, location.client().blobs.main.inner)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    lossy.armed = True
    try:
        writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    except UpperMismatch as e:  # the nemesis writer's (correct) reaction to a mismatch
        writer.compare_and_append([(b"a", b"1", e.current, 1)], e.current, e.current + 1)
    result = _check(client, shard, [b"a"], 1 << 20)
    assert result.duplicated == 1


def test_control_inline_bound_violation_is_caught(location, monkeypatch):
    # The transition's bound broken outright: neither the process's max nor the one the
    # shard recorded holds an append back.
    monkeypatch.setattr(transitions, "inline_write_bound", lambda state, own: 1 << 30)
    client = location.client(InlinePolicy(4096, 100))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    keys = []
    for t in range(5):
        keys.append(b"k%d" % t)
        writer.compare_and_append([(keys[-1], b"x" * 60, t, 1)], t, t + 1)
    result = _check(client, shard, keys, 100, final_gc=False)
    assert any("exceed the max" in v for v in result.violations)


def test_control_lossy_compaction_is_caught(location, monkeypatch):
    from persist_pipeline import compaction

    real = compaction.consolidate
    monkeypatch.setattr(compaction, "consolidate",
                        lambda table, **kw: real(table, **kw).slice(1))  # drops a row
    client = location.client()
    shard = _two_batches(client)
    client.compact(shard)
    result = _check(client, shard, [b"a", b"b"], 1 << 20)
    assert result.lost == 1


def test_control_regressing_upper_and_undecodable_state_are_caught(location):
    client = location.client()
    shard = _two_batches(client)
    state = client._machine(shard).fetch_latest()
    from dataclasses import replace

    regressed = replace(state, seqno=state.seqno + 1, upper=1)
    record = VersionedData(regressed.seqno, state_codec.encode_diff(state, regressed),
                           state_codec.encode_summary(regressed))
    assert client.consensus.compare_and_set(str(shard), state.seqno, record)
    result = checker.check_history(client, str(shard), 1 << 20)
    assert any("upper went back" in v for v in result.violations)
    garbage = VersionedData(regressed.seqno + 1, b"\xff garbage", record.summary)
    assert client.consensus.compare_and_set(str(shard), regressed.seqno, garbage)
    result = checker.check_history(client, str(shard), 1 << 20)
    assert any("does not decode" in v for v in result.violations)


def test_control_gc_without_orphan_sweep_leaks_and_is_caught(location, monkeypatch):
    clock = HandClock()
    client = client_on_clock(location, clock, InlinePolicy(0, 0),
                             PersistConfig(gc_orphan_min_age_s=3))
    shard = _two_batches(client)
    client.blobs.main.set(f"{shard}/p/b-crashed-0000.parquet", b"orphan of a dead writer")
    # Older than the orphan age on the store's clock, whose stamps may be rounded down.
    clock.advance(3.1 + client.blobs.main.stamp_resolution_s)
    monkeypatch.setattr("persist_pipeline.gc._sweep_orphans", lambda machine: 0)
    result = _check(client, shard, [b"a", b"b"], 0)
    assert result.leaked_blobs == 1
    monkeypatch.undo()
    assert _check(client, shard, [b"a", b"b"], 0).leaked_blobs == 0  # the real GC sweeps


def test_control_partial_uploads_left_by_killed_writers_are_caught(tmp_path, monkeypatch):
    """A writer killed mid-upload leaves a local folder's temporary file, which no listing
    shows: the checker counts it as a leak unless the final GC's sweep took it."""
    import os

    location = Location("embedded-wal", f"sqlite:///{tmp_path / 'consensus.db'}",
                        f"file://{tmp_path / 'blobs'}", f"file://{tmp_path / 'wal'}")
    client = location.client(InlinePolicy(0, 0))
    shard = _two_batches(client)
    partial = tmp_path / "wal" / str(shard) / "p" / "b-killed" / (".tmp-" + "a" * 32)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"half a part")
    old = time.time() - 2 * 3600  # older than the shard's orphan age
    os.utime(partial, (old, old))
    monkeypatch.setattr("persist_pipeline.blob.local.LocalBlob.sweep_partial_writes",
                        lambda self, prefix, stamped_before: 0)
    result = _check(client, shard, [b"a", b"b"], 0)
    assert result.leaked_blobs == 1 and "partial upload" in result.violations[0]
    monkeypatch.undo()
    assert _check(client, shard, [b"a", b"b"], 0).leaked_blobs == 0  # the real GC sweeps
    assert not partial.exists()


def test_control_listen_that_drops_updates_is_caught(tmp_path, monkeypatch):
    from persist_pipeline.read import Listen, ReadHandle

    real_emit, real_snapshot = Listen._emit, ReadHandle.snapshot
    writes = 5
    reading, caught_up = threading.Event(), threading.Event()

    def lossy_emit(self, state):
        events = real_emit(self, state)
        kept = [e for e in events if e.kind == "progress"]  # drops every update
        if any(e.upper is not None and e.upper >= writes for e in kept):
            caught_up.set()  # the listener handles these before it next looks for "stop"
        return kept

    def signalling_snapshot(self, as_of):
        reading.set()  # the listener chose its as_of (the upper it found) just before
        return real_snapshot(self, as_of)

    monkeypatch.setattr(Listen, "_emit", lossy_emit)
    monkeypatch.setattr(ReadHandle, "snapshot", signalling_snapshot)
    setup = workload.NemesisSetup(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                  None, str(ShardId.new()), str(tmp_path), 0, 0.0,
                                  InlinePolicy(), PersistConfig())
    client = setup.client("writer", faults=False)
    writer = client.open_writer(setup.shard)
    thread = threading.Thread(target=workload.listener, args=(setup, "listener"))
    thread.start()
    # The listener's as_of is chosen before any write (its snapshot waits for the first),
    # so every later write reaches it only through its listen.
    assert reading.wait(WAIT_S), "the listener never read its snapshot"
    for t in range(writes):
        writer.compare_and_append([(b"k%d" % t, b"v", t, 1)], t, t + 1)
    assert caught_up.wait(WAIT_S), "the listen never reached the last write"
    (tmp_path / "stop").touch()
    thread.join(timeout=30)
    import json

    report = json.loads((tmp_path / "listener.json").read_text())
    assert report["mismatch_count"] > 0


def test_checker_passes_a_healthy_shard(location):
    client = location.client()
    shard = _two_batches(client)
    client.compact(shard)
    result = _check(client, shard, [b"a", b"b"], 1 << 20)
    assert result.violations == [] and result.present == 2
    assert expected_snapshot([(b"a", b"1", 0, 1), (b"b", b"1", 1, 1)], 1) == \
        rows(client.open_reader(shard).snapshot(1), 1)
