"""Typed shards end to end on every backend and inline setting: round trips of every
supported type (nulls included) through inline parts, blob parts, compaction, streaming
snapshots, listens and read plans; schema mismatch and evolution; upsert and delete
against a model, under concurrency and lost replies; DuckDB reading the typed columns.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_pipeline import (
    InlinePolicy,
    PersistClient,
    PersistConfig,
    SchemaMismatch,
    ShardId,
    ShardSchema,
    UpperMismatch,
    WriteHandle,
)
from persist_pipeline.blob.memory import MemoryBlob
from persist_pipeline.exceptions import InvalidFrontier, InvalidInput, InvalidUpdates
from persist_pipeline.internal.blobs import ShardBlobs
from persist_pipeline.internal.lookup import current_rows
from persist_pipeline.internal.state import HollowPart
from tests.fixtures.location import Location
from tests.helpers import process_context
from tests.test_regressions_lost_replies import Clients

UTC = datetime.UTC

ALL_TYPES = ShardSchema(
    [pa.field("id", pa.int64(), nullable=False), ("region", pa.string())],
    [("qty", pa.int32()), ("price", pa.float64()), ("amount", pa.decimal128(12, 2)),
     ("note", pa.string()), ("blob", pa.binary()), ("at", pa.timestamp("us", tz="UTC")),
     ("day", pa.date32()), ("ok", pa.bool_()), ("tags", pa.list_(pa.string())),
     ("addr", pa.struct([("city", pa.string()), ("zip", pa.int32()),
                         ("lines", pa.list_(pa.string()))]))])


def _row(i: int, *, nulls: bool = False) -> dict[str, Any]:
    if nulls:
        return {"id": i, "region": None, "qty": None, "price": None, "amount": None,
                "note": None, "blob": None, "at": None, "day": None, "ok": None,
                "tags": None, "addr": None}
    return {"id": i, "region": ["eu", "us", "ä"][i % 3], "qty": i - 50,
            "price": [1.5, -0.25, float("inf")][i % 3],
            "amount": decimal.Decimal(f"{i}.{i % 100:02d}"), "note": f"note {i}" * (i % 4),
            "blob": bytes([i % 256, 0, 255]), "at": datetime.datetime(2026, 1, 1, i % 24,
                                                                     tzinfo=UTC),
            "day": datetime.date(1999, 12, 31) + datetime.timedelta(days=i),
            "ok": i % 2 == 0, "tags": [f"t{j}" for j in range(i % 3)] + [None] * (i % 2),
            "addr": {"city": f"c{i}", "zip": None if i % 5 == 0 else i,
                     "lines": ["a", "b"][: i % 3]}}


def _table(rows: list[dict[str, Any]], t: int, d: int = 1) -> pa.Table:
    table = pa.Table.from_pylist(rows, schema=pa.schema([*ALL_TYPES.key, *ALL_TYPES.value]))
    n = table.num_rows
    return table.append_column("t", pa.array([t] * n, pa.int64())).append_column(
        "d", pa.array([d] * n, pa.int64()))


def _collection(table: pa.Table) -> list[tuple[Any, ...]]:
    """A snapshot as a sorted list of (row without t, d) for order-free comparison."""
    out = []
    for row in table.to_pylist():
        d = row.pop("d")
        row.pop("t")
        out.append((repr(sorted(row.items())), d))
    return sorted(out)


def _expected(*tables: pa.Table) -> list[tuple[Any, ...]]:
    sums: dict[str, int] = {}
    for table in tables:
        for row in table.to_pylist():
            d = row.pop("d")
            row.pop("t")
            key = repr(sorted(row.items()))
            sums[key] = sums.get(key, 0) + d
    return sorted((k, d) for k, d in sums.items() if d)


def test_typed_round_trip_through_every_path(open_client: Callable[..., PersistClient]) -> None:
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard, schema=ALL_TYPES)
    small = _table([_row(1), _row(2, nulls=True)], t=0)
    large = _table([_row(i) for i in range(3, 400)] + [_row(2, nulls=True)], t=1)
    retract = _table([_row(5), _row(7)], t=2, d=-1)
    writer.compare_and_append(small, 0, 1)
    writer.compare_and_append(large, 1, 2)
    writer.compare_and_append(retract, 2, 3)
    expected = _expected(small, large, retract)
    reader = client.open_reader(shard)
    snapshot = reader.snapshot(2)
    assert snapshot.schema.names == [*ALL_TYPES.columns, "t", "d"]
    assert snapshot.schema.field("addr").type == ALL_TYPES.value.field("addr").type
    assert _collection(snapshot) == expected
    streamed = pa.Table.from_batches(list(reader.snapshot_batches(2, max_rows=37)))
    assert _collection(streamed) == expected
    if not client.blobs.main.describe().startswith("mem://"):  # plans need shared files
        with reader.snapshot_plan(2) as plan:
            assert _collection(plan.to_table()) == expected
    listened = []
    listen = reader.listen(0)
    for event in listen.poll():
        if event.kind == "updates":
            assert event.updates is not None
            assert "k" not in event.updates.column_names
            listened.append(event.updates)
    listen.close()
    assert _expected(pa.concat_tables(listened)) == _expected(large, retract)
    client.compact(shard)
    assert _collection(reader.snapshot(2)) == expected
    assert client.schema(shard) == ALL_TYPES


def test_typed_parts_store_real_columns_for_other_engines(tmp_path: Any) -> None:
    client = PersistClient.open(f"sqlite:///{tmp_path}/c.db", f"file://{tmp_path}/b",
                                inline_policy=InlinePolicy(0, 0))
    shard = ShardId.new()
    writer = client.open_writer(shard, schema=ALL_TYPES)
    rows = _table([_row(i) for i in range(20)], t=0)
    writer.compare_and_append(rows, 0, 1)
    reader = client.open_reader(shard)
    with reader.snapshot_plan(0) as plan:
        [path] = [f.path for f in plan.file_details]
        file = pq.read_table(path)
    for field in [*ALL_TYPES.key, *ALL_TYPES.value]:
        assert file.schema.field(field.name).type == field.type
    assert file.select(ALL_TYPES.columns).to_pylist() == \
        rows.select(ALL_TYPES.columns).sort_by("id").to_pylist()
    client.close()


def test_duckdb_reads_typed_columns_from_the_read_plan(durable_location: Location) -> None:
    duckdb = pytest.importorskip("duckdb")
    client = durable_location.client(InlinePolicy(4096, 1 << 20))
    shard = ShardId.new()
    schema = ShardSchema([("id", pa.int64())], [("name", pa.string()),
                                                ("amount", pa.decimal128(10, 2))])
    writer = client.open_writer(shard, schema=schema)
    writer.compare_and_append(pa.table({"id": range(500), "name": [f"n{i}" for i in
                                                                   range(500)],
                                        "amount": [decimal.Decimal(i) for i in range(500)],
                                        "t": [0] * 500}), 0, 1)
    writer.upsert(pa.table({"id": [1, 2], "name": ["one", None],
                            "amount": [decimal.Decimal("1.50"), None]}))  # inline
    reader = client.open_reader(shard)
    expected = reader.snapshot(reader_upper(writer) - 1).drop_columns(["t", "d"]).to_pylist()
    with reader.snapshot_plan() as plan:
        dataset = plan.to_dataset()  # noqa: F841 - read by DuckDB below
        con = duckdb.connect()
        types = dict(con.sql("DESCRIBE SELECT id, name, amount FROM dataset").fetchall()
                     and [(r[0], r[1]) for r in con.sql(
                         "DESCRIBE SELECT id, name, amount FROM dataset").fetchall()])
        assert types == {"id": "BIGINT", "name": "VARCHAR", "amount": "DECIMAL(10,2)"}
        got = con.sql("SELECT id, name, amount FROM dataset GROUP BY ALL "
                      "HAVING sum(d) <> 0 ORDER BY id").fetchall()
    assert [dict(zip(["id", "name", "amount"], r, strict=True)) for r in got] == \
        sorted(expected, key=lambda r: r["id"])
    client.close()


def reader_upper(writer: Any) -> int:
    upper: int = writer.fetch_recent_upper()
    return upper


def test_schema_mismatch_and_evolution(location: Location) -> None:
    client = location.client(InlinePolicy(4096, 1 << 20))
    shard = ShardId.new()
    v1 = ShardSchema([("id", pa.int64())], [("a", pa.string())])
    writer = client.open_writer(shard, schema=v1)
    writer.compare_and_append(pa.table({"id": [1, 2], "a": ["x", None], "t": [0, 0]}), 0, 1)
    seqno = client.inspect(shard)["seqno"]
    for bad in (ShardSchema([("id", pa.int32())], [("a", pa.string())]),
                ShardSchema([("id", pa.int64())], [("a", pa.binary())]),
                ShardSchema([("id", pa.int64())], [("a", pa.string()),
                                                   pa.field("b", pa.int8(), False)]),
                ShardSchema([("id", pa.int64()), ("id2", pa.int8())], [("a", pa.string())])):
        with pytest.raises(SchemaMismatch):
            client.open_writer(shard, schema=bad)
    assert client.inspect(shard)["seqno"] == seqno  # nothing changed
    assert client.schema(shard) == v1
    v2 = ShardSchema([("id", pa.int64())], [("a", pa.string()), ("b", pa.list_(pa.int8()))])
    newer = client.open_writer(shard, schema=v2)
    assert client.schema(shard) == v2
    newer.compare_and_append(pa.table({"id": [3], "a": ["z"], "b": [[1, 2]], "t": [1]}), 1, 2)
    # The old writer still writes (its rows lack b: null) and reads see every column.
    writer.compare_and_append(pa.table({"id": [4], "a": ["w"], "t": [2]}), 2, 3)
    # A row retracted in the new shape cancels the one written in the old shape.
    newer.compare_and_append(pa.table({"id": [1], "a": ["x"], "b": pa.array([None],
                                       pa.list_(pa.int8())), "t": [3], "d": [-1]}), 3, 4)
    snapshot = client.open_reader(shard).snapshot(3)
    assert sorted(snapshot.select(["id", "a", "b"]).to_pylist(), key=lambda r: r["id"]) == [
        {"id": 2, "a": None, "b": None}, {"id": 3, "a": "z", "b": [1, 2]},
        {"id": 4, "a": "w", "b": None}]
    # Reopening with no schema takes the recorded one; an older one keeps it too.
    assert client.open_writer(shard).schema == v2
    assert client.open_writer(shard, schema=v1).schema == v2
    client.close()


def test_untyped_and_typed_never_mix(location: Location) -> None:
    client = location.client(InlinePolicy(4096, 1 << 20))
    untyped = ShardId.new()
    w = client.open_writer(untyped)
    w.compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    with pytest.raises(SchemaMismatch, match="untyped updates"):
        client.open_writer(untyped, schema=ShardSchema([("id", pa.int64())]))
    assert client.schema(untyped) is None
    with pytest.raises(SchemaMismatch, match="typed shard"):
        w.upsert(pa.table({"id": [1]}))
    # A writer opened before the shard got its schema cannot write raw bytes into it.
    shard = ShardId.new()
    early = client.open_writer(shard)
    typed = client.open_writer(shard, schema=ShardSchema([("id", pa.int64())]))
    with pytest.raises(SchemaMismatch, match="reopen the writer"):
        early.compare_and_append([(b"raw", b"", 0, 1)], 0, 1)
    typed.compare_and_append(pa.table({"id": [7], "t": [0]}), 0, 1)
    assert client.open_reader(shard).snapshot(0).to_pylist() == [{"id": 7, "t": 0, "d": 1}]
    with pytest.raises(InvalidUpdates):
        typed.compare_and_append([(b"raw", b"", 1, 1)], 1, 2)
    with pytest.raises(InvalidInput):
        client.open_writer(shard, schema="id int")  # type: ignore[arg-type]
    client.close()


def test_an_untyped_write_into_a_typed_shard_is_a_schema_mismatch() -> None:
    """Guarantee 14: untyped ``(key, val, ts, diff)`` tuples sent to a typed writer (or
    its transaction appends and upserts) are refused with ``SchemaMismatch``, as a raw
    k/v/t/d table is; the error is still an ``InvalidUpdates`` too. Nothing changes."""
    client, shard, writer = _id_writer("mem://typed-untyped-write", ("name", pa.string()))
    before = client.inspect(shard)
    writes = [
        lambda: writer.compare_and_append([(b"raw", b"", 0, 1)], 0, 1),
        lambda: writer.compare_and_append([[b"raw", b"", 0, 1]], 0, 1),
        lambda: writer.compare_and_append(((b"raw", b"", 0, 1),), 0, 1),
        lambda: writer.append([(b"raw", b"", 0, 1)], 0, 1),
        lambda: writer.upsert([(1, "a")]),
        lambda: client.transaction().compare_and_append(writer, [(b"raw", b"", 0, 1)], 0, 1),
    ]
    for write in writes:
        with pytest.raises(SchemaMismatch, match=r"typed.*not untyped \(key, val, ts, diff\)") \
                as err:
            write()
        assert isinstance(err.value, InvalidUpdates)
        assert "id" in str(err.value) and "name" in str(err.value)
    with pytest.raises(SchemaMismatch) as err:  # a raw k/v/t/d table, as before
        writer.compare_and_append(pa.table({"k": [b"a"], "v": [b""], "t": [0], "d": [1]}), 0, 1)
    # The hint names the columns the shard takes; k and v can never be added (reserved).
    assert str(err.value).endswith("k and v are an untyped shard's columns; this typed "
                                   "shard takes id, name, t, d"), str(err.value)
    with pytest.raises(InvalidUpdates, match="a typed shard takes") as err:
        writer.compare_and_append("not updates", 0, 1)  # not a write at all
    assert not isinstance(err.value, SchemaMismatch)
    after = client.inspect(shard)
    assert (after["seqno"], after["upper"]) == (before["seqno"], 0)
    client.close()


def test_a_small_typed_write_with_a_negative_time_is_refused_and_changes_nothing() -> None:
    client, shard, writer = _id_writer("mem://typed-negative", ("score", pa.float64()))
    bad = pa.table({"id": [1, 2], "score": [0.5, -1.5], "t": [0, -3]})
    with pytest.raises(InvalidUpdates, match=r"update #1: ts must be a non-negative"):
        writer.compare_and_append(bad, 0, 1)
    assert writer.upper == 0
    good = pa.table({"id": [2, 1, 1], "score": [-1.5, 0.5, 0.5], "t": [0, 0, 0],
                     "d": [1, 1, -1]})
    writer.compare_and_append(good, 0, 1)
    snapshot = client.open_reader(shard).snapshot(0)
    assert snapshot.to_pylist() == [{"id": 2, "score": -1.5, "t": 0, "d": 1}]
    client.close()


def _id_writer(location: str, value: tuple[str, pa.DataType]
               ) -> tuple[PersistClient, ShardId, WriteHandle]:
    """A client on ``location`` (memory) and a writer of a new shard keyed by ``id``
    (int64) with one ``value`` column."""
    client = PersistClient.open(location, location)
    shard = ShardId.new()
    return client, shard, client.open_writer(shard, schema=ShardSchema([("id", pa.int64())],
                                                                       [value]))


def _compacted_with_since_at_the_upper(client: PersistClient, shard: ShardId) -> None:
    """Its readers released every time below the upper (the API allows since == upper),
    then compaction advanced the rows' times to the since: to the upper."""
    reader = client.open_reader(shard)
    reader.downgrade_since(client.inspect(shard)["upper"])
    client.compact(shard)
    reader.expire()


def test_replace_contents_counts_rows_compaction_moved_to_the_upper(location: Location
                                                                    ) -> None:
    client = location.client()
    shard = ShardId.new()
    schema = ShardSchema([("id", pa.int64())], [("a", pa.string())])
    table = pa.table({"id": [1, 2, 3], "a": ["x", "y", "z"]})
    writer = client.open_writer(shard, schema=schema)
    writer.replace_contents(table)
    _compacted_with_since_at_the_upper(client, shard)
    # The shard holds exactly the table already: replacing it with itself changes nothing.
    result = writer.replace_contents(table)
    assert (result.rows_added, result.rows_retracted) == (0, 0)
    changed = writer.replace_contents(table.slice(0, 2))
    assert (changed.rows_added, changed.rows_retracted) == (0, 1)
    snapshot = client.open_reader(shard).snapshot(int(changed.upper) - 1)
    assert sorted((r["id"], r["a"], r["d"]) for r in snapshot.to_pylist()) == [
        (1, "x", 1), (2, "y", 1)]
    client.close()


def test_store_table_after_compaction_to_a_since_at_the_upper_loads_one_table(
        location: Location) -> None:
    from persist_pipeline.tables import load_table, store_table

    client = location.client()
    table = pa.table({"id": [1, 2, 3], "a": ["x", "y", "z"]})
    stored = store_table(client, "seams/orders", table, ["id"])
    _compacted_with_since_at_the_upper(client, stored.shard)
    store_table(client, "seams/orders", table, ["id"])
    assert load_table(client, "seams/orders").sort_by("id").to_pylist() == table.to_pylist()
    client.close()


def test_an_upsert_at_the_largest_time_is_refused_and_changes_nothing() -> None:
    # Its new upper would be past the largest time: not a frontier any write accepts.
    from persist_pipeline.frontier import MAX_TIME

    client, shard, writer = _id_writer("mem://typed-max-time", ("name", pa.string()))
    writer.upsert(pa.table({"id": [1], "name": ["a"]}))
    with pytest.raises(InvalidFrontier, match="largest time"):
        writer.upsert(pa.table({"id": [2], "name": ["b"]}), ts=MAX_TIME)
    with pytest.raises(InvalidFrontier, match="largest time"):
        writer.delete(pa.table({"id": [1]}), ts=MAX_TIME)
    assert client.inspect(shard)["upper"] == 1
    # Closing the shard is how to write at the largest time.
    writer.compare_and_append(pa.table({"id": [2], "name": ["b"], "t": [MAX_TIME]}), 1, None)
    assert client.inspect(shard)["upper"] is None
    client.close()


def test_an_upsert_that_would_retract_a_diff_of_minus_2_to_the_63_is_refused() -> None:
    # Its retraction, +2**63, does not fit 64 bits: refused, never wrapped to -2**63.
    client, shard, writer = _id_writer("mem://typed-min-diff", ("name", pa.string()))
    writer.compare_and_append(pa.table({"id": [1], "name": ["a"], "t": [0],
                                        "d": [-(1 << 63)]}), 0, 1)
    for write in (lambda: writer.upsert(pa.table({"id": [1], "name": ["b"]})),
                  lambda: writer.delete(pa.table({"id": [1]})),
                  lambda: writer.replace_contents(pa.table({"id": [2], "name": ["c"]}))):
        with pytest.raises(InvalidUpdates, match="64 bits"):
            write()
    assert client.inspect(shard)["upper"] == 1
    client.close()


def test_table_names_that_would_be_another_tables_generation_are_refused() -> None:
    from persist_pipeline.tables import load_table, store_table, store_tables

    client = PersistClient.open("mem://table-names", "mem://table-names")
    store_table(client, "foo", pa.table({"a": [1, 2]}))
    for bad in ("foo/_v2", "_v7", "t" * 189):
        with pytest.raises(InvalidInput):
            store_table(client, bad, pa.table({"b": ["x"]}))
        with pytest.raises(InvalidInput):
            store_tables(client, {"ok": (pa.table({"b": [1]}), None),
                                  bad: (pa.table({"b": ["x"]}), None)})
    assert load_table(client, "foo").to_pylist() == [{"a": 1}, {"a": 2}]
    assert "ok" not in client.shard_names()  # the transaction stored nothing
    # A partition key may read _v<N>; a name of 188 characters can still change schema.
    store_table(client, "sales/_partitions/_v3", pa.table({"a": [1]}))
    long = "t" * 188
    store_table(client, long, pa.table({"a": [1]}))
    assert store_table(client, long, pa.table({"a": ["one"]})).name == f"{long}/_v2"
    assert load_table(client, long).to_pylist() == [{"a": "one"}]
    client.close()


def test_a_pinned_upper_loads_its_own_generation_or_is_refused_as_ambiguous() -> None:
    from persist_pipeline.tables import load_table, store_table

    client = PersistClient.open("mem://table-pins", "mem://table-pins")
    for ids in ([1], [1, 2], [1, 2, 3]):
        store_table(client, "orders", pa.table({"id": ids}))
    # A type change starts generation 2, whose uppers count from 1 again.
    second = store_table(client, "orders", pa.table({"id": ["a"]}))
    assert (second.name, second.result.upper) == ("orders/_v2", 1)
    # Only generation 1 reached upper 3 and 2: those pins read it.
    assert load_table(client, "orders", 3).to_pylist() == [{"id": 1}, {"id": 2}, {"id": 3}]
    assert load_table(client, "orders", 2).to_pylist() == [{"id": 1}, {"id": 2}]
    # Both reached upper 1: which one reported it cannot be told.
    with pytest.raises(InvalidInput, match=r"ambiguous.*'orders/_v1'"):
        load_table(client, "orders", 1)
    # Each generation by its own name: the first one's is orders/_v1 (orders names all).
    assert load_table(client, "orders/_v2", 1).to_pylist() == [{"id": "a"}]
    assert load_table(client, "orders/_v1", 1).to_pylist() == [{"id": 1}]
    assert load_table(client, "orders/_v1").to_pylist() == [{"id": 1}, {"id": 2}, {"id": 3}]
    assert load_table(client, "orders").to_pylist() == [{"id": "a"}]
    client.close()


def test_a_closed_table_shard_loads_its_last_table() -> None:
    from persist_pipeline.tables import load_table, store_table

    client = PersistClient.open("mem://table-closed", "mem://table-closed")
    stored = store_table(client, "done", pa.table({"id": [1, 2]}))
    writer = client.open_writer(stored.shard)
    writer.compare_and_append([], stored.result.upper, None)  # closed: no more writes
    assert load_table(client, "done").to_pylist() == [{"id": 1}, {"id": 2}]
    assert load_table(client, "done", 1).to_pylist() == [{"id": 1}, {"id": 2}]
    with pytest.raises(InvalidInput, match="positive integer"):
        load_table(client, "done", 0)
    client.close()



@pytest.mark.parametrize("table", [pa.table({"id": [3]}), pa.table({"id": ["a"]})],
                         ids=["same-schema", "new-schema"])
def test_a_closed_table_refuses_a_store_and_starts_no_generation(table: pa.Table) -> None:
    # Closed is for good: neither the same schema nor a new one (which would start a
    # generation) is stored, and the refusal names the table, not an internal call.
    from persist_pipeline.tables import load_table, store_table, store_tables

    client = PersistClient.open("mem://", "mem://")
    stored = store_table(client, "done", pa.table({"id": [1, 2]}))
    client.open_writer(stored.shard).compare_and_append([], stored.result.upper, None)
    names = dict(client.shard_names())
    with pytest.raises(InvalidFrontier, match="table 'done' is closed"):
        store_table(client, "done", table)
    with pytest.raises(InvalidFrontier, match="table 'done' is closed"):
        store_tables(client, {"other": (pa.table({"x": [1]}), None), "done": (table, None)})
    assert dict(client.shard_names()) == names, "no generation or other table was named"
    assert load_table(client, "done").to_pylist() == [{"id": 1}, {"id": 2}]
    client.close()

def test_a_generation_named_by_a_store_that_died_loads_the_previous_table() -> None:
    from persist_pipeline.tables import load_table, store_table

    client = PersistClient.open("mem://table-died", "mem://table-died")
    store_table(client, "orders", pa.table({"id": [1, 2]}))
    # A store of a new schema named its generation and died before creating its shard,
    # or before its write.
    client.name_registry.resolve("orders/_v2", create=True)  # as a table store does
    assert load_table(client, "orders").to_pylist() == [{"id": 1}, {"id": 2}]
    client.create_shard(client.resolve("orders/_v2"))
    assert load_table(client, "orders").to_pylist() == [{"id": 1}, {"id": 2}]
    # The next store of that schema writes the named generation, and loads read it.
    assert store_table(client, "orders", pa.table({"id": ["a"]})).name == "orders/_v2"
    assert load_table(client, "orders").to_pylist() == [{"id": "a"}]
    client.close()


def test_frames_and_row_dicts_are_accepted() -> None:
    pd = pytest.importorskip("pandas")
    pl = pytest.importorskip("polars")
    client, shard, writer = _id_writer("mem://typed-frames", ("name", pa.string()))
    writer.compare_and_append(pd.DataFrame({"id": [1], "name": ["pd"], "t": [0]}), 0, 1)
    writer.compare_and_append(pl.DataFrame({"id": [2], "name": ["pl"], "t": [1]}), 1, 2)
    writer.compare_and_append([{"id": 3, "name": "dict", "t": 2}], 2, 3)
    writer.upsert(pl.DataFrame({"id": [1], "name": ["PD"]}))
    result = writer.delete(pd.DataFrame({"id": [2]}))
    snapshot = client.open_reader(shard).snapshot(int(result.upper) - 1)
    assert sorted((r["id"], r["name"]) for r in snapshot.to_pylist()) == [(1, "PD"),
                                                                            (3, "dict")]
    client.close()


def test_row_dicts_arrow_cannot_read_are_refused_with_a_typed_error() -> None:
    """Row dicts become a table by pyarrow's own inference: an integer beyond int64
    (2**63 for a uint64 column) is refused as bad input, never a raw OverflowError, and
    nothing changes; a pyarrow Table of the column's type writes it."""
    client, shard, writer = _id_writer("mem://typed-row-overflow", ("n", pa.uint64()))
    with pytest.raises(InvalidUpdates, match="cannot read the rows as a table"):
        writer.compare_and_append([{"id": 1, "n": 2**63, "t": 0}], 0, 1)
    assert client.inspect(shard)["upper"] == 0
    writer.compare_and_append(pa.table({"id": [1], "n": pa.array([2**63], pa.uint64()),
                                        "t": [0]}), 0, 1)
    assert client.open_reader(shard).snapshot(0).column("n").to_pylist() == [2**63]
    client.close()


def test_upsert_and_delete_bad_input_changes_nothing(location: Location) -> None:
    client = location.client(InlinePolicy(4096, 1 << 20))
    shard = ShardId.new()
    writer = client.open_writer(shard, schema=ShardSchema([("id", pa.int64())],
                                                          [("val", pa.int64())]))
    writer.upsert(pa.table({"id": [1], "val": [10]}), ts=5)
    seqno = client.inspect(shard)["seqno"]
    with pytest.raises(InvalidUpdates, match="more than once"):
        writer.upsert(pa.table({"id": [1, 1], "val": [1, 2]}))
    with pytest.raises(SchemaMismatch, match="take the time as an argument"):
        writer.upsert(pa.table({"id": [1], "val": [1], "t": [9]}))
    with pytest.raises(SchemaMismatch, match="only the key columns"):
        writer.delete(pa.table({"id": [1], "val": [1]}))
    with pytest.raises(UpperMismatch):
        writer.upsert(pa.table({"id": [2], "val": [1]}), ts=3)  # below the upper (6)
    with pytest.raises(InvalidFrontier):
        writer.delete(pa.table({"id": [1]}), ts=-1)
    assert client.inspect(shard)["seqno"] == seqno
    assert client.open_reader(shard).snapshot(5).to_pylist() == [
        {"id": 1, "val": 10, "t": 5, "d": 1}]
    client.close()


def _random_ops(writer: Any, seed: int, *, steps: int, key_space: int
                ) -> Iterator[tuple[int, str, dict[int, int | None]]]:
    """Random upserts (3 in 4) and deletes of 1-3 keys; yields each committed one as
    ``(time, "op", {key: new value or None})``."""
    rng = random.Random(seed)
    for step in range(steps):
        keys = rng.sample(range(key_space), rng.randint(1, 3))
        if rng.random() < 0.25:
            result = writer.delete(pa.table({"id": keys}))
            changes: dict[int, int | None] = dict.fromkeys(keys)
        else:
            values = [seed * 1000 + step * 10 + i for i in range(len(keys))]
            result = writer.upsert(pa.table({"id": keys, "val": values}))
            changes = dict(zip(keys, values, strict=True))
        yield int(result.upper) - 1, "op", changes


def _model_check(client: PersistClient, shard: ShardId,
                 log: list[tuple[int, str, dict[int, int | None]]]) -> None:
    """Replays committed operations in upper order; the snapshot must equal it."""
    model: dict[int, int] = {}
    uppers = [upper for upper, _, _ in log]
    assert len(set(uppers)) == len(uppers), "two operations committed at one upper"
    for _, _, changes in sorted(log, key=lambda entry: entry[0]):
        for key, value in changes.items():
            if value is None:
                model.pop(key, None)
            else:
                model[key] = value
    reader = client.open_reader(shard)
    upper = reader_upper(client.open_writer(shard))
    snapshot = reader.snapshot(upper - 1).to_pylist()
    assert all(r["d"] == 1 for r in snapshot), "a key has a row with multiplicity != 1"
    assert {r["id"]: r["val"] for r in snapshot} == model
    assert len(snapshot) == len(model)


def test_concurrent_upserts_and_deletes_match_a_model(
        location: Location, inline: InlinePolicy) -> None:
    client = location.client(inline, PersistConfig(inline_policy=inline))
    shard = ShardId.new()
    schema = ShardSchema([("id", pa.int64())], [("val", pa.int64())])
    client.open_writer(shard, schema=schema)
    log: list[tuple[int, str, dict[int, int | None]]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        writer = client.open_writer(shard)
        try:
            for entry in _random_ops(writer, seed, steps=12, key_space=8):
                with lock:
                    log.append(entry)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(log) == 48
    _model_check(client, shard, log)
    client.compact(shard)
    _model_check(client, shard, log)
    client.close()


def test_upsert_whose_reply_is_lost_while_another_upsert_lands_applies_once(
        location: Location) -> None:
    clients = Clients(location)
    try:
        lossy_client, lossy = clients.lossy(InlinePolicy(4096, 1 << 20))
        other = clients.plain(InlinePolicy(4096, 1 << 20))
        shard = ShardId.new()
        schema = ShardSchema([("id", pa.int64())], [("val", pa.int64())])
        first = lossy_client.open_writer(shard, schema=schema)
        first.upsert(pa.table({"id": [1], "val": [1]}))
        second = other.open_writer(shard, schema=schema)
        landed: list[int] = []

        def concurrent_upsert() -> None:
            landed.append(int(second.upsert(pa.table({"id": [1], "val": [3]})).upper))

        lossy.arm(concurrent_upsert)
        result = first.upsert(pa.table({"id": [1], "val": [2]}))
        assert lossy.lost == 1
        assert int(result.upper) < landed[0]  # ours committed first, theirs after
        reader = other.open_reader(shard)
        assert reader.snapshot(landed[0] - 1).to_pylist() == [
            {"id": 1, "val": 3, "t": landed[0] - 1, "d": 1}]
    finally:
        clients.close()


class CountingBlob(MemoryBlob):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def get(self, key: str) -> bytes | None:
        self.reads.append(key)
        return super().get(key)


def test_key_lookups_read_only_parts_whose_key_bounds_can_hold_the_keys() -> None:
    blob = CountingBlob()
    client = PersistClient(_memory_consensus(), blob, config=PersistConfig(
        inline_policy=InlinePolicy(0, 0), background_maintenance=False))
    shard = ShardId.new()
    schema = ShardSchema([("id", pa.int64())], [("val", pa.string())])
    writer = client.open_writer(shard, schema=schema)
    for n in range(10):  # ten batches, each over its own key range
        ids = list(range(n * 100, n * 100 + 100))
        writer.compare_and_append(pa.table({"id": ids, "val": [str(i) for i in ids],
                                            "t": [n] * 100}), n, n + 1)
    state = client._machine(shard).fetch_latest()
    parts = [p for b in state.batches.values() for p in b.parts]
    assert len(parts) == 10 and all(isinstance(p, HollowPart) for p in parts)
    keys = sorted(schema.encode_keys(pa.table({"id": [150, 777]})).to_pylist())
    blob.reads.clear()
    found = current_rows(ShardBlobs(blob, None, blob, None), state, keys)
    assert len(set(blob.reads)) == 2  # two of the ten parts
    assert sorted(schema.decode(found).column("id").to_pylist()) == [150, 777]
    writer.upsert(pa.table({"id": [150], "val": ["new"]}))
    assert sorted(r["val"] for r in client.open_reader(shard).snapshot(10).to_pylist()
                  if r["id"] == 150) == ["new"]
    client.close()


def _memory_consensus() -> Any:
    from persist_pipeline.consensus.memory import MemoryConsensus

    return MemoryConsensus()


def test_lookups_in_large_parts_read_only_row_groups_that_can_hold_a_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from persist_pipeline.internal import blobs as blobs_module
    from persist_pipeline.internal import lookup as lookup_module

    # Small row groups, and no part counts as small: the streaming path with pruning.
    monkeypatch.setattr(blobs_module, "_ROW_GROUP_BYTES", 8 << 10)
    monkeypatch.setattr(blobs_module, "WHOLE_FETCH_MAX_BYTES", 256)
    monkeypatch.setattr(lookup_module, "WHOLE_FETCH_MAX_BYTES", 256)
    chosen: list[tuple[int, int]] = []
    original = blobs_module._row_groups_from

    def spy(meta: Any, lower: Any, upper: Any, keys: Any = None) -> list[int]:
        groups = original(meta, lower, upper, keys)
        chosen.append((len(groups), meta.num_row_groups))
        return groups

    monkeypatch.setattr(blobs_module, "_row_groups_from", spy)
    client = PersistClient(_memory_consensus(), MemoryBlob(), config=PersistConfig(
        inline_policy=InlinePolicy(0, 0), background_maintenance=False))
    shard = ShardId.new()
    schema = ShardSchema([("id", pa.int64())], [("val", pa.string())])
    writer = client.open_writer(shard, schema=schema)
    n = 20_000
    writer.compare_and_append(pa.table({"id": range(n), "val": [f"v{i:08d}" for i in range(n)],
                                        "t": [0] * n}), 0, 1)
    state = client._machine(shard).fetch_latest()
    [part] = [p for b in state.batches.values() for p in b.parts]
    keys = sorted(schema.encode_keys(pa.table({"id": [17, 12_345]})).to_pylist())
    found = current_rows(client._machine(shard).blobs, state, keys)
    assert sorted(schema.decode(found).column("id").to_pylist()) == [17, 12_345]
    assert isinstance(part, HollowPart)
    [(read, total)] = chosen
    assert total > 20 and read <= 2, (read, total)
    client.close()


def test_upsert_reading_parts_that_compaction_replaced_and_gc_deleted_rereads(
        durable_location: Location) -> None:
    schema = ShardSchema([("id", pa.int64())], [("val", pa.int64())])
    shard = ShardId.new()
    maintainer = durable_location.client(InlinePolicy(0, 0))
    writer0 = maintainer.open_writer(shard, schema=schema)
    writer0.compare_and_append(pa.table({"id": [1, 2], "val": [10, 20], "t": [0, 0]}), 0, 1)
    writer0.compare_and_append(pa.table({"id": [3], "val": [30], "t": [1]}), 1, 2)
    for t in range(2, 6):  # more batches: the Spine asks for merges
        writer0.compare_and_append(pa.table({"id": [100 + t], "val": [t], "t": [t]}), t,
                                   t + 1)
    client = durable_location.client(InlinePolicy(0, 0))  # caches nothing yet
    writer = client.open_writer(shard)
    machine = writer._machine
    stale = machine.fetch_latest()
    compacted = maintainer.compact(shard)
    assert compacted["applied"] >= 1, compacted
    # What GC does once no live version references them: the merges' inputs go.
    live = {p for b in maintainer._machine(shard).fetch_latest().batches.values()
            for p in b.parts}
    replaced = [p for b in stale.batches.values() for p in b.parts if p not in live]
    assert len(replaced) >= 2 and all(isinstance(p, HollowPart) for p in replaced)
    for p in replaced:
        maintainer.blobs.main.delete(p.key)
    real = machine.fetch_latest
    calls = {"n": 0}

    def first_stale() -> Any:
        calls["n"] += 1
        return stale if calls["n"] == 1 else real()

    machine.fetch_latest = first_stale  # type: ignore[method-assign]
    writer.upsert(pa.table({"id": [1], "val": [11]}))
    machine.fetch_latest = real  # type: ignore[method-assign]
    assert calls["n"] >= 2
    upper = writer.fetch_recent_upper()
    rows = client.open_reader(shard).snapshot(upper - 1).to_pylist()
    assert sorted((r["id"], r["val"], r["d"]) for r in rows) == [
        (1, 11, 1), (2, 20, 1), (3, 30, 1), *((100 + t, t, 1) for t in range(2, 6))]
    # A part missing while the state did not move is reported, not retried forever.
    holding = [p for b in machine.fetch_latest().batches.values() for p in b.parts
               if isinstance(p, HollowPart) and p.may_hold_keys(None, None)]
    for part in holding:
        machine.blobs.main.delete(part.key)
    from persist_pipeline.exceptions import CorruptPart

    fresh = durable_location.client(InlinePolicy(0, 0))  # no decoded parts cached
    seqno = fresh.inspect(shard)["seqno"]
    with pytest.raises(CorruptPart, match="missing"):
        fresh.open_writer(shard).upsert(pa.table({"id": [2], "val": [21]}))
    assert fresh.inspect(shard)["upper"] == upper  # nothing written
    assert fresh.inspect(shard)["seqno"] == seqno + 1  # (the writer's registration)
    for c in (maintainer, client, fresh):
        c.close()


def _process_upserter(consensus: str, blob: str, shard: str, seed: int, out: Any) -> None:
    client = PersistClient.open(consensus, blob, inline_policy=InlinePolicy(4096, 1 << 20))
    log: list[tuple[int, str, dict[int, int | None]]] = []
    try:
        writer = client.open_writer(shard)
        log.extend(_random_ops(writer, seed, steps=8, key_space=6))
        out.put(("ok", log))
    except BaseException as e:
        out.put(("error", repr(e)))
    finally:
        client.close()


def test_upserts_from_several_processes_match_a_model(durable_location: Location) -> None:

    client = durable_location.client(InlinePolicy(4096, 1 << 20))
    shard = ShardId.new()
    client.open_writer(shard, schema=ShardSchema([("id", pa.int64())], [("val", pa.int64())]))
    ctx = process_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_process_upserter,
                         args=(durable_location.consensus_uri, durable_location.blob_uri,
                               str(shard), seed, out)) for seed in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    errors = [r[1] for r in results if r[0] != "ok"]
    assert not errors, errors
    log = [entry for _, entries in results for entry in entries]
    assert len(log) == 24
    _model_check(client, shard, log)
    client.close()


@pytest.mark.parametrize("between", ["compaction", "same-key upsert", "delete"])
def test_a_write_or_merge_landing_between_an_upserts_read_and_its_commit(
        location: Location, between: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic interleaving: another client acts after the upsert read the key's
    current rows and before its compare-and-set. The upsert must still leave exactly its
    own row (a moved upper makes it read again; a merge changes no content)."""
    import persist_pipeline.write as write_module

    schema = ShardSchema([("id", pa.int64())], [("val", pa.int64())])
    shard = ShardId.new()
    other = location.client(InlinePolicy(0, 0))
    ours = location.client(InlinePolicy(0, 0))
    seed = other.open_writer(shard, schema=schema)
    for t in range(6):  # several blob batches: something to merge
        seed.compare_and_append(pa.table({"id": [t % 3], "val": [t], "t": [t]}), t, t + 1)
    writer = ours.open_writer(shard)
    real = write_module.current_rows
    reads = {"n": 0}

    def read_then_interfere(blobs: Any, state: Any, keys: Any) -> pa.Table:
        found = real(blobs, state, keys)
        if blobs is not ours.blobs:
            return found  # the other client's own upsert or delete
        reads["n"] += 1
        if reads["n"] == 1:
            if between == "compaction":
                assert other.compact(shard)["applied"] >= 1
            elif between == "same-key upsert":
                other.open_writer(shard).upsert(pa.table({"id": [0], "val": [999]}))
            else:
                other.open_writer(shard).delete(pa.table({"id": [0, 1]}))
        return found

    monkeypatch.setattr(write_module, "current_rows", read_then_interfere)
    result = writer.upsert(pa.table({"id": [0], "val": [42]}))
    monkeypatch.setattr(write_module, "current_rows", real)
    assert reads["n"] == (1 if between == "compaction" else 2)
    rows = other.open_reader(shard).snapshot(int(result.upper) - 1).to_pylist()
    got = sorted((r["id"], r["val"], r["d"]) for r in rows)
    expected = {"compaction": [(0, 42, 1), (1, 1, 1), (1, 4, 1), (2, 2, 1), (2, 5, 1)],
                "same-key upsert": [(0, 42, 1), (1, 1, 1), (1, 4, 1), (2, 2, 1), (2, 5, 1)],
                "delete": [(0, 42, 1), (2, 2, 1), (2, 5, 1)]}[between]
    assert got == expected
    other.close()
    ours.close()


def test_a_table_load_decodes_with_the_schema_its_snapshot_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A load racing a store that appends a nullable column to the same keyed shard (a
    schema evolution, same generation) returns one of the two stored tables: never a
    bare ``KeyError`` from decoding the snapshot read before the evolution with the
    evolved schema that a heartbeat or another thread's store cached meanwhile."""
    from persist_pipeline.read import ReadHandle
    from persist_pipeline.tables import load_table, store_table

    client = PersistClient.open("mem://", "mem://")
    first = pa.table({"id": [1, 2], "a": ["x", "y"]})
    second = pa.table({"id": [1, 2], "a": ["x", "y"], "b": [10, None]})
    stored = store_table(client, "race/orders", first, ["id"])
    read = ReadHandle._snapshot_batches

    def read_then_store(self: ReadHandle, *args: Any, **kwargs: Any) -> Any:
        yield from read(self, *args, **kwargs)
        monkeypatch.setattr(ReadHandle, "_snapshot_batches", read)
        # Another thread of this process stores the next version meanwhile.
        assert store_table(client, "race/orders", second, ["id"]).shard == stored.shard

    monkeypatch.setattr(ReadHandle, "_snapshot_batches", read_then_store)
    loaded = load_table(client, "race/orders").sort_by("id")
    assert loaded.to_pylist() in (first.to_pylist(), second.to_pylist())
    assert load_table(client, "race/orders").sort_by("id").to_pylist() == second.to_pylist()
    client.close()


def test_the_latest_table_loads_after_its_readers_released_times_up_to_the_upper(
        location: Location) -> None:
    """A reader may move since up to the shard's upper (the API allows it), after which
    compaction may advance every row's time to the upper. The table stored is still
    there and ``load_table`` of its latest version returns it, rather than
    ``SinceViolation`` (a read at ``upper - 1``, below since)."""
    from persist_pipeline.tables import load_table, store_table

    client = location.client()
    table = pa.table({"id": [1, 2, 3], "a": ["x", "y", "z"]})
    stored = store_table(client, "seams/released", table, ["id"])
    _compacted_with_since_at_the_upper(client, stored.shard)
    assert load_table(client, "seams/released").sort_by("id").to_pylist() == table.to_pylist()
    client.close()


def test_a_store_racing_a_generation_switch_is_what_loads_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes store tables of different schemas under one name. B's starts
    generation 2 while A's store, which listed the generations before, is opening
    generation 1 (its schema still fits there). A's store finishes last, so the
    table a load returns afterwards is A's: never a store that reports success into a
    generation no load reads (loads read the newest)."""
    from persist_pipeline import tables
    from persist_pipeline.tables import load_table, store_table

    proc_a = PersistClient.open("mem://gen-race", "mem://gen-race")
    proc_b = PersistClient.open("mem://gen-race", "mem://gen-race")
    first = pa.table({"id": [1], "a": ["x"]})
    theirs = pa.table({"id": ["one"], "b": [1.5]})  # another key type: generation 2
    ours = pa.table({"id": [2], "a": ["y"]})
    store_table(proc_a, "race/gen", first, ["id"])
    open_generation = tables._open_generation

    def b_switches_meanwhile(client: PersistClient, *args: Any) -> Any:
        monkeypatch.setattr(tables, "_open_generation", open_generation)
        assert store_table(proc_b, "race/gen", theirs, ["id"]).name == "race/gen/_v2"
        return open_generation(client, *args)

    monkeypatch.setattr(tables, "_open_generation", b_switches_meanwhile)
    stored = store_table(proc_a, "race/gen", ours, ["id"])
    assert load_table(proc_b, "race/gen").to_pylist() == ours.to_pylist(), stored.name
    proc_a.close()
    proc_b.close()


def test_an_evolved_schema_remembers_what_it_evolved_from_and_when():
    """Recorded evolutions keep the schema they replaced with the upper it was replaced
    at (what a table loaded as of an earlier time is decoded with); equality ignores it,
    and the metadata key it travels under is reserved."""
    from persist_pipeline.internal import transitions
    from persist_pipeline.internal.state import State

    v1 = ShardSchema([("id", pa.int64())], [("a", pa.string())], {"m": "1"})
    v2 = ShardSchema([("id", pa.int64())], [("a", pa.string()), ("b", pa.int64())],
                     {"m": "2"})
    v3 = ShardSchema([("id", pa.int64())], [*v2.value, ("c", pa.float64())])
    state = State(shard_id="s" + "0" * 36)
    state, _ = transitions.record_schema(state, v1, 0)
    state, _ = transitions.record_schema(replace_upper(state, 4), v2, 0)
    state, _ = transitions.record_schema(replace_upper(state, 9), v3, 0)
    recorded = ShardSchema.from_bytes(state.schema)
    assert recorded == v3 and [u for u, _ in recorded.history] == [4, 9]
    assert recorded.as_of(3) == v1 and recorded.as_of(3).metadata == {b"m": b"1"}
    assert recorded.as_of(4) == v2 and recorded.as_of(8) == v2
    assert recorded.as_of(9) is recorded
    # Entries no read can ask for (every time below since) are dropped at the next
    # evolution: reads at as_of >= since never pick them.
    v4 = ShardSchema([("id", pa.int64())], [*v3.value, ("e", pa.int8())])
    later = dataclasses.replace(replace_upper(state, 12), since=9)
    later, _ = transitions.record_schema(later, v4, 0)
    assert [u for u, _ in ShardSchema.from_bytes(later.schema).history] == [12]
    with pytest.raises(InvalidInput, match="reserved"):
        ShardSchema([("id", pa.int64())], [], {"persist_pipeline.schema_history": "[]"})


def replace_upper(state: Any, upper: int) -> Any:
    return dataclasses.replace(state, upper=upper)


def _not_utf8(values: list[bytes]) -> pa.Array:
    """A string array holding ``values`` as they are (Arrow checks no UTF-8 it reads
    from Parquet or IPC: a file another tool wrote may hold such strings)."""
    raw = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(values), raw.buffers())


@pytest.mark.parametrize("rows", [3, 600])
def test_a_typed_write_of_text_that_is_not_utf8_is_bad_input(tmp_path, rows: int) -> None:
    """Strings that are not UTF-8 are refused with InvalidUpdates naming the column and
    nothing is written, through the API and the CLI's append of a Parquet file: a small
    write raised UnicodeDecodeError (a traceback from the CLI) and a large one
    CorruptPart, which says stored data is damaged."""
    import os

    from tests.helpers import run_cli

    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    text = _not_utf8([b"ok%d" % i for i in range(rows - 1)] + [b"\xff\xfe"])
    schema = ShardSchema({"id": pa.int64()}, {"name": pa.string(),
                                              "tags": pa.list_(pa.string())})
    ids = pa.array(range(rows), pa.int64())
    tags = pa.ListArray.from_arrays(pa.array(range(rows + 1), pa.int32()), text)
    good_text = pa.array(["x"] * rows)
    good_tags = pa.array([["y"]] * rows, pa.list_(pa.string()))
    with PersistClient.open(consensus, blob) as client:
        shard = client.resolve("people", create=True)
        with client.open_writer(shard, schema=schema) as writer:
            for name, table in (("name", {"name": text, "tags": good_tags}),
                                ("tags", {"name": good_text, "tags": tags})):
                with pytest.raises(InvalidUpdates, match=f"column '{name}'.*UTF-8"):
                    writer.compare_and_append(pa.table({"id": ids, **table,
                                                        "t": pa.array([0] * rows)}), 0, 1)
        path = tmp_path / "people.parquet"
        pq.write_table(pa.table({"id": ids, "name": text, "t": pa.array([0] * rows)}), path)
        env = dict(os.environ, PERSIST_CONSENSUS_URI=consensus, PERSIST_BLOB_URI=blob)
        done = run_cli(env, "append", "people", str(path))
        assert done.returncode == 2 and "not valid UTF-8" in done.stderr, done.stderr
        state = client._machine(str(shard)).fetch_latest()
        assert state.upper == 0 and not state.batches


def test_a_schema_with_a_time_zone_arrow_does_not_know_is_refused(tmp_path) -> None:
    """Arrow takes any text as a time zone and then fails on every conversion of the
    column: a shard typed so took rows that the CLI's snapshot could not print (a
    traceback) nor pandas load. Such a schema is refused (InvalidInput, nothing
    created), top-level or nested; one a shard recorded earlier still reads."""
    import os

    from tests.helpers import run_cli

    for type_ in (pa.timestamp("us", "Mars/Base"), pa.timestamp("s", "utc"),
                  pa.list_(pa.timestamp("ms", "+99:00")),
                  pa.struct([("at", pa.timestamp("ns", "Nowhere"))])):
        with pytest.raises(InvalidInput, match="unknown time zone"):
            ShardSchema({"id": pa.int64()}, {"at": type_})
    for tz in ("UTC", "Europe/Paris", "+05:30", "Etc/GMT+3"):
        ShardSchema({"id": pa.int64()}, {"at": pa.timestamp("us", tz)})
    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    env = dict(os.environ, PERSIST_CONSENSUS_URI=consensus, PERSIST_BLOB_URI=blob)
    done = run_cli(env, "new-shard", "--name", "mars", "--schema",
                   '{"key": {"id": "int64"}, "value": {"w": "timestamp[us, tz=Mars/Base]"}}')
    assert done.returncode == 2 and "unknown time zone 'Mars/Base'" in done.stderr
    with PersistClient.open(consensus, blob) as client:
        assert client.shard_names() == {} and client.list_shards() == []
    # Recorded before this check (the bytes a shard's state holds): still decoded.
    recorded = pa.schema([("id", pa.int64()), ("at", pa.timestamp("us", "utc"))],
                         metadata={b"persist_pipeline.key_columns": b"1"})
    decoded = ShardSchema.from_bytes(bytes(recorded.serialize().to_pybytes()))
    assert decoded.value.field("at").type == pa.timestamp("us", "utc")


def test_a_schema_with_a_decimal_parquet_cannot_hold_is_refused(tmp_path) -> None:
    """A decimal whose scale is negative or beyond its precision is an Arrow type that
    Parquet cannot hold: a shard typed so took inline rows that compaction could then
    never flush (OSError on every run, the inline bytes stuck), and refused writes too
    large to inline. Such a schema is refused (InvalidInput), top-level or nested."""
    for type_ in (pa.decimal128(5, -2), pa.decimal128(5, 7), pa.decimal256(40, -1),
                  pa.list_(pa.decimal128(5, -1)), pa.struct([("x", pa.decimal128(3, 4))])):
        with pytest.raises(InvalidInput, match="scale outside"):
            ShardSchema({"id": pa.int64()}, {"x": type_})
    schema = ShardSchema({"id": pa.int64()}, {"x": pa.decimal128(38, 38),
                                              "y": pa.decimal128(5, 0)})
    with PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}",
                            f"file://{tmp_path / 'b'}") as client:
        shard = client.resolve("money", create=True)
        with client.open_writer(shard, schema=schema) as writer:
            writer.compare_and_append(pa.table({"id": [1], "x": pa.array([None],
                                                                      pa.decimal128(38, 38)),
                                                "y": pa.array([7], pa.decimal128(5, 0)),
                                                "t": [0]}), 0, 1)
        assert client.compact(shard)["inline_bytes_after"] == 0
