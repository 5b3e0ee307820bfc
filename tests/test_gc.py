"""GC deletes only what no live state version references and respects every hold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.blob import open_blob
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import Consensus
from persist_pipeline.exceptions import (
    CommitDeadlineExceeded,
    CorruptData,
    InvalidConfig,
    UpperMismatch,
)
from persist_pipeline.ids import batch_id as batch_id_of
from persist_pipeline.ids import new_token
from persist_pipeline.internal.blobs import write_parts
from persist_pipeline.sim import controls
from persist_pipeline.updates import Updates, encode_parquet
from tests.fixtures.location import Location
from tests.helpers import (
    BeforeNextCas,
    HandClock,
    StoreOnClock,
    client_on_clock,
    expected_snapshot,
    rows,
)

BLOB_ONLY = InlinePolicy(0, 0)


def test_gc_respects_a_readers_seqno_hold(location: Location):
    cfg = PersistConfig(rollup_threshold=4, heartbeat_interval_s=0)
    client = location.client(BLOB_ONLY, cfg)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    old_reader = client.open_reader(shard)  # holds an early seqno
    written = []
    for t in range(20):
        batch = [(b"k%d" % t, b"v", t, 1)]
        writer.compare_and_append(batch, t, t + 1)
        written += batch
    client.compact(shard)
    for t in range(20, 30):
        writer.compare_and_append([], t, t + 1)
    held = client.gc(shard)
    assert held["seqnos_truncated"] == 0 and held["blobs_deleted"] == 0
    assert rows(old_reader.snapshot(19), 19) == expected_snapshot(written, 19)
    old_reader.heartbeat()  # not reading anything: its hold moves to the head
    # The rollups started in the background recorded (GC truncates below the latest
    # recorded one): on a loaded machine they may still be in flight.
    client.flush_maintenance()
    freed = client.gc(shard)
    assert freed["seqnos_truncated"] > 0 and freed["blobs_deleted"] >= 20
    assert rows(old_reader.snapshot(19), 19) == expected_snapshot(written, 19)
    client.close()


def test_gc_never_deletes_an_uncommitted_part_of_a_write_in_flight(location: Location):
    client = location.client(BLOB_ONLY, PersistConfig(gc_orphan_min_age_s=3600))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"b", 0, 1)], 0, 1)
    # A write whose part is uploaded but whose compare-and-set has not happened yet.
    in_flight = f"{shard}/p/b-in-flight-0000.parquet"
    client.blobs.main.set(in_flight, encode_parquet(Updates.coerce([(b"c", b"d", 1, 1)])
                                                    .table()))
    client.gc(shard)
    assert client.blobs.main.get(in_flight) is not None
    client.close()


ORPHAN_AGE_S = 120.0


def test_orphans_are_swept_once_old_and_late_commits_are_refused(location: Location):
    # An orphan age long enough that no real delay of a loaded machine (an upload and a
    # CaS taking seconds) reaches half of it; time passes on the client's clock and its
    # store's, by hand: ages on the store's clock and the writer's commit deadline see
    # it as they would a real pause.
    cfg = PersistConfig(gc_orphan_min_age_s=ORPHAN_AGE_S)
    clock = HandClock()
    client = client_on_clock(location, clock, BLOB_ONLY, cfg)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"b", 0, 1)], 0, 1)
    orphan = f"{shard}/p/b-crashed-writer-0000.parquet"
    client.blobs.main.set(orphan, b"left behind by a writer that died before its CaS")
    # Older than the orphan age on the store's clock, whose stamps may be rounded down.
    clock.advance(ORPHAN_AGE_S + 0.1 + client.blobs.main.stamp_resolution_s)
    metrics = client.gc(shard)
    assert metrics["orphans_deleted"] == 1
    assert client.blobs.main.get(orphan) is None
    assert rows(client.open_reader(shard).snapshot(0), 0) == [(b"a", b"b", 1)]
    # A writer stalled past half the orphan age between upload and CaS must not commit.
    slow = client.open_writer(shard)
    real_transition = slow._transition

    def stalled_transition(staged):
        clock.advance(ORPHAN_AGE_S / 2 + 0.1)  # past half the orphan age, before the CaS
        return real_transition(staged)

    slow._transition = stalled_transition  # type: ignore[method-assign]
    with pytest.raises(CommitDeadlineExceeded):
        slow.compare_and_append([(b"late", b"x", 1, 1)], 1, 2)
    slow._transition = real_transition  # type: ignore[method-assign]
    assert client.inspect(shard)["upper"] == 1
    assert not [m for m in client.blobs.main.list_keys(f"{shard}/p/") if b"late" in
                (client.blobs.main.get(m.key) or b"")]
    client.close()


def test_the_sweeps_fence_alone_makes_a_paused_writers_commit_check_its_deadline(
        location: Location):
    """A writer computes its commit in time, then pauses before its compare-and-set
    past the orphan age; GC sweeps its part meanwhile. GC commits nothing but its fence
    here (a reader holds an older seqno, so no rollup is written; no lease expires):
    the fence alone must make the writer's CaS fail and its re-run refuse the commit for
    the deadline, never reference the part the sweep deleted."""
    cfg = PersistConfig(inline_policy=BLOB_ONLY, gc_orphan_min_age_s=ORPHAN_AGE_S,
                        heartbeat_interval_s=0)
    clock = HandClock()
    paused = BeforeNextCas(open_consensus(location.consensus_uri))
    writer_client = _process(location, clock, cfg, consensus=paused)
    collector = _process(location, clock, cfg)
    shard = ShardId.new()
    writer = writer_client.open_writer(shard)
    writer.compare_and_append([(b"a", b"b", 0, 1)], 0, 1)
    reader = collector.open_reader(shard)  # holds this seqno while the head moves on
    writer.compare_and_append([], 1, 2)
    writer.fetch_recent_upper()  # the commit below is computed on the latest state
    metrics: list[dict[str, object]] = []

    def gc_while_paused() -> None:
        clock.advance(ORPHAN_AGE_S + 1 + writer_client.blobs.main.stamp_resolution_s)
        metrics.append(collector.gc(shard))

    paused.arm(gc_while_paused)
    with pytest.raises(CommitDeadlineExceeded):
        writer.compare_and_append([(b"late", b"x", 2, 1)], 2, 3)
    assert metrics and metrics[0]["orphans_deleted"] == 1  # the paused write's part
    state = writer_client._machine(str(shard)).fetch_latest()
    missing = [key for store, key in state.referenced_blobs()
               if writer_client.blobs.store(store).get(key) is None]
    assert missing == [], "the shard references a part GC deleted"
    assert state.upper == 2
    assert rows(reader.snapshot(1), 1) == [(b"a", b"b", 1)]
    for client in (writer_client, collector):
        client.close()


def test_the_sweep_keeps_the_files_of_a_plan_open_longer_than_the_orphan_age(
        durable_location: Location):
    """Compaction replaced the files of an open read plan, and they are older than the
    orphan age: they are no orphans (the version the plan's reader holds references
    them), so the sweep leaves them and the plan still reads its data."""
    cfg = PersistConfig(inline_policy=BLOB_ONLY, gc_orphan_min_age_s=ORPHAN_AGE_S,
                        heartbeat_interval_s=0)
    clock = HandClock()
    client = _process(durable_location, clock, cfg)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    written = []
    for t in range(6):
        batch = [(b"k%d" % t, b"v", t, 1)]
        writer.compare_and_append(batch, t, t + 1)
        written += batch
    plan = client.open_reader(shard).snapshot_plan(5)
    client.compact(shard)
    live = {key for _, key in client._machine(str(shard)).fetch_latest().referenced_blobs()}
    assert {f.key for f in plan.file_details} - live, "compaction replaced the plan's files"
    clock.advance(ORPHAN_AGE_S + 1 + client.blobs.main.stamp_resolution_s)
    client.gc(shard)
    assert rows(plan.to_table(), 5) == expected_snapshot(written, 5)
    plan.close()
    client.close()


def _blob_files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_gc_without_the_wal_store_is_a_config_error_and_changes_nothing(tmp_path: Path):
    consensus = f"sqlite:///{tmp_path / 'consensus.db'}"
    blob, wal = tmp_path / "blobs", tmp_path / "wal"
    cfg = PersistConfig(rollup_threshold=4, heartbeat_interval_s=0, inline_policy=BLOB_ONLY)
    shard = ShardId.new()
    with PersistClient.open(consensus, f"file://{blob}", f"file://{wal}",
                            inline_policy=BLOB_ONLY, config=cfg) as client:
        writer = client.open_writer(shard)
        for t in range(10):
            writer.compare_and_append([(b"k%d" % t, b"v", t, 1)], t, t + 1)
        client.compact(shard)  # the WAL parts are replaced: garbage GC must delete
        for t in range(10, 20):
            writer.compare_and_append([], t, t + 1)
        writer.expire()
    assert _blob_files(wal), "the writes went to the WAL store"
    before = (_blob_files(blob), _blob_files(wal))
    with PersistClient.open(consensus, f"file://{blob}", inline_policy=BLOB_ONLY,
                            config=cfg) as forgetful:
        earliest = forgetful.consensus.scan(str(shard), 0, limit=1)[0].seqno
        with pytest.raises(InvalidConfig, match="WAL blob") as refused:
            forgetful.gc(shard)
        assert not isinstance(refused.value, CorruptData)
        assert forgetful.consensus.scan(str(shard), 0, limit=1)[0].seqno == earliest
    # (GC may have written a rollup of the head before it found the WAL part: that
    # adds a blob, it removes nothing.)
    assert _blob_files(blob) >= before[0], "no blob of the main store was deleted"
    assert _blob_files(wal) == before[1], "no WAL part was deleted"


_KILLED_MID_UPLOAD = """
import os, signal, sys
from persist_pipeline import InlinePolicy, PersistClient
client = PersistClient.open(sys.argv[1], sys.argv[2], sys.argv[3],
                            inline_policy=InlinePolicy(0, 0))
writer = client.open_writer(sys.argv[4])
# Die as the kernel would kill it: the part's bytes are written and synced to its
# temporary file, the rename that makes it the part never happens.
os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
writer.compare_and_append([(b"k%d" % i, b"v" * 64, 0, 1) for i in range(500)], 0, 1)
"""


def _temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".tmp-*") if p.is_file()]


def test_the_sweep_deletes_the_partial_uploads_of_a_killed_writer(tmp_path: Path):
    """A writer killed mid-upload leaves its part's temporary file in a local store (the
    listing never shows it, so it was swept by nothing, in the main or the WAL store):
    the orphan sweep deletes such files once older than the orphan age, and keeps a
    younger one (an upload that may still finish)."""
    consensus = f"sqlite:///{tmp_path / 'consensus.db'}"
    blob, wal = tmp_path / "blobs", tmp_path / "wal"
    shard = ShardId.new()
    with PersistClient.open(consensus, f"file://{blob}", f"file://{wal}",
                            inline_policy=BLOB_ONLY) as client:
        client.create_shard(shard)
    repo = Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", _KILLED_MID_UPLOAD, consensus,
                            f"file://{blob}", f"file://{wal}", str(shard)],
                           cwd=repo, capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    [left] = _temp_files(wal)
    assert left.parent.is_relative_to(wal / str(shard))
    old = time.time() - 2 * 3600  # older than the shard's orphan age (1 hour)
    os.utime(left, (old, old))
    young = left.parent / (".tmp-" + "f" * 32)  # an upload in flight right now
    young.write_bytes(b"partial")
    with PersistClient.open(consensus, f"file://{blob}", f"file://{wal}",
                            inline_policy=BLOB_ONLY) as client:
        metrics = client.gc(shard)
    assert not left.exists(), "the dead writer's partial upload was swept"
    assert young.exists(), "a young partial upload is kept"
    assert metrics["orphans_deleted"] >= 1
    young.unlink()


def test_a_writer_paused_mid_upload_past_the_orphan_age_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A writer pauses between writing its part's temporary file and the rename, longer
    than the shard's orphan age, while GC sweeps the file as a dead upload's. When it
    resumes, its rename finds the file gone: it writes the part again, and its commit
    is refused for the deadline (the upload started more than half the orphan age
    ago), so nothing references a part the sweep may delete. The shard is unchanged
    and takes the same write when it is made again."""
    age_s = 1.0  # the smallest orphan age there is: the pause below is real time
    consensus = f"sqlite:///{tmp_path / 'consensus.db'}"
    blob, wal = tmp_path / "blobs", tmp_path / "wal"
    cfg = PersistConfig(inline_policy=BLOB_ONLY, gc_orphan_min_age_s=age_s,
                        heartbeat_interval_s=0, background_maintenance=False)
    shard = ShardId.new()
    writer_client = PersistClient.open(consensus, f"file://{blob}", f"file://{wal}",
                                       config=cfg)
    collector = PersistClient.open(consensus, f"file://{blob}", f"file://{wal}",
                                   config=cfg)
    writer = writer_client.open_writer(shard)
    # Inline, so no deadline applies to it: on a cold process the first upload alone
    # may take longer than half this orphan age.
    writer.compare_and_append([], 0, 1)
    real_replace = os.replace
    paused: list[str] = []
    metrics: list[dict[str, object]] = []

    def replace_after_a_pause(src: Any, dst: Any) -> None:
        if not paused and Path(src).name.startswith(".tmp-"):
            paused.append(str(src))
            # The pause: past the orphan age on every clock, then GC runs meanwhile.
            time.sleep(age_s + 0.2 + writer_client.blobs.main.stamp_resolution_s)
            metrics.append(collector.gc(shard))
            assert not Path(src).exists(), "the sweep took the paused upload's file"
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_a_pause)
    updates = [(b"k%d" % i, b"v" * 64, 1, 1) for i in range(200)]
    with pytest.raises(CommitDeadlineExceeded):
        writer.compare_and_append(updates, 1, 2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert paused and metrics and metrics[0]["orphans_deleted"] >= 1
    assert _temp_files(blob) == [] and _temp_files(wal) == []
    state = collector._machine(str(shard)).fetch_latest()
    missing = [key for store, key in state.referenced_blobs()
               if collector.blobs.store(store).get(key) is None]
    assert missing == [], "the shard references a part GC deleted"
    assert state.upper == 1, "the refused write changed nothing"
    for attempt in range(5):  # an upload slower than half the age (a loaded machine)
        try:
            writer.compare_and_append(updates, 1, 2)
            break
        except CommitDeadlineExceeded:
            if attempt == 4:
                raise
    assert rows(collector.open_reader(shard).snapshot(1), 1) == expected_snapshot(updates, 1)
    for client in (writer_client, collector):
        client.close()


def test_reading_a_wal_part_without_the_wal_store_is_a_config_error(tmp_path: Path):
    consensus = f"sqlite:///{tmp_path / 'consensus.db'}"
    blob, wal = f"file://{tmp_path / 'blobs'}", f"file://{tmp_path / 'wal'}"
    shard = ShardId.new()
    with PersistClient.open(consensus, blob, wal, inline_policy=BLOB_ONLY) as client:
        client.open_writer(shard).compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    with PersistClient.open(consensus, blob, inline_policy=BLOB_ONLY) as forgetful, \
            pytest.raises(InvalidConfig, match="wal_blob_uri"):
        forgetful.open_reader(shard).snapshot(0)


WRITER_AGE_S = 600.0  # this writer's deadline: 300 s after its upload started
GC_AGE_S = 60.0  # a GC configured with a tenth of it


def _paused_write_while_gc_runs(writer: PersistClient, collector: PersistClient,
                                clock: HandClock, shard: ShardId, pause_s: float
                                ) -> tuple[list[dict[str, object]], object]:
    """``writer`` uploads a part, pauses ``pause_s`` before its compare-and-set, and
    ``collector`` runs GC meanwhile. Returns GC's metrics and the write's result (or
    the error it raised)."""
    handle = writer.open_writer(shard)
    real_transition = handle._transition
    metrics: list[dict[str, object]] = []

    def paused_transition(staged):  # type: ignore[no-untyped-def]
        if not metrics:  # once: the pause between the upload and the first CaS
            clock.advance(pause_s)
            metrics.append(collector.gc(shard))
        return real_transition(staged)

    handle._transition = paused_transition  # type: ignore[method-assign]
    try:
        outcome: object = handle.compare_and_append([(b"late", b"x", 1, 1)], 1, 2)
    except CommitDeadlineExceeded as e:
        outcome = e
    return metrics, outcome


class _FastWallClock:
    """Another process on ``clock``'s time, whose wall clock runs an hour fast and whose
    monotonic clock has its own origin."""

    def __init__(self, clock: HandClock) -> None:
        self._clock = clock

    def now_ms(self) -> int:
        return self._clock.now_ms() + 3_600_000

    def monotonic(self) -> float:
        return self._clock.monotonic() + 12_345.0

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(seconds)


def _process(location: Location, clock: HandClock, config: PersistConfig, *,
             own_clock: Any = None, consensus: Consensus | None = None) -> PersistClient:
    """A client whose blob stores keep ``clock``'s time (the store's clock is one for
    everybody), on its ``own_clock`` (default: ``clock``) and ``consensus`` (default:
    the location's)."""
    wal = (StoreOnClock(open_blob(location.wal_blob_uri), clock)
           if location.wal_blob_uri else None)
    return PersistClient(consensus or open_consensus(location.consensus_uri),
                         StoreOnClock(open_blob(location.blob_uri), clock), wal, config,
                         own_clock or clock)


@pytest.mark.parametrize("created_by", ["writer", "collector"])
def test_processes_configured_with_different_orphan_ages_never_lose_a_write(
        location: Location, created_by: str):
    """The orphan age is the shard's, recorded when it is created: a GC configured with
    a smaller age never sweeps a part a writer configured with a larger one may still
    commit, and such a writer's deadline is the shard's (shorter) one. The GC's wall
    clock also runs an hour fast: it plays no part in a blob's age."""
    clock = HandClock()
    writer = client_on_clock(location, clock, BLOB_ONLY,
                             PersistConfig(gc_orphan_min_age_s=WRITER_AGE_S,
                                           heartbeat_interval_s=0))
    collector = _process(location, clock, PersistConfig(
        inline_policy=BLOB_ONLY, gc_orphan_min_age_s=GC_AGE_S, heartbeat_interval_s=0),
        own_clock=_FastWallClock(clock))
    shard = ShardId.new()
    creator = writer if created_by == "writer" else collector
    creator.open_writer(shard).compare_and_append([(b"a", b"b", 0, 1)], 0, 1)
    recorded = WRITER_AGE_S if created_by == "writer" else GC_AGE_S
    assert writer.inspect(shard)["orphan_min_age_s"] == recorded
    # Paused past the GC's age, well within the writer's own deadline.
    metrics, outcome = _paused_write_while_gc_runs(writer, collector, clock, shard,
                                                   pause_s=2 * GC_AGE_S)
    assert metrics, "GC ran while the write was paused"
    state = writer._machine(str(shard)).fetch_latest()
    missing = [key for store, key in state.referenced_blobs()
               if writer.blobs.store(store).get(key) is None]
    assert missing == [], "the shard references a part GC deleted"
    if created_by == "writer":
        # The shard's age is the writer's: GC waits for it, the write commits.
        assert metrics[0]["orphans_deleted"] == 0
        assert not isinstance(outcome, Exception)
        expected = [(b"a", b"b", 0, 1), (b"late", b"x", 1, 1)]
    else:
        # The shard's age is the GC's: the writer's part may be swept, so its commit
        # is refused (a typed error, nothing written) rather than referencing it.
        assert isinstance(outcome, CommitDeadlineExceeded)
        expected = [(b"a", b"b", 0, 1)]
    assert state.upper == (2 if created_by == "writer" else 1)
    fresh = location.client(BLOB_ONLY)
    assert rows(fresh.open_reader(shard).snapshot(state.upper - 1), state.upper - 1) == \
        expected_snapshot(expected, state.upper - 1)
    for client in (writer, collector, fresh):
        client.close()


def _two_commits_of_the_same_parts(location: Location, clock: HandClock
                                   ) -> tuple[PersistClient, ShardId, Any, list[Exception]]:
    """Two commits of the same uploaded parts with one token (a Spark driver that never
    learnt the outcome commits them again): the first computes its commit in time and
    pauses before sending it; meanwhile the second, past the deadline, is refused; then
    the first lands. Returns a client, the shard, the parts and the refusals."""
    cfg = PersistConfig(inline_policy=BLOB_ONLY, gc_orphan_min_age_s=ORPHAN_AGE_S,
                        heartbeat_interval_s=0, blob_cache_bytes=0)
    paused = BeforeNextCas(open_consensus(location.consensus_uri))
    first_client = _process(location, clock, cfg, consensus=paused)
    second_client = _process(location, clock, cfg)
    shard = ShardId.new()
    first = first_client.open_writer(shard)
    first.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    token = new_token()
    started_s = clock.monotonic()  # one host: both commits measure from the plan
    parts = write_parts(pa.table({"k": [b"s"], "v": [b"1"], "t": [1], "d": [1]}),
                        str(shard), batch_id_of(token), first_client.blobs.main, "main",
                        cfg.blob_target_size_bytes)
    # Opened before: the second commit itself changes no state that would fence the
    # first (opening a writer would).
    second = second_client.open_writer(shard)
    first.fetch_recent_upper()  # the first computes its commit on the latest state
    refusals: list[Exception] = []

    def the_second_commit_meanwhile() -> None:
        clock.advance(ORPHAN_AGE_S / 2 + 1)
        try:
            second.compare_and_append_parts(
                parts, 1, 1, 2, idempotency_token=token, upload_started_s=started_s,
                schema=None)
        except CommitDeadlineExceeded as e:
            refusals.append(e)

    paused.arm(the_second_commit_meanwhile)
    first.compare_and_append_parts(parts, 1, 1, 2, idempotency_token=token,
                                   upload_started_s=started_s, schema=None)
    first_client.close()
    return second_client, shard, parts, refusals


def test_parts_refused_past_their_deadline_stay_while_another_commit_of_them_may_land(
        location: Location):
    """A refusal for the deadline changes no state, so it fences nothing: the first
    commit lands and references the parts, which the refusal must not have deleted."""
    client, shard, parts, refusals = _two_commits_of_the_same_parts(location, HandClock())
    assert len(refusals) == 1
    assert client._machine(str(shard)).fetch_latest().upper == 2
    assert all(client.blobs.main.get(p.key) is not None for p in parts), \
        "the refusal deleted parts the first commit then referenced"
    assert rows(client.open_reader(shard).snapshot(1), 1) == [(b"a", b"1", 1), (b"s", b"1", 1)]
    client.close()


def test_control_deadline_refusal_that_deletes_parts_loses_the_write(location: Location):
    """The negative control: a deadline refusal that deletes the parts leaves the shard
    referencing deleted parts once the first commit lands (reads fail)."""
    with controls.deadline_refusal_deletes_parts():
        client, shard, parts, refusals = _two_commits_of_the_same_parts(location,
                                                                        HandClock())
    assert len(refusals) == 1
    assert client._machine(str(shard)).fetch_latest().upper == 2
    assert all(client.blobs.main.get(p.key) is None for p in parts)
    with pytest.raises(CorruptData):
        client.open_reader(shard).snapshot(1)
    client.close()


def test_parts_refused_for_a_gap_stay_for_a_commit_of_them_once_the_gap_fills(
        location: Location):
    """An upper mismatch below the expected upper (a gap) fences nothing either: once
    another write fills the gap, a commit of the same parts with the token (a driver's
    commit retried while its first attempt was on its way) lands and references them,
    so the refusal must not have deleted them."""
    clock = HandClock()
    cfg = PersistConfig(inline_policy=BLOB_ONLY, gc_orphan_min_age_s=ORPHAN_AGE_S,
                        heartbeat_interval_s=0, blob_cache_bytes=0)
    client = _process(location, clock, cfg)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    token = new_token()
    started_s = clock.monotonic()
    parts = write_parts(pa.table({"k": [b"s"], "v": [b"1"], "t": [2], "d": [1]}),
                        str(shard), batch_id_of(token), client.blobs.main, "main",
                        cfg.blob_target_size_bytes)
    other = client.open_writer(shard)  # the other attempt's handle, opened before
    with pytest.raises(UpperMismatch):
        writer.compare_and_append_parts(parts, 1, 2, 3, idempotency_token=token,
                                        upload_started_s=started_s, schema=None)
    writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2)  # the gap fills
    other.compare_and_append_parts(parts, 1, 2, 3, idempotency_token=token,
                                   upload_started_s=started_s, schema=None)
    assert all(client.blobs.main.get(p.key) is not None for p in parts), \
        "the refusal deleted parts a later commit of them referenced"
    assert rows(client.open_reader(shard).snapshot(2), 2) == [
        (b"a", b"1", 1), (b"b", b"1", 1), (b"s", b"1", 1)]
    client.close()
