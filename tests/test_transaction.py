"""Atomic multi-shard transactions: all or nothing, one consensus round trip.

The API tests run on the ``open_client`` matrix (every inline setting; SQLite + files,
PostgreSQL + S3, with and without a WAL store); the racing, lost-reply and killed-process
tests on the durable locations.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import (
    InlinePolicy,
    PersistClient,
    ShardId,
    ShardSchema,
    UpperMismatch,
    WriteHandle,
)
from persist_pipeline.blob import open_blob
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.faults import FaultConfig, FaultyConsensus
from persist_pipeline.exceptions import (
    Indeterminate,
    InvalidFrontier,
    InvalidInput,
    InvalidUpdates,
    LeaseExpired,
    SchemaMismatch,
)
from tests.fixtures.location import Location, location_kinds, make_location
from tests.helpers import process_context, rows, wait_until
from tests.test_regressions_lost_replies import (
    NO_INLINE,
    PAUSE_S,
    SHORT_LEASE_S,
    Clients,
    LoseNextReply,
)


def snapshot_rows(client: PersistClient, shard: Any) -> list[tuple[bytes, bytes, int]]:
    reader = client.open_reader(shard)
    try:
        upper = client._machine(reader.shard_id).fetch_latest().upper
        return [] if not upper else rows(reader.snapshot(upper - 1))
    finally:
        reader.expire()


def two_shards(client: PersistClient) -> tuple[ShardId, ShardId, Any, Any]:
    """Two fresh shards and a writer of each."""
    a, b = ShardId.new(), ShardId.new()
    return a, b, client.open_writer(a), client.open_writer(b)


def uppers(client: PersistClient, *shards: Any) -> list[Any]:
    return [client._machine(s).fetch_latest().upper for s in shards]


def blob_keys(client: PersistClient) -> set[str]:
    keys = {m.key for m in client.blobs.main.list_keys("")}
    if client.blobs.wal is not None:
        keys |= {m.key for m in client.blobs.wal.list_keys("")}
    return keys


def test_a_transaction_commits_every_shard_at_once(open_client):
    client = open_client()
    a, b, wa, wb = two_shards(client)
    heads = [client.consensus.head(str(s)) for s in (a, b)]
    with client.transaction() as txn:
        txn.compare_and_append(wa, [(b"order", b"1", 0, 1)], 0, 1)
        txn.compare_and_append(wb, [(b"line", b"1", 0, 1), (b"line", b"2", 0, 1)], 0, 1)
        assert txn.shards == [str(a), str(b)]
    # Each shard advanced by exactly one record: the transaction's.
    after = [client.consensus.head(str(s)) for s in (a, b)]
    assert [h.seqno for h in after] == [h.seqno + 1 for h in heads]  # type: ignore[union-attr]
    assert snapshot_rows(client, a) == [(b"order", b"1", 1)]
    assert snapshot_rows(client, b) == [(b"line", b"1", 1), (b"line", b"2", 1)]
    assert wa.upper == wb.upper == 1

    txn = client.transaction()
    txn.append(a, [(b"order", b"2", 1, 1)], 1, 2)  # by id: the transaction opens a writer
    txn.compare_and_append(wb, [], 1, 3)
    results = txn.commit()
    assert set(results) == {str(a), str(b)}
    assert results[str(a)].upper == 2 and results[str(a)].num_updates == 1
    assert results[str(b)].upper == 3 and results[str(b)].placement == "none"
    # A second client sees both shards' writes.
    other = open_client()
    assert snapshot_rows(other, a) == [(b"order", b"1", 1), (b"order", b"2", 1)]
    assert uppers(other, a, b) == [2, 3]


def test_an_upper_mismatch_on_one_shard_changes_no_shard(open_client):
    client = open_client()
    a, b, wa, wb = two_shards(client)
    wb.compare_and_append([(b"x", b"", 0, 1)], 0, 1)
    before = blob_keys(client)
    big = [(f"k{i}".encode(), b"v" * 200, 0, 1) for i in range(50)]  # blob-sized
    txn = client.transaction()
    txn.compare_and_append(wa, big, 0, 1)
    txn.compare_and_append(wb, [(b"y", b"", 0, 1)], 0, 1)
    with pytest.raises(UpperMismatch) as info:
        txn.commit()
    assert info.value.shard == str(b) and info.value.current == 1
    assert str(b) in str(info.value)
    assert uppers(client, a, b) == [0, 1]
    assert snapshot_rows(client, b) == [(b"x", b"", 1)]
    # The parts uploaded for the refused commit were deleted.
    assert blob_keys(client) - before == set()


def test_a_replace_of_a_closed_shard_deletes_the_parts_staged_before_it(open_client):
    """A replacement planned at commit finds its shard closed: the transaction raises
    InvalidFrontier, no shard changes, and the parts the other appends had uploaded are
    deleted at once (not left for GC's orphan sweep)."""
    client = open_client()
    schema = ShardSchema(pa.schema([("id", pa.int64())]), pa.schema([("qty", pa.int64())]))
    a, b = ShardId.new(), ShardId.new()
    wa, wb = client.open_writer(a), client.open_writer(b, schema=schema)
    wb.replace_contents(pa.table({"id": [1], "qty": [1]}))
    empty = pa.table({c: pa.array([], pa.int64()) for c in ("id", "qty", "t", "d")})
    wb.compare_and_append(empty, 1, None)  # closed for good
    before = blob_keys(client)
    big = [(f"k{i}".encode(), b"v" * 200, 0, 1) for i in range(50)]  # blob-sized
    txn = client.transaction()
    txn.compare_and_append(wa, big, 0, 1)
    txn.replace_contents(wb, pa.table({"id": [2], "qty": [2]}))
    with pytest.raises(InvalidFrontier):
        txn.commit()
    assert uppers(client, a, b) == [0, None]
    assert blob_keys(client) - before == set()


def test_a_replace_whose_shard_is_closed_while_it_commits_is_refused_as_closed(
        tmp_path: Path):
    """A shard closed (the CLI's append --new-upper closed) between a transaction's
    planning and its commit refuses its replacement as a closed shard (InvalidFrontier),
    as when it was closed before, and as a single replace_contents (the IO manager's one
    store) refuses it: not as a mismatch to retry. No shard changes."""
    from tests.helpers import ForwardingConsensus

    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    schema = ShardSchema(pa.schema([("id", pa.int64())]), pa.schema([("qty", pa.int64())]))
    empty = pa.table({c: pa.array([], pa.int64()) for c in ("id", "qty", "t", "d")})
    closer = PersistClient.open(consensus, blob)
    a, b = ShardId.new(), ShardId.new()
    closer.open_writer(a, schema=schema).replace_contents(pa.table({"id": [1], "qty": [1]}))
    closer.open_writer(b, schema=schema).replace_contents(pa.table({"id": [1], "qty": [1]}))
    closing: list[ShardId] = []

    class ClosesFirst(ForwardingConsensus):
        def compare_and_set_many(self, writes: Any) -> bool:
            while closing:  # another client closes the shard just before this commit
                closer.open_writer(closing.pop()).compare_and_append(empty, 1, None)
            return super().compare_and_set_many(writes)

        def compare_and_set(self, *args: Any) -> bool:
            while closing:
                closer.open_writer(closing.pop()).compare_and_append(empty, 1, None)
            return super().compare_and_set(*args)

    client = PersistClient(ClosesFirst(open_consensus(consensus)), open_blob(blob))
    txn = client.transaction()
    txn.replace_contents(client.open_writer(a), pa.table({"id": [2], "qty": [2]}))
    txn.replace_contents(client.open_writer(b), pa.table({"id": [2], "qty": [2]}))
    closing.append(b)
    with pytest.raises(InvalidFrontier, match="closed"):
        txn.commit()
    assert uppers(client, a, b) == [1, None]
    single = client.open_writer(a)
    closing.append(a)
    with pytest.raises(InvalidFrontier, match="closed"):
        single.replace_contents(pa.table({"id": [3], "qty": [3]}))
    client.close()
    closer.close()


def test_an_exception_in_the_block_commits_nothing(open_client):
    client = open_client()
    a, b, wa, wb = two_shards(client)
    with pytest.raises(RuntimeError, match="boom"), client.transaction() as txn:
        txn.compare_and_append(wa, [(b"k", b"", 0, 1)], 0, 1)
        txn.compare_and_append(wb, [(b"k", b"", 0, 1)], 0, 1)
        raise RuntimeError("boom")
    assert uppers(client, a, b) == [0, 0]
    with pytest.raises(InvalidInput, match="already been committed or aborted"):
        txn.commit()


def test_bad_input_is_refused_and_changes_nothing(open_client):
    client = open_client()
    a, b, wa, wb = two_shards(client)
    txn = client.transaction()
    with pytest.raises(InvalidInput, match="empty transaction"):
        txn.commit()
    txn = client.transaction()
    txn.compare_and_append(wa, [(b"k", b"", 0, 1)], 0, 1)
    with pytest.raises(InvalidInput, match="appears twice"):
        txn.compare_and_append(wa, [(b"j", b"", 0, 1)], 0, 1)
    with pytest.raises(InvalidInput, match="appears twice"):
        txn.append(str(a), [(b"j", b"", 0, 1)], 0, 1)
    with pytest.raises(InvalidUpdates):
        txn.compare_and_append(wb, [(b"k", b"", 5, 1)], 0, 1)  # time beyond new_upper
    with pytest.raises(InvalidFrontier):
        txn.compare_and_append(wb, [], 1, 1)
    with pytest.raises(InvalidFrontier):
        txn.compare_and_append(wb, [], None, 1)  # type: ignore[arg-type]
    foreign = open_client().open_writer(b)
    with pytest.raises(InvalidInput, match="another client"):
        txn.compare_and_append(foreign, [], 0, 1)
    assert txn.shards == [str(a)]  # the refused additions left it as it was
    results = txn.commit()
    assert list(results) == [str(a)]
    with pytest.raises(InvalidInput, match="already been committed"):
        txn.commit()
    with pytest.raises(InvalidInput, match="already been committed"):
        txn.compare_and_append(wb, [], 0, 1)
    assert uppers(client, a, b) == [1, 0]
    # A closed shard takes no writes: a mismatch naming it, and the other shard unchanged.
    wb.compare_and_append([], 0, None)
    txn = client.transaction()
    txn.compare_and_append(wa, [], 1, 2)
    txn.compare_and_append(wb, [], 0, 1)
    with pytest.raises(UpperMismatch) as info:
        txn.commit()
    assert info.value.shard == str(b) and info.value.current is None
    assert uppers(client, a, b) == [1, None]
    # An expired writer cannot join.
    wa.expire()
    with pytest.raises(LeaseExpired):
        client.transaction().compare_and_append(wa, [], 1, 2)


def test_a_writer_expired_after_its_append_was_added_makes_the_commit_change_nothing(
        open_client):
    client = open_client()
    a, b, wa, wb = two_shards(client)
    txn = client.transaction()
    txn.compare_and_append(wa, [(b"k", b"v", 0, 1)], 0, 1)
    txn.compare_and_append(wb, [(b"k", b"v", 0, 1)], 0, 1)
    wa.expire()  # the handle cannot write afterwards, through a transaction either
    with pytest.raises(LeaseExpired):
        txn.commit()
    assert uppers(client, a, b) == [0, 0]
    assert wa.writer_id not in client._machine(str(a)).fetch_latest().writers
    with pytest.raises(InvalidInput, match="already been committed"):
        txn.commit()


def test_typed_shards_keep_their_schema_checks(open_client):
    client = open_client()
    schema = ShardSchema(pa.schema([("id", pa.int64())]), pa.schema([("qty", pa.int64())]))
    typed, raw = ShardId.new(), ShardId.new()
    wt, wr = client.open_writer(typed, schema=schema), client.open_writer(raw)
    txn = client.transaction()
    with pytest.raises(SchemaMismatch):
        txn.compare_and_append(wt, pa.table({"id": ["not", "ints"]}), 0, 1)
    table = pa.table({"id": [1, 2], "qty": [10, 20], "t": [0, 0], "d": [1, 1]})
    txn.compare_and_append(wt, table, 0, 1)
    txn.compare_and_append(wr, [(b"audit", b"2 rows", 0, 1)], 0, 1)
    txn.commit()
    reader = client.open_reader(typed)
    assert reader.snapshot(0).select(["id", "qty"]).to_pylist() == [
        {"id": 1, "qty": 10}, {"id": 2, "qty": 20}]
    assert snapshot_rows(client, raw) == [(b"audit", b"2 rows", 1)]


def test_an_untyped_transaction_write_into_a_shard_typed_meanwhile_is_refused(open_client):
    """The schema an append was encoded with travels into the commit: a shard typed
    between adding the append and committing refuses it, and no shard changes."""
    client = open_client()
    a, b, wa, wb = two_shards(client)
    txn = client.transaction()
    txn.compare_and_append(wa, [(b"k", b"v", 0, 1)], 0, 1)
    txn.compare_and_append(wb, [(b"k", b"v", 0, 1)], 0, 1)
    schema = ShardSchema(pa.schema([("id", pa.int64())]), pa.schema([]))
    open_client().open_writer(b, schema=schema)  # another process types b
    with pytest.raises(SchemaMismatch):
        txn.commit()
    assert uppers(client, a, b) == [0, 0]


def test_a_shard_added_before_it_existed_is_created_by_the_commit(open_client):
    """An append to a shard id no shard has yet creates the shard at commit, not when
    added (an aborted transaction leaves no empty shard behind); if another process
    creates and types it in between, the untyped append is refused as for a shard typed
    meanwhile, and no shard changes."""
    client = open_client()
    a, _b, wa, _wb = two_shards(client)
    fresh, later = ShardId.new(), ShardId.new()
    txn = client.transaction()
    txn.compare_and_append(wa, [(b"k", b"v", 0, 1)], 0, 1)
    txn.compare_and_append(str(fresh), [(b"k", b"v", 0, 1)], 0, 1)
    assert str(fresh) not in client.list_shards()
    schema = ShardSchema(pa.schema([("id", pa.int64())]), pa.schema([]))
    open_client().open_writer(fresh, schema=schema)  # another process types it
    with pytest.raises(SchemaMismatch):
        txn.commit()
    assert uppers(client, a, fresh) == [0, 0]
    with client.transaction() as txn:
        txn.compare_and_append(wa, [(b"k", b"v", 0, 1)], 0, 1)
        txn.compare_and_append(str(later), [(b"k", b"v", 0, 1)], 0, 1)
        assert str(later) not in client.list_shards()
    assert uppers(client, a, later) == [1, 1]
    assert snapshot_rows(client, later) == [(b"k", b"v", 1)]
    client.close()


def test_append_in_a_transaction_cuts_what_identical_writers_wrote(open_client):
    client = open_client()
    a, b, wa, wb = two_shards(client)
    wa.compare_and_append([(b"k", b"0", 0, 1)], 0, 1)
    wb.compare_and_append([(b"k", b"0", 0, 1), (b"k", b"1", 1, 1)], 0, 2)
    txn = client.transaction()
    txn.append(wa, [(b"k", b"0", 0, 1), (b"k", b"1", 1, 1)], 0, 2)
    txn.append(wb, [(b"k", b"0", 0, 1), (b"k", b"1", 1, 1)], 0, 2)
    results = txn.commit()
    assert results[str(a)].upper == 2 and results[str(a)].num_updates == 1
    assert results[str(b)].placement == "none"
    assert snapshot_rows(client, a) == [(b"k", b"0", 1), (b"k", b"1", 1)]
    assert snapshot_rows(client, b) == [(b"k", b"0", 1), (b"k", b"1", 1)]


def test_append_in_a_transaction_leaves_out_a_closed_shard_as_a_writers_append_does(
        open_client):
    """A closed shard's upper (the empty frontier) is past every upper: ``append`` writes
    nothing there and reports so (placement "none"), alone and in a transaction alike;
    the transaction's other appends commit. ``compare_and_append`` to it is refused."""
    client = open_client()
    a, b, wa, wb = two_shards(client)
    wa.compare_and_append([(b"k", b"0", 0, 1)], 0, None)  # closed for good
    alone = wa.append([(b"k", b"1", 3, 1)], 3, 5)
    assert alone.placement == "none" and alone.upper is None
    txn = client.transaction()
    txn.append(wa, [(b"k", b"1", 3, 1)], 3, 5)
    txn.compare_and_append(wb, [(b"k", b"1", 0, 1)], 0, 1)
    results = txn.commit()
    assert results[str(a)].placement == "none" and results[str(a)].upper is None
    assert results[str(a)].num_updates == 0
    assert uppers(client, a, b) == [None, 1]
    assert snapshot_rows(client, b) == [(b"k", b"1", 1)]


def test_a_new_name_is_registered_only_when_its_transaction_commits(open_client):
    """A transaction's append to a name no shard has yet registers the name in the
    commit's own compare-and-set: a transaction aborted (an exception in its block,
    ``abort()``) or refused by the commit itself leaves no name behind (names are never
    deleted); a name another client registers meanwhile refuses the commit
    (``UpperMismatch`` naming it), the name keeping that client's shard; the same new
    name twice in one transaction is refused when added."""
    client = open_client()
    _a, b, _wa, wb = two_shards(client)
    wb.compare_and_append([(b"x", b"", 0, 1)], 0, 1)
    with pytest.raises(RuntimeError), client.transaction() as txn:
        txn.compare_and_append("fresh/two", [(b"k", b"", 0, 1)], 0, 1)
        raise RuntimeError("the caller's code failed: the transaction aborts")
    txn = client.transaction()
    txn.append("fresh/two", [(b"k", b"", 0, 1)], 0, 1)
    txn.abort()
    assert client.shard_names() == {}
    # Nor a shard: the shard of a new name is created at commit, not when added.
    assert sorted(client.list_shards()) == sorted([str(_a), str(b)])
    with pytest.raises(UpperMismatch), client.transaction() as txn:
        txn.compare_and_append("fresh/one", [(b"k", b"", 0, 1)], 0, 1)
        txn.compare_and_append(wb, [(b"k", b"", 0, 1)], 0, 1)  # b's upper is 1
    assert client.shard_names() == {} and uppers(client, b) == [1]
    txn = client.transaction()
    txn.compare_and_append("fresh/three", [(b"k", b"", 0, 1)], 0, 1)
    with pytest.raises(InvalidInput, match="appears twice"):
        txn.append("fresh/three", [(b"j", b"", 0, 1)], 0, 1)
    txn.compare_and_append(wb, [(b"k", b"", 1, 1)], 1, 2)
    other = client.resolve("fresh/three", create=True)  # another client names it first
    with pytest.raises(UpperMismatch) as refused:
        txn.commit()
    assert refused.value.shard == "fresh/three"
    assert client.resolve("fresh/three") == other and uppers(client, b) == [1]
    with client.transaction() as txn:
        txn.compare_and_append("fresh/one", [(b"k", b"", 0, 1)], 0, 1)
        txn.compare_and_append(wb, [(b"k", b"", 1, 1)], 1, 2)
    assert set(client.shard_names()) == {"fresh/one", "fresh/three"}
    assert snapshot_rows(client, client.resolve("fresh/one")) == [(b"k", b"", 1)]
    assert snapshot_rows(client, b) == [(b"k", b"", 1), (b"x", b"", 1)]
    client.close()


def test_a_full_inline_budget_sends_that_shard_to_blob(location):
    """The budget is per shard: the one whose budget is full goes to blob within the
    same transaction; the other stays inline."""
    policy = InlinePolicy(4096, 20_000)
    client = location.client(policy)
    a, b, wa, wb = two_shards(client)
    # Fill a's budget to just below the max with inline writes.
    upper = 0
    while client._machine(a).fetch_latest().inline_bytes + 3100 < policy.max_bytes:
        wa.compare_and_append([(f"f{upper}".encode(), b"x" * 3000, upper, 1)], upper,
                              upper + 1)
        upper += 1
    txn = client.transaction()
    txn.compare_and_append(wa, [(b"z", b"y" * 3000, upper, 1)], upper, upper + 1)
    txn.compare_and_append(wb, [(b"z", b"y", 0, 1)], 0, 1)
    results = txn.commit()
    assert results[str(a)].fell_back and results[str(a)].placement in ("blob", "wal")
    assert results[str(b)].placement == "inline"
    assert (b"z", b"y" * 3000, 1) in snapshot_rows(client, a)
    client.close()


# --- all or nothing under races, lost replies and kills (durable locations) --------------


def _pair_rows(client: PersistClient, a: Any, b: Any) -> tuple[set[bytes], set[bytes]]:
    ka = {k for k, _, _ in snapshot_rows(client, a)}
    kb = {k for k, _, _ in snapshot_rows(client, b)}
    return ka, kb


@pytest.mark.timeout(240)
def test_all_or_nothing_under_racing_single_shard_writers(durable_location):
    """Threads commit pair transactions on (a, b) while others append to a alone; every
    transaction's row is in both shards or neither, and a reader of both at one time
    sees each pair whole."""
    a, b = ShardId.new(), ShardId.new()
    clients = [durable_location.client(InlinePolicy(4096, 1 << 20)) for _ in range(3)]
    committed: list[bytes] = []
    errors: list[str] = []
    lock = threading.Lock()

    def pairs(c: PersistClient, name: str) -> None:
        wa, wb = c.open_writer(a), c.open_writer(b)
        for i in range(15):
            key = f"{name}-{i}".encode()
            while True:
                ta, tb = wa.fetch_recent_upper(), wb.fetch_recent_upper()
                txn = c.transaction()
                txn.compare_and_append(wa, [(key, b"", ta, 1)], ta, ta + 1)
                txn.compare_and_append(wb, [(key, b"", tb, 1)], tb, tb + 1)
                try:
                    txn.commit()
                except UpperMismatch:
                    continue
                with lock:
                    committed.append(key)
                break

    def singles(c: PersistClient) -> None:
        w = c.open_writer(a)
        for i in range(30):
            t = w.fetch_recent_upper()
            with contextlib.suppress(UpperMismatch):
                w.compare_and_append([(f"solo-{i}".encode(), b"", t, 1)], t, t + 1)

    def run(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # surfaced below with its type
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(pairs, clients[0], "p0")),
               threading.Thread(target=run, args=(pairs, clients[1], "p1")),
               threading.Thread(target=run, args=(singles, clients[2]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    assert errors == []
    ka, kb = _pair_rows(clients[0], a, b)
    assert {k for k in ka if not k.startswith(b"solo")} == kb == set(committed)
    assert len(committed) == 30
    for c in clients:
        c.close()


@pytest.mark.timeout(240)
def test_lost_replies_at_the_commit_are_settled_all_or_nothing(durable_location):
    """Half of the multi-shard compare-and-sets lose their reply (applied or not): each
    transaction either reports its commit, or raises, and its rows are then in both
    shards or neither; a reported commit is always in both."""
    a, b = ShardId.new(), ShardId.new()
    setup = durable_location.client()
    setup.create_shard(a)
    setup.create_shard(b)
    faults = FaultConfig(fail_before=0.25, fail_after=0.25, seed=7,
                         operations=frozenset({"compare_and_set"}))
    consensus = FaultyConsensus(open_consensus(durable_location.consensus_uri), faults)
    client = PersistClient(consensus, open_blob(durable_location.blob_uri))
    wa, wb = client.open_writer(a), client.open_writer(b)
    reported: list[bytes] = []
    unsure: list[bytes] = []
    for i in range(25):
        key = f"t{i}".encode()
        ta, tb = wa.fetch_recent_upper(), wb.fetch_recent_upper()
        txn = client.transaction()
        txn.compare_and_append(wa, [(key, b"v" * (0 if i % 2 else 5000), ta, 1)], ta, ta + 1)
        txn.compare_and_append(wb, [(key, b"", tb, 1)], tb, tb + 1)
        try:
            txn.commit()
            reported.append(key)
        except (Indeterminate, UpperMismatch):
            unsure.append(key)
    assert faults.fail_after > 0 and consensus.faults.injected.get("fail_after", 0) > 0
    ka, kb = _pair_rows(setup, a, b)
    assert ka == kb
    assert set(reported) <= ka
    assert ka <= set(reported) | set(unsure)
    client.close()
    setup.close()


def test_lost_replies_at_a_commit_creating_names_register_a_name_iff_it_committed(
        durable_location):
    """Half of the commits that create a name (and append to an existing shard) lose
    their reply, applied or not: a name is registered exactly when the transaction's
    rows landed, whatever the caller was told, and a reported commit has both. A commit
    refused by the other shard's upper leaves no name; another client registering one
    of the names first refuses that commit as a whole."""
    b = ShardId.new()
    setup = durable_location.client()
    setup.create_shard(b)
    faults = FaultConfig(fail_before=0.25, fail_after=0.25, seed=11,
                         operations=frozenset({"compare_and_set"}))
    consensus = FaultyConsensus(open_consensus(durable_location.consensus_uri), faults)
    client = PersistClient(consensus, open_blob(durable_location.blob_uri))
    wb = client.open_writer(b)
    reported: set[str] = set()
    for i in range(20):
        name, key = f"lost/n{i}", f"t{i}".encode()
        tb = wb.fetch_recent_upper()
        txn = client.transaction()
        txn.compare_and_append(name, [(key, b"", 0, 1)], 0, 1)
        txn.compare_and_append(wb, [(key, b"", tb, 1)], tb, tb + 1)
        if i % 5 == 2:  # b moves on first: the commit is refused, no name is left
            setup.open_writer(b).compare_and_append([], tb, tb + 1)
        if i % 5 == 4:  # another client takes the name between add and commit
            setup.resolve(name, create=True)
        try:
            txn.commit()
            reported.add(name)
        except (Indeterminate, UpperMismatch) as e:
            if i % 5 == 4:
                assert isinstance(e, UpperMismatch) and e.shard == name
            if i % 5 == 2:
                assert isinstance(e, UpperMismatch) and e.shard == str(b)
    assert consensus.faults.injected.get("fail_after", 0) > 0
    landed = {k.decode() for k, _, _ in snapshot_rows(setup, b)}
    names = setup.shard_names()
    for i in range(20):
        name, key = f"lost/n{i}", f"t{i}"
        if i % 5 == 4:
            # The other client's name, for its own shard (not created yet).
            assert key not in landed and str(names[name]) not in setup.list_shards()
            continue
        assert (name in names) == (key in landed), (name, key)
        if name in reported:
            assert key in landed
        if name in names:
            assert snapshot_rows(setup, names[name]) == [(key.encode(), b"", 1)]
    client.close()
    setup.close()


def pair_losing_a_reply_after_gc(clients: Clients, location: Location) -> tuple[
        PersistClient, LoseNextReply, ShardId, ShardId, WriteHandle, WriteHandle,
        PersistClient]:
    """A client, two shards at upper 1 and its writers of them: its next compare-and-set
    lands, then its process pauses past the writers' leases while GC (another client,
    also returned) expires them and truncates the records that would settle it, then
    its reply is lost."""
    a, b = ShardId.new(), ShardId.new()
    lossy = LoseNextReply(open_consensus(location.consensus_uri))
    client = clients._open(lossy, NO_INLINE, reader_lease_duration_s=SHORT_LEASE_S)
    wa, wb = client.open_writer(a), client.open_writer(b)
    wa.compare_and_append([(b"base", b"", 0, 1)], 0, 1)
    wb.compare_and_append([(b"base", b"", 0, 1)], 0, 1)
    gc = clients.plain()

    def pause_then_gc() -> None:
        clients.clock.advance(PAUSE_S)
        gc.gc(a)
        gc.gc(b)

    lossy.arm(pause_then_gc)
    return client, lossy, a, b, wa, wb, gc


@pytest.mark.parametrize("rows_first", [False, True], ids=["empty-first", "rows-first"])
def test_a_lost_reply_is_settled_by_any_shards_batch_in_history(location, rows_first):
    """A transaction lands; its process pauses past its writers' leases, GC expires them
    and truncates the records that would settle it; then its reply is lost. Only B's
    batch is left to tell (A's append holds no rows: no batch), in B's kept history:
    found there, the commit is reported, whichever shard was added first."""
    clients = Clients(location)
    try:
        client, lossy, a, b, wa, wb, gc = pair_losing_a_reply_after_gc(clients, location)
        txn = client.transaction()
        appends = [(wa, []), (wb, [(b"x", b"", 1, 1)])]
        for writer, updates in reversed(appends) if rows_first else appends:
            txn.compare_and_append(writer, updates, 1, 2)
        results = txn.commit()
        assert lossy.lost == 1
        assert results[str(b)].already_committed and results[str(b)].upper == 2
        assert results[str(a)].upper == 2
        assert uppers(gc, a, b) == [2, 2]
    finally:
        clients.close()


class LoseNextTransactionReply(LoseNextReply):
    """:class:`LoseNextReply` for multi-shard compare-and-sets only (a new shard's own
    creation, a single compare-and-set, keeps its reply)."""

    def compare_and_set(self, shard: str, expected: int | None, new: Any) -> bool:
        return self.inner.compare_and_set(shard, expected, new)


def test_a_lost_reply_of_a_naming_commit_is_settled_by_the_name_record(location):
    """A transaction of empty appends (no batch for history to find) to a shard and to a
    new name lands; its process pauses past its writers' leases, GC expires them and
    truncates both shards' records that would settle it; then its reply is lost. The
    name's record, created by that commit and never truncated, settles it: reported
    committed, not Indeterminate."""
    clients = Clients(location)
    try:
        a = ShardId.new()
        lossy = LoseNextTransactionReply(open_consensus(location.consensus_uri))
        client = clients._open(lossy, NO_INLINE, reader_lease_duration_s=SHORT_LEASE_S)
        wa = client.open_writer(a)
        wa.compare_and_append([(b"base", b"", 0, 1)], 0, 1)
        gc = clients.plain()
        txn = client.transaction()
        txn.compare_and_append(wa, [], 1, 2)
        txn.compare_and_append("named/lost", [], 0, 2)
        new = txn._new_names["named/lost"]
        truncated: list[bool] = []

        def pause_then_gc() -> None:
            clients.clock.advance(PAUSE_S)
            for shard in (str(a), new):
                landed = gc.consensus.head(shard)  # the record this commit wrote
                assert landed is not None
                gc.gc(shard)
                truncated.append(gc.consensus.scan(shard, 0)[0].seqno > landed.seqno)

        lossy.arm(pause_then_gc)
        results = txn.commit()
        assert lossy.lost == 1 and truncated == [True, True]
        assert results[new].upper == 2 and results[str(a)].upper == 2
        assert gc.shard_names() == {"named/lost": ShardId.parse(new)}
        assert uppers(gc, a, new) == [2, 2]
    finally:
        clients.close()


def _txn_loop(consensus_uri: str, blob_uri: str, a: str, b: str, ready: Any,
              commits: Any) -> None:
    """A spawned process: commits pair transactions forever (until killed), counting the
    ones that committed in ``commits``."""
    client = PersistClient.open(consensus_uri, blob_uri)
    wa, wb = client.open_writer(a), client.open_writer(b)
    ready.set()
    i = 0
    while True:
        key = f"{os.getpid()}-{i}".encode()
        ta, tb = wa.fetch_recent_upper(), wb.fetch_recent_upper()
        txn = client.transaction()
        rows_a = [(key, b"x" * (6000 if i % 3 == 0 else 10), ta, 1)]
        txn.compare_and_append(wa, rows_a, ta, ta + 1)
        txn.compare_and_append(wb, [(key, b"", tb, 1)], tb, tb + 1)
        with contextlib.suppress(UpperMismatch):
            txn.commit()
            commits.value += 1  # this process is the only writer
        i += 1


@pytest.mark.timeout(240)
def test_a_process_killed_mid_transaction_leaves_every_pair_whole(durable_location):
    """SIGKILL two processes committing pair transactions at random moments, several
    times: every pair is in both shards or neither."""
    a, b = str(ShardId.new()), str(ShardId.new())
    setup = durable_location.client()
    setup.create_shard(a)
    setup.create_shard(b)
    ctx = process_context()
    for round_ in range(3):
        procs, commits = [], []
        for _ in range(2):
            ready, committed = ctx.Event(), ctx.Value("i", 0)
            p = ctx.Process(target=_txn_loop, args=(durable_location.consensus_uri,
                                                    durable_location.blob_uri, a, b, ready,
                                                    committed))
            p.start()
            assert ready.wait(60)
            procs.append(p)
            commits.append(committed)
        # Kill once each process has committed pairs of its own (more each round): both
        # are then racing mid-loop, however slowly either started under load.
        target = 10 * (round_ + 1)
        wait_until(lambda commits=commits, target=target:
                   all(c.value >= target for c in commits),
                   f"each process to commit {target} pair transactions", timeout_s=60)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
            p.join(10)
    ka, kb = _pair_rows(setup, a, b)
    assert ka == kb and len(ka) > 0
    setup.close()


def test_sqlite_transaction_is_one_round_trip(tmp_path: Path):
    """A pair transaction commits with ONE consensus compare-and-set call."""
    calls: list[str] = []
    inner = open_consensus(f"sqlite:///{tmp_path / 'c.db'}")
    from tests.helpers import ForwardingConsensus

    class Counting(ForwardingConsensus):
        def compare_and_set(self, *args: Any) -> bool:
            calls.append("cas")
            return super().compare_and_set(*args)

        def compare_and_set_many(self, writes: Any) -> bool:
            calls.append(f"many{len(writes)}")
            return super().compare_and_set_many(writes)

    client = PersistClient(Counting(inner), open_blob(f"file://{tmp_path / 'b'}"))
    _, _, wa, wb = two_shards(client)
    calls.clear()
    with client.transaction() as txn:
        txn.compare_and_append(wa, [(b"k", b"", 0, 1)], 0, 1)
        txn.compare_and_append(wb, [(b"k", b"", 0, 1)], 0, 1)
    assert calls == ["many2"]
    client.close()


# --- replacing several typed shards together ---------------------------------------------


def test_replace_contents_of_several_shards_is_one_atomic_step(open_client):
    """A transaction replacing two typed shards' contents: both change together; a
    racing write to one of them makes the transaction read it again and retry."""
    client = open_client()
    schema = ShardSchema(pa.schema([("id", pa.int64())]), pa.schema([("qty", pa.int64())]))
    a, b = ShardId.new(), ShardId.new()
    wa, wb = client.open_writer(a, schema=schema), client.open_writer(b, schema=schema)
    wa.replace_contents(pa.table({"id": [1, 2], "qty": [1, 1]}))
    txn = client.transaction()
    txn.replace_contents(wa, pa.table({"id": [2, 3], "qty": [5, 5]}))
    txn.replace_contents(wb, pa.table({"id": [9], "qty": [9]}))
    # Another writer lands on a between planning and commit: its rows are replaced too.
    other = open_client().open_writer(a, schema=schema)
    other.upsert(pa.table({"id": [7], "qty": [7]}))
    results = txn.commit()
    assert results[str(a)].rows_added == 2 and results[str(a)].rows_retracted == 3

    def contents(shard: ShardId) -> list[dict]:
        upper = client._machine(str(shard)).fetch_latest().upper
        reader = client.open_reader(shard)
        try:
            return sorted(reader.snapshot(upper - 1).select(["id", "qty"]).to_pylist(),
                          key=lambda r: r["id"])
        finally:
            reader.expire()

    assert contents(a) == [{"id": 2, "qty": 5}, {"id": 3, "qty": 5}]
    assert contents(b) == [{"id": 9, "qty": 9}]
    with pytest.raises(SchemaMismatch):
        client.transaction().replace_contents(client.open_writer(ShardId.new()),
                                              pa.table({"id": [1]}))
    with pytest.raises(InvalidUpdates, match="more than once"):
        client.transaction().replace_contents(wa, pa.table({"id": [1, 1], "qty": [1, 2]}))


def test_store_tables_stores_every_table_or_none(open_client):
    from persist_pipeline import tables

    client = open_client()
    stored = tables.store_tables(client, {
        "shop/orders": (pa.table({"id": [1, 2], "amount": [3.5, 4.0]}), ["id"]),
        "shop/lines": (pa.table({"order": [1, 1, 2], "sku": ["a", "b", "c"]}), None),
    })
    assert {s.name for s in stored.values()} == {"shop/orders", "shop/lines"}
    assert tables.load_table(client, "shop/orders").to_pylist() == [
        {"id": 1, "amount": 3.5}, {"id": 2, "amount": 4.0}]
    # A bad table (a key twice) refuses the whole set: the other is unchanged too.
    with pytest.raises(InvalidUpdates):
        tables.store_tables(client, {
            "shop/orders": (pa.table({"id": [1], "amount": [9.0]}), ["id"]),
            "shop/lines": (pa.table({"order": [5, 5], "sku": ["x", "x"]}), ["order"]),
        })
    assert sorted(r["sku"] for r in tables.load_table(client, "shop/lines").to_pylist()) == [
        "a", "b", "c"]
    assert tables.load_table(client, "shop/orders").num_rows == 2
    with pytest.raises(InvalidInput):
        tables.store_tables(client, {})


def test_a_retried_transaction_token_whose_batch_was_compacted_is_reported_committed(
        location):
    """A transaction committed with recorded tokens, but its process died before it
    learnt the outcome; compaction then merged its batches away. A retry with the same
    tokens (through fresh writers) must report it committed, as a single write's retry
    does (the batch id is in the state's history), never ``UpperMismatch`` ("no shard
    changed")."""
    client = location.client(InlinePolicy(0, 0))
    a, b = ShardId.new(), ShardId.new()
    for s in (a, b):
        with client.open_writer(s) as w:
            w.compare_and_append([(b"base", b"", 0, 1)], 0, 1)
    ta, tb = "tok-a-1", "tok-b-1"
    txn = client.transaction()
    txn.compare_and_append(a, [(b"x", b"", 1, 1)], 1, 2, idempotency_token=ta)
    txn.compare_and_append(b, [(b"y", b"", 1, 1)], 1, 2, idempotency_token=tb)
    txn.commit()  # ...whose reply the process never saw
    for s in (a, b):
        client.compact(s)
        assert len(client._machine(s).fetch_latest().batches) == 1
    # The single-write retry of the same situation is settled from history:
    with client.open_writer(a) as w:
        assert w.compare_and_append([(b"x", b"", 1, 1)], 1, 2,
                                    idempotency_token=ta).already_committed
    retry = client.transaction()
    retry.compare_and_append(a, [(b"x", b"", 1, 1)], 1, 2, idempotency_token=ta)
    retry.compare_and_append(b, [(b"y", b"", 1, 1)], 1, 2, idempotency_token=tb)
    results = retry.commit()
    assert results[str(a)].already_committed and results[str(b)].already_committed
    assert snapshot_rows(client, a) == [(b"base", b"", 1), (b"x", b"", 1)]
    client.close()


def test_a_retried_transaction_token_is_reported_committed(location):
    """Retrying a committed transaction with the same idempotency tokens (its process
    never saw the reply) reports it committed, as a single write's retry does: never
    ``CorruptState`` ("its batches are in some shards and not in others"), and nothing
    is written twice."""
    client = location.client(InlinePolicy(0, 0))
    a, b = ShardId.new(), ShardId.new()
    wa, wb = client.open_writer(a), client.open_writer(b)

    def commit() -> dict[str, Any]:
        txn = client.transaction()
        txn.compare_and_append(wa, [(b"x", b"", 0, 1)], 0, 1, idempotency_token="ta")
        txn.compare_and_append(wb, [(b"y", b"", 0, 1)], 0, 1, idempotency_token="tb")
        return txn.commit()

    commit()
    again = commit()
    assert again[str(a)].already_committed and again[str(b)].already_committed
    assert again[str(a)].upper == again[str(b)].upper == 1
    assert snapshot_rows(client, a) == [(b"x", b"", 1)]
    assert snapshot_rows(client, b) == [(b"y", b"", 1)]
    client.close()


def test_a_retried_transaction_with_an_empty_append_is_reported_committed(location):
    """A retried transaction (same tokens, through fresh writers: its process died
    before it learnt the outcome) one of whose appends holds no rows: that append leaves
    no batch to find, but the other shard's batch shows the transaction committed, and
    all or none of it did. The retry reports it committed, never ``UpperMismatch`` ("no
    shard changed"), after which its caller would write the rows again."""
    client = location.client(InlinePolicy(0, 0))
    a, b = ShardId.new(), ShardId.new()
    for s in (a, b):
        client.create_shard(s)

    def commit() -> dict[str, Any]:
        txn = client.transaction()
        txn.compare_and_append(a, [], 0, 1, idempotency_token="tok-a")
        txn.compare_and_append(b, [(b"y", b"", 0, 1)], 0, 1, idempotency_token="tok-b")
        return txn.commit()

    commit()  # ...whose reply the process never saw
    again = commit()
    assert again[str(a)].already_committed and again[str(b)].already_committed
    assert again[str(a)].upper == again[str(b)].upper == 1
    assert snapshot_rows(client, b) == [(b"y", b"", 1)]
    client.close()


def test_bad_input_to_a_transaction_by_name_registers_no_name_and_creates_no_shard(
        tmp_path: Path) -> None:
    """A transaction's append given a name: bad input "raises here and leaves the
    transaction as it was", and bad input changes nothing (guarantee 7). Names are never
    deleted, so registering one for a refused append is a permanent change."""
    from persist_pipeline import InvalidUpdates, SchemaMismatch

    with PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}",
                            f"file://{tmp_path / 'b'}") as client:
        txn = client.transaction()
        with pytest.raises(InvalidUpdates):
            txn.compare_and_append("orders", [("text", b"v", 0, 1)], 0, 1)
        with pytest.raises(InvalidUpdates):
            txn.compare_and_append("lines", [(b"k", b"v", 5, 1)], 0, 1)
        with pytest.raises(SchemaMismatch):  # a new shard is untyped: never replaceable
            txn.replace_contents("customers", pa.table({"id": pa.array([1, 2], pa.int64())}))
        txn.abort()
        assert client.shard_names() == {}
        assert client.list_shards() == []


def test_a_retried_transaction_of_empty_appends_only_is_reported_committed(location):
    """A retried transaction (same tokens, through fresh writers: its process never saw
    the reply) all of whose appends hold no rows, only advancing uppers: no shard has a
    batch to find, but each append's writer recorded its token when it committed, as a
    single empty write's retry is settled. The retry reports it committed, never
    ``UpperMismatch``, after which its caller would advance the uppers again."""
    client = location.client(InlinePolicy(0, 0))
    a, b = ShardId.new(), ShardId.new()
    for s in (a, b):
        client.create_shard(s)

    def commit() -> dict[str, Any]:
        txn = client.transaction()
        txn.compare_and_append(a, [], 0, 1, idempotency_token="tok-a")
        txn.compare_and_append(b, [], 0, 1, idempotency_token="tok-b")
        return txn.commit()

    commit()  # ...whose reply the process never saw
    again = commit()
    assert again[str(a)].already_committed and again[str(b)].already_committed
    assert again[str(a)].upper == again[str(b)].upper == 1
    assert [client._machine(s).fetch_latest().upper for s in (a, b)] == [1, 1]
    client.close()


@pytest.mark.parametrize("kind", location_kinds("embedded", "pg-s3"))
def test_a_lost_reply_of_empty_appends_only_is_settled_by_their_writers_records(
        request, tmp_path, kind):
    """Every reply of the consensus is lost after it applied (FaultyConsensus with
    fail_after=1.0): a transaction of empty appends only (no batch anywhere) is settled
    by its writers' records of its tokens and reported committed, once."""
    location = make_location(kind, request, tmp_path)
    setup = location.client()
    a, b = ShardId.new(), ShardId.new()
    setup.create_shard(a)
    setup.create_shard(b)
    faults = FaultConfig(fail_after=1.0, operations=frozenset({"compare_and_set"}))
    consensus = FaultyConsensus(open_consensus(location.consensus_uri), faults)
    client = PersistClient(consensus, open_blob(location.blob_uri))
    wa, wb = client.open_writer(a), client.open_writer(b)
    txn = client.transaction()
    txn.compare_and_append(wa, [], 0, 1)
    txn.compare_and_append(wb, [], 0, 1)
    results = txn.commit()
    assert consensus.faults.injected.get("fail_after", 0) > 0
    assert results[str(a)].upper == results[str(b)].upper == 1
    assert [setup._machine(s).fetch_latest().upper for s in (a, b)] == [1, 1]
    client.close()
    setup.close()


def test_a_new_name_at_an_upper_its_new_shard_has_not_registers_nothing(
        tmp_path: Path) -> None:
    """A new name's shard starts at upper 0: an append to it expecting another upper
    (``compare_and_append`` at 3, or ``append`` from lower 3, a gap) is refused for
    certain, so it is refused when added (``UpperMismatch`` naming the name, current 0),
    leaving the transaction as it was: it created the shard when added and registered
    the name for good before the commit that refused it."""
    with PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}",
                            f"file://{tmp_path / 'b'}") as client:
        kept = client.resolve("kept", create=True)
        client.create_shard(kept)
        txn = client.transaction()
        with pytest.raises(UpperMismatch) as refused:
            txn.compare_and_append("orders", [(b"k", b"v", 5, 1)], 3, 9)
        assert (refused.value.shard, refused.value.expected, refused.value.current) == \
            ("orders", 3, 0)
        with pytest.raises(UpperMismatch):
            txn.append("lines", [(b"k", b"v", 5, 1)], 3, 9)
        txn.compare_and_append("kept", [(b"k", b"v", 0, 1)], 0, 1)
        assert txn.commit()[str(kept)].upper == 1
        assert client.shard_names() == {"kept": kept}
        assert client.list_shards() == [str(kept)]
        with client.transaction() as txn:  # at 0 a new name is registered, as before
            txn.append("lines", [(b"k", b"v", 5, 1)], 0, 9)
        assert set(client.shard_names()) == {"kept", "lines"}


@pytest.mark.parametrize("kind", location_kinds("embedded", "pg-s3"))
def test_a_transaction_refused_by_its_commit_registers_no_name(request, tmp_path, kind):
    """All or nothing: a transaction that would create a name and is refused by its own
    commit (an upper mismatch on another shard) leaves the name unregistered."""
    location = make_location(kind, request, tmp_path)
    client = location.client()
    a = ShardId.new()
    wa = client.open_writer(a)
    wa.compare_and_append([(b"x", b"", 0, 1)], 0, 1)
    with pytest.raises(UpperMismatch), client.transaction() as txn:
        txn.compare_and_append("fresh/refused", [(b"k", b"", 0, 1)], 0, 1)
        txn.compare_and_append(wa, [(b"k", b"", 0, 1)], 0, 1)  # a's upper is 1
    other = location.client()
    assert other.shard_names() == {} and client.shard_names() == {}
    assert uppers(other, a) == [1]
    other.close()
    client.close()


@pytest.mark.parametrize("kind", location_kinds("embedded", "pg-s3"))
def test_a_name_another_client_takes_before_the_commit_refuses_it_whole(
        request, tmp_path, kind):
    """Another client creates and writes a shard under a transaction's new name between
    the append's add and the commit: the commit is refused as a whole (``UpperMismatch``
    whose ``.shard`` is the name, ``.current`` that shard's upper). Nothing of the
    transaction landed: the name keeps the other client's shard and rows, the
    transaction's other shard did not move, its parts were deleted; a new transaction
    at the name's current upper then appends to the other client's shard."""
    location = make_location(kind, request, tmp_path)
    client = location.client(NO_INLINE)  # blob parts, uploaded before the commit
    a = ShardId.new()
    wa = client.open_writer(a)
    wa.compare_and_append([(b"x", b"", 0, 1)], 0, 1)
    big = [(f"k{i}".encode(), b"v" * 200, 0, 1) for i in range(50)]  # blob-sized
    txn = client.transaction()
    txn.compare_and_append("taken/late", big, 0, 1)
    txn.compare_and_append(wa, [(k, v, 1, d) for k, v, _, d in big], 1, 2)
    other = location.client()
    theirs = other.open_writer(other.resolve("taken/late", create=True))
    theirs.compare_and_append([(b"theirs", b"", 0, 1)], 0, 1)
    before = blob_keys(client)
    with pytest.raises(UpperMismatch) as refused:
        txn.commit()
    assert (refused.value.shard, refused.value.expected, refused.value.current) == \
        ("taken/late", 0, 1)
    assert blob_keys(client) - before == set()
    fresh = location.client()
    assert fresh.shard_names() == {"taken/late": ShardId.parse(theirs.shard_id)}
    assert uppers(fresh, a, theirs.shard_id) == [1, 1]
    assert snapshot_rows(fresh, a) == [(b"x", b"", 1)]
    assert snapshot_rows(fresh, theirs.shard_id) == [(b"theirs", b"", 1)]
    # The shard the commit created for the name (its first step) holds nothing.
    for shard in set(fresh.list_shards()) - {str(a), theirs.shard_id}:
        assert uppers(fresh, shard) == [0]
    with client.transaction() as again:
        again.compare_and_append("taken/late", [(b"mine", b"", 1, 1)], 1, 2)
        again.compare_and_append(wa, [(b"mine", b"", 1, 1)], 1, 2)
    assert snapshot_rows(fresh, theirs.shard_id) == [(b"mine", b"", 1), (b"theirs", b"", 1)]
    assert snapshot_rows(fresh, a) == [(b"mine", b"", 1), (b"x", b"", 1)]
    for c in (fresh, other, client):
        c.close()
