"""Transactions and single writes where they meet retries, compaction and group commit.

A write retried with the token of an attempt that landed (its process never learnt the
outcome) uploads its parts again before its commit finds the batch already there: those
parts are certainly never committed (a batch id lands once, and every staging writes
fresh keys), so they are deleted at once, as a refused write's are, rather than left in
the store until GC's orphan sweep. The parts of the attempt that landed are kept.
"""

from __future__ import annotations

from typing import Any

import pytest

from persist_pipeline import InlinePolicy, PersistClient, ShardId
from persist_pipeline.exceptions import LeaseExpired
from tests.fixtures.location import Location
from tests.helpers import rows

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
