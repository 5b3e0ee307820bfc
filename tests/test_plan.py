"""Read plans (``ReadHandle.snapshot_plan``): other engines reproduce the snapshot from
the plan's files and inline rows, and GC never deletes a file of a plan in use.

Runs on SQLite + a local folder and on PostgreSQL + the loopback S3 server, with a
WAL store too, on shards holding compacted, blob, WAL and inline parts at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.exceptions import (
    InvalidConfig,
    LeaseExpired,
    NotYetAvailable,
    PartMissing,
    SinceViolation,
)
from persist_pipeline.plan import SnapshotPlan
from tests.fixtures.location import Location, location_kinds, make_location
from tests.helpers import HandClock, client_on_clock, expected_snapshot, rows, wait_until

INLINE_ON = InlinePolicy(4096, 1 << 20)
Update = tuple[bytes, bytes, int, int]


@pytest.fixture(params=location_kinds("embedded", "pg-s3", "pg-s3-wal"))
def plan_location(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    return make_location(request.param, request, tmp_path)


def _big(t: int, n: int, tag: bytes) -> list[Update]:
    """Enough rows to go past the inline threshold (a blob or WAL part)."""
    return [(b"key-%05d" % i, tag + b"-" + b"x" * 40, t, 1) for i in range(n)]


def build_mixed_shard(client: PersistClient) -> tuple[str, list[Update]]:
    """A shard with a compacted part, a blob (or WAL) part and inline parts, where later
    batches retract and re-insert rows of earlier ones; returns it and every update."""
    shard = str(ShardId.new())
    written: list[Update] = []
    with client.open_writer(shard) as writer:
        first, then = _big(0, 300, b"a"), _big(1, 50, b"b")
        writer.compare_and_append(first, 0, 1)
        writer.compare_and_append(then, 1, 2)
        written += first + then
        client.compact(shard)  # the first two batches become a compacted part (main)
        second = [(k, v, 2, -1) for k, v, _, _ in _big(0, 100, b"a")] + _big(2, 200, b"c")
        assert writer.compare_and_append(second, 2, 3).placement in ("blob", "wal")
        written += second
        for t in range(3, 6):
            small = [(b"key-%05d" % t, b"a-" + b"x" * 40, t, -1), (b"new-%d" % t, b"n", t, 2)]
            assert writer.compare_and_append(small, t, t + 1).placement == "inline"
            written += small
    return shard, written


def _duckdb_snapshot(plan: SnapshotPlan) -> list[tuple[bytes, bytes, int]]:
    ds = plan.to_dataset()  # noqa: F841 - DuckDB finds the dataset by its variable name
    got = duckdb.sql(f"SELECT k, v, sum(d)::BIGINT AS d FROM ds WHERE t <= {plan.as_of} "
                     "GROUP BY k, v HAVING sum(d) <> 0").fetchall()
    return sorted((bytes(k), bytes(v), int(d)) for k, v, d in got)


def _polars_snapshot(plan: SnapshotPlan) -> list[tuple[bytes, bytes, int]]:
    frame = (pl.scan_pyarrow_dataset(plan.to_dataset())
             .filter(pl.col("t") <= plan.as_of)
             .group_by("k", "v").agg(pl.col("d").sum())
             .filter(pl.col("d") != 0).collect())
    return sorted((r["k"], r["v"], r["d"]) for r in frame.to_dicts())


def test_plan_reproduces_the_snapshot_in_pyarrow_duckdb_and_polars(plan_location: Location
                                                                   ) -> None:
    client = plan_location.client(INLINE_ON)
    shard, written = build_mixed_shard(client)
    reader = client.open_reader(shard)
    stores = set()
    for as_of in (1, 2, 3, 5):
        expected = expected_snapshot(written, as_of)
        assert rows(reader.snapshot(as_of), as_of) == expected
        with reader.snapshot_plan(as_of) as plan:
            assert plan.as_of == as_of and plan.since == 0 and plan.upper == 6
            stores |= set(plan.stores())
            assert all(u.startswith("file:///" if plan_location.name == "embedded" else
                                    ("s3://", "file:///")) for u in plan.files)
            assert rows(plan.to_table(), as_of) == expected
            assert _duckdb_snapshot(plan) == expected
            assert _polars_snapshot(plan) == expected
    # The files were of every kind the location has, and inline rows were in the plan.
    assert stores == ({"main", "wal"} if plan_location.wal_blob_uri else {"main"})
    with reader.snapshot_plan(5) as plan:
        assert plan.inline.num_rows == 6
        assert plan.inline.schema.names == ["k", "v", "t", "d"]
        # The files are plain Parquet that the engine reads from the URIs themselves.
        main = [f for f in plan.file_details if f.store == "main"]
        fs = plan.filesystem("main")
        table = pads.dataset([f.path for f in main], filesystem=fs).to_table()
        assert table.num_rows == sum(f.num_updates for f in main)
    reader.expire()
    client.close()


def test_plan_defaults_to_the_latest_complete_time_and_checks_as_of(tmp_path: Path) -> None:
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=INLINE_ON)
    shard = str(ShardId.new())
    reader = client.open_reader(shard, create=True)
    with pytest.raises(NotYetAvailable):
        reader.snapshot_plan()
    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"a", b"1", 3, 1)], 0, 7)
    with reader.snapshot_plan() as plan:
        assert plan.as_of == 6 and plan.files == []
        assert rows(plan.to_table(), 6) == [(b"a", b"1", 1)]
        shown = plan.describe()
        assert shown["inline"] == [{"k": "a", "v": "1", "t": 3, "d": 1}]
        assert shown["inline_encoding"] == {"k": "utf-8", "v": "utf-8"}
    with pytest.raises(NotYetAvailable):
        reader.snapshot_plan(7)
    reader.downgrade_since(5)
    with pytest.raises(SinceViolation):
        reader.snapshot_plan(4)
    reader.expire()
    client.close()


def test_plan_of_an_in_memory_store_is_refused_clearly() -> None:
    client = PersistClient.open("mem://", "mem://", inline_policy=InlinePolicy(0, 0))
    shard = str(ShardId.new())
    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    reader = client.open_reader(shard)
    with pytest.raises(InvalidConfig, match="memory"):
        reader.snapshot_plan(0)
    # The failed plan released its hold: the reader can still read and expire.
    assert rows(reader.snapshot(0), 0) == [(b"a", b"1", 1)]
    reader.expire()
    client.close()


def _exists(plan: SnapshotPlan, store: Any = "main") -> list[bool]:
    fs = plan.filesystem(store)
    return [fs.get_file_info(f.path).type != pafs.FileType.NotFound
            for f in plan.file_details if f.store == store]


@pytest.mark.parametrize("kind", location_kinds("embedded", "pg-s3"))
def test_gc_never_deletes_a_file_of_a_plan_in_use(kind: str, request: pytest.FixtureRequest,
                                                  tmp_path: Path) -> None:
    location = make_location(kind, request, tmp_path)
    # Background heartbeats every 50 ms: they keep the lease and must not move the hold.
    cfg = PersistConfig(rollup_threshold=4, heartbeat_interval_s=0.05)
    client = location.client(InlinePolicy(0, 0), cfg)
    shard = str(ShardId.new())
    written: list[Update] = []
    with client.open_writer(shard) as writer:
        for t in range(12):
            batch = [(b"k%d" % (t % 5), b"v%d" % t, t, 1), (b"k%d" % (t % 3), b"v0", t, -1)]
            writer.compare_and_append(batch, t, t + 1)
            written += batch
    reader = client.open_reader(shard)
    plan = reader.snapshot_plan(11)
    expected = expected_snapshot(written, 11)
    assert len(plan.files) == 11  # the two updates at t=0 cancel out: no part
    # Compaction replaces the plan's files; GC then runs, again and again, while
    # heartbeats keep going.
    client.compact(shard)
    with client.open_writer(shard) as writer:
        for t in range(12, 20):
            writer.compare_and_append([], t, t + 1)

    def last_heartbeat_ms() -> int:
        return client._machine(shard).fetch_latest().leased_readers[
            reader.reader_id].last_heartbeat_ms

    for _ in range(3):
        metrics = client.gc(shard)
        assert metrics["blobs_deleted"] == 0, metrics
        beat = last_heartbeat_ms()
        wait_until(lambda beat=beat: last_heartbeat_ms() > beat,
                   "a background heartbeat of the reader before the next GC")
    assert all(_exists(plan))
    assert rows(plan.to_table(), 11) == expected
    plan.close()
    metrics = client.gc(shard)
    live = {key for _, key in client._machine(shard).fetch_latest().referenced_blobs()}
    replaced = [f.key not in live for f in plan.file_details]
    assert sum(replaced) >= 8  # compaction merged most of them
    assert metrics["blobs_deleted"] >= sum(replaced)
    assert _exists(plan) == [not r for r in replaced]
    # The reader itself reads the compacted state as before.
    assert rows(reader.snapshot(11), 11) == expected
    reader.expire()
    client.close()


@pytest.mark.parametrize("kind", ["embedded", pytest.param("pg-s3", marks=[
    pytest.mark.postgres, pytest.mark.s3])])
def test_plan_files_may_go_once_its_readers_lease_ran_out(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Documented limit: the hold lives as long as the reader's lease; reading the plan
    afterwards names the file that is gone (a typed error, on the local and S3 stores)."""
    cfg = PersistConfig(reader_lease_duration_s=0.5, heartbeat_interval_s=0)
    clock = HandClock()
    location = (Location("embedded", f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
                if kind == "embedded" else make_location(kind, request, tmp_path))
    client = client_on_clock(location, clock, InlinePolicy(0, 0), cfg)
    shard = str(ShardId.new())
    with client.open_writer(shard) as writer:
        for t in range(4):
            writer.compare_and_append([(b"k", b"v%d" % t, t, 1)], t, t + 1)
    reader = client.open_reader(shard)
    plan = reader.snapshot_plan(3)
    client.compact(shard)
    assert client.gc(shard)["blobs_deleted"] == 0
    clock.advance(0.7)  # no heartbeat: the lease runs out, GC expires the reader
    assert client.gc(shard)["blobs_deleted"] >= 4
    assert not any(_exists(plan))
    with pytest.raises(PartMissing, match="of this snapshot plan is gone: GC deletes"):
        plan.to_table()
    if kind == "embedded":
        # pyarrow looks local files up when the dataset for DuckDB and polars is made
        # (S3 ones only when it is scanned): the same typed error, not a bare path.
        with pytest.raises(PartMissing, match="of this snapshot plan is gone: GC deletes"):
            plan.to_dataset()
    plan.close()  # closing after expiry is harmless
    client.close()


@pytest.mark.parametrize("kind", location_kinds("embedded-wal", "pg-s3-wal"))
def test_a_plans_wal_files_stay_after_compaction_moved_them_until_its_lease_ran_out(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A plan of WAL parts, then compaction moves them all into the main store and GC
    truncates consensus and collects again and again: the reader's seqno hold keeps
    every WAL file of the plan, read alike by pyarrow and DuckDB. Once the reader's
    lease runs out (its holder paused), GC deletes them and reading the plan names the
    WAL file that is gone (typed), never returning fewer rows."""
    cfg = PersistConfig(reader_lease_duration_s=2.0, heartbeat_interval_s=0,
                        rollup_threshold=3)
    clock = HandClock()
    location = make_location(kind, request, tmp_path)
    client = client_on_clock(location, clock, InlinePolicy(0, 0), cfg)
    shard = str(ShardId.new())
    written: list[Update] = []
    with client.open_writer(shard) as writer:
        for t in range(8):
            batch = [(b"k%d" % (t % 3), b"v%d" % t, t, 1)]
            assert writer.compare_and_append(batch, t, t + 1).placement == "wal"
            written += batch
    reader = client.open_reader(shard)
    plan = reader.snapshot_plan(7)
    assert plan.stores() == ["wal"] and len(plan.files) == 8
    assert client.compact(shard)["applied"]
    with client.open_writer(shard) as writer:
        for t in range(8, 20):  # rollups, so that GC truncates below the plan's version
            writer.compare_and_append([], t, t + 1)
    state = client._machine(shard).fetch_latest()
    assert {p.store for b in state.batches.values() for p in b.hollow_parts()} == {"main"}
    truncated = 0
    for _ in range(3):
        metrics = client.gc(shard)
        assert metrics["blobs_deleted"] == 0, metrics
        truncated += metrics["seqnos_truncated"]
    assert truncated > 0
    expected = expected_snapshot(written, 7)
    assert all(_exists(plan, "wal"))
    assert rows(plan.to_table(), 7) == expected
    assert _duckdb_snapshot(plan) == expected
    clock.advance(2.5)  # no heartbeat for longer than the lease: GC expires the reader
    assert client.gc(shard)["blobs_deleted"] >= 8
    assert not any(_exists(plan, "wal"))
    for read in (plan.to_table, plan.to_dataset):
        with pytest.raises(PartMissing, match=r"file file://.*of this snapshot plan is gone"):
            read()
    with pytest.raises(LeaseExpired):
        reader.snapshot(7)
    plan.close()
    client.close()


def test_a_plan_shows_no_credentials(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    location = make_location("pg-s3", request, tmp_path)
    secret = "SeCrEtPlanKey/9+x"
    blob_uri = (location.blob_uri + "&access_key_id=AKIAPLANTEST&secret_access_key="
                + secret.replace("/", "%2F"))
    client = PersistClient.open(location.consensus_uri, blob_uri,
                                inline_policy=InlinePolicy(0, 0))
    shard = str(ShardId.new())
    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    with client.open_reader(shard) as reader, reader.snapshot_plan(0) as plan:
        shown = plan.to_json() + repr(plan) + " ".join(plan.files)
        assert secret not in shown and "SeCrEt" not in shown
        # The file system carries them (it reads the files) without showing them.
        assert rows(plan.to_table(), 0) == [(b"a", b"1", 1)]
        assert "SeCrEt" not in repr(plan.filesystem())
    client.close()


def test_a_closed_plan_refuses_to_read(tmp_path: Path) -> None:
    """Once closed, a plan's files are no longer held against GC: reading it is refused
    with a typed error (not left to succeed until GC happens to run), while what it
    describes stays available."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0))
    shard = str(ShardId.new())
    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
        writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2)
    reader = client.open_reader(shard)
    with reader.snapshot_plan() as plan:
        assert rows(plan.to_table(), 1) == [(b"a", b"1", 1), (b"b", b"1", 1)]
    assert plan.closed
    for read in (plan.to_table, plan.to_dataset):
        with pytest.raises(LeaseExpired, match="the plan was closed; make a new one"):
            read()
    assert len(plan.describe()["files"]) == 2 and "closed" in repr(plan)
    with reader.snapshot_plan() as again:
        assert rows(again.to_table(), 1) == [(b"a", b"1", 1), (b"b", b"1", 1)]
    reader.expire()
    client.close()


def test_a_plan_whose_reader_was_expired_refuses_to_read(tmp_path: Path) -> None:
    """Expiring a reader releases its open plans' hold, as closing them does; so does a
    heartbeat that finds the reader expired (its holder paused past the lease). Reading
    such a plan is refused with LeaseExpired, as a closed plan's is, rather than
    succeeding while GC has not yet deleted its files and failing half-way once it
    does."""
    cfg = PersistConfig(reader_lease_duration_s=1.0, heartbeat_interval_s=0)
    clock = HandClock()
    location = Location("embedded", f"sqlite:///{tmp_path / 'c.db'}",
                        f"file://{tmp_path / 'b'}")
    client = client_on_clock(location, clock, InlinePolicy(0, 0), cfg)
    shard = str(ShardId.new())
    with client.open_writer(shard) as writer:
        writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
        writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2)
    expired = client.open_reader(shard)
    plan = expired.snapshot_plan(1)
    assert rows(plan.to_table(), 1) == [(b"a", b"1", 1), (b"b", b"1", 1)]
    expired.expire()
    paused = client.open_reader(shard)
    paused_plan = paused.snapshot_plan(1)
    clock.advance(1.5)
    client.gc(shard)  # expires the paused reader (nothing to delete yet)
    with pytest.raises(LeaseExpired):
        paused.heartbeat()
    for read in (plan.to_table, plan.to_dataset, paused_plan.to_table,
                 paused_plan.to_dataset):
        with pytest.raises(LeaseExpired, match="was expired; make a new plan"):
            read()
    plan.close()
    paused_plan.close()
    client.close()


def test_a_plan_made_before_an_evolution_compaction_and_gc_reads_its_own_version(
        tmp_path: Path) -> None:
    """A typed shard's plan is of one state version: a nullable column appended after it
    was made, a compaction merging parts of both schemas and a GC change nothing it
    reads (its files are held while it is open), and a new plan reads the new version
    with the new column, alike through pyarrow and DuckDB."""
    import pyarrow as pa

    from persist_pipeline import ShardSchema

    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=INLINE_ON)
    shard = ShardId.new()
    v1 = ShardSchema([("id", pa.int64())], [("name", pa.string())])
    v2 = ShardSchema([("id", pa.int64())], [("name", pa.string()), ("n", pa.int64())])
    client.open_writer(shard, schema=v1).compare_and_append(
        [{"id": i, "name": f"a{i}", "t": 0} for i in range(300)], 0, 1)  # a blob part
    reader = client.open_reader(shard)
    old = reader.snapshot_plan(0)
    before = old.to_table()
    assert before.column_names == ["id", "name", "t", "d"] and before.num_rows == 300
    writer = client.open_writer(shard, schema=v2)
    writer.compare_and_append([{"id": i, "name": "b", "n": i, "t": 1} for i in range(300)],
                              1, 2)
    writer.compare_and_append([{"id": 0, "name": "a0", "t": 2, "d": -1}], 2, 3)  # inline
    client.compact(shard)
    client.gc(shard)
    assert old.to_table().equals(before)
    ds = old.to_dataset()
    assert duckdb.sql("SELECT count(*) FROM ds WHERE t <= 0").fetchone() == (300,)
    old.close()
    with reader.snapshot_plan(2) as new:
        after = new.to_table()
        assert after.column_names == ["id", "name", "n", "t", "d"]
        assert after.equals(reader.snapshot(2))
        ds = new.to_dataset()  # noqa: F841
        got = duckdb.sql("SELECT id, name, n, sum(d)::BIGINT FROM ds WHERE t <= 2 "
                         "GROUP BY ALL HAVING sum(d) <> 0").fetchall()
        assert sorted(got) == sorted((r["id"], r["name"], r["n"], r["d"])
                                     for r in after.to_pylist())
    reader.expire()
    client.close()


def test_a_typed_plans_json_tells_binary_values_apart_and_is_strict_json(
        tmp_path: Path) -> None:
    """The plan's description (the CLI's ``plan``) shows a typed shard's binary values
    as text only when every one of the column is UTF-8, else all as hex (said in
    ``inline_encoding``), as for untyped keys: two different values never print alike.
    Floats JSON cannot hold (NaN, infinities) are named as text, so strict parsers
    read it."""
    import json

    import pyarrow as pa

    from persist_pipeline import ShardSchema

    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=INLINE_ON)
    shard = ShardId.new()
    schema = ShardSchema([("id", pa.int64())], [
        ("b", pa.binary()), ("l", pa.list_(pa.binary())), ("s", pa.binary()),
        ("f", pa.float64())])
    client.open_writer(shard, schema=schema).compare_and_append(pa.table({
        "id": [1, 2, 3], "b": [b"abcd", b"\xab\xcd", None], "l": [[b"abcd"], [b"\xab\xcd"], []],
        "s": [b"ok", b"fine", None], "f": [float("nan"), float("-inf"), 1.5],
        "t": [0, 0, 0]}), 0, 1)
    with client.open_reader(shard) as reader, reader.snapshot_plan() as plan:
        shown = json.loads(plan.to_json(), parse_constant=lambda c: pytest.fail(c))
    by_id = {r["id"]: r for r in shown["inline"]}
    assert (by_id[1]["b"], by_id[2]["b"], by_id[3]["b"]) == ("61626364", "abcd", None)
    assert (by_id[1]["l"], by_id[2]["l"]) == (["61626364"], ["abcd"])
    assert (by_id[1]["s"], by_id[2]["s"]) == ("ok", "fine")
    assert shown["inline_encoding"] == {"b": "hex", "l": "hex", "s": "utf-8"}
    assert [by_id[i]["f"] for i in (1, 2, 3)] == ["NaN", "-Infinity", 1.5]
    client.close()
