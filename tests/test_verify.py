"""``PersistClient.verify`` and ``persist-pipeline verify``: a check that everything a
shard's state references is stored intact, which reads only and never reports a blob
that compaction and GC replaced meanwhile."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from persist_pipeline import (
    InlinePolicy,
    InvalidConfig,
    InvalidInput,
    PersistClient,
    ShardId,
    ShardNotFound,
)
from persist_pipeline.internal.state import HollowPart
from persist_pipeline.verify import _contents_problem, _verify_state
from tests.fixtures.location import Location, location_kinds, make_location
from tests.helpers import run_cli

#: Rows of a write big enough to go to blob storage (a Parquet part) under any policy.
BIG = 5000


def _rows(n: int, t: int, tag: bytes = b"") -> pa.Table:
    return pa.table({"k": [b"k%06d" % i + tag for i in range(n)], "v": [b"v"] * n,
                     "t": [t] * n, "d": [1] * n})


def _shard_with_everything(client: PersistClient) -> ShardId:
    """A shard holding inline parts, Parquet parts (in the WAL store where the location
    has one) and, after GC, a state rollup."""
    shard = ShardId.new()
    with client.open_writer(shard) as w:
        w.compare_and_append([(b"a", b"1", 0, 1), (b"b", b"2", 0, 1)], 0, 1)
        w.compare_and_append(_rows(BIG, 1), 1, 2)
        w.compare_and_append([(b"c", b"3", 2, 1)], 2, 3)
    client.gc(shard)
    return shard


def _hollow_parts(client: PersistClient, shard: ShardId) -> list[HollowPart]:
    state = client._machine(str(shard)).fetch_latest()
    return [p for b in state.batches.values() for p in b.hollow_parts()]


@pytest.fixture(params=location_kinds("embedded", "embedded-wal", "pg-s3", "pg-s3-wal"))
def loc(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    return make_location(request.param, request, tmp_path)


@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
def test_a_healthy_shard_verifies_clean(loc: Location, deep: bool) -> None:
    client = loc.client()
    shard = _shard_with_everything(client)
    before = client.inspect(shard)
    report = client.verify(shard, deep=deep)
    assert report.ok and report.problems == ()
    parts = before["parts"]
    assert report.parts == parts["hollow_main"] + parts["hollow_wal"] >= 1
    assert report.inline_parts == parts["inline"] == 2
    assert report.rollups == len(before["rollups"]) >= 1
    assert report.seqno == before["seqno"] and report.deep is deep
    assert report.bytes_checked >= before["hollow_bytes"] > 0
    if loc.wal_blob_uri is not None:
        assert parts["hollow_wal"] >= 1  # the WAL store's parts were checked too
    # It reads only: the shard's state did not move.
    assert client.inspect(shard)["seqno"] == before["seqno"]
    client.close()


@pytest.mark.parametrize("kind", ["missing", "size"])
def test_a_lost_or_truncated_part_is_reported(loc: Location, kind: str) -> None:
    client = loc.client()
    shard = _shard_with_everything(client)
    [part] = _hollow_parts(client, shard)
    store = client.blobs.store(part.store)
    if kind == "missing":
        store.delete(part.key)
    else:
        data = store.get(part.key)
        assert data is not None
        store.set(part.key, data[: len(data) // 2])
    seqno = client.inspect(shard)["seqno"]
    report = client.verify(shard)
    assert not report.ok
    [problem] = report.problems
    assert (problem.kind, problem.store, problem.key) == (kind, part.store, part.key)
    assert problem.batch and problem.batch in {
        b.id for b in client._machine(str(shard)).fetch_latest().batches.values()}
    assert client.inspect(shard)["seqno"] == seqno  # reported, nothing changed
    client.close()


def test_deep_finds_bytes_that_rotted_in_place(tmp_path: Path) -> None:
    """Garbage of the recorded size passes the listing; only its CRC-32 tells, or, for
    a part recorded before CRC-32s were (none to check), decoding it."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
    shard = _shard_with_everything(client)
    [part] = _hollow_parts(client, shard)
    client.blobs.main.set(part.key, b"\x00" * part.encoded_size)
    assert client.verify(shard).ok
    [problem] = client.verify(shard, deep=True).problems
    assert (problem.kind, problem.key) == ("checksum", part.key)
    assert "CRC-32" in problem.detail
    machine = client._machine(str(shard))
    state = machine.fetch_latest()
    unrecorded = {b.id: replace(b, parts=tuple(replace(p, crc32=None) if p == part else p
                                                for p in b.parts))
                  for b in state.batches.values()}
    [problem] = _verify_state(machine, state.evolve(batches=unrecorded), deep=True).problems
    assert (problem.kind, problem.key) == ("unreadable", part.key)
    assert "corrupt Parquet part" in problem.detail
    client.close()


def test_a_lost_rollup_is_reported_and_a_state_that_cannot_be_rebuilt_too(
        tmp_path: Path) -> None:
    location = (f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
    client = PersistClient.open(*location)
    shard = _shard_with_everything(client)
    state = client._machine(str(shard)).fetch_latest()
    latest = state.latest_rollup()
    assert latest is not None
    client.blobs.main.delete(latest.key)
    # This client's state is current: the rollup is reported missing.
    problems = client.verify(shard).problems
    assert ("missing", "main", latest.key, "") in [
        (p.kind, p.store, p.key, p.batch) for p in problems]
    # A new process must rebuild the state from that rollup (GC truncated the records
    # before it): that it cannot is the report, not an exception, so that a check of
    # every shard goes on to the next.
    fresh = PersistClient.open(*location)
    [problem] = fresh.verify(shard).problems
    assert (problem.kind, problem.key) == ("state", str(shard))
    assert "CorruptState" in problem.detail and latest.key in problem.detail
    client.close()
    fresh.close()


def test_blobs_replaced_and_collected_meanwhile_are_not_problems(tmp_path: Path) -> None:
    """The state read at the start references parts that compaction then replaced and
    GC deleted, before the check listed the store: they are ``replaced``, not lost."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0))
    shard = ShardId.new()
    with client.open_writer(shard) as w:
        for t in range(4):
            w.compare_and_append(_rows(50, t, tag=b"-%d" % t), t, t + 1)
    machine = client._machine(str(shard))
    stale = machine.fetch_latest()
    stale_parts = [p for b in stale.batches.values() for p in b.hollow_parts()]
    client.compact(shard)
    client.gc(shard)
    gone = [p for p in stale_parts if client.blobs.main.get(p.key) is None]
    assert gone  # else this test would not test the recheck
    for deep in (False, True):
        report = _verify_state(machine, stale, deep=deep)
        assert report.ok, report.problems
        assert report.replaced >= len(gone)
    client.close()


def test_verify_beside_writers_compaction_and_gc_finds_nothing(tmp_path: Path) -> None:
    """Checks run over and over while another thread writes, compacts and collects:
    every blob a check finds gone was replaced, never reported."""
    location = (f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
    writer_client = PersistClient.open(*location, inline_policy=InlinePolicy(0, 0))
    checker = PersistClient.open(*location)
    shard = ShardId.new()
    writer = writer_client.open_writer(shard)
    writer.compare_and_append(_rows(20, 0), 0, 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def maintain() -> None:
        try:
            t = 1
            while not stop.is_set() and t < 60:
                writer.compare_and_append(_rows(20, t, tag=b"-%d" % t), t, t + 1)
                if t % 3 == 0:
                    writer_client.compact(shard)
                    writer_client.gc(shard)
                t += 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=maintain)
    thread.start()
    reports = []
    try:
        while thread.is_alive():
            reports.append(checker.verify(shard, deep=len(reports) % 2 == 1))
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert len(reports) >= 2
    assert all(r.ok for r in reports), [r.problems for r in reports if not r.ok]
    writer.expire()
    writer_client.close()
    checker.close()


def test_a_merged_count_beyond_64_bits_verifies_clean(tmp_path: Path) -> None:
    """Two valid writes whose diffs for one row add up beyond 64 bits: the merge keeps
    the exact count as two rows on one (k, v, t), which deep verification accepts."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0))
    shard = ShardId.new()
    with client.open_writer(shard) as w:
        w.compare_and_append([(b"a", b"1", 0, 2**63 - 1)], 0, 1)
        w.compare_and_append([(b"a", b"1", 1, 1), (b"b", b"1", 1, 1)], 1, 2)
        w.compare_and_append([(b"c", b"1", 2, 1)], 2, 3)
    with client.open_reader(shard) as r:
        r.downgrade_since(2)  # the merge advances both rows of a to time 2
    client.compact(shard)
    keys = [client.blobs.fetch_part(p, "test", cached=False).column("k").to_pylist()
            for p in _hollow_parts(client, shard)]
    assert [b"a", b"a", b"b"] in keys  # the merge kept a's count exact, in two rows
    report = client.verify(shard, deep=True)
    assert report.ok, report.problems
    client.close()


def test_wal_parts_need_the_wal_store(tmp_path: Path) -> None:
    with_wal = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                  f"file://{tmp_path / 'wal'}", inline_policy=InlinePolicy(0, 0))
    shard = ShardId.new()
    with with_wal.open_writer(shard) as w:
        w.compare_and_append(_rows(10, 0), 0, 1)
    assert with_wal.inspect(shard)["parts"]["hollow_wal"] == 1
    without = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
    with pytest.raises(InvalidConfig, match="WAL blob store"):
        without.verify(shard)
    with_wal.close()
    without.close()


def test_bad_input_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
    shard = ShardId.new()
    with pytest.raises(ShardNotFound):
        client.verify(shard)
    assert client.list_shards() == []
    client.open_writer(shard).expire()
    with pytest.raises(InvalidInput, match="deep"):
        client.verify(shard, deep="yes")  # type: ignore[arg-type]
    client.close()


def _table(k: list[bytes], v: list[bytes], t: list[int], d: list[int]) -> pa.Table:
    return pa.table({"k": pa.array(k, pa.binary()), "v": pa.array(v, pa.binary()),
                     "t": pa.array(t, pa.int64()), "d": pa.array(d, pa.int64())})


def _part(n: int, min_time: int = 0, max_time: int = 9, min_key: bytes | None = b"a",
          max_key: bytes | None = b"z") -> HollowPart:
    return HollowPart("key", "main", 100, n, min_time, max_time, min_key, max_key)


@pytest.mark.parametrize(("table", "part", "found"), [
    (_table([b"a", b"b"], [b"1", b"1"], [0, 0], [1, 1]), _part(2), None),
    (_table([b"a", b"b"], [b"1", b"1"], [0, 0], [1, 1]), _part(3), "2 updates stored, 3"),
    (_table([b"b", b"a"], [b"1", b"1"], [0, 0], [1, 1]), _part(2), "out of (k, v, t) order"),
    (_table([b"a", b"a"], [b"2", b"1"], [0, 0], [1, 1]), _part(2), "out of (k, v, t) order"),
    (_table([b"a", b"a"], [b"1", b"1"], [0, 0], [1, 1]), _part(2), "two rows on one"),
    (_table([b"a", b"a", b"b"], [b"1", b"1", b"1"], [0, 0, 0], [-1, -2, 1]), _part(3),
     "two rows on one"),
    # A merge writes a count beyond 64 bits as rows that add up to it: not a problem.
    (_table([b"a", b"a", b"b"], [b"1", b"1", b"1"], [0, 0, 0], [2**63 - 1, 1, 1]),
     _part(3), None),
    (_table([b"a", b"a", b"b", b"b"], [b"1"] * 4, [0] * 4, [2**63 - 1, 1, 2, 3]),
     _part(4), "two rows on one"),
    (_table([b"a", b"b"], [b"1", b"1"], [0, 0], [1, 0]), _part(2), "diff 0"),
    (_table([b"a", b"b"], [b"1", b"1"], [0, 12], [1, 1]), _part(2), "times 0..12 stored"),
    (_table([b"a", b"b"], [b"1", b"1"], [0, 0], [1, 1]), _part(2, min_key=b"b"),
     "below the part's recorded key bounds"),
    (_table([b"a", b"b"], [b"1", b"1"], [0, 0], [1, 1]), _part(2, max_key=b"az"),
     "above the part's recorded key bounds"),
    (_table([b"a", b"b"], [b"1", b"1"], [0, 0], [1, 1]), _part(2, min_key=None, max_key=None),
     None),
])
def test_deep_contents_checks(table: pa.Table, part: HollowPart, found: str | None) -> None:
    """What a deep check finds wrong in a part that decodes: each against what the
    state records of it, or the order every part is written in."""
    problem = _contents_problem(table, part.num_updates, part)
    if found is None:
        assert problem is None
    else:
        assert problem is not None and found in problem


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PERSIST_CONSENSUS_URI": f"sqlite:///{tmp_path / 'c.db'}",
            "PERSIST_BLOB_URI": f"file://{tmp_path / 'b'}"}


def test_cli_verify_reports_and_exits_by_what_it_found(env: dict[str, str],
                                                       tmp_path: Path) -> None:
    client = PersistClient.open(env["PERSIST_CONSENSUS_URI"], env["PERSIST_BLOB_URI"])
    shard = _shard_with_everything(client)
    other = ShardId.new()
    client.register_name("sales/orders", other)
    with client.open_writer(other) as w:
        w.compare_and_append([(b"x", b"y", 0, 1)], 0, 1)
    out = run_cli(env, "verify", "--all")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True and set(report["shards"]) == {str(shard), str(other)}
    assert f"verifying {other} (sales/orders)" in out.stderr  # progress, with names
    out = run_cli(env, "verify", "sales/orders", "--deep")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["shards"][str(other)]["inline_parts"] == 1

    [part] = _hollow_parts(client, shard)
    client.blobs.main.delete(part.key)
    out = run_cli(env, "verify", str(shard), "sales/orders")
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert report["ok"] is False and report["shards"][str(other)]["ok"] is True
    [problem] = report["shards"][str(shard)]["problems"]
    assert (problem["kind"], problem["key"]) == ("missing", part.key)
    assert f"1 problem(s) in 1 shard(s): {shard}" in out.stderr
    client.close()


@pytest.mark.parametrize(("args", "code", "says"), [
    ((), 2, "shards (ids or names) or --all"),
    (("sales/orders", "--all"), 2, "not both"),
    (("no/such/name",), 1, "neither a shard id"),
    ((str(ShardId.new()),), 1, "does not exist"),
])
def test_cli_verify_bad_input(env: dict[str, str], args: tuple[str, ...], code: int,
                              says: str) -> None:
    PersistClient.open(env["PERSIST_CONSENSUS_URI"], env["PERSIST_BLOB_URI"]).close()
    out = run_cli(env, "verify", *args)
    assert out.returncode == code, out.stderr
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert out.stdout == ""
