"""The typed row encoding against a model: decode(encode(rows)) == rows, and two rows
encode to the same bytes exactly when they are equal (nulls included; one NaN; -0.0 is 0.0).

Schemas and rows are drawn by hypothesis over every supported type, nested lists and
structs included; the model of equality is Python equality of the normalized rows.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_pipeline import InvalidInput, ShardSchema
from persist_pipeline.exceptions import CorruptPart, InvalidUpdates, SchemaMismatch
from persist_pipeline.internal import rowcodec
from tests.helpers import examples

_LEAF_TYPES: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    (pa.int8(), st.integers(-128, 127)),
    (pa.int64(), st.integers(-(1 << 63), (1 << 63) - 1)),
    (pa.uint32(), st.integers(0, (1 << 32) - 1)),
    (pa.uint64(), st.integers(0, (1 << 64) - 1)),
    (pa.float32(), st.floats(width=32, allow_nan=True)),
    (pa.float64(), st.floats(allow_nan=True)),
    (pa.bool_(), st.booleans()),
    (pa.string(), st.text(max_size=8)),
    (pa.large_string(), st.text(max_size=4)),
    (pa.binary(), st.binary(max_size=8)),
    (pa.binary(3), st.binary(min_size=3, max_size=3)),
    (pa.decimal128(12, 3), st.decimals(min_value=-10**8, max_value=10**8, places=3,
                                       allow_nan=False, allow_infinity=False)),
    (pa.date32(), st.dates()),
    (pa.timestamp("us", tz="UTC"), st.integers(-(1 << 50), 1 << 50)),
    (pa.timestamp("ns"), st.integers(-(1 << 62), 1 << 62)),
    (pa.time64("us"), st.integers(0, 86_400_000_000 - 1)),
    (pa.duration("ms"), st.integers(-(1 << 40), 1 << 40)),
]


def _column(depth: int = 0) -> st.SearchStrategy[tuple[pa.DataType, st.SearchStrategy[Any]]]:
    leaf = st.sampled_from(_LEAF_TYPES)
    if depth >= 2:
        return leaf

    def as_list(inner: tuple[pa.DataType, st.SearchStrategy[Any]]) -> tuple[Any, Any]:
        type_, values = inner
        return pa.list_(type_), st.lists(st.none() | values, max_size=4)

    def as_struct(inners: list[tuple[pa.DataType, st.SearchStrategy[Any]]]) -> tuple[Any, Any]:
        fields = [pa.field(f"f{i}", t) for i, (t, _) in enumerate(inners)]
        values = st.fixed_dictionaries({f"f{i}": st.none() | v
                                        for i, (_, v) in enumerate(inners)})
        return pa.struct(fields), values

    nested = _column(depth + 1)
    return st.one_of(leaf, leaf, nested.map(as_list),
                     st.lists(nested, min_size=1, max_size=3).map(as_struct))


@st.composite
def _tables(draw: st.DrawFn) -> tuple[pa.Schema, list[dict[str, Any]]]:
    columns = draw(st.lists(_column(), min_size=1, max_size=4))
    schema = pa.schema([pa.field(f"c{i}", t) for i, (t, _) in enumerate(columns)])
    row = st.fixed_dictionaries({f"c{i}": st.none() | v for i, (_, v) in enumerate(columns)})
    rows = draw(st.lists(row, min_size=0, max_size=12))
    # Repeat some rows so that equal rows are common.
    if rows:
        rows += draw(st.lists(st.sampled_from(rows), max_size=6))
    return schema, rows


def _normal(value: Any) -> Any:
    """A value as the codec's equality sees it: one NaN, -0.0 == 0.0."""
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return 0.0 if value == 0 else value
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


def _roundtrip(schema: pa.Schema, table: pa.Table, *, strip: bool) -> list[pa.Array]:
    encoded = rowcodec.encode_rows(table.columns, table.num_rows, strip_trailing_nulls=strip)
    assert encoded.type == pa.binary()
    return rowcodec.decode_rows(encoded, schema, where="test", allow_missing_trailing=strip)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_tables(), st.booleans())
def test_decode_inverts_encode_and_equal_rows_encode_equal(
        case: tuple[pa.Schema, list[dict[str, Any]]], strip: bool) -> None:
    schema, rows = case
    table = pa.Table.from_pylist(rows, schema=schema)
    decoded = pa.Table.from_arrays(_roundtrip(schema, table, strip=strip), schema=schema)
    model = [_normal(r) for r in table.to_pylist()]
    assert [_normal(r) for r in decoded.to_pylist()] == model
    encoded = rowcodec.encode_rows(table.columns, table.num_rows,
                                   strip_trailing_nulls=strip).to_pylist()
    # The plain-Python path of small writes produces the very same bytes.
    assert rowcodec.encode_rows_list(table.columns, table.num_rows,
                                     strip_trailing_nulls=strip) == encoded
    for i in range(len(rows)):
        for j in range(len(rows)):
            same = model[i] == model[j]
            assert (encoded[i] == encoded[j]) == same, (rows[i], rows[j])


_FIXED_WIDTH_TYPES: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    *[(t, v) for t, v in _LEAF_TYPES if rowcodec._fixed_width(t) is not None],
    (pa.int16(), st.integers(-(1 << 15), (1 << 15) - 1)),
    (pa.uint8(), st.integers(0, 255)),
    (pa.uint16(), st.integers(0, (1 << 16) - 1)),
    (pa.int32(), st.integers(-(1 << 31), (1 << 31) - 1)),
    (pa.time32("s"), st.integers(0, 86_399)),
    (pa.date64(), st.dates()),
]


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_small_columns_without_nulls_encode_like_the_vectorized_path(data: st.DataObject
                                                                     ) -> None:
    # Small null-free fixed-width columns are read straight from their data buffer; a
    # slice (a non-zero offset) must read its own values and give the vectorized bytes.
    type_, values = data.draw(st.sampled_from(_FIXED_WIDTH_TYPES))
    rows = data.draw(st.lists(values, min_size=1, max_size=rowcodec._PER_VALUE_ROWS + 3))
    start = data.draw(st.integers(0, len(rows) - 1))
    column = pa.array(rows, type_).slice(start)
    if pa.types.is_timestamp(type_) or pa.types.is_duration(type_) or pa.types.is_time(type_):
        column = pa.array(rows, pa.int64() if type_.bit_width == 64 else pa.int32()
                          ).cast(type_).slice(start)
    expected = rowcodec.encode_rows([column], len(column), strip_trailing_nulls=False)
    assert rowcodec.encode_rows_list([column], len(column),
                                     strip_trailing_nulls=False) == expected.to_pylist()


@settings(max_examples=examples(50), deadline=None)
@given(_tables())
def test_sliced_and_chunked_inputs_encode_like_whole_ones(
        case: tuple[pa.Schema, list[dict[str, Any]]]) -> None:
    schema, rows = case
    if len(rows) < 3:
        return
    table = pa.Table.from_pylist(rows, schema=schema)
    whole = rowcodec.encode_rows(table.columns, table.num_rows, strip_trailing_nulls=True)
    sliced = table.slice(1, len(rows) - 2)
    part = rowcodec.encode_rows(sliced.columns, sliced.num_rows, strip_trailing_nulls=True)
    assert part.to_pylist() == whole.to_pylist()[1:-1]
    chunked = pa.concat_tables([table.slice(0, 2), table.slice(2)])
    again = rowcodec.encode_rows(chunked.columns, chunked.num_rows, strip_trailing_nulls=True)
    assert again.to_pylist() == whole.to_pylist()


def test_value_rows_written_before_a_column_was_added_equal_rows_with_null_there() -> None:
    old = pa.table({"a": pa.array([1, 2], pa.int32())})
    new = pa.table({"a": pa.array([1, 2], pa.int32()),
                    "b": pa.array([None, "x"], pa.string())})
    old_rows = rowcodec.encode_rows(old.columns, 2, strip_trailing_nulls=True).to_pylist()
    new_rows = rowcodec.encode_rows(new.columns, 2, strip_trailing_nulls=True).to_pylist()
    assert old_rows[0] == new_rows[0]
    assert old_rows[1] != new_rows[1]
    read = rowcodec.decode_rows(pa.array(old_rows, pa.binary()), new.schema, where="t",
                                allow_missing_trailing=True)
    assert read[1].to_pylist() == [None, None]


def test_single_fixed_width_keys_sort_numerically() -> None:
    values = [-(1 << 63), -5, -1, 0, 1, 7, (1 << 63) - 1]
    ints = rowcodec.encode_rows([pa.array(values, pa.int64())], len(values),
                                strip_trailing_nulls=False).to_pylist()
    assert ints == sorted(ints)
    floats = [-math.inf, -2.5, -1e-300, 0.0, 1e-300, 3.0, math.inf]
    enc = rowcodec.encode_rows([pa.array(floats, pa.float64())], len(floats),
                               strip_trailing_nulls=False).to_pylist()
    assert enc == sorted(enc)


def test_garbage_bytes_raise_corrupt_part_not_crash() -> None:
    schema = pa.schema([("a", pa.int64()), ("s", pa.string()), ("l", pa.list_(pa.int8()))])
    good = rowcodec.encode_rows(
        [pa.array([1]), pa.array(["xy"]), pa.array([[1, 2]], pa.list_(pa.int8()))], 1,
        strip_trailing_nulls=False).to_pylist()[0]
    bad = [good[:-1], good + b"\x00", b"\x02" + good[1:], good[:9] + b"\xff\xff\xff\xff",
           good[:9] + b"\x01\x00\x00\x00\x02\xff\xfe" + good[16:]]
    for row in bad:
        with pytest.raises(CorruptPart):
            rowcodec.decode_rows(pa.array([row], pa.binary()), schema, where="t",
                                 allow_missing_trailing=False)


def test_shard_schema_validation_and_evolution() -> None:
    key = pa.schema([("id", pa.int64())])
    with pytest.raises(InvalidInput, match="at least one key"):
        ShardSchema([], [("v", pa.string())])
    with pytest.raises(InvalidInput, match="reserved"):
        ShardSchema(key, [("t", pa.string())])
    with pytest.raises(InvalidInput, match="twice"):
        ShardSchema(key, [("id", pa.string())])
    with pytest.raises(InvalidInput, match="not supported"):
        ShardSchema(key, [("m", pa.map_(pa.string(), pa.int8()))])
    with pytest.raises(InvalidInput, match="float16"):
        ShardSchema(key, [("h", pa.float16())])
    base = ShardSchema(key, [("a", pa.string())])
    assert ShardSchema.from_bytes(base.to_bytes()) == base
    added = ShardSchema(key, [("a", pa.string()), ("b", pa.float64())])
    assert base.evolve(added) == added
    assert added.evolve(base) == added  # an older writer keeps the newer schema
    with pytest.raises(SchemaMismatch, match="nullable"):
        base.evolve(ShardSchema(key, [("a", pa.string()), pa.field("b", pa.int8(), False)]))
    with pytest.raises(SchemaMismatch, match="keys cannot change"):
        base.evolve(ShardSchema([("id", pa.int32())], [("a", pa.string())]))
    with pytest.raises(SchemaMismatch, match="value column 'a'"):
        base.evolve(ShardSchema(key, [("a", pa.large_string())]))


def test_typed_tables_are_checked_before_anything_is_encoded() -> None:
    schema = ShardSchema([pa.field("id", pa.int64(), nullable=False)],
                         [("name", pa.string()), ("n", pa.int32())])
    ok = schema.encode(pa.table({"id": [1], "name": ["a"], "t": [0]}))
    assert ok.column("d").to_pylist() == [1]
    with pytest.raises(SchemaMismatch, match="no column 'id'"):
        schema.encode(pa.table({"name": ["a"], "t": [0]}))
    with pytest.raises(SchemaMismatch, match="not in the shard's schema"):
        schema.encode(pa.table({"id": [1], "extra": [1], "t": [0]}))
    with pytest.raises(InvalidUpdates, match="not nullable"):
        schema.encode(pa.table({"id": pa.array([None], pa.int64()), "t": [0]}))
    with pytest.raises(SchemaMismatch, match="does not cast"):
        schema.encode(pa.table({"id": ["x"], "t": [0]}))
    with pytest.raises(InvalidUpdates, match="needs a t column"):
        schema.encode(pa.table({"id": [1]}))
    with pytest.raises(SchemaMismatch, match="does not cast"):
        schema.encode(pa.table({"id": [1], "n": [1 << 40], "t": [0]}))
    rows = schema.encode([{"id": 3, "name": "x", "t": 2, "d": -1}])
    back = schema.decode(rows).to_pylist()
    assert back == [{"id": 3, "name": "x", "n": None, "t": 2, "d": -1}]
