"""What the IO manager stores is an ordinary typed, named shard that every entry point
reads: the library by name, the CLI, a read plan in DuckDB, Spark's data source; keyed
materializations; projections; bounded parts under many materializations; schema
generations; shards of earlier versions read and migrated; the Spark compaction factory.
"""

# No `from __future__ import annotations`: Dagster reads the asset functions' annotations.

import csv
import datetime
import io
import json
import logging
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import pyarrow as pa
import pytest

from persist_pipeline import PersistClient
from persist_pipeline.dagster_io import (
    AssetNotStored,
    PersistIOManager,
    UnsupportedOutput,
    asset_shard_id,
    compaction_definitions,
)
from persist_pipeline.dagster_io.encoding import contents_for
from persist_pipeline.exceptions import InvalidConfig, InvalidFrontier, InvalidInput
from tests.pipeline_support import dagster_instance, spark_session, table_location

__all__ = ["spark_session", "table_location"]  # fixtures, imported for pytest

ORDERS = pa.table({
    "order_id": pa.array([1, 2, 3], pa.int32()),
    "customer": pa.array(["ann", "bob", "ann"]).dictionary_encode(),
    "amount": pa.array([10.5, 3.25, 7.0], pa.float64()),
})


@dg.asset(key_prefix=["sales"])
def orders() -> pa.Table:
    return ORDERS



@pytest.fixture
def io_manager(table_location: tuple[str, str]) -> Any:
    manager = PersistIOManager(consensus_uri=table_location[0], blob_uri=table_location[1])
    yield manager
    manager.teardown_after_execution(None)  # type: ignore[arg-type]


def _materialize(io_manager: PersistIOManager, *assets: Any) -> dg.ExecuteInProcessResult:
    with dagster_instance() as instance:
        result = dg.materialize(list(assets), resources={"io_manager": io_manager},
                                instance=instance)
    assert result.success
    return result


def _metadata(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    [event] = result.get_asset_materialization_events()
    metadata = event.step_materialization_data.materialization.metadata
    return {k: getattr(v, "value", v) for k, v in metadata.items()}


def test_an_io_managed_asset_is_a_named_typed_shard_every_entry_point_reads(
        io_manager: PersistIOManager, table_location: tuple[str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    import duckdb

    from persist_pipeline import cli

    meta = _metadata(_materialize(io_manager, orders))
    assert meta["dagster/table_name"] == "sales/orders"
    client = io_manager.client()
    shard = client.resolve("sales/orders")
    assert meta["persist/shard_id"] == str(shard)
    schema = client.schema(shard)
    assert schema is not None and schema.columns == ["order_id", "customer", "amount"]
    # The CLI, by name, prints the columns.
    env = ["--consensus", table_location[0], "--blob", table_location[1]]
    assert cli.main([*env, "snapshot", "sales/orders", "--as-of", "latest"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0][:3] == ["order_id", "customer", "amount"]
    assert sorted((int(r[0]), r[1], float(r[2])) for r in rows[1:]) == [
        (1, "ann", 10.5), (2, "bob", 3.25), (3, "ann", 7.0)]
    # A read plan in DuckDB: the real column types.
    reader = client.open_reader(shard)
    with reader.snapshot_plan("latest") as plan:
        dataset = plan.to_dataset()  # noqa: F841 - DuckDB scans it by name
        described = duckdb.sql("DESCRIBE SELECT order_id, customer, amount FROM dataset"
                               ).fetchall()
        assert [row[:2] for row in described] == [
            ("order_id", "INTEGER"), ("customer", "VARCHAR"), ("amount", "DOUBLE")]
        got = duckdb.sql("SELECT order_id, customer, sum(d) FROM dataset "
                         "GROUP BY ALL ORDER BY order_id").fetchall()
    assert got == [(1, "ann", 1), (2, "bob", 1), (3, "ann", 1)]
    reader.expire()


@pytest.mark.spark
def test_spark_reads_an_io_managed_asset_by_name(spark_session: Any,
                                                 tmp_path: Path) -> None:
    from persist_pipeline.spark import register

    manager = PersistIOManager(consensus_uri=f"sqlite:///{tmp_path}/c.db",
                               blob_uri=f"file://{tmp_path}/b")
    _materialize(manager, orders)
    spark = spark_session
    try:
        register(spark)
        df = (spark.read.format("persist").option("consensus", f"sqlite:///{tmp_path}/c.db")
              .option("blob", f"file://{tmp_path}/b").option("shard", "sales/orders").load())
        assert [f.name for f in df.schema.fields] == ["order_id", "customer", "amount", "t",
                                                      "d"]
        assert [f.dataType.simpleString() for f in df.schema.fields][:3] == [
            "int", "string", "double"]
        assert sorted((r.order_id, r.customer) for r in df.collect()) == [
            (1, "ann"), (2, "bob"), (3, "ann")]
        with pytest.raises(Exception) as info:
            (spark.read.format("persist").option("consensus", f"sqlite:///{tmp_path}/c.db")
             .option("blob", f"file://{tmp_path}/b").option("shard", "sales/orders")
             .option("asof", "0").load().collect())
        first_line = str(info.value).splitlines()[0]
        assert "InvalidConfig: unknown option(s) ['asof']" in first_line
        assert "as_of" in first_line
    finally:
        manager.teardown_after_execution(None)  # type: ignore[arg-type]


@dg.asset(key_prefix=["sensors"])
def readings() -> pd.DataFrame:
    return pd.DataFrame({
        "sensor": pd.Series([1, 2, 255], dtype="uint8"),
        "count": pd.Series([0, 70000, 4294967295], dtype="uint32"),
        "total": pd.Series([0, 1, 2**64 - 1], dtype="uint64"),
        "level": pd.Series([0, 1, 65535], dtype="uint16")})


@pytest.mark.spark
def test_spark_reads_and_writes_an_io_managed_frames_unsigned_columns(
        spark_session: Any, tmp_path: Path) -> None:
    """What the IO manager stores every entry point reads: a pandas frame's unsigned
    columns (Spark has no unsigned types) read in Spark as the wider signed types (a
    64-bit one as decimal(20,0)) holding every value exactly, and a Spark write of such
    columns into the shard loads back as the frame's dtypes; a value that does not fit
    is refused and changes nothing."""
    import decimal

    from persist_pipeline.spark import register

    consensus, blob = f"sqlite:///{tmp_path}/c.db", f"file://{tmp_path}/b"
    manager = PersistIOManager(consensus_uri=consensus, blob_uri=blob)
    meta = _metadata(_materialize(manager, readings))
    spark = spark_session
    try:
        register(spark)
        options = {"consensus": consensus, "blob": blob, "shard": "sensors/readings"}
        df = spark.read.format("persist").options(**options).load()
        assert df.dtypes == [("sensor", "smallint"), ("count", "bigint"),
                             ("total", "decimal(20,0)"), ("level", "int"), ("t", "bigint"),
                             ("d", "bigint")]
        assert sorted(tuple(r)[:4] for r in df.collect()) == [
            (1, 0, decimal.Decimal(0), 0), (2, 70000, decimal.Decimal(1), 1),
            (255, 4294967295, decimal.Decimal(2**64 - 1), 65535)]
        upper = meta["persist/upper"]
        write = {**options, "expected_upper": str(upper), "new_upper": str(upper + 1)}
        row = [(7, 8, decimal.Decimal(9), 10, upper, 1)]
        spark.createDataFrame(row, df.schema).write.format("persist").options(
            **write).mode("append").save()
        bad = [(-1, 8, decimal.Decimal(9), 10, upper + 1, 1)]
        with pytest.raises(Exception, match=r"SchemaMismatch|InvalidUpdates"):
            spark.createDataFrame(bad, df.schema).write.format("persist").options(
                **{**write, "expected_upper": str(upper + 1), "new_upper": str(upper + 2)}
            ).mode("append").save()
        loaded = manager.load("sensors/readings").to_pandas()
        assert [str(t) for t in loaded.dtypes] == ["uint8", "uint32", "uint64", "uint16"]
        assert sorted(map(tuple, loaded.itertuples(index=False))) == [
            (1, 0, 0, 0), (2, 70000, 1, 1), (7, 8, 9, 10), (255, 4294967295, 2**64 - 1, 65535)]
        # 64-bit dates and 32-bit times read as Spark's dates and times.
        days = pa.table({"day": pa.array([0, 86_400_000], pa.date64()),
                         "at": pa.array([1, 86_399], pa.time32("s"))})
        manager.store("sensors/days", days)
        got = spark.read.format("persist").options(
            **{**options, "shard": "sensors/days"}).load()
        assert [dtype for _, dtype in got.dtypes][:1] == ["date"]
        assert sorted((r.day.isoformat(), r.at.isoformat()) for r in got.collect()) == [
            ("1970-01-01", "00:00:01"), ("1970-01-02", "23:59:59")]
    finally:
        manager.teardown_after_execution(None)  # type: ignore[arg-type]


EVENTS = dg.AssetKey(["sales", "events"])


@dg.asset(ins={"events": dg.AssetIn(key=EVENTS)})
def event_names(events: pa.Table) -> pa.Table:
    return events


def test_an_asset_loads_a_typed_shard_other_entry_points_wrote(
        io_manager: PersistIOManager, table_location: tuple[str, str],
        tmp_path: Path) -> None:
    """Every entry point reads what any other stores: a typed shard the CLI created and
    appended to, and a transaction appended to, loads as an asset's input by its name
    (its key and value columns, each row as often as its count), as it reads in the CLI,
    a read plan or Spark."""
    from persist_pipeline import cli

    env = ["--consensus", table_location[0], "--blob", table_location[1]]
    schema = '{"key": {"id": "int64"}, "value": {"name": "string", "at": "timestamp[us, tz=UTC]"}}'
    assert cli.main([*env, "new-shard", "--name", "sales/events", "--schema", schema]) == 0
    rows = tmp_path / "events.jsonl"
    rows.write_text('{"id": 1, "name": "ann", "at": "2026-01-01T10:00:00Z", "t": 0, "d": 1}\n'
                    '{"id": 2, "name": null, "at": null, "t": 0, "d": 2}\n')
    assert cli.main([*env, "append", "sales/events", str(rows)]) == 0
    client = io_manager.client()
    with client.transaction() as txn:
        txn.compare_and_append("sales/events", [{"id": 3, "name": "cy", "t": 1}], 1, 2)
    result = _materialize(io_manager, dg.AssetSpec(EVENTS), event_names)
    loaded = result.output_for_node("event_names")
    assert loaded.schema.names == ["id", "name", "at"]
    assert loaded.schema.field("at").type == pa.timestamp("us", tz="UTC")
    assert sorted(loaded.to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "name": "ann", "at": datetime.datetime(2026, 1, 1, 10, tzinfo=datetime.UTC)},
        {"id": 2, "name": None, "at": None}, {"id": 2, "name": None, "at": None},
        {"id": 3, "name": "cy", "at": None}]


CHANGES = dg.AssetKey(["changes"])


@dg.asset(ins={"changes": dg.AssetIn(key=CHANGES)})
def change_rows(changes: pa.Table) -> pa.Table:
    return changes


def test_an_asset_loads_an_untyped_shard_by_its_name(
        io_manager: PersistIOManager, table_location: tuple[str, str],
        tmp_path: Path) -> None:
    """An untyped shard (what the CLI's append and ingestion write) loads as an asset
    input by its name too: its k and v bytes, each row as often as its count, as the
    CLI's snapshot, a read plan and Spark read it."""
    from persist_pipeline import cli

    env = ["--consensus", table_location[0], "--blob", table_location[1]]
    rows = tmp_path / "changes.jsonl"
    rows.write_text('{"k": "a", "v": "1", "t": 0}\n{"k": "b", "v": "2", "t": 1, "d": 2}\n'
                    '{"k": "a", "v": "1", "t": 1, "d": -1}\n')
    assert cli.main([*env, "append", "changes", str(rows), "--create"]) == 0
    loaded = _materialize(io_manager, dg.AssetSpec(CHANGES), change_rows
                          ).output_for_node("change_rows")
    assert loaded.schema == pa.schema([pa.field("k", pa.binary(), False),
                                       pa.field("v", pa.binary(), False)])
    assert loaded.to_pylist() == [{"k": b"b", "v": b"2"}, {"k": b"b", "v": b"2"}]


@dg.asset(ins={"ledger": dg.AssetIn(key=dg.AssetKey(["finance", "ledger"]))})
def ledger_rows(ledger: pa.Table) -> pa.Table:
    return ledger


@dg.asset(metadata={"dagster/table_name": "finance/books"})
def books() -> pa.Table:
    return pa.table({"id": [1, 2]})


def test_a_declared_table_name_is_where_an_asset_is_stored_and_loaded(
        io_manager: PersistIOManager, table_location: tuple[str, str],
        tmp_path: Path) -> None:
    """An asset whose definition metadata declares ``dagster/table_name`` (as ingestion's
    ``ingest/NAME`` declares NAME) is loaded from, and stored in, the shard of that name,
    not the one named after its key; a partitioned asset cannot declare one."""
    from persist_pipeline import cli

    env = ["--consensus", table_location[0], "--blob", table_location[1]]
    rows = tmp_path / "ledger.jsonl"
    rows.write_text('{"k": "a", "v": "1", "t": 0}\n{"k": "b", "v": "2", "t": 0, "d": 2}\n')
    assert cli.main([*env, "append", "books-2026", str(rows), "--create"]) == 0
    spec = dg.AssetSpec(["finance", "ledger"], metadata={"dagster/table_name": "books-2026"})
    loaded = _materialize(io_manager, spec, ledger_rows).output_for_node("ledger_rows")
    assert sorted(loaded.to_pylist(), key=lambda r: r["k"]) == [
        {"k": b"a", "v": b"1"}, {"k": b"b", "v": b"2"}, {"k": b"b", "v": b"2"}]
    assert "finance/ledger" not in io_manager.client().shard_names()

    assert _metadata(_materialize(io_manager, books))["dagster/table_name"] == "finance/books"
    assert io_manager.load("finance/books").to_pylist() == [{"id": 1}, {"id": 2}]
    assert "books" not in io_manager.client().shard_names()

    @dg.asset(metadata={"dagster/table_name": "finance/regions"},
              partitions_def=dg.StaticPartitionsDefinition(["eu"]))
    def regions() -> pa.Table:
        return pa.table({"id": [1]})

    with dagster_instance() as instance:
        result = dg.materialize([regions], partition_key="eu", instance=instance,
                                resources={"io_manager": io_manager}, raise_on_error=False)
    assert not result.success
    assert "finance/regions" not in io_manager.client().shard_names()


def test_declared_keys_replace_rows_by_key(io_manager: PersistIOManager) -> None:
    first = pa.table({"id": [1, 2, 3], "name": ["a", "b", "c"]})
    io_manager.store("customers", first, primary_key=["id"])
    # Key 1 is gone, 2 changed, 3 unchanged (a null in the new column is no change), 4
    # new, and a nullable column appears.
    second = pa.table({"id": [2, 3, 4], "name": ["B", "c", "d"],
                       "tier": pa.array([None, None, 1], pa.int64())})
    meta = io_manager.store("customers", second, primary_key=["id"])
    assert meta["dagster/table_name"] == "customers"  # the same shard: a schema evolution
    assert (meta["persist/rows_added"], meta["persist/rows_retracted"]) == (2, 2)
    loaded = io_manager.load("customers")
    assert sorted(loaded.to_pylist(), key=lambda r: r["id"]) == [
        {"id": 2, "name": "B", "tier": None}, {"id": 3, "name": "c", "tier": None},
        {"id": 4, "name": "d", "tier": 1}]
    with pytest.raises(InvalidInput, match="appears more than once"):
        io_manager.store("customers", pa.table({"id": [5, 5], "name": ["x", "y"],
                                                "tier": pa.array([1, 2], pa.int64())}),
                         primary_key=["id"])
    with pytest.raises(InvalidInput, match="primary_key"):
        io_manager.store("customers", second, primary_key=["nope"])


def test_a_key_of_every_column_is_still_unique(io_manager: PersistIOManager) -> None:
    """A table whose primary key covers every column is stored like a collection, but its
    declared key is still checked: a repeated row is refused, and nothing is stored."""
    io_manager.store("tags", pa.table({"id": [1, 2]}), primary_key=["id"])
    with pytest.raises(InvalidInput, match=r"primary_key \['id'\]: a key appears more"):
        io_manager.store("tags", pa.table({"id": [5, 5]}), primary_key=["id"])
    with pytest.raises(InvalidInput, match="appears more than once"):
        io_manager.store_many({"tags": pa.table({"id": [7, 7]})}, primary_keys={"tags": ["id"]})
    assert sorted(io_manager.load("tags").column("id").to_pylist()) == [1, 2]


def test_an_all_null_column_keeps_the_tables_generation(io_manager: PersistIOManager
                                                        ) -> None:
    """An output whose column holds only nulls (Arrow's null type: an empty partition's,
    pandas' all-None column) takes the column's stored type instead of starting a new
    generation, and the next ordinary output stays in it too."""
    io_manager.store("scores", pa.table({"id": [1, 2], "score": [0.5, 1.5]}), primary_key=["id"])
    meta = io_manager.store("scores", pa.table({"id": [3], "score": [None]}), primary_key=["id"])
    assert meta["dagster/table_name"] == "scores"
    loaded = io_manager.load("scores")
    assert loaded.schema.field("score").type == pa.float64()
    assert loaded.to_pylist() == [{"id": 3, "score": None}]
    meta = io_manager.store("scores", pa.table({"id": [4], "score": [2.5]}), primary_key=["id"])
    assert meta["dagster/table_name"] == "scores"
    # store_many takes the same path.
    meta = io_manager.store_many({"scores": pa.table({"id": [5], "score": [None]})},
                                 primary_keys={"scores": ["id"]})["scores"]
    assert meta["dagster/table_name"] == "scores"
    # A table with no stored generation keeps the null type (nothing to take it from).
    io_manager.store("fresh", pa.table({"id": [1], "note": [None]}), primary_key=["id"])
    assert io_manager.load("fresh").schema.field("note").type == pa.null()


def test_a_collection_keeps_duplicate_rows(io_manager: PersistIOManager) -> None:
    table = pa.table({"word": ["a", "a", "b"]})
    io_manager.store("words", table)
    assert sorted(io_manager.load("words").column("word").to_pylist()) == ["a", "a", "b"]
    meta = io_manager.store("words", pa.table({"word": ["a", "b", "b"]}))
    assert (meta["persist/rows_added"], meta["persist/rows_retracted"]) == (1, 1)
    assert sorted(io_manager.load("words").column("word").to_pylist()) == ["a", "b", "b"]


def test_a_schema_change_starts_a_generation_loads_read_the_newest(
        io_manager: PersistIOManager) -> None:
    assert io_manager.store("kpis", pa.table({"x": [1]}))["dagster/table_name"] == "kpis"
    meta = io_manager.store("kpis", pa.table({"x": ["one"]}))  # a type change
    assert meta["dagster/table_name"] == "kpis/_v2"
    assert meta["persist/new_generation"] == "column x: int64 -> string"
    assert io_manager.load("kpis").to_pylist() == [{"x": "one"}]
    again = io_manager.store("kpis", pa.table({"x": ["two"]}))
    assert again["dagster/table_name"] == "kpis/_v2" and again["persist/upper"] == 2
    assert "persist/new_generation" not in again  # the newest generation: nothing new
    # A value column added to a keyed table is stored in place (an evolution) ...
    keyed = io_manager.store("kpis", pa.table({"x": ["two"], "y": [1]}), primary_key=["x"])
    assert keyed["dagster/table_name"] == "kpis/_v2" and "persist/new_generation" not in keyed
    # ... one dropped, or the key changed, is not (a load must return this table).
    dropped = io_manager.store("kpis", pa.table({"x": ["two"]}), primary_key=["x"])
    assert (dropped["dagster/table_name"], dropped["persist/new_generation"]) == (
        "kpis/_v3", "columns dropped: y")
    rekeyed = io_manager.store("kpis", pa.table({"x": ["two"], "y": [1]}), primary_key=["y"])
    assert (rekeyed["dagster/table_name"], rekeyed["persist/new_generation"]) == (
        "kpis/_v4", "primary key none (the whole row) -> (y); columns added: y")
    client = io_manager.client()
    first = client.resolve("kpis")
    # The first generation's contents are untouched; its upper moved by one (an empty
    # append) once the second was registered, so that no store of several tables that
    # read it can commit into it any more (tables._seal).
    assert client.open_reader(first).snapshot(0).to_pylist() == [{"x": 1, "t": 0, "d": 1}]
    assert client.inspect(first)["upper"] == 2
    assert client.open_reader(first).snapshot("latest").to_pylist() == [
        {"x": 1, "t": 1, "d": 1}]


def test_a_materialization_that_starts_a_generation_says_why_in_the_run_log(
        io_manager: PersistIOManager) -> None:
    """A pandas frame's index is part of the table it stores: a filtered frame (its
    index a column) after an unfiltered one (a RangeIndex) starts a generation, a new
    shard. The run says so, and which change did it, instead of a silent new name."""
    shapes = iter([pd.DataFrame({"x": [1, 2, 3]}),
                   pd.DataFrame({"x": [5, 6]}),  # another length: the same shape
                   # Rows 0, 1, 3: no range (pandas 3 keeps a RangeIndex for a slice).
                   pd.DataFrame({"x": [1, 2, 3, 4]}).query("x != 3")])

    @dg.asset
    def scores() -> pd.DataFrame:
        return next(shapes)

    warnings = []
    for _ in range(3):
        with dagster_instance() as instance:
            result = dg.materialize([scores], resources={"io_manager": io_manager},
                                    instance=instance)
            assert result.success
            warnings.append([e.message for e in instance.all_logs(result.run_id)
                             if e.level == logging.WARNING
                             and "new generation" in e.message])
        [materialized] = result.asset_materializations_for_node("scores")
        metadata = materialized.metadata
    assert warnings[0] == [] and warnings[1] == []  # the first store; the same shape again
    [message] = warnings[2]
    assert "scores: stored in a new generation, scores/_v2, because its schema changed: " \
        "pandas index RangeIndex(start=0, step=1) -> an Index stored as column " \
        "'__index_level_0__'" in message
    assert metadata["dagster/table_name"].value == "scores/_v2"
    assert "RangeIndex(start=0, step=1) -> an Index" in metadata["persist/new_generation"].value
    loaded = io_manager.load("scores").to_pandas()
    pd.testing.assert_frame_equal(loaded, pd.DataFrame({"x": [1, 2, 4]}, index=[0, 1, 3]))


def test_columns_input_metadata_loads_only_those(io_manager: PersistIOManager) -> None:
    @dg.asset(key_prefix=["sales"], ins={"orders": dg.AssetIn(
        key=["sales", "orders"], metadata={"columns": ["amount", "order_id"]})})
    def amounts(orders: pa.Table) -> pa.Table:
        assert orders.column_names == ["amount", "order_id"]
        return pa.table({"total": [sum(orders.column("amount").to_pylist())]})

    result = _materialize(io_manager, orders, amounts)
    assert result.output_for_node("sales__amounts").to_pylist() == [{"total": 20.75}]
    from persist_pipeline.dagster_io.io_manager import _project

    with pytest.raises(InvalidInput, match="not columns of the stored table"):
        _project(ORDERS, ["nope"], "sales/orders")
    # A pandas DataFrame keeps its named index when only some columns are loaded.
    frame = pd.DataFrame({"x": [1, 2], "y": [3, 4]},
                         index=pd.Index(["a", "b"], name="day"))
    io_manager.store("by_day", pa.Table.from_pandas(frame))
    stored = io_manager.load("by_day")
    loaded = _project(stored, ["y"], "by_day", keep_pandas_index=True).to_pandas()
    assert list(loaded.columns) == ["y"] and loaded.index.name == "day"
    assert loaded.sort_index().to_dict() == {"y": {"a": 3, "b": 4}}
    assert _project(stored, ["y"], "by_day").column_names == ["y"]  # Arrow: only those

    @dg.asset(ins={"by_day": dg.AssetIn(metadata={"columns": ["y"]})})
    def arrow_reader(by_day: pa.Table) -> pa.Table:
        assert by_day.column_names == ["y"]
        return by_day

    @dg.asset(ins={"by_day": dg.AssetIn(metadata={"columns": ["y"]})})
    def pandas_reader(by_day: pd.DataFrame) -> pd.DataFrame:
        assert list(by_day.columns) == ["y"] and by_day.index.name == "day"
        return by_day

    @dg.asset
    def by_day() -> pd.DataFrame:  # what was stored above
        return frame

    _materialize(io_manager, by_day, arrow_reader, pandas_reader)


def test_sixty_materializations_keep_the_shard_compacted(io_manager: PersistIOManager
                                                          ) -> None:
    for i in range(60):
        table = pa.table({"id": list(range(200)), "v": [f"{i}-{j % 7}" for j in range(200)]})
        io_manager.store("churn", table, primary_key=["id"])
    client = io_manager.client()
    shard = client.resolve("churn")
    info = client.inspect(shard)
    assert info["pending_merge_requests"] == 0
    assert info["batches"] <= 8 and sum(info["parts"].values()) <= 8, info
    blobs = [m.key for m in client.blobs.main.list_keys(f"{shard}/p/")]
    assert len(blobs) <= 16, len(blobs)  # superseded parts are collected
    assert io_manager.load("churn").num_rows == 200


def test_a_shard_of_an_earlier_version_is_read_then_migrated(io_manager: PersistIOManager
                                                              ) -> None:
    key = dg.AssetKey(["sales", "orders"])
    legacy = asset_shard_id(key)
    client = io_manager.client()
    contents = contents_for(ORDERS)
    updates = [(k, v, 0, d) for (k, v), d in contents.items()]
    client.open_writer(legacy).compare_and_append(updates, 0, 1)
    with dagster_instance() as instance:
        @dg.asset(key_prefix=["sales"])
        def order_count(orders: pa.Table) -> int:
            return orders.num_rows

        result = dg.materialize([orders, order_count], resources={"io_manager": io_manager},
                                instance=instance, selection=[order_count],
                                raise_on_error=False)
    # Read from the earlier shard (the typed one does not exist yet).
    loaded = io_manager.load("sales/orders", legacy_shard=legacy)
    assert loaded.schema == ORDERS.schema and loaded.num_rows == 3
    assert result is not None
    meta = io_manager.migrate(key)
    assert meta["dagster/table_name"] == "sales/orders"
    assert sorted(io_manager.load("sales/orders").to_pylist(), key=json.dumps) == sorted(
        ORDERS.to_pylist(), key=json.dumps)
    with pytest.raises(AssetNotStored):
        io_manager.migrate(dg.AssetKey("never"))


def test_reads_take_latest_and_refuse_none(tmp_path: Path) -> None:
    with PersistClient.open(f"sqlite:///{tmp_path}/c.db", f"file://{tmp_path}/b") as client:
        writer = client.open_writer("s" + "0" * 8 + "-0000-4000-8000-" + "0" * 12)
        writer.compare_and_append([(b"a", b"1", 0, 1), (b"b", b"1", 4, 1)], 0, 5)
        reader = client.open_reader(writer.shard_id)
        assert reader.snapshot("latest").to_pylist() == reader.snapshot(4).to_pylist()
        with reader.snapshot_plan() as plan:
            assert plan.as_of == 4
        with pytest.raises(InvalidFrontier, match="'latest'"):
            reader.snapshot(None)  # type: ignore[arg-type]
        with pytest.raises(InvalidFrontier):
            reader.snapshot_plan(None)  # type: ignore[arg-type]


def test_a_load_from_a_mistyped_location_creates_nothing(tmp_path: Path) -> None:
    """A load opens the location without creating it: a mistyped URI is reported (the
    asset is not stored there) and leaves no empty store behind; a store then creates
    it, the SQLite file's folder included, as the code location's persist resource
    (ingestion) does with the same URIs."""
    manager = PersistIOManager(consensus_uri=f"sqlite:///{tmp_path}/typo/c.db",
                               blob_uri=f"file://{tmp_path}/typo-blob")
    with pytest.raises(AssetNotStored, match=r"no persist store exists .*typo"):
        manager.load("orders")
    with pytest.raises(AssetNotStored, match=r"no persist store exists .*typo"):
        manager.migrate(dg.AssetKey("orders"))
    assert list(tmp_path.iterdir()) == []
    manager.store("orders", pa.table({"n": [1, 2]}))
    assert manager.load("orders").num_rows == 2
    from resources.persist import PersistResource

    persist = PersistResource(consensus_uri=f"sqlite:///{tmp_path}/other/c.db",
                              blob_uri=f"file://{tmp_path}/other-blob")
    persist.client().close()
    assert (tmp_path / "other" / "c.db").is_file()


@pytest.mark.parametrize("kwargs", [
    {"retry_after_seconds": -1}, {"retry_after_seconds": 1.5},
    {"retry_after_seconds": "600"}, {"retry_after_seconds": True},
    {"minimum_interval_seconds": 0}, {"minimum_interval_seconds": None},
])
def test_compaction_definitions_refuse_bad_intervals(kwargs: dict[str, Any]) -> None:
    """A bad interval is refused when the definitions are built, not turned into a
    retry on every tick (or never) once the sensor runs."""
    [name] = kwargs
    with pytest.raises(InvalidConfig, match=name):
        compaction_definitions(**kwargs)


def test_compaction_definitions_request_a_run_for_pending_shards(tmp_path: Path) -> None:
    manager = PersistIOManager(consensus_uri=f"sqlite:///{tmp_path}/c.db",
                               blob_uri=f"file://{tmp_path}/b", maintenance="external")
    defs = compaction_definitions()
    sensor = defs.sensors[0]  # type: ignore[index]
    try:
        with dagster_instance() as instance:
            with dg.build_sensor_context(instance=instance,
                                         resources={"io_manager": manager}) as context:
                skipped = sensor.evaluate_tick(context)
            # Nothing stored yet: a tick creates nothing (a mistyped URI is no new store).
            assert skipped.run_requests == [] and "nothing is stored at the IO manager's " \
                "URIs yet" in (skipped.skip_message or "")
            assert sorted(p.name for p in tmp_path.iterdir()) == []
            for i in range(3):
                manager.store("pending", pa.table({"n": list(range(i + 3))}))
            with dg.build_sensor_context(instance=instance,
                                         resources={"io_manager": manager}) as context:
                result = sensor.evaluate_tick(context)
            [request] = result.run_requests or []
            shard = str(manager.client().resolve("pending"))
            config = request.run_config["ops"]["persist_io_compaction_op"]["config"]
            assert config == {"shards": [shard]}
            assert request.run_key is not None and "~" not in request.run_key

            def tick(cursor: str | None) -> Any:
                with dg.build_sensor_context(instance=instance, cursor=cursor,
                                             resources={"io_manager": manager}) as context:
                    return sensor.evaluate_tick(context)

            # Asked again at once, with its run still to come: no second request.
            assert tick(result.cursor).run_requests == []
            # Later, its run failed without changing the shard (same seqno): the daemon
            # launches a run key once, so the retry is numbered. Not while a run of the
            # request is in flight, though.
            aged = json.loads(result.cursor or "{}")
            aged["at_ms"] -= 601_000
            instance.add_run(dg.DagsterRun(job_name="persist_io_compaction",
                                           run_id="r1", status=dg.DagsterRunStatus.STARTED,
                                           tags={"dagster/run_key": request.run_key}))
            assert tick(json.dumps(aged)).run_requests == []
            instance.handle_run_event("r1", dg.DagsterEvent(
                event_type_value="PIPELINE_FAILURE", job_name="persist_io_compaction"))
            [retry] = tick(json.dumps(aged)).run_requests or []
            assert retry.run_key == f"{request.run_key}~1"
    finally:
        manager.teardown_after_execution(None)  # type: ignore[arg-type]


def test_a_multi_asset_stores_its_outputs_in_one_transaction(
        io_manager: PersistIOManager) -> None:
    """``store_many`` from a multi-asset: both assets' shards change in one commit, each
    materialization reports its own table; a failing table stores neither."""

    @dg.multi_asset(specs=[dg.AssetSpec(["shop", "orders"]), dg.AssetSpec(["shop", "lines"])],
                    required_resource_keys={"io_manager"})
    def shop(context: dg.AssetExecutionContext):
        metadata = context.resources.io_manager.store_many(
            {"shop/orders": pa.table({"id": [1, 2], "total": [3.0, 4.0]}),
             "shop/lines": pa.table({"order": [1, 2, 2], "sku": ["a", "b", "c"]})},
            primary_keys={"shop/orders": ["id"]}, debug=f"dagster run {context.run.run_id}")
        for name, meta in metadata.items():
            yield dg.MaterializeResult(asset_key=dg.AssetKey(name.split("/")),
                                       metadata=meta)

    with dagster_instance() as instance:
        result = dg.materialize([shop], resources={"io_manager": io_manager},
                                instance=instance)
    assert result.success
    events = {e.asset_key.to_user_string(): e.step_materialization_data.materialization.metadata
              for e in result.get_asset_materialization_events()}
    assert events["shop/orders"]["dagster/table_name"].value == "shop/orders"
    assert events["shop/lines"]["dagster/row_count"].value == 3
    orders_upper = events["shop/orders"]["persist/upper"].value
    client = io_manager.client()
    assert client.inspect(client.resolve("shop/orders"))["upper"] == orders_upper
    with pytest.raises(InvalidInput):
        io_manager.store_many({"shop/orders": pa.table({"id": [5, 5], "total": [1.0, 2.0]}),
                               "shop/lines": pa.table({"order": [9], "sku": ["z"]})},
                              primary_keys={"shop/orders": ["id"]})
    assert client.inspect(client.resolve("shop/lines"))["upper"] == \
        events["shop/lines"]["persist/upper"].value


class _Rows(dg.Config):
    rows: int = 3


@dg.asset
def daily_totals(config: _Rows) -> pd.DataFrame:
    return pd.DataFrame({"day": list(range(config.rows)), "total": [1.5] * config.rows})


def test_pandas_outputs_of_other_lengths_stay_in_one_shard(io_manager: PersistIOManager,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    # A DataFrame's RangeIndex records its stop (the row count) in the Arrow schema's
    # pandas metadata; kept in the shard schema, every other length was a new
    # generation (a new shard, nothing retracted).
    metas = []
    with dagster_instance() as instance:
        for rows in (3, 5, 4):
            result = dg.materialize(
                [daily_totals], instance=instance, resources={"io_manager": io_manager},
                run_config={"ops": {"daily_totals": {"config": {"rows": rows}}}})
            assert result.success
            metas.append(_metadata(result))
    assert [m["dagster/table_name"] for m in metas] == ["daily_totals"] * 3
    assert [m["persist/upper"] for m in metas] == [1, 2, 3]
    assert metas[2]["persist/rows_retracted"] == 1  # day 4 is gone
    loaded = io_manager.load("daily_totals").to_pandas()
    assert loaded.index.equals(pd.RangeIndex(4)) and sorted(loaded["day"]) == [0, 1, 2, 3]
    # Another RangeIndex comes back as it was stored.
    stepped = pd.DataFrame({"x": [7, 8]}, index=pd.RangeIndex(10, 14, 2))
    io_manager.store("stepped", pa.Table.from_pandas(stepped))
    assert io_manager.load("stepped").to_pandas().index.equals(pd.RangeIndex(10, 14, 2))
    # A shard an earlier version stored with the stop kept stays the asset's shard.
    from persist_pipeline import tables

    with monkeypatch.context() as m:
        m.setattr(tables, "_kept_schema", lambda schema: schema)
        io_manager.store("legacy", pa.Table.from_pandas(pd.DataFrame({"a": [1, 2, 3]})))
    meta = io_manager.store("legacy", pa.Table.from_pandas(pd.DataFrame({"a": [1, 2]})))
    assert (meta["dagster/table_name"], meta["persist/upper"]) == ("legacy", 2)
    assert io_manager.load("legacy").to_pandas().index.equals(pd.RangeIndex(2))


_REGIONS = dg.StaticPartitionsDefinition(["eu", "us", "apac"])


@dg.asset(partitions_def=_REGIONS)
def signups(context: dg.AssetExecutionContext) -> pd.DataFrame:
    if context.partition_key == "eu":
        return pd.DataFrame({"id": [1, 2], "referrer": ["ads", None]})
    if context.partition_key == "us":
        return pd.DataFrame({"id": [3], "referrer": [None]})  # no referrer here: null type
    return pd.DataFrame({"id": ["x"], "referrer": ["ads"]})  # an id of another type


@dg.asset(ins={"signups": dg.AssetIn(partition_mapping=dg.StaticPartitionMapping(
    {"eu": "all", "us": "all"}))}, partitions_def=dg.StaticPartitionsDefinition(["all"]))
def signup_count(signups: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"n": [len(signups)], "referrers": [signups["referrer"].count()]})


def test_partitions_with_a_column_of_nulls_load_as_one_table(io_manager: PersistIOManager
                                                             ) -> None:
    with dagster_instance() as instance:
        for region in ("eu", "us", "apac"):
            assert dg.materialize([signups], partition_key=region, instance=instance,
                                  resources={"io_manager": io_manager}).success
        assert dg.materialize([signups, signup_count], selection=[signup_count],
                              partition_key="all", instance=instance,
                              resources={"io_manager": io_manager}).success
    assert io_manager.load(
        "signup_count/_partitions/all").to_pylist() == [{"n": 3, "referrers": 1}]
    # Partitions whose types do not combine: a typed error naming them.
    from persist_pipeline.dagster_io.io_manager import _concat_partitions

    with pytest.raises(InvalidInput, match=r"partitions \['eu', 'apac'\]"):
        _concat_partitions([io_manager.load("signups/_partitions/eu"),
                            io_manager.load("signups/_partitions/apac")], ["eu", "apac"],
                           "signups")


_LEVELS = pd.CategoricalDtype(["low", "medium", "high", "urgent"], ordered=True)


@dg.asset
def tickets() -> pd.DataFrame:
    return pd.DataFrame({"id": [1, 2, 3, 4],
                         "level": pd.Categorical(["high", "low", "medium", "low"],
                                                 dtype=_LEVELS)})


@dg.asset
def raised(tickets: pd.DataFrame) -> pd.DataFrame:
    return tickets[tickets["level"] > "low"]


def test_an_ordered_categorical_keeps_its_categories_and_their_order(
        io_manager: PersistIOManager) -> None:
    # The categories (unused ones included) and their order are the dtype: a comparison
    # downstream selects by that order, not by the order the rows were stored in.
    _materialize(io_manager, tickets, raised)
    loaded = io_manager.load("tickets").to_pandas()
    assert loaded["level"].dtype == _LEVELS
    assert sorted(io_manager.load("raised").to_pandas()["id"]) == [1, 3]
    # Other categories are another dtype: a generation of their own.
    other = pd.CategoricalDtype(["high", "low"], ordered=True)
    meta = io_manager.store("tickets", pa.Table.from_pandas(pd.DataFrame(
        {"id": [9], "level": pd.Categorical(["low"], dtype=other)})))
    assert meta["dagster/table_name"] == "tickets/_v2"
    assert io_manager.load("tickets").to_pandas()["level"].dtype == other
    # An ordered categorical too large to keep in the shard schema is refused.
    from persist_pipeline.tables import UnsupportedOutput

    huge = pd.CategoricalDtype([f"c{i:07d}" * 4 for i in range(40_000)], ordered=True)
    with pytest.raises(UnsupportedOutput, match="ordered categorical"):
        io_manager.store("huge", pa.Table.from_pandas(pd.DataFrame(
            {"level": pd.Categorical(["c0000000" * 4], dtype=huge)})))
    assert "huge" not in io_manager.client().shard_names()
    # Unordered categoricals come back with the categories their rows use.
    plain = pa.table({"c": pa.array(["b", "a", "b"]).dictionary_encode()})
    io_manager.store("plain", plain)
    assert sorted(io_manager.load("plain").column("c").to_pylist()) == ["a", "b", "b"]


def test_unordered_categoricals_with_other_categories_stay_in_one_shard(
        io_manager: PersistIOManager, monkeypatch: pytest.MonkeyPatch) -> None:
    # An unordered categorical's categories follow its rows (and pandas' index width
    # follows their count): outputs whose categories change are one table's versions.
    def visits(cities: list[str]) -> pa.Table:
        return pa.Table.from_pandas(pd.DataFrame({"city": pd.Categorical(cities)}))

    first = io_manager.store("visits", visits(["paris", "rome"]))
    second = io_manager.store("visits", visits(["paris", "rome", "oslo"]))
    many = [f"city{i:03d}" for i in range(300)]  # more than 127: 16-bit codes
    third = io_manager.store("visits", visits(many))
    assert [m["dagster/table_name"] for m in (first, second, third)] == ["visits"] * 3
    assert [m["persist/upper"] for m in (first, second, third)] == [1, 2, 3]
    loaded = io_manager.load("visits").to_pandas()
    assert sorted(loaded["city"]) == many and loaded["city"].dtype == "category"
    # A shard an earlier version stored (8-bit indices, the category count kept) stays
    # the table's shard.
    from persist_pipeline import tables

    with monkeypatch.context() as m:
        m.setattr(tables, "_kept_schema", lambda schema: schema)
        io_manager.store("trips", visits(["a", "b"]))
    assert io_manager.store("trips", visits(many))["dagster/table_name"] == "trips"
    assert sorted(io_manager.load("trips").to_pandas()["city"]) == many


def test_an_unordered_categorical_of_numbers_or_dates_loads(io_manager: PersistIOManager
                                                            ) -> None:
    # Arrow casts only strings to a dictionary type: other values are encoded again.
    days = pd.to_datetime(["2026-01-02", "2026-01-01", "2026-01-02"])
    frame = pd.DataFrame({"n": pd.Categorical([3, 1, 3]), "day": pd.Categorical(days)})
    io_manager.store("numbers", pa.Table.from_pandas(frame))
    loaded = io_manager.load("numbers").to_pandas()
    assert loaded["n"].dtype == "category" and sorted(loaded["n"]) == [1, 3, 3]
    assert loaded["day"].dtype == "category" and sorted(loaded["day"]) == sorted(days)


def _written_by(frame: pd.DataFrame, pandas_version: str, pyarrow_version: str,
                labels: str) -> pa.Table:
    """``frame`` as pandas ``pandas_version`` and pyarrow ``pyarrow_version`` describe it
    (``labels``: the dtype of string column labels, ``str`` from pandas 3 on)."""
    table = pa.Table.from_pandas(frame)
    doc = json.loads(table.schema.metadata[b"pandas"])
    doc["pandas_version"] = pandas_version
    doc["creator"]["version"] = pyarrow_version
    doc["column_indexes"][0]["numpy_type"] = labels
    return table.replace_schema_metadata({**table.schema.metadata,
                                          b"pandas": json.dumps(doc).encode()})


def test_upgrading_pandas_or_pyarrow_keeps_a_tables_generation(
        io_manager: PersistIOManager, monkeypatch: pytest.MonkeyPatch) -> None:
    # pandas' metadata names the versions of pandas and pyarrow that wrote it, and pandas
    # 3 gives string column labels another dtype: none of it is the table's, so the same
    # frame written after an upgrade is the same table's next version.
    frame = pd.DataFrame({"id": [1, 2], "x": [0.5, 1.5]})
    writers = [("2.2.3", "16.1.0", "object"), ("2.3.3", "21.0.0", "object"),
               ("3.0.0", "23.0.0", "str")]
    stored = [io_manager.store("upgraded", _written_by(frame, *w)) for w in writers]
    assert [m["dagster/table_name"] for m in stored] == ["upgraded"] * 3
    loaded = io_manager.load("upgraded").to_pandas()
    assert sorted(loaded["id"]) == [1, 2] and list(loaded.columns) == ["id", "x"]
    # A shard an earlier version stored (the versions kept) stays the table's shard.
    from persist_pipeline import tables

    with monkeypatch.context() as m:
        m.setattr(tables, "_kept_schema", lambda schema: schema)
        io_manager.store("kept_versions", _written_by(frame, *writers[0]))
    again = io_manager.store("kept_versions", _written_by(frame, *writers[2]))
    assert again["dagster/table_name"] == "kept_versions" and again["persist/upper"] == 2


def test_a_pinned_upper_pins_each_partition_to_its_own_version(io_manager: Any) -> None:
    """Each partition is its own shard with its own uppers: input metadata ``upper``
    loads every partition's version at that upper of its own shard, and a partition
    whose shard has not reached it is refused by name."""
    io_manager.store("visits/_partitions/eu", pa.table({"r": ["eu"], "n": [1]}))
    io_manager.store("visits/_partitions/us", pa.table({"r": ["us"], "n": [1]}))
    io_manager.store("visits/_partitions/us", pa.table({"r": ["us", "us"], "n": [2, 2]}))
    regions = dg.StaticPartitionsDefinition(["eu", "us"])

    def load(upper: int) -> pa.Table:
        return io_manager.load_input(dg.build_input_context(
            asset_key=dg.AssetKey("visits"), definition_metadata={"upper": upper},
            asset_partitions_def=regions, dagster_type=dg.PythonObjectDagsterType(pa.Table),
            asset_partition_key_range=dg.PartitionKeyRange("eu", "us")))

    assert sorted(load(1).to_pylist(), key=str) == [{"r": "eu", "n": 1}, {"r": "us", "n": 1}]
    with pytest.raises(InvalidInput, match=r"visits partition eu: input metadata upper=2"):
        load(2)


@pytest.mark.parametrize("frame", [
    pd.DataFrame([[1, 2]], columns=["a", "a"]),
    pd.DataFrame({"mixed": [1, "two"]}),
], ids=["repeated-column", "mixed-object-column"])
def test_a_frame_arrow_cannot_take_is_refused_with_a_typed_error(
        io_manager: PersistIOManager, frame: pd.DataFrame) -> None:
    """A pandas frame that pyarrow cannot convert (a column name twice, an object column
    of ints and text) is bad input: ``UnsupportedOutput`` (an ``InvalidInput``), as a
    table with a repeated column is, not pyarrow's own exception; nothing is stored."""
    with pytest.raises(UnsupportedOutput, match="cannot be stored as an Arrow table"):
        io_manager.store_many({"frames/bad": frame})
    assert io_manager.client().shard_names() == {}


def test_a_name_no_store_wrote_yet_loads_as_not_stored(io_manager: PersistIOManager) -> None:
    """A table name registered whose store died before writing (its shard never created,
    or created and still empty) is an asset with nothing stored yet: ``AssetNotStored``,
    as for a name never registered, not the lookup of a shard id the user never saw."""
    client = io_manager.client()
    client.resolve("named/only", create=True)  # a store that died after naming it
    client.open_writer(client.resolve("named/empty", create=True)).expire()
    for name in ("named/only", "named/empty", "named/never"):
        with pytest.raises(AssetNotStored, match=f"{name}: nothing stored yet"):
            io_manager.load(name)
    io_manager.store("named/only", pa.table({"n": [1]}))
    assert io_manager.load("named/only").to_pylist() == [{"n": 1}]


def test_the_readmes_duckdb_query_reads_a_table_stored_twice(io_manager: PersistIOManager
                                                              ) -> None:
    """The README's DuckDB query over an IO-managed asset's plan returns the table its
    last materialization stored: a plan holds every update of every version (rows
    retracted by the second store included), which a plain ``SELECT *`` shows."""
    import duckdb

    io_manager.store("sales/orders", pa.table({"id": [1, 2, 3], "x": ["a", "b", "c"]}),
                     primary_key=["id"])
    io_manager.store("sales/orders", pa.table({"id": [1, 2, 4], "x": ["a", "B", "d"]}),
                     primary_key=["id"])
    client = io_manager.client()
    reader = client.open_reader(client.resolve("sales/orders"))
    with reader.snapshot_plan("latest") as plan:
        dataset = plan.to_dataset()  # noqa: F841 - DuckDB scans it by name
        assert duckdb.sql("SELECT count(*) FROM dataset").fetchone() == (7,)
        got = duckdb.sql(f"SELECT * EXCLUDE (k, v, t, d), sum(d) AS n FROM dataset "
                         f"WHERE t <= {plan.as_of} GROUP BY ALL HAVING n <> 0 "
                         f"ORDER BY id").fetchall()
    reader.expire()
    assert got == [(1, "a", 1), (2, "B", 1), (4, "d", 1)]


def test_an_asset_declaring_a_partition_folder_as_its_table_keeps_off_its_partitions(
        io_manager: PersistIOManager) -> None:
    """A partition key may read ``_v<N>`` (``visits/_partitions/_v2``); an asset whose
    ``dagster/table_name`` is the folder ``visits/_partitions`` took that partition for
    its table's second generation and stored over it. It is refused (InvalidInput),
    and the partition keeps its rows."""
    @dg.asset(partitions_def=dg.StaticPartitionsDefinition(["_v2"]))
    def visits() -> pa.Table:
        return pa.table({"region": ["eu"], "n": [3]})

    @dg.asset(metadata={"dagster/table_name": "visits/_partitions"})
    def totals() -> pa.Table:
        return pa.table({"region": ["all"], "n": [0]})

    resources = {"io_manager": io_manager}
    with dagster_instance() as instance:
        assert dg.materialize([visits], partition_key="_v2", instance=instance,
                              resources=resources).success
        second = dg.materialize([totals], instance=instance, resources=resources,
                                raise_on_error=False)
    assert not second.success
    [failure] = [e for e in second.all_events if e.is_step_failure]
    assert "InvalidInput" in str(failure.event_specific_data)
    assert io_manager.load("visits/_partitions/_v2").to_pylist() == [
        {"region": "eu", "n": 3}]
