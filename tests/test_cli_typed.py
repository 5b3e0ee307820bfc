"""The CLI on typed shards, in process (``cli.main``): new-shard --schema (JSON or a
Parquet file's schema), append with the shard's current upper by default, a missing
shard refused unless --create, typed inline rows in ``plan``, extra columns refused."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_pipeline import PersistClient, ShardId, ShardSchema, cli


@pytest.fixture
def env(tmp_path: Path) -> list[str]:
    return ["--consensus", f"sqlite:///{tmp_path / 'c.db'}", "--blob", f"file://{tmp_path / 'b'}"]


def _run(env: list[str], capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main([*env, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _id_name_shard(env: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """A new typed shard keyed by ``id`` (int64) with a ``name`` (string); its id."""
    schema = json.dumps({"key": {"id": "int64"}, "value": {"name": "string"}})
    code, out, err = _run(env, capsys, "new-shard", "--schema", schema)
    assert code == 0, err
    return out.strip()


def _client(tmp_path: Path) -> PersistClient:
    return PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")


def test_new_shard_with_a_json_schema_then_appends_at_the_current_upper(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    schema = json.dumps({"key": {"id": "int64 not null"},
                         "value": {"name": "string", "at": "timestamp[us, tz=UTC]"}})
    code, out, err = _run(env, capsys, "new-shard", "--name", "people", "--schema", schema)
    assert code == 0, err
    shard = out.strip()
    with _client(tmp_path) as client:
        assert client.schema(shard) == ShardSchema(
            [pa.field("id", pa.int64(), False)],
            [("name", pa.string()), ("at", pa.timestamp("us", "UTC"))])
    rows = tmp_path / "people.csv"
    rows.write_text("id,name,at,t\n1,ann,2026-11-25T10:00:00Z,3\n2,bob,,5\n")
    code, out, err = _run(env, capsys, "append", "people", str(rows))
    assert code == 0, err
    assert json.loads(out)["upper"] == 6  # expected 0 (current), new one past t=5
    rows.write_text("id,name,at,t\n3,cy,,6\n")
    code, out, err = _run(env, capsys, "append", "people", str(rows))
    assert code == 0 and json.loads(out)["upper"] == 7, err
    # plan prints the inline rows with their columns, not hex.
    code, out, err = _run(env, capsys, "plan", "people")
    plan = json.loads(out)
    assert code == 0 and "ShardSchema" in plan["schema"]
    assert sorted(r["name"] for r in plan["inline"]) == ["ann", "bob", "cy"]
    assert {r["id"] for r in plan["inline"]} == {1, 2, 3}
    assert any(r["at"] == "2026-11-25T10:00:00+00:00" for r in plan["inline"])


def test_appending_a_file_without_rows_advances_the_upper_by_one(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # As --help says: the default new upper is at least one past the expected one, so a
    # header-only export (nothing happened in that interval) still marks progress.
    shard = _id_name_shard(env, capsys)
    empty = tmp_path / "empty.csv"
    empty.write_text("id,name,t\n")
    code, out, err = _run(env, capsys, "append", shard, str(empty))
    assert code == 0, err
    assert json.loads(out)["upper"] == 1 and json.loads(out)["updates"] == 0
    code, out, err = _run(env, capsys, "append", shard, str(empty))
    assert code == 0 and json.loads(out)["upper"] == 2, err


def test_a_tables_old_generation_is_read_by_its_name_with_a_note_and_latest_by_default(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from persist_pipeline import tables

    with _client(tmp_path) as client:
        tables.store_table(client, "sales", pa.table({"id": [1], "amt": [1.5]}), ["id"])
        # Another type for amt: a new generation, sales/_v2, which loads read.
        tables.store_table(client, "sales", pa.table({"id": [2], "amt": ["x"]}), ["id"])
    code, out, err = _run(env, capsys, "snapshot", "sales")  # --as-of latest by default
    assert code == 0, err
    # The first generation, as named: its row unchanged, at its latest time (its upper
    # moved by one, an empty append, when the second generation was first written, so
    # that no store of several tables can commit into it any more).
    assert out.splitlines()[1:] == ["1,1.5,1,1"]
    assert "newest generation is 'sales/_v2'" in err
    code, out, err = _run(env, capsys, "snapshot", "sales", "--as-of", "0")
    assert code == 0 and out.splitlines()[1:] == ["1,1.5,0,1"], err
    code, out, err = _run(env, capsys, "snapshot", "sales/_v2")
    assert code == 0 and err == "", err
    assert out.splitlines()[1:] == ['2,"x",0,1']
    code, out, err = _run(env, capsys, "inspect", "sales")
    assert code == 0 and json.loads(out)["upper"] == 2 and "sales/_v2" in err


def test_new_shard_takes_a_parquet_files_schema_with_keys(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    sample = tmp_path / "sample.parquet"
    pq.write_table(pa.table({"sku": ["a"], "qty": pa.array([1], pa.int32()),
                             "tags": pa.array([["x"]], pa.list_(pa.string()))}), sample)
    code, out, err = _run(env, capsys, "new-shard", "--schema", str(sample), "--key", "sku")
    assert code == 0, err
    with _client(tmp_path) as client:
        schema = client.schema(out.strip())
    assert schema is not None and schema.key.names == ["sku"]
    assert schema.value.names == ["qty", "tags"]
    code, _, err = _run(env, capsys, "new-shard", "--schema", str(sample), "--key", "nope")
    assert code == 2 and "not columns" in err


def test_new_shard_takes_the_schema_of_a_rows_file_without_its_times_and_diffs(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # A typed shard's rows file (as snapshot --out writes and append takes) holds t and
    # d besides the shard's columns: the schema made from it is the shard's own, and
    # the same file then appends into it.
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"sku": ["a", "b"], "qty": pa.array([1, 2], pa.int32()),
                             "t": pa.array([0, 1], pa.int64()),
                             "d": pa.array([1, 1], pa.int64())}), rows)
    code, out, err = _run(env, capsys, "new-shard", "--name", "stock", "--schema", str(rows),
                          "--key", "sku")
    assert code == 0, err
    with _client(tmp_path) as client:
        schema = client.schema(out.strip())
    assert schema is not None and schema.key.names == ["sku"]
    assert schema.value.names == ["qty"]
    code, out, err = _run(env, capsys, "append", "stock", str(rows))
    assert code == 0 and json.loads(out)["updates"] == 2, err
    code, _, err = _run(env, capsys, "new-shard", "--schema", str(rows), "--key", "t")
    assert code == 2 and "not columns" in err


@pytest.mark.parametrize("bad", ['{"key": {"id": "int65"}}', '{"value": {}}', "not json",
                                 '{"key": {"id": 5}}'])
def test_bad_schemas_are_refused_and_create_nothing(env: list[str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    bad: str):
    code, _, err = _run(env, capsys, "new-shard", "--schema", bad)
    assert code == 2 and "invalid input" in err
    assert not (tmp_path / "c.db").exists() or _client(tmp_path).list_shards() == []


def test_append_to_a_shard_that_does_not_exist_needs_create(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    rows = tmp_path / "u.jsonl"
    rows.write_text('{"k": "a", "v": "b", "t": 0, "d": 1}\n')
    shard = str(ShardId.new())
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 1 and "--create" in err
    code, out, err = _run(env, capsys, "append", shard, str(rows), "--create")
    assert code == 0 and json.loads(out)["upper"] == 1, err


def test_typed_append_refuses_columns_outside_the_schema(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    shard = _id_name_shard(env, capsys)
    rows = tmp_path / "extra.csv"
    rows.write_text("id,name,surprise,t\n1,ann,zzz,0\n")
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 2 and "surprise" in err
    with _client(tmp_path) as client:
        assert client.inspect(shard)["upper"] == 0


def test_a_typed_json_lines_row_may_leave_out_what_an_untyped_one_may(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A JSON Lines row of a typed shard, like an untyped one's, may leave out ``d``
    (1) and a nullable value column (null), or give null for them, on any line, not
    only as the first line does (Spark's JSON writer leaves null fields out); a column
    outside the schema is still refused, wherever it first appears."""
    shard = _id_name_shard(env, capsys)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 1, "t": 0}\n'
                    '{"id": 2, "name": "bob", "t": 0, "d": 2}\n'
                    '{"id": 3, "name": null, "t": 1, "d": null}\n')
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 0, err
    with _client(tmp_path) as client, client.open_reader(shard) as reader:
        got = sorted(tuple(r.values()) for r in reader.snapshot(1).to_pylist())
    assert got == [(1, None, 1, 1), (2, "bob", 1, 2), (3, None, 1, 1)]
    rows.write_text('{"id": 4, "t": 2}\n{"id": 5, "t": 2, "surprise": 1}\n')
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 2 and "surprise" in err
    with _client(tmp_path) as client:
        assert client.inspect(shard)["upper"] == 2


@pytest.mark.parametrize(("file", "text", "says"), [
    ("no_t.csv", "id,name\n1,ann\n", "needs a t column"),
    ("number.jsonl", "1\n", "not a JSON object"),
    ("null.jsonl", "null\n{\"id\": 1, \"name\": \"a\", \"t\": 0}\n", "not a JSON object"),
])
def test_a_typed_file_that_is_not_rows_is_one_line_and_changes_nothing(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], file: str,
        text: str, says: str):
    shard = _id_name_shard(env, capsys)
    rows = tmp_path / file
    rows.write_text(text)
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 2 and says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    with _client(tmp_path) as client:
        assert client.inspect(shard)["upper"] == 0


@pytest.mark.parametrize("seconds", ["nan", "inf", "-1"])
def test_plan_refuses_hold_seconds_that_are_not_a_finite_wait(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], seconds: str):
    code, out, _ = _run(env, capsys, "new-shard")
    code, out, err = _run(env, capsys, "plan", out.strip(), "--hold-seconds", seconds)
    assert code == 2 and "--hold-seconds" in err and out == ""


def test_a_row_at_the_largest_time_needs_the_shard_closed(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    shard = _id_name_shard(env, capsys)
    rows = tmp_path / "last.csv"
    rows.write_text(f"id,name,t\n1,ann,{(1 << 63) - 1}\n")
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 2 and "--new-upper closed" in err
    with _client(tmp_path) as client:
        assert client.inspect(shard)["upper"] == 0
    code, out, err = _run(env, capsys, "append", shard, str(rows), "--new-upper", "closed")
    assert code == 0 and json.loads(out)["upper"] is None, err


def test_a_schema_file_that_is_missing_or_a_folder_is_named_so(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code, _, err = _run(env, capsys, "new-shard", "--schema", str(tmp_path / "nosuch.json"))
    assert code == 2 and "nosuch.json: no such file" in err and "Expecting" not in err
    (tmp_path / "adir.json").mkdir()
    code, _, err = _run(env, capsys, "new-shard", "--schema", str(tmp_path / "adir.json"))
    assert code == 2 and "adir.json: is a folder, not a file" in err
    (tmp_path / "adir.parquet").mkdir()
    code, _, err = _run(env, capsys, "new-shard", "--schema", str(tmp_path / "adir.parquet"))
    assert code == 2 and "adir.parquet: is a folder, not a file" in err
    (tmp_path / "broken.json").write_text("{not json")
    code, _, err = _run(env, capsys, "new-shard", "--schema", str(tmp_path / "broken.json"))
    assert code == 2 and "broken.json: not valid JSON" in err
    code, _, err = _run(env, capsys, "new-shard", "--schema", "{not json")
    assert code == 2 and "neither" in err
    assert not (tmp_path / "c.db").exists() or _client(tmp_path).list_shards() == []


def test_a_typed_binary_column_round_trips_through_csv(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """What ``snapshot --out x.csv`` writes, ``append x.csv`` reads back as the same
    values: a binary column of UTF-8 text is written as that text (as ``k`` and ``v``
    are), and one that is not UTF-8 throughout is written as hex, said on stderr."""
    schema = json.dumps({"key": {"id": "int64"}, "value": {"blob": "binary"}})
    for name in ("src", "dst", "raw"):
        code, _, err = _run(env, capsys, "new-shard", "--name", name, "--schema", schema)
        assert code == 0, err
    rows = tmp_path / "rows.csv"
    rows.write_text("id,blob,t\n1,caf\u00e9,0\n2,,0\n")
    assert _run(env, capsys, "append", "src", str(rows))[0] == 0
    out = tmp_path / "out.csv"
    code, _, err = _run(env, capsys, "snapshot", "src", "--as-of", "latest",
                          "--out", str(out))
    assert code == 0, err
    assert "hex" not in err
    assert _run(env, capsys, "append", "dst", str(out))[0] == 0
    with _client(tmp_path) as client:
        got = {r["id"]: r["blob"] for r in client.open_reader(client.resolve("dst"))
               .snapshot("latest").to_pylist()}
    assert got == {1: "caf\u00e9".encode(), 2: None}
    # Bytes that are not UTF-8 cannot be CSV text: hex, and stderr says so.
    with _client(tmp_path) as client:
        writer = client.open_writer(client.resolve("raw"))
        writer.compare_and_append(pa.table({"id": [1], "blob": pa.array([b"\x00\xff"]),
                                            "t": [0]}), 0, 1)
        writer.expire()
    code, _, err = _run(env, capsys, "snapshot", "raw", "--as-of", "latest",
                          "--out", str(out))
    assert code == 0 and "blob" in err and "hex" in err
    assert "00ff" in out.read_text()


def _csv_round_trip(tmp_path: Path, schema: ShardSchema,
                    table: pa.Table) -> tuple[pa.Table, pa.Table]:
    """``table`` written to typed shard ``src``, snapshotted to CSV by the CLI and the CSV
    appended by the CLI to shard ``dst`` of the same schema: both snapshots, by id."""
    import os

    from tests.helpers import run_cli

    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    with PersistClient.open(consensus, blob) as client:
        for name in ("src", "dst"):
            writer = client.open_writer(client.resolve(name, create=True), schema=schema)
            if name == "src":
                writer.compare_and_append(table, 0, 1)
            writer.expire()
    env = dict(os.environ, PERSIST_CONSENSUS_URI=consensus, PERSIST_BLOB_URI=blob)
    out = tmp_path / "src.csv"
    done = run_cli(env, "snapshot", "src", "--as-of", "0", "--out", str(out))
    assert done.returncode == 0, done.stderr
    done = run_cli(env, "append", "dst", str(out))
    assert done.returncode == 0, done.stderr
    with PersistClient.open(consensus, blob) as client:
        src, dst = (client.open_reader(client.resolve(name)) for name in ("src", "dst"))
        want, got = src.snapshot(0).sort_by("id"), dst.snapshot(0).sort_by("id")
        src.expire()
        dst.expire()
    return want, got


def test_a_csv_snapshot_of_binary_columns_appends_back_as_the_same_bytes(
        tmp_path: Path) -> None:
    """The CLI writes a typed binary column as text where UTF-8 "so a CSV snapshot
    appends back as the same bytes": empty bytes and text Arrow's CSV reader takes
    for null (NULL, NaN, #N/A, ...) must not come back as null."""
    schema = ShardSchema({"id": pa.int64()}, {"blob": pa.binary(), "s": pa.string()})
    values = [b"plain", b"", None, b"NULL", b"null", b"NaN", b"#N/A", b"N/A"]
    strings = [None if v is None else v.decode() for v in values]
    n = len(values)
    table = pa.table({"id": pa.array(range(n), pa.int64()),
                      "blob": pa.array(values, pa.binary()),
                      "s": pa.array(strings, pa.string()),
                      "t": pa.array([0] * n, pa.int64()), "d": pa.array([1] * n, pa.int64())})
    _want, got = _csv_round_trip(tmp_path, schema, table)
    assert got.column("blob").to_pylist() == values
    assert got.column("s").to_pylist() == strings


def test_a_csv_with_list_or_struct_columns_is_refused_naming_them(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    schema = ShardSchema([("id", pa.int64())], [("tags", pa.list_(pa.string())),
                                                ("at", pa.struct([("x", pa.int64())]))])
    with _client(tmp_path) as client:
        shard = client.resolve("tagged", create=True)
        writer = client.open_writer(shard, schema=schema)
        writer.compare_and_append(pa.table({"id": [1], "tags": [["a"]], "at": [{"x": 1}],
                                            "t": [0]}), 0, 1)
        writer.expire()
    out = tmp_path / "tagged.csv"
    code, _, err = _run(env, capsys, "snapshot", "tagged", "--as-of", "0", "--out", str(out))
    assert code == 0, err
    # The snapshot's JSON text is for reading: appending it back says which columns a
    # CSV cannot hold and where to take them from, and writes nothing.
    code, _, err = _run(env, capsys, "append", "tagged", str(out))
    assert code == 2 and "['tags', 'at']" in err and "Parquet or JSON Lines" in err
    with _client(tmp_path) as client:
        assert client.inspect(shard)["upper"] == 1
    # Without them (nullable: left out, null) a CSV appends.
    out.write_text("id,t\n2,1\n")
    code, _, err = _run(env, capsys, "append", "tagged", str(out))
    assert code == 0, err


def test_a_csv_snapshot_of_float_columns_appends_back_as_the_same_values(
        tmp_path: Path) -> None:
    """NaN is a value, not a null: a CSV snapshot wrote it as ``nan`` unquoted, which
    ``append`` (Arrow's CSV reader) reads as null, so NaN came back as null. Every
    other float (infinities, extremes, float32's own values) and null come back too."""
    import math

    schema = ShardSchema({"id": pa.int64()}, {"f": pa.float64(), "g": pa.float32()})
    values = [float("nan"), None, float("inf"), -float("inf"), 1e-300, 0.1, -2.5, 5e-324]
    narrow = [float("nan"), None, float("inf"), -float("inf"), 1e-30, 0.1, -2.5, 3e38]
    n = len(values)
    table = pa.table({"id": pa.array(range(n), pa.int64()),
                      "f": pa.array(values, pa.float64()),
                      "g": pa.array(narrow, pa.float32()),
                      "t": pa.array([0] * n, pa.int64())})
    want, got = _csv_round_trip(tmp_path, schema, table)

    def shown(column: pa.ChunkedArray) -> list[object]:
        return ["nan" if isinstance(v, float) and math.isnan(v) else v
                for v in column.to_pylist()]

    assert shown(want.column("f"))[0] == "nan"
    for name in ("f", "g"):
        assert shown(got.column(name)) == shown(want.column(name))


def test_a_json_schema_naming_a_column_no_utf8_text_holds_is_bad_input(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """JSON may escape a lone surrogate (``"\\ud800"``), which no column name (UTF-8
    text) holds: ``new-shard --schema`` says so (exit 2) and creates nothing; it raised
    UnicodeEncodeError from pyarrow, a traceback."""
    from persist_pipeline.exceptions import InvalidInput

    with pytest.raises(InvalidInput, match="surrogate"):
        ShardSchema.from_json({"key": {"\ud800": "int64"}, "value": {}})
    schema = '{"key": {"id": "int64"}, "value": {"x\\udfff": "string"}}'
    code, _, err = _run(env, capsys, "new-shard", "--name", "odd", "--schema", schema)
    assert code == 2 and "surrogate" in err, err
    with _client(tmp_path) as client:
        assert client.shard_names() == {} and client.list_shards() == []


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
@pytest.mark.parametrize("value", ["1e40", "-1e40", "1e-50"])
def test_append_of_a_float_a_float32_column_cannot_hold_is_refused_as_by_the_api(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str,
        value: str) -> None:
    """A text file's number out of a float32 column's range was parsed straight to
    float32 (infinity, or zero) and stored, while the Python API refuses the same value
    (SchemaMismatch, nothing written): one entry point stored what another refuses.
    Bad input changes nothing, whichever entry point it comes through."""
    from persist_pipeline.exceptions import SchemaMismatch

    schema = ShardSchema({"id": pa.int64()}, {"g": pa.float32()})
    with _client(tmp_path) as client:
        shard = client.resolve("narrow", create=True)
        with client.open_writer(shard, schema=schema) as writer, \
                pytest.raises(SchemaMismatch, match="does not fit float"):
            writer.compare_and_append(pa.table({"id": [1], "g": [float(value)], "t": [0]}),
                                      0, 1)
    rows = tmp_path / f"rows.{fmt}"
    rows.write_text(f"id,g,t\n1,{value},0\n" if fmt == "csv"
                    else f'{{"id": 1, "g": {value}, "t": 0}}\n')
    code, _, err = _run(env, capsys, "append", "narrow", str(rows))
    assert code == 2 and "does not fit float" in err, err
    with _client(tmp_path) as client:
        state = client.inspect(shard)
        assert state["upper"] == 0, state


def test_a_hand_written_csv_keeps_unquoted_words_that_look_like_null(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """CSV writers other than the CLI (pandas' to_csv, Excel, spreadsheets) quote no
    text: a country code ``NA`` or the word ``null`` is text in a typed shard's string
    column, as it is in an untyped shard's ``k`` and ``v``; only an empty cell is null.
    A marker where a number or time must be is bad input naming its line, nothing
    written, rather than a null nobody wrote."""
    shard = _id_name_shard(env, capsys)
    words = ["NA", "N/A", "null", "NULL", "nan", "NaN", "#N/A", "-nan", "None"]
    rows = tmp_path / "words.csv"
    rows.write_text("id,name,t\n" + "".join(f"{i},{w},0\n" for i, w in enumerate(words))
                    + f"{len(words)},,0\n")
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 0, err
    with _client(tmp_path) as client:
        reader = client.open_reader(shard)
        got = reader.snapshot(0).sort_by("id").column("name").to_pylist()
        reader.expire()
    assert got == [*words, None]
    bad = tmp_path / "bad.csv"
    bad.write_text("id,name,t\n20,x,1\nNA,y,1\n")
    code, _, err = _run(env, capsys, "append", shard, str(bad))
    assert code == 2 and "line 3" in err and "'NA'" in err, err
    with _client(tmp_path) as client:
        assert client.inspect(shard)["upper"] == 1


def test_a_json_lines_time_without_its_columns_zone_is_refused_as_in_csv(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A JSON Lines timestamp without a zone offset into a column with a zone (or one
    with an offset into a column without) is refused naming its line, nothing written,
    as a CSV cell is: Arrow's JSON reader took the wall clock for UTC and dropped an
    offset. A time with an offset into a zoned column is that instant."""
    schema = json.dumps({"key": {"id": "int64"},
                         "value": {"at": "timestamp[us, tz=UTC]", "local": "timestamp[ms]"}})
    code, out, err = _run(env, capsys, "new-shard", "--schema", schema)
    assert code == 0, err
    shard = out.strip()
    rows = tmp_path / "rows.jsonl"
    for line, column in [('{"id": 2, "t": 0, "at": "2024-01-02 03:04:05"}', "at"),
                         ('{"id": 2, "t": 0, "local": "2024-01-02T03:04:05Z"}', "local"),
                         ('{"id": 2, "t": 0, "at": "2024-01-02"}', "at")]:
        rows.write_text('{"id": 1, "t": 0}\n\n' + line + "\n")
        code, _, err = _run(env, capsys, "append", shard, str(rows))
        assert code == 2 and "line 3" in err and f"column {column}" in err, err
        with _client(tmp_path) as client:
            assert client.inspect(shard)["upper"] == 0
    rows.write_text('{"id": 1, "t": 0, "at": "2024-01-02T03:04:05+02:00", '
                    '"local": "2024-01-02 03:04:05.5"}\n')
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 0, err
    with _client(tmp_path) as client:
        reader = client.open_reader(shard)
        row = reader.snapshot(0).to_pylist()[0]
        reader.expire()
    assert row["at"].isoformat() == "2024-01-02T01:04:05+00:00"
    assert row["local"].isoformat() == "2024-01-02T03:04:05.500000"


def test_a_json_lines_date_is_its_iso_text_as_in_csv(
        env: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A date column's JSON Lines value is its ISO text, as a CSV cell and Spark's JSON
    writer give it (Arrow's JSON reader refused "2024-01-02" and took a number for days
    since 1970); a number there is refused naming its line, nothing written."""
    schema = json.dumps({"key": {"id": "int64"}, "value": {"day": "date32"}})
    code, out, err = _run(env, capsys, "new-shard", "--schema", schema)
    assert code == 0, err
    shard = out.strip()
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 1, "t": 0, "day": "2024-01-02"}\n{"id": 2, "t": 0, "day": 19000}\n')
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 2 and "line 2: column day must be date32[day], got 19000" in err, err
    with _client(tmp_path) as client:
        assert client.inspect(shard)["upper"] == 0
    rows.write_text('{"id": 1, "t": 0, "day": "2024-01-02"}\n{"id": 2, "t": 0, "day": null}\n')
    code, _, err = _run(env, capsys, "append", shard, str(rows))
    assert code == 0, err
    with _client(tmp_path) as client:
        reader = client.open_reader(shard)
        got = reader.snapshot(0).sort_by("id").column("day").to_pylist()
        reader.expire()
    assert [d and d.isoformat() for d in got] == ["2024-01-02", None]


def test_json_lines_times_inside_lists_and_structs_parse_as_top_level_ones(
        tmp_path: Path) -> None:
    """A list's or struct's timestamps and dates are read as top-level ones are: a time
    without an offset in a zoned list is refused naming its line, a date's ISO text in
    a struct is that date."""
    from persist_pipeline.exceptions import InvalidInput
    from persist_pipeline.ingest import read_typed_file

    schema = ShardSchema({"id": pa.int64()}, {"ats": pa.list_(pa.timestamp("us", "UTC")),
                                              "s": pa.struct([("d", pa.date32())])})
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 1, "t": 0, "ats": ["2024-01-02T03:04:05Z"], '
                    '"s": {"d": "2024-01-02"}}\n'
                    '{"id": 2, "t": 0, "ats": ["2024-01-02T03:04:05Z", "2024-01-02 03:04:05"]}\n')
    with pytest.raises(InvalidInput, match="line 2: column ats must be"):
        read_typed_file(rows, schema)
    rows.write_text('{"id": 1, "t": 0, "ats": ["2024-01-02T03:04:05+01:00"], '
                    '"s": {"d": "2024-01-02"}}\n{"id": 2, "t": 0}\n')
    table = read_typed_file(rows, schema)
    assert table.schema.field("ats").type == pa.list_(pa.timestamp("us", "UTC"))
    assert table.column("ats").to_pylist()[0][0].isoformat() == "2024-01-02T02:04:05+00:00"
    assert table.column("s").to_pylist()[0]["d"].isoformat() == "2024-01-02"
    assert table.column("s").to_pylist()[1] is None
