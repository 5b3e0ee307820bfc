"""What a Spark write's idempotency token promises (docs/design.md, *Spark data source*).

A write's token names one write. Without option ``idempotency_token`` every save draws
a fresh one: a save run again is a new write. With it, a save run again is a retry of
the save that used the token: reported written (nothing appended twice) when that one
landed, even once compaction merged its batch away; a token that named a write at
another ``expected_upper`` is refused (``TokenReused``), never taken for that write.
Real backends: SQLite + files and PostgreSQL + S3; the driver's side runs without a
Spark session (the functions its PySpark classes call).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, ShardId
from persist_pipeline.exceptions import InvalidConfig, TokenReused, UpperMismatch
from persist_pipeline.ids import new_token
from persist_pipeline.spark_datasource import PersistCommitMessage
from persist_pipeline.spark_source import _commit, _commit_marker, _write_job, _write_task
from tests.fixtures.location import Location

BLOB = InlinePolicy(0, 0)


def _options(location: Location, shard: str, expected: int, new: int,
             **extra: str) -> dict[str, str]:
    options = {"consensus": location.consensus_uri, "blob": location.blob_uri,
               "shard": shard, "expected_upper": str(expected), "new_upper": str(new),
               **extra}
    if location.wal_blob_uri:
        options["wal_blob"] = location.wal_blob_uri
    return options


def _save(options: dict[str, str], rows: list[tuple[bytes, bytes, int, int]]) -> Any:
    """One ``df.write...save()``: plan, one task's upload, the driver's commit."""
    job = _write_job(options, overwrite=False)
    table = pa.table({"k": [r[0] for r in rows], "v": [r[1] for r in rows],
                      "t": [r[2] for r in rows], "d": [r[3] for r in rows]})
    message = PersistCommitMessage(*_write_task(job, iter(table.to_batches())))
    _commit(job, [message])
    return job


def _contents(client: PersistClient, shard: str, as_of: int) -> list[tuple[bytes, int]]:
    table = client.open_reader(shard).snapshot(as_of)
    return sorted(zip(table.column("k").to_pylist(), table.column("d").to_pylist(),
                      strict=True))


@pytest.fixture
def client(durable_location: Location) -> Iterator[PersistClient]:
    with durable_location.client(BLOB) as c:
        yield c


@pytest.mark.parametrize("compacted", [False, True], ids=["in-state", "merged-away"])
def test_a_save_run_again_with_its_token_is_reported_written_once(
        durable_location: Location, client: PersistClient, compacted: bool):
    shard = str(ShardId.new())
    client.open_writer(shard).compare_and_append([(b"base", b"", 0, 1)], 0, 1)
    token = new_token()
    options = _options(durable_location, shard, 1, 2, idempotency_token=token)
    first = _save(options, [(b"a", b"", 1, 1)])  # ...whose outcome its caller never saw
    assert first.token == token
    if compacted:
        client.compact(shard)
        assert len(client._machine(shard).fetch_latest().batches) == 1
    again = _save(options, [(b"a", b"", 1, 1)])  # run again: a retry, not a second write
    assert _contents(client, shard, 1) == [(b"a", 1), (b"base", 1)]
    assert client._machine(shard).fetch_latest().upper == 2
    # Each run's abort judges its own commit: the runs share the token, not the marker.
    assert _commit_marker(first) != _commit_marker(again)


def test_a_new_save_reusing_a_token_is_refused_not_taken_for_the_old_one(
        durable_location: Location, client: PersistClient):
    """The first save landed at [1, 2); a new save at [2, 3) with its token must not be
    reported written (its rows would be dropped silently): TokenReused, nothing
    written, the first save's rows intact."""
    shard = str(ShardId.new())
    client.open_writer(shard).compare_and_append([(b"base", b"", 0, 1)], 0, 1)
    token = new_token()
    _save(_options(durable_location, shard, 1, 2, idempotency_token=token),
          [(b"a", b"", 1, 1)])
    with pytest.raises(TokenReused, match=r"already named a write appended at \[1, 2\)"):
        _save(_options(durable_location, shard, 2, 3, idempotency_token=token),
              [(b"b", b"", 2, 1)])
    assert client._machine(shard).fetch_latest().upper == 2
    assert _contents(client, shard, 1) == [(b"a", 1), (b"base", 1)]
    # A single write reusing the token is refused alike, and committed() names it.
    writer = client.open_writer(shard)
    with pytest.raises(TokenReused):
        writer.compare_and_append([(b"b", b"", 2, 1)], 2, 3, idempotency_token=token)
    with pytest.raises(TokenReused):
        writer.committed(token, 2)
    assert writer.committed(token, 1) is True


def test_a_new_save_reusing_the_token_of_a_write_merged_away(
        durable_location: Location, client: PersistClient):
    """Once compaction merged the first save's batch away, the token is found only in
    history, which a refused write asks: a new save at a stale upper is TokenReused
    (never "already written"); one at the current upper is written, as a new write."""
    shard = str(ShardId.new())
    client.open_writer(shard).compare_and_append([(b"base", b"", 0, 1)], 0, 1)
    token = new_token()
    _save(_options(durable_location, shard, 1, 2, idempotency_token=token),
          [(b"a", b"", 1, 1)])
    client.compact(shard)
    assert len(client._machine(shard).fetch_latest().batches) == 1
    with pytest.raises(TokenReused):
        _save(_options(durable_location, shard, 0, 1, idempotency_token=token),
              [(b"b", b"", 0, 1)])
    _save(_options(durable_location, shard, 2, 3, idempotency_token=token),
          [(b"b", b"", 2, 1)])
    assert _contents(client, shard, 2) == [(b"a", 1), (b"b", 1), (b"base", 1)]


def test_saves_without_a_token_are_new_writes(durable_location: Location,
                                              client: PersistClient):
    """No option: each save draws its own token, so running a save again is a second
    write (at the same bounds it is refused: the first moved the upper)."""
    shard = str(ShardId.new())
    options = _options(durable_location, shard, 0, 1)
    first = _save(options, [(b"a", b"", 0, 1)])
    with pytest.raises(UpperMismatch):
        _save(options, [(b"a", b"", 0, 1)])
    second = _save(_options(durable_location, shard, 1, 2), [(b"a", b"", 1, 1)])
    assert first.token != second.token
    assert _contents(client, shard, 1) == [(b"a", 2)]


@pytest.mark.parametrize("token", ["", "has space", "x" * 129])
def test_a_malformed_token_option_is_refused_before_anything_is_created(
        durable_location: Location, client: PersistClient, token: str):
    with pytest.raises(InvalidConfig, match="option idempotency_token must be"):
        _write_job(_options(durable_location, "fresh/orders", 0, 1,
                            idempotency_token=token), overwrite=False)
    assert client.shard_names() == {} and client.list_shards() == []


def test_an_abort_after_a_commit_that_landed_keeps_its_parts(
        durable_location: Location, client: PersistClient):
    """Spark aborts a write whose commit raised on the JVM's side, also when the Python
    worker that ran the commit finished it (killed after committing, its reply lost):
    the commit's parts are then the shard's rows, and the abort must not delete them.
    An abort after failed tasks (no commit ran) still deletes what they uploaded."""
    from persist_pipeline.blob import open_blob
    from persist_pipeline.spark_source import _abort

    blob = open_blob(durable_location.blob_uri)
    shard = str(ShardId.new())
    landed = _write_job(_options(durable_location, shard, 0, 1), overwrite=False)
    message = PersistCommitMessage(*_write_task(landed, iter([pa.RecordBatch.from_pylist(
        [{"k": b"a", "v": b"", "t": 0, "d": 1}])])))
    _commit(landed, [message])  # ...whose reply Spark never got: it aborts the write
    _abort(landed, [message])
    assert all(blob.get(p.key) is not None for p in message.parts)
    assert _contents(client, shard, 0) == [(b"a", 1)]

    failed = _write_job(_options(durable_location, shard, 1, 2), overwrite=False)
    lost = PersistCommitMessage(*_write_task(failed, iter([pa.RecordBatch.from_pylist(
        [{"k": b"b", "v": b"", "t": 1, "d": 1}])])))
    _abort(failed, [lost])  # a task failed: no commit was attempted
    assert all(blob.get(p.key) is None for p in lost.parts)
    assert _contents(client, shard, 0) == [(b"a", 1)]


def test_an_abort_that_overtakes_its_commit_keeps_the_commit_from_landing(
        durable_location: Location, client: PersistClient):
    """Spark aborts a write while the Python worker that commits it has not started the
    commit yet: the abort deletes the uploaded parts (consensus says the batch never
    landed), and the late commit must then refuse instead of committing a batch whose
    parts are gone (every later read of the shard would fail on a missing part)."""
    from persist_pipeline.blob import open_blob
    from persist_pipeline.exceptions import CommitDeadlineExceeded
    from persist_pipeline.spark_source import _abort

    blob = open_blob(durable_location.blob_uri)
    shard = str(ShardId.new())
    job = _write_job(_options(durable_location, shard, 0, 1), overwrite=False)
    message = PersistCommitMessage(*_write_task(job, iter([pa.RecordBatch.from_pylist(
        [{"k": b"a", "v": b"", "t": 0, "d": 1}])])))
    _abort(job, [message])
    assert all(blob.get(p.key) is None for p in message.parts)
    with pytest.raises(CommitDeadlineExceeded, match="aborted"):
        _commit(job, [message])
    assert not _commit_marker(job).exists()
    assert all(client.inspect(s)["upper"] == 0 for s in client.list_shards())
    # The write run again (a new plan) commits as usual.
    _save(_options(durable_location, shard, 0, 1), [(b"a", b"", 0, 1)])
    assert _contents(client, shard, 0) == [(b"a", 1)]
