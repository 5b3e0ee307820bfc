"""Updates: validation, consolidation, and both part encodings, including corrupt input."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist_pipeline.exceptions import CorruptPart, InvalidUpdates
from persist_pipeline.updates import (
    SCHEMA,
    Updates,
    consolidate,
    decode_inline,
    decode_parquet,
    encode_parquet,
)
from tests.helpers import examples, expected_snapshot

update = st.tuples(st.binary(max_size=8), st.binary(max_size=8), st.integers(0, 20),
                   st.integers(-3, 3))


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(update, max_size=300), st.integers(0, 20))
def test_consolidation_matches_the_definition(updates, as_of):
    table = Updates.coerce(updates).table()
    snap = consolidate(table, as_of=as_of)
    assert sorted((r["k"], r["v"], r["d"]) for r in snap.to_pylist()) == \
        expected_snapshot(updates, as_of)
    assert set(snap.column("t").to_pylist()) <= {as_of}


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(update, max_size=300))
def test_both_encodings_round_trip_and_the_list_and_arrow_paths_agree(updates):
    small = Updates.coerce(updates)
    arrow = Updates.coerce(pa.Table.from_pylist(
        [{"k": k, "v": v, "t": t, "d": d} for k, v, t, d in updates], schema=SCHEMA))
    assert small.table().equals(arrow.table())
    assert decode_inline(small.encode_inline(), "t").equals(small.table())
    assert decode_parquet(encode_parquet(small.table()), "p").equals(small.table())


def test_consolidate_advances_times_to_since_and_drops_zeros():
    table = Updates.coerce([(b"a", b"", 1, 1), (b"a", b"", 3, -1), (b"b", b"", 9, 2)]).table()
    out = consolidate(table, since=5)
    assert out.to_pylist() == [{"k": b"b", "v": b"", "t": 9, "d": 2}]


def test_parquet_parts_are_plain_parquet_with_kvtd_columns():
    data = encode_parquet(Updates.coerce([(b"k", b"v", 3, 1)]).table())
    table = pq.read_table(io.BytesIO(data))
    assert table.schema.names == ["k", "v", "t", "d"]
    assert table.schema.field("t").type == pa.int64()


@pytest.mark.parametrize("data", [b"", b"garbage", b"PAR1\x00\x00PAR1", b"\xff" * 64])
def test_corrupt_parquet_is_a_corrupt_part_error_naming_the_part(data):
    with pytest.raises(CorruptPart, match="part-key"):
        decode_parquet(data, "part-key")


@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"\x0a\x05ab"])
def test_corrupt_inline_is_a_corrupt_part_error(data):
    with pytest.raises(CorruptPart, match="inline-7"):
        decode_inline(data, "inline-7")


@settings(max_examples=examples(200), deadline=None)
@given(st.binary(max_size=200))
def test_decoders_never_crash_on_arbitrary_bytes(data):
    for decode in (decode_inline, decode_parquet):
        try:
            table = decode(data, "fuzz")
        except CorruptPart:
            continue
        assert table.schema.names == ["k", "v", "t", "d"]


def test_diff_sums_beyond_64_bits_are_rejected():
    big = (1 << 63) - 1
    with pytest.raises(InvalidUpdates, match="64 bits"):
        Updates.coerce([(b"k", b"v", 0, big), (b"k", b"v", 0, big)])


def test_tables_with_nulls_or_negative_times_are_rejected():
    nulls = pa.table({"k": pa.array([None], pa.binary()), "v": [b"v"], "t": [0], "d": [1]})
    with pytest.raises(InvalidUpdates, match="null"):
        Updates.coerce(nulls)
    negative = pa.table({"k": [b"k"], "v": [b"v"], "t": [-1], "d": [1]})
    with pytest.raises(InvalidUpdates, match="non-negative"):
        Updates.coerce(negative)
    # A small table takes the plain-Python path; it names the offending row as tuples do.
    late = pa.table({"k": [b"a", b"b", b"c"], "v": [b"v"] * 3, "t": [0, 4, -2], "d": [1] * 3})
    with pytest.raises(InvalidUpdates, match=r"update #2: ts must be a non-negative"):
        Updates.coerce(late)


def test_small_tables_consolidate_like_tuples():
    rows = [(b"b", b"v", 1, 2), (b"a", b"v", 0, 1), (b"b", b"v", 1, -2), (b"a", b"v", 0, 4)]
    table = pa.table({"k": [r[0] for r in rows], "v": [r[1] for r in rows],
                      "t": [r[2] for r in rows], "d": [r[3] for r in rows]})
    assert Updates.coerce(table).table().to_pylist() == \
        Updates.coerce(rows).table().to_pylist() == [{"k": b"a", "v": b"v", "t": 0, "d": 5}]
