"""Diffs never wrap: a write whose own sums leave 64 bits is refused on every path with
InvalidUpdates (nothing changes); reads, listens and merges that meet such a sum from
individually valid writes raise DiffOverflow naming the shard and the key, and a
compensating write makes later times exact again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from persist_pipeline import InlinePolicy, PersistClient, ShardId, ShardSchema, tables
from persist_pipeline.exceptions import DiffOverflow, InvalidUpdates
from persist_pipeline.updates import consolidate_sorted, exact_segment_sums
from tests.fixtures.location import Location

MAX = (1 << 63) - 1
MIN = -(1 << 63)
INLINE = InlinePolicy(4096, 1 << 20)
BLOB = InlinePolicy(0, 0)


def _table(rows: list[tuple[bytes, bytes, int, int]]) -> pa.Table:
    k, v, t, d = zip(*rows, strict=True)
    return pa.table({"k": pa.array(k, pa.binary()), "v": pa.array(v, pa.binary()),
                     "t": pa.array(t, pa.int64()), "d": pa.array(d, pa.int64())})


def _overflowing_write(n_filler: int) -> list[tuple[bytes, bytes, int, int]]:
    """Four rows of d = 2**62 on one (k, v, t) (their sum wraps to 0 in int64) among
    ``n_filler`` ordinary rows."""
    return [(b"hot", b"v", 0, 1 << 62)] * 4 + [(b"f%04d" % i, b"v", 0, 1)
                                               for i in range(n_filler)]


@pytest.fixture(params=["tuples", "small-table", "large-table"])
def shape(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _as_input(rows: list[tuple[bytes, bytes, int, int]], shape: str) -> object:
    return rows if shape == "tuples" else _table(rows)


@pytest.mark.parametrize("policy", [INLINE, BLOB], ids=["inline", "blob"])
def test_write_whose_sum_leaves_64_bits_is_refused_and_changes_nothing(
        durable_location: Location, shape: str, policy: InlinePolicy):
    filler = 10 if shape == "small-table" else 300  # > 256 rows: the vectorized path
    with durable_location.client(policy) as client:
        shard = ShardId.new()
        writer = client.open_writer(shard)
        with pytest.raises(InvalidUpdates, match="sum to 18446744073709551616"):
            writer.compare_and_append(_as_input(_overflowing_write(filler), shape), 0, 1)
        assert writer.fetch_recent_upper() == 0
        assert client.inspect(shard)["batches"] == 0


def test_typed_write_whose_sum_leaves_64_bits_is_refused(tmp_path: Path):
    schema = ShardSchema({"id": pa.int64()}, {"x": pa.string()})
    n = 300
    table = pa.table({"id": [7] * 4 + list(range(100, 100 + n)),
                      "x": ["a"] * (n + 4), "t": [0] * (n + 4),
                      "d": [1 << 62] * 4 + [1] * n})
    with _embedded(tmp_path) as client:
        writer = client.open_writer(ShardId.new(), schema=schema)
        with pytest.raises(InvalidUpdates, match="beyond 64 bits"):
            writer.compare_and_append(table, 0, 1)
        assert writer.fetch_recent_upper() == 0


def _embedded(tmp_path: Path, policy: InlinePolicy = INLINE) -> PersistClient:
    return PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                              inline_policy=policy)


@pytest.fixture
def overflowing_shard(durable_location: Location,
                      request: pytest.FixtureRequest) -> Iterator[tuple[PersistClient, str]]:
    """Two individually valid writes whose counts sum to 2**63 at time 1."""
    policy = getattr(request, "param", INLINE)
    with durable_location.client(policy) as client:
        shard = str(ShardId.new())
        writer = client.open_writer(shard)
        # One update each: the Spine fuses the two batches into one merge request.
        writer.compare_and_append([(b"k", b"v", 0, MAX)], 0, 1)
        writer.compare_and_append([(b"k", b"v", 1, 1)], 1, 2)
        yield client, shard


def test_reads_that_would_wrap_raise_diff_overflow_naming_shard_and_key(
        overflowing_shard: tuple[PersistClient, str]):
    client, shard = overflowing_shard
    reader = client.open_reader(shard)
    assert reader.snapshot(0).to_pylist() == [{"k": b"k", "v": b"v", "t": 0, "d": MAX}]
    with pytest.raises(DiffOverflow) as info:
        reader.snapshot(1)
    error = info.value
    assert (error.shard, error.key, error.val, error.time, error.total) == (
        shard, b"k", b"v", 1, 1 << 63)
    assert shard in str(error) and "b'k'" in str(error)
    with pytest.raises(DiffOverflow):
        list(reader.snapshot_batches(1))
    with pytest.raises(DiffOverflow), reader.snapshot_plan(1) as plan:
        plan.to_table()
    # A listen emits each time apart, so it never needs the sum: exact rows.
    events = reader.listen(0).poll()
    assert [r for e in events if e.updates is not None for r in e.updates.to_pylist()] == [
        {"k": b"k", "v": b"v", "t": 1, "d": 1}]


def test_compaction_keeps_a_sum_beyond_64_bits_exact_as_several_rows(
        overflowing_shard: tuple[PersistClient, str]):
    """A merge that must sum beyond 64 bits keeps the exact total as two rows; reads of
    that time still raise (the count cannot be returned), and nothing is lost."""
    client, shard = overflowing_shard
    reader = client.open_reader(shard)
    reader.downgrade_since(1)  # the merge advances both times to 1 and must sum them
    before = client.inspect(shard)
    assert before["pending_merge_requests"] == 1 and before["batches"] == 2
    metrics = client.compact(shard)
    assert metrics["applied"] == 1
    after = client.inspect(shard)
    assert after["batches"] == 1 and after["pending_merge_requests"] == 0
    with reader.snapshot_plan(1) as plan:
        stored = plan.to_dataset().to_table(columns=["k", "v", "t", "d"])
    assert sorted(stored.to_pylist(), key=lambda r: r["d"]) == [
        {"k": b"k", "v": b"v", "t": 1, "d": 1}, {"k": b"k", "v": b"v", "t": 1, "d": MAX}]
    with pytest.raises(DiffOverflow, match=shard):
        reader.snapshot(1)
    client.open_writer(shard).compare_and_append([(b"k", b"v", 2, -1)], 2, 3)
    assert reader.snapshot(2).to_pylist() == [{"k": b"k", "v": b"v", "t": 2, "d": MAX}]


def test_negative_overflow_is_refused_as_well(tmp_path: Path):
    with _embedded(tmp_path, BLOB) as client:
        shard = str(ShardId.new())
        writer = client.open_writer(shard)
        with pytest.raises(InvalidUpdates, match="sum to -9223372036854775809"):
            writer.compare_and_append(
                _table([(b"k", b"v", 0, MIN), (b"k", b"v", 0, -1)]
                       + [(b"f%04d" % i, b"v", 0, 1) for i in range(300)]), 0, 1)
        writer.compare_and_append([(b"k", b"v", 0, MIN)], 0, 1)
        writer.compare_and_append([(b"k", b"v", 1, -1)], 1, 2)
        with pytest.raises(DiffOverflow, match="sum to -9223372036854775809"):
            client.open_reader(shard).snapshot(1)


def test_spark_write_task_refuses_a_wrapping_sum(tmp_path: Path):
    """The Spark data source's executor function validates like every other write."""
    from persist_pipeline.spark_source import _Location, _write_job, _write_task

    uri = f"sqlite:///{tmp_path / 'c.db'}"
    blob = f"file://{tmp_path / 'b'}"
    shard = str(ShardId.new())
    options = {"consensus": uri, "blob": blob, "shard": shard,
               "expected_upper": "0", "new_upper": "1"}
    assert _Location.from_options(options, writing=True).shard_id == shard
    job = _write_job(options, overwrite=False)
    batches = _table(_overflowing_write(300)).to_batches()
    with pytest.raises(InvalidUpdates, match="beyond 64 bits"):
        _write_task(job, iter(batches))
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").rglob("*.parquet"))


def test_cli_append_refuses_a_wrapping_sum(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from persist_pipeline import cli

    data = tmp_path / "updates.parquet"
    import pyarrow.parquet as pq

    pq.write_table(_table(_overflowing_write(300)), data)
    env = ["--consensus", f"sqlite:///{tmp_path / 'c.db'}", "--blob", f"file://{tmp_path / 'b'}"]
    shard = str(ShardId.new())
    code = cli.main([*env, "append", shard, str(data), "--expected-upper", "0",
                     "--new-upper", "1", "--create"])
    assert code != 0
    assert "beyond 64 bits" in capsys.readouterr().err


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(
    [MIN, MIN + 1, -(1 << 62), -5, -1, 1, 5, 1 << 62, MAX - 1, MAX])), min_size=1,
    max_size=40))
def test_consolidation_sums_exactly_raises_or_splits(groups: list[tuple[int, int]]):
    """Reads: exact sums, or DiffOverflow naming the first (k, v, t) whose sum leaves
    int64. Merges: rows whose diffs add up to the exact sum, each within int64."""
    groups.sort(key=lambda g: g[0])
    table = _table([(bytes([k]), b"", 0, d) for k, d in groups])
    exact: dict[int, int] = {}
    for k, d in groups:
        exact[k] = exact.get(k, 0) + d
    want = {bytes([k]): total for k, total in exact.items() if total}
    beyond = [k for k in sorted(exact) if not MIN <= exact[k] <= MAX]
    if beyond:
        with pytest.raises(DiffOverflow) as info:
            consolidate_sorted(table)
        assert (info.value.key, info.value.total) == (bytes([beyond[0]]), exact[beyond[0]])
    else:
        got = consolidate_sorted(table).to_pylist()
        assert {r["k"]: r["d"] for r in got} == want and len(got) == len(want)
    split = consolidate_sorted(table, "split").to_pylist()
    assert [r["k"] for r in split] == sorted(r["k"] for r in split)
    sums: dict[bytes, int] = {}
    for r in split:
        assert r["d"] != 0 and MIN <= r["d"] <= MAX
        sums[r["k"]] = sums.get(r["k"], 0) + r["d"]
    assert sums == want


def test_exact_segment_sums_fast_path_for_unit_diffs():
    diffs = np.array([1, -1, 1, 1, 1], dtype=np.int64)
    sums, beyond = exact_segment_sums(diffs, np.array([0, 2], dtype=np.int64))
    assert sums.tolist() == [0, 3] and beyond == []


#: A typed table (key id, value a) and the counts other writers leave on its rows: three
#: rows counted 2**62 and three counted -2**62, whose sums each leave 64 bits.
_COUNTED = {"id": [1, 2, 3, 4, 5, 6], "a": ["x"] * 6,
            "d": [1 << 62] * 3 + [-(1 << 62)] * 3}


@pytest.mark.parametrize("op", ["replace_contents", "upsert", "delete", "transaction",
                                "store_table"])
def test_rows_a_replacement_adds_and_retracts_are_counted_exactly(
        durable_location: Location, op: str):
    """A replacement (``replace_contents``, ``upsert``, ``delete``, one in a
    transaction, a table store: what the IO manager reports as ``persist/rows_added``
    and ``persist/rows_retracted``) of rows that other writers counted far beyond one
    (any 64-bit count is a valid diff) reports the rows it added and retracted exactly:
    their totals leave 64 bits here, and are never wrapped into a wrong number."""
    with durable_location.client(BLOB) as client:
        schema = ShardSchema({"id": pa.int64()}, {"a": pa.string()})
        if op == "store_table":
            stored = tables.store_table(client, "counted", pa.table(
                {"id": pa.array([0], pa.int64()), "a": ["seed"]}), ["id"])
            shard = stored.shard
            writer = client.open_writer(shard)
            writer.delete(pa.table({"id": pa.array([0], pa.int64())}))
        else:
            shard = ShardId.new()
            writer = client.open_writer(shard, schema=schema)
        upper = writer.fetch_recent_upper()
        assert upper is not None
        writer.compare_and_append(pa.table(
            {**_COUNTED, "id": pa.array(_COUNTED["id"], pa.int64()),
             "t": [upper] * 6}), upper, upper + 1)
        replacement = pa.table({"id": pa.array([9], pa.int64()), "a": ["new"]})
        if op == "replace_contents":
            result = writer.replace_contents(replacement)
        elif op == "upsert":  # the keys of both counts, and one new key
            result = writer.upsert(pa.table({"id": pa.array([1, 2, 3, 4, 5, 6, 9]),
                                             "a": ["y"] * 7}))
        elif op == "delete":
            result = writer.delete(pa.table({"id": pa.array([1, 2, 3, 4, 5, 6])}))
        elif op == "transaction":
            txn = client.transaction()
            txn.replace_contents(writer, replacement)
            result = txn.commit()[str(shard)]
        else:
            result = tables.store_table(client, "counted", pa.table(
                {"id": pa.array([9], pa.int64()), "a": ["new"]}), ["id"]).result
        added = {"upsert": 7, "delete": 0}.get(op, 1) + 3 * (1 << 62)
        assert (result.rows_added, result.rows_retracted) == (added, 3 * (1 << 62))
        writer.expire()
