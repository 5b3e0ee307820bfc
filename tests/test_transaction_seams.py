"""Transactions and single writes where they meet retries, expired handles, GC's orphan
sweep and group commit, on every location kind (SQLite + files, PostgreSQL + S3 with
and without a WAL store).

A write retried with the token of an attempt that landed (its process never learnt the
outcome) uploads its parts again before its commit finds the batch already there: those
parts are certainly never committed (a batch id lands once, and every staging writes
fresh keys), so they are deleted at once, as a refused write's are, rather than left in
the store until GC's orphan sweep. The parts of the attempt that landed are kept.

A commit refused before it starts (an expired handle) creates no shard; one paused past
the orphan age while GC sweeps one of its shards lands in none. A commit's new shards
are created all together or none, after the checks that may refuse it (another client
typing one, registering one of its names, or an upper already moved past), also when
the creation's reply is lost; one refused after creating them leaves them empty and
unnamed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import (
    InlinePolicy,
    PersistClient,
    PersistConfig,
    SchemaMismatch,
    ShardId,
    ShardSchema,
    UntypedUpdates,
    UpperMismatch,
)
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import CasWrite, Consensus
from persist_pipeline.exceptions import CommitDeadlineExceeded, ConsensusUnavailable, LeaseExpired
from persist_pipeline.names import registry_key
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


class _BeforeCreating(ForwardingConsensus):
    """Runs a hook once, right before the first compare-and-set (single or multi-shard)
    that would create the record of ``key``: a transaction paused between adding its
    appends to new shards and creating them."""

    def __init__(self, inner: Consensus) -> None:
        super().__init__(inner)
        self.key = ""
        self._hook: Callable[[], None] | None = None

    def arm(self, key: str, hook: Callable[[], None]) -> None:
        self.key, self._hook = key, hook

    def _before(self, writes: Sequence[CasWrite]) -> None:
        if self._hook is not None and any(
                w.shard == self.key and w.expected is None for w in writes):
            hook, self._hook = self._hook, None
            hook()

    def compare_and_set(self, shard: str, expected: int | None, new: Any) -> bool:
        self._before([CasWrite(shard, expected, new)])
        return self.inner.compare_and_set(shard, expected, new)

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        self._before(writes)
        return self.inner.compare_and_set_many(writes)


TYPED = ShardSchema(pa.schema([("id", pa.int64())]), pa.schema([]))


def _two_new_shards(location: Location) -> tuple[PersistClient, PersistClient,
                                                  _BeforeCreating]:
    """A client whose consensus runs a hook before it creates a shard, and another."""
    hooked = _BeforeCreating(open_consensus(location.consensus_uri))
    client = client_on_clock(location, HandClock(), BLOB, consensus=hooked)
    return client, location.client(BLOB), hooked


@pytest.mark.parametrize("when", ["before-commit", "mid-commit"])
def test_a_transaction_to_two_new_ids_refused_for_the_second_creates_neither(
        location: Location, when: str) -> None:
    """Appends to two shard ids no shard has yet; another client creates and types the
    second (after the appends were added, or while the commit is about to create the
    shards). The untyped append to it is refused (``SchemaMismatch``) and the first
    shard is not created either: all or nothing, also for which shards exist."""
    client, other, hooked = _two_new_shards(location)
    first, second = str(ShardId.new()), str(ShardId.new())
    txn = client.transaction()
    txn.compare_and_append(first, [(b"k", b"v", 0, 1)], 0, 1)
    txn.compare_and_append(second, [(b"k", b"v", 0, 1)], 0, 1)

    def type_second() -> None:
        other.open_writer(second, schema=TYPED).expire()

    if when == "before-commit":
        type_second()
    else:
        hooked.arm(first, type_second)
    before = _part_keys(other)
    with pytest.raises(SchemaMismatch):
        txn.commit()
    assert other.list_shards() == [second], "the refused transaction created a shard"
    assert other.schema(second) == TYPED and other.inspect(second)["upper"] == 0
    assert _part_keys(other) == before
    client.close()
    other.close()


@pytest.mark.parametrize("how", ["tuples", "table", "append"])
@pytest.mark.parametrize("when", ["before-commit", "mid-commit"])
def test_an_untyped_append_to_a_new_id_typed_meanwhile_is_refused_also_when_its_bytes_decode(
        location: Location, when: str, how: str) -> None:
    """An untyped append (``(key, val, ts, diff)`` tuples, a ``k``/``v`` table, or an
    ``append``) to a shard id no shard has yet, which another client creates and types
    before the commit creates it: refused with ``SchemaMismatch`` (``UntypedUpdates``
    for tuples) as the same updates given to a typed writer are, also when its key and value bytes
    happen to be valid encodings of rows of the schema (taken as typed rows, they would
    land in the typed shard as rows nobody wrote as such). Nothing is written, no shard
    of the transaction is created, and its typed shard stays empty."""
    client, other, hooked = _two_new_shards(location)
    first, second = str(ShardId.new()), str(ShardId.new())
    encoded = TYPED.to_updates(pa.table({"id": [7], "t": [0], "d": [1]})).table()
    key, val = encoded.column("k")[0].as_py(), encoded.column("v")[0].as_py()
    updates: Any = [(key, val, 0, 1)] if how != "table" else pa.table(
        {"k": [key], "v": [val], "t": [0], "d": [1]},
        schema=pa.schema([("k", pa.binary()), ("v", pa.binary()), ("t", pa.int64()),
                          ("d", pa.int64())]))
    # What a typed writer answers to them: tuples are untyped updates, a k/v table's
    # columns are not the schema's.
    refusal = SchemaMismatch if how == "table" else UntypedUpdates
    typed_writer = other.open_writer(ShardId.new(), schema=TYPED)
    with pytest.raises(refusal):
        typed_writer.compare_and_append(updates, 0, 1)
    typed_writer.expire()
    txn = client.transaction()
    txn.compare_and_append(first, [(b"k", b"v", 0, 1)], 0, 1)
    if how == "append":
        txn.append(second, updates, 0, 1)
    else:
        txn.compare_and_append(second, updates, 0, 1)

    def type_second() -> None:
        other.open_writer(second, schema=TYPED).expire()

    if when == "before-commit":
        type_second()
    else:
        hooked.arm(first, type_second)
    shards = set(other.list_shards())
    before = _part_keys(other)
    with pytest.raises(refusal):
        txn.commit()
    assert set(other.list_shards()) == shards | {second}, "the refused commit created a shard"
    state = other._machine(second).fetch_latest()
    assert other.schema(second) == TYPED
    assert state.upper == 0 and not state.batches, "untyped rows landed in a typed shard"
    assert _part_keys(other) == before
    client.close()
    other.close()


def test_a_transaction_to_two_new_names_refused_for_the_second_creates_neither(
        location: Location) -> None:
    """Appends to two names no shard has yet; another client registers the second
    before the commit. The commit is refused (``UpperMismatch`` naming it) before it
    creates any shard: no shard of the transaction, and no name of it, is left."""
    client, other, _ = _two_new_shards(location)
    txn = client.transaction()
    txn.compare_and_append("orders/a", [(b"k", b"v", 0, 1)], 0, 1)
    txn.compare_and_append("orders/b", [(b"k", b"v", 0, 1)], 0, 1)
    theirs = other.resolve("orders/b", create=True)
    with pytest.raises(UpperMismatch) as refused:
        txn.commit()
    assert refused.value.shard == "orders/b"
    assert other.shard_names() == {"orders/b": theirs}
    assert set(other.list_shards()) <= {str(theirs)}
    client.close()
    other.close()


def test_new_shards_left_by_a_commit_refused_after_creating_them_are_empty_and_unnamed(
        location: Location) -> None:
    """What may remain (see docs/design.md, Transactions): a commit refused by its own
    compare-and-set after it created its new shards (here: another client registers
    one of its names just before that compare-and-set) leaves each of them empty
    (upper 0, no updates, no schema) and unnamed; its parts are deleted."""
    client, other, hooked = _two_new_shards(location)
    fresh = str(ShardId.new())
    txn = client.transaction()
    txn.compare_and_append(fresh, [(b"k", b"v", 0, 1)], 0, 1)
    txn.compare_and_append("orders/c", [(b"k", b"v", 0, 1)], 0, 1)
    ours = txn._new_names["orders/c"]
    hooked.arm(registry_key("orders/c"), lambda: other.resolve("orders/c", create=True))
    before = _part_keys(other)
    with pytest.raises(UpperMismatch) as refused:
        txn.commit()
    assert refused.value.shard == "orders/c"
    theirs = str(other.resolve("orders/c"))
    assert theirs != ours and other.shard_names() == {"orders/c": ShardId.parse(theirs)}
    left = set(other.list_shards()) - {theirs}
    assert left == {fresh, ours}
    for shard in left:
        state = other._machine(shard).fetch_latest()
        assert state.upper == 0 and not state.batches and not state.schema
    assert _part_keys(other) == before
    client.close()
    other.close()


class _LoseCreationReply(ForwardingConsensus):
    """Loses the reply of the first multi-shard compare-and-set that creates records:
    after it ran (``landed``) or instead of running it."""

    def __init__(self, inner: Consensus, landed: bool) -> None:
        super().__init__(inner)
        self.landed = landed
        self.lost = 0

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        if self.lost or not all(w.expected is None for w in writes):
            return self.inner.compare_and_set_many(writes)
        self.lost += 1
        if self.landed:
            self.inner.compare_and_set_many(writes)
        raise ConsensusUnavailable("the reply was lost")


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_a_lost_reply_creating_two_new_shards_is_settled_and_the_commit_lands_once(
        location: Location, landed: bool) -> None:
    """The one compare-and-set creating a transaction's two new shards loses its reply,
    having created both or neither: the commit settles it by the shards' records (sent
    again when neither exists) and lands once in both."""
    lossy = _LoseCreationReply(open_consensus(location.consensus_uri), landed)
    client = client_on_clock(location, HandClock(), BLOB, consensus=lossy)
    first, second = str(ShardId.new()), str(ShardId.new())
    with client.transaction() as txn:
        txn.compare_and_append(first, [(b"a", b"1", 0, 1)], 0, 1)
        txn.compare_and_append(second, [(b"b", b"2", 0, 1)], 0, 1)
    assert lossy.lost == 1
    other = location.client(BLOB)
    assert sorted(other.list_shards()) == sorted([first, second])
    assert _rows(other, first) == [(b"a", b"1", 1)]
    assert _rows(other, second) == [(b"b", b"2", 1)]
    other.close()
    client.close()


@pytest.mark.parametrize("new", ["id", "name"])
def test_a_commit_certain_to_be_refused_for_a_stale_upper_creates_no_shard(
        location: Location, new: str) -> None:
    """A transaction appending to a new shard (id or name) and, at an upper that has
    moved past, to an existing one: refused (``UpperMismatch`` naming the existing
    shard) before the new shard is created, since uppers never go back; nothing is
    left, and the existing shard is as it was."""
    client = location.client(BLOB)
    existing = ShardId.new()
    with client.open_writer(existing) as w:
        w.compare_and_append([(b"x", b"", 0, 1)], 0, 1)
    fresh = str(ShardId.new())
    with pytest.raises(UpperMismatch) as refused, client.transaction() as txn:
        txn.compare_and_append(fresh if new == "id" else "orders/stale",
                               [(b"k", b"v", 0, 1)], 0, 1)
        txn.compare_and_append(existing, [(b"k", b"v", 0, 1)], 0, 1)
    assert refused.value.shard == str(existing) and refused.value.current == 1
    other = location.client()
    assert other.list_shards() == [str(existing)] and other.shard_names() == {}
    assert _rows(other, existing) == [(b"x", b"", 1)]
    other.close()
    client.close()
