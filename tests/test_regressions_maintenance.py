"""Regression tests for the maintenance the merge commit deadline-9: compaction deadlines,
overlapping GCs, the reader hold race, listen holds, and opening/reading while GC runs.

Every race is set up deterministically: hooks in wrappers of the raw backends (or of a
machine's ``fetch_latest``) run the competing operation at the exact point wanted,
threads are ordered with events, and a hand-advanced clock expires leases and passes
deadlines without sleeping. Where a negative control of :mod:`persist_pipeline.sim.controls`
puts a defect back, the same scenario is run under it to show the test catches it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline import updates as updates_module
from persist_pipeline.blob import open_blob
from persist_pipeline.blob.base import Blob, BlobMeta
from persist_pipeline.compaction import apply_merge_result, merge_requests, run_merge
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import Consensus, VersionedData
from persist_pipeline.exceptions import (
    CorruptData,
    CorruptPart,
    CorruptState,
    LeaseExpired,
    ResourceExhausted,
    SinceViolation,
)
from persist_pipeline.frontier import MAX_TIME
from persist_pipeline.internal.clock import SYSTEM_CLOCK, Clock
from persist_pipeline.internal.state import State
from persist_pipeline.read import Listen, ListenEvent, ReadHandle
from persist_pipeline.sim import controls
from tests.fixtures.location import Location, location_kinds, make_location
from tests.helpers import (
    WAIT_S,
    ForwardingConsensus,
    HandClock,
    StoreOnClock,
    client_on_clock,
    expected_snapshot,
    rows,
    state_history,
)

BLOB_ONLY = InlinePolicy(0, 0)
Update = tuple[bytes, bytes, int, int]


# --- helpers: hooked backends, clients ----------------------------------------------------


Hook = Callable[..., None]


class HookedConsensus(ForwardingConsensus):
    """A raw consensus whose calls run ``before[op](*args)`` / ``after[op](*args)``."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.before: dict[str, Hook] = {}
        self.after: dict[str, Hook] = {}

    def _call(self, op: str, args: tuple[Any, ...], run: Callable[[], Any]) -> Any:
        if op in self.before:
            self.before[op](*args)
        result = run()
        if op in self.after:
            self.after[op](*args)
        return result

    def head(self, shard: str) -> VersionedData | None:
        return self._call("head", (shard,), lambda: self.inner.head(shard))

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        return self._call("compare_and_set", (shard, expected, new),
                          lambda: self.inner.compare_and_set(shard, expected, new))

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        return self._call("scan", (shard, from_seqno, limit),
                          lambda: self.inner.scan(shard, from_seqno, limit))

    def truncate(self, shard: str, seqno: int) -> int:
        return self._call("truncate", (shard, seqno), lambda: self.inner.truncate(shard, seqno))

    def close(self) -> None:
        self.inner.close()


class HookedBlob(Blob):
    """A raw blob store whose calls run ``before[op](*args)`` first."""

    def __init__(self, inner: Blob) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.stamp_resolution_s = inner.stamp_resolution_s
        self.before: dict[str, Hook] = {}

    def _hook(self, op: str, *args: Any) -> None:
        if op in self.before:
            self.before[op](*args)

    def get(self, key: str) -> bytes | None:
        self._hook("get", key)
        return self.inner.get(key)

    def set(self, key: str, value: bytes) -> None:
        self._hook("set", key)
        self.inner.set(key, value)

    def delete(self, key: str) -> int | None:
        self._hook("delete", key)
        return self.inner.delete(key)

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        self._hook("list_keys", prefix)
        return self.inner.list_keys(prefix)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()


class Once:
    """A hook that runs ``action`` the first time ``match(*args)`` holds, then never."""

    def __init__(self, match: Callable[..., bool], action: Callable[[], None]) -> None:
        self.match = match
        self.action = action
        self.fired = False
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> None:
        with self._lock:
            if self.fired or not self.match(*args):
                return
            self.fired = True
        self.action()


class Killed(BaseException):
    """The process running a GC "dies" (not a PersistError, so nothing catches it)."""


class WatchedLock:
    """A mutex that calls ``on_contended`` when a thread has to wait for it."""

    def __init__(self, on_contended: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._on_contended = on_contended
        self.contentions = 0

    def __enter__(self) -> WatchedLock:
        if not self._lock.acquire(blocking=False):
            self.contentions += 1
            self._on_contended()
            self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@dataclass
class Node:
    """A client on a location plus the hooked raw backends under it."""

    client: PersistClient
    consensus: HookedConsensus
    blob: HookedBlob


@dataclass
class Nodes:
    """Makes clients on a location (every raw backend hooked); closes them all after."""

    made: list[PersistClient] = field(default_factory=list)

    def __call__(self, loc: Location, config: PersistConfig | None = None, *,
                 policy: InlinePolicy | None = None, clock: Clock = SYSTEM_CLOCK) -> Node:
        cfg = config or PersistConfig(heartbeat_interval_s=0)
        if policy is not None:
            cfg = replace(cfg, inline_policy=policy)
        consensus = HookedConsensus(open_consensus(loc.consensus_uri))
        blob = HookedBlob(open_blob(loc.blob_uri))
        wal = open_blob(loc.wal_blob_uri) if loc.wal_blob_uri else None
        if isinstance(clock, HandClock):  # the stores' time passes with the test's too
            store_blob: Blob = StoreOnClock(blob, clock)
            wal = StoreOnClock(wal, clock) if wal is not None else None
        else:
            store_blob = blob
        client = PersistClient(consensus, store_blob, wal, cfg, clock)
        self.made.append(client)
        return Node(client, consensus, blob)


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    made = Nodes()
    yield made
    for client in made.made:
        with contextlib.suppress(Exception):
            client.close()


@pytest.fixture(params=location_kinds("pg-s3"))
def real_location(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """PostgreSQL consensus + the loopback S3 store: for the GC and reader races."""
    return make_location(request.param, request, tmp_path)


def write_batches(client: PersistClient, shard: str, times: Iterable[int],
                  rows_per_batch: int = 1) -> list[Update]:
    """One compare_and_append per time ``t`` (upper t -> t+1); returns what was written."""
    writer = client.open_writer(shard)
    written: list[Update] = []
    for t in times:
        batch = [(b"k%d-%d" % (t, i), b"v%d" % t, t, 1) for i in range(rows_per_batch)]
        if t % 3 == 2:  # some retractions, so consolidation has work to do
            batch.append((b"k%d-0" % (t - 1), b"v%d" % (t - 1), t, -1))
        writer.compare_and_append(batch, t, t + 1)
        written += batch
    writer.expire()
    return written


def assert_history_intact(client: PersistClient, shard: str) -> list[State]:
    """Every state version still in consensus rebuilds, and no batch of any of them
    references a blob that is gone; the head's latest rollup exists."""
    versions = list(state_history(client, shard))
    assert versions, "no state versions in consensus"
    present: dict[tuple[str, str], bool] = {}
    for state in versions:
        for batch in state.batches.values():
            for part in batch.hollow_parts():
                ref = (part.store, part.key)
                if ref not in present:
                    present[ref] = client.blobs.store(part.store).get(part.key) is not None
                assert present[ref], (f"state seqno {state.seqno} references blob {ref}, "
                                      f"which is gone")
    latest = versions[-1].latest_rollup()
    if latest is not None:
        assert client.blobs.main.get(latest.key) is not None, "the head's rollup is gone"
    return versions


def fresh_snapshot(loc: Location, shard: str, as_of: int) -> list[tuple[bytes, bytes, int]]:
    """What a brand-new client reads at ``as_of``."""
    client = loc.client(config=PersistConfig(heartbeat_interval_s=0))
    try:
        reader = client.open_reader(shard)
        out = rows(reader.snapshot(as_of), as_of)
        reader.expire()
        return out
    finally:
        client.close()


# --- the merge commit deadline: compaction output had no commit deadline ------------------


ORPHAN_CFG = PersistConfig(gc_orphan_min_age_s=10, heartbeat_interval_s=0, blob_cache_bytes=0)


def _pending_merges(node: Node, shard: str, clock: HandClock) -> tuple[float, list[Any]]:
    """Run every pending merge of ``shard`` (not applied); returns (started_s, results),
    ``started_s`` on the committing client's monotonic clock."""
    client = node.client
    reqs = merge_requests(client._machine(shard).fetch_latest())
    assert reqs, "the setup left no merge request"
    started_s = clock.monotonic()
    results = [run_merge(r, shard, client.blobs.main, client.blobs.wal,
                         client.config.blob_target_size_bytes) for r in reqs]
    return started_s, results


def _output_keys(results: list[Any]) -> list[str]:
    keys = [p.key for res in results for p in res.output.hollow_parts()]
    assert keys, "the merges wrote no output parts"
    return keys


def test_merge_result_whose_outputs_gc_swept_is_refused(location: Location, nodes: Nodes):
    """The merge commit deadline: a merge result whose outputs GC swept as orphans is refused,
    data intact."""
    clock = HandClock()
    node = nodes(location, ORPHAN_CFG, policy=BLOB_ONLY, clock=clock)
    client = node.client
    shard = str(ShardId.new())
    written = write_batches(client, shard, range(4), rows_per_batch=2)
    started_s, results = _pending_merges(node, shard, clock)
    outputs = _output_keys(results)
    assert all(client.blobs.main.get(k) is not None for k in outputs)

    # The "Spark job" outlives the orphan age; a GC meanwhile sees its outputs as orphans.
    clock.advance(ORPHAN_CFG.gc_orphan_min_age_s + 5)
    gc_metrics = nodes(location, ORPHAN_CFG, clock=clock).client.gc(shard)
    assert gc_metrics["orphans_deleted"] >= len(outputs)
    assert all(client.blobs.main.get(k) is None for k in outputs)

    before = client._machine(shard).fetch_latest()
    for res in results:
        assert apply_merge_result(client._machine(shard), res, started_s) == "deadline_exceeded"
    after = client._machine(shard).fetch_latest()
    assert after.seqno == before.seqno and dict(after.batches) == dict(before.batches)
    assert rows(client.open_reader(shard).snapshot(3), 3) == expected_snapshot(written, 3)
    assert fresh_snapshot(location, shard, 3) == expected_snapshot(written, 3)
    assert_history_intact(client, shard)


def test_merge_result_past_deadline_deletes_its_outputs_and_a_timely_one_applies(
        location: Location, nodes: Nodes):
    """The merge commit deadline: a late merge result is refused and its outputs deleted; a
    timely one applies."""
    clock = HandClock()
    node = nodes(location, ORPHAN_CFG, policy=BLOB_ONLY, clock=clock)
    client = node.client
    shard = str(ShardId.new())
    machine = client._machine(shard)
    written = write_batches(client, shard, range(4), rows_per_batch=2)
    started_s, late = _pending_merges(node, shard, clock)
    late_outputs = _output_keys(late)
    clock.advance(ORPHAN_CFG.gc_orphan_min_age_s / 2 + 1)  # past the deadline, no GC
    before = machine.fetch_latest()
    for res in late:
        assert apply_merge_result(machine, res, started_s) == "deadline_exceeded"
    assert all(client.blobs.main.get(k) is None for k in late_outputs)
    after = machine.fetch_latest()
    assert after.seqno == before.seqno and dict(after.batches) == dict(before.batches)

    started_s, timely = _pending_merges(node, shard, clock)
    for res in timely:
        assert apply_merge_result(machine, res, started_s) == "applied"
    # A retry of an applied result (its reply lost) long after the deadline is still
    # recognised, and its outputs, now referenced, are kept.
    clock.advance(ORPHAN_CFG.gc_orphan_min_age_s)
    for res in timely:
        assert apply_merge_result(machine, res, started_s) == "already_applied"
    assert all(client.blobs.main.get(k) is not None for k in _output_keys(timely))
    assert rows(client.open_reader(shard).snapshot(3), 3) == expected_snapshot(written, 3)
    assert_history_intact(client, shard)


def test_merge_without_deadline_control_commits_swept_outputs(location: Location,
                                                              nodes: Nodes):
    """The merge commit deadline (negative control): without the deadline swept outputs commit;
    reads fail."""
    clock = HandClock()
    node = nodes(location, ORPHAN_CFG, policy=BLOB_ONLY, clock=clock)
    client = node.client
    shard = str(ShardId.new())
    write_batches(client, shard, range(4), rows_per_batch=2)
    started_s, results = _pending_merges(node, shard, clock)
    clock.advance(ORPHAN_CFG.gc_orphan_min_age_s + 5)
    nodes(location, ORPHAN_CFG, clock=clock).client.gc(shard)
    with controls.merge_without_deadline():
        outcomes = [apply_merge_result(client._machine(shard), r, started_s) for r in results]
    assert "applied" in outcomes
    with pytest.raises(CorruptPart):
        client.open_reader(shard).snapshot(3)


# --- overlapping and killed GCs -----------------------------------------------------------


GC_CFG = PersistConfig(rollup_threshold=4, background_maintenance=False,
                       heartbeat_interval_s=0, blob_cache_bytes=0)


def _gc_history(loc: Location, nodes: Nodes) -> tuple[str, list[Update]]:
    """A shard with compacted batches, rollups, and one GC already done (earliest > 1),
    then more writes and compactions, so the next GC has parts and rollups to delete."""
    setup = nodes(loc, GC_CFG, policy=BLOB_ONLY).client
    shard = str(ShardId.new())
    written: list[Update] = []
    for round_ in range(4):
        written += write_batches(setup, shard, range(round_ * 6, round_ * 6 + 6))
        setup.compact(shard)
        if round_ == 1:
            first = setup.gc(shard)
            assert first["seqnos_truncated"] > 0 and first["skipped"] == ""
    assert setup.consensus.scan(shard, 0, limit=1)[0].seqno > 1
    return shard, written


def _is_rollup(key: str) -> bool:
    return "/rollup/" in key


#: Where GC A is paused for GC B to run a full GC: (backend, before/after, op, match).
PAUSE_POINTS: dict[str, tuple[str, str, str, Callable[..., bool]]] = {
    # A's first read of a rollup (the state it replays from): B deletes that rollup.
    "rollup_get": ("blob", "before", "get", lambda key: _is_rollup(key)),
    # A's scan of the records it replays (limit = cut - earliest): B truncates them.
    "records_scan": ("consensus", "before", "scan",
                     lambda shard, start, limit: (limit or 0) > 1),
    # A about to delete its first removed part.
    "first_delete": ("blob", "before", "delete", lambda key: not _is_rollup(key)),
    # Just before / just after A truncates consensus.
    "before_truncate": ("consensus", "before", "truncate", lambda shard, seqno: True),
    "after_truncate": ("consensus", "after", "truncate", lambda shard, seqno: True),
}


def _pause_gc_a(loc: Location, nodes: Nodes, shard: str, where: str
                ) -> tuple[Node, Once, list[dict]]:
    """GC client A, already caught up, with GC B (another client) armed to run a full GC
    at ``where`` inside A's next GC."""
    a = nodes(loc, GC_CFG)
    b = nodes(loc, GC_CFG).client
    a.client._machine(shard).fetch_latest()  # opening reads a rollup: not part of the GC
    b_metrics: list[dict] = []
    backend, phase, op, match = PAUSE_POINTS[where]
    hook = Once(match, lambda: b_metrics.append(b.gc(shard)))
    if backend == "blob":
        a.blob.before[op] = hook
    elif phase == "before":
        a.consensus.before[op] = hook
    else:
        a.consensus.after[op] = hook
    return a, hook, b_metrics


@pytest.mark.parametrize("where", list(PAUSE_POINTS))
def test_gc_overtaken_by_another_gc_is_safe(real_location: Location, nodes: Nodes, where: str):
    """Overlapping and killed GCs: a GC overtaken by another neither fails nor deletes live
    blobs (or skips)."""
    shard, written = _gc_history(real_location, nodes)
    a, hook, b_metrics = _pause_gc_a(real_location, nodes, shard, where)
    a_metrics = a.client.gc(shard)
    assert hook.fired, f"GC A never reached {where}"
    assert len(b_metrics) == 1 and b_metrics[0]["skipped"] == ""
    assert b_metrics[0]["seqnos_truncated"] > 0
    if where in ("rollup_get", "records_scan"):
        assert a_metrics["skipped"], "GC A read truncated/removed data but did not skip"
    assert_history_intact(a.client, shard)
    upper = 24
    assert fresh_snapshot(real_location, shard, upper - 1) == expected_snapshot(written,
                                                                                upper - 1)
    # A later GC finds nothing wrong either.
    later = nodes(real_location, GC_CFG).client.gc(shard)
    assert later["skipped"] == ""
    assert_history_intact(a.client, shard)
    assert fresh_snapshot(real_location, shard, upper - 1) == expected_snapshot(written,
                                                                                upper - 1)


@pytest.mark.parametrize("where", ["rollup_get", "records_scan"])
def test_gc_trusts_its_scan_control_fails_when_overtaken(real_location: Location, nodes: Nodes,
                                                         where: str):
    """Overlapping and killed GCs (negative control): trusting its scan, the overtaken GC hits
    CorruptState."""
    shard, _ = _gc_history(real_location, nodes)
    a, hook, _ = _pause_gc_a(real_location, nodes, shard, where)
    with controls.gc_trusts_its_scan(), pytest.raises(CorruptState):
        a.client.gc(shard)
    assert hook.fired


def test_gc_killed_after_truncate_then_another_gc(real_location: Location, nodes: Nodes):
    """Overlapping and killed GCs: after a GC killed right after truncating, the next GC cleans
    up safely."""
    shard, written = _gc_history(real_location, nodes)
    a = nodes(real_location, GC_CFG)
    a.client._machine(shard).fetch_latest()

    def die(shard_: str, seqno: int) -> None:
        raise Killed(f"GC killed right after truncating below {seqno}")

    a.consensus.after["truncate"] = die
    with pytest.raises(Killed):
        a.client.gc(shard)
    observer = nodes(real_location, GC_CFG).client
    earliest = observer.consensus.scan(shard, 0, limit=1)[0].seqno
    head = observer._machine(shard).fetch_latest()
    assert any(s < earliest for s in head.rollups), "the kill left no stale rollup behind"
    assert_history_intact(observer, shard)

    metrics = nodes(real_location, GC_CFG).client.gc(shard)
    assert metrics["skipped"] == ""
    versions = assert_history_intact(observer, shard)
    earliest = observer.consensus.scan(shard, 0, limit=1)[0].seqno
    head = versions[-1]
    assert all(s >= earliest for s in head.rollups), "rollups below the earliest record kept"
    listed = {m.key for m in observer.blobs.main.list_keys(f"{shard}/rollup/")}
    assert listed == {r.key for r in head.rollups.values()}, "rollup blobs leaked"
    assert fresh_snapshot(real_location, shard, 23) == expected_snapshot(written, 23)


# --- the reader's seqno hold: the reader's seqno hold raced its fetch ---------------------


HOLD_CFG = PersistConfig(rollup_threshold=1, background_maintenance=False,
                         heartbeat_interval_s=0, blob_cache_bytes=0)


@dataclass
class HoldRace:
    reader: ReadHandle
    written: list[Update]
    lock: WatchedLock
    gc_metrics: list[dict]
    errors: list[BaseException]
    threads: list[threading.Thread]
    fired: list[int]


def _hold_race(loc: Location, nodes: Nodes) -> HoldRace:
    """Arm the race: the reader's next snapshot, right after fetching its state, lets
    another thread write, compact (same client, so the same Machine) and heartbeat the
    reader, then runs a GC from a second client, then continues."""
    c1 = nodes(loc, HOLD_CFG, policy=BLOB_ONLY).client
    c2 = nodes(loc, HOLD_CFG, policy=BLOB_ONLY).client
    shard = str(ShardId.new())
    writer = c1.open_writer(shard)
    written: list[Update] = []
    for t in range(2):
        batch = [(b"k%d" % t, b"v%d" % t, t, 1)]
        writer.compare_and_append(batch, t, t + 1)
        written += batch
    reader = c1.open_reader(shard)
    machine = c1._machine(shard)
    assert reader._machine is machine
    advanced, settled = threading.Event(), threading.Event()
    lock = WatchedLock(on_contended=settled.set)
    reader._reading_lock = lock  # type: ignore[assignment]
    race = HoldRace(reader, written, lock, [], [], [], [])

    def other_thread() -> None:
        try:
            writer.compare_and_append([(b"late", b"v", 2, 1)], 2, 3)
            metrics = c1.compact(shard)
            assert metrics["applied"] >= 1
            advanced.set()
            reader.heartbeat()  # with the fix: blocks until the read has registered
        except BaseException as e:  # reported by the test
            race.errors.append(e)
        finally:
            advanced.set()
            settled.set()

    main = threading.current_thread()
    real_fetch = machine.fetch_latest

    def fetch_latest() -> State:
        state = real_fetch()
        if threading.current_thread() is main and not race.fired:
            race.fired.append(state.seqno)
            t = threading.Thread(target=other_thread, daemon=True)
            race.threads.append(t)
            t.start()
            assert advanced.wait(WAIT_S), "the writer/compactor thread did not advance"
            # Either the heartbeat finished, or it is waiting for this read's registration.
            assert settled.wait(WAIT_S), "the heartbeat neither finished nor blocked"
            race.gc_metrics.append(c2.gc(shard))
        return state

    machine.fetch_latest = fetch_latest  # type: ignore[method-assign]
    return race


def _join(race: HoldRace) -> None:
    for t in race.threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "the heartbeat thread is stuck"
    assert not race.errors, race.errors


def test_reader_hold_is_registered_with_the_state_it_reads(real_location: Location,
                                                           nodes: Nodes):
    """The reader's seqno hold: a racing heartbeat waits for the read's hold, so GC keeps its
    parts."""
    race = _hold_race(real_location, nodes)
    table = race.reader.snapshot(1)
    _join(race)
    assert race.fired and len(race.gc_metrics) == 1
    assert race.lock.contentions >= 1, "the heartbeat did not wait for the registration"
    assert rows(table, 1) == expected_snapshot(race.written, 1)
    assert rows(race.reader.snapshot(2), 2) == expected_snapshot(
        [*race.written, (b"late", b"v", 2, 1)], 2)


def test_reader_hold_race_control_loses_parts(real_location: Location, nodes: Nodes):
    """The reader's seqno hold (negative control): with the race back, GC deletes the parts
    (CorruptPart)."""
    race = _hold_race(real_location, nodes)
    with controls.reader_hold_race(), pytest.raises(CorruptPart):
        race.reader.snapshot(1)
    _join(race)
    assert race.fired and race.gc_metrics[0]["blobs_deleted"] >= 2


# --- a listen's since hold: a listen emitted updates twice after downgrade_since + compaction ---


def _accumulate(snapshot: pa.Table, events: list[ListenEvent]) -> list[tuple[bytes, bytes, int]]:
    sums: dict[tuple[bytes, bytes], int] = defaultdict(int)
    for r in snapshot.to_pylist():
        sums[(r["k"], r["v"])] += r["d"]
    for event in events:
        if event.kind == "updates":
            assert event.updates is not None
            for r in event.updates.to_pylist():
                sums[(r["k"], r["v"])] += r["d"]
    return sorted((k, v, d) for (k, v), d in sums.items() if d != 0)


def _listen_scenario(loc: Location, nodes: Nodes, since_target: int | None = None
                     ) -> tuple[PersistClient, str, ReadHandle, pa.Table, Listen, list[Update]]:
    """snapshot(2) + listen(2), writes up to upper 10, then since moved far ahead."""
    client = nodes(loc).client
    shard = str(ShardId.new())
    written = write_batches(client, shard, range(3), rows_per_batch=2)
    reader = client.open_reader(shard)
    snap = reader.snapshot(2)
    listen = reader.listen(2)
    written += write_batches(client, shard, range(3, 10), rows_per_batch=2)
    reader.downgrade_since(9 if since_target is None else since_target)
    return client, shard, reader, snap, listen, written


@pytest.mark.parametrize("since_target", [9, 1000], ids=["to-upper", "beyond-upper"])
def test_listen_after_downgrade_and_compaction_emits_each_update_once(
        location: Location, nodes: Nodes, since_target: int):
    """A listen's since hold: snapshot + listen after downgrade_since and compaction has no
    duplicates."""
    client, shard, reader, snap, listen, written = _listen_scenario(location, nodes,
                                                                    since_target)
    held_since = reader.since
    assert client.compact(shard)["applied"] >= 1
    events = listen.poll()
    assert events[-1].kind == "progress" and events[-1].upper == 10
    assert _accumulate(snap, events) == expected_snapshot(written, 9)
    assert _accumulate(snap, events) == fresh_snapshot(location, shard, 9)
    assert held_since == 2, "since was not held at the listen's frontier - 1"
    assert reader.since == 9, "since was not released as the listen advanced"
    # Another round: the hold follows the listen.
    more = write_batches(client, shard, range(10, 14), rows_per_batch=2)
    client.compact(shard)
    events += listen.poll()
    assert _accumulate(snap, events) == expected_snapshot(written + more, 13)
    assert _accumulate(snap, events) == fresh_snapshot(location, shard, 13)
    assert reader.since == min(since_target, 13)


def test_listen_without_hold_control_emits_duplicates(location: Location, nodes: Nodes):
    """A listen's since hold (negative control): without the hold the listen emits updates twice."""
    with controls.listen_without_hold():
        client, shard, _, snap, listen, written = _listen_scenario(location, nodes)
        client.compact(shard)
        events = listen.poll()
    acc = _accumulate(snap, events)
    assert acc != expected_snapshot(written, 9)
    assert any(d == 2 for _, _, d in acc), f"no duplicate in {acc}"


def test_listen_refuses_a_batch_compacted_past_its_frontier(location: Location, nodes: Nodes,
                                                            monkeypatch: pytest.MonkeyPatch):
    """A listen's since hold: a batch compacted past the listen's frontier is refused
    (SinceViolation)."""
    monkeypatch.setattr(ReadHandle, "_listen_cap", lambda self: None)
    client, shard, reader, _, listen, _ = _listen_scenario(location, nodes)
    assert reader.since == 9
    client.compact(shard)
    with pytest.raises(SinceViolation):
        listen.poll()
    assert listen.frontier == 3


# --- reads racing GC ----------------------------------------------------------------------


ROLLUP_CFG = PersistConfig(rollup_threshold=3, background_maintenance=False,
                           heartbeat_interval_s=0)


def _shard_with_rollup(loc: Location, nodes: Nodes) -> tuple[str, list[Update], str]:
    setup = nodes(loc, ROLLUP_CFG).client
    shard = str(ShardId.new())
    written = write_batches(setup, shard, range(10), rows_per_batch=2)
    while True:
        head = setup._machine(shard).fetch_latest()
        latest = head.latest_rollup()
        assert latest is not None
        if head.seqno - latest.seqno >= 2:
            # GC's new rollup (of the head) lies beyond the first record after this one,
            # so its truncation removes records a reader of this rollup needs.
            return shard, written, latest.key
        setup.open_writer(shard)  # one more (routine) commit


def _open_while_gc_replaces_rollup(loc: Location, nodes: Nodes, entry: str,
                                   where: str = "rollup_get"
                                   ) -> tuple[Once, Node, Callable[[], Any]]:
    """A new client opening the shard, with a GC from another client (which replaces the
    latest rollup and truncates below the new one) armed to run between the open's head
    read and its fetch of the rollup (``rollup_get``), or between that fetch and its
    scan of the records after it (``records_scan``)."""
    shard, written, old_rollup = _shard_with_rollup(loc, nodes)
    gc_client = nodes(loc, ROLLUP_CFG).client
    gc_client._machine(shard).fetch_latest()
    new = nodes(loc, ROLLUP_CFG)
    gc_metrics: list[dict] = []

    def run_gc() -> None:
        gc_metrics.append(gc_client.gc(shard))
        assert gc_client.blobs.main.get(old_rollup) is None, "GC kept the old rollup"

    if where == "rollup_get":
        hook = Once(lambda key: key == old_rollup, run_gc)
        new.blob.before["get"] = hook
    else:
        hook = Once(lambda shard_, start, limit: limit is None and start > 1, run_gc)
        new.consensus.before["scan"] = hook

    def open_shard() -> Any:
        if entry == "open_reader":
            reader = new.client.open_reader(shard)
            assert rows(reader.snapshot(9), 9) == expected_snapshot(written, 9)
            return reader
        state = new.client._machine(shard).fetch_latest()
        assert state.upper == 10
        assert rows(new.client.open_reader(shard).snapshot(9), 9) == expected_snapshot(
            written, 9)
        return state

    return hook, new, open_shard


@pytest.mark.parametrize("entry", ["open_reader", "fetch_latest"])
def test_open_while_gc_replaces_the_rollup_retries(real_location: Location, nodes: Nodes,
                                                   entry: str):
    """Opening while GC replaces the rollup: opening while GC replaces the rollup retries
    instead of CorruptState."""
    hook, new, open_shard = _open_while_gc_replaces_rollup(real_location, nodes, entry)
    open_shard()
    assert hook.fired
    assert new.client.metrics.state_fetches >= 2, "the open did not retry"


def test_open_while_gc_truncates_the_records_after_the_rollup_retries(
        real_location: Location, nodes: Nodes):
    """Opening while GC replaces the rollup: opening while GC truncates the records to replay
    retries too."""
    hook, new, open_shard = _open_while_gc_replaces_rollup(real_location, nodes,
                                                           "open_reader", "records_scan")
    open_shard()
    assert hook.fired
    assert new.client.metrics.state_fetches >= 2, "the open did not retry"


@pytest.mark.parametrize("entry", ["open_reader", "fetch_latest"])
def test_open_fails_on_replaced_rollup_control(real_location: Location, nodes: Nodes,
                                               entry: str):
    """Opening while GC replaces the rollup (negative control): the same open raises
    CorruptState."""
    hook, _, open_shard = _open_while_gc_replaces_rollup(real_location, nodes, entry)
    with controls.open_fails_on_replaced_rollup(), pytest.raises(CorruptState):
        open_shard()
    assert hook.fired


LEASE_CFG = PersistConfig(reader_lease_duration_s=60, heartbeat_interval_s=0,
                          blob_cache_bytes=0)


def _reader_paused_past_lease(loc: Location, nodes: Nodes, kind: str
                              ) -> tuple[Callable[[], Any], ReadHandle, list[dict], str,
                                         list[Update]]:
    """A read (``snapshot(3)`` or the first poll of ``listen(0)``) that, right after
    fetching its state, is paused past the reader's lease while another client compacts
    and GCs (expiring the reader and deleting the compacted inputs)."""
    clock = HandClock()
    c1 = nodes(loc, LEASE_CFG, policy=BLOB_ONLY, clock=clock).client
    c2 = nodes(loc, LEASE_CFG, policy=BLOB_ONLY, clock=clock).client
    shard = str(ShardId.new())
    written = write_batches(c1, shard, range(4))
    reader = c1.open_reader(shard)
    read: Callable[[], Any]
    if kind == "snapshot":
        def read() -> Any:
            return reader.snapshot(3)
    else:
        listen = reader.listen(0)

        def read() -> Any:
            return listen.poll()
    machine = c1._machine(shard)
    real_fetch = machine.fetch_latest
    metrics: list[dict] = []

    def fetch_latest() -> State:
        state = real_fetch()
        if not metrics:
            clock.advance(LEASE_CFG.reader_lease_duration_s + 1)
            metrics.append(c2.compact(shard))
            metrics.append(c2.gc(shard))
        return state

    machine.fetch_latest = fetch_latest  # type: ignore[method-assign]
    return read, reader, metrics, shard, written


@pytest.mark.parametrize("kind", ["snapshot", "listen"])
def test_reader_paused_past_its_lease_gets_lease_expired(real_location: Location,
                                                         nodes: Nodes, kind: str):
    """An expired reader's read: a reader expired mid-read whose parts GC deleted gets
    LeaseExpired."""
    read, reader, metrics, shard, written = _reader_paused_past_lease(real_location, nodes,
                                                                      kind)
    with pytest.raises(LeaseExpired):
        read()
    compacted, collected = metrics
    assert compacted["applied"] >= 1 and collected["blobs_deleted"] >= 2
    with pytest.raises(LeaseExpired):
        reader.snapshot(3)
    assert fresh_snapshot(real_location, shard, 3) == expected_snapshot(written, 3)


@pytest.mark.parametrize("kind", ["snapshot", "listen"])
def test_expired_read_reports_corruption_control(real_location: Location, nodes: Nodes,
                                                 kind: str):
    """An expired reader's read (negative control): the same read reports CorruptPart."""
    read, _, metrics, _, _ = _reader_paused_past_lease(real_location, nodes, kind)
    with controls.expired_read_reports_corruption(), pytest.raises(CorruptPart):
        read()
    assert len(metrics) == 2


@pytest.mark.parametrize("error", [pa.ArrowMemoryError("simulated: out of memory"),
                                   MemoryError("simulated")], ids=["arrow", "python"])
def test_out_of_memory_decoding_a_part_is_resource_exhausted(
        location: Location, nodes: Nodes, monkeypatch: pytest.MonkeyPatch,
        error: BaseException):
    """Memory errors while decoding: out of memory decoding a Parquet part is
    ResourceExhausted, not corrupt."""
    client = nodes(location, policy=BLOB_ONLY).client
    shard = str(ShardId.new())
    written = write_batches(client, shard, range(4), rows_per_batch=3)
    reader = client.open_reader(shard)
    before = client.inspect(shard)

    def out_of_memory(*args: object, **kwargs: object) -> pa.Table:
        raise error

    # Where a part is decoded: on the calling thread, by ParquetFile.read.
    monkeypatch.setattr(updates_module.pq.ParquetFile, "read", out_of_memory)
    for attempt in (lambda: reader.snapshot(3), lambda: client.compact(shard),
                    lambda: reader.listen(0).poll()):
        with pytest.raises(ResourceExhausted) as caught:
            attempt()
        assert not isinstance(caught.value, CorruptData)
        assert isinstance(caught.value, MemoryError)
    monkeypatch.undo()
    assert client.inspect(shard)["seqno"] >= before["seqno"]
    assert client.inspect(shard)["batches"] == before["batches"]
    assert rows(reader.snapshot(3), 3) == expected_snapshot(written, 3)


def _drain(listen: Listen) -> list[ListenEvent]:
    """Iterate a listen to its end on a helper thread; fails if it does not end."""
    out: list[ListenEvent] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.extend(listen)
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive(), "the listen never finished"
    assert not errors, errors
    return out


def test_listen_at_max_time_on_a_closed_shard(location: Location, nodes: Nodes):
    """listen(2**63 - 1) on a closed shard reports the shard closed at once (no updates
    can follow the largest time), like a listen at any other time does."""
    client = nodes(location).client
    shard = str(ShardId.new())
    writer = client.open_writer(shard)
    updates = [(b"a", b"1", 0, 1), (b"b", b"2", 5, 1), (b"c", b"3", MAX_TIME, 1)]
    writer.compare_and_append(updates, 0, None)
    reader = client.open_reader(shard)
    listen = reader.listen(MAX_TIME)
    assert listen.poll() == [ListenEvent("progress", upper=None)]
    assert listen.frontier is None
    assert listen.poll() == [] and _drain(listen) == []
    assert _drain(reader.listen(MAX_TIME)) == [ListenEvent("progress", upper=None)]
    assert rows(reader.snapshot(MAX_TIME), MAX_TIME) == expected_snapshot(updates, MAX_TIME)
    # A listen from an earlier time ends with the closed frontier.
    events = _drain(reader.listen(4))
    assert events[-1].kind == "progress" and events[-1].upper is None
    got = [(r["k"], r["v"], r["t"], r["d"]) for e in events if e.updates is not None
           for r in e.updates.to_pylist()]
    assert sorted(got) == [(b"b", b"2", 5, 1), (b"c", b"3", MAX_TIME, 1)]
    reader.downgrade_since(MAX_TIME)
    assert reader.since == MAX_TIME


def test_listen_at_max_time_waits_for_the_close_and_reports_it(location: Location,
                                                                nodes: Nodes):
    """A listen after the largest time on an open shard reports nothing while the shard
    is open (no update can come), then the close."""
    client = nodes(location).client
    shard = str(ShardId.new())
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 3)
    listen = client.open_reader(shard).listen(MAX_TIME)
    assert listen.poll() == []
    writer.compare_and_append([(b"b", b"1", 7, 1)], 3, 9)
    assert listen.poll() == []
    writer.compare_and_append([], 9, None)
    assert listen.poll() == [ListenEvent("progress", upper=None)]
    assert listen.poll() == []


def test_rollup_every_seqno_with_foreground_maintenance(location: Location, nodes: Nodes):
    """Rollups in the foreground: rollup_threshold=1 in the foreground: no RecursionError, GC
    and reads work."""
    cfg = PersistConfig(rollup_threshold=1, background_maintenance=False,
                        heartbeat_interval_s=0)
    client = nodes(location, cfg).client
    shard = str(ShardId.new())
    writer = client.open_writer(shard)
    written: list[Update] = []
    for t in range(120):
        n = 60 if t % 10 == 0 else 1  # some writes go to blob, most inline
        batch = [(b"k%d-%d" % (t, i), b"x" * 80, t, 1) for i in range(n)]
        writer.compare_and_append(batch, t, t + 1)
        written += batch
        if t % 40 == 39:
            client.compact(shard)
    state = client._machine(shard).fetch_latest()
    assert state.upper == 120 and state.latest_rollup() is not None
    assert state.seqno - state.latest_rollup().seqno <= 2
    metrics = client.gc(shard)
    assert metrics["skipped"] == "" and metrics["seqnos_truncated"] > 0
    assert metrics["blobs_deleted"] > 0
    assert_history_intact(client, shard)
    assert fresh_snapshot(location, shard, 119) == expected_snapshot(written, 119)


def test_rollups_a_killed_gc_dropped_are_swept_by_the_next_gc(location: Location,
                                                               monkeypatch: pytest.MonkeyPatch):
    """Overlapping and killed GCs (found by the nemesis): a GC killed after dropping rollups
    from the state but before deleting their blobs left them listed in kept versions; the
    next GC's orphan sweep must still delete them (only the head's rollups are ever read)."""
    from persist_pipeline import gc as gc_module

    # Writes get the default commit deadline (a loaded machine may need more than the half
    # second a 1 s orphan age leaves), and the shard the default orphan age, which GC
    # goes by whatever it is configured with. The reader's lease outlives the time GC's
    # clock is advanced by.
    writing = location.client(InlinePolicy(0, 0), PersistConfig(
        rollup_threshold=2, background_maintenance=False, reader_lease_duration_s=86400))
    config = PersistConfig(rollup_threshold=2, gc_orphan_min_age_s=1,
                           background_maintenance=False)
    clock = HandClock()  # GC's time: its store's clock is what ages the dropped rollups
    client = client_on_clock(location, clock, InlinePolicy(0, 0), config)
    shard = ShardId.new()
    writer = writing.open_writer(shard)
    for t in range(12):
        writer.compare_and_append([(b"k%d" % t, b"v", t, 1)], t, t + 1)
    # A reader holds this seqno, so neither GC can truncate past the first GC's drop.
    reader = writing.open_reader(shard)
    real_delete = gc_module._delete

    def dies_before_deleting_rollups(machine: Any, store: str, key: str) -> int:
        if "/rollup/" in key:
            return 0  # the GC process was killed right after its drop commit
        return real_delete(machine, store, key)

    monkeypatch.setattr(gc_module, "_delete", dies_before_deleting_rollups)
    dropped = client.gc(shard, sweep_orphans=False)["rollups_deleted"]
    assert dropped > 0
    monkeypatch.undo()
    writer.compare_and_append([], 12, 13)
    # The dropped rollups are now old enough for the sweep on the store's clock, whose
    # stamps may be rounded down (S3: to the second).
    clock.advance(writing.config.gc_orphan_min_age_s
                  + client.blobs.main.stamp_resolution_s + 0.1)
    client.gc(shard)
    head = client._machine(shard).fetch_latest()
    listed = {m.key for m in client.blobs.main.list_keys(f"{shard}/") if "/rollup/" in m.key}
    assert listed == {r.key for r in head.rollups.values()}
    fresh = location.client(InlinePolicy(0, 0), config)
    assert rows(fresh.open_reader(shard).snapshot(12), 12) == \
        sorted((b"k%d" % t, b"v", 1) for t in range(12))
    assert rows(reader.snapshot(11), 11) == sorted((b"k%d" % t, b"v", 1) for t in range(12))
