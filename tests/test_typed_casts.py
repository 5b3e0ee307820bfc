"""Typed writes cast columns to the shard's types only where no value changes beyond
rounding: floats narrowed out of their range, or into a decimal's scale, are refused
and nothing is written (Arrow's own safe cast lets both through)."""

from __future__ import annotations

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
