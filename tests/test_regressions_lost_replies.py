"""Regression tests: stale caches and lost compare-and-set replies never produce a false
negative answer, and never make a process delete blobs a committed state references.

Each defect has a test of the fixed behaviour and a twin that runs the same scenario
inside the negative control of :mod:`persist_pipeline.sim.controls` that puts the defect
back, asserting the defect shows (so each test demonstrably fails without its fix).

Every scenario is deterministic: a reply is lost by a consensus wrapper that commits the
compare-and-set, runs a hook (another client's write, GC or compaction; time passing on
a hand-advanced clock) and then raises ``ConsensusUnavailable``. No test sleeps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId, UpperMismatch
from persist_pipeline.blob import open_blob
from persist_pipeline.compaction import apply_merge_result, merge_requests, run_merge
from persist_pipeline.config import READER_LEASE_DURATION_S, RETRY_DEADLINE_S
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.exceptions import (
    CommitDeadlineExceeded,
    ConsensusUnavailable,
    CorruptPart,
    FencedOut,
    Indeterminate,
    InvalidInput,
    InvalidUpdates,
)
from persist_pipeline.ids import batch_id as batch_id_of
from persist_pipeline.ids import new_token
from persist_pipeline.internal import paths, transitions
from persist_pipeline.internal.blobs import write_parts
from persist_pipeline.internal.state import Batch, HollowPart, State
from persist_pipeline.internal.trace import MergeRes
from persist_pipeline.read import fetch_batches
from persist_pipeline.sim import controls
from persist_pipeline.updates import consolidate
from tests.fixtures.location import Location
from tests.helpers import ForwardingConsensus, expected_snapshot, rows, state_history

Update = tuple[bytes, bytes, int, int]

#: Every write below goes to blob storage unless a test asks for inline writes.
NO_INLINE = InlinePolicy(0, 0)
INLINE_ON = InlinePolicy(4096, 1 << 20)

#: The paused writer's lease, and how long the pause lasts (below the retry deadline, so
#: the CaS loop keeps resolving instead of giving up with Indeterminate).
SHORT_LEASE_S = 10.0
PAUSE_S = 30.0
#: The orphan sweep's age in the commit-deadline tests: writes must commit within half.
ORPHAN_AGE_S = 10.0


# --- test doubles -------------------------------------------------------------------------


class ManualClock:
    """A clock that moves only when told to (``sleep`` moves it too, never blocking)."""

    def __init__(self) -> None:
        # Wall time starts at the real time: blob stores stamp objects with real time,
        # and GC's orphan sweep compares those stamps with this clock.
        self._ms = int(time.time() * 1000)
        self._mono = 1000.0

    def now_ms(self) -> int:
        return self._ms

    def monotonic(self) -> float:
        return self._mono

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self._ms += int(seconds * 1000)
        self._mono += seconds


class LoseNextReply(ForwardingConsensus):
    """Raw consensus whose next successful compare_and_set (or a transaction's
    compare_and_set_many), once armed, commits, runs a hook, and then reports
    ``ConsensusUnavailable`` (the reply was lost)."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.lost = 0
        self.lost_seqno: int | None = None
        self._hook: Callable[[], None] | None = None
        self._armed = False

    def arm(self, hook: Callable[[], None] | None = None) -> None:
        self._armed = True
        self._hook = hook

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        return self._maybe_lose(self.inner.compare_and_set(shard, expected, new), new.seqno)

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        return self._maybe_lose(self.inner.compare_and_set_many(writes), writes[0].new.seqno)

    def _maybe_lose(self, ok: bool, seqno: int) -> bool:
        if ok and self._armed:
            self._armed = False
            hook, self._hook = self._hook, None
            if hook is not None:
                hook()
            self.lost += 1
            self.lost_seqno = seqno
            raise ConsensusUnavailable("test: the commit landed but its reply was lost")
        return ok

    def close(self) -> None:
        self.inner.close()


@dataclass
class Clients:
    """Opens clients (each one a separate process's caches) on one location, all on one
    hand-advanced clock; closes them all at the end."""

    location: Location
    clock: ManualClock = field(default_factory=ManualClock)
    opened: list[PersistClient] = field(default_factory=list)

    def _open(self, consensus: Consensus, policy: InlinePolicy, **config: Any) -> PersistClient:
        cfg = PersistConfig(inline_policy=policy, heartbeat_interval_s=0,
                            background_maintenance=False, **config)
        wal = open_blob(self.location.wal_blob_uri) if self.location.wal_blob_uri else None
        client = PersistClient(consensus, open_blob(self.location.blob_uri), wal, cfg,
                               clock=self.clock)
        self.opened.append(client)
        return client

    def plain(self, policy: InlinePolicy = NO_INLINE, **config: Any) -> PersistClient:
        return self._open(open_consensus(self.location.consensus_uri), policy, **config)

    def lossy(self, policy: InlinePolicy = NO_INLINE,
              **config: Any) -> tuple[PersistClient, LoseNextReply]:
        lossy = LoseNextReply(open_consensus(self.location.consensus_uri))
        return self._open(lossy, policy, **config), lossy

    def snapshot(self, shard: ShardId, as_of: int) -> list[tuple[bytes, bytes, int]]:
        """What a fresh process (no cache of any kind) reads at ``as_of``."""
        reader = self.plain().open_reader(shard)
        try:
            return rows(reader.snapshot(as_of), as_of)
        finally:
            reader.expire()

    def close(self) -> None:
        for client in self.opened:
            client.close()


@pytest.fixture
def clients(location: Location) -> Iterator[Clients]:
    c = Clients(location)
    yield c
    c.close()


# --- helpers ------------------------------------------------------------------------------


def blob_exists(client: PersistClient, part: HollowPart) -> bool:
    return client.blobs.store(part.store).get(part.key) is not None


def batch_with(state: State, update: Update) -> Batch:
    """The one batch of ``state`` that covers ``update``'s time."""
    (batch,) = [b for b in state.batches.values()
                if b.desc.lower <= update[2] and (b.desc.upper is None
                                                  or update[2] < b.desc.upper)]
    return batch


def missing_blobs(client: PersistClient, shard: ShardId) -> list[tuple[int, str]]:
    """(seqno, key) of every blob a state version still in consensus references but that
    is gone from its store."""
    missing = []
    for state in state_history(client, str(shard)):
        for store, key in sorted(state.referenced_blobs()):
            if client.blobs.store(store).get(key) is None:
                missing.append((state.seqno, key))
    return missing


def missing_parts(client: PersistClient, shard: ShardId) -> list[tuple[int, str]]:
    """As :func:`missing_blobs`, for parts only: versions below a GC cut still list
    rollups GC removed and deleted, which nothing reads again."""
    return [(seqno, key) for seqno, key in missing_blobs(client, shard)
            if not paths.is_rollup_key(key)]


# --- negative answers confirmed: a stale cache gives a false negative ---------------------


FIRST: list[Update] = [(b"a", b"1", 0, 1), (b"b", b"1", 1, 1)]
SECOND: list[Update] = [(b"c", b"1", 2, 1)]


def _stale_writer(clients: Clients) -> tuple[ShardId, Any]:
    """Writer 2 caches upper 0; then writer 1 (another process) moves the upper 0 -> 2."""
    shard = ShardId.new()
    stale = clients.plain().open_writer(shard)
    assert stale.upper == 0
    clients.plain().open_writer(shard).compare_and_append(FIRST, 0, 2)
    return shard, stale


def test_stale_cache_compare_and_append_at_the_current_upper_succeeds(clients: Clients):
    """Negative answers confirmed: a writer whose cache says upper 0 gets no false
    UpperMismatch at upper 2."""
    shard, stale = _stale_writer(clients)
    result = stale.compare_and_append(SECOND, 2, 3)
    assert result.upper == 3 and result.num_updates == 1 and not result.already_committed
    assert clients.snapshot(shard, 2) == expected_snapshot(FIRST + SECOND, 2)


def test_stale_cache_append_after_the_current_upper_claims_no_gap(clients: Clients):
    """Negative answers confirmed: append(lower=2, upper=3) from a writer caching upper 0
    claims no gap."""
    shard, stale = _stale_writer(clients)
    result = stale.append(SECOND, 2, 3)
    assert result.upper == 3 and result.num_updates == 1
    assert clients.snapshot(shard, 2) == expected_snapshot(FIRST + SECOND, 2)


def test_control_trusting_the_cache_gives_a_false_upper_mismatch_forever(clients: Clients):
    """Negative answers confirmed control: with cached negatives trusted, the stale writer is
    refused."""
    shard, stale = _stale_writer(clients)
    with controls.trust_cached_negatives():
        for _ in range(2):  # forever: nothing makes the writer re-read the shard
            with pytest.raises(UpperMismatch) as info:
                stale.compare_and_append(SECOND, 2, 3)
            assert (info.value.expected, info.value.current) == (2, 0)
        with pytest.raises(UpperMismatch) as info:
            stale.append(SECOND, 2, 3)
        assert info.value.current == 0  # "a gap would open", though there is none
    assert clients.plain().open_writer(shard).fetch_recent_upper() == 2  # nothing written
    assert clients.snapshot(shard, 1) == expected_snapshot(FIRST, 1)


def _stale_critical_reader(clients: Clients) -> tuple[ShardId, Any]:
    """Client B's critical reader caches token o1; client A (same reader id) sets o2."""
    shard = ShardId.new()
    clients.plain().open_writer(shard).compare_and_append(FIRST, 0, 2)
    stale = clients.plain().open_critical_reader(shard, opaque=b"o1")
    current = clients.plain().open_critical_reader(shard, reader_id=stale.reader_id)
    assert current.opaque == b"o1"
    assert current.compare_and_downgrade_since(b"o1", b"o2", 1) == 1
    return shard, stale


def test_stale_critical_reader_passing_the_current_token_is_not_fenced(clients: Clients):
    """Negative answers confirmed: a critical reader with a stale cache gets no false FencedOut."""
    shard, stale = _stale_critical_reader(clients)
    assert stale.compare_and_downgrade_since(b"o2", b"o3", 2) == 2
    assert stale.opaque == b"o3"
    reader = clients.plain()._machine(shard).fetch_latest().critical_readers[stale.reader_id]
    assert (reader.opaque, reader.since) == (b"o3", 2)


def test_control_trusting_the_cache_fences_out_the_rightful_critical_reader(clients: Clients):
    """Negative answers confirmed control: with cached negatives trusted, the current token is
    refused."""
    shard, stale = _stale_critical_reader(clients)
    with controls.trust_cached_negatives(), pytest.raises(FencedOut) as info:
        stale.compare_and_downgrade_since(b"o2", b"o3", 2)
    assert (info.value.expected, info.value.current) == (b"o2", b"o1")
    reader = clients.plain()._machine(shard).fetch_latest().critical_readers[stale.reader_id]
    assert (reader.opaque, reader.since) == (b"o2", 1)


# --- lost reply after a lease expiry: lost reply + writer lease expired meanwhile ---------


BASE: list[Update] = [(b"base", b"1", 0, 1)]
LATE: list[Update] = [(b"late", b"1", 1, 1), (b"late2", b"1", 1, 1)]


@dataclass
class LostWrite:
    shard: ShardId
    writer: Any
    lossy: LoseNextReply
    gc: PersistClient
    expired_in_hook: list[bool] = field(default_factory=list)


def _lost_write_with_expired_lease(clients: Clients, policy: InlinePolicy, *,
                                   reader_hold: bool, lease_s: float = SHORT_LEASE_S,
                                   pause_s: float = PAUSE_S) -> LostWrite:
    """A writer (10 s lease) writes BASE; its next commit lands, then the process pauses
    30 s, GC in another process expires its lease (dropping its idempotency token), and
    only then is the reply lost. ``reader_hold``: a long-leased reader registered before
    the write keeps GC from truncating the record that tells the commit landed."""
    shard = ShardId.new()
    hold = clients.plain(reader_lease_duration_s=3600.0).open_reader(shard, create=True)
    if not reader_hold:
        hold.expire()
    client, lossy = clients.lossy(policy, reader_lease_duration_s=lease_s)
    writer = client.open_writer(shard)
    writer.compare_and_append(BASE, 0, 1)
    gc_client = clients.plain()
    lost = LostWrite(shard, writer, lossy, gc_client)

    def pause_then_gc() -> None:
        clients.clock.advance(pause_s)
        gc_client.gc(shard)
        latest = gc_client._machine(shard).fetch_latest()
        lost.expired_in_hook.append(writer.writer_id not in latest.writers)

    lossy.arm(pause_then_gc)
    return lost


@pytest.mark.parametrize("policy", [INLINE_ON, NO_INLINE], ids=["inline", "blob"])
def test_lost_reply_after_lease_expiry_reports_the_committed_write(clients: Clients,
                                                                    policy: InlinePolicy):
    """Lost reply after a lease expiry: a committed write whose reply was lost while GC expired
    its writer is a success, its parts stay, and every snapshot is right."""
    lost = _lost_write_with_expired_lease(clients, policy, reader_hold=True)
    result = lost.writer.compare_and_append(LATE, 1, 2)
    assert lost.lossy.lost == 1 and lost.expired_in_hook == [True]
    wal = clients.location.wal_blob_uri is not None
    expected_placement = "inline" if policy.threshold_bytes else ("wal" if wal else "blob")
    assert result.placement == expected_placement
    assert result.upper == 2 and result.num_updates == 2
    state = lost.gc._machine(lost.shard).fetch_latest()
    assert state.upper == 2
    batch = batch_with(state, LATE[0])
    assert batch.num_updates == 2
    assert all(blob_exists(lost.gc, p) for p in batch.hollow_parts())
    assert missing_blobs(lost.gc, lost.shard) == []
    assert clients.snapshot(lost.shard, 1) == expected_snapshot(BASE + LATE, 1)


@pytest.mark.parametrize("policy", [INLINE_ON, NO_INLINE], ids=["inline", "blob"])
def test_control_guessing_lost_replies_denies_a_committed_write(clients: Clients,
                                                                 policy: InlinePolicy):
    """Lost reply after a lease expiry control: a guessed-lost reply gives UpperMismatch for a
    committed write; a blob write also deletes its committed parts (snapshots raise
    CorruptPart)."""
    lost = _lost_write_with_expired_lease(clients, policy, reader_hold=True)
    with controls.guess_lost_replies(), pytest.raises(UpperMismatch) as info:
        lost.writer.compare_and_append(LATE, 1, 2)
    assert lost.lossy.lost == 1 and lost.expired_in_hook == [True]
    assert (info.value.expected, info.value.current) == (1, 2)  # "not written", yet it was
    state = lost.gc._machine(lost.shard).fetch_latest()
    assert batch_with(state, LATE[0]).num_updates == 2
    if policy.threshold_bytes:
        assert clients.snapshot(lost.shard, 1) == expected_snapshot(BASE + LATE, 1)
    else:
        assert missing_blobs(lost.gc, lost.shard) != []
        with pytest.raises(CorruptPart):
            clients.snapshot(lost.shard, 1)


@pytest.mark.parametrize("policy", [INLINE_ON, NO_INLINE], ids=["inline", "blob"])
def test_lost_reply_whose_record_gc_truncated_is_settled_by_the_batch_in_the_head(
        clients: Clients, policy: InlinePolicy):
    """GC expired the writer (and its token) and truncated the record of the commit, but
    the batch, whose id derives from the write's token, is in the head state: the write
    is reported committed, never Indeterminate, and its parts stay."""
    lost = _lost_write_with_expired_lease(clients, policy, reader_hold=False)
    result = lost.writer.compare_and_append(LATE, 1, 2)
    assert result.already_committed and result.upper == 2 and result.num_updates == 2
    assert lost.lossy.lost == 1 and lost.expired_in_hook == [True]
    # GC did truncate the record of the lost commit (that is what made it hard to tell).
    assert lost.lossy.lost_seqno is not None
    earliest = lost.gc.consensus.scan(str(lost.shard), 0, limit=1)[0].seqno
    assert earliest > lost.lossy.lost_seqno
    state = lost.gc._machine(lost.shard).fetch_latest()
    batch = batch_with(state, LATE[0])
    assert all(blob_exists(lost.gc, p) for p in batch.hollow_parts())
    assert missing_blobs(lost.gc, lost.shard) == []
    assert clients.snapshot(lost.shard, 1) == expected_snapshot(BASE + LATE, 1)


def _lost_write_then_merged(clients: Clients, *, truncate_merge: bool) -> LostWrite:
    """As :func:`_lost_write_with_expired_lease`, but before the reply is lost the batch
    is also compacted away (merged with BASE), so the head no longer holds it; GC then
    truncates up to a rollup taken before the merge (``truncate_merge=False``: the
    merge's record, which deletes the batch, stays) or after it (nothing kept names
    the batch)."""
    shard = ShardId.new()
    client, lossy = clients.lossy(NO_INLINE, reader_lease_duration_s=SHORT_LEASE_S)
    writer = client.open_writer(shard)
    writer.compare_and_append(BASE, 0, 1)
    gc_client = clients.plain()
    lost = LostWrite(shard, writer, lossy, gc_client)

    def pause_merge_gc() -> None:
        clients.clock.advance(PAUSE_S)
        machine = gc_client._machine(shard)
        if not truncate_merge:
            # A rollup after the lost commit, and a reader holding it: GC truncates the
            # commit's record but keeps the merge's.
            gc_client.open_reader(shard)
            machine.write_rollup(machine.fetch_latest())
        gc_client.compact(shard)
        gc_client.gc(shard)
        latest = machine.fetch_latest()
        lost.expired_in_hook.append(writer.writer_id not in latest.writers)

    lossy.arm(pause_merge_gc)
    return lost


def test_lost_reply_of_a_batch_compacted_away_is_settled_by_the_kept_merge_record(
        clients: Clients):
    lost = _lost_write_then_merged(clients, truncate_merge=False)
    result = lost.writer.compare_and_append(LATE, 1, 2)
    assert result.already_committed and lost.expired_in_hook == [True]
    assert lost.lossy.lost_seqno is not None  # the commit's own record is truncated
    earliest = lost.gc.consensus.scan(str(lost.shard), 0, limit=1)[0].seqno
    assert earliest > lost.lossy.lost_seqno
    state = lost.gc._machine(lost.shard).fetch_latest()
    assert len(state.batches) == 1  # BASE and LATE merged: the head does not name it
    assert missing_parts(lost.gc, lost.shard) == []
    assert clients.snapshot(lost.shard, 1) == expected_snapshot(BASE + LATE, 1)


def test_lost_reply_that_no_kept_history_can_settle_is_indeterminate_and_keeps_parts(
        clients: Clients):
    """Compacted away and every record naming it truncated: only then Indeterminate,
    never a negative answer, and nothing is deleted."""
    lost = _lost_write_then_merged(clients, truncate_merge=True)
    with pytest.raises(Indeterminate):
        lost.writer.compare_and_append(LATE, 1, 2)
    assert lost.expired_in_hook == [True]
    assert missing_parts(lost.gc, lost.shard) == []
    assert clients.snapshot(lost.shard, 1) == expected_snapshot(BASE + LATE, 1)


def test_control_guessing_a_truncated_lost_reply_deletes_committed_parts(clients: Clients):
    """Lost reply after a lease expiry control (record truncated): the guess gives
    UpperMismatch and deletes the parts of the committed batch."""
    lost = _lost_write_with_expired_lease(clients, NO_INLINE, reader_hold=False)
    with controls.guess_lost_replies(), pytest.raises(UpperMismatch):
        lost.writer.compare_and_append(LATE, 1, 2)
    state = lost.gc._machine(lost.shard).fetch_latest()
    assert not any(blob_exists(lost.gc, p) for p in batch_with(state, LATE[0]).hollow_parts())
    with pytest.raises(CorruptPart):
        clients.snapshot(lost.shard, 1)


@pytest.mark.parametrize("policy", [INLINE_ON, NO_INLINE], ids=["inline", "blob"])
def test_token_retry_of_a_write_committed_before_its_lease_expired_is_not_denied(
        clients: Clients, policy: InlinePolicy):
    """Guarantee 9 with the default lease (longer than the retry deadline): retrying with
    its idempotency token a write that committed is never reported as not written."""
    lost = _lost_write_with_expired_lease(clients, policy, reader_hold=True,
                                          lease_s=READER_LEASE_DURATION_S,
                                          pause_s=READER_LEASE_DURATION_S + 100)
    assert READER_LEASE_DURATION_S + 100 > RETRY_DEADLINE_S
    token = new_token()
    # Indeterminate is allowed: the caller then retries with the token, as documented.
    with contextlib.suppress(Indeterminate):
        lost.writer.compare_and_append(LATE, 1, 2, idempotency_token=token)
    assert lost.lossy.lost == 1 and lost.expired_in_hook == [True]
    try:
        retry = lost.writer.compare_and_append(LATE, 1, 2, idempotency_token=token)
    except UpperMismatch as e:
        pytest.fail(f"the retry of a committed write (same idempotency token) was told it was "
                    f"not written: {e}")
    except Indeterminate:
        retry = None  # honest, if unhelpful: never a false "not written"
    if retry is not None:
        assert retry.already_committed and retry.upper == 2
    state = lost.gc._machine(lost.shard).fetch_latest()
    assert all(blob_exists(lost.gc, p) for p in batch_with(state, LATE[0]).hollow_parts())
    assert clients.snapshot(lost.shard, 1) == expected_snapshot(BASE + LATE, 1)


@pytest.mark.parametrize("late", [False, True], ids=["in-time", "past-deadline"])
def test_parts_retry_of_a_write_compacted_away_keeps_its_parts(clients: Clients,
                                                               late: bool):
    """``compare_and_append_parts`` retried with its token and the same parts (the
    documented recovery after Indeterminate) once compaction merged the committed batch
    away, through a fresh writer as a Spark driver commits: reported committed, as
    ``compare_and_append``'s retry is, never "nothing was written"; and the parts, which
    the versions kept from before the merge still reference, are not deleted."""
    client = clients.plain(gc_orphan_min_age_s=ORPHAN_AGE_S)
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append(BASE, 0, 1)
    token = new_token()
    started_s = client.clock.monotonic()
    table = consolidate(pa.table({"k": [u[0] for u in LATE], "v": [u[1] for u in LATE],
                                  "t": [u[2] for u in LATE], "d": [u[3] for u in LATE]}))
    parts = write_parts(table, str(shard), batch_id_of(token), client.blobs.main, "main",
                        client.config.blob_target_size_bytes)

    def commit() -> Any:
        return client.open_writer(shard).compare_and_append_parts(
            parts, len(LATE), 1, 2, idempotency_token=token, upload_started_s=started_s,
            schema=None)

    commit()  # ...whose reply its process never saw
    client.compact(shard)
    assert len(client._machine(shard).fetch_latest().batches) == 1
    if late:
        clients.clock.advance(ORPHAN_AGE_S)
    retry = commit()
    assert retry.already_committed and retry.upper == 2
    assert all(blob_exists(client, p) for p in parts)
    assert missing_parts(client, shard) == []
    assert clients.snapshot(shard, 1) == expected_snapshot(BASE + LATE, 1)


def test_parts_retry_refused_as_bad_input_deletes_nothing(clients: Clients):
    """``compare_and_append_parts`` committed, its reply never seen; a retry with its
    token and parts but bounds at the shard's current upper (a caller that read the
    upper before retrying) is bad input: refused, and it changes nothing. The parts are
    the committed batch's: deleting them loses the acknowledged data. Parts under
    another batch's folder (a wrong token) are not this call's to delete either."""
    client = clients.plain()
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append(BASE, 0, 1)
    token = new_token()
    table = consolidate(pa.table({"k": [u[0] for u in LATE], "v": [u[1] for u in LATE],
                                  "t": [u[2] for u in LATE], "d": [u[3] for u in LATE]}))
    parts = write_parts(table, str(shard), batch_id_of(token), client.blobs.main, "main",
                        client.config.blob_target_size_bytes)

    def commit(expected: int, upper: int, with_token: str) -> Any:
        return client.open_writer(shard).compare_and_append_parts(
            parts, len(LATE), expected, upper, idempotency_token=with_token,
            upload_started_s=client.clock.monotonic(), schema=None)

    commit(1, 2, token)  # ...whose reply its process never saw
    with pytest.raises(InvalidUpdates):
        commit(2, 3, token)  # its times (1) lie below the upper it now gives
    with pytest.raises(InvalidUpdates):
        commit(2, 3, new_token())  # parts of another batch
    assert all(blob_exists(client, p) for p in parts)
    assert missing_parts(client, shard) == []
    assert clients.snapshot(shard, 1) == expected_snapshot(BASE + LATE, 1)


def _pause_every_upload(clients: Clients, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on each write's upload ends past half the orphan age after its start
    (past its commit deadline), as a process paused while uploading."""
    from persist_pipeline import write

    real = write.write_parts

    def paused_upload(*args: Any, **kwargs: Any) -> Any:
        parts = real(*args, **kwargs)
        clients.clock.advance(ORPHAN_AGE_S)
        return parts

    monkeypatch.setattr(write, "write_parts", paused_upload)


def test_token_retry_past_its_deadline_of_a_write_compacted_away_is_reported_committed(
        clients: Clients, monkeypatch: pytest.MonkeyPatch):
    """A write committed with a token its process never saw answered; compaction merges
    its batch away. A retry with the token (a restarted process: a fresh writer) pauses
    past its own commit deadline while uploading: its transition then sees only that
    deadline, and history must settle it (committed), never CommitDeadlineExceeded
    ("nothing was written")."""
    client = clients.plain(gc_orphan_min_age_s=ORPHAN_AGE_S)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append(BASE, 0, 1)
    token = new_token()
    writer.compare_and_append(LATE, 1, 2, idempotency_token=token)  # reply never seen
    client.compact(shard)
    assert len(client._machine(shard).fetch_latest().batches) == 1
    _pause_every_upload(clients, monkeypatch)
    retry = client.open_writer(shard).compare_and_append(LATE, 1, 2, idempotency_token=token)
    assert retry.already_committed and retry.upper == 2
    assert clients.snapshot(shard, 1) == expected_snapshot(BASE + LATE, 1)


def test_transaction_retry_past_its_deadline_of_batches_compacted_away_is_committed(
        clients: Clients, monkeypatch: pytest.MonkeyPatch):
    """The transaction twin of the test above: a transaction with tokens committed (its
    process never saw the reply) and compaction merged both shards' batches away. Its
    retry (the same tokens, fresh writers) pauses past its commit deadline while
    uploading, so each append's transition sees only that deadline: history must settle
    it committed, never CommitDeadlineExceeded ("no shard changed")."""
    client = clients.plain(gc_orphan_min_age_s=ORPHAN_AGE_S)
    a, b = ShardId.new(), ShardId.new()
    for shard in (a, b):
        client.open_writer(shard).compare_and_append(BASE, 0, 1)

    def commit() -> Any:
        txn = client.transaction()
        txn.compare_and_append(a, LATE, 1, 2, idempotency_token="txn-a")
        txn.compare_and_append(b, LATE, 1, 2, idempotency_token="txn-b")
        return txn.commit()

    commit()  # ...whose reply its process never saw
    for shard in (a, b):
        client.compact(shard)
        assert len(client._machine(shard).fetch_latest().batches) == 1
    _pause_every_upload(clients, monkeypatch)
    retry = commit()
    assert all(retry[str(s)].already_committed and retry[str(s)].upper == 2
               for s in (a, b))
    for shard in (a, b):
        assert clients.snapshot(shard, 1) == expected_snapshot(BASE + LATE, 1)


class _FailsBeforeRunning(ForwardingConsensus):
    """Raw consensus whose next compare_and_set, once armed, fails without running (the
    connection dropped before the statement reached the database)."""

    armed = False

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        if self.armed:
            self.armed = False
            raise ConsensusUnavailable("test: the statement never ran")
        return self.inner.compare_and_set(shard, expected, new)

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        if self.armed:
            self.armed = False
            raise ConsensusUnavailable("test: the statement never ran")
        return self.inner.compare_and_set_many(writes)


class _HookedClock(ManualClock):
    """A :class:`ManualClock` that runs a hook at its next sleep (a retry's back-off)."""

    hook: Callable[[], None] | None = None

    def sleep(self, seconds: float) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        super().sleep(seconds)


def _client_whose_next_cas_can_fail(location: Location
                                    ) -> tuple[_HookedClock, _FailsBeforeRunning, PersistClient]:
    """A client on ``location`` whose next compare-and-set fails without running once
    armed, and whose clock runs a hook at its next back-off."""
    clock = _HookedClock()
    failing = _FailsBeforeRunning(open_consensus(location.consensus_uri))
    config = PersistConfig(inline_policy=NO_INLINE, heartbeat_interval_s=0,
                           background_maintenance=False, group_commit=False)
    wal = open_blob(location.wal_blob_uri) if location.wal_blob_uri else None
    client = PersistClient(failing, open_blob(location.blob_uri), wal, config, clock=clock)
    return clock, failing, client


def test_a_failed_commit_beaten_during_its_back_off_is_an_upper_mismatch(location: Location):
    """A compare-and-set fails with no reply (it never ran); nothing is at the next seqno
    yet, so the loop backs off; meanwhile another writer takes that seqno. The attempt
    has certainly lost (the seqno holds another commit), so the answer is the confirmed
    UpperMismatch, not Indeterminate as if it might still land."""
    clock, failing, client = _client_whose_next_cas_can_fail(location)
    other = location.client(NO_INLINE)
    try:
        shard = ShardId.new()
        rival = other.open_writer(shard)
        writer = client.open_writer(shard)
        failing.armed = True
        clock.hook = lambda: rival.compare_and_append(BASE, 0, 1)
        with pytest.raises(UpperMismatch) as info:
            writer.compare_and_append([(b"mine", b"1", 0, 1)], 0, 1)
        assert info.value.current == 1
        assert clock.hook is None  # the rival wrote during the back-off
        assert rows(other.open_reader(shard).snapshot(0), 0) == [(b"base", b"1", 1)]
    finally:
        client.close()
        other.close()


def test_a_failed_transaction_beaten_on_its_second_shard_is_an_upper_mismatch(
        location: Location):
    """The transaction twin of the test above: its one statement fails with no reply
    (it never ran), and during the back-off another writer takes the next seqno of the
    transaction's second shard only, so nothing is at the first shard's next seqno. The
    statement needed both heads: it has certainly lost, and the answer is the confirmed
    UpperMismatch naming that shard, not Indeterminate."""
    clock, failing, client = _client_whose_next_cas_can_fail(location)
    other = location.client(NO_INLINE)
    try:
        first, second = ShardId.new(), ShardId.new()
        rival = other.open_writer(second)
        writers = [client.open_writer(s) for s in (first, second)]
        txn = client.transaction()
        for writer in writers:
            txn.compare_and_append(writer, [(b"mine", b"1", 0, 1)], 0, 1)
        failing.armed = True
        clock.hook = lambda: rival.compare_and_append(BASE, 0, 1)
        with pytest.raises(UpperMismatch) as info:
            txn.commit()
        assert info.value.shard == str(second) and info.value.current == 1
        assert clock.hook is None  # the rival wrote during the back-off
        assert other._machine(first).fetch_latest().upper == 0
    finally:
        client.close()
        other.close()


# --- idempotency before the commit deadline -----------------------------------------------


def _lost_write_past_commit_deadline(clients: Clients) -> tuple[ShardId, Any, LoseNextReply]:
    """A blob write commits, then time passes beyond its commit deadline (half the orphan
    sweep's age after its parts were uploaded) before the reply is lost."""
    shard = ShardId.new()
    client, lossy = clients.lossy(gc_orphan_min_age_s=ORPHAN_AGE_S)
    writer = client.open_writer(shard)
    writer.compare_and_append(BASE, 0, 1)
    lossy.arm(lambda: clients.clock.advance(ORPHAN_AGE_S / 2 + 1))
    return shard, writer, lossy


def test_lost_reply_past_the_commit_deadline_reports_success_and_keeps_parts(
        clients: Clients):
    """Idempotency before the commit deadline: a retry past the commit deadline of a write that
    committed is a success, not CommitDeadlineExceeded, and the committed parts stay."""
    shard, writer, lossy = _lost_write_past_commit_deadline(clients)
    started_s = clients.clock.monotonic()
    result = writer.compare_and_append(LATE, 1, 2)
    assert lossy.lost == 1
    assert clients.clock.monotonic() > started_s + ORPHAN_AGE_S / 2  # the deadline passed
    assert result.upper == 2 and result.num_updates == 2 and result.num_parts >= 1
    reader_client = clients.plain()
    batch = batch_with(reader_client._machine(shard).fetch_latest(), LATE[0])
    assert all(blob_exists(reader_client, p) for p in batch.hollow_parts())
    assert clients.snapshot(shard, 1) == expected_snapshot(BASE + LATE, 1)


def test_control_deadline_before_token_reports_a_committed_write_as_failed(clients: Clients):
    """Idempotency before the commit deadline control: checked first, the deadline denies the
    committed write and its parts are deleted (snapshots raise CorruptPart)."""
    shard, writer, lossy = _lost_write_past_commit_deadline(clients)
    with controls.deadline_before_token(), pytest.raises(CommitDeadlineExceeded):
        writer.compare_and_append(LATE, 1, 2)
    assert lossy.lost == 1
    reader_client = clients.plain()
    batch = batch_with(reader_client._machine(shard).fetch_latest(), LATE[0])
    assert not any(blob_exists(reader_client, p) for p in batch.hollow_parts())
    with pytest.raises(CorruptPart):
        clients.snapshot(shard, 1)


# --- a lost merge reply: lost reply on a merge result -------------------------------------


X: list[Update] = [(b"x", b"1", 0, 1)]
Y: list[Update] = [(b"y", b"1", 1, 1), (b"x", b"1", 1, -1)]
# Four updates: Z's Spine level (2) reaches that of O's entry, so the two form a merge.
Z: list[Update] = [(b"z%d" % i, b"1", 2, 1) for i in range(4)]


@dataclass
class LostMerge:
    shard: ShardId
    machine: Any
    res: MergeRes
    started_s: float
    lossy: LoseNextReply
    observer: PersistClient
    mid_read: list[State] = field(default_factory=list)


def _lost_merge_reply(clients: Clients) -> LostMerge:
    """Compactor A merges X and Y into O; O commits, and before A hears back a writer
    appends Z, a reader starts reading the version holding O, and compactor B (another
    process) merges O with Z."""
    shard = ShardId.new()
    writer = clients.plain().open_writer(shard)
    writer.compare_and_append(X, 0, 1)
    writer.compare_and_append(Y, 1, 2)
    compactor_a, lossy = clients.lossy()
    machine = compactor_a._machine(shard)
    (req,) = merge_requests(machine.fetch_latest())
    assert len(req.inputs) == 2
    started_s = clients.clock.monotonic()
    res = run_merge(req, str(shard), compactor_a.blobs.main, compactor_a.blobs.wal,
                    compactor_a.config.blob_target_size_bytes)
    observer = clients.plain()
    lost = LostMerge(shard, machine, res, started_s, lossy, observer)
    reader_client, compactor_b = clients.plain(), clients.plain()

    def meanwhile() -> None:
        # A reader fetches the state that holds O (a snapshot in progress).
        lost.mid_read.append(reader_client._machine(shard).fetch_latest())
        writer.compare_and_append(Z, 2, 3)
        metrics = compactor_b.compact(shard)
        assert metrics["applied"] == 1, metrics

    lossy.arm(meanwhile)
    return lost


def _check_merge_scenario_ran(lost: LostMerge) -> State:
    assert lost.lossy.lost == 1
    (old,) = lost.mid_read
    assert lost.res.output.id in old.batches  # the reader was reading A's output
    latest = lost.observer._machine(lost.shard).fetch_latest()
    assert lost.res.output.id not in latest.batches  # B replaced it
    assert latest.upper == 3 and len(latest.batches) == 1
    return old


def test_lost_merge_reply_is_applied_and_keeps_outputs_a_reader_may_read(clients: Clients):
    """A lost merge reply: a merge result whose reply was lost while another compactor merged its
    output is "applied", and its outputs stay for readers of older versions."""
    lost = _lost_merge_reply(clients)
    outcome = apply_merge_result(lost.machine, lost.res, lost.started_s)
    assert outcome in ("applied", "already_applied")
    old = _check_merge_scenario_ran(lost)
    assert all(blob_exists(lost.observer, p) for p in lost.res.output.hollow_parts())
    # The reader that started on the version holding O finishes its snapshot.
    table = fetch_batches(lost.observer._machine(lost.shard), list(old.ordered_batches), "test")
    assert rows(consolidate(table, as_of=1), 1) == expected_snapshot(X + Y, 1)
    assert missing_blobs(lost.observer, lost.shard) == []
    assert clients.snapshot(lost.shard, 2) == expected_snapshot(X + Y + Z, 2)


def test_control_guessing_a_lost_merge_reply_deletes_outputs_still_referenced(
        clients: Clients):
    """A lost merge reply control: guessed lost, the merge is "no_match" and its outputs are
    deleted though live versions reference them (a reader in progress fails)."""
    lost = _lost_merge_reply(clients)
    with controls.guess_lost_replies():
        outcome = apply_merge_result(lost.machine, lost.res, lost.started_s)
    assert outcome == "no_match"
    old = _check_merge_scenario_ran(lost)
    assert not any(blob_exists(lost.observer, p) for p in lost.res.output.hollow_parts())
    with pytest.raises(CorruptPart):
        fetch_batches(lost.observer._machine(lost.shard), list(old.ordered_batches), "test")
    assert missing_blobs(lost.observer, lost.shard) != []


# --- a critical reader's own downgrade whose reply was lost -------------------------------


def _lost_downgrade(clients: Clients) -> tuple[ShardId, Any, LoseNextReply]:
    shard = ShardId.new()
    writer = clients.plain().open_writer(shard)
    writer.compare_and_append(FIRST, 0, 2)
    client, lossy = clients.lossy()
    reader = client.open_critical_reader(shard, opaque=b"o1")
    # Another process moves the head on before the reply is lost.
    lossy.arm(lambda: writer.compare_and_append(SECOND, 2, 3))
    return shard, reader, lossy


def test_critical_reader_lost_downgrade_reply_is_not_fenced_out(clients: Clients):
    """Lost reply: a critical reader's own committed downgrade is not reported FencedOut."""
    shard, reader, lossy = _lost_downgrade(clients)
    assert reader.compare_and_downgrade_since(b"o1", b"o2", 1) == 1
    assert lossy.lost == 1
    assert (reader.opaque, reader.since) == (b"o2", 1)
    held = clients.plain()._machine(shard).fetch_latest().critical_readers[reader.reader_id]
    assert (held.opaque, held.since) == (b"o2", 1)


def test_control_guessing_a_lost_downgrade_reply_fences_out_its_own_reader(clients: Clients):
    """Lost reply control: guessed lost, the reader's own new token fences it out."""
    shard, reader, lossy = _lost_downgrade(clients)
    with controls.guess_lost_replies(), pytest.raises(FencedOut) as info:
        reader.compare_and_downgrade_since(b"o1", b"o2", 1)
    assert lossy.lost == 1
    assert (info.value.expected, info.value.current) == (b"o1", b"o2")
    held = clients.plain()._machine(shard).fetch_latest().critical_readers[reader.reader_id]
    assert (held.opaque, held.since) == (b"o2", 1)  # it did commit


# --- merge validation ---------------------------------------------------------------------


def _merge_fixture(clients: Clients, *, since: int) -> tuple[ShardId, PersistClient, Any]:
    """A shard with one pending merge of two batches whose desc.since is ``since``."""
    shard = ShardId.new()
    client = clients.plain()
    writer = client.open_writer(shard)
    if since:
        writer.compare_and_append([(b"w", b"0", 0, 1)], 0, since)
        reader = client.open_reader(shard)
        reader.downgrade_since(since)
        writer.fetch_recent_upper()
    writer.compare_and_append([(b"p", b"1", since, 1)], since, since + 1)
    writer.compare_and_append([(b"q", b"1", since + 1, 1)], since + 1, since + 2)
    # The merge of the last two batches (with a WAL store, the first batch alone is
    # work too: compaction moves its part to the main store).
    reqs = [r for r in merge_requests(client._machine(shard).fetch_latest())
            if len(r.inputs) == 2]
    assert len(reqs) == 1
    (req,) = reqs
    assert max(b.desc.since for b in req.inputs) == since
    return shard, client, req


def _extra_update_result(client: PersistClient, shard: ShardId, req: Any) -> MergeRes:
    """A "merge" of ``req`` whose output holds one update more than its inputs."""
    blobs = client.blobs
    inputs = [blobs.fetch_part(p, "test") for b in req.inputs for p in b.parts]
    extra = pa.table({"k": [b"ghost"], "v": [b"1"], "t": [req.desc.lower], "d": [1]},
                     schema=inputs[0].schema)
    merged = consolidate(pa.concat_tables([*inputs, extra]), since=req.desc.since)
    parts = write_parts(merged, str(shard), "bbogus", blobs.main, "main", 1 << 20)
    assert merged.num_rows > req.num_updates
    return MergeRes(req.input_ids, Batch("bbogus", req.desc, parts, merged.num_rows))


def _since_behind_result(client: PersistClient, shard: ShardId, req: Any) -> MergeRes:
    """A merge of ``req`` whose output claims a since behind its inputs' since."""
    res = run_merge(req, str(shard), client.blobs.main, client.blobs.wal, 1 << 20)
    output = replace(res.output, desc=replace(res.output.desc, since=req.desc.since - 1))
    return MergeRes(res.input_ids, output)


MERGE_CASES = {
    "more-updates": (0, _extra_update_result),
    "since-behind": (1, _since_behind_result),
}


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_invalid_merge_result_is_refused_deleted_and_changes_nothing(clients: Clients,
                                                                    case: str):
    """Merge validation: a result with more updates than its inputs, or a since behind
    theirs, raises InvalidInput; its outputs are deleted and the shard is unchanged."""
    since, make_result = MERGE_CASES[case]
    shard, client, req = _merge_fixture(clients, since=since)
    res = make_result(client, shard, req)
    assert all(blob_exists(client, p) for p in res.output.hollow_parts())
    machine = client._machine(shard)
    before = machine.fetch_latest()
    as_of = since + 1
    snapshot_before = clients.snapshot(shard, as_of)
    with pytest.raises(InvalidInput):
        transitions.apply_merge(before, res, clients.clock.now_ms())
    with pytest.raises(InvalidInput):
        apply_merge_result(machine, res, clients.clock.monotonic())
    assert not any(blob_exists(client, p) for p in res.output.hollow_parts())
    after = clients.plain()._machine(shard).fetch_latest()
    assert after.batches == before.batches and after.since == before.since
    assert all(blob_exists(client, p) for b in after.batches.values() for p in b.hollow_parts())
    assert clients.snapshot(shard, as_of) == snapshot_before


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_control_unvalidated_merge_result_is_committed(clients: Clients, case: str,
                                                       monkeypatch: pytest.MonkeyPatch):
    """Merge validation control: without the check the bad result replaces its inputs
    (with the extra update, the collection itself changes)."""
    since, make_result = MERGE_CASES[case]
    shard, client, req = _merge_fixture(clients, since=since)
    res = make_result(client, shard, req)
    as_of = since + 1
    snapshot_before = clients.snapshot(shard, as_of)
    monkeypatch.setattr(transitions, "_check_merge_result", lambda res, inputs: None)
    assert apply_merge_result(client._machine(shard), res, clients.clock.monotonic()) == "applied"
    monkeypatch.undo()
    assert res.output.id in clients.plain()._machine(shard).fetch_latest().batches
    if case == "more-updates":
        assert clients.snapshot(shard, as_of) != snapshot_before


class _DownAfterLostReply(ForwardingConsensus):
    """Consensus whose next compare-and-set commits and loses its reply, after which
    every call fails as unavailable until ``up()``: the writer cannot settle the lost
    reply before its retry deadline."""

    def __init__(self, inner: Consensus) -> None:
        super().__init__(inner)
        self.armed = False
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConsensusUnavailable("test: consensus is down")

    def head(self, shard: str) -> VersionedData | None:
        self._check()
        return self.inner.head(shard)

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        self._check()
        return self.inner.scan(shard, from_seqno, limit)

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        self._check()
        ok = self.inner.compare_and_set(shard, expected, new)
        if ok and self.armed:
            self.armed, self.down = False, True
            raise ConsensusUnavailable("test: the commit landed but its reply was lost")
        return ok

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        self._check()
        ok = self.inner.compare_and_set_many(writes)
        if ok and self.armed:
            self.armed, self.down = False, True
            raise ConsensusUnavailable("test: the commit landed but its reply was lost")
        return ok

    def up(self) -> None:
        self.down = False


def test_an_indeterminate_write_that_landed_keeps_its_parts(durable_location: Location):
    """Guarantee 9: the commit landed, its reply was lost and consensus stayed down past
    the retry deadline, so the write is Indeterminate; it must not delete its parts (GC
    decides), since the state now references them."""
    flaky = _DownAfterLostReply(open_consensus(durable_location.consensus_uri))
    cfg = PersistConfig(inline_policy=NO_INLINE, retry_deadline_s=0.5)
    client = PersistClient(flaky, open_blob(durable_location.blob_uri), None, cfg)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append(BASE, 0, 1)
    flaky.armed = True
    with pytest.raises(Indeterminate):
        writer.compare_and_append(LATE, 1, 2)
    flaky.up()
    reader = durable_location.client(NO_INLINE)
    state = reader._machine(str(shard)).fetch_latest()
    assert state.upper == 2, "the write landed"
    assert missing_parts(reader, shard) == []
    assert rows(reader.open_reader(shard).snapshot(1), 1) == expected_snapshot(BASE + LATE, 1)
    client.close()
    reader.close()
