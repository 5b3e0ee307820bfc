"""Secrets never leak; SQL is never built from values; keys cannot escape their folder."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from persist_pipeline import PersistClient, PersistError, ShardId
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import VersionedData

ROOT = Path(__file__).resolve().parent.parent
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYSECRETKEY"
PG_PASSWORD = "pg-pa55-SECRET"


def test_credentials_never_appear_in_logs_errors_or_inspect(pg_url, s3_uri, caplog, capfd):
    consensus_uri = pg_url.replace("postgres@", f"postgres:{PG_PASSWORD}@", 1)
    blob_uri = f"{s3_uri}&access_key_id=AKIDSECRETID&secret_access_key={SECRET_KEY}"
    seen: list[str] = []
    with caplog.at_level(logging.DEBUG):
        client = PersistClient.open(consensus_uri, blob_uri)
        shard = ShardId.new()
        writer = client.open_writer(shard)
        writer.compare_and_append([(b"k", b"v" * 5000, 0, 1)], 0, 1)  # a blob part
        writer.compare_and_append([(b"k2", b"v", 1, 1)], 1, 2)  # inline
        seen.append(str(client.inspect(shard)))
        client.compact(shard)
        client.gc(shard)
        seen.append(repr(client.blobs.main) + client.blobs.main.describe())
        seen.append(repr(client.consensus))
        for bad in (lambda: client.inspect(ShardId.new()),
                    lambda: PersistClient.open(consensus_uri.replace("127.0.0.1", "127.0.0.1:1"),
                                               blob_uri),
                    lambda: PersistClient.open(consensus_uri, blob_uri.replace(
                        "s3://", "s3://missing-", 1)).open_writer(ShardId.new())
                    .compare_and_append([(b"k", b"v" * 5000, 0, 1)], 0, 1)):
            with pytest.raises(PersistError) as err:
                bad()
            seen.append(f"{err.value!r} {err.value} {err.value.__cause__!r}")
        client.close()
    env = {**os.environ, "PERSIST_CONSENSUS_URI": consensus_uri, "PERSIST_BLOB_URI": blob_uri}
    for args in (["inspect", str(shard)], ["inspect", str(ShardId.new())],
                 ["--blob", blob_uri.replace("s3://", "s3://nope-"), "inspect", str(shard)]):
        done = subprocess.run([sys.executable, "-m", "persist_pipeline", *args], env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        seen += [done.stdout, done.stderr]
    out, err_out = capfd.readouterr()
    seen += [caplog.text, out, err_out]
    everything = "\n".join(seen)
    assert "shard" in everything and len(caplog.records) > 0
    # (An access key id is an identifier, not a secret: botocore logs it in headers.)
    for secret in (SECRET_KEY, PG_PASSWORD):
        assert secret not in everything, f"{secret[:6]}... leaked"


def _sql_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("execute", "exec_driver_sql", "executemany", "text") \
                and node.args:
            yield node


def test_no_sql_is_built_by_string_formatting():
    offenders = []
    for path in (ROOT / "persist_pipeline").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for call in _sql_calls(tree):
            arg = call.args[0]
            formatted = isinstance(arg, ast.JoinedStr | ast.BinOp) or (
                isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute)
                and arg.func.attr == "format")
            if formatted:
                offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    # Allowed: joining our own constant PREPARE statements, and a PRAGMA (which takes no
    # bound parameters) given an int() of a setting. Nothing else, and nothing user-given.
    for o in offenders:
        source = (ROOT / o.split(":")[0]).read_text().splitlines()[int(o.split(":")[1]) - 1]
        assert "DEALLOCATE ALL" in source or ("PRAGMA" in source and "{int(" in source), o


@pytest.mark.parametrize("shard", ["x'); DROP TABLE consensus; --", "a\"b", "%s %(x)s", "ü∂"])
def test_hostile_shard_names_are_data(pg_url, shard):
    with open_consensus(pg_url) as store:
        assert store.compare_and_set(shard, None, VersionedData(1, b"d", b"s"))
        assert store.head(shard) == VersionedData(1, b"d", b"s")
        assert shard in store.list_shards()


def test_the_dagster_ui_binds_to_loopback_by_default():
    makefile = (ROOT / "Makefile").read_text()
    ui = makefile[makefile.index("\nui:"):].split("\n\n")[0]
    assert "-h 127.0.0.1" in ui


@pytest.mark.parametrize("password", ["on", "e", "refused", "s3cr3t-long-password"])
def test_driver_messages_are_masked_by_structure_not_by_substring(password: str) -> None:
    """A short password is masked only where it stands as a password (a URI's user
    info, a ``password=`` value), so the rest of the message reads as the driver wrote
    it and masks never show where the password's letters occur; a long one is masked
    wherever it occurs."""
    import psycopg2
    from sqlalchemy.engine import make_url

    from persist_pipeline.consensus._sql_errors import map_error

    url = make_url(f"postgresql://app:{password}@db.example:5432/persist")
    driver = psycopg2.OperationalError(
        'connection to server at "db.example" (10.0.0.1), port 5432 failed: Connection '
        f"refused; dsn postgresql://app:{password}@db.example/persist password={password} "
        f"host=db.example")
    text = str(map_error(driver, url, "opening"))
    assert "Connection refused" in text
    assert f"app:{password}@" not in text and f"password={password} " not in text
    assert "postgresql://***@db.example/persist" in text and "password=*** host" in text
    if len(password) >= 8:
        assert password not in text
    else:  # untouched elsewhere: no mask inside words
        assert "c***" not in text.lower() and "***ion" not in text
