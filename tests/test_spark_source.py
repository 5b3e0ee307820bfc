"""The ``persist`` PySpark data source (one ``local[2]`` session for the module).

Reads equal ``snapshot(as_of)`` on shards with compacted, blob, WAL and inline parts,
split over several partitions read by executors; writes commit every task's parts as
one atomic ``compare_and_append``, and a write that fails (an upper mismatch, bad rows
in one task) leaves nothing visible and no part behind.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, ShardId
from persist_pipeline.blob import open_blob
from persist_pipeline.consensus import open_consensus
from persist_pipeline.exceptions import (
    CommitDeadlineExceeded,
    InvalidUpdates,
    LeaseExpired,
    PartMissing,
    UpperMismatch,
)
from persist_pipeline.spark import register
from tests.fixtures.location import Location, location_kinds, make_location
from tests.helpers import expected_snapshot, rows
from tests.pipeline_support import spark_session
from tests.test_plan import INLINE_ON, build_mixed_shard

__all__ = ["spark_session"]  # a fixture, imported for pytest

pytestmark = pytest.mark.spark


def _spark_location(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    location = make_location(kind, request, tmp_path)
    if location.blob_uri.startswith("s3://"):
        # Spark's Python workers do not share this process's environment (the fake AWS
        # credentials the S3 fixture sets): give them in the URI, as on a cluster.
        location = replace(location, blob_uri=location.blob_uri +
                           "&access_key_id=testing&secret_access_key=testing")
    return location


@pytest.fixture(params=location_kinds("embedded", "pg-s3-wal"))
def spark_location(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    return _spark_location(request.param, request, tmp_path)


def _options(location: Location, shard: str, **extra: Any) -> dict[str, str]:
    opts = {"consensus": location.consensus_uri, "blob": location.blob_uri, "shard": shard}
    if location.wal_blob_uri:
        opts["wal_blob"] = location.wal_blob_uri
    opts.update({k: str(v) for k, v in extra.items()})
    return opts


def _spark_rows(df: Any) -> list[tuple[bytes, bytes, int, int]]:
    return sorted((bytes(r.k), bytes(r.v), r.t, r.d) for r in df.collect())


def _as_rows(table: Any) -> list[tuple[bytes, bytes, int, int]]:
    return sorted((r["k"], r["v"], r["t"], r["d"]) for r in table.to_pylist())


def test_spark_read_equals_snapshot(spark_session: Any, spark_location: Location) -> None:
    register(spark_session)
    client = spark_location.client(INLINE_ON)
    shard, written = build_mixed_shard(client)
    reader = client.open_reader(shard)
    for as_of in (1, 3, 5):
        df = (spark_session.read.format("persist")
              .options(**_options(spark_location, shard, as_of=as_of, partition_bytes=512))
              .load())
        assert df.columns == ["k", "v", "t", "d"]
        # Several key ranges, each read by its own task.
        assert df.rdd.getNumPartitions() > 1
        got = _spark_rows(df)
        assert got == _as_rows(reader.snapshot(as_of))
        assert [(k, v, d) for k, v, _, d in got] == expected_snapshot(written, as_of)
    # Defaults: as_of is the latest complete time, and a small shard is one partition.
    df = spark_session.read.format("persist").options(**_options(spark_location, shard)).load()
    assert df.rdd.getNumPartitions() == 1
    assert _spark_rows(df) == _as_rows(reader.snapshot(5))
    reader.expire()
    client.close()


def _blob_keys(location: Location, shard: str) -> set[str]:
    keys = set()
    for uri in (location.blob_uri, location.wal_blob_uri):
        if uri:
            keys |= {m.key for m in open_blob(uri).list_keys(f"{shard}/p/")}
    return keys


@pytest.mark.parametrize("kind", location_kinds("embedded", "pg-s3"))
def test_spark_write_round_trips_atomically(spark_session: Any, kind: str,
                                            request: pytest.FixtureRequest,
                                            tmp_path: Path) -> None:
    register(spark_session)
    location = _spark_location(kind, request, tmp_path)
    client: PersistClient = location.client(InlinePolicy(4096, 1 << 20))
    shard = str(ShardId.new())
    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"seed", b"x", 0, 1)], 0, 10)
    updates = [(b"user-%03d" % i, b"event-%d" % (i % 7), 10 + i % 5, 1 + i % 2)
               for i in range(400)]
    df = spark_session.createDataFrame(updates, "k binary, v binary, t long, d long"
                                       ).repartition(3)
    (df.write.format("persist")
     .options(**_options(location, shard, expected_upper=10, new_upper=20))
     .mode("append").save())
    state = client._machine(shard).fetch_latest()
    assert state.upper == 20
    # One batch for the whole write, with the parts of every task.
    spark_batches = [b for b in state.batches.values() if b.desc.lower == 10]
    assert len(spark_batches) == 1 and len(spark_batches[0].parts) == 3
    reader = client.open_reader(shard)
    everything = [(b"seed", b"x", 0, 1), *updates]
    assert rows(reader.snapshot(19), 19) == expected_snapshot(everything, 19)
    # Read back through the data source.
    back = (spark_session.read.format("persist")
            .options(**_options(location, shard, as_of=19)).load())
    assert _spark_rows(back) == _as_rows(reader.snapshot(19))

    # An upper mismatch: the write fails, nothing becomes visible, no part is left.
    keys_before = _blob_keys(location, shard)
    seqno_before = client._machine(shard).fetch_latest().seqno
    with pytest.raises(Exception, match="UpperMismatch"):
        (df.write.format("persist")
         .options(**_options(location, shard, expected_upper=10, new_upper=30))
         .mode("append").save())
    after = client._machine(shard).fetch_latest()
    assert after.upper == 20
    assert [b.id for b in after.batches.values()] == [b.id for b in state.batches.values()]
    assert _blob_keys(location, shard) == keys_before
    # A task with a row outside [expected_upper, new_upper): the others' parts go too.
    bad = spark_session.createDataFrame(
        [(b"a", b"b", 20, 1)] * 50 + [(b"late", b"b", 99, 1)],
        "k binary, v binary, t long, d long").repartition(3)
    with pytest.raises(Exception, match="update times must lie"):
        (bad.write.format("persist")
         .options(**_options(location, shard, expected_upper=20, new_upper=30))
         .mode("append").save())
    assert client._machine(shard).fetch_latest().upper == 20
    assert _blob_keys(location, shard) == keys_before
    assert client._machine(shard).fetch_latest().seqno >= seqno_before
    reader.expire()
    client.close()


def test_a_spark_write_whose_tasks_sums_leave_64_bits_is_refused(
        spark_session: Any, spark_location: Location) -> None:
    """Diffs never wrap, whichever entry point writes: equal (k, v, t) in two tasks whose
    diffs sum beyond 64 bits are refused like one API write holding them (InvalidUpdates,
    nothing visible, no part left); sums that fit, also -2**63 exactly, commit."""
    register(spark_session)
    client = spark_location.client()
    shard = str(ShardId.new())
    half = 1 << 62
    schema = "k binary, v binary, t long, d long"

    def write(updates: list[tuple[bytes, bytes, int, int]], expected: int) -> None:
        # One row per task: each task's own sums fit, only the write's do not.
        df = spark_session.createDataFrame(
            spark_session.sparkContext.parallelize(updates, len(updates)), schema)
        (df.write.format("persist")
         .options(**_options(spark_location, shard, expected_upper=expected,
                             new_upper=expected + 1))
         .mode("append").save())

    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"seed", b"x", 0, 1)], 0, 1)
        with pytest.raises(InvalidUpdates, match="beyond 64 bits"):
            writer.compare_and_append([(b"k", b"v", 1, half), (b"k", b"v", 1, half)], 1, 2)
    keys_before = _blob_keys(spark_location, shard)
    with pytest.raises(Exception, match=r"InvalidUpdates.*beyond 64 bits"):
        write([(b"k", b"v", 1, half), (b"k", b"v", 1, half)], 1)
    assert client._machine(shard).fetch_latest().upper == 1
    assert _blob_keys(spark_location, shard) == keys_before
    # Sums that fit commit, also across tasks: -2**63 exactly, and big diffs at
    # different times.
    write([(b"k", b"v", 1, -half), (b"k", b"v", 1, -half), (b"j", b"v", 1, half),
           (b"j", b"w", 1, half)], 1)
    with client.open_reader(shard) as reader:
        assert _as_rows(reader.snapshot(1)) == [
            (b"j", b"v", 1, half), (b"j", b"w", 1, half), (b"k", b"v", 1, -(1 << 63)),
            (b"seed", b"x", 1, 1)]
    client.close()


def test_an_untyped_spark_write_without_d_counts_each_row_once(
        spark_session: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``d`` is optional in an untyped write as in the CLI's append, ingestion and a
    typed Spark write: a DataFrame of k, v, t alone writes each row with count 1, the
    rows the CLI appends from the same file content."""
    from persist_pipeline import cli

    register(spark_session)
    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    rows_ = [(b"a", b"1", 0), (b"b", b"2", 1), (b"a", b"1", 1)]
    df = spark_session.createDataFrame(rows_, "k binary, v binary, t long").repartition(2)
    (df.write.format("persist")
     .options(consensus=consensus, blob=blob, shard="spark/events", expected_upper="0",
              new_upper="2").mode("append").save())
    lines = tmp_path / "events.jsonl"
    lines.write_text('{"k": "a", "v": "1", "t": 0}\n{"k": "b", "v": "2", "t": 1}\n'
                     '{"k": "a", "v": "1", "t": 1}\n')
    env = ["--consensus", consensus, "--blob", blob]
    assert cli.main([*env, "append", "cli/events", str(lines), "--create",
                     "--new-upper", "2"]) == 0
    client = PersistClient.open(consensus, blob)
    snapshots = []
    for name in ("spark/events", "cli/events"):
        reader = client.open_reader(client.resolve(name))
        snapshots.append(_as_rows(reader.snapshot(1)))
        reader.expire()
    assert snapshots[0] == snapshots[1] == [(b"a", b"1", 1, 2), (b"b", b"2", 1, 1)]
    client.close()


def test_a_new_name_is_registered_only_when_its_write_commits(
        spark_session: Any, tmp_path: Path) -> None:
    """A Spark write to a new name refused for a row only a task meets (a time outside
    the bounds, a null key) leaves the name unregistered, as the CLI's append --create
    and a transaction do; the next good write registers it with its rows. A name another
    writer registered while a write was planned refuses that write's commit (its parts
    are deleted), and the name keeps the other writer's shard."""
    from persist_pipeline.spark_datasource import PersistCommitMessage
    from persist_pipeline.spark_source import _abort, _commit, _write_job, _write_task

    register(spark_session)
    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    opts = {"consensus": consensus, "blob": blob, "shard": "fresh/late",
            "expected_upper": "0", "new_upper": "5"}
    schema = "k binary, v binary, t long, d long"
    late = spark_session.createDataFrame([(b"a", b"1", 0, 1), (b"b", b"2", 9, 1)], schema)
    no_key = spark_session.createDataFrame([(None, b"1", 0, 1)], schema)
    client = PersistClient.open(consensus, blob)
    for bad, error in ((late, "update times must lie"), (no_key, "contains nulls")):
        with pytest.raises(Exception, match=error):
            bad.write.format("persist").options(**opts).mode("append").save()
        assert "fresh/late" not in client.shard_names()
    good = spark_session.createDataFrame([(b"a", b"1", 0, 1)], schema)
    good.write.format("persist").options(**opts).mode("append").save()
    reader = client.open_reader(client.resolve("fresh/late"))
    assert _as_rows(reader.snapshot(4)) == [(b"a", b"1", 4, 1)]
    reader.expire()

    # Another writer registers the name between this write's plan and its commit.
    raced = {**opts, "shard": "fresh/raced"}
    job = _write_job(raced, overwrite=False)
    parts, n, bound = _write_task(job, iter([pa.RecordBatch.from_pylist(
        [{"k": b"a", "v": b"b", "t": 1, "d": 1}])]))
    other = client.resolve("fresh/raced", create=True)
    message = PersistCommitMessage(parts, n, bound)
    with pytest.raises(UpperMismatch):
        _commit(job, [message])
    _abort(job, [message])
    assert open_blob(blob).get(parts[0].key) is None
    assert client.resolve("fresh/raced") == other
    client.close()


def _one_task_write_to(tmp_path: Path, name: str) -> tuple[str, str, Any, Any]:
    """A planned Spark write of one row to ``name`` (new) on an embedded location, its one
    task run: the consensus and blob URIs, the job and the task's commit message."""
    from persist_pipeline.spark_datasource import PersistCommitMessage
    from persist_pipeline.spark_source import _write_job, _write_task

    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    opts = {"consensus": consensus, "blob": blob, "shard": name,
            "expected_upper": "0", "new_upper": "5"}
    job = _write_job(opts, overwrite=False)
    parts, n, bound = _write_task(job, iter([pa.RecordBatch.from_pylist(
        [{"k": b"a", "v": b"b", "t": 1, "d": 1}])]))
    return consensus, blob, job, PersistCommitMessage(parts, n, bound)


def test_a_write_to_a_new_name_refused_by_its_commit_registers_no_name(
        tmp_path: Path) -> None:
    """A Spark write to a new name whose commit itself is refused (the driver paused
    past the commit deadline after planning) leaves the name unregistered: the name is
    created in the commit's own compare-and-set. Committed in time, it is registered
    with the write's rows."""
    import dataclasses

    from persist_pipeline.config import PersistConfig
    from persist_pipeline.spark_source import _commit

    consensus, blob, job, message = _one_task_write_to(tmp_path, "fresh/paused")
    # Planned longer ago than the commit deadline (half the orphan age) allows.
    paused = dataclasses.replace(
        job, planned_s=job.planned_s - PersistConfig().gc_orphan_min_age_s)
    with pytest.raises(CommitDeadlineExceeded):
        _commit(paused, [message])
    client = PersistClient.open(consensus, blob)
    assert "fresh/paused" not in client.shard_names()
    _commit(job, [message])
    reader = client.open_reader(client.resolve("fresh/paused"))
    assert _as_rows(reader.snapshot(4)) == [(b"a", b"b", 4, 1)]
    reader.expire()
    client.close()


def test_two_commits_of_one_write_to_a_new_name_racing_land_it_once(tmp_path: Path) -> None:
    """The same Spark write committed twice at once (a driver that never learnt the
    outcome commits again while the first commit is on its way): the second loses its
    compare-and-set to the first, finds the name record it was to create holding its
    own shard, and reports the write committed; the name is registered once, the rows
    are there once."""
    from persist_pipeline.spark_source import _commit
    from tests.helpers import ForwardingConsensus

    consensus, blob, job, message = _one_task_write_to(tmp_path, "fresh/twice")
    first = PersistClient.open(consensus, blob)
    racing: list[bool] = [True]

    class FirstCommitLandsMeanwhile(ForwardingConsensus):
        def compare_and_set_many(self, writes: Any) -> bool:
            if racing and any(w.expected is None for w in writes):
                racing.clear()  # the other commit of this write lands just before
                _commit(job, [message], first)
            return super().compare_and_set_many(writes)

    second = PersistClient(FirstCommitLandsMeanwhile(open_consensus(consensus)),
                           open_blob(blob))
    _commit(job, [message], second)
    assert not racing  # the race happened
    assert first.shard_names() == {"fresh/twice": ShardId.parse(job.location.shard_id)}
    reader = first.open_reader(first.resolve("fresh/twice"))
    assert _as_rows(reader.snapshot(4)) == [(b"a", b"b", 4, 1)]
    reader.expire()
    first.close()
    second.close()


def test_spark_source_refuses_bad_options(spark_session: Any, tmp_path: Path) -> None:
    register(spark_session)
    opts = {"consensus": f"sqlite:///{tmp_path / 'c.db'}", "blob": "mem://x",
            "shard": str(ShardId.new())}
    with pytest.raises(Exception, match="in-memory store"):
        spark_session.read.format("persist").options(**opts).load().collect()
    with pytest.raises(Exception, match="option consensus names an in-memory store"):
        spark_session.read.format("persist").options(**{**opts, "consensus": "mem://x"}
                                                    ).load().collect()
    df = spark_session.createDataFrame([(b"a", b"b", 0, 1)], "k binary, v binary, t long, d long")
    opts["blob"] = f"file://{tmp_path / 'b'}"
    with pytest.raises(Exception, match="append-only"):
        df.write.format("persist").options(**opts, expected_upper="0", new_upper="1"
                                           ).mode("overwrite").save()
    # Bad bounds are refused before a name is resolved: a name is registered for good,
    # so a refused write must not leave one behind.
    opts["shard"] = "fresh/orders"
    for bounds, error in (({"expected_upper": "5", "new_upper": "3"}, "must be beyond"),
                          ({"expected_upper": "x", "new_upper": "3"}, "must be a time"),
                          ({"expected_upper": "closed", "new_upper": "3"}, "must be a time"),
                          ({"new_upper": "3"}, "needs option expected_upper")):
        with pytest.raises(Exception, match=f"InvalidFrontier.*{error}"):
            df.write.format("persist").options(**opts, **bounds).mode("append").save()
    client = PersistClient.open(opts["consensus"], opts["blob"])
    assert client.shard_names() == {} and client.list_shards() == []
    client.close()


def test_a_write_whose_columns_the_shard_cannot_take_creates_nothing(
        spark_session: Any, tmp_path: Path) -> None:
    """Bad input changes nothing, whichever entry point writes: a DataFrame whose
    columns cannot be a write of the shard (text keys, a typed shard's columns missing)
    is refused with the error an API write gets, before a name is registered (for good)
    or a shard created, as the CLI's append --create and a transaction refuse it."""
    from persist_pipeline import ShardSchema
    from persist_pipeline.exceptions import SchemaMismatch

    register(spark_session)
    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    client = PersistClient.open(consensus, blob)
    text = spark_session.createDataFrame([("k", "v", 0, 1)], "k string, v string, t long, "
                                                             "d long")
    with pytest.raises(InvalidUpdates, match="encode them as UTF-8"):
        client.transaction().compare_and_append("fresh/orders", text.toArrow(), 0, 1)
    fresh_id = str(ShardId.new())
    for shard in ("fresh/orders", fresh_id):
        with pytest.raises(Exception, match=r"InvalidUpdates.*encode them as UTF-8"):
            (text.write.format("persist")
             .options(consensus=consensus, blob=blob, shard=shard, expected_upper="0",
                      new_upper="1").mode("append").save())
    assert client.shard_names() == {} and client.list_shards() == []
    # A typed shard: the DataFrame lacks its key column; the shard stays as it was.
    typed = client.resolve("typed/orders", create=True)
    client.open_writer(typed, schema=ShardSchema([("id", pa.int64())],
                                                 [("name", pa.string())])).expire()
    names = spark_session.createDataFrame([("ann", 0)], "name string, t long")
    with client.open_writer(typed) as writer, pytest.raises(SchemaMismatch):
        writer.compare_and_append(names.toArrow(), 0, 1)
    seqno = client._machine(str(typed)).fetch_latest().seqno
    with pytest.raises(Exception, match="SchemaMismatch"):
        (names.write.format("persist")
         .options(consensus=consensus, blob=blob, shard="typed/orders",
                  expected_upper="0", new_upper="1").mode("append").save())
    assert client._machine(str(typed)).fetch_latest().seqno == seqno
    assert set(client.shard_names()) == {"typed/orders"}
    client.close()


@pytest.mark.parametrize("wal", [False, True], ids=["main", "wal"])
def test_a_planned_read_keeps_its_files_until_its_lease_runs_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wal: bool) -> None:
    """Compaction commits while the planner splits the plan, and GC runs before the
    executors read: the plan's files must stay for the lease (no Spark needed). With a
    WAL store, the plan lists WAL parts that compaction moves to the main store: the
    executors still read them from the WAL store."""
    from persist_pipeline import PersistConfig, ReadHandle
    from persist_pipeline.spark_source import _read_partition, make_read_plan

    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    wal_blob = f"file://{tmp_path / 'w'}" if wal else None
    client = PersistClient.open(consensus, blob, wal_blob, inline_policy=InlinePolicy(0, 0),
                                config=PersistConfig(rollup_threshold=4))
    shard = str(ShardId.new())
    written = []
    with client.open_writer(shard) as writer:
        for t in range(10):
            batch = [(b"k%d" % (t % 4), b"v%d" % t, t, 1)]
            writer.compare_and_append(batch, t, t + 1)
            written += batch
    opts = {"consensus": consensus, "blob": blob, "shard": shard, "as_of": "9",
            "partition_bytes": "1024", "lease_seconds": "1.5"}
    if wal_blob:
        opts["wal_blob"] = wal_blob
    take_plan = ReadHandle.snapshot_plan

    def compacting_meanwhile(*args: Any) -> Any:
        plan = take_plan(*args)
        client.compact(shard)
        with client.open_writer(shard) as writer:
            for t in range(10, 20):
                writer.compare_and_append([], t, t + 1)
        return plan

    monkeypatch.setattr(ReadHandle, "snapshot_plan", compacting_meanwhile)
    location, as_of, partitions, lease, _, reader_id, _ = make_read_plan(opts)
    assert len(partitions) > 1 and lease == 1.5
    assert {f.store for p in partitions for f in p.parts} == {"wal" if wal else "main"}
    if wal:  # compaction moved every part out of the WAL store
        assert {p.store for b in client._machine(shard).fetch_latest().batches.values()
                for p in b.hollow_parts()} == {"main"}
    assert client.gc(shard)["blobs_deleted"] == 0
    got = sorted((r["k"], r["v"], r["d"]) for p in partitions
                 for b in _read_partition(location, as_of, p, lease, reader_id=reader_id)
                 for r in b.to_pylist())
    assert got == expected_snapshot(written, 9)
    # Once the lease ran out, GC expires the planner's reader and collects the files:
    # a read that late fails clearly instead of returning wrong data.
    import time

    time.sleep(1.6)
    assert client.gc(shard)["blobs_deleted"] >= 10
    with pytest.raises(LeaseExpired, match="longer than its reader's lease"):
        for p in partitions:
            list(_read_partition(location, as_of, p, lease, reader_id=reader_id))
    client.close()


def test_a_part_missing_while_its_reader_holds_the_plan_is_no_lease_that_ran_out(
        tmp_path: Path) -> None:
    """A read whose blob option names another store than the location's (the planner
    finds the state in consensus, the executors no part) fails with PartMissing saying
    the reader still holds the files, not with advice to lengthen a lease that did not
    run out (no Spark needed)."""
    from persist_pipeline.spark_source import _read_partition, make_read_plan

    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    client = PersistClient.open(consensus, blob, inline_policy=InlinePolicy(0, 0))
    shard = str(ShardId.new())
    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    (tmp_path / "other").mkdir()
    opts = {"consensus": consensus, "blob": f"file://{tmp_path / 'other'}", "shard": shard}
    location, as_of, [partition], lease, _, reader_id, _ = make_read_plan(opts)
    with pytest.raises(PartMissing, match="reader still holds it") as missing:
        list(_read_partition(location, as_of, partition, lease, reader_id=reader_id))
    assert not isinstance(missing.value, LeaseExpired)
    client.close()


def test_a_read_of_a_mistyped_location_creates_nothing_there(tmp_path: Path) -> None:
    """A read opens the location without creating it, as the CLI's reads do: a
    mistyped consensus or blob URI is reported as no store there, rather than leaving
    an empty database and folder behind and reporting the shard missing (no Spark
    needed: the planner's and the declared schema's side)."""
    from persist_pipeline.exceptions import BlobLocationNotFound, ConsensusLocationNotFound
    from persist_pipeline.spark_source import _Location, _shard_schema, make_read_plan

    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    client = PersistClient.open(consensus, blob)
    shard = str(ShardId.new())
    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    client.register_name("sales/orders", ShardId.parse(shard))
    client.close()
    typo_db, typo_dir = tmp_path / "typo.db", tmp_path / "typo"
    for bad, error in (({"consensus": f"sqlite:///{typo_db}"}, ConsensusLocationNotFound),
                       ({"blob": f"file://{typo_dir}"}, BlobLocationNotFound)):
        for name in ("sales/orders", shard):
            opts = {"consensus": consensus, "blob": blob, "shard": name, **bad}
            with pytest.raises(error):
                make_read_plan(opts)
            with pytest.raises(error):
                _shard_schema(_Location.from_options(opts))
    assert not typo_db.exists() and not typo_dir.exists()


def test_abort_deletes_parts_only_when_no_commit_was_attempted(tmp_path: Path) -> None:
    """Spark calls abort after a failed task (no commit ran: the parts are certainly
    unreferenced) and after a failed commit (which may have been indeterminate: the
    parts may be referenced, so they are GC's to judge)."""
    import pyarrow as pa

    from persist_pipeline.spark_datasource import PersistCommitMessage
    from persist_pipeline.spark_source import (
        _abort,
        _commit_marker,
        _write_job,
        _write_task,
    )

    blob = f"file://{tmp_path / 'b'}"
    opts = {"consensus": f"sqlite:///{tmp_path / 'c.db'}", "blob": blob,
            "shard": str(ShardId.new()), "expected_upper": "0", "new_upper": "5"}
    batch = pa.RecordBatch.from_pylist([{"k": b"a", "v": b"b", "t": 1, "d": 1}])

    def uploaded(job: Any) -> PersistCommitMessage:
        parts, n, bound = _write_task(job, iter([batch]))
        assert len(parts) == 1 and open_blob(blob).get(parts[0].key) is not None
        return PersistCommitMessage(parts, n, bound)

    failed_task = _write_job(opts, overwrite=False)
    message = uploaded(failed_task)
    _abort(failed_task, [message])
    assert open_blob(blob).get(message.parts[0].key) is None

    failed_commit = _write_job(opts, overwrite=False)
    message = uploaded(failed_commit)
    _commit_marker(failed_commit).touch()  # what a commit does before its first CaS
    _abort(failed_commit, [message])
    assert open_blob(blob).get(message.parts[0].key) is not None
    assert not _commit_marker(failed_commit).exists()


def test_a_lost_task_attempt_of_a_write_to_a_new_shard_is_swept(tmp_path: Path) -> None:
    """Planning creates the shard, so the parts of a task attempt nobody commits (Spark
    retried the task; the job then aborted) are swept by GC like any orphan, even
    though no write ever committed to the shard."""
    import pyarrow as pa

    from persist_pipeline import PersistConfig
    from persist_pipeline.spark_source import _abort, _write_job, _write_task
    from tests.helpers import StoreOnClock

    class Clock:
        offset_s = 0.0

    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    shard = str(ShardId.new())
    job = _write_job({"consensus": consensus, "blob": blob, "shard": shard,
                      "expected_upper": "0", "new_upper": "1"}, overwrite=False)
    batch = pa.RecordBatch.from_pylist([{"k": b"a", "v": b"b", "t": 0, "d": 1}])
    lost, _, _ = _write_task(job, iter([batch]))  # its executor died: no message
    _abort(job, [])  # the retries failed too: Spark aborts the job
    clock = Clock()
    store = StoreOnClock(open_blob(blob), clock)
    client = PersistClient(open_consensus(consensus), store, None,
                           PersistConfig(gc_orphan_min_age_s=60.0))
    try:
        assert shard in client.list_shards()
        assert store.get(lost[0].key) is not None
        # The store's clock: the orphan is now older than the shard's age, which its
        # planner (default config) recorded and GC goes by, whatever its own config.
        clock.offset_s = PersistConfig().gc_orphan_min_age_s + 1
        assert client.gc(shard)["orphans_deleted"] == 1
        assert store.get(lost[0].key) is None
    finally:
        client.close()


def test_typed_shard_reads_and_writes_real_spark_types(spark_session: Any,
                                                       spark_location: Location) -> None:
    import datetime
    import decimal

    from persist_pipeline import ShardSchema

    register(spark_session)
    client = spark_location.client(INLINE_ON)
    shard = ShardId.new()
    schema = ShardSchema(
        [("id", pa.int64())],
        [("name", pa.string()), ("amount", pa.decimal128(10, 2)),
         ("at", pa.timestamp("us", tz="UTC")), ("day", pa.date32()), ("ok", pa.bool_()),
         ("tags", pa.list_(pa.string())), ("addr", pa.struct([("city", pa.string()),
                                                              ("zip", pa.int32())]))])
    writer = client.open_writer(shard, schema=schema)
    rows = [{"id": i, "name": None if i % 7 == 0 else f"n{i}",
             "amount": decimal.Decimal(i) / 4, "day": datetime.date(2026, 1, 1 + i % 28),
             "at": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
             "ok": i % 2 == 0, "tags": ["a"] * (i % 3), "addr": {"city": f"c{i}", "zip": i},
             "t": 0} for i in range(300)]
    writer.compare_and_append(rows, 0, 1)  # a blob part
    writer.upsert([{"id": 5, "name": "five"}])  # inline; other columns null
    writer.delete([{"id": 6}])
    upper = writer.fetch_recent_upper()
    assert upper is not None
    df = (spark_session.read.format("persist")
          .options(**_options(spark_location, str(shard), partition_bytes=2048,
                              partitions=3)).load())
    assert df.columns == [*schema.columns, "t", "d"]
    assert dict(df.dtypes) == {"id": "bigint", "name": "string", "amount": "decimal(10,2)",
                               "at": "timestamp", "day": "date", "ok": "boolean",
                               "tags": "array<string>",
                               "addr": "struct<city:string,zip:int>", "t": "bigint",
                               "d": "bigint"}
    assert df.rdd.getNumPartitions() > 1
    snapshot = client.open_reader(shard).snapshot(upper - 1)
    got = sorted((r.id, r.name, r.amount, r.day, r.ok, r.tags,
                  None if r.addr is None else (r.addr.city, r.addr.zip), r.t, r.d)
                 for r in df.collect())
    want = sorted((r["id"], r["name"], r["amount"], r["day"], r["ok"], r["tags"],
                   None if r["addr"] is None else (r["addr"]["city"], r["addr"]["zip"]),
                   r["t"], r["d"]) for r in snapshot.to_pylist())
    assert got == want and len(got) == 299
    # A typed write from Spark: the same columns (d optional), committed atomically.
    new = spark_session.createDataFrame(
        [(1000 + i, f"spark{i}", upper) for i in range(20)], "id long, name string, t long")
    (new.write.format("persist")
     .options(**_options(spark_location, str(shard), expected_upper=upper,
                         new_upper=upper + 1)).mode("append").save())
    after = client.open_reader(shard).snapshot(upper)
    names = {r["id"]: r["name"] for r in after.to_pylist() if r["id"] >= 1000}
    assert names == {1000 + i: f"spark{i}" for i in range(20)}
    client.close()


def test_a_read_whose_shard_schema_evolved_after_load_reads_the_declared_columns(
        spark_session: Any, tmp_path: Path) -> None:
    """``load()`` fixes the DataFrame's columns (the data source's ``schema()``); the
    reader plans when an action runs. A nullable value column appended to the shard in
    between must not make the read fail on batches of another shape: the rows read are
    those of the declared columns (the evolution only appended a nullable column)."""
    from persist_pipeline import ShardSchema

    register(spark_session)
    location = _spark_location("embedded", None, tmp_path)  # type: ignore[arg-type]
    client = location.client(INLINE_ON)
    shard = ShardId.new()
    v1 = ShardSchema([("id", pa.int64())], [("name", pa.string())])
    writer = client.open_writer(shard, schema=v1)
    writer.compare_and_append([{"id": 1, "name": "one", "t": 0}], 0, 1)
    df = spark_session.read.format("persist").options(**_options(location, str(shard))).load()
    assert df.columns == ["id", "name", "t", "d"]
    v2 = ShardSchema([("id", pa.int64())], [("name", pa.string()), ("n", pa.int64())])
    evolved = client.open_writer(shard, schema=v2)
    evolved.compare_and_append([{"id": 2, "name": "two", "n": 2, "t": 1}], 1, 2)
    got = sorted((r.id, r.name, r.t, r.d) for r in df.collect())
    assert got == [(1, "one", 1, 1), (2, "two", 1, 1)]
    # A shard typed after load() (it was empty: k, v, t, d declared) is refused clearly.
    empty = ShardId.new()
    client.create_shard(empty)
    df = spark_session.read.format("persist").options(**_options(location, str(empty)),
                                                      as_of="0").load()
    assert df.columns == ["k", "v", "t", "d"]
    client.open_writer(empty, schema=v1).compare_and_append(
        [{"id": 1, "name": "one", "t": 0}], 0, 1)
    with pytest.raises(Exception, match="SchemaMismatch"):
        df.collect()
    client.close()


def test_a_read_as_of_before_an_evolution_has_the_shards_current_columns(
        spark_session: Any, tmp_path: Path) -> None:
    """A read at a time before nullable columns were appended returns the rows of that
    time with the shard's current columns (the added ones null), as ``snapshot`` and a
    read plan do; only a table load pinned to an upper returns the columns the table
    was stored with. Parts written under both schemas, merged by compaction, read
    alike; a time below since is refused by the planner."""
    from persist_pipeline.tables import load_table, store_table

    register(spark_session)
    location = _spark_location("embedded", None, tmp_path)  # type: ignore[arg-type]
    client = location.client(INLINE_ON)
    first = store_table(client, "orders", pa.table({"id": [1, 2], "x": ["a", "b"]}), ["id"])
    second = store_table(client, "orders", pa.table(
        {"id": [1, 2, 3], "x": ["a", "b", "c"], "y": [1.5, None, 2.0]}), ["id"])
    assert first.shard == second.shard and first.result.upper == 1
    client.compact(str(first.shard))
    reader = client.open_reader(first.shard)
    for as_of, want in ((0, [(1, "a", None), (2, "b", None)]),
                        (1, [(1, "a", 1.5), (2, "b", None), (3, "c", 2.0)])):
        df = (spark_session.read.format("persist")
              .options(**_options(location, "orders", as_of=as_of)).load())
        assert df.columns == ["id", "x", "y", "t", "d"]
        assert sorted((r.id, r.x, r.y, r.t, r.d) for r in df.collect()) == [
            (*row, as_of, 1) for row in want]
        snapshot = reader.snapshot(as_of)
        assert snapshot.column_names == df.columns
        assert sorted((r["id"], r["x"], r["y"]) for r in snapshot.to_pylist()) == want
        with reader.snapshot_plan(as_of) as plan:
            assert plan.to_table().equals(snapshot)
    assert load_table(client, "orders", 1).to_pylist() == [{"id": 1, "x": "a"},
                                                           {"id": 2, "x": "b"}]
    # Below since: the planner refuses with the reader's own typed error.
    shard = ShardId.new()
    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"a", b"1", 0, 1), (b"b", b"1", 1, 1)], 0, 2)
    holder = client.open_reader(shard)
    holder.downgrade_since(1)
    assert client.inspect(shard)["since"] == 1
    with pytest.raises(Exception, match="SinceViolation"):
        (spark_session.read.format("persist")
         .options(**_options(location, str(shard), as_of=0)).load().collect())
    holder.expire()
    reader.expire()
    client.close()


def test_a_write_to_a_new_name_at_an_upper_its_shard_has_not_creates_nothing(
        spark_session: Any, tmp_path: Path) -> None:
    """A new name's fresh shard starts at upper 0: a write expecting another upper
    (its rows inside its bounds) is refused with ``UpperMismatch`` when planned, as the
    CLI's append --create and a transaction refuse it, registering no name and creating
    no shard; it created the shard, ran its tasks and registered the name for good,
    then was refused at the commit."""
    register(spark_session)
    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    df = spark_session.createDataFrame([(b"a", b"1", 5, 1)], "k binary, v binary, t long, "
                                                             "d long")
    opts = {"consensus": consensus, "blob": blob, "shard": "fresh/late"}
    with pytest.raises(Exception, match=r"UpperMismatch.*expected 3, shard upper is 0"):
        df.write.format("persist").options(**opts, expected_upper="3", new_upper="9"
                                           ).mode("append").save()
    client = PersistClient.open(consensus, blob)
    assert client.shard_names() == {} and client.list_shards() == []
    df.write.format("persist").options(**opts, expected_upper="0", new_upper="9"
                                       ).mode("append").save()
    assert client.inspect(client.resolve("fresh/late"))["upper"] == 9
    client.close()


def test_a_read_refused_for_its_declared_columns_leaves_no_reader_behind(
        tmp_path: Path) -> None:
    """A read whose DataFrame was loaded before the shard was typed is refused with
    SchemaMismatch when it plans, and changes nothing: the planner's reader, which would
    hold since at the read's time and the plan's files against GC for a whole lease
    (15 minutes by default), is expired (no Spark needed)."""
    from persist_pipeline import ShardSchema
    from persist_pipeline.exceptions import SchemaMismatch
    from persist_pipeline.spark_datasource import PersistReader
    from persist_pipeline.spark_source import _untyped_struct

    location = _spark_location("embedded", None, tmp_path)  # type: ignore[arg-type]
    client = location.client(INLINE_ON)
    shard = ShardId.new()
    v1 = ShardSchema([("id", pa.int64())], [("name", pa.string())])
    client.open_writer(shard, schema=v1).compare_and_append(
        [{"id": 1, "name": "one", "t": 0}], 0, 1)
    with pytest.raises(SchemaMismatch, match="load the DataFrame again"):
        PersistReader(_options(location, str(shard)), _untyped_struct())
    assert client.inspect(shard)["readers"] == []
    client.close()
