"""Tables (:mod:`persist_pipeline.tables`) at their edges: what a load returns when other
writers' appends left the shard holding what no table is, and pinned loads around the
shard's since and upper. On SQLite + files and PostgreSQL + S3, every write to blob
parts (what other engines read)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pandas as pd
import pyarrow as pa
import pytest

from persist_pipeline import (
    InlinePolicy,
    NotATable,
    NotYetAvailable,
    PersistClient,
    ResourceExhausted,
    SchemaMismatch,
    ShardSchema,
    SinceViolation,
    tables,
)
from tests.fixtures.location import Location


@pytest.fixture
def client(durable_location: Location) -> Iterator[PersistClient]:
    with durable_location.client(InlinePolicy(0, 0)) as c:
        yield c


def _append(client: PersistClient, name: str, rows: pa.Table) -> None:
    """``rows`` (with ``t``, maybe ``d``) appended at the upper by a plain typed writer."""
    writer = client.open_writer(client.resolve(name))
    upper = writer.fetch_recent_upper()
    assert isinstance(upper, int)
    writer.compare_and_append(rows.append_column("t", pa.array([upper] * rows.num_rows)),
                              upper, upper + 1)
    writer.expire()


ORDERS = pa.table({"id": [1, 2], "val": ["a", "b"]})


def test_a_retraction_of_a_row_never_stored_makes_loads_refuse_until_a_store(
        client: PersistClient) -> None:
    first = tables.store_table(client, "orders", ORDERS, ["id"])
    _append(client, "orders", pa.table({"id": [9], "val": ["z"], "d": [-1]}))
    with pytest.raises(NotATable, match=r"counted -1.*'id': 9"):
        tables.load_table(client, "orders")
    # The version the store left is still there, and a store replaces the contents.
    assert tables.load_table(client, "orders", first.result.upper).equals(ORDERS)
    tables.store_table(client, "orders", ORDERS.slice(1), ["id"])
    assert tables.load_table(client, "orders").equals(ORDERS.slice(1))


def test_a_key_appended_twice_to_a_keyed_table_is_refused_not_shown_twice(
        client: PersistClient) -> None:
    tables.store_table(client, "orders", ORDERS, ["id"])
    _append(client, "orders", pa.table({"id": [1], "val": ["other"]}))
    with pytest.raises(NotATable, match=r"key \{'id': 1\} more than once"):
        tables.load_table(client, "orders")
    tables.store_table(client, "orders", ORDERS, ["id"])
    assert tables.load_table(client, "orders").sort_by("id").equals(ORDERS)


def test_a_key_of_nested_columns_appended_with_a_count_of_two_is_refused(
        client: PersistClient) -> None:
    table = pa.table({"id": [[1, 2], [3]], "s": [{"a": 1}, {"a": 2}], "x": ["a", "b"]})
    tables.store_table(client, "nested", table, ["id", "s"])
    _append(client, "nested", pa.table({"id": [[3]], "s": [{"a": 2}], "x": ["b"],
                                        "d": [1]}))
    with pytest.raises(NotATable, match="more than once"):
        tables.load_table(client, "nested")


def test_a_table_without_a_key_keeps_repeated_rows(
        client: PersistClient) -> None:
    rows = pa.table({"id": [1, 1], "val": ["a", "a"]})
    tables.store_table(client, "bag", rows)
    _append(client, "bag", rows.slice(0, 1))
    assert tables.load_table(client, "bag").num_rows == 3


def test_a_load_pinned_at_the_upper_reads_when_since_reached_it(
        client: PersistClient) -> None:
    stored = [tables.store_table(client, "p", pa.table({"id": [i], "val": [str(i)]}),
                                 ["id"]) for i in range(3)]
    shard = client.resolve("p")
    reader = client.open_reader(shard)
    reader.downgrade_since(3)
    reader.expire()
    assert client.inspect(shard)["since"] == client.inspect(shard)["upper"] == 3
    latest = tables.load_table(client, "p")
    # The version the last store left at upper 3 is the latest: every update lies
    # below the upper, so every update's sum is exactly it.
    assert tables.load_table(client, "p", stored[-1].result.upper).equals(latest)
    assert latest.to_pylist() == [{"id": 2, "val": "2"}]
    with pytest.raises(SinceViolation):  # an earlier version may be merged away
        tables.load_table(client, "p", stored[-2].result.upper)
    # Once a later store moved the upper, the contents are that store's: upper 3
    # is no longer exact, and is refused rather than answered with the newer table.
    tables.store_table(client, "p", pa.table({"id": [7], "val": ["7"]}), ["id"])
    with pytest.raises(SinceViolation):
        tables.load_table(client, "p", stored[-1].result.upper)


@pytest.mark.parametrize("released", [1, 100])
def test_a_load_pinned_at_the_upper_keeps_its_columns_when_since_reached_it_first(
        client: PersistClient, released: int) -> None:
    """A typed shard evolved (a nullable value column appended, nothing written) after
    its readers released every time up to its upper (or past it, as the API allows): a
    load pinned to that upper reads every update's sum, and returns the columns its rows
    were stored with, as it does while since is still below the upper."""
    schema = ShardSchema({"id": pa.int64()}, {"val": pa.string()})
    shard = client.resolve("api", create=True)
    writer = client.open_writer(shard, schema=schema)
    writer.compare_and_append(pa.table({"id": [1], "val": ["a"], "t": [0]}), 0, 1)
    writer.expire()
    reader = client.open_reader(shard)
    reader.downgrade_since(released)
    reader.expire()
    evolved = ShardSchema(schema.key, pa.schema([*schema.value, ("extra", pa.int64())]))
    client.open_writer(shard, schema=evolved).expire()
    assert (client.inspect(shard)["since"], client.inspect(shard)["upper"]) == (released, 1)
    assert tables.load_table(client, "api", 1).to_pylist() == [{"id": 1, "val": "a"}]
    assert tables.load_table(client, "api").to_pylist() == [
        {"id": 1, "val": "a", "extra": None}]


OLDER = pa.table({"id": [1, 2], "a": ["x", "y"]})
NEWER = pa.table({"id": [1, 2], "a": ["x", "y"], "b": [10, 20]})


def _load_racing_an_evolving_store(client: PersistClient,
                                   monkeypatch: pytest.MonkeyPatch) -> pa.Table:
    """A load of a keyed table during which a store adding a column (the same
    generation, its schema evolved) lands between the load's look at the upper and its
    read: the interleaving of two processes, made deterministic."""
    tables.store_table(client, "evolving", OLDER, ["id"])
    looked_up = tables.as_of_upper

    def store_meanwhile(*args: object, **kwargs: object) -> int:
        monkeypatch.setattr(tables, "as_of_upper", looked_up)
        as_of = looked_up(*args, **kwargs)  # type: ignore[arg-type]
        assert tables.store_table(client, "evolving", NEWER, ["id"]).name == "evolving"
        return as_of

    monkeypatch.setattr(tables, "as_of_upper", store_meanwhile)
    return tables.load_table(client, "evolving")


def test_a_load_racing_a_store_that_evolves_the_schema_returns_one_stored_table(
        client: PersistClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load returns one of the two tables stored, never the older rows with the
    newer, all-null column."""
    loaded = _load_racing_an_evolving_store(client, monkeypatch)
    assert loaded.equals(OLDER) or loaded.equals(NEWER), loaded.to_pylist()


def test_latest_load_control_returns_a_table_never_stored(
        client: PersistClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a latest load that reads at the upper it looked up first, and
    decodes with the schema of the state it reads then, returns the older rows with the
    newer column. The simulation's table loads rarely land between a racing store's
    look-up and read, so this control is checked here rather than by seeds."""
    from persist_pipeline.sim import controls

    with controls.latest_load_at_looked_up_upper():
        loaded = _load_racing_an_evolving_store(client, monkeypatch)
    assert loaded.to_pylist() == [{"id": 1, "a": "x", "b": None},
                                  {"id": 2, "a": "y", "b": None}]


def test_a_float16_column_refuses_appended_values_out_of_its_range(
        client: PersistClient) -> None:
    halves = pa.table({"id": [1], "x": pa.array([1.5], pa.float16())})
    tables.store_table(client, "h", halves, ["id"])
    # Stored as float32: a float32 beyond float16's range would load as infinity.
    with pytest.raises(SchemaMismatch, match="would be stored as inf"):
        _append(client, "h", pa.table({"id": [2], "x": pa.array([1e10], pa.float32())}))
    with pytest.raises(SchemaMismatch, match="would be stored as 0"):
        _append(client, "h", pa.table({"id": [2], "x": pa.array([1e-10], pa.float32())}))
    # Within it (rounded to the nearest float16), NaN and infinity are kept.
    _append(client, "h", pa.table({"id": [2, 3, 4],
                                   "x": pa.array([0.1, float("nan"), float("inf")],
                                                 pa.float32())}))
    got = tables.load_table(client, "h").sort_by("id")
    assert got.schema == halves.schema
    assert got.column("x").to_pylist()[:2] == [1.5, pa.array([0.1], pa.float16())[0]
                                               .as_py()]
    assert got.column("x").to_pylist()[3] == float("inf")


def test_a_column_of_nulls_only_refuses_appended_values(
        client: PersistClient) -> None:
    empty = pa.table({"id": [1], "n": pa.nulls(1)})
    tables.store_table(client, "nulls", empty, ["id"])
    # Stored as int8: a value there would load as null, silently.
    with pytest.raises(SchemaMismatch, match="only nulls"):
        _append(client, "nulls", pa.table({"id": [2], "n": pa.array([5], pa.int8())}))
    _append(client, "nulls", pa.table({"id": [2], "n": pa.nulls(1, pa.int8())}))
    assert tables.load_table(client, "nulls").sort_by("id").equals(
        pa.table({"id": [1, 2], "n": pa.nulls(2)}))


def test_a_repeated_key_is_named_by_the_tables_own_column_names(
        client: PersistClient) -> None:
    # "k" is stored as "k_col0" (the storage format reserves k): the error says "k".
    table = pa.table({"k": [1], "val": ["a"]})
    tables.store_table(client, "reserved", table, ["k"])
    _append(client, "reserved", pa.table({"k_col0": [1], "val": ["b"]}))
    with pytest.raises(NotATable, match=r"key \{'k': 1\}"):
        tables.load_table(client, "reserved")


def test_float16_and_null_inside_nested_columns_refuse_values_they_cannot_hold(
        client: PersistClient) -> None:
    half = pa.float16()
    table = pa.table({
        "id": [1],
        "s": pa.array([{"h": 1.5, "n": None}], pa.struct([("h", half), ("n", pa.null())])),
        "l": pa.array([[0.5]], pa.list_(half)),
        "m": pa.array([[("a", 2.5)]], pa.map_(pa.string(), half)),
    })
    tables.store_table(client, "nested", table, ["id"])
    stored = client.schema(client.resolve("nested"))
    assert stored is not None
    f32 = pa.float32()
    s_type = pa.struct([("h", f32), ("n", pa.int8())])
    m_type = pa.list_(pa.struct([pa.field("key", pa.string(), False), ("value", f32)]))

    def row(s: object, lst: object, m: object) -> pa.Table:
        return pa.table({"id": [2], "s": pa.array([s], s_type),
                         "l": pa.array([lst], pa.list_(f32)), "m": pa.array([m], m_type)})

    for bad, where in ((row({"h": 1e10, "n": None}, [0.5], []), "s.h"),
                       (row({"h": 1.0, "n": 3}, [0.5], []), "s.n"),
                       (row(None, [0.5, 1e-10], []), "l[]"),
                       (row(None, None, [{"key": "b", "value": -1e9}]), "m.value")):
        with pytest.raises(SchemaMismatch, match=re.escape(f"'{where}'")):
            _append(client, "nested", bad)
    # Values in range (and nulls) are taken; a load returns them in the table's types.
    _append(client, "nested", row({"h": 0.25, "n": None}, None, [{"key": "c",
                                                                    "value": None}]))
    # A struct with a field of nulls only loads too (Arrow casts nothing to null inside
    # a struct: such a table could be stored but its load failed).
    got = tables.load_table(client, "nested").sort_by("id")
    assert got.schema == table.schema
    assert got.column("s").to_pylist() == [{"h": 1.5, "n": None}, {"h": 0.25, "n": None}]
    assert got.column("l").to_pylist() == [[0.5], None]
    assert got.column("m").to_pylist() == [[("a", 2.5)], [("c", None)]]


def test_lists_and_maps_of_nulls_only_load(client: PersistClient) -> None:
    table = pa.table({"id": [1, 2, 3],
                      "l": pa.array([[None, None], None, []], pa.list_(pa.null())),
                      "m": pa.array([[("a", None)], [], None],
                                    pa.map_(pa.string(), pa.null()))})
    tables.store_table(client, "nothing", table, ["id"])
    assert tables.load_table(client, "nothing").sort_by("id").equals(table)


def test_pandas_outputs_without_rows_or_with_an_all_none_column_keep_the_generation(
        client: PersistClient) -> None:
    frame = pd.DataFrame({"id": [1, 2], "note": ["a", "b"], "score": [0.5, 1.5]})
    first = tables.store_table(client, "scores", pa.Table.from_pandas(frame), ["id"])
    # pandas calls these columns "empty" (Arrow's null type): the same table all the same.
    for later in (frame.iloc[0:0], pd.DataFrame({"id": [3], "note": [None],
                                                  "score": [None]})):
        stored = tables.store_table(client, "scores", pa.Table.from_pandas(later), ["id"])
        assert stored.name == "scores"
        got = tables.load_table(client, "scores").to_pandas()
        pd.testing.assert_frame_equal(got, later.astype(frame.dtypes))
    # One generation: a pinned load of the first version is not ambiguous.
    assert tables.load_table(client, "scores", first.result.upper).to_pandas().equals(frame)


def test_a_table_named_but_never_written_is_not_yet_available(client: PersistClient
                                                               ) -> None:
    """A name registered whose shard was never created (its store died after naming it)
    holds no table yet, as an empty shard: ``NotYetAvailable``, not ``ShardNotFound``."""
    client.resolve("named/only", create=True)
    with pytest.raises(NotYetAvailable, match="named/only: nothing stored yet"):
        tables.load_table(client, "named/only")


def test_store_tables_refused_for_a_foreign_shard_names_no_other_table(
        client: PersistClient) -> None:
    """A ``store_tables`` refused because one name is a shard no table store wrote
    (``NotATable``) changes nothing: the other, new, tables are not named (names are
    forever) nor their shards created."""
    writer = client.open_writer(client.resolve("foreign", create=True))  # untyped
    writer.compare_and_append([(b"x", b"y", 0, 1)], 0, 1)
    writer.expire()
    before = dict(client.shard_names())
    shards_before = set(client.list_shards())
    with pytest.raises(NotATable):
        tables.store_tables(client, {"fresh": (pa.table({"id": [1]}), None),
                                     "foreign": (pa.table({"id": [2]}), None)})
    assert client.shard_names() == before
    assert set(client.list_shards()) == shards_before


def test_a_primary_key_given_as_one_string_is_one_column_as_the_io_manager_reads_it(
        client: PersistClient) -> None:
    # Guarantee 13: a key declared as "ab" means the column "ab" at every entry point
    # (the IO manager's output metadata reads it so), never the columns "a" and "b".
    table = pa.table({"ab": [1, 2], "a": [1, 1], "b": [1, 1]})
    tables.store_table(client, "edges/str_key", table, "ab")
    loaded = tables.load_table(client, "edges/str_key")
    assert loaded.sort_by("ab").equals(table)
    assert tables.store_tables(client, {"edges/str_keys": (table, "ab")})
    assert tables.load_table(client, "edges/str_keys").sort_by("ab").equals(table)



def test_a_store_of_what_is_not_an_arrow_table_is_a_typed_error_naming_nothing(
        client: PersistClient) -> None:
    # Guarantee 7: bad input gets a typed error and changes nothing.
    from persist_pipeline.exceptions import InvalidInput
    with pytest.raises(InvalidInput):
        tables.store_table(client, "edges/not_a_table", {"id": [1]})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        tables.store_tables(client, {"edges/not_a_pair": ORDERS})  # type: ignore[dict-item]
    assert not {"edges/not_a_table", "edges/not_a_pair"} & set(client.shard_names())


def test_a_partition_keyed_like_a_generation_is_no_generation_of_its_folder(
        client: PersistClient) -> None:
    # A partition key may read _v<N>: sales/orders/_partitions/_v2 is that partition's
    # table. A table stored at the folder's name took it for its second generation and
    # stored over the partition (another table's rows lost); a load of the folder's name
    # read the partition.
    from persist_pipeline.exceptions import InvalidInput, ShardNameNotFound
    partition = tables.asset_shard_name(["sales", "orders"], "_v2")
    folder = "sales/orders/_partitions"
    assert partition == f"{folder}/_v2"
    tables.store_table(client, partition, ORDERS, ["id"])
    other = pa.table({"id": [9], "val": ["not the partition"]})
    with pytest.raises(InvalidInput, match="_partitions"):
        tables.store_table(client, folder, other, ["id"])
    with pytest.raises(InvalidInput, match="_partitions"):
        tables.store_tables(client, {folder: (other, ["id"])})
    assert tables.load_table(client, partition).sort_by("id").equals(ORDERS)
    with pytest.raises(ShardNameNotFound):
        tables.load_table(client, folder)
    # A shard registered at the folder's name by another entry point (the CLI, a
    # pipeline's config) is that shard alone; the partition _v1, never stored, is not it.
    writer = client.open_writer(client.resolve(folder, create=True))
    writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    writer.expire()
    assert tables.load_table(client, folder).to_pylist() == [{"k": b"k", "v": b"v"}]
    with pytest.raises(ShardNameNotFound):
        tables.load_table(client, f"{folder}/_v1")
    assert tables.load_table(client, partition).sort_by("id").equals(ORDERS)
    # The partition keyed _partitions is a partition like any other, with generations.
    keyed = tables.asset_shard_name(["sales", "orders"], "_partitions")
    tables.store_table(client, keyed, ORDERS, ["id"])
    assert tables.store_table(client, keyed, other.cast(pa.schema(
        [("id", pa.int32()), ("val", pa.string())])), ["id"]).name == f"{keyed}/_v2"
    assert tables.load_table(client, keyed).column("id").type == pa.int32()
    assert tables.load_table(client, partition).sort_by("id").equals(ORDERS)


@pytest.mark.parametrize("counts", [[1 << 62, 1 << 62], [1 << 62], [1 << 45, 3]],
                         ids=["sum-beyond-64-bits", "beyond-addressable", "beyond-memory"])
def test_a_load_of_counts_no_table_can_hold_is_a_typed_error_and_changes_nothing(
        client: PersistClient, counts: list[int]) -> None:
    """Counts the API, the CLI or ingestion store (any 64-bit diff) that a table load
    cannot expand into rows (a sum beyond 64 bits, more rows than memory can address or
    hold) are refused with ResourceExhausted, a PersistError, never a bare ValueError or
    MemoryError from the expansion; the shard is unchanged and other reads still count
    them exactly."""
    writer = client.open_writer(client.resolve("ingested", create=True))
    rows = [(b"k%d" % i, b"v", 0, d) for i, d in enumerate(counts)]
    writer.compare_and_append(rows, 0, 1)
    writer.expire()
    with pytest.raises(ResourceExhausted, match=f"{sum(counts)} rows"):
        tables.load_table(client, "ingested")
    typed = client.open_writer(client.resolve("typed", create=True),
                               schema=ShardSchema({"id": pa.int64()}, {}))
    typed.compare_and_append(pa.table({"id": list(range(len(counts))), "t": [0] * len(counts),
                                       "d": counts}), 0, 1)
    typed.expire()
    with pytest.raises(ResourceExhausted, match=f"{sum(counts)} rows"):
        tables.load_table(client, "typed")
    reader = client.open_reader(client.resolve("ingested"))
    try:
        assert reader.snapshot(0).column("d").to_pylist() == counts
    finally:
        reader.expire()
