"""A route's one transaction (:func:`assets.ingestion.commit_routed`) when one of its
target shards is changed by another client between the run's plan (the uppers it read)
and its commit, or is not a shard ingestion may write, on SQLite+files and
PostgreSQL+S3.

Covers: a target typed meanwhile refuses the whole file with SchemaMismatch (a failure
the run does not retry) and no shard changes, now or on a retry; a target closed
meanwhile fails the file naming it and no shard changes; a table store under a target's
name meanwhile is refused (NotATable), so no generation seals the target and the file
lands once in every target; a target whose name is a table's superseded generation
refuses the whole file with SchemaMismatch. A retry after a commit whose reply was
lost settles that write (SettledElsewhere: the file is in every target once) even when a
target was closed since, for a route and for a files shard. (Lost replies and runs that
died after their commit, with Dagster runs: tests/test_pipeline_retries.py and
tests/test_pipeline_routes.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from assets.ingestion import SettledElsewhere, append, commit_routed, file_plan, split_routed
from assets.pipeline_config import FileSource, RouteConfig
from assets.retries import is_transient
from persist_pipeline import PersistClient, ShardSchema
from persist_pipeline.exceptions import Indeterminate, NotATable, SchemaMismatch
from persist_pipeline.ingest import read_updates_file
from persist_pipeline.tables import store_table
from persist_pipeline.transaction import Transaction
from persist_pipeline.write import WriteHandle
from tests.fixtures.location import Location

FILE = "k,v,t,table\no1,10,0,order\nr1,-10,0,refund\n"


def _parts(tmp_path: Path) -> tuple[FileSource, dict[str, pa.Table], str]:
    path = tmp_path / "f.csv"
    path.write_text(FILE)
    source = FileSource(uri=str(tmp_path))
    route = RouteConfig(name="commerce", targets={"order": "orders", "refund": "refunds"},
                        source=source, column="table")
    return source, split_routed(read_updates_file(path, route="table"), route,
                                str(path)), str(path)


def _contents(client: PersistClient, shard_id: str) -> list[tuple[bytes, bytes, int]]:
    upper = client.shard_summaries()[shard_id].upper
    if not upper:
        return []
    reader = client.open_reader(shard_id)
    try:
        snap = reader.snapshot(upper - 1)
    finally:
        reader.expire()
    return sorted(zip(*(snap.column(c).to_pylist() for c in "kvd"), strict=True))


def _writers(client: PersistClient) -> dict[str, WriteHandle]:
    return {name: client.open_writer(client.resolve(name, create=True))
            for name in ("orders", "refunds")}


def _after_first_read(writer: WriteHandle, meanwhile: Callable[[], object]) -> list[int | None]:
    """Run ``meanwhile`` right after the writer's first upper read (the run's plan);
    returns the uppers read, in order."""
    real = writer.fetch_recent_upper
    calls: list[int | None] = []

    def read_then_change() -> int | None:
        upper = real()
        if not calls:
            meanwhile()
        calls.append(upper)
        return upper

    writer.fetch_recent_upper = read_then_change  # type: ignore[method-assign]
    return calls


def _uppers(client: PersistClient, writers: dict[str, WriteHandle]) -> dict[str, int | None]:
    summaries = client.shard_summaries()
    return {name: summaries[str(w.shard_id)].upper for name, w in writers.items()}


def test_a_target_typed_between_plan_and_commit_refuses_the_whole_file(
        durable_location: Location, tmp_path: Path) -> None:
    """Another client records a schema on an empty target after the run read the
    uppers: the transaction's untyped rows no longer fit it, so the whole file is
    refused with a typed error (not a Dagster retry loop) and neither shard changes,
    on the first attempt nor on a retry of the run."""
    source, parts, shown = _parts(tmp_path)
    with durable_location.client() as client, durable_location.client() as other:
        writers = _writers(client)
        schema = ShardSchema([("id", pa.int64())], [("amount", pa.int64())])
        refunds = str(writers["refunds"].shard_id)
        _after_first_read(writers["refunds"],
                          lambda: other.open_writer(refunds, schema=schema).expire())
        with pytest.raises(SchemaMismatch) as info:
            commit_routed(client, writers, parts, source, shown, "id")
        assert not is_transient(info.value)  # the run fails once, with this message
        assert _uppers(client, writers) == {"orders": 0, "refunds": 0}
        # A retry of the run (fresh writers) is refused the same way: never half.
        with pytest.raises(SchemaMismatch):
            commit_routed(client, _writers(client), parts, source, shown, "id")
        assert _uppers(client, writers) == {"orders": 0, "refunds": 0}
        assert _contents(client, str(writers["orders"].shard_id)) == []
        assert client.schema(refunds) == schema


def test_a_target_closed_between_plan_and_commit_writes_no_shard(
        durable_location: Location, tmp_path: Path) -> None:
    """A target closed by another client after the run read the uppers: the commit is
    refused as a whole and the run fails naming the closed shard, without a retry;
    the open target stays as it was."""
    source, parts, shown = _parts(tmp_path)
    with durable_location.client() as client, durable_location.client() as other:
        writers = _writers(client)
        refunds = str(writers["refunds"].shard_id)
        _after_first_read(writers["refunds"],
                          lambda: other.open_writer(refunds).compare_and_append([], 0, None))
        with pytest.raises(dg.Failure, match=r"shard\(s\) refunds closed") as info:
            commit_routed(client, writers, parts, source, shown, "id")
        assert info.value.allow_retries is False
        assert _uppers(client, writers) == {"orders": 0, "refunds": None}
        assert _contents(client, str(writers["orders"].shard_id)) == []


def test_a_table_store_under_a_targets_name_meanwhile_is_refused_and_the_file_lands_once(
        durable_location: Location, tmp_path: Path) -> None:
    """A table stored under a target's name after the run read the uppers would open
    the table's next generation there and seal the shard the route writes: the store is
    refused instead (NotATable, nothing changed), since table loads of the name would
    then read the table and not the ingested shard, and the file lands once in every
    target, at the uppers the run planned on."""
    source, parts, shown = _parts(tmp_path)
    with durable_location.client() as client, durable_location.client() as other:
        writers = _writers(client)
        for writer in writers.values():  # earlier files: the shards hold rows
            writer.compare_and_append([(b"old", b"x", 0, 1)], 0, 1)
        refused: list[Exception] = []

        def store() -> None:
            try:
                store_table(other, "refunds", pa.table({"id": [1]}))
            except NotATable as e:
                refused.append(e)

        calls = _after_first_read(writers["refunds"], store)
        results, _, _ = commit_routed(client, writers, parts, source, shown, "id")
        assert len(refused) == 1 and calls == [1]
        assert results["orders"].upper == 2 and results["refunds"].upper == 2
        assert _contents(client, str(writers["orders"].shard_id)) == [
            (b"o1", b"10", 1), (b"old", b"x", 1)]
        assert _contents(client, str(writers["refunds"].shard_id)) == [
            (b"old", b"x", 1), (b"r1", b"-10", 1)]
        assert "refunds/_v2" not in client.name_registry.names()


def test_a_target_naming_a_superseded_table_generation_refuses_the_whole_file(
        durable_location: Location, tmp_path: Path) -> None:
    """A route target whose name is a table's (typed by its first store, then sealed
    when a second store's schema change opened generation _v2): its untyped rows fit
    no table, so the whole file is refused with SchemaMismatch and the other target is
    not written; the table's generations keep what the stores wrote."""
    source, parts, shown = _parts(tmp_path)
    with durable_location.client() as client:
        store_table(client, "refunds", pa.table({"id": [1]}))
        store_table(client, "refunds", pa.table({"name": ["x"]}))  # a new generation
        writers = _writers(client)
        before = _uppers(client, writers)
        assert before["refunds"] == 2  # the first store, then the seal
        with pytest.raises(SchemaMismatch):
            commit_routed(client, writers, parts, source, shown, "id")
        assert _uppers(client, writers) == {"orders": 0, "refunds": 2}
        assert _contents(client, str(writers["orders"].shard_id)) == []
        assert client.shard_summaries()[str(client.resolve("refunds/_v2"))].upper == 1


def test_a_retry_after_a_lost_commit_reply_settles_even_once_a_target_is_closed(
        durable_location: Location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route's commit landed but its reply was lost (Indeterminate); before the
    step's retry a target is closed. The retry settles the earlier write (the file is in
    every target, once) instead of failing with "no shard of the route was written",
    which would leave the file unrecorded and its message false."""
    source, parts, shown = _parts(tmp_path)
    recorded: list[tuple[str, int, str]] = []
    with durable_location.client() as client:
        def intent(name: str, upper: int, token: str) -> None:
            recorded.append((name, upper, token))

        def settle() -> list[dg.MaterializeResult[Any]]:
            # As settle_intents: one committed recorded write settles the file.
            for name, upper, token in recorded:
                writer = client.open_writer(client.resolve(name))
                try:
                    if writer.committed(token, upper):
                        return [dg.MaterializeResult(asset_key=dg.AssetKey(name))]
                finally:
                    writer.expire()
            return []

        real = Transaction.commit

        def lost_reply(self: Transaction) -> Any:
            real(self)
            raise Indeterminate("the commit's reply was lost")

        with monkeypatch.context() as patch:
            patch.setattr(Transaction, "commit", lost_reply)
            with pytest.raises(Indeterminate):
                commit_routed(client, _writers(client), parts, source, shown, "id",
                              intent, settle)
        writers = _writers(client)
        writers["refunds"].compare_and_append([], 1, None)  # closed before the retry
        with pytest.raises(SettledElsewhere) as info:
            commit_routed(client, writers, parts, source, shown, "id", intent, settle)
        assert len(info.value.results) == 1
        assert _uppers(client, writers) == {"orders": 1, "refunds": None}
        assert _contents(client, str(writers["orders"].shard_id)) == [(b"o1", b"10", 1)]


def test_a_files_shard_retry_after_a_lost_reply_settles_even_once_it_is_closed(
        durable_location: Location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a ``files`` shard's single write (:func:`assets.ingestion.append`):
    the retry settles the write that landed unheard, not "shard is closed"."""
    path = tmp_path / "g.csv"
    path.write_text("k,v,t\no1,10,0\n")
    plan = file_plan(read_updates_file(path), FileSource(uri=str(tmp_path)), str(path))
    recorded: list[tuple[int, str]] = []
    with durable_location.client() as client:
        shard = client.resolve("orders", create=True)

        def settle() -> list[dg.MaterializeResult[Any]]:
            writer = client.open_writer(shard)
            try:
                if any(writer.committed(token, upper) for upper, token in recorded):
                    return [dg.MaterializeResult(asset_key=dg.AssetKey("orders"))]
            finally:
                writer.expire()
            return []

        real = WriteHandle.compare_and_append

        def lost_reply(self: WriteHandle, *args: Any, **kwargs: Any) -> Any:
            real(self, *args, **kwargs)
            raise Indeterminate("the commit's reply was lost")

        with monkeypatch.context() as patch:
            patch.setattr(WriteHandle, "compare_and_append", lost_reply)
            with pytest.raises(Indeterminate):
                append(client.open_writer(shard), plan,
                       lambda upper, token: recorded.append((upper, token)), settle)
        writer = client.open_writer(shard)
        writer.compare_and_append([], 1, None)  # closed before the retry
        with pytest.raises(SettledElsewhere):
            append(writer, plan, lambda upper, token: recorded.append((upper, token)),
                   settle)
        assert client.shard_summaries()[str(shard)].upper is None
