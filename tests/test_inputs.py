"""What users hold is accepted wherever a k/v/t/d table is: pandas and polars DataFrames,
pyarrow RecordBatchReaders and Arrow streams; text keys and values are refused the same
way in tuples and in every kind of table, with a hint to encode them."""

from __future__ import annotations

import datetime
import decimal
from typing import Any

import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

from persist_pipeline import PersistClient, ShardId
from persist_pipeline.exceptions import InvalidUpdates
from tests.helpers import rows

UPDATES = [(b"b", b"2", 1, 1), (b"a", b"1", 0, 1), (b"a", b"1", 1, 2), (b"c", b"\xff", 2, -1)]
EXPECTED = [(b"a", b"1", 3), (b"b", b"2", 1), (b"c", b"\xff", -1)]


def _columns() -> dict[str, list[Any]]:
    return {"k": [u[0] for u in UPDATES], "v": [u[1] for u in UPDATES],
            "t": [u[2] for u in UPDATES], "d": [u[3] for u in UPDATES]}


def _arrow() -> pa.Table:
    return pa.table({"k": pa.array(_columns()["k"], pa.binary()),
                     "v": pa.array(_columns()["v"], pa.binary()),
                     "t": pa.array(_columns()["t"], pa.int64()),
                     "d": pa.array(_columns()["d"], pa.int64())})


FRAMES = {
    "pandas": lambda: pd.DataFrame(_columns()),
    "polars": lambda: pl.DataFrame(_columns()),
    "record-batch-reader": lambda: pa.RecordBatchReader.from_batches(
        _arrow().schema, _arrow().to_batches(max_chunksize=2)),
    "arrow-stream": lambda: _ArrowStream(_arrow()),
}


class _ArrowStream:
    """Any object exporting the Arrow C stream interface (as DuckDB results do)."""

    def __init__(self, table: pa.Table) -> None:
        self._table = table

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        return self._table.__arrow_c_stream__(requested_schema)


@pytest.fixture
def client() -> Any:
    c = PersistClient.open("mem://", "mem://")
    yield c
    c.close()


@pytest.mark.parametrize("kind", list(FRAMES))
def test_frames_and_streams_write_like_tables(client: PersistClient, kind: str) -> None:
    shard = ShardId.new()
    with client.open_writer(shard) as writer:
        writer.compare_and_append(FRAMES[kind](), 0, 3)
    with client.open_reader(shard) as reader:
        assert rows(reader.snapshot(2), 2) == EXPECTED


TEXT = {
    "tuples": lambda: [("a", b"1", 0, 1)],
    "tuple-value": lambda: [(b"a", "1", 0, 1)],
    "arrow": lambda: pa.table({"k": ["a"], "v": [b"1"], "t": [0], "d": [1]}),
    "arrow-large": lambda: pa.table({"k": pa.array([b"a"]), "v": pa.array(["1"],
                                     pa.large_string()), "t": [0], "d": [1]}),
    "arrow-dictionary": lambda: pa.table({"k": pa.array(["a"]).dictionary_encode(),
                                          "v": [b"1"], "t": [0], "d": [1]}),
    "pandas": lambda: pd.DataFrame({"k": ["a"], "v": [b"1"], "t": [0], "d": [1]}),
    "polars": lambda: pl.DataFrame({"k": [b"a"], "v": ["1"], "t": [0], "d": [1]}),
}


@pytest.mark.parametrize("kind", list(TEXT))
def test_text_keys_and_values_are_refused_alike(client: PersistClient, kind: str) -> None:
    shard = ShardId.new()
    with client.open_writer(shard) as writer:
        with pytest.raises(InvalidUpdates, match=r"bytes.*UTF-8|UTF-8.*bytes"):
            writer.compare_and_append(TEXT[kind](), 0, 1)
        assert writer.fetch_recent_upper() == 0  # nothing was written


def test_encoded_text_is_accepted(client: PersistClient) -> None:
    frame = pd.DataFrame({"k": ["a"], "v": ["1"], "t": [0], "d": [1]})
    frame["k"] = frame["k"].str.encode("utf-8")
    frame["v"] = frame["v"].str.encode("utf-8")
    polars_frame = pl.DataFrame({"k": ["b"], "v": ["2"], "t": [0], "d": [1]}).with_columns(
        pl.col("k").cast(pl.Binary), pl.col("v").cast(pl.Binary))
    shard = ShardId.new()
    with client.open_writer(shard) as writer:
        writer.compare_and_append(frame, 0, 1)
        writer.compare_and_append(polars_frame.with_columns(pl.lit(1).alias("t")), 1, 2)
    with client.open_reader(shard) as reader:
        assert rows(reader.snapshot(1), 1) == [(b"a", b"1", 1), (b"b", b"2", 1)]


def test_a_lazy_frame_and_bad_frames_get_clear_errors(client: PersistClient) -> None:
    shard = ShardId.new()
    with client.open_writer(shard) as writer:
        with pytest.raises(InvalidUpdates, match="collect"):
            writer.compare_and_append(pl.DataFrame(_columns()).lazy(), 0, 3)
        with pytest.raises(InvalidUpdates, match="columns k, v, t, d"):
            writer.compare_and_append(pd.DataFrame({"k": [b"a"], "v": [b"1"]}), 0, 3)
        with pytest.raises(InvalidUpdates, match="types"):
            writer.compare_and_append(pd.DataFrame({"k": [b"a"], "v": [b"1"], "t": [0.5],
                                                    "d": [1]}), 0, 3)
        assert writer.fetch_recent_upper() == 0


# Times and diffs are ints in tuples (a bool, a float, a Decimal or a datetime is refused
# there): a table column of any other type is refused alike, not cast into int64 (True as
# a diff of 1, 1.0 as a time, a timestamp as its count of nanoseconds).
NOT_INTEGERS = {
    "tuple-bool-diff": lambda: [(b"a", b"1", 0, True)],
    "tuple-float-time": lambda: [(b"a", b"1", 1.0, 1)],
    "tuple-decimal-diff": lambda: [(b"a", b"1", 0, decimal.Decimal(1))],
    "tuple-datetime-time": lambda: [(b"a", b"1", datetime.datetime(2024, 1, 2), 1)],
    "arrow-bool-diff": lambda: pa.table({"k": [b"a"], "v": [b"1"], "t": [0], "d": [True]}),
    "arrow-float-time": lambda: pa.table({"k": [b"a"], "v": [b"1"], "t": [1.0], "d": [1]}),
    "arrow-decimal-diff": lambda: pa.table({"k": [b"a"], "v": [b"1"], "t": [0],
                                            "d": pa.array([decimal.Decimal(1)])}),
    "arrow-timestamp-time": lambda: pa.table({"k": [b"a"], "v": [b"1"], "d": [1],
                                              "t": pa.array([datetime.datetime(2024, 1, 2)])}),
    "arrow-duration-time": lambda: pa.table({"k": [b"a"], "v": [b"1"], "d": [1],
                                             "t": pa.array([datetime.timedelta(seconds=1)])}),
    "pandas-datetime-time": lambda: pd.DataFrame({"k": [b"a"], "v": [b"1"], "d": [1],
                                                  "t": pd.to_datetime(["2024-01-02"])}),
    "polars-bool-diff": lambda: pl.DataFrame({"k": [b"a"], "v": [b"1"], "t": [0],
                                              "d": [True]}),
    # Past the small-write path: the wide table's own checks.
    "arrow-wide-float-time": lambda: pa.table({
        "k": [b"%d" % i for i in range(500)], "v": [b"1"] * 500,
        "t": [float(i) for i in range(500)], "d": [1] * 500}),
}


@pytest.mark.parametrize("kind", list(NOT_INTEGERS))
def test_times_and_diffs_that_are_not_integers_are_refused_alike(client: PersistClient,
                                                                  kind: str) -> None:
    shard = ShardId.new()
    with client.open_writer(shard) as writer:
        with pytest.raises(InvalidUpdates, match=r"\b(ts|diff|t|d)\b.*int"):
            writer.compare_and_append(NOT_INTEGERS[kind](), 0, 600)
        assert writer.fetch_recent_upper() == 0  # nothing was written


def test_integer_columns_of_any_width_are_taken(client: PersistClient) -> None:
    """Narrower and unsigned integers are ints: taken, as pandas' nullable Int64 is."""
    shard = ShardId.new()
    table = pa.table({"k": [b"a", b"b"], "v": [b"1", b"2"],
                      "t": pa.array([0, 1], pa.uint16()), "d": pa.array([1, -2], pa.int8())})
    frame = pd.DataFrame({"k": [b"c"], "v": [b"3"], "t": pd.array([2], "Int64"),
                          "d": pd.array([1], "Int32")})
    with client.open_writer(shard) as writer:
        writer.compare_and_append(table, 0, 2)
        writer.compare_and_append(frame, 2, 3)
    with client.open_reader(shard) as reader:
        assert rows(reader.snapshot(2), 2) == [(b"a", b"1", 1), (b"b", b"2", -2),
                                                (b"c", b"3", 1)]
