"""Handles when consensus fails under them: a listen poll whose since release fails
still returns its updates, a failed expire() (reader or writer) or downgrade_since is
not remembered as done, and closing a listen releases the since it held back. On every
backend."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.blob import open_blob
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.exceptions import ConsensusUnavailable, PersistError, SinceViolation
from tests.fixtures.location import Location
from tests.helpers import WAIT_S, ForwardingConsensus, wait_until
from tests.test_regressions_lost_replies import ManualClock

NO_INLINE = InlinePolicy(0, 0)


class Outage(ForwardingConsensus):
    """Consensus whose compare-and-sets fail (without running) while ``down``."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.down = False

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        if self.down:
            raise ConsensusUnavailable("test: consensus is down")
        return self.inner.compare_and_set(shard, expected, new)

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        if self.down:
            raise ConsensusUnavailable("test: consensus is down")
        return self.inner.compare_and_set_many(writes)

    def close(self) -> None:
        self.inner.close()


def _client(location: Location, consensus: Consensus, clock: ManualClock,
            policy: InlinePolicy = NO_INLINE, **config: Any) -> PersistClient:
    cfg = PersistConfig(inline_policy=policy, heartbeat_interval_s=0,
                        background_maintenance=False, **config)
    wal = open_blob(location.wal_blob_uri) if location.wal_blob_uri else None
    return PersistClient(consensus, open_blob(location.blob_uri), wal, cfg, clock=clock)


def _written(location: Location, opened: list[PersistClient]
             ) -> tuple[Outage, PersistClient, ShardId, Any]:
    """A client whose consensus can be taken down, and a shard it wrote one row to at
    time 0 (upper 1), with the writer."""
    outage = Outage(open_consensus(location.consensus_uri))
    client = _client(location, outage, ManualClock())
    opened.append(client)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    return outage, client, shard, writer


@pytest.fixture
def opened(location: Location) -> Iterator[list[PersistClient]]:
    out: list[PersistClient] = []
    yield out
    for c in out:
        c.close()


def test_a_listen_whose_since_release_fails_loses_no_updates(location: Location,
                                                             opened: list[PersistClient]):
    """A poll that fails (consensus down while the listen releases the reader's since)
    must not advance the listen: the updates it fetched are emitted by the next poll."""
    outage, client, shard, writer = _written(location, opened)
    reader = client.open_reader(shard)
    listen = reader.listen(0)
    reader.downgrade_since(5)  # the user releases times it no longer needs
    writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2)
    outage.down = True
    events = []
    # The release of since fails: failing is fine; skipping the updates it took is not.
    with contextlib.suppress(PersistError):
        events += listen.poll()
    outage.down = False
    events += listen.poll()
    got = [(r["k"], r["t"]) for e in events if e.kind == "updates"
           for r in e.updates.to_pylist()]
    assert got == [(b"b", 1)]


def test_listen_release_control_loses_the_updates(tmp_path: Path):
    """Negative control for the test above: with the release raising again, the poll
    whose release failed drops the updates it took, and no later poll returns them."""
    from persist_pipeline.sim import controls

    location = Location("sqlite", f"sqlite:///{tmp_path}/c.db", f"file://{tmp_path}/b")
    opened: list[PersistClient] = []
    try:
        outage, client, shard, writer = _written(location, opened)
        reader = client.open_reader(shard)
        listen = reader.listen(0)
        reader.downgrade_since(5)
        writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2)
        outage.down = True
        with controls.listen_release_raises(), pytest.raises(PersistError):
            listen.poll()
        outage.down = False
        assert [e for e in listen.poll() if e.kind == "updates"] == []
    finally:
        for c in opened:
            c.close()


def test_a_reader_whose_expire_failed_can_expire_again(location: Location,
                                                      opened: list[PersistClient]):
    """``expire()`` that fails (consensus down) must be retryable: the reader's since
    and seqno holds stay in the state until it succeeds, so a retry that is a silent
    no-op holds back compaction and GC for a whole lease."""
    outage, client, shard, _writer = _written(location, opened)
    reader = client.open_reader(shard)
    outage.down = True
    with pytest.raises(PersistError):
        reader.expire()
    outage.down = False
    reader.expire()  # the retry
    state = client._machine(shard).fetch_latest()
    assert reader.reader_id not in state.leased_readers


def test_a_writer_whose_expire_failed_can_expire_again(location: Location,
                                                      opened: list[PersistClient]):
    """As for readers: a writer's failed ``expire()`` is retried by the next call, not
    taken as done (its entry would stay in the state until its lease ran out)."""
    outage, client, shard, writer = _written(location, opened)
    outage.down = True
    with pytest.raises(PersistError):
        writer.expire()
    outage.down = False
    with pytest.raises(PersistError):  # expired for its caller at the first call
        writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2)
    writer.expire()  # the retry
    assert writer.writer_id not in client._machine(shard).fetch_latest().writers


def test_a_failed_since_downgrade_does_not_refuse_a_lower_one(location: Location,
                                                             opened: list[PersistClient]):
    """``downgrade_since(10)`` that failed (consensus down, nothing committed) left the
    reader's since at 0; a later ``downgrade_since(5)`` must not be refused with "since
    may only advance: reader holds 10" (a negative answer from a cache, not from
    consensus), and a listen moving on must not release 10 behind the user's back."""
    outage, client, shard, _writer = _written(location, opened)
    reader = client.open_reader(shard)
    outage.down = True
    with pytest.raises(PersistError):
        reader.downgrade_since(10)
    outage.down = False
    assert client._machine(shard).fetch_latest().since == 0  # nothing was committed
    reader.downgrade_since(5)
    assert reader.since == 5


def test_closing_a_listen_releases_the_since_it_held(location: Location,
                                                     opened: list[PersistClient]):
    """``Listen.close()``: "the reader's since is no longer held back for this listen".
    The since the user asked for while the listen capped it is released by the close,
    not left held (blocking compaction) until some later call."""
    clock = ManualClock()
    client = _client(location, open_consensus(location.consensus_uri), clock)
    opened.append(client)
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"a", b"1", 0, 1)], 0, 10)
    reader = client.open_reader(shard)
    listen = reader.listen(2)
    reader.downgrade_since(8)
    assert reader.since == 2  # capped by the open listen
    listen.close()
    assert reader.since == 8
    assert client._machine(shard).fetch_latest().since == 8


class _NotingLock:
    """A reader's since lock that notes when another thread tries to take it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.tried = threading.Event()

    def __enter__(self) -> None:
        self.tried.set()
        self._inner.acquire()

    def __exit__(self, *exc: object) -> None:
        self._inner.release()


def test_a_listen_opened_while_another_listen_releases_since_is_held(location: Location):
    """One reader, two threads: a listen is opened at ``as_of`` (checked against the
    reader's since) while another listen of the reader moves on and releases the since
    the user asked for. The release must count the new listen: a since moved past its
    ``as_of`` after the check lets compaction fold the times it has yet to emit, and the
    listen then fails (or emits them at the wrong time)."""
    client = location.client(InlinePolicy(0, 0), PersistConfig(
        heartbeat_interval_s=0, background_maintenance=False))
    shard = str(ShardId.new())
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"k0", b"v", 0, 1)], 0, 5)
    reader = client.open_reader(shard)
    first = reader.listen(4)
    reader.downgrade_since(100)  # held at 4 while the first listen is at 5
    for t in range(5, 12):
        writer.compare_and_append([(b"k%d" % t, b"v", t, 1)], t, t + 1)
    check_as_of = reader._check_as_of
    errors: list[BaseException] = []

    def move_first() -> None:
        try:
            first.poll()  # moves to 12 and releases since up to what listens allow
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    mover = threading.Thread(target=move_first)

    def checked_then_moved(as_of: object, state: Any) -> int:
        t = check_as_of(as_of, state)
        if as_of == 4 and mover.ident is None:
            # The other listen moves on between this listen's check and its
            # registration: either it finishes first (the race) or it waits for this
            # listen to be registered.
            mover.start()
            wait_until(lambda: not mover.is_alive() or noting.tried.is_set(),
                       "the other listen finished or waits for the reader's since lock")
        return t

    noting = _NotingLock(getattr(reader, "_since_lock", threading.RLock()))
    reader._since_lock = noting  # type: ignore[attr-defined]
    reader._check_as_of = checked_then_moved  # type: ignore[method-assign]
    second = reader.listen(4)
    reader._check_as_of = check_as_of  # type: ignore[method-assign]
    mover.join(WAIT_S)
    assert not mover.is_alive() and not errors
    assert reader.since == 4  # the second listen, at 5, holds it
    client.compact(shard)
    got = []
    for event in second.poll():
        if event.kind == "updates":
            assert event.updates is not None
            got += [(r["k"], r["t"]) for r in event.updates.to_pylist()]
    assert sorted(got) == sorted((b"k%d" % t, t) for t in range(5, 12))
    client.close()


def test_listen_registration_control_moves_since_past_the_new_listen(tmp_path: Path):
    """Negative control for the test above (the simulation's sibling listens reach the
    race too rarely to test it there): with the reader's since moves and listen
    registrations no longer serialised, the other listen's release, run between the new
    listen's check and its registration, moves the since past the new listen's as_of,
    and the new listen fails once compaction folded the times it had yet to emit."""
    from persist_pipeline.sim import controls

    location = Location("sqlite", f"sqlite:///{tmp_path}/c.db", f"file://{tmp_path}/b")
    client = location.client(InlinePolicy(0, 0), PersistConfig(
        heartbeat_interval_s=0, background_maintenance=False))
    try:
        shard = str(ShardId.new())
        writer = client.open_writer(shard)
        writer.compare_and_append([(b"k0", b"v", 0, 1)], 0, 5)
        with controls.listen_registration_unserialised():
            reader = client.open_reader(shard)
        first = reader.listen(4)
        reader.downgrade_since(100)
        for t in range(5, 12):
            writer.compare_and_append([(b"k%d" % t, b"v", t, 1)], t, t + 1)
        check_as_of = reader._check_as_of

        def checked_then_moved(as_of: object, state: Any) -> int:
            t = check_as_of(as_of, state)
            first.poll()  # the other listen's release lands between check and registration
            return t

        reader._check_as_of = checked_then_moved  # type: ignore[method-assign]
        second = reader.listen(4)
        reader._check_as_of = check_as_of  # type: ignore[method-assign]
        assert reader.since > 4  # past the second listen's as_of
        client.compact(shard)
        with pytest.raises(SinceViolation):
            second.poll()
    finally:
        client.close()
