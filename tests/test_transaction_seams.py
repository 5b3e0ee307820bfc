"""Transactions and single writes where they meet retries, expired handles, GC's orphan
sweep and group commit, on every location kind (SQLite + files, PostgreSQL + S3 with
and without a WAL store).

A write retried with the token of an attempt that landed (its process never learnt the
outcome) uploads its parts again before its commit finds the batch already there: those
parts are certainly never committed (a batch id lands once, and every staging writes
fresh keys), so they are deleted at once, as a refused write's are, rather than left in
the store until GC's orphan sweep. The parts of the attempt that landed are kept.

A commit refused before it starts (an expired handle) creates no shard; one paused past
the orphan age while GC sweeps one of its shards lands in none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import CasWrite, Consensus
from persist_pipeline.exceptions import CommitDeadlineExceeded, LeaseExpired
from tests.fixtures.location import Location
from tests.helpers import ForwardingConsensus, HandClock, client_on_clock, rows
from tests.test_regressions_lost_replies import Clients
from tests.test_transaction import pair_losing_a_reply_after_gc

BLOB = InlinePolicy(0, 0)  # every write uploads parts before its commit


def _part_keys(client: PersistClient) -> set[str]:
    stores = [client.blobs.main] + ([client.blobs.wal] if client.blobs.wal else [])
    return {m.key for s in stores for m in s.list_keys("") if "/p/" in m.key}


def _rows(client: PersistClient, shard: Any) -> list[tuple[bytes, bytes, int]]:
    reader = client.open_reader(shard)
    try:
        upper = client._machine(reader.shard_id).fetch_latest().upper
        return rows(reader.snapshot(upper - 1))
    finally:
        reader.expire()


def _referenced(client: PersistClient, shard: Any) -> set[str]:
    state = client._machine(str(shard)).fetch_latest()
    return {key for _, key in state.referenced_blobs() if "/p/" in key}


@pytest.mark.parametrize("compacted", [False, True], ids=["in-state", "merged-away"])
def test_a_retried_transaction_that_landed_leaves_no_parts_of_its_own(
        location: Location, compacted: bool) -> None:
    """A transaction committed with recorded tokens, retried with them through fresh
    writers: the retry is reported committed, the rows are there once, and the parts the
    retry uploaded are gone, whether it found the batches in the shards' state or (after
    compaction merged them away) in their history; the committed parts are kept."""
    client = location.client(BLOB)
    a, b = ShardId.new(), ShardId.new()

    def commit() -> dict[str, Any]:
        txn = client.transaction()
        txn.compare_and_append(a, [(b"x", b"1", 0, 1)], 0, 1, idempotency_token="ta")
        txn.compare_and_append(b, [(b"y", b"2", 0, 1)], 0, 1, idempotency_token="tb")
        return txn.commit()

    first = commit()  # ...whose reply its process never saw
    assert not any(r.already_committed for r in first.values())
    if compacted:
        for s in (a, b):
            with client.open_writer(s) as w:  # a second batch for compaction to merge
                w.compare_and_append([(b"z", b"", 1, 1)], 1, 2)
            assert client.compact(s)["applied"] >= 1
            assert "bta" not in client._machine(str(s)).fetch_latest().batches
            assert "btb" not in client._machine(str(s)).fetch_latest().batches
    before = _part_keys(client)
    again = commit()
    assert all(r.already_committed for r in again.values())
    assert _part_keys(client) == before, "the retry left parts nothing references"
    for s, key, value in ((a, b"x", b"1"), (b, b"y", b"2")):
        assert (key, value, 1) in _rows(client, s)
        assert _referenced(client, s) <= _part_keys(client)
    client.close()


@pytest.mark.parametrize("group_commit", [True, False], ids=["funnel", "alone"])
def test_a_retried_write_that_landed_leaves_no_parts_of_its_own(
        location: Location, group_commit: bool) -> None:
    """A single write retried with its token after it landed (through the client's
    group-commit funnel or alone): reported committed, its rows there once, and the
    parts the retry uploaded deleted; the committed ones kept and readable."""
    client = location.client(BLOB)
    if not group_commit:
        client._funnel = None
    shard = ShardId.new()
    writer = client.open_writer(shard)
    if not group_commit:
        writer._funnel = None
    assert not writer.compare_and_append([(b"x", b"1", 0, 1)], 0, 1,
                                         idempotency_token="t1").already_committed
    before = _part_keys(client)
    retry = writer.compare_and_append([(b"x", b"1", 0, 1)], 0, 1, idempotency_token="t1")
    assert retry.already_committed
    assert _part_keys(client) == before, "the retry left parts nothing references"
    # Another writer (another process's retry) is settled alike.
    other = client.open_writer(shard)
    assert other.compare_and_append([(b"x", b"1", 0, 1)], 0, 1,
                                    idempotency_token="t1").already_committed
    assert _part_keys(client) == before
    assert _rows(client, shard) == [(b"x", b"1", 1)]
    assert _referenced(client, shard) <= _part_keys(client)
    client.close()


@pytest.mark.parametrize("new", ["id", "name"])
def test_a_commit_refused_for_an_expired_writer_creates_no_shard(
        location: Location, new: str) -> None:
    """A transaction whose writer handle was expired after its append was added is
    refused at commit (``LeaseExpired``) before anything is done: the shard it would
    have created for an append to a new id or name is not created (nor the name
    registered), and the other shards keep their uppers."""
    client = location.client(BLOB)
    a = ShardId.new()
    wa = client.open_writer(a)
    fresh = str(ShardId.new())
    txn = client.transaction()
    txn.compare_and_append(wa, [(b"k", b"v", 0, 1)], 0, 1)
    txn.compare_and_append(fresh if new == "id" else "orders/new",
                           [(b"k", b"v", 0, 1)], 0, 1)
    wa.expire()
    before = _part_keys(client)
    with pytest.raises(LeaseExpired):
        txn.commit()
    other = location.client()
    assert other.list_shards() == [str(a)]
    assert other.shard_names() == {}
    assert other._machine(str(a)).fetch_latest().upper == 0
    assert _part_keys(other) == before
    other.close()
    client.close()


class _BeforeNextCasMany(ForwardingConsensus):
    """Runs a hook right before the next multi-shard compare-and-set, once armed: a
    process paused between computing a transaction's commit and sending it."""

    def __init__(self, inner: Consensus) -> None:
        super().__init__(inner)
        self._hook: Callable[[], None] | None = None

    def arm(self, hook: Callable[[], None]) -> None:
        self._hook = hook

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        return self.inner.compare_and_set_many(writes)


ORPHAN_AGE_S = 120.0


@pytest.mark.parametrize("swept", [0, 1], ids=["first-shard", "second-shard"])
def test_a_transaction_paused_past_the_orphan_age_while_gc_sweeps_one_shard_lands_nowhere(
        location: Location, swept: int) -> None:
    """A transaction computes its commit in time, then pauses before its compare-and-set
    past the orphan age while GC sweeps one of its shards (committing only its fence
    there: a reader holds an older seqno) and deletes the parts staged for it. The
    fence alone makes the one statement fail for every shard, and its re-run refuse the
    whole transaction for the deadline: no shard moves, no version references a deleted
    part, and the parts staged for the shard GC did not sweep are deleted too."""
    cfg = PersistConfig(inline_policy=BLOB, gc_orphan_min_age_s=ORPHAN_AGE_S,
                        heartbeat_interval_s=0)
    clock = HandClock()
    paused = _BeforeNextCasMany(open_consensus(location.consensus_uri))
    writer_client = client_on_clock(location, clock, config=cfg, consensus=paused)
    collector = client_on_clock(location, clock, config=cfg)
    shards = [ShardId.new(), ShardId.new()]
    writers = [writer_client.open_writer(s) for s in shards]
    for w in writers:
        w.compare_and_append([(b"a", b"b", 0, 1)], 0, 1)
    reader = collector.open_reader(shards[swept])  # holds this seqno under the sweep
    before = _part_keys(collector)
    metrics: list[dict[str, Any]] = []

    def gc_while_paused() -> None:
        clock.advance(ORPHAN_AGE_S + 1 + writer_client.blobs.main.stamp_resolution_s)
        metrics.append(collector.gc(shards[swept]))

    paused.arm(gc_while_paused)
    txn = writer_client.transaction()
    for w in writers:
        txn.compare_and_append(w, [(b"late", b"x", 1, 1)], 1, 2)
    with pytest.raises(CommitDeadlineExceeded):
        txn.commit()
    assert metrics and metrics[0]["orphans_deleted"] == 1  # the swept shard's staged part
    for shard in shards:
        state = collector._machine(str(shard)).fetch_latest()
        assert state.upper == 1
        assert _referenced(collector, shard) <= _part_keys(collector)
        assert _rows(collector, shard) == [(b"a", b"b", 1)]
    assert _part_keys(collector) == before, "a part staged by the refused commit is left"
    assert rows(reader.snapshot(0), 0) == [(b"a", b"b", 1)]
    for client in (writer_client, collector):
        client.close()


@pytest.mark.parametrize("through", ["transaction", "write"])
def test_a_lost_reply_settled_from_history_keeps_the_parts_that_landed(
        location: Location, through: str) -> None:
    """A commit of blob parts lands; its process pauses past its writers' leases, GC
    expires them and truncates the records that would settle it; then its reply is
    lost. Settled from the batch found in the shard's state, it is reported committed,
    and that batch's parts, this very commit's, are kept: a fresh process reads the
    rows, and every part the shards reference is in the store."""
    clients = Clients(location)
    try:
        client, lossy, a, b, wa, wb, _ = pair_losing_a_reply_after_gc(clients, location)
        if through == "transaction":
            txn = client.transaction()
            txn.compare_and_append(wa, [(b"x", b"1", 1, 1)], 1, 2)
            txn.compare_and_append(wb, [(b"y", b"2", 1, 1)], 1, 2)
            results = list(txn.commit().values())
        else:
            results = [wa.compare_and_append([(b"x", b"1", 1, 1)], 1, 2)]
        assert lossy.lost == 1
        assert all(r.upper == 2 for r in results)
        reader = clients.plain()
        assert (b"x", b"1", 1) in _rows(reader, a)
        if through == "transaction":
            assert (b"y", b"2", 1) in _rows(reader, b)
        for shard in (a, b):
            assert _referenced(reader, shard) <= _part_keys(reader)
    finally:
        clients.close()
