"""A write is committed with the schema it was encoded with, or refused.

Two seams: a Spark data-source write planned while a shard had no schema must not
commit raw bytes into the shard once another client has typed it; and a writer opened
before a schema evolution must upsert and delete rows written in the newer shape (it
writes and commits them with the schema of the state it read, never re-decoding them
with its own older one). Each scenario is deterministic, on SQLite + files and
PostgreSQL + S3, and fails without its fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, ShardId, ShardSchema
from persist_pipeline.exceptions import SchemaMismatch
from persist_pipeline.spark_datasource import PersistCommitMessage
from persist_pipeline.spark_source import _commit, _write_job, _write_task
from tests.fixtures.location import Location

V1 = ShardSchema({"id": pa.int64()}, {"a": pa.string()})
V2 = ShardSchema({"id": pa.int64()}, {"a": pa.string(), "b": pa.int32()})
BLOB = InlinePolicy(0, 0)
INLINE = InlinePolicy(4096, 1 << 20)


def _spark_options(location: Location, shard: str, expected: int, new: int) -> dict[str, str]:
    options = {"consensus": location.consensus_uri, "blob": location.blob_uri,
               "shard": shard, "expected_upper": str(expected), "new_upper": str(new)}
    if location.wal_blob_uri:
        options["wal_blob"] = location.wal_blob_uri
    return options


def _blob_keys(client: PersistClient, shard: str) -> set[str]:
    keys = {m.key for m in client.blobs.main.list_keys(shard)}
    if client.blobs.wal is not None:
        keys |= {m.key for m in client.blobs.wal.list_keys(shard)}
    return {k for k in keys if "/rollup/" not in k}


@pytest.fixture
def client(durable_location: Location) -> Iterator[PersistClient]:
    with durable_location.client(BLOB) as c:
        yield c


def test_spark_write_planned_untyped_is_refused_once_the_shard_is_typed(
        durable_location: Location, client: PersistClient):
    shard = str(ShardId.new())  # does not exist yet: the write is planned untyped
    job = _write_job(_spark_options(durable_location, shard, 0, 1), overwrite=False)
    assert job.schema == b""
    rows = pa.table({"k": [b"raw-1", b"raw-2"], "v": [b"x", b"y"], "t": [0, 0], "d": [1, 1]})
    message = PersistCommitMessage(*_write_task(job, iter(rows.to_batches())))
    assert message.parts
    # Before the driver commits, another client types the still-empty shard.
    typed = client.open_writer(shard, schema=V1)
    with pytest.raises(SchemaMismatch, match="untyped"):
        _commit(job, [message])
    assert _blob_keys(client, shard) == set()  # certainly not committed: parts deleted
    # The shard is typed, empty and readable; typed writes go on.
    typed.compare_and_append(pa.table({"id": [1], "a": ["one"], "t": [0]}), 0, 1)
    reader = client.open_reader(shard)
    assert reader.snapshot(0).to_pylist() == [{"id": 1, "a": "one", "t": 0, "d": 1}]


def test_spark_write_planned_with_an_older_schema_commits_into_the_evolved_shard(
        durable_location: Location, client: PersistClient):
    shard = str(ShardId.new())
    client.open_writer(shard, schema=V1)
    job = _write_job(_spark_options(durable_location, shard, 0, 1), overwrite=False)
    assert ShardSchema.from_bytes(job.schema) == V1
    rows = pa.table({"id": [1, 2], "a": ["x", "y"], "t": [0, 0], "d": [1, 1]})
    message = PersistCommitMessage(*_write_task(job, iter(rows.to_batches())))
    client.open_writer(shard, schema=V2)  # evolved before the commit: V1 rows still fit
    _commit(job, [message])
    got = client.open_reader(shard).snapshot(0).to_pylist()
    assert got == [{"id": 1, "a": "x", "b": None, "t": 0, "d": 1},
                   {"id": 2, "a": "y", "b": None, "t": 0, "d": 1}]


def test_spark_write_committed_again_once_the_shard_was_typed_keeps_its_landed_parts(
        durable_location: Location, client: PersistClient):
    """A Spark write's commit lands but its driver never learns it, so the same write is
    committed again (its token and parts) later. Meanwhile its rows were retracted,
    compaction consolidated both writes away (the shard then holds no updates) and
    another client typed the shard: the second commit meets a schema that no longer
    fits. Its parts are the landed batch's, still referenced by the versions a reader's
    plan holds: it must find the batch in the shard's history and report the write
    committed, never delete them as "nothing was written"."""
    shard = str(ShardId.new())
    job = _write_job(_spark_options(durable_location, shard, 0, 1), overwrite=False)
    assert job.schema == b""
    rows = pa.table({"k": [b"raw"], "v": [b"x"], "t": [0], "d": [1]})
    message = PersistCommitMessage(*_write_task(job, iter(rows.to_batches())))
    assert message.parts
    _commit(job, [message])  # ...whose outcome its driver never learnt
    client.open_writer(shard).compare_and_append([(b"raw", b"x", 1, -1)], 1, 2)
    reader = client.open_reader(shard)
    with reader.snapshot_plan(1) as plan:
        assert {f.key for f in plan.file_details} >= {p.key for p in message.parts}
        reader.downgrade_since(1)  # the plan holds its version; its times consolidate
        client.compact(shard)
        assert sum(b.num_updates for b in
                   client._machine(shard).fetch_latest().batches.values()) == 0
        client.open_writer(shard, schema=V1)  # a shard without updates may be typed
        _commit(job, [message])  # committed again: found in history, not refused
        assert all(client.blobs.main.get(p.key) is not None for p in message.parts)
        assert plan.to_table().num_rows == 0  # every file of the plan is still there
    assert client.schema(shard) == V1
    assert client.open_reader(shard).snapshot(1).to_pylist() == []


@pytest.fixture(params=[BLOB, INLINE], ids=["blob", "inline"])
def policy(request: pytest.FixtureRequest) -> InlinePolicy:
    return request.param  # type: ignore[no-any-return]


def _evolved_under_an_old_writer(location: Location, policy: InlinePolicy
                                 ) -> tuple[PersistClient, str, object]:
    """Writer V1 opens; another process evolves the shard to V2 and upserts key 7 with
    the new column set. Returns (client, shard, the V1 writer)."""
    client = location.client(policy)
    shard = str(ShardId.new())
    old = client.open_writer(shard, schema=V1)
    old.upsert(pa.table({"id": [7, 8], "a": ["first", "eight"]}))
    with location.client(policy) as other:
        other.open_writer(shard, schema=V2).upsert(
            pa.table({"id": [7], "a": ["second"], "b": [42]}))
    return client, shard, old


def test_writer_opened_before_an_evolution_upserts_rows_written_in_the_new_shape(
        durable_location: Location, policy: InlinePolicy):
    client, shard, old = _evolved_under_an_old_writer(durable_location, policy)
    try:
        result = old.upsert(pa.table({"id": [7], "a": ["third"]}))  # type: ignore[attr-defined]
        reader = client.open_reader(shard)
        upper = result.upper - 1
        assert reader.snapshot(upper).to_pylist() == [
            {"id": 7, "a": "third", "b": None, "t": upper, "d": 1},
            {"id": 8, "a": "eight", "b": None, "t": upper, "d": 1}]
        # The parts' typed columns (what other engines read) are right too.
        with reader.snapshot_plan(upper) as plan:
            assert plan.to_table().sort_by("id").to_pylist() == [
                {"id": 7, "a": "third", "b": None, "t": upper, "d": 1},
                {"id": 8, "a": "eight", "b": None, "t": upper, "d": 1}]
            if plan.files:
                stored = plan.to_dataset().to_table(columns=["id", "a", "b", "d"])
                assert {"id": 7, "a": "second", "b": 42, "d": -1} in stored.to_pylist()
    finally:
        client.close()


def test_writer_opened_before_an_evolution_deletes_rows_written_in_the_new_shape(
        durable_location: Location, policy: InlinePolicy):
    client, shard, old = _evolved_under_an_old_writer(durable_location, policy)
    try:
        result = old.delete(pa.table({"id": [7]}))  # type: ignore[attr-defined]
        upper = result.upper - 1
        assert client.open_reader(shard).snapshot(upper).to_pylist() == [
            {"id": 8, "a": "eight", "b": None, "t": upper, "d": 1}]
    finally:
        client.close()


def test_old_writer_still_appends_in_its_own_shape_after_an_evolution(tmp_path: Path):
    """Plain appends by a writer opened before the evolution encode with its schema,
    whose rows are rows of the newer one too; the commit accepts them."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=BLOB)
    with client:
        shard = str(ShardId.new())
        old = client.open_writer(shard, schema=V1)
        client.open_writer(shard, schema=V2)
        old.compare_and_append(pa.table({"id": [1], "a": ["x"], "t": [0]}), 0, 1)
        assert client.open_reader(shard).snapshot(0).to_pylist() == [
            {"id": 1, "a": "x", "b": None, "t": 0, "d": 1}]


def test_encoded_updates_that_are_not_rows_of_the_schema_are_refused(tmp_path: Path):
    from persist_pipeline.updates import Updates

    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
    with client:
        shard = str(ShardId.new())
        writer = client.open_writer(shard, schema=V1)
        with pytest.raises(SchemaMismatch, match="not rows of the shard's schema"):
            writer.compare_and_append(Updates.coerce([(b"raw", b"bytes", 0, 1)]), 0, 1)
        assert writer.fetch_recent_upper() == 0
