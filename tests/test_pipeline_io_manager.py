"""``PersistIOManager`` with a user's own assets, on SQLite + files and PostgreSQL + S3.

Covers: an asset's pyarrow output stored in its shard with ``dagster/row_count``, the
column schema and the shard's upper; a downstream asset loads it with exactly the
stored Arrow types; an overwrite retracts what is gone in one write; input metadata
``upper`` loads an earlier version; a partitioned asset (pandas and polars outputs) maps
each partition to its own shard and a downstream asset loads them all; two concurrent
first writes agree on the shard; clear errors for a never-stored input and an output
that is not a table.
"""

# No `from __future__ import annotations` here: Dagster reads the annotations of the
# decorated asset functions (config and input types) at definition time.

import datetime
import decimal
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dagster as dg
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

from persist_pipeline import PersistClient
from persist_pipeline.dagster_io import (
    AssetNotStored,
    PersistIOManager,
    UnsupportedOutput,
    asset_shard_name,
)
from persist_pipeline.dagster_io.encoding import contents_for, table_from_contents
from tests.pipeline_support import dagster_instance, table_location

__all__ = ["table_location"]  # fixtures, imported for pytest

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow

ORDERS_V1 = pa.table({
    "order_id": pa.array([1, 2, 3, 4], pa.int32()),
    "customer": pa.array(["ann", "bob", None, "ann"]).dictionary_encode(),
    "amount": pa.array([decimal.Decimal("10.50"), decimal.Decimal("3.25"),
                        decimal.Decimal("7.00"), None], pa.decimal128(9, 2)),
    "placed": pa.array([1_700_000_000_000_000_001, 1_700_000_000_000_000_002,
                        1_700_000_000_000_000_003, 1_700_000_000_000_000_004],
                       pa.timestamp("ns", tz="UTC")),
    "tags": pa.array([["new"], [], None, ["vip", "new"]], pa.list_(pa.string())),
    "day": pa.array([datetime.date(2026, 11, 1)] * 4, pa.date32()),
})
# Order 2 is gone, order 3 changed its amount, order 5 is new.
ORDERS_V2 = pa.table({
    "order_id": pa.array([1, 3, 4, 5], pa.int32()),
    "customer": pa.array(["ann", None, "ann", "cy"]).dictionary_encode(),
    "amount": pa.array([decimal.Decimal("10.50"), decimal.Decimal("8.00"), None,
                        decimal.Decimal("1.00")], pa.decimal128(9, 2)),
    "placed": pa.array([1_700_000_000_000_000_001, 1_700_000_000_000_000_003,
                        1_700_000_000_000_000_004, 1_700_000_000_000_000_005],
                       pa.timestamp("ns", tz="UTC")),
    "tags": pa.array([["new"], None, ["vip", "new"], []], pa.list_(pa.string())),
    "day": pa.array([datetime.date(2026, 11, 1)] * 3 + [datetime.date(2026, 11, 2)],
                    pa.date32()),
})


def _sorted(table: pa.Table) -> list[dict[str, Any]]:
    return sorted(table.to_pylist(), key=lambda r: r["order_id"])


class Version(dg.Config):
    version: int = 1


@dg.asset
def orders(config: Version) -> pa.Table:
    return ORDERS_V1 if config.version == 1 else ORDERS_V2


@dg.asset
def order_summary(orders: pa.Table) -> pa.Table:
    # The input arrives with exactly the stored types: the decimal sums exactly.
    assert orders.schema == ORDERS_V1.schema
    total = sum((a for a in orders.column("amount").to_pylist() if a is not None),
                decimal.Decimal(0))
    return pa.table({"orders": [orders.num_rows], "total": pa.array([total],
                                                                     pa.decimal128(12, 2))})


@dg.asset(ins={"orders": dg.AssetIn(metadata={"upper": 1})})
def first_orders(orders: pa.Table) -> pa.Table:
    return orders.select(["order_id"])


REGIONS = dg.StaticPartitionsDefinition(["eu", "us"])


@dg.asset(partitions_def=REGIONS)
def visits(context: dg.AssetExecutionContext) -> pd.DataFrame:
    region = context.partition_key
    n = 3 if region == "eu" else 2
    return pd.DataFrame({"region": [region] * n, "visits": pd.array(range(n), "int64")})


@dg.asset(partitions_def=REGIONS)
def visits_polars(context: dg.AssetExecutionContext, visits: pl.DataFrame) -> pl.DataFrame:
    assert isinstance(visits, pl.DataFrame)
    return visits.with_columns((pl.col("visits") * 10).alias("scaled"))


@dg.asset
def visit_totals(visits_polars: pa.Table) -> pa.Table:
    # An unpartitioned asset reads every partition of its partitioned input.
    return pa.table({"rows": [visits_polars.num_rows],
                     "scaled": [sum(visits_polars.column("scaled").to_pylist())]})



@pytest.fixture
def io_manager(table_location: tuple[str, str]) -> PersistIOManager:
    return PersistIOManager(consensus_uri=table_location[0], blob_uri=table_location[1],
                            persist_inline_update_threshold_bytes=4096,
                            persist_inline_update_max_bytes=1 << 20)


def _meta(result: dg.ExecuteInProcessResult, key: str) -> dict[str, Any]:
    [event] = [e for e in result.get_asset_materialization_events()
               if e.asset_key == dg.AssetKey(key)]
    metadata = event.step_materialization_data.materialization.metadata
    return {k: getattr(v, "value", v) for k, v in metadata.items()}


def _stored(manager: PersistIOManager, name: str, as_of: int) -> pa.Table:
    """The shard's typed snapshot, as any other client reads it by name."""
    client = manager.client()
    reader = client.open_reader(client.resolve(name))
    try:
        return reader.snapshot(as_of)
    finally:
        reader.expire()


def test_store_load_overwrite_and_load_an_earlier_upper(io_manager: PersistIOManager) -> None:
    resources = {"io_manager": io_manager}
    with dagster_instance() as instance:
        first = dg.materialize([orders, order_summary], resources=resources,
                               instance=instance)
        assert first.success
        meta = _meta(first, "orders")
        assert meta["dagster/row_count"] == 4
        schema = meta["dagster/column_schema"]
        assert [(c.name, c.type) for c in schema.columns] == [
            ("order_id", "int32"), ("customer", "dictionary<values=string, indices=int32, "
                                                "ordered=0>"),
            ("amount", "decimal128(9, 2)"), ("placed", "timestamp[ns, tz=UTC]"),
            ("tags", "list<item: string>"), ("day", "date32[day]")]
        assert meta["persist/upper"] == 1 and meta["persist/rows_added"] == 4
        assert meta["persist/rows_retracted"] == 0 and meta["persist/placement"] == "inline"
        assert meta["dagster/table_name"] == "orders"
        shard = io_manager.client().resolve("orders")
        assert meta["persist/shard_id"] == str(shard)
        uri = urlsplit(meta["dagster/uri"])
        assert uri.scheme in ("s3", "file") and uri.path.endswith(f"/{shard}")
        assert " " not in meta["dagster/uri"]  # a URI, no endpoint description
        summary = first.output_for_node("order_summary")
        assert summary.to_pylist() == [{"orders": 4, "total": decimal.Decimal("20.75")}]

        # What a downstream asset loads: the same rows, the same types (dictionary too).
        loaded = io_manager.load("orders")
        assert loaded.schema == ORDERS_V1.schema
        assert _sorted(loaded) == _sorted(ORDERS_V1)

        # Overwrite: one write retracts order 2 and the old order 3, adds new 3 and 5.
        second = dg.materialize([orders], resources=resources, instance=instance,
                                run_config=dg.RunConfig(ops={"orders": Version(version=2)}))
        assert second.success
        meta = _meta(second, "orders")
        assert (meta["persist/upper"], meta["persist/rows_added"],
                meta["persist/rows_retracted"]) == (2, 2, 2)
        assert _sorted(io_manager.load("orders")) == _sorted(ORDERS_V2)
        # The shard holds exactly v2, typed: one row per order, diff 1.
        stored = _stored(io_manager, "orders", 1)
        assert sorted(stored.column("order_id").to_pylist()) == [1, 3, 4, 5]
        assert set(stored.column("d").to_pylist()) == {1}

        # An earlier version through input metadata; the latest one otherwise.
        earlier = dg.materialize([orders, first_orders], resources=resources,
                                 instance=instance, selection=[first_orders])
        assert sorted(earlier.output_for_node("first_orders").column("order_id").to_pylist()
                      ) == [1, 2, 3, 4]

        # Writing the same table again changes nothing but the upper.
        third = dg.materialize([orders], resources=resources, instance=instance,
                               run_config=dg.RunConfig(ops={"orders": Version(version=2)}))
        meta = _meta(third, "orders")
        assert (meta["persist/upper"], meta["persist/rows_added"],
                meta["persist/rows_retracted"]) == (3, 0, 0)
        assert _sorted(io_manager.load("orders", upper=1)) == _sorted(ORDERS_V1)
        with pytest.raises(Exception, match=r"upper=9 must be an integer in \[1, 3\]"):
            io_manager.load("orders", upper=9)


def test_partitions_have_their_own_shards(io_manager: PersistIOManager) -> None:
    resources = {"io_manager": io_manager}
    assets = [visits, visits_polars, visit_totals]
    with dagster_instance() as instance:
        for region in ("eu", "us"):
            result = dg.materialize(assets, resources=resources, instance=instance,
                                    partition_key=region,
                                    selection=[visits, visits_polars])
            assert result.success
            assert _meta(result, "visits")["dagster/row_count"] == (3 if region == "eu" else 2)
        assert asset_shard_name(["visits"], "eu") == "visits/_partitions/eu"
        eu = io_manager.load("visits/_partitions/eu")
        us = io_manager.load("visits/_partitions/us")
        assert sorted(eu.column("visits").to_pylist()) == [0, 1, 2]
        assert us.column("region").to_pylist() == ["us", "us"]
        # pandas' index and dtypes round-trip through the stored schema metadata.
        frame = eu.to_pandas()
        assert list(frame.dtypes.astype(str)) == ["object", "int64"] or \
            list(frame.dtypes.astype(str)) == ["str", "int64"]
        totals = dg.materialize(assets, resources=resources, instance=instance,
                                selection=[visit_totals])
        assert totals.success
        assert totals.output_for_node("visit_totals").to_pylist() == [
            {"rows": 5, "scaled": (0 + 10 + 20) + (0 + 10)}]
        # Re-materializing one partition leaves the other's shard alone.
        again = dg.materialize(assets, resources=resources, instance=instance,
                               partition_key="us", selection=[visits])
        assert _meta(again, "visits")["persist/upper"] == 2
        client = io_manager.client()
        eu_id = str(client.resolve("visits/_partitions/eu"))
        assert client.shard_summaries()[eu_id].upper == 1


def test_concurrent_first_writes_agree_on_the_shard(table_location: tuple[str, str]) -> None:
    name = asset_shard_name(["team", "scores"])
    assert name == "team/scores" != asset_shard_name(["team", "scores"], "p")
    tables = [pa.table({"who": ["a", "b"], "score": [i, i + 1]}) for i in range(4)]
    managers = [PersistIOManager(consensus_uri=table_location[0], blob_uri=table_location[1])
                for _ in tables]
    errors: list[BaseException] = []

    def write(manager: PersistIOManager, table: pa.Table) -> None:
        try:
            manager.store(name, table)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=pair)
               for pair in zip(managers, tables, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        client = managers[0].client()
        shard = str(client.resolve(name))
        assert client.shard_summaries()[shard].upper == 4  # four writes, one shard
        # Each version is exactly one of the outputs, never a mix.
        for upper in range(1, 5):
            version = managers[0].load(name, upper=upper)
            assert any(sorted(version.to_pylist(), key=repr) == t.to_pylist()
                       for t in tables), upper
    finally:
        for m in managers:
            m.teardown_after_execution(None)  # type: ignore[arg-type]


def test_clear_errors(io_manager: PersistIOManager) -> None:
    @dg.asset
    def not_a_table() -> dict[str, int]:
        return {"a": 1}

    @dg.asset(deps=[])
    def reader_of(orders: pa.Table) -> int:
        return orders.num_rows

    with dagster_instance() as instance:
        bad = dg.materialize([not_a_table], resources={"io_manager": io_manager},
                             instance=instance, raise_on_error=False)
        assert not bad.success
        with pytest.raises(UnsupportedOutput, match=r"got builtins\.dict"):
            dg.materialize([not_a_table], resources={"io_manager": io_manager},
                           instance=instance)
        with pytest.raises(AssetNotStored, match="orders: nothing stored yet"):
            dg.materialize([orders, reader_of], resources={"io_manager": io_manager},
                           instance=instance, selection=[reader_of])


def test_encoding_round_trips_every_common_arrow_type() -> None:
    table = pa.table({
        "b": pa.array([True, None, False]), "i8": pa.array([-1, None, 7], pa.int8()),
        "u64": pa.array([2**64 - 1, 0, None], pa.uint64()),
        "f16": pa.array([1.5, None, -0.0], pa.float64()),
        "s": pa.array(["é", "", None], pa.large_string()),
        "bin": pa.array([b"\x00\x01", None, b""], pa.binary()),
        "fsb": pa.array([b"ab", b"cd", None], pa.binary(2)),
        "t": pa.array([1, None, 3], pa.time64("us")),
        "dur": pa.array([5, 6, None], pa.duration("ms")),
        "st": pa.array([{"x": 1, "y": "a"}, None, {"x": None, "y": None}]),
        "m": pa.array([[("k", 1)], None, []], pa.map_(pa.string(), pa.int64())),
    }).replace_schema_metadata({"owner": "analytics"})
    contents = contents_for(table)
    back = table_from_contents([(k, v, d) for (k, v), d in contents.items()], "test")
    assert back.schema == table.schema and back.schema.metadata == {b"owner": b"analytics"}
    key = lambda r: repr(r)  # noqa: E731
    assert sorted(back.to_pylist(), key=key) == sorted(table.to_pylist(), key=key)
    # Deterministic: the same rows encode to the same records (so rewrites are diffs).
    assert contents_for(table.slice(1)) == contents_for(
        pa.Table.from_pylist(table.slice(1).to_pylist(), schema=table.schema))


def test_persist_client_is_importable_without_dagster() -> None:
    import subprocess
    import sys

    code = ("import sys, persist_pipeline; from persist_pipeline import PersistClient; "
            "assert 'dagster' not in sys.modules, 'persist_pipeline imported dagster'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert PersistClient is not None


def test_the_documented_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snippet of docs/pipeline.md ("The IO manager in your own Dagster project")
    runs as printed, on the embedded default instead of S3."""
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "pipeline.md").read_text()
    section = doc.split("## The IO manager in your own Dagster project", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    source = code.group(1).replace('"s3://bucket/prefix?region=eu-west-1"',
                                   f'"file://{tmp_path}/blobs"')
    assert f"file://{tmp_path}/blobs" in source
    monkeypatch.setenv("PERSIST_CONSENSUS_URI", f"sqlite:///{tmp_path}/consensus.db")
    namespace: dict[str, Any] = {}
    exec(compile(source, "docs/pipeline.md", "exec"), namespace)
    defs = namespace["defs"]
    job = defs.resolve_implicit_global_asset_job_def()
    with dagster_instance() as instance:
        result = job.execute_in_process(instance=instance)
        assert result.success
        assert result.output_for_node("order_total").to_pylist() == [{"total": 12.5}]
        first = result.output_for_node("first_orders")
        assert isinstance(first, pd.DataFrame) and list(first["id"]) == [1, 2]


def test_the_documented_duckdb_read_returns_the_stored_table(tmp_path: Path) -> None:
    """The DuckDB query docs/pipeline.md shows for reading an asset's shard returns the
    table the asset stored last: a row its second materialization changed is retracted
    in the shard (its old version sums to 0) and must not come back as a row."""
    import re
    import textwrap

    import duckdb

    from persist_pipeline.tables import store_table

    doc = (Path(__file__).resolve().parent.parent / "docs" / "pipeline.md").read_text()
    section = doc.split("## The IO manager in your own Dagster project", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    block = textwrap.dedent(next(b for b in blocks if "duckdb" in b))
    sql = re.search(r"duckdb\.sql\((.*?)\)\.show\(\)", block, re.S)
    assert sql is not None
    with PersistClient.open(f"sqlite:///{tmp_path}/c.db", f"file://{tmp_path}/b") as client:
        store_table(client, "sales/orders", pa.table({"id": [1, 2], "amount": [9.5, 3.0]}))
        store_table(client, "sales/orders", pa.table({"id": [1, 2], "amount": [9.5, 4.0]}))
        reader = client.open_reader(client.resolve("sales/orders"))
        with reader.snapshot_plan("latest") as plan:
            dataset = plan.to_dataset()  # noqa: F841 (the query's table, by name)
            rows = duckdb.sql(eval(f"({sql.group(1)})", {"plan": plan})).fetchall()
        reader.expire()
    assert sorted(rows) == [(1, 9.5, 1), (2, 4.0, 1)]


def test_column_schema_carries_types_nullability_and_descriptions() -> None:
    from persist_pipeline.dagster_io.io_manager import column_schema

    schema = column_schema(pa.schema([
        pa.field("id", pa.int64(), nullable=False, metadata={"description": "order id"}),
        pa.field("note", pa.large_string())]))
    first, second = schema.columns
    assert (first.name, first.type, first.description) == ("id", "int64", "order id")
    assert first.constraints.nullable is False and second.constraints.nullable is True
    assert (second.type, second.description) == ("large_string", None)
