"""Property-based fuzzing of every decoder and parser that takes outside input.

Each must either succeed or raise a typed :class:`PersistError` subclass: never another
exception from deep inside, never a change to stored state.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from persist_pipeline import PersistError
from persist_pipeline.blob import open_blob
from persist_pipeline.cli import main as cli_main
from persist_pipeline.consensus import open_consensus
from persist_pipeline.exceptions import CorruptState, InvalidInput, InvalidUpdates
from persist_pipeline.ingest import read_updates_file
from persist_pipeline.internal import state_codec
from persist_pipeline.internal.state import State
from tests.helpers import examples

FUZZ = settings(max_examples=examples(300), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
SHARD = "s00000000-0000-4000-8000-000000000000"


@FUZZ
@given(st.binary(max_size=300))
def test_state_records_decode_or_raise_corrupt_state(data):
    for decode in (lambda: state_codec.decode_state(data, "fuzz"),
                   lambda: state_codec.apply_diff(State(shard_id=SHARD),
                                                  state_codec.decode_diff(data, "fuzz"), "fuzz"),
                   lambda: state_codec.decode_summary(data, "fuzz")):
        with contextlib.suppress(CorruptState):
            decode()


def _mutations():
    seeds = ["s3://bucket/prefix?endpoint_url=http://127.0.0.1:1&region=us-east-1",
             "file:///tmp/x", "mem://name", "postgresql://u:p@127.0.0.1:1/db",
             "sqlite:///x.db", "cockroachdb://u@h:1/d"]
    return st.one_of(
        st.text(max_size=80),
        st.builds(lambda s, i, t: s[:i] + t + s[i:], st.sampled_from(seeds),
                  st.integers(0, 40), st.text(max_size=12)),
    )


@FUZZ
@given(_mutations())
def test_uris_open_or_raise_a_typed_error(uri):
    # Only fuzz what cannot create files or connect for long.
    assume(not uri.startswith(("sqlite", "file:", "s3:", "postgres", "cockroach")))
    for opener in (open_consensus, open_blob):
        with contextlib.suppress(PersistError):
            opener(uri).close()


@FUZZ
@given(st.text(max_size=200))
def test_malformed_s3_and_sql_uris_are_typed_errors(tail):
    for prefix in ("s3://", "postgresql://", "cockroachdb://"):
        uri = prefix + tail
        assume("127.0.0.1" not in uri and "localhost" not in uri)
        # Parsing only: S3Blob does not connect until used; SQL would, so a
        # well-formed host here resolves nowhere (no network) and fails typed.
        with contextlib.suppress(PersistError):
            (open_blob if prefix == "s3://" else _open_sql_fast)(uri).close()


def _open_sql_fast(uri: str):
    sep = "&" if "?" in uri else "?"
    return open_consensus(f"{uri}{sep}connect_timeout=1")


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(["inspect", "append", "snapshot", "compact", "gc",
                                           "--as-of", "--expected-upper", "--new-upper",
                                           "--out", "--consensus", "--blob", "-x", "shards",
                                           "s00000000-0000-4000-8000-000000000000", "-1",
                                           "closed"]),
                          st.text(max_size=10)), max_size=6))
def test_cli_arguments_never_crash(argv):
    with tempfile.TemporaryDirectory() as tmp:
        env = {"PERSIST_CONSENSUS_URI": f"sqlite:///{tmp}/c.db",
               "PERSIST_BLOB_URI": f"file://{tmp}/b"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                code = cli_main(argv)
        except SystemExit as e:
            code = e.code
        finally:
            os.chdir(cwd)
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        assert code in (0, 1, 2)


@FUZZ
@given(st.binary(max_size=400), st.sampled_from([".csv", ".jsonl", ".parquet"]))
def test_ingestion_files_read_or_raise_invalid_updates(content, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"f{suffix}"
        path.write_bytes(content)
        try:
            table = read_updates_file(path)
        except InvalidUpdates:
            return
        assert table.column_names == ["k", "v", "t", "d"]


@FUZZ
@given(st.lists(st.dictionaries(st.sampled_from(["k", "v", "t", "d", "x"]),
                                st.one_of(st.none(), st.integers(), st.text(max_size=5),
                                          st.floats(), st.booleans()), max_size=5),
                max_size=5))
def test_jsonl_rows_of_any_shape(records):
    import json

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in records))
        with contextlib.suppress(InvalidInput):
            read_updates_file(path)


@FUZZ
@given(st.lists(st.tuples(st.one_of(st.binary(max_size=3), st.text(max_size=3), st.none()),
                          st.one_of(st.integers(-5, 5), st.floats(), st.none())), max_size=6))
def test_parquet_files_with_odd_columns(rows):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.parquet"
        try:
            table = pa.table({"k": [r[0] for r in rows], "v": [b"v"] * len(rows),
                              "t": [r[1] for r in rows]})
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return
        pq.write_table(table, path)
        with contextlib.suppress(InvalidUpdates):
            read_updates_file(path)
