"""Review E: defects in deferred table schema recording, schema history, base/_v1
names, opening without creating, and landing/CLI round trips."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import PersistClient, tables

V1 = pa.table({"id": pa.array([1, 2], pa.int64()), "name": pa.array(["a", "b"])})
V2 = pa.table({"id": pa.array([1, 3], pa.int64()), "name": pa.array(["a", "c"]),
               "tier": pa.array([1.0, None])})


def _client(tmp_path: Path) -> PersistClient:
    return PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")


def _after_open(client: PersistClient, action: Callable[[], Any]) -> None:
    """Run ``action`` (another store) once, right after this client's next table writer
    opens: the interleaving of two concurrent stores, made deterministic."""
    original = client._open_table_writer
    done = []

    def opened(*args: Any, **kwargs: Any) -> Any:
        handle = original(*args, **kwargs)
        if not done:
            done.append(True)
            action()
        return handle

    client._open_table_writer = opened  # type: ignore[method-assign]


def test_a_store_committing_after_a_concurrent_evolution_loads_exactly(
        tmp_path: Path) -> None:
    with _client(tmp_path) as client, _client(tmp_path) as other:
        tables.store_table(client, "t", V1, ["id"])
        # A stores a V1-shaped table; between its writer's open and its commit another
        # process stores V2 (evolving the generation in place, adding "tier").
        narrow = V1.slice(1)
        _after_open(client, lambda: tables.store_table(other, "t", V2, ["id"]))
        stored = tables.store_table(client, "t", narrow, ["id"])
        latest = tables.load_table(client, "t")
        # store_table: "Make the newest generation of name hold exactly table".
        assert latest.schema.names == narrow.schema.names, (stored.name, latest)
        assert latest.equals(narrow)


def test_store_tables_committing_after_a_concurrent_evolution_loads_exactly(
        tmp_path: Path) -> None:
    with _client(tmp_path) as client, _client(tmp_path) as other:
        tables.store_table(client, "t", V1, ["id"])
        narrow = V1.slice(1)
        _after_open(client, lambda: tables.store_table(other, "t", V2, ["id"]))
        tables.store_tables(client, {"t": (narrow, ["id"])})
        latest = tables.load_table(client, "t")
        assert latest.schema.names == narrow.schema.names, latest
        assert latest.equals(narrow)


def test_opening_a_foreign_sqlite_database_without_create_changes_nothing(
        tmp_path: Path) -> None:
    """create=False "creates nothing": a SQLite file that holds no persist store is
    refused, and left as it was (not switched to WAL journaling, nor written)."""
    import sqlite3

    from persist_pipeline.consensus import open_consensus
    from persist_pipeline.exceptions import ConsensusLocationNotFound

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE mine (x INTEGER)")
        conn.execute("INSERT INTO mine VALUES (1)")
    conn.close()
    before = path.read_bytes()
    with pytest.raises(ConsensusLocationNotFound):
        open_consensus(f"sqlite:///{path}", create=False)
    with sqlite3.connect(path) as conn:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    conn.close()
    assert mode == "delete"
    assert path.read_bytes() == before
    # An empty file (touched, not a database yet) stays empty.
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(ConsensusLocationNotFound):
        open_consensus(f"sqlite:///{empty}", create=False)
    assert empty.stat().st_size == 0


def test_a_csv_snapshot_of_binary_columns_appends_back_as_the_same_bytes(
        tmp_path: Path) -> None:
    """The CLI writes a typed binary column as text where UTF-8 "so a CSV snapshot
    appends back as the same bytes": empty bytes and text Arrow's CSV reader takes
    for null (NULL, NaN, #N/A, ...) must not come back as null."""
    import os

    from persist_pipeline import ShardSchema
    from tests.helpers import run_cli

    consensus, blob = f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}"
    schema = ShardSchema({"id": pa.int64()}, {"blob": pa.binary(), "s": pa.string()})
    values = [b"plain", b"", None, b"NULL", b"null", b"NaN", b"#N/A", b"N/A"]
    strings = [None if v is None else v.decode() for v in values]
    n = len(values)
    table = pa.table({"id": pa.array(range(n), pa.int64()),
                      "blob": pa.array(values, pa.binary()),
                      "s": pa.array(strings, pa.string()),
                      "t": pa.array([0] * n, pa.int64()), "d": pa.array([1] * n, pa.int64())})
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
        reader = client.open_reader(client.resolve("dst"))
        got = reader.snapshot(0).sort_by("id")
        reader.expire()
    assert got.column("blob").to_pylist() == values
    assert got.column("s").to_pylist() == strings


def test_the_ambiguity_message_names_no_other_table_as_the_first_generation(
        tmp_path: Path) -> None:
    """A name registered literally as ``y/_v1`` before such names were refused is its own
    table: it is no generation of ``y``, and the ambiguity error must not tell the user
    to load it as ``y``'s first generation (that load returns the other table)."""
    from persist_pipeline.exceptions import InvalidInput
    from persist_pipeline.tables import _encode, storage_plan

    other = pa.table({"q": pa.array([9], pa.int64())})
    with _client(tmp_path) as client:
        tables.store_table(client, "y", V1, ["id"])
        keyed_by_text = pa.table({"id": pa.array(["k"]), "name": pa.array(["z"])})
        assert tables.store_table(client, "y", keyed_by_text, ["id"]).name == "y/_v2"
        # The legacy table, stored as store_table did before "y/_v1" was refused.
        plan = storage_plan(other.schema, None, [])
        writer = client.open_writer(client.resolve("y/_v1", create=True),
                                    schema=plan.shard_schema)
        writer._replace_encoded(_encode(plan, other, None))
        writer.expire()
        assert tables.load_table(client, "y/_v1").equals(other)
        with pytest.raises(InvalidInput, match="ambiguous") as caught:
            tables.load_table(client, "y", 1)
        message = str(caught.value)
        generations = message[message.index("generations ["):message.index("]")]
        assert "'y/_v1'" not in generations, message
        assert "first generation's is 'y/_v1'" not in message, message
