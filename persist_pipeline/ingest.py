"""Reading updates from files: Parquet, CSV and JSON Lines.

Every format carries columns ``k``, ``v``, ``t`` and optionally ``d`` (default 1); other
columns are ignored, or refused by name with ``extra_columns=False`` (as
``compare_and_append`` refuses a table's, and as the CLI's ``append`` and the
pipeline's landing ingestion do). In
CSV and JSONL, ``k`` and ``v`` are text (stored as UTF-8 bytes, a leading byte order mark
skipped) and ``t``/``d`` integers (in JSONL, JSON numbers, not text); in Parquet,
``k``/``v`` may be binary or string. A file whose rows go to several shards
also carries a *route column* (text, named by the caller) saying each row's shard; it is
returned as a fifth column. Errors name the file and line (or row) and nothing is
returned for a file with any bad row.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist_pipeline.exceptions import InvalidInput, InvalidUpdates
from persist_pipeline.frontier import MAX_TIME
from persist_pipeline.schema import replace_leaf_types
from persist_pipeline.updates import SCHEMA

if TYPE_CHECKING:
    from persist_pipeline.schema import ShardSchema

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl",
           ".ndjson": "jsonl"}
_DIFF_RANGE = (-(1 << 63), (1 << 63) - 1)
#: An integer written in a CSV cell: ASCII digits with an optional sign, as a typed CSV
#: column reads them. Python's ``int()`` also takes ``1_000`` and other scripts' digits,
#: which would make the untyped path accept cells the typed one refuses.
_CSV_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)


def with_default_diff(table: pa.Table) -> pa.Table:
    """``table`` of untyped updates with ``d`` = 1 in every row if it has no ``d`` column:
    the one default of every untyped write (the CLI's append, ingestion, a Spark write),
    as a typed write's (:meth:`~persist_pipeline.schema.ShardSchema.encode`)."""
    if "d" in table.column_names:
        return table
    return table.append_column("d", pa.array(np.ones(table.num_rows, np.int64)))


def detect_format(path: Path, fmt: str | None = None) -> str:
    if fmt:
        return fmt
    try:
        return FORMATS[path.suffix.lower()]
    except KeyError:
        raise InvalidUpdates(f"{path}: cannot tell the format from the extension "
                             f"{path.suffix!r}; use one of {sorted(FORMATS)}") from None


def path_problem(path: Path) -> str | None:
    """Why Arrow cannot open ``path`` whatever the file holds, or None: a name that is
    not UTF-8 (Arrow encodes every path as UTF-8 text and fails on one that is not)."""
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"its name is not valid UTF-8 (byte {e.start}), which Arrow cannot open; "
                f"rename it")
    return None


def file_problem(path: Path, *, arrow: bool = False) -> str | None:
    """Why ``path`` cannot be read as a file (``"no such file"``, ``"is a folder, not a
    file"``; with ``arrow``, a name Arrow cannot open), or None if it can be tried."""
    if path.is_dir():
        return "is a folder, not a file"
    if not path.exists():
        return "no such file"
    return path_problem(path) if arrow else None


def _check_file(path: Path, *, arrow: bool = False) -> None:
    problem = file_problem(path, arrow=arrow)
    if problem is not None:
        raise InvalidUpdates(f"{path}: {problem}")


def _int(value: Any, name: str, where: str, lo: int, hi: int, text: bool = True) -> int:
    """``value`` as an integer in ``[lo, hi]``; ``text``: it may be written as text (a CSV
    cell), else it must be an integer already (a JSON number)."""
    if isinstance(value, bool):
        raise InvalidUpdates(f"{where}: column {name} must be an integer, got {value!r}")
    if isinstance(value, str) and not text:
        raise InvalidUpdates(f"{where}: column {name} must be an integer (a JSON number, "
                             f"not text), got {value[:40]!r}")
    if isinstance(value, str):
        if not _CSV_INTEGER.fullmatch(value.strip()):
            raise InvalidUpdates(f"{where}: column {name} must be an integer, "
                                 f"got {value[:40]!r}")
        value = int(value.strip())
    if not isinstance(value, int):
        raise InvalidUpdates(f"{where}: column {name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidUpdates(f"{where}: column {name}={value} is out of range [{lo}, {hi}]")
    return value


def _text(value: Any, name: str, where: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidUpdates(f"{where}: column {name} must be text, got {value!r}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:
        # JSON may escape a lone surrogate ("\ud800"), which no UTF-8 text holds.
        raise InvalidUpdates(f"{where}: column {name} holds a lone surrogate "
                             f"({value[e.start]!r}), which is not UTF-8 text") from None


Row = tuple[bytes, bytes, int, int] | tuple[bytes, bytes, int, int, str]


def _row(record: dict[str, Any], where: str, route: str | None = None,
         from_json: bool = False) -> Row:
    """One update of a CSV record (every cell text) or, with ``from_json``, of a JSON object
    (``t`` and ``d`` must be JSON integers; ``d`` may be null or absent)."""
    required = ("k", "v", "t") if route is None else ("k", "v", "t", route)
    missing = [c for c in required if c not in record or record[c] is None]
    if missing:
        raise InvalidUpdates(f"{where}: missing column(s) {', '.join(missing)}")
    d = record.get("d", 1)
    d = 1 if d is None or (d == "" and not from_json) else d
    row = (_text(record["k"], "k", where), _text(record["v"], "v", where),
           _int(record["t"], "t", where, 0, MAX_TIME, text=not from_json),
           _int(d, "d", where, *_DIFF_RANGE, text=not from_json))
    if route is None:
        return row
    value = record[route]
    if not isinstance(value, str) or not value:
        raise InvalidUpdates(f"{where}: column {route} must name a shard, got {value!r}")
    _text(value, route, where)
    return (*row, value)


def route_schema(route: str | None) -> pa.Schema:
    """The columns the readers return: k/v/t/d, and the route column if there is one."""
    return SCHEMA if route is None else SCHEMA.append(pa.field(route, pa.string(), False))


def _table(rows: list[Row], route: str | None = None) -> pa.Table:
    schema = route_schema(route)
    cols: list[tuple[Any, ...]] = (list(zip(*rows, strict=True)) if rows
                                   else [()] * len(schema))
    return pa.Table.from_arrays(
        [pa.array(list(col), field.type) for col, field in zip(cols, schema, strict=True)],
        schema=schema)


def _check_route_column(route: str | None) -> None:
    if route is not None and route in SCHEMA.names:
        raise InvalidInput(f"the route column cannot be {route!r}: k, v, t and d are the "
                           "updates' own columns")


def _needed(route: str | None) -> str:
    return "k, v, t" + (f", {route}" if route else "")


def _check_no_extra(columns: Any, where: str, route: str | None, extra_ok: bool) -> None:
    """Unless ``extra_ok``, refuse columns besides k, v, t, d (and the route column): as
    compare_and_append refuses a table with extra columns, a file's are refused rather
    than dropped."""
    if extra_ok:
        return
    allowed = set(SCHEMA.names) | ({route} if route else set())
    extra = [str(c) for c in columns if c not in allowed]
    if extra:
        raise InvalidUpdates(f"{where}: unexpected column(s) {', '.join(extra)}: an update "
                             f"file has columns {_needed(route)} and optionally d")


def _check_no_repeat(names: Sequence[str], where: str, route: str | None) -> None:
    """Refuse a column read as k, v, t, d (or the route) that ``names`` holds twice:
    its row would have two readings (a dict keeps the last), where a typed file and an
    untyped Parquet file are refused. Repeats of an ignored extra column are read by
    nothing."""
    used = set(SCHEMA.names) | ({route} if route else set())
    seen: set[str] = set()
    for name in names:
        if name in seen and name in used:
            raise InvalidUpdates(f"{where}: repeats column {name}: which one holds the "
                                 f"row's {name} cannot be told")
        seen.add(name)


def read_csv(path: Path, route: str | None = None, extra_ok: bool = True) -> pa.Table:
    rows = []
    # utf-8-sig: a byte order mark (Excel writes one) is not part of the first name.
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        needed = {"k", "v", "t"} | ({route} if route else set())
        if reader.fieldnames is None or not needed <= set(reader.fieldnames):
            raise InvalidUpdates(f"{path}: line 1: the header must name columns "
                                 f"{_needed(route)} (and optionally d); got "
                                 f"{reader.fieldnames}")
        _check_no_repeat(reader.fieldnames, f"{path}: line 1", route)
        _check_no_extra(reader.fieldnames, f"{path}: line 1", route, extra_ok)
        for record in reader:
            where = f"{path}: line {reader.line_num}"
            if None in record:
                raise InvalidUpdates(f"{where}: more fields than the header has")
            if any(record.get(c) is None for c in reader.fieldnames):
                raise InvalidUpdates(f"{where}: fewer fields than the header has")
            rows.append(_row(record, where, route))
    return _table(rows, route)


class _Pairs(dict[str, Any]):
    """A JSON object, with its names in order as the line gave them (repeats kept)."""

    names: list[str]


def _pairs(pairs: list[tuple[str, Any]]) -> _Pairs:
    out = _Pairs(pairs)
    out.names = [name for name, _ in pairs]
    return out


def read_jsonl(path: Path, route: str | None = None, extra_ok: bool = True) -> pa.Table:
    rows = []
    with path.open(encoding="utf-8-sig") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {n}"
            try:
                record = json.loads(line, object_pairs_hook=_pairs)
            except json.JSONDecodeError as e:
                raise InvalidUpdates(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(record, _Pairs):
                raise InvalidUpdates(f"{where}: each line must be a JSON object")
            _check_no_repeat(record.names, where, route)
            _check_no_extra(record, where, route, extra_ok)
            rows.append(_row(record, where, route, from_json=True))
    return _table(rows, route)


def read_parquet(path: Path, route: str | None = None, extra_ok: bool = True) -> pa.Table:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise InvalidUpdates(f"{path}: not a readable Parquet file: {e}") from None
    if not {"k", "v", "t"} | ({route} if route else set()) <= set(table.column_names):
        raise InvalidUpdates(f"{path}: needs columns {_needed(route)} (and optionally d); "
                             f"got {table.column_names}")
    _check_no_extra(table.column_names, str(path), route, extra_ok)
    table = with_default_diff(table)
    arrays = []
    schema = route_schema(route)
    for name, typ in zip(schema.names, schema.types, strict=True):
        col = table.column(name)
        try:
            arrays.append(col.cast(typ, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise InvalidUpdates(f"{path}: column {name} has type {col.type}, which cannot "
                                 f"be read as {typ}: {e}") from None
        if col.null_count:
            first = col.is_null().to_pylist().index(True)
            raise InvalidUpdates(f"{path}: row {first + 1}: column {name} is null")
    out = pa.Table.from_arrays(arrays, schema=schema)
    if route is not None:
        try:
            # Arrow checks no UTF-8 it reads from Parquet: a route naming no text.
            out.column(route).validate(full=True)
        except pa.ArrowInvalid as e:
            raise InvalidUpdates(f"{path}: column {route} holds text that is not valid "
                                 f"UTF-8: {e}") from None
        empty = pc.equal(out.column(route), "").to_pylist()
        if any(empty):
            raise InvalidUpdates(f"{path}: row {empty.index(True) + 1}: column {route} must "
                                 "name a shard, got ''")
    negative = [i for i, t in enumerate(out.column("t").to_pylist()) if t < 0]
    if negative:
        raise InvalidUpdates(f"{path}: row {negative[0] + 1}: column t is negative")
    return out


def read_updates_file(path: Path | str, fmt: str | None = None, *,
                      route: str | None = None, extra_columns: bool = True) -> pa.Table:
    """Read a file of updates into a k/v/t/d table; raises :class:`InvalidUpdates`.

    Args:
        route: the route column: each row's shard (non-empty text), returned as a fifth
            column of that name.
        extra_columns: False: a column besides k, v, t, d (and ``route``) is refused,
            named in the message; True: such columns are ignored.

    Raises:
        InvalidUpdates: no such file, a bad row (the message names file and line), or an
            extra column with ``extra_columns=False``.
        InvalidInput: ``route`` is one of k, v, t, d.
    """
    _check_route_column(route)
    path = Path(path)
    kind = detect_format(path, fmt)
    # CSV and JSON Lines are opened by Python, which takes any name; Parquet by Arrow.
    _check_file(path, arrow=kind == "parquet")
    try:
        if kind == "csv":
            return read_csv(path, route, extra_columns)
        if kind == "jsonl":
            return read_jsonl(path, route, extra_columns)
        return read_parquet(path, route, extra_columns)
    except UnicodeDecodeError as e:
        raise InvalidUpdates(f"{path}: not UTF-8 text (byte {e.start})") from None


def _first_bad_csv_row(path: Path, types: dict[str, pa.DataType],
                       named: Mapping[str, pa.DataType] | None = None) -> str | None:
    """Where a typed CSV read failed: ``"N: what"`` for the first row whose field count
    differs from the header's or whose cell does not convert to its column's type, or
    None if neither is found. Cells are converted by Arrow's cast of the text read
    with the same options, so the same cells are null."""
    import pyarrow.csv as pacsv

    texts = {name: pa.string() for name in types}
    try:
        try:
            text = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
                column_types=texts, null_values=_CSV_NULLS, strings_can_be_null=True,
                quoted_strings_can_be_null=False))
        except pa.ArrowInvalid:
            return _ragged_csv_row(path)
        return _first_bad_cell(path, text, types, named or types)
    except (UnicodeDecodeError, csv.Error, OSError):
        return None  # Arrow's own message, then


def _first_bad_cell(path: Path, text: pa.Table, types: dict[str, pa.DataType],
                    named: Mapping[str, pa.DataType]) -> str | None:
    first: tuple[int, str, str] | None = None  # (row, column, value)
    for name in text.column_names:
        if name not in types:
            continue
        column = text.column(name)
        row = _first_uncastable(column, types[name])
        if row is not None and (first is None or row < first[0]):
            first = (row, name, column[row].as_py())
    if first is None:
        return None
    row, name, value = first
    line = _csv_line_of_row(path, row)
    if line is None:
        return None
    return f"{line}: column {name} must be {named[name]}, got {value[:40]!r}"


def _first_uncastable(column: pa.ChunkedArray, type_: pa.DataType) -> int | None:
    """The index of the first value of ``column`` that does not cast to ``type_``: a
    binary search over prefixes, each cast vectorized."""

    def casts(length: int) -> bool:
        try:
            column.slice(0, length).cast(type_, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return False
        return True

    if casts(len(column)) or not casts(0):  # no bad value, or no cast to search with
        return None
    lo, hi = 0, len(column)  # casts(lo), not casts(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if casts(mid):
            lo = mid
        else:
            hi = mid
    return hi - 1


def _csv_records(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line, fields)`` of each non-blank record, the header first (Arrow skips blank
    lines too); ``line`` is where the record ends, as ``csv.reader`` counts."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        for record in reader:
            if record:
                yield reader.line_num, record


def _csv_line_of_row(path: Path, row: int) -> int | None:
    for index, (line, _) in enumerate(_csv_records(path)):
        if index == row + 1:
            return line
    return None


def _ragged_csv_row(path: Path) -> str | None:
    width: int | None = None
    for line, record in _csv_records(path):
        if width is None:
            width = len(record)
        elif len(record) != width:
            return f"{line}: {len(record)} fields, the header has {width}"
    return None


def _csv_header(path: Path) -> list[str]:
    """The column names in a CSV file's first line (none if it cannot be read)."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            return next(csv.reader(f), [])
    except (UnicodeDecodeError, csv.Error, OSError):
        return []  # the read itself says what is wrong


def _time_as_text(type_: pa.DataType) -> pa.DataType:
    """Timestamps and dates as text (read so, then cast); any other type as it is."""
    return pa.string() if pa.types.is_timestamp(type_) or pa.types.is_date(type_) else type_


def _json_times(path: Path, name: str, texts: pa.ChunkedArray, type_: pa.DataType
                ) -> pa.ChunkedArray:
    """A JSON Lines file's column ``name`` of timestamps or dates (or lists and structs
    holding them), read as text, parsed to ``type_`` by Arrow's cast as a CSV cell is
    (an offset where the column has a zone and none where it has none); else
    :class:`InvalidUpdates` naming the first refused value's line."""
    try:
        return pc.cast(texts, type_)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass

    def refused(value: object) -> bool:
        try:
            pc.cast(pa.array([value], texts.type), type_)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return True
        return False

    found = next(((i, v) for i, v in enumerate(texts.to_pylist())
                  if v is not None and refused(v)), None)
    if found is None:  # refused as a whole only: no line to name
        raise InvalidUpdates(f"{path}: column {name} cannot be read as {type_}")
    row, value = found
    with path.open(encoding="utf-8-sig") as f:
        line = [n for n, text in enumerate(f, start=1) if text.strip()][row]
    form = ("ISO text" if pa.types.is_date(type_) else
            f"a time {'with' if type_.tz else 'without'} a zone offset"
            if pa.types.is_timestamp(type_) else
            "dates and times as ISO text, with a zone offset where the type has a zone")
    raise InvalidUpdates(f"{path}: line {line}: column {name} must be {type_} ({form}), "
                         f"got {json.dumps(value)[:40]}")


def _first_bad_json_line(path: Path, explicit: pa.Schema, named: pa.Schema | None = None
                         ) -> str | None:
    """Where a typed JSON Lines read failed: ``"N: column C must be T, got V"`` for the
    first line holding a value Arrow's JSON reader does not read as its column's type,
    or None if none is found. Lines are read again by the same reader with the same
    schema (a thousand at a time, then one by one and column by column within a refused
    thousand), so a line is blamed only if Arrow refuses it (Arrow's own message counts
    rows from 0 within a block, not lines of the file). ``named``: the types the message
    names, when the file is read as others (times as text)."""
    import io

    import pyarrow.json as pajson

    def refused(lines: list[str], schema: pa.Schema) -> bool:
        try:
            # On the calling thread: a threaded read may leave pool tasks holding the
            # Python buffer, whose release at interpreter exit can abort the process
            # (as decode_parquet, see there).
            pajson.read_json(io.BytesIO("".join(lines).encode()),
                             read_options=pajson.ReadOptions(use_threads=False),
                             parse_options=pajson.ParseOptions(explicit_schema=schema))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
            return True
        return False

    def first_in(chunk: list[tuple[int, str]]) -> str | None:
        for n, line in chunk:
            if not refused([line], explicit):
                continue
            record = json.loads(line)
            for name, value in (record.items() if isinstance(record, dict) else ()):
                if name in explicit.names and refused(
                        [json.dumps({name: value}) + "\n"], pa.schema([explicit.field(name)])):
                    return (f"{n}: column {name} must be {(named or explicit).field(name).type}, "
                            f"got {json.dumps(value)[:40]}")
            return None  # the line is refused as a whole: Arrow's message, then
        return None

    try:
        with path.open(encoding="utf-8-sig") as f:
            chunk: list[tuple[int, str]] = []
            for n, line in enumerate(f, start=1):
                if line.strip():
                    chunk.append((n, line if line.endswith("\n") else line + "\n"))
                if len(chunk) == 1024:
                    if refused([text for _, text in chunk], explicit):
                        return first_in(chunk)
                    chunk = []
            if chunk and refused([text for _, text in chunk], explicit):
                return first_in(chunk)
    except (UnicodeDecodeError, json.JSONDecodeError, OSError):
        return None
    return None


def _json_lines_columns(path: Path, types: Mapping[str, pa.DataType]) -> set[str]:
    """The columns the lines of a typed JSON Lines file give, all of them in ``types``.

    Raises:
        InvalidUpdates: a line is not a JSON object, or gives a column outside ``types``
            (named, with its line).
    """
    present: set[str] = set()
    with path.open(encoding="utf-8-sig") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidUpdates(f"{path}: line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise InvalidUpdates(f"{path}: line {n} is not a JSON object: each line of "
                                     f"a typed JSON Lines file is one row's columns")
            extra = sorted(set(record) - set(types))
            if extra:
                raise InvalidUpdates(f"{path}: line {n}: {extra} are not columns of the "
                                     f"shard ({', '.join(types)})")
            present.update(record)
    return present


# The only null a CSV cell spells: an empty one, as the CLI's snapshot writes it.
# Arrow's default markers (NA, N/A, null, NULL, nan, #N/A, ...) would turn such words
# in a text column into nulls nobody wrote (an untyped file keeps them as text); in a
# number or time column they are then bad input, named with their line.
_CSV_NULLS = [""]


def _wide_float(type_: pa.DataType) -> pa.DataType:
    """float16 and float32 as float64; any other type as it is."""
    if pa.types.is_float16(type_) or pa.types.is_float32(type_):
        return pa.float64()
    return type_


def read_typed_file(path: Path | str, schema: ShardSchema, fmt: str | None = None) -> pa.Table:
    """Read a file of a typed shard's rows (its key and value columns, ``t``, optional
    ``d``), parsed to the schema's types; raises :class:`InvalidUpdates`.

    CSV and JSON Lines cells are parsed as the schema's column types (nested columns
    need Parquet or JSON Lines); the rows are checked by :meth:`ShardSchema.encode`. A
    CSV cell is null when it is empty and unquoted; a quoted one is text (``""`` the
    empty string), and so is every other cell of a text column (``NA``, ``null``).
    """
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson

    path = Path(path)
    kind = detect_format(path, fmt)
    _check_file(path, arrow=True)  # every format is opened by Arrow here
    # Text numbers are parsed as float64 where the column is a narrower float: parsed
    # straight to float32, one out of its range became infinity or zero unseen, a value
    # the API refuses; ShardSchema.encode's cast refuses it here too (bad input changes
    # nothing, whichever entry point it comes through).
    types = {f.name: replace_leaf_types(f.type, _wide_float) if kind != "parquet" else f.type
             for f in [*schema.key, *schema.value]}
    types.update({"t": pa.int64(), "d": pa.int64()})
    # What an error names: the schema's types, not the wider ones text is parsed as.
    declared = {f.name: f.type for f in [*schema.key, *schema.value]}
    declared.update({"t": pa.int64(), "d": pa.int64()})
    nested = [name for name in _csv_header(path) if name in types
              and pa.types.is_nested(types[name])] if kind == "csv" else []
    if nested:
        # Said up front: Arrow's CSV reader names no column, and the JSON text a CSV
        # snapshot writes for them is for reading, not a typed encoding to parse back.
        raise InvalidUpdates(f"{path}: column(s) {nested} of {schema!r} are lists or "
                             f"structs, which a CSV file cannot hold: append them from "
                             f"Parquet or JSON Lines (snapshot --out FILE.parquet)")
    try:
        if kind == "csv":
            # A quoted cell is text, never null: "" is empty and "NULL" the word (the
            # CLI's snapshot quotes every text cell and writes null as an empty one).
            table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
                column_types=types, null_values=_CSV_NULLS, strings_can_be_null=True,
                quoted_strings_can_be_null=False))
        elif kind == "jsonl":
            # Every column some line gives: a line may leave one out, as in an untyped
            # file (Spark's JSON writer leaves null fields out).
            present = _json_lines_columns(path, types)
            explicit = pa.schema([(n, t) for n, t in types.items() if n in present])
            # Timestamps and dates are read as text and parsed by Arrow's cast, as a CSV
            # cell is: the JSON reader took a time without an offset for UTC in a zoned
            # column, dropped an offset in a column without a zone, refused a date's
            # ISO text and took a number for days.
            # (also inside lists and structs).
            read_as = pa.schema([f.with_type(replace_leaf_types(f.type, _time_as_text))
                                 for f in explicit])
            times = [f.name for f in explicit if read_as.field(f.name).type != f.type]
            table = pajson.read_json(path, parse_options=pajson.ParseOptions(
                explicit_schema=read_as, unexpected_field_behavior="error"))
            for name in times:
                table = table.set_column(table.column_names.index(name), name,
                                         _json_times(path, name, table.column(name),
                                                     types[name]))
            if "d" in table.column_names and table.column("d").null_count:
                # d null or left out is 1, as in an untyped file.
                table = table.set_column(table.column_names.index("d"), "d",
                                         pc.fill_null(table.column("d"), 1))
        else:
            table = pq.read_table(path)
    except InvalidUpdates:
        raise  # says what is wrong with the file already
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, OSError) as e:
        # Arrow's CSV message names no line, its JSON message a row counted from 0 in a
        # block: a second pass (on the error path only) finds the first bad row, so the
        # error names its line as for untyped files.
        located = None
        if kind == "csv" and isinstance(e, pa.ArrowInvalid):
            located = _first_bad_csv_row(path, types, declared)
        elif kind == "jsonl" and isinstance(e, pa.ArrowInvalid):
            located = _first_bad_json_line(path, read_as, pa.schema(
                [f.with_type(declared[f.name]) for f in explicit]))
        if located is not None:
            raise InvalidUpdates(f"{path}: line {located}") from None
        raise InvalidUpdates(f"{path}: cannot read it as rows of {schema!r}: {e}") from None
    if "t" not in table.column_names:
        raise InvalidUpdates(f"{path}: a typed file needs a t column (each row's time) "
                             f"beside the columns of {schema!r}")
    return table
