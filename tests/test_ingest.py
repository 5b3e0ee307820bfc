"""Reading landed files (:mod:`persist_pipeline.ingest`) with a route column.

Covers: each format returns k/v/t/d plus the route column, in file order; a missing,
empty, null or non-text route value is an error naming the file and row and returns
nothing; the route column cannot be one of the updates' own columns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_pipeline.exceptions import InvalidInput, InvalidUpdates
from persist_pipeline.ingest import read_csv, read_typed_file, read_updates_file, route_schema

ROWS = [{"k": "a", "v": "1", "t": 0, "table": "orders"},
        {"k": "b", "v": "2", "t": 1, "d": -1, "table": "refunds"}]


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    if path.suffix == ".csv":
        columns = ["k", "v", "t", "d", "table"]
        lines = [",".join(columns)] + [",".join(str(r.get(c, "")) for c in columns)
                                       for r in rows]
        path.write_text("\n".join(lines) + "\n")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist([{"d": 1, **r} for r in rows]), path)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_route_column_is_returned_beside_the_updates(tmp_path: Path, suffix: str) -> None:
    table = read_updates_file(_write(tmp_path / f"f{suffix}", ROWS), route="table")
    assert table.schema == route_schema("table")
    assert table.to_pylist() == [
        {"k": b"a", "v": b"1", "t": 0, "d": 1, "table": "orders"},
        {"k": b"b", "v": b"2", "t": 1, "d": -1, "table": "refunds"}]
    # Without a route, the same file reads as plain updates (the column is ignored).
    assert read_updates_file(tmp_path / f"f{suffix}").column_names == ["k", "v", "t", "d"]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_row_without_a_route_value_is_an_error(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path / f"f{suffix}", [ROWS[0], {**ROWS[1], "table": ""}])
    with pytest.raises(InvalidUpdates, match=r"(line 3|line 2|row 2): column table must "
                                             r"name a shard"):
        read_updates_file(path, route="table")


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_file_without_the_route_column_is_an_error(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path / f"f{suffix}", [{k: v for k, v in r.items() if k != "table"}
                                            for r in ROWS])
    with pytest.raises(InvalidUpdates, match=str(path)) as info:
        read_updates_file(path, route="table")
    assert "table" in str(info.value)


def test_a_non_text_or_null_route_value_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "f.jsonl", [ROWS[0], {**ROWS[1], "table": 7}])
    with pytest.raises(InvalidUpdates, match="line 2: column table must name a shard, got 7"):
        read_updates_file(path, route="table")
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"k": ["a"], "v": ["1"], "t": [0],
                             "table": pa.array([None], pa.string())}), path)
    with pytest.raises(InvalidUpdates, match="row 1: column table is null"):
        read_updates_file(path, route="table")


@pytest.mark.parametrize("column", ["k", "v", "t", "d"])
def test_the_route_column_cannot_be_an_update_column(tmp_path: Path, column: str) -> None:
    path = _write(tmp_path / "f.csv", ROWS)
    with pytest.raises(InvalidInput, match="the route column cannot be"):
        read_updates_file(path, route=column)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_folder_or_a_missing_file_is_named_for_what_it_is(tmp_path: Path,
                                                            suffix: str) -> None:
    from persist_pipeline.schema import ShardSchema

    schema = ShardSchema([("id", pa.int64())], [])
    folder = tmp_path / f"somedir{suffix}"
    folder.mkdir()
    for read in (read_updates_file, lambda p: read_typed_file(p, schema)):
        with pytest.raises(InvalidUpdates, match=r"somedir.*: is a folder, not a file"):
            read(folder)
        with pytest.raises(InvalidUpdates, match=r"nosuch.*: no such file"):
            read(tmp_path / f"nosuch{suffix}")


def test_a_bad_typed_csv_row_is_reported_with_its_line(tmp_path: Path) -> None:
    """A typed CSV cell that does not convert names the file, the line (counting blank
    lines and quoted line breaks as the file's own lines), the column and the value."""
    from persist_pipeline.schema import ShardSchema

    schema = ShardSchema([("id", pa.int64())], [("name", pa.string())])
    bad = tmp_path / "typedbad.csv"
    bad.write_text('id,name,t\n1,a,0\n\n2,"b\nc",0\n3,d,1\nx,e,0\n')
    with pytest.raises(InvalidUpdates) as info:
        read_typed_file(bad, schema)
    message = str(info.value)
    assert message.startswith(f"{bad}: line 7: column id"), message
    assert "'x'" in message and "int64" in message
    late = tmp_path / "late_t.csv"
    late.write_text("id,name,t\n" + "".join(f"{i},n,0\n" for i in range(3000)) + "5,n,soon\n")
    with pytest.raises(InvalidUpdates, match=r"late_t\.csv: line 3002: column t .*'soon'"):
        read_typed_file(late, schema)
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("id,name,t\n1,a,0\n2,b,0,9\n")
    with pytest.raises(InvalidUpdates, match=r"ragged\.csv: line 3: 4 fields, the header "
                                             r"has 3"):
        read_typed_file(ragged, schema)


def test_a_bad_typed_json_line_is_reported_with_its_line(tmp_path: Path) -> None:
    """A typed JSON Lines value of the wrong type names the file, the line (counting
    blank lines; Arrow's own message counts rows from 0 within a block), the column and
    the value, as for CSV."""
    from persist_pipeline.schema import ShardSchema

    schema = ShardSchema([("id", pa.int64())], [("name", pa.string())])
    bad = tmp_path / "typedbad.jsonl"
    bad.write_text('{"id": 1, "name": "a", "t": 0}\n\n{"id": 2, "name": "b", "t": 0}\n'
                   '{"id": "x", "name": "e", "t": 0}\n')
    with pytest.raises(InvalidUpdates) as info:
        read_typed_file(bad, schema)
    assert str(info.value) == f'{bad}: line 4: column id must be int64, got "x"'
    late = tmp_path / "late_t.jsonl"
    late.write_text("".join(json.dumps({"id": i, "name": "n" * 20, "t": 0}) + "\n"
                            for i in range(40000)) + '{"id": 5, "name": "n", "t": "soon"}\n')
    with pytest.raises(InvalidUpdates, match=r'late_t\.jsonl: line 40001: column t must be '
                                             r'int64, got "soon"$'):
        read_typed_file(late, schema)
    wrong = tmp_path / "wrong_name.jsonl"
    wrong.write_text('{"id": 1, "name": 7, "t": 0}\n')
    with pytest.raises(InvalidUpdates, match=r"line 1: column name must be string, got 7$"):
        read_typed_file(wrong, schema)


@pytest.mark.parametrize("suffix", ["csv", "jsonl"])
def test_a_bad_narrow_float_cell_names_the_schemas_type(tmp_path: Path, suffix: str) -> None:
    """A float32 column's text is parsed as float64 (so a value out of float32's range
    is refused, not stored as infinity), but a cell that is no number is reported
    against the schema's type: the user declared float, never double."""
    from persist_pipeline.schema import ShardSchema

    schema = ShardSchema([("id", pa.int64())], [("x", pa.float32()), ("n", pa.int32())])
    bad = tmp_path / f"narrow.{suffix}"
    bad.write_text("id,x,n,t\n1,1.5,2,0\n2,abc,3,0\n" if suffix == "csv" else
                   '{"id": 1, "x": 1.5, "n": 2, "t": 0}\n{"id": 2, "x": "abc", "n": 3, "t": 0}\n')
    line = 3 if suffix == "csv" else 2  # a CSV file's first line is its header
    with pytest.raises(InvalidUpdates, match=rf"line {line}: column x must be float, got "):
        read_typed_file(bad, schema)


def test_a_csv_with_a_byte_order_mark_reads_like_one_without(tmp_path: Path) -> None:
    """Excel writes UTF-8 CSV with a BOM: the header's first name is k, not '\\ufeffk'."""
    path = tmp_path / "excel.csv"
    path.write_bytes("k,v,t\nalice,signup,0\n".encode("utf-8-sig"))
    table = read_updates_file(path)
    assert table.to_pylist() == [{"k": b"alice", "v": b"signup", "t": 0, "d": 1}]
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes('{"k": "a", "v": "b", "t": 1}\n'.encode("utf-8-sig"))
    assert read_updates_file(jsonl).column("t").to_pylist() == [1]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_column_besides_k_v_t_d_is_refused_by_name(tmp_path: Path, suffix: str) -> None:
    """With extra_columns=False (the CLI's append), as compare_and_append refuses a table
    with extra columns, a file's extra column is refused, not dropped; a route column,
    when there is one, is expected."""
    rows = [{"k": "a", "v": "1", "t": 0, "d": 1, "note": "x", "amount": 3}]
    path = tmp_path / f"extra{suffix}"
    if suffix == ".csv":
        path.write_text("k,v,t,d,note,amount\na,1,0,1,x,3\n")
    elif suffix == ".jsonl":
        path.write_text('{"k": "a", "v": "1", "t": 0}\n' + json.dumps(rows[0]) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(InvalidUpdates, match=r"extra.*: .*column\(s\) note, amount") as info:
        read_updates_file(path, extra_columns=False)
    if suffix == ".jsonl":
        assert "line 2" in str(info.value)
    assert read_updates_file(path).column_names == ["k", "v", "t", "d"]  # the default
    routed = _write(tmp_path / f"routed{suffix}", ROWS)
    assert read_updates_file(routed, route="table", extra_columns=False).num_rows == 2
    with pytest.raises(InvalidUpdates, match="table"):
        read_updates_file(routed, extra_columns=False)  # a route column, none expected


@pytest.mark.parametrize(("line", "column"), [
    ('{"k": "a", "v": "b", "t": "21"}', "t"),
    ('{"k": "a", "v": "b", "t": 1, "d": "-1"}', "d"),
    ('{"k": "a", "v": "b", "t": 1, "d": ""}', "d"),
    ('{"k": "a", "v": "b", "t": 2.0}', "t"),
])
def test_jsonl_times_and_diffs_are_json_integers(tmp_path: Path, line: str,
                                                 column: str) -> None:
    """A JSON Lines t or d must be a JSON integer: text is refused, as CSV refuses a
    cell that is not an integer, naming the line."""
    path = tmp_path / "u.jsonl"
    path.write_text('{"k": "a", "v": "b", "t": 0}\n' + line + "\n")
    with pytest.raises(InvalidUpdates, match=rf"u\.jsonl: line 2: column {column} must be "
                                             r"an integer"):
        read_updates_file(path)


@pytest.mark.parametrize("cell", ["1_000", "\u0661\u0662", "1e3", "0x10", "", "1.0"])
def test_an_untyped_csv_refuses_times_a_typed_csv_refuses(tmp_path: Path, cell: str) -> None:
    """A time cell is ASCII digits with an optional sign, as a typed CSV column reads it;
    Python's int() alone would take ``1_000`` and other scripts' digits."""
    path = tmp_path / "times.csv"
    path.write_text(f"k,v,t\na,1,5\nb,2,{cell}\n", encoding="utf-8")
    with pytest.raises(InvalidUpdates, match=r"line 3.*column t must be an integer"):
        read_csv(path)


def test_an_untyped_csv_reads_signed_and_padded_integers(tmp_path: Path) -> None:
    path = tmp_path / "times.csv"
    path.write_text("k,v,t,d\na,1, 7 ,-2\nb,2,+8,+3\n", encoding="utf-8")
    assert read_csv(path).to_pylist() == [
        {"k": b"a", "v": b"1", "t": 7, "d": -2}, {"k": b"b", "v": b"2", "t": 8, "d": 3}]


@pytest.mark.parametrize(("suffix", "text"), [
    (".csv", "k,v,t,t\na,1,0,5\n"),
    (".csv", "k,v,t,d,d\na,1,0,1,-1\n"),
    (".csv", "k,v,v,t\na,1,2,0\n"),
    (".jsonl", '{"k": "a", "v": "1", "t": 0, "t": 5}\n'),
    (".jsonl", '{"k": "a", "v": "1", "d": 1, "t": 0, "d": -1}\n'),
])
def test_an_untyped_file_repeating_a_column_is_refused_as_a_typed_one_is(
        tmp_path: Path, suffix: str, text: str) -> None:
    """A repeated k, v, t or d holds two readings of one row: a typed file (any format)
    and an untyped Parquet file are refused, so an untyped CSV or JSON Lines file is
    too, naming the column, rather than read as its last value."""
    path = tmp_path / f"updates{suffix}"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InvalidUpdates, match=r"line 1.*repeats column"):
        read_updates_file(path)
    with pytest.raises(InvalidUpdates, match=r"line 1.*repeats column"):
        read_updates_file(path, extra_columns=False)


def test_a_repeated_route_column_is_refused_and_a_repeated_ignored_one_is_not(
        tmp_path: Path) -> None:
    path = tmp_path / "routed.csv"
    path.write_text("k,v,t,to,to\na,1,0,x,y\n", encoding="utf-8")
    with pytest.raises(InvalidUpdates, match=r"line 1.*repeats column to"):
        read_updates_file(path, route="to")
    path.write_text("k,v,t,note,note\na,1,0,x,y\n", encoding="utf-8")
    assert read_updates_file(path).num_rows == 1


@pytest.mark.parametrize("line", [
    '{"k": "\\ud800", "v": "x", "t": 0}',
    '{"k": "a", "v": "x\\udfff", "t": 0}',
    '{"k": "a", "v": "x", "t": 0, "to": "\\ud800"}',
])
def test_a_json_string_that_is_no_utf8_text_is_a_bad_row(tmp_path: Path, line: str) -> None:
    """JSON may escape a lone surrogate (``"\\ud800"``), which no UTF-8 text holds: the
    row is refused naming its line, as other bad rows are; it raised UnicodeEncodeError
    (the CLI printed a traceback, ingestion failed with no file or line)."""
    path = tmp_path / "updates.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    route = "to" if '"to"' in line else None
    with pytest.raises(InvalidUpdates, match=r"line 1: column (k|v|to) .*surrogate"):
        read_updates_file(path, route=route)


def test_a_parquet_route_column_that_is_not_utf8_is_a_bad_file(tmp_path: Path) -> None:
    """Arrow checks no UTF-8 it reads from Parquet: a route column holding other bytes
    is refused naming it (InvalidUpdates); it raised UnicodeDecodeError. Keys and values
    are bytes, so a string k or v column is taken as its bytes, whatever they are."""
    raw = pa.array([b"a", b"\xff"], pa.binary())
    text = pa.Array.from_buffers(pa.string(), 2, raw.buffers())
    path = tmp_path / "routed.parquet"
    pq.write_table(pa.table({"k": raw, "v": raw, "t": [0, 0], "to": text}), path)
    with pytest.raises(InvalidUpdates, match="column to holds text that is not valid UTF-8"):
        read_updates_file(path, route="to")
    pq.write_table(pa.table({"k": text, "v": text, "t": [0, 0]}), path)
    assert read_updates_file(path).column("k").to_pylist() == [b"a", b"\xff"]
