"""The persist-pipeline command (also: python -m persist_pipeline).

Global options --consensus URI --blob URI [--wal-blob URI] default to the PERSIST_*
environment variables. Every command taking a shard takes its id or a name registered
for it (new-shard --name, resolve --create); "names" lists them. Every error is printed
as one line on stderr with exit code 2 (bad input) or 1 (anything else); no stack
traces. Commands that only read, or need a shard that exists (compact, gc, append
without --create), create nothing: at a location without a store they fail ("no store
at ..."). "persist-pipeline COMMAND --help" shows a command's options
and examples.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from persist_pipeline.client import PersistClient
from persist_pipeline.exceptions import (
    InvalidFrontier,
    InvalidInput,
    InvalidShardId,
    InvalidShardName,
    InvalidUpdates,
    LeaseExpired,
    LocationNotFound,
    PersistError,
    ShardNameNotFound,
    ShardNotFound,
)
from persist_pipeline.frontier import MAX_TIME, Frontier
from persist_pipeline.ids import ShardId
from persist_pipeline.ingest import (
    file_problem,
    path_problem,
    read_typed_file,
    read_updates_file,
)
from persist_pipeline.read import ReadHandle
from persist_pipeline.schema import ShardSchema
from persist_pipeline.updates import SCHEMA, Updates
from persist_pipeline.write import check_append_bounds, check_new_shard_bounds, check_times


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's exit code 2 with our one-line style
        self.print_usage(sys.stderr)
        print(f"persist-pipeline: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _frontier(text: str) -> int | None:
    if text.lower() in ("closed", "none", "empty"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"times are non-negative: {value}")
    return value


def _time(text: str) -> int:
    value = _frontier(text)
    if value is None:
        raise argparse.ArgumentTypeError("a time is required here")
    return value


#: ``--new-upper`` not given (``None`` means ``closed``).
_UNSET: Any = object()


def _as_of(text: str) -> int | str:
    """A time, or ``latest``: the shard's latest complete time, upper - 1."""
    if text.strip().lower() == "latest":
        return "latest"
    return _time(text)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="persist-pipeline", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--consensus", metavar="URI", help="consensus URI (PERSIST_CONSENSUS_URI)")
    p.add_argument("--blob", metavar="URI", help="blob URI (PERSIST_BLOB_URI)")
    p.add_argument("--wal-blob", metavar="URI", help="WAL blob URI (PERSIST_WAL_BLOB_URI)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("shards", help="list shards with their summaries and pipeline names "
                       "(JSON)")
    s.add_argument("--config", type=Path,
                   help="pipeline config naming the shards (default: "
                        "$PERSIST_PIPELINE_CONFIG, else ./pipeline.yaml if present)")
    s = sub.add_parser("new-shard", help="create a shard and print its id")
    s.add_argument("--id", help="use this shard id instead of a fresh one")
    s.add_argument("--name", help="register this name for the shard; if the name is "
                   "registered already, its shard is the one created (and printed)")
    s.add_argument("--schema", help="make it a typed shard: a JSON schema (inline, or a "
                   ".json file), e.g. '{\"key\": {\"id\": \"int64\"}, \"value\": "
                   "{\"name\": \"string\"}}', or a Parquet file whose columns it takes "
                   "(with --key; its t and d columns, a rows file's times and diffs, are "
                   "left out)")
    s.add_argument("--key", action="append", default=[], metavar="COLUMN",
                   help="with a Parquet --schema: a key column (repeat for several; "
                        "default: every column is the key)")
    sub.add_parser("names", help="list registered shard names and their ids (JSON)")
    s = sub.add_parser("resolve", help="print the id of the shard registered under a name")
    s.add_argument("name")
    s.add_argument("--create", action="store_true",
                   help="if the name has no shard: register a fresh shard id under it and "
                        "create that shard (as new-shard --name does)")
    s = sub.add_parser("inspect", help="print a shard's state as JSON")
    s.add_argument("shard")
    s = sub.add_parser("append", help="compare_and_append a file (Parquet, CSV or JSONL)")
    s.add_argument("shard")
    s.add_argument("file", type=Path)
    s.add_argument("--expected-upper", type=_time,
                   help="the upper the shard must have (default: its current upper)")
    s.add_argument("--new-upper", type=_frontier, default=_UNSET,
                   help="new upper time, or 'closed' (default: one past the file's "
                        "largest time and at least one past the expected upper, so a "
                        "file without rows still advances the shard by one time)")
    s.add_argument("--create", action="store_true",
                   help="create the shard if it does not exist, registering the name "
                        "if SHARD is one (else a mistyped id or name is an error)")
    s.add_argument("--format", choices=["parquet", "csv", "jsonl"],
                   help="file format (default: from the extension)")
    s = sub.add_parser("snapshot", help="write the collection at --as-of (default: latest)")
    s.add_argument("shard")
    s.add_argument("--as-of", type=_as_of, default="latest",
                   help="a time, or 'latest' (default: the latest complete time, upper - 1)")
    s.add_argument("--out", type=Path, help="output .parquet or .csv (default: stdout, CSV; "
                                            "k and v as text, or hex where not UTF-8)")
    s = sub.add_parser("plan", help="print the read plan at --as-of as JSON: the live "
                       "Parquet files and the inline rows, for DuckDB, polars, Spark...")
    s.add_argument("shard")
    s.add_argument("--as-of", type=_as_of, default="latest",
                   help="a time, or 'latest' (default)")
    s.add_argument("--hold-seconds", type=float, default=0.0,
                   help="keep the files from GC this long after printing (the reader "
                        "heartbeats meanwhile; exit 1, LeaseExpired, if it was expired "
                        "during the hold); without it they are guaranteed only while "
                        "the command runs")
    s = sub.add_parser("compact", help="run pending merges and flush inline parts")
    s.add_argument("shard")
    s = sub.add_parser("gc", help="delete unreferenced blobs and truncate consensus")
    s.add_argument("shard")
    s = sub.add_parser("verify", help="check that every part and rollup the shards' states "
                       "reference is stored intact (JSON report; exit 1 if anything is "
                       "lost or damaged)")
    s.add_argument("shards", nargs="*", metavar="SHARD")
    s.add_argument("--all", action="store_true", help="every shard at the location")
    s.add_argument("--deep", action="store_true",
                   help="also fetch and decode every part and rollup and check its "
                        "contents (reads all the data; without it: one listing per store)")
    s = sub.add_parser("set-inline-max", help="record the shard's "
                       "persist_inline_update_max_bytes (every process inlines up to the "
                       "smaller of it and its own; 0: no inlining)")
    s.add_argument("shard")
    s.add_argument("max_bytes", metavar="BYTES", help="a non-negative number of bytes")
    s = sub.add_parser("nemesis", help="kill processes and inject faults while checking that "
                       "nothing acknowledged is lost (a fresh shard on the given location)")
    s.add_argument("--seconds", type=float, default=60.0)
    s.add_argument("--writers", type=int, default=3)
    s.add_argument("--readers", type=int, default=2)
    s.add_argument("--seed", type=int, help="reproduce an earlier run (default: random)")
    s.add_argument("--fault-rate", type=float, default=0.02,
                   help="probability of each injected fault per backend call")
    s.add_argument("--pg-restart", default="auto",
                   help="'auto' (restart a local PostgreSQL cluster once), 'never', or a "
                        "command that restarts the consensus database")
    s.add_argument("--workdir", help="where ack logs go (default: a temporary folder)")
    s = sub.add_parser("simulate", help="deterministic simulation: the library's real code "
                       "under a seeded scheduler, clock and in-memory stores, with lost "
                       "replies, pauses and crashes, checked after every step")
    s.add_argument("--seeds", type=int, default=100, help="how many seeds to run")
    s.add_argument("--seed", type=int, default=0,
                   help="the first seed (with --seeds 1: reproduce that seed)")
    s.add_argument("--steps", type=int, default=2000, help="scheduler steps per seed")
    s.add_argument("--control", help="run with a negative control (a fix reverted), "
                                     "to see the simulation catch it")
    s.add_argument("--profile", help="run every seed with this workload profile (default: "
                                     "seeds rotate over all of them)")
    s.add_argument("--keep-going", action="store_true",
                   help="run every seed even after a violation")
    for name, parser in sub.choices.items():
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.epilog = "examples:\n" + "\n".join(f"  persist-pipeline {line}"
                                                   for line in EXAMPLES[name])
    return p


#: What ``COMMAND --help`` shows under "examples" (with PERSIST_CONSENSUS_URI and
#: PERSIST_BLOB_URI set).
EXAMPLES: dict[str, list[str]] = {
    "shards": ["shards", "shards --config pipeline.yaml"],
    "new-shard": ["new-shard", "new-shard --name sales/orders"],
    "names": ["names"],
    "resolve": ["resolve sales/orders", "resolve --create sales/orders"],
    "inspect": ["inspect sales/orders"],
    "append": ["append sales/orders updates.csv", "append sales/orders updates.parquet "
               "--expected-upper 10 --new-upper 11", "append new/shard rows.jsonl --create"],
    "snapshot": ["snapshot sales/orders --as-of latest", "snapshot sales/orders --as-of 9 "
                 "--out orders.parquet"],
    "plan": ["plan sales/orders", "plan sales/orders --as-of 9"],
    "compact": ["compact sales/orders"],
    "gc": ["gc sales/orders"],
    "verify": ["verify sales/orders", "verify --all", "verify sales/orders --deep"],
    "set-inline-max": ["set-inline-max sales/orders 1048576", "set-inline-max sales/orders 0"],
    "nemesis": ["nemesis --seconds 60", "nemesis --seconds 600 --writers 4 --seed 7"],
    "simulate": ["simulate --seeds 200", "simulate --seeds 1 --seed 27 --profile writes"],
}


def _print_json(obj: object) -> None:
    print(json.dumps(_readable(obj), indent=2, sort_keys=True, default=str))


#: Integers above this in a key ending ``_ms`` are epoch times (not durations).
_EPOCH_MS_FLOOR = 10**11


def _readable(obj: object) -> object:
    """JSON for people: floats to 3 decimals, epoch milliseconds (``*_ms`` keys) as ISO
    8601 UTC times under the key without ``_ms``, and an empty ``skipped`` reason left
    out (nothing was skipped)."""
    if isinstance(obj, float):
        return round(obj, 3)
    if isinstance(obj, list | tuple):
        return [_readable(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out: dict[str, object] = {}
    for key, value in obj.items():
        if key == "skipped" and value == "":
            continue
        if isinstance(key, str) and key.endswith("_ms") and isinstance(value, int) \
                and not isinstance(value, bool) and value > _EPOCH_MS_FLOOR:
            moment = datetime.datetime.fromtimestamp(value / 1000, tz=datetime.UTC)
            out[key[:-3]] = moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
            continue
        out[key] = _readable(value)
    return out


def _printable(table: pa.Table) -> pa.Table:
    """k and v as text: UTF-8 where every value of the column is, else hex (said on
    stderr, so a reader of the CSV knows how to decode it)."""
    from persist_pipeline.plan import text_or_hex

    if "k" not in table.column_names:  # a typed shard: its own columns
        return _flat_columns(table)
    for index, name in ((0, "k"), (1, "v")):
        encoding, values = text_or_hex(table.column(name))
        if encoding == "hex":
            print(f"persist-pipeline: column {name} is not valid UTF-8 throughout: written "
                  f"as hex", file=sys.stderr)
        table = table.set_column(index, name, pa.array(values, pa.string()))
    return table


def _flat_columns(table: pa.Table) -> pa.Table:
    """A typed table for CSV: lists and structs as JSON text; a float column holding NaN
    as quoted text (unquoted "nan" reads back as null); a binary column as text
    where it is UTF-8 throughout (what ``append`` reads a CSV's binary column as, so the
    file round-trips), else as hex, said on stderr."""
    from persist_pipeline.plan import text_or_hex

    for index, field in enumerate(table.schema):
        type_ = field.type
        if pa.types.is_nested(type_):
            text = [None if v is None else json.dumps(v, default=str, sort_keys=True)
                    for v in table.column(index).to_pylist()]
        elif pa.types.is_binary(type_) or pa.types.is_large_binary(type_) or \
                pa.types.is_fixed_size_binary(type_):
            encoding, text = text_or_hex(table.column(index).cast(pa.large_binary()))
            if encoding == "hex":
                print(f"persist-pipeline: column {field.name} is not valid UTF-8 "
                      f"throughout: written as hex", file=sys.stderr)
        elif pa.types.is_floating(type_) and pc.any(pc.is_nan(table.column(index))).as_py():
            # Written unquoted, NaN is "nan", a null marker to Arrow's CSV reader (and
            # so to append); quoted, it is read as the float NaN. Arrow's cast writes
            # each float's shortest text that reads back as the same value.
            table = table.set_column(index, field.name,
                                     table.column(index).cast(pa.string()))
            continue
        else:
            continue
        table = table.set_column(index, field.name, pa.array(text, pa.string()))
    return table


def _check_out(out: Path) -> None:
    """``snapshot --out``, checked before anything is read or written: a snapshot that
    cannot be written is bad input naming the path, not a storage error after the read."""
    if out.suffix not in (".parquet", ".csv"):
        raise InvalidInput(f"--out must end in .parquet or .csv, got {out.name!r}")
    problem = path_problem(out)
    if problem is not None:
        raise InvalidInput(f"--out {out}: {problem}")
    if out.is_dir():
        raise InvalidInput(f"--out {out}: is a folder; name a file in it")
    parent = out.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "no such folder"
        raise InvalidInput(f"--out {out}: {parent}: {what}")


def _write_table(table: pa.Table, out: Path | None) -> None:
    printable = _printable(table) if out is None or out.suffix == ".csv" else table
    if out is None:
        pacsv.write_csv(printable, sys.stdout.buffer)
    elif out.suffix == ".parquet":
        pq.write_table(table, out)
    else:
        pacsv.write_csv(printable, out)


def _stream_parquet(reader: ReadHandle, as_of: int, out: Path) -> None:
    """Write the snapshot to Parquet as it streams, in bounded memory whatever its size;
    a failed read leaves no partial file."""
    partial = out.with_name(out.name + ".partial")
    try:
        writer: pq.ParquetWriter | None = None
        try:
            for batch in reader.snapshot_batches(as_of):
                # The batches' own schema: a typed shard's as of this read.
                writer = writer or pq.ParquetWriter(partial, batch.schema)
                writer.write_batch(batch)
            if writer is None:  # an empty snapshot still gets its columns
                typed = reader.schema()
                empty = SCHEMA if typed is None else typed.arrow_schema()
                writer = pq.ParquetWriter(partial, empty)
        finally:
            if writer is not None:
                writer.close()
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    if args.command == "nemesis":
        return _nemesis(args)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "new-shard":
        return _new_shard(args)
    if args.command == "snapshot" and args.out is not None:
        _check_out(args.out)
    with _open(args) as client:
        if args.command == "shards":
            names = _shard_names(args.config, client)
            registered: dict[str, list[str]] = {}
            for name, shard_id in client.shard_names().items():
                registered.setdefault(str(shard_id), []).append(name)
            _print_json({k: {**(v.__dict__ if hasattr(v, "__dict__") else _summary(v)),
                             "name": names.get(k), "names": registered.get(k, [])}
                         for k, v in client.shard_summaries().items()})
            return 0
        if args.command == "names":
            _print_json({name: str(i) for name, i in client.shard_names().items()})
            return 0
        if args.command == "resolve":
            try:
                resolved = client.resolve(args.name, create=args.create)
            except ShardNameNotFound:
                raise ShardNameNotFound(f"no shard named {args.name!r}; create it with "
                                        f"`persist-pipeline resolve --create "
                                        f"{args.name}`") from None
            if args.create and str(resolved) not in client.list_shards():
                # A name --create printed names a shard that exists, so inspect, shards
                # and append find it (as after new-shard --name).
                client.open_writer(resolved).expire()
            print(resolved)
            return 0
        if args.command == "append":
            _append(client, args)
            return 0
        if args.command == "verify":
            return _verify(client, args)
        shard = _shard(client, args.shard)
        if args.command == "inspect":
            _print_json(client.inspect(shard))
        elif args.command == "snapshot":
            with client.open_reader(shard, debug="cli") as reader:
                as_of = args.as_of
                if args.out is not None and args.out.suffix == ".parquet":
                    _stream_parquet(reader, as_of, args.out)
                else:  # CSV decides text or hex per column, so it needs the whole table
                    _write_table(reader.snapshot(as_of), args.out)
        elif args.command == "plan":
            if not math.isfinite(args.hold_seconds) or args.hold_seconds < 0:
                raise InvalidInput(f"--hold-seconds must be a finite number of seconds, "
                                   f"not negative; got {args.hold_seconds}")
            with client.open_reader(shard, debug="cli plan") as reader, \
                    reader.snapshot_plan(args.as_of) as plan:
                print(plan.to_json(), flush=True)
                if args.hold_seconds:
                    _hold(client, reader, args.hold_seconds)
        elif args.command == "compact":
            _print_json(client.compact(shard))
        elif args.command == "gc":
            _print_json(client.gc(shard))
        elif args.command == "set-inline-max":
            value = _int_or_text(args.max_bytes)
            previous = client.set_inline_max_bytes(shard, value)  # type: ignore[arg-type]
            _print_json({"shard_id": str(shard), "inline_max_bytes": value,
                         "previous": previous})
    return 0


#: Commands that only read: they open the location without creating it, so a mistyped
#: URI is reported ("no store at ...") instead of leaving an empty store behind.
_READ_ONLY = frozenset({"shards", "names", "inspect", "snapshot", "plan", "verify"})


#: Commands that need an existing shard (without --create): at a location without a
#: store they cannot succeed, so they create nothing there either.
_NEED_A_SHARD = frozenset({"compact", "gc", "set-inline-max"})


def _verify(client: PersistClient, args: argparse.Namespace) -> int:
    """``verify``: one report per shard, as JSON; exit 1 when any finds a problem."""
    if args.all == bool(args.shards):
        raise InvalidInput("verify needs shards (ids or names) or --all, not both")
    shards = client.list_shards() if args.all else [str(_shard(client, text))
                                                     for text in args.shards]
    named: dict[str, str] = {}
    if args.all or len(shards) > 1:  # progress on stderr, with each shard's name if any
        named = {str(i): n for n, i in sorted(client.shard_names().items(), reverse=True)}
    reports = {}
    for shard in dict.fromkeys(shards):
        if args.all or len(shards) > 1:
            name = f" ({named[shard]})" if shard in named else ""
            print(f"persist-pipeline: verifying {shard}{name}", file=sys.stderr, flush=True)
        reports[shard] = client.verify(shard, deep=args.deep)
    _print_json({"ok": all(r.ok for r in reports.values()),
                 "shards": {shard: r.as_dict() for shard, r in reports.items()}})
    damaged = [shard for shard, r in reports.items() if not r.ok]
    if damaged:
        problems = sum(len(reports[shard].problems) for shard in damaged)
        print(f"persist-pipeline: {problems} problem(s) in {len(damaged)} shard(s): "
              f"{', '.join(damaged)} (see the report's problems)", file=sys.stderr)
        return 1
    return 0


def _int_or_text(text: str) -> int | str:
    """``text`` as an int if it is one (the library refuses anything else, typed)."""
    try:
        return int(text)
    except ValueError:
        return text


def _hold(client: PersistClient, reader: ReadHandle, seconds: float) -> None:
    """Keep the printed plan's files from GC for ``seconds``, renewing the reader's lease
    at every heartbeat interval and once more at the end.

    The hold is only as good as the lease: a GC whose wall clock runs ahead of this
    host's by more than the lease, or a pause of this process past it, expires the
    reader, and GC may then delete the files while someone reads them under the hold.
    Such a hold is reported (``LeaseExpired``, exit 1) as soon as a renewal finds it,
    never ended with exit 0 as if the files had been kept: a reader still registered at
    the end was never expired (an expired reader never comes back).

    Any other failure of a renewal (consensus away for a moment) ends nothing early:
    leaving would release the hold while the files may still be read, and the lease
    outlasts a few missed renewals. Only the last renewal's failure is raised, after
    the hold: that one leaves the hold unconfirmed."""
    clock = client.clock
    interval = client.config.heartbeat_interval_s
    deadline = clock.monotonic() + seconds
    unconfirmed: PersistError | None = None
    while (left := deadline - clock.monotonic()) > 0:
        clock.sleep(min(left, interval) if interval > 0 else left)
        try:
            reader.heartbeat()
            unconfirmed = None
        except LeaseExpired as e:
            raise LeaseExpired(
                f"the plan's files were not held for --hold-seconds {seconds:g}: its reader "
                f"was expired (a GC whose clock runs ahead of this host's by more than the "
                f"reader's lease, or this process paused past it), so GC may have deleted "
                f"them; a read of them under this hold may have failed: make a new plan "
                f"({e})") from None
        except PersistError as e:
            unconfirmed = e
    if unconfirmed is not None:
        raise unconfirmed


def _open(args: argparse.Namespace) -> PersistClient:
    """The client of the command's location, created only by commands that may create
    it; a missing location's error says which command would."""
    try:
        return PersistClient.open(args.consensus, args.blob, args.wal_blob,
                                  create=_writes(args))
    except LocationNotFound as e:
        hint = ("pass --create to create it" if args.command == "append" else
                "new-shard, resolve --create or append --create makes one")
        raise type(e)(f"{e}; {hint}") from None


def _writes(args: argparse.Namespace) -> bool:
    """Whether the command may create the location (a database file, tables, a folder)."""
    if args.command in ("resolve", "append"):
        return bool(args.create)
    return args.command not in _READ_ONLY | _NEED_A_SHARD


def _append(client: PersistClient, args: argparse.Namespace) -> None:
    """``append``: the shard must exist, unless ``--create`` (which also registers SHARD
    if it is an unregistered name)."""
    shard = _lookup(client, args.shard, missing_ok=args.create)
    untyped: pa.Table | None = None
    if shard is None or str(shard) not in client.list_shards():
        if not args.create:
            raise ShardNotFound(f"shard {shard} does not exist; pass --create to create "
                                f"it")
        # A shard created here is untyped: a bad file, bad bounds, times outside them
        # or an expected upper other than a new shard's 0 are refused before the name
        # or the shard is written.
        untyped = _read_untyped(args)
        expected, new_upper = check_append_bounds(*_append_bounds(lambda: 0, untyped, args))
        check_times(Updates.coerce(untyped), expected, new_upper)
        check_new_shard_bounds(expected, args.shard)
        if shard is None:
            shard = client.resolve(args.shard, create=True)
    with client.open_writer(shard, debug="cli") as writer:
        if writer.schema is not None:
            updates = read_typed_file(args.file, writer.schema, args.format)
        else:
            updates = untyped if untyped is not None else _read_untyped(args)
        expected, new_upper = _append_bounds(writer.fetch_recent_upper, updates, args)
        res = writer.compare_and_append(updates, expected, new_upper)
    _print_json({"placement": res.placement, "encoded_bytes": res.encoded_bytes,
                 "seqno": res.seqno, "upper": res.upper, "updates": res.num_updates})


def _read_untyped(args: argparse.Namespace) -> pa.Table:
    # A column besides k, v, t, d is refused, not dropped: compare_and_append refuses
    # a table with one, and a typed append refuses columns outside the schema.
    return read_updates_file(args.file, args.format, extra_columns=False)


def _new_shard(args: argparse.Namespace) -> int:
    shard = ShardId.parse(args.id) if args.id else ShardId.new()
    schema = _schema_arg(args.schema, args.key) if args.schema else None
    if args.key and not args.schema:
        raise InvalidInput("--key goes with a Parquet --schema")
    with PersistClient.open(args.consensus, args.blob, args.wal_blob) as client:
        if args.name is not None:
            recorded = client.register_name(args.name, shard)
            if args.id and recorded != shard:
                raise InvalidInput(f"the name {args.name!r} is registered for shard "
                                   f"{recorded}, not {shard}; names never change")
            shard = recorded
        client.open_writer(shard, schema=schema).expire()
    print(shard)
    return 0


#: The columns of a typed rows file that hold each row's time and diff, not its data.
_UPDATE_COLUMNS = ("t", "d")


def _schema_arg(text: str, keys: list[str]) -> ShardSchema:
    """``new-shard --schema``: JSON (inline or a .json file), or a Parquet file's schema
    with ``--key`` columns (default: every column is a key)."""
    path = Path(text)
    if text.endswith((".parquet", ".json")):
        problem = file_problem(path, arrow=text.endswith(".parquet"))
        if problem is not None:  # a file was meant: say what is wrong with it
            raise InvalidInput(f"--schema {text}: {problem}")
    if text.endswith(".parquet"):
        try:
            arrow = pq.read_schema(path).remove_metadata()
        except (pa.ArrowInvalid, OSError) as e:
            raise InvalidInput(f"--schema {text}: not a Parquet file ({e})") from None
        # A file of a typed shard's rows (what `snapshot --out` writes, what `append`
        # takes) carries its times and diffs as t and d: they are no columns of the shard.
        columns = [f for f in arrow if f.name not in _UPDATE_COLUMNS]
        names = [f.name for f in columns]
        unknown = [k for k in keys if k not in names]
        if unknown:
            raise InvalidInput(f"--key {unknown} are not columns of {text}: {names}")
        key_names = keys or names
        return ShardSchema([arrow.field(k) for k in key_names],
                           [f for f in columns if f.name not in key_names])
    if keys:
        raise InvalidInput("--key goes with a Parquet --schema (a JSON schema names its "
                           "key columns itself)")
    from_file = text.endswith(".json")
    raw = path.read_text() if from_file else text
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        if from_file:
            raise InvalidInput(f"--schema {text}: not valid JSON: {e}") from None
        raise InvalidInput(f"--schema is neither a Parquet file nor JSON: {e}") from None
    return ShardSchema.from_json(data)


def _append_bounds(current_upper: Callable[[], Frontier], updates: Any,
                   args: argparse.Namespace) -> tuple[int, Frontier]:
    """``append``'s ``(expected_upper, new_upper)``: as given, else the shard's current
    upper and one past the file's largest time (or the upper + 1 for an empty file)."""
    expected = args.expected_upper
    if expected is None:
        current = current_upper()
        if current is None:
            raise InvalidFrontier(f"shard {args.shard} is closed: it takes no writes")
        expected = current
    if args.new_upper is not _UNSET:
        return expected, args.new_upper
    times = updates.column("t") if isinstance(updates, pa.Table) else None
    largest = pc.max(times).as_py() if times is not None and len(times) else None
    new_upper = max(expected, largest if largest is not None else expected) + 1
    if new_upper > MAX_TIME:
        raise InvalidFrontier(f"the file holds a row at the largest time {MAX_TIME}: no "
                              f"upper lies past it; pass --new-upper closed to write it "
                              f"and close the shard")
    return expected, new_upper


def _shard(client: PersistClient, text: str) -> ShardId:
    """The shard a command-line argument names: a shard id, else a registered name."""
    found = _lookup(client, text, missing_ok=False)
    assert found is not None
    return found


def _lookup(client: PersistClient, text: str, missing_ok: bool) -> ShardId | None:
    """:func:`_shard`, or None for a well-formed name that is not registered when
    ``missing_ok``."""
    try:
        return ShardId.parse(text)
    except InvalidShardId as not_an_id:
        try:
            found = client.name_registry.lookup(text)
        except InvalidShardName:
            raise not_an_id from None
        if found is not None:
            _note_newer_generation(client, text)
        if found is None and not missing_ok:
            # Not found, as an id of no shard and `resolve` of an unknown name are (exit
            # 1): a well-formed name is no bad input, it may be registered a moment later.
            raise ShardNameNotFound(f"{text!r} is neither a shard id ({not_an_id}) nor a "
                                    "registered shard name (`persist-pipeline names` lists "
                                    "them)") from None
        return found


def _note_newer_generation(client: PersistClient, name: str) -> None:
    """Say on stderr when ``name`` is a table whose newest generation is another shard:
    a name names one shard for good, so the command reads (or writes) the generation
    the name itself names, which table loads no longer read."""
    from persist_pipeline.tables import generation_name, generations

    found = generations(name, client.shard_names())
    if found and found[-1] != 1:
        newest = generation_name(name, found[-1])
        print(f"persist-pipeline: note: {name!r} is a table whose newest generation is "
              f"{newest!r} (a schema change started it; table loads read that one); this "
              f"command uses the shard named {name!r} itself", file=sys.stderr)


def _simulate(args: argparse.Namespace) -> int:
    import contextlib
    import logging

    from persist_pipeline.sim import runner
    from persist_pipeline.sim.controls import CONTROLS

    if args.seeds < 1 or args.steps < 1 or args.seed < 0:
        raise InvalidInput("simulate needs --seeds >= 1, --steps >= 1 and --seed >= 0")
    if args.profile is not None and args.profile not in runner.PROFILES:
        raise InvalidInput(f"unknown --profile {args.profile!r}; one of: "
                           f"{', '.join(runner.PROFILES)}")
    if args.control is not None and args.control not in CONTROLS:
        raise InvalidInput(f"unknown --control {args.control!r}; one of: "
                           f"{', '.join(sorted(CONTROLS))}")
    # Simulated faults make the library log warnings by the thousand: keep stderr quiet.
    logging.getLogger("persist_pipeline").setLevel(logging.CRITICAL)
    seeds = list(range(args.seed, args.seed + args.seeds))
    every = max(1, args.seeds // 20)

    def progress(report: runner.SimReport) -> None:
        if args.seeds > 1 and (report.seeds % every == 0 or report.failures):
            print(f"  {report.seeds}/{args.seeds} seeds, {report.ops_per_s:.0f} ops/s, "
                  f"{len(report.failures)} failing", file=sys.stderr, flush=True)

    control = CONTROLS[args.control]() if args.control else contextlib.nullcontext()
    with control:
        report = runner.run_seeds(seeds, args.steps, stop_at_first=not args.keep_going,
                                  profile=args.profile, progress=progress)
    print(report.line())
    for failure in report.failures:
        for line in runner.describe(failure):
            print(line)
        print(f"reproduce with: persist-pipeline simulate --seeds 1 --seed {failure.seed} "
              f"--steps {args.steps}" + (f" --control {args.control}" if args.control else "")
              + (f" --profile {args.profile}" if args.profile else ""))
    return 1 if report.failures else 0


def _nemesis(args: argparse.Namespace) -> int:
    import os

    from persist_pipeline.nemesis.runner import NemesisOptions, run

    consensus = args.consensus or os.environ.get("PERSIST_CONSENSUS_URI")
    blob = args.blob or os.environ.get("PERSIST_BLOB_URI")
    if not consensus or not blob:
        raise InvalidInput("nemesis needs --consensus and --blob (or PERSIST_CONSENSUS_URI "
                           "and PERSIST_BLOB_URI)")
    if args.writers < 1 or args.seconds <= 0 or not 0 <= args.fault_rate < 0.5:
        raise InvalidInput("nemesis needs --writers >= 1, --seconds > 0 and "
                           "0 <= --fault-rate < 0.5")
    report = run(NemesisOptions(
        consensus_uri=consensus, blob_uri=blob,
        wal_blob_uri=args.wal_blob or os.environ.get("PERSIST_WAL_BLOB_URI") or None,
        seconds=args.seconds, writers=args.writers, readers=args.readers, seed=args.seed,
        fault_rate=args.fault_rate, pg_restart=args.pg_restart, workdir=args.workdir))
    return 1 if report.check.violations else 0


def _shard_names(config: Path | None, client: PersistClient) -> dict[str, str]:
    """``{shard_id: name}`` from the pipeline config: ``config`` (errors are errors),
    else ``$PERSIST_PIPELINE_CONFIG`` or ``./pipeline.yaml`` if present (errors are
    warnings: the listing itself does not need names). Only the config's ``shards``
    mapping is read, without the code location: each shard's ``shard_id`` (an id, or a
    name looked up in the location's registry), else the id derived from its name."""
    path = config or os.environ.get("PERSIST_PIPELINE_CONFIG")
    if path is None and Path("pipeline.yaml").is_file():
        path = "pipeline.yaml"
    if path is None:
        return {}
    try:
        return _config_shard_ids(Path(path), client)
    except (OSError, ValueError, PersistError) as e:
        message = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        if config is not None:
            raise InvalidInput(f"--config {config}: {message}") from None
        print(f"persist-pipeline: shard names not shown: {path}: {message}", file=sys.stderr)
        return {}


def _config_shard_ids(path: Path, client: PersistClient) -> dict[str, str]:
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise ValueError("reading a pipeline config needs PyYAML, which is not installed: "
                         "pip install pyyaml (or install the library with its pipeline "
                         "extra)") from None
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML: {str(e).splitlines()[0]}") from None
    shards = raw.get("shards") if isinstance(raw, dict) else None
    if not isinstance(shards, dict):
        raise ValueError("no 'shards' mapping")
    registry: dict[str, str] | None = None
    out: dict[str, str] = {}
    for name, spec in shards.items():
        given = spec.get("shard_id") if isinstance(spec, dict) else None
        if not given:
            out[str(ShardId.for_pipeline_name(str(name)))] = str(name)
            continue
        try:
            out[str(ShardId.parse(str(given)))] = str(name)
        except InvalidShardId:
            if registry is None:
                registry = {n: str(i) for n, i in client.shard_names().items()}
            if str(given) in registry:
                out[registry[str(given)]] = str(name)
    return out


def _summary(s: object) -> dict[str, Any]:
    return {name: getattr(s, name) for name in getattr(s, "__slots__", ())}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except InvalidUpdates as e:
        print(f"persist-pipeline: invalid input: {e}", file=sys.stderr)
        return 2
    except InvalidInput as e:
        print(f"persist-pipeline: invalid input: {e}", file=sys.stderr)
        return 2
    except PersistError as e:
        print(f"persist-pipeline: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader of our output went away (`| head`): stop quietly, as Unix tools do,
        # and keep Python from reporting the pipe again when it flushes stdout at exit.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as e:
        filename = getattr(e, "filename", None)
        where = f": {filename}" if filename else ""
        print(f"persist-pipeline: {e.strerror or e}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
