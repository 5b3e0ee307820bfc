"""Group commit where it meets other features: an append held in the funnel's window
while another client changes its shard (evolves or records its schema, closes it).

The append's transition runs against the shard's state at the group's commit, not at
enqueue: it commits with the schema it was encoded with (an evolution appended only
nullable columns, so its rows still fit, and read back identically through every read
path), or it is refused with the typed error of a single write, nothing written and its
uploaded parts deleted. Deterministic: the other client acts inside the leader's window
sleep, on SQLite + files and PostgreSQL + S3, inline and blob. A group mixing a stale
append, one to a closed shard, one by a writer whose lease lapsed and a plain one
answers each alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from persist_pipeline import (
    InlinePolicy,
    LeaseExpired,
    PersistClient,
    PersistConfig,
    SchemaMismatch,
    ShardId,
    ShardSchema,
    UpperMismatch,
)
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import Consensus
from persist_pipeline.exceptions import ConsensusUnavailable, Indeterminate
from persist_pipeline.write import WriteResult
from tests.fixtures.location import Location
from tests.helpers import ForwardingConsensus, HandClock, client_on_clock

V1 = ShardSchema({"id": pa.int64()}, {"a": pa.string()})
V2 = ShardSchema({"id": pa.int64()}, {"a": pa.string(), "b": pa.int32()})
POLICIES = {"inline": InlinePolicy(4096, 1 << 20), "blob": InlinePolicy(0, 0)}
WINDOW_S = 0.01


class _WindowHook:
    """The funnel's clock, running ``hook`` once inside the leader's window sleep: after
    the append was enqueued, before its group is taken and committed."""

    def __init__(self, clock: Any, hook: Callable[[], None]) -> None:
        self._clock = clock
        self._hook: Callable[[], None] | None = hook

    def sleep(self, seconds: float) -> None:
        hook, self._hook = self._hook, None
        if hook is not None and seconds == WINDOW_S:
            hook()
        else:
            self._hook = hook
        self._clock.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clock, name)


def _grouping_client(location: Location, policy: InlinePolicy,
                     hook: Callable[[], None]) -> PersistClient:
    client = location.client(policy, PersistConfig(group_commit_window_s=WINDOW_S))
    funnel = client._funnel
    funnel._clock = _WindowHook(funnel._clock, hook)  # type: ignore[assignment]
    return client


def _part_keys(client: PersistClient, shard: str) -> set[str]:
    stores = [client.blobs.main] + ([client.blobs.wal] if client.blobs.wal else [])
    return {m.key for s in stores for m in s.list_keys(shard) if "/p/" in m.key}


@pytest.mark.parametrize("placement", list(POLICIES))
def test_an_append_held_while_the_schema_evolves_commits_and_reads_back_everywhere(
        durable_location: Location, placement: str):
    policy = POLICIES[placement]
    other = durable_location.client(policy)
    shard = str(ShardId.new())
    client = _grouping_client(durable_location, policy,
                              lambda: other.open_writer(shard, schema=V2).expire())
    writer = client.open_writer(shard, schema=V1)
    result = writer.compare_and_append(
        pa.table({"id": [1, 2], "a": ["x", None], "t": [0, 0], "d": [1, 1]}), 0, 1)
    assert result.upper == 1 and result.placement == placement
    assert client.metrics.group_commits >= 1
    assert other.schema(shard) == V2
    # A writer of the new shape retracts one of the held append's rows and rewrites it
    # with the new column: the sums only cancel if both encode the row identically.
    later = other.open_writer(shard)
    later.compare_and_append(pa.table({"id": [1, 1, 3], "a": ["x", "x", "z"],
                                       "b": pa.array([None, 5, 7], pa.int32()),
                                       "t": [1, 1, 1], "d": [-1, 1, 1]}), 1, 2)
    expected = [(1, "x", 5, 1), (2, None, None, 1), (3, "z", 7, 1)]
    reader = other.open_reader(shard)
    try:
        snap = reader.snapshot(1)
        assert [(r["id"], r["a"], r["b"], r["d"]) for r in snap.to_pylist()] == expected
        batches = pa.Table.from_batches(list(reader.snapshot_batches(1, max_rows=1)))
        assert batches.equals(snap)
        with reader.snapshot_plan(1) as plan:
            ds = plan.to_dataset()  # noqa: F841 (read by DuckDB below)
            got = duckdb.sql("SELECT id, a, b, sum(d) FROM ds WHERE t <= 1 GROUP BY id, a, b "
                             "HAVING sum(d) <> 0 ORDER BY id").fetchall()
            assert got == expected
    finally:
        reader.expire()
    client.close()
    other.close()


@pytest.mark.parametrize("placement", list(POLICIES))
def test_an_untyped_append_held_while_the_shard_is_typed_is_refused(
        durable_location: Location, placement: str):
    policy = POLICIES[placement]
    other = durable_location.client(policy)
    shard = str(ShardId.new())
    client = _grouping_client(durable_location, policy,
                              lambda: other.open_writer(shard, schema=V1).expire())
    writer = client.open_writer(shard)
    with pytest.raises(SchemaMismatch):
        writer.compare_and_append([(b"raw", b"bytes", 0, 1)], 0, 1)
    state = other.inspect(shard)
    assert state["upper"] == 0 and other.schema(shard) == V1
    assert _part_keys(other, shard) == set()  # certainly refused: its parts deleted
    client.close()
    other.close()


@pytest.mark.parametrize("placement", list(POLICIES))
def test_an_append_held_while_the_shard_is_closed_writes_nothing(
        durable_location: Location, placement: str):
    policy = POLICIES[placement]
    other = durable_location.client(policy)
    shard = str(ShardId.new())
    closer = other.open_writer(shard)
    client = _grouping_client(durable_location, policy,
                              lambda: closer.compare_and_append([], 0, None))
    writer = client.open_writer(shard)
    with pytest.raises(UpperMismatch) as refused:
        writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    assert refused.value.current is None
    # persist's append leaves a closed shard out, as when it was closed before.
    closed_after = writer.append([(b"k", b"v", 0, 1)], 0, 1)
    assert closed_after.placement == "none" and closed_after.upper is None
    assert other.inspect(shard)["upper"] is None
    assert _part_keys(other, shard) == set()
    client.close()
    other.close()


LEASE_S = 10.0


@pytest.mark.parametrize("placement", list(POLICIES))
def test_one_group_of_a_stale_a_closed_a_lapsed_and_a_plain_append_answers_each_alone(
        durable_location: Location, placement: str):
    """Four threads' appends meet in the funnel's window: one at a stale upper, one to a
    shard another client closed, one by a writer whose lease lapsed (this process
    paused; GC expired it from the state), one plain. Each gets its own answer: the
    stale and the closed one are refused (``UpperMismatch``, nothing written, their
    parts deleted), the lapsed writer's append commits (registering its writer again),
    as does the plain one; the refusals never hold back the others."""
    policy = POLICIES[placement]
    clock = HandClock()
    cfg = PersistConfig(inline_policy=policy, group_commit_window_s=0.05,
                        reader_lease_duration_s=LEASE_S, heartbeat_interval_s=0)
    client = client_on_clock(durable_location, clock, config=cfg)
    other = client_on_clock(durable_location, clock, config=replace(
        cfg, group_commit_window_s=0.0))
    names = ("plain", "stale", "closed", "lapsed")
    shards = {n: str(ShardId.new()) for n in names}
    writers = {n: client.open_writer(shards[n]) for n in names}
    for w in writers.values():
        w.compare_and_append([(b"base", b"", 0, 1)], 0, 1)
    other.open_writer(shards["closed"]).compare_and_append([], 1, None)
    clock.advance(LEASE_S + 1)  # every writer's lease lapses; GC expires one shard's
    other.gc(shards["lapsed"])
    lapsed_id = writers["lapsed"].writer_id
    assert lapsed_id not in other._machine(shards["lapsed"]).fetch_latest().writers
    parts_before = {n: _part_keys(other, shards[n]) for n in names}
    groups, grouped = client.metrics.group_commits, client.metrics.group_commit_appends
    barrier = threading.Barrier(len(names))
    outcomes: dict[str, object] = {}

    def append(name: str) -> None:
        expected = 0 if name == "stale" else 1
        barrier.wait()
        try:
            outcomes[name] = writers[name].compare_and_append(
                [(name.encode(), b"v" * 100, expected, 1)], expected, expected + 1)
        except Exception as e:  # asserted below
            outcomes[name] = e

    threads = [threading.Thread(target=append, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert client.metrics.group_commit_appends - grouped > \
        client.metrics.group_commits - groups, "no two appends shared a round trip"
    stale, closed = outcomes["stale"], outcomes["closed"]
    assert isinstance(stale, UpperMismatch) and stale.current == 1
    assert isinstance(closed, UpperMismatch) and closed.current is None
    for name in ("plain", "lapsed"):
        result = outcomes[name]
        assert isinstance(result, WriteResult) and result.upper == 2, (name, result)
        reader = other.open_reader(shards[name])
        try:
            assert (name.encode(), b"v" * 100, 1) in [
                (r["k"], r["v"], r["d"]) for r in reader.snapshot(1).to_pylist()]
        finally:
            reader.expire()
    assert lapsed_id in other._machine(shards["lapsed"]).fetch_latest().writers
    assert other.inspect(shards["stale"])["upper"] == 1
    assert other.inspect(shards["closed"])["upper"] is None
    for name in ("stale", "closed"):
        assert _part_keys(other, shards[name]) == parts_before[name]
    client.close()
    other.close()


def _expired_while_held(location: Location, policy: InlinePolicy, shard: str
                        ) -> tuple[PersistClient, PersistClient, Any]:
    """A grouping client whose next append's handle another thread ``expire()``s while
    the append waits in the funnel, a second client, and that handle, on ``shard``,
    which holds one row at upper 1."""
    handle: list[Any] = []

    def expire_from_another_thread() -> None:
        expirer = threading.Thread(target=handle[0].expire)
        expirer.start()
        expirer.join(timeout=60)
        assert not expirer.is_alive()

    client = _grouping_client(location, policy, expire_from_another_thread)
    other = location.client(policy)
    with other.open_writer(shard) as first:
        first.compare_and_append([(b"base", b"", 0, 1)], 0, 1)
    writer = client.open_writer(shard)
    handle.append(writer)
    return client, other, writer


@pytest.mark.parametrize("placement", list(POLICIES))
def test_an_append_held_while_its_handle_is_expired_is_refused_and_changes_nothing(
        durable_location: Location, placement: str):
    """Another thread ``expire()``s the handle while its append waits in the funnel's
    window: the append is refused with ``LeaseExpired``, as the same write through the
    expired handle is when it starts, and changes nothing: the shard's upper and rows
    stay, the writer is not registered again, and the parts it uploaded are deleted."""
    shard = str(ShardId.new())
    client, other, writer = _expired_while_held(durable_location, POLICIES[placement], shard)
    before = other._machine(shard).fetch_latest()
    parts_before = _part_keys(other, shard)
    with pytest.raises(LeaseExpired):
        writer.compare_and_append([(b"k", b"v" * 100, 1, 1)], 1, 2)
    after = other._machine(shard).fetch_latest()
    assert writer.writer_id not in after.writers, "the expired writer registered again"
    assert after.upper == 1 and after.batches.keys() == before.batches.keys()
    assert _part_keys(other, shard) == parts_before  # certainly refused: parts deleted
    with pytest.raises(LeaseExpired):  # as the same write is once the handle is expired
        writer.compare_and_append([(b"k", b"v" * 100, 1, 1)], 1, 2)
    client.close()
    other.close()


@pytest.mark.parametrize("placement", list(POLICIES))
def test_threads_racing_expire_against_queued_appends_never_bring_a_writer_back(
        durable_location: Location, placement: str):
    """Threads append through their own handles (their appends queue in the funnel
    behind each other's groups) while another thread expires each handle at some point
    of its run. Every append either commits before its handle's expiry or is refused
    with ``LeaseExpired``; afterwards no expired writer is in any shard's state, and
    each shard holds exactly the rows of the appends that were acknowledged."""
    policy = POLICIES[placement]
    client = durable_location.client(policy, PersistConfig(group_commit_window_s=0.002))
    n, rounds = 4, 12
    shards = [str(ShardId.new()) for _ in range(n)]
    writers = [client.open_writer(s) for s in shards]
    acked: list[list[int]] = [[] for _ in range(n)]
    refused: list[int] = [0] * n
    errors: list[BaseException] = []
    started = threading.Barrier(n + 1)

    def append(i: int) -> None:
        started.wait()
        for r in range(rounds):
            try:
                writers[i].compare_and_append([(b"r%d" % r, b"v" * 100, r, 1)], r, r + 1)
            except LeaseExpired:
                refused[i] += 1
                return
            except BaseException as e:  # asserted below
                errors.append(e)
                return
            acked[i].append(r)

    def expire_all() -> None:
        started.wait()
        for i, w in enumerate(writers):
            # Each handle at another point of its run: after 0, 3, 6, ... appends of it.
            while len(acked[i]) < min(3 * i, rounds) and not errors:
                client.clock.sleep(0.0005)
            w.expire()

    threads = [threading.Thread(target=append, args=(i,)) for i in range(n)]
    threads.append(threading.Thread(target=expire_all))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and errors == []
    other = durable_location.client(policy)
    for i, shard in enumerate(shards):
        state = other._machine(shard).fetch_latest()
        assert writers[i].writer_id not in state.writers, f"writer {i} registered again"
        assert state.upper == len(acked[i])
        assert acked[i] == list(range(len(acked[i])))
        if state.upper:
            reader = other.open_reader(shard)
            try:
                got = sorted(r["k"] for r in reader.snapshot(state.upper - 1).to_pylist())
            finally:
                reader.expire()
            assert got == sorted(b"r%d" % r for r in acked[i])
    assert sum(refused) + sum(len(a) == rounds for a in acked) == n
    client.close()
    other.close()


class _LoseAppendReply(ForwardingConsensus):
    """Loses the reply of the next compare-and-set once armed (after it ran when
    ``landed``, instead of running it otherwise), running a hook first."""

    def __init__(self, inner: Consensus, landed: bool) -> None:
        super().__init__(inner)
        self.landed = landed
        self.hook: Callable[[], None] | None = None

    def compare_and_set(self, shard: str, expected: int | None, new: Any) -> bool:
        hook, self.hook = self.hook, None
        if hook is None:
            return self.inner.compare_and_set(shard, expected, new)
        if self.landed:
            assert self.inner.compare_and_set(shard, expected, new)
        hook()
        raise ConsensusUnavailable("the reply was lost")


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_an_append_whose_reply_is_lost_while_its_handle_is_expired(
        durable_location: Location, landed: bool):
    """An append's compare-and-set loses its reply, and another thread expires the
    handle before the commit loop settles it. One that landed is reported committed
    (its rows there); one that did not is never re-run into a commit through the
    expired handle: the outcome is unknown (``Indeterminate``, nothing at its seqno
    yet) and nothing is written. Either way, once the expiry commits, the writer is not
    in the state."""
    lossy = _LoseAppendReply(open_consensus(durable_location.consensus_uri), landed)
    client = client_on_clock(durable_location, HandClock(), POLICIES["inline"],
                             consensus=lossy)
    shard = str(ShardId.new())
    writer = client.open_writer(shard)
    expirer = threading.Thread(target=writer.expire)

    def expire_while_unsettled() -> None:
        expirer.start()  # closes the handle at once, then waits for the commit loop
        while not writer._closed:
            threading.Event().wait(0.001)

    lossy.hook = expire_while_unsettled
    if landed:
        result = writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
        assert result.upper == 1
    else:
        with pytest.raises(Indeterminate):
            writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    expirer.join(timeout=60)
    assert not expirer.is_alive()
    other = durable_location.client()
    state = other._machine(shard).fetch_latest()
    assert writer.writer_id not in state.writers
    assert state.upper == (1 if landed else 0)
    if landed:
        reader = other.open_reader(shard)
        try:
            assert [(r["k"], r["d"]) for r in reader.snapshot(0).to_pylist()] == [(b"k", 1)]
        finally:
            reader.expire()
    client.close()
    other.close()


@pytest.mark.parametrize("placement", list(POLICIES))
def test_a_write_refused_for_its_expired_handle_is_retried_once_through_a_fresh_one(
        durable_location: Location, placement: str):
    """The write refused with ``LeaseExpired`` while it waited in the funnel left
    nothing that could still land: the expired handle answers nothing more (its
    ``committed`` is refused as its writes are), a fresh handle reports the token's
    write not committed at its ``expected_upper``, and the same write retried through
    it with the same token commits once (its rows read back once; a second retry is
    reported already committed)."""
    shard = str(ShardId.new())
    client, other, writer = _expired_while_held(durable_location, POLICIES[placement], shard)
    token = "t" * 32
    rows = [(b"k", b"v" * 100, 1, 1)]
    with pytest.raises(LeaseExpired):
        writer.compare_and_append(rows, 1, 2, idempotency_token=token)
    with pytest.raises(LeaseExpired):
        writer.committed(token, 1)
    fresh = other.open_writer(shard)
    assert fresh.committed(token, 1) is False
    result = fresh.compare_and_append(rows, 1, 2, idempotency_token=token)
    assert not result.already_committed and result.upper == 2
    again = fresh.compare_and_append(rows, 1, 2, idempotency_token=token)
    assert again.already_committed and again.upper == 2
    assert fresh.committed(token, 1) is True
    reader = other.open_reader(shard)
    got = sorted((r["k"], r["d"]) for r in reader.snapshot(1).to_pylist())
    assert got == [(b"base", 1), (b"k", 1)]
    reader.expire()
    fresh.expire()
    client.close()
    other.close()


@pytest.mark.parametrize("placement", list(POLICIES))
def test_a_transaction_whose_handle_is_expired_as_it_commits_changes_nothing(
        durable_location: Location, placement: str, monkeypatch: pytest.MonkeyPatch):
    """A writer handle given to a transaction is expired after the commit checked it
    open and staged its append, before the compare-and-set: the commit is refused with
    ``LeaseExpired`` (the append transition asks the handle), no shard changes, the
    expired writer is not registered again, and the parts staged for the commit (its
    own fresh keys, certainly not committed) are deleted, as a single write's are."""
    from persist_pipeline.transaction import Transaction

    policy = POLICIES[placement]
    client = durable_location.client(policy)
    shards = [str(ShardId.new()) for _ in range(2)]
    for s in shards:
        with client.open_writer(s) as first:
            first.compare_and_append([(b"base", b"", 0, 1)], 0, 1)
    writer = client.open_writer(shards[0])
    staging = Transaction._stage_all

    def stage_then_expire(live: Any, ops: Any) -> None:
        staging(live, ops)
        writer.expire()

    monkeypatch.setattr(Transaction, "_stage_all", staticmethod(stage_then_expire))
    before = {s: client._machine(s).fetch_latest() for s in shards}
    parts_before = {s: _part_keys(client, s) for s in shards}
    txn = client.transaction()
    txn.compare_and_append(writer, [(b"a", b"v" * 100, 1, 1)], 1, 2)
    txn.compare_and_append(shards[1], [(b"b", b"v" * 100, 1, 1)], 1, 2)
    with pytest.raises(LeaseExpired):
        txn.commit()
    for s in shards:
        after = client._machine(s).fetch_latest()
        assert after.upper == 1 and after.batches.keys() == before[s].batches.keys()
        assert writer.writer_id not in after.writers, "the expired writer registered again"
        assert _part_keys(client, s) == parts_before[s]  # certainly refused: parts deleted
    client.close()
