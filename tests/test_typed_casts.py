"""Typed writes cast columns to the shard's types only where no value changes beyond
rounding: floats narrowed out of their range, or into a decimal's scale, are refused
and nothing is written (Arrow's own safe cast lets both through)."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pyarrow as pa
import pytest

from persist_pipeline import PersistClient, SchemaMismatch, ShardSchema

SCHEMA = ShardSchema([("id", pa.int64())], [("price", pa.decimal128(10, 2)),
                                            ("ratio", pa.float32())])


def _write(tmp_path: Path, rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """``rows`` (t = 0) written to a new typed shard; its contents after."""
    with PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}",
                            f"file://{tmp_path / 'b'}") as client:
        shard = client.resolve("casts", create=True)
        writer = client.open_writer(shard, schema=SCHEMA)
        try:
            writer.compare_and_append(pa.Table.from_pylist([{**r, "t": 0} for r in rows]),
                                      0, 1)
        finally:
            assert client.inspect(shard)["upper"] in (0, 1)
            writer.expire()
        return client.open_reader(shard).snapshot(0).drop_columns(["t", "d"]).to_pylist()


@pytest.mark.parametrize(("row", "stored_as"), [
    ({"id": 1, "price": 0.125, "ratio": 1.0}, "Decimal('0.12')"),
    ({"id": 1, "price": 1e-9, "ratio": 1.0}, "Decimal('0.00')"),
    ({"id": 1, "price": 1.0, "ratio": 1e300}, "inf"),
    ({"id": 1, "price": 1.0, "ratio": 1e-50}, "0.0"),
])
def test_a_float_that_would_be_stored_as_another_number_is_refused(
        tmp_path: Path, row: dict[str, object], stored_as: str) -> None:
    with pytest.raises(SchemaMismatch, match=re.escape(f"would be stored as {stored_as}")):
        _write(tmp_path, [{"id": 0, "price": 1.0, "ratio": 1.0}, row])
    with PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}",
                            f"file://{tmp_path / 'b'}") as client:
        assert client.inspect(client.resolve("casts"))["upper"] == 0  # nothing written


def test_floats_that_fit_are_stored_rounded_as_the_column_type_means(tmp_path: Path) -> None:
    got = _write(tmp_path, [{"id": 1, "price": 0.1, "ratio": 0.1},
                            {"id": 2, "price": 2.5, "ratio": float("inf")},
                            {"id": 3, "price": None, "ratio": float("nan")}])
    assert [str(r["price"]) for r in got] == ["0.10", "2.50", "None"]
    assert got[0]["ratio"] == pa.array([0.1], pa.float32())[0].as_py()
    assert got[1]["ratio"] == float("inf")


NAIVE = pa.timestamp("us")
AWARE = pa.timestamp("us", "Europe/Paris")


@pytest.mark.parametrize(("stored", "written"), [(AWARE, NAIVE), (NAIVE, AWARE)])
def test_a_timestamp_with_and_one_without_a_time_zone_are_not_taken_for_each_other(
        tmp_path: Path, stored: pa.DataType, written: pa.DataType) -> None:
    schema = ShardSchema([("id", pa.int64())], [("at", stored)])
    with PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}",
                            f"file://{tmp_path / 'b'}") as client:
        writer = client.open_writer(client.resolve("at", create=True), schema=schema)
        at = pa.array([1_700_000_000_000_000], written)
        with pytest.raises(SchemaMismatch, match="time zone"):
            writer.compare_and_append(pa.table({"id": [1], "at": at, "t": [0]}), 0, 1)
        # Nulls only carry no time to mistake.
        writer.compare_and_append(pa.table({"id": [1], "at": pa.nulls(1, written),
                                            "t": [0]}), 0, 1)
        got = client.open_reader(writer.shard_id).snapshot(0)
        assert got.column("at").type == stored and got.column("at").to_pylist() == [None]
        writer.expire()


def test_a_timestamp_in_another_time_zone_is_stored_as_the_same_instant(
        tmp_path: Path) -> None:
    schema = ShardSchema([("id", pa.int64())], [("at", AWARE)])
    with PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}",
                            f"file://{tmp_path / 'b'}") as client:
        writer = client.open_writer(client.resolve("at", create=True), schema=schema)
        at = pa.array([1_700_000_000_000_000], pa.timestamp("us", "UTC"))
        writer.compare_and_append(pa.table({"id": [1], "at": at, "t": [0]}), 0, 1)
        got = client.open_reader(writer.shard_id).snapshot(0).column("at")
        assert got.type == AWARE
        assert got.cast(pa.int64()).to_pylist() == [1_700_000_000_000_000]
        writer.expire()


@pytest.mark.parametrize("written", [NAIVE, AWARE])
def test_a_timestamp_is_not_cut_to_a_date(tmp_path: Path, written: pa.DataType) -> None:
    schema = ShardSchema([("id", pa.int64())], [("day", pa.date32())])
    noon = 1_767_268_800_000_000  # 2026-01-01 12:00 UTC
    with PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}",
                            f"file://{tmp_path / 'b'}") as client:
        writer = client.open_writer(client.resolve("days", create=True), schema=schema)
        # The time of day would be dropped (and an instant's day depends on its zone).
        refusal = "time zone" if written.tz else "does not fit date32"
        with pytest.raises(SchemaMismatch, match=refusal):
            writer.compare_and_append(pa.table({"id": [1], "day": pa.array(
                [noon], written), "t": [0]}), 0, 1)
        if written.tz is None:  # midnight is a whole day
            midnight = noon - 12 * 3600 * 1_000_000
            writer.compare_and_append(pa.table({"id": [1], "day": pa.array(
                [midnight], written), "t": [0]}), 0, 1)
            got = client.open_reader(writer.shard_id).snapshot(0).column("day")
            assert got.to_pylist() == [datetime.date(2026, 1, 1)]
        writer.expire()
