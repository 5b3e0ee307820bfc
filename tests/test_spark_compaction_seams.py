"""Seams of a Spark compaction (planned on the driver, run in tasks, committed by the
driver) that other processes act in between, on SQLite + files and PostgreSQL + S3.
The tasks run in process through :func:`drive_compaction` (what
:func:`compact_shards` hands to Spark), so the other process acts at an exact moment:
after the plan, before the commit.

- A typed shard whose schema evolves (a column added) between the plan and the commit,
  with rows in both shapes written meanwhile: the merged output, written with the
  planned schema, reads back with the right columns for every reader.
- The commit's reply lost: the retry settles it (applied once, its outputs kept and
  referenced; nothing left for GC to find orphaned).
- A local ``client.compact`` of the same merge winning the race: the Spark result is
  not applied, its parts are deleted, the snapshot is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, ShardId, ShardSchema
from persist_pipeline.blob import open_blob
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import VersionedData
from persist_pipeline.exceptions import ConsensusUnavailable
from persist_pipeline.spark import _run_task, _Task, _TaskResult, drive_compaction
from tests.fixtures.location import Location
from tests.helpers import ForwardingConsensus, state_history

V1 = ShardSchema({"id": pa.int64()}, {"a": pa.string()})
V2 = ShardSchema({"id": pa.int64()}, {"a": pa.string(), "b": pa.int32()})
INLINE = InlinePolicy(4096, 1 << 20)


class _LoseNextCommit(ForwardingConsensus):
    """Commits the next compare-and-set, then raises as if its reply were lost."""

    armed = False
    lost = 0

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        ok = self.inner.compare_and_set(shard, expected, new)
        if ok and self.armed:
            self.armed = False
            self.lost += 1
            raise ConsensusUnavailable("test: the commit landed but its reply was lost")
        return ok


def _parts(client: PersistClient, shard: str) -> set[str]:
    keys = {m.key for m in client.blobs.main.list_keys(shard)}
    if client.blobs.wal is not None:
        keys |= {m.key for m in client.blobs.wal.list_keys(shard)}
    return {k for k in keys if "/rollup/" not in k}


def _referenced(client: PersistClient, shard: str) -> set[str]:
    """The parts of every state version still in consensus (the inputs a merge
    replaced stay for readers of older versions until GC)."""
    return {p.key for state in state_history(client, shard)
            for b in state.batches.values() for p in b.hollow_parts()}


def _latest(client: PersistClient, shard: str) -> set[str]:
    state = client._machine(shard).fetch_latest()
    return {p.key for b in state.batches.values() for p in b.hollow_parts()}


def _typed_shard_with_work(client: PersistClient) -> str:
    shard = str(ShardId.new())
    w = client.open_writer(shard, schema=V1)
    for t in range(6):
        n = 300 if t == 2 else 3
        w.compare_and_append(pa.table({"id": [t * 1000 + j for j in range(n)],
                                       "a": [f"r{t}-{j}" for j in range(n)],
                                       "t": [t] * n}), t, t + 1)
    return shard


def _runner(meanwhile: Any, seen: list[_TaskResult] | None = None) -> Any:
    """Runs the tasks here, then ``meanwhile`` (another process acting between the
    tasks' end and the driver's commit)."""
    def run(tasks: list[_Task]) -> tuple[list[_TaskResult], str]:
        assert all(t.req.schema == V1.to_bytes() for t in tasks)  # planned with V1
        results = [_run_task(t) for t in tasks]
        assert all(r.res is not None for r in results), results
        if seen is not None:
            seen.extend(results)
        meanwhile()
        return results, "in-process"
    return run


@pytest.fixture
def client(durable_location: Location) -> Iterator[PersistClient]:
    with durable_location.client(INLINE) as c:
        yield c


def test_a_schema_evolved_between_plan_and_commit_reads_back_right(
        durable_location: Location, client: PersistClient) -> None:
    shard = _typed_shard_with_work(client)

    def evolve_and_write_new_shape() -> None:
        with durable_location.client(INLINE) as other:
            w = other.open_writer(shard, schema=V2)
            w.compare_and_append(pa.table({"id": [9000, 9001], "a": ["n0", "n1"],
                                           "b": [7, 8], "t": [6, 6]}), 6, 7)

    metrics = drive_compaction(_runner(evolve_and_write_new_shape), client, [shard],
                               blob_uri=durable_location.blob_uri,
                               wal_blob_uri=durable_location.wal_blob_uri)
    assert metrics[shard]["applied"] >= 1, metrics
    recorded = ShardSchema.from_bytes(client._machine(shard).fetch_latest().schema)
    assert [f.name for f in recorded.value] == ["a", "b"]  # evolved meanwhile
    # In id order: the rows of the planned shape (b null), then the new shape's.
    expected: list[dict[str, Any]] = [
        {"id": t * 1000 + j, "a": f"r{t}-{j}", "b": None}
        for t in range(6) for j in range(300 if t == 2 else 3)]
    expected += [{"id": 9000, "a": "n0", "b": 7}, {"id": 9001, "a": "n1", "b": 8}]
    _check_reads(durable_location, shard, expected)
    # A later merge of the output (parts typed with the planned schema) with the rows
    # written in the new shape reads back the same.
    client.compact(shard)
    _check_reads(durable_location, shard, expected)


def _check_reads(location: Location, shard: str, expected: list[dict[str, Any]]) -> None:
    """What a fresh process reads at time 6: rows, a plan's table, the parts' columns."""
    with location.client(INLINE) as fresh:
        reader = fresh.open_reader(shard)
        got = reader.snapshot(6).select(["id", "a", "b"]).sort_by("id").to_pylist()
        assert got == expected
        with reader.snapshot_plan(6) as plan:
            assert plan.to_table().select(["id", "a", "b"]).sort_by("id").to_pylist() \
                == expected
            if plan.files:  # the parts' typed columns, as other engines read them
                stored = plan.to_dataset().to_table(columns=["id", "a", "b"])
                assert stored.sort_by("id").to_pylist() == expected
        reader.expire()


def test_a_lost_commit_reply_is_settled_once_and_leaves_no_orphan(
        durable_location: Location, client: PersistClient) -> None:
    shard = _typed_shard_with_work(client)
    lossy = _LoseNextCommit(open_consensus(durable_location.consensus_uri))
    wal = open_blob(durable_location.wal_blob_uri) if durable_location.wal_blob_uri else None
    with PersistClient(lossy, open_blob(durable_location.blob_uri), wal,
                       client.config) as driver:
        before = driver.open_reader(shard).snapshot(5).sort_by("id").to_pylist()

        def lose_the_commit_reply() -> None:
            lossy.armed = True

        metrics = drive_compaction(_runner(lose_the_commit_reply), driver, [shard],
                                   blob_uri=durable_location.blob_uri,
                                   wal_blob_uri=durable_location.wal_blob_uri)
        assert lossy.lost == 1
        assert metrics[shard]["applied"] == metrics[shard]["requests"] >= 1, metrics
        assert metrics[shard]["not_applied"] == 0
    state = client._machine(shard).fetch_latest()
    assert state.inline_bytes == 0
    # Every part the state holds is stored, and every stored part is referenced by a
    # version: nothing left behind unreferenced for the orphan sweep.
    assert _latest(client, shard) <= _parts(client, shard) == _referenced(client, shard)
    assert client.open_reader(shard).snapshot(5).sort_by("id").to_pylist() == before


def test_a_local_compaction_winning_the_race_leaves_the_spark_result_unapplied(
        durable_location: Location, client: PersistClient) -> None:
    shard = _typed_shard_with_work(client)
    before = client.open_reader(shard).snapshot(5).sort_by("id").to_pylist()
    local: list[dict[str, Any]] = []
    seen: list[_TaskResult] = []

    def compact_locally() -> None:
        with durable_location.client(INLINE) as other:
            local.append(other.compact(shard))

    metrics = drive_compaction(_runner(compact_locally, seen), client, [shard],
                               blob_uri=durable_location.blob_uri,
                               wal_blob_uri=durable_location.wal_blob_uri)
    assert local[0]["applied"] >= 1
    assert metrics[shard]["applied"] == 0 and metrics[shard]["not_applied"] >= 1, metrics
    # The loser's parts were deleted: every stored part is referenced by a version.
    loser = {p.key for r in seen if r.res is not None for p in r.res.output.hollow_parts()}
    assert loser and not loser & _parts(client, shard)
    assert _latest(client, shard) <= _parts(client, shard) == _referenced(client, shard)
    assert client.open_reader(shard).snapshot(5).sort_by("id").to_pylist() == before
