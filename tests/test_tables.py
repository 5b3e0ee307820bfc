"""Tables (the IO manager's storage, :mod:`persist_pipeline.tables`) against schema
evolution: a refused store changes no table, and a table's earlier versions read back
with the columns they were stored with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, tables
from persist_pipeline.consensus import open_consensus
from persist_pipeline.exceptions import CommitDeadlineExceeded, Contended
from persist_pipeline.frontier import MAX_TIME
from tests.fixtures.location import Location
from tests.helpers import BeforeNextCas, HandClock, client_on_clock


def _client(tmp_path: Path) -> PersistClient:
    return PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")


V1 = pa.table({"id": pa.array([1, 2], pa.int64()), "name": pa.array(["a", "b"])})
#: Adds a nullable column: the same generation, its schema evolved in place.
V2 = pa.table({"id": pa.array([1, 3], pa.int64()), "name": pa.array(["a", "c"]),
               "tier": pa.array([1.0, None])})


def test_a_load_pinned_to_an_earlier_upper_returns_the_table_stored_there(
        tmp_path: Path) -> None:
    with _client(tmp_path) as client:
        first = tables.store_table(client, "customers", V1, ["id"])
        second = tables.store_table(client, "customers", V2, ["id"])
        assert first.name == second.name == "customers"  # one generation
        assert tables.load_table(client, "customers").sort_by("id").equals(V2.sort_by("id"))
        pinned = tables.load_table(client, "customers", first.result.upper)
        # The version whose write left the upper at 1 is V1, columns and all.
        assert pinned.schema.names == V1.schema.names
        assert pinned.sort_by("id").equals(V1.sort_by("id"))


def test_a_refused_store_tables_changes_no_table(tmp_path: Path) -> None:
    with _client(tmp_path) as client:
        tables.store_table(client, "a", V1, ["id"])
        b = tables.store_table(client, "b", V1, ["id"])
        # b's upper is the largest time: no replace can be written there any more.
        writer = client.open_writer(b.shard)
        writer.compare_and_append(V1.slice(0, 0).append_column("t", pa.array([], pa.int64())),
                                  writer.fetch_recent_upper(), MAX_TIME)
        writer.expire()
        schema_before = client.schema(client.resolve("a"))
        with pytest.raises(Exception, match="largest time"):
            tables.store_tables(client, {"a": (V2, ["id"]), "b": (V1, ["id"])})
        # "(on any error) none changed": a still holds exactly V1.
        assert client.schema(client.resolve("a")) == schema_before
        assert tables.load_table(client, "a").sort_by("id").equals(V1.sort_by("id"))


def test_each_pinned_version_loads_as_stored_across_two_evolutions(tmp_path: Path) -> None:
    v3 = V2.append_column("zone", pa.array(["n", "s"]))
    versions = (V1, V1.slice(0, 1), V2, V2.slice(1), v3)
    with _client(tmp_path) as client:
        uppers = [tables.store_table(client, "t", v, ["id"]).result.upper for v in versions]
        assert list(client.shard_names()) == ["t"]  # one generation, evolved in place
    with _client(tmp_path) as client:  # a new process's view: the state as recorded
        for upper, stored in zip(uppers, versions, strict=True):
            got = tables.load_table(client, "t", upper)
            assert got.schema.names == stored.schema.names, upper
            assert got.sort_by("id").equals(stored.sort_by("id")), upper
        # The core's typed snapshot is unchanged: every time reads with the newest schema.
        reader = client.open_reader(client.resolve("t"))
        assert reader.snapshot(0).schema.names == ["id", "name", "tier", "zone", "t", "d"]
        reader.expire()


def test_pinned_loads_control_returns_a_table_never_stored(tmp_path: Path) -> None:
    """The schema history (negative control): a pinned load that decodes with the newest
    schema returns the earlier version with a column it never had. The simulation's
    table writers rarely pin a version stored before an evolution, so this control is
    checked here rather than by seeds."""
    from persist_pipeline.sim import controls

    with _client(tmp_path) as client:
        first = tables.store_table(client, "customers", V1, ["id"])
        tables.store_table(client, "customers", V2, ["id"])
        with controls.pinned_loads_with_the_newest_schema():
            pinned = tables.load_table(client, "customers", first.result.upper)
        assert pinned.schema.names == ["id", "name", "tier"]
        assert tables.load_table(client, "customers", first.result.upper).equals(
            V1.sort_by("id"))


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


@pytest.mark.parametrize("many", [False, True], ids=["store_table", "store_tables"])
def test_a_store_committing_after_a_concurrent_evolution_loads_exactly(
        tmp_path: Path, many: bool) -> None:
    """A store of a V1-shaped table whose commit comes after another process stored V2
    (evolving the generation in place, adding "tier"): "make the newest generation of
    name hold exactly table", so it loads without the other store's column."""
    with _client(tmp_path) as client, _client(tmp_path) as other:
        tables.store_table(client, "t", V1, ["id"])
        narrow = V1.slice(1)
        _after_open(client, lambda: tables.store_table(other, "t", V2, ["id"]))
        if many:
            tables.store_tables(client, {"t": (narrow, ["id"])})
        else:
            tables.store_table(client, "t", narrow, ["id"])
        latest = tables.load_table(client, "t")
        assert latest.schema.names == narrow.schema.names, latest
        assert latest.equals(narrow)


@pytest.mark.parametrize("many", [False, True], ids=["store_table", "store_tables"])
def test_a_store_outrun_by_newer_generations_every_time_gives_up_with_contended(
        tmp_path: Path, many: bool) -> None:
    """Another process starts a newer generation (a table keyed otherwise) right after
    each of this store's writers opens, so every attempt lands in a generation no load
    reads: after MAX_GENERATION_ATTEMPTS the store gives up with the typed, retryable
    Contended, and loads return the other process's table, never this one."""
    with _client(tmp_path) as client, _client(tmp_path) as other:
        tables.store_table(client, "t", V1, ["id"])
        keys = [["name"], ["id", "name"]]
        original = client._open_table_writer
        stored = []

        def opened(*args: Any, **kwargs: Any) -> Any:
            handle = original(*args, **kwargs)
            # Keyed unlike this store and unlike the newest: a generation of its own.
            stored.append(tables.store_table(other, "t", V2, keys[len(stored) % 2]))
            return handle

        client._open_table_writer = opened  # type: ignore[method-assign]
        with pytest.raises(Contended, match="newer generations kept starting"):
            if many:
                tables.store_tables(client, {"t": (V1.slice(1), ["id"])})
            else:
                tables.store_table(client, "t", V1.slice(1), ["id"])
        assert len(stored) == tables.MAX_GENERATION_ATTEMPTS
        assert tables.load_table(client, "t").sort_by("id").equals(V2.sort_by("id"))


def _evolution_refused_for_its_deadline(location: Location) -> PersistClient:
    """Stores V1 in "t", then V2 (adding "tier", the generation evolved in place) from a
    process that pauses between uploading V2's rows and committing them, past its
    commit deadline, while another process opens a writer of the shard (so the commit
    is computed again, on the state after the pause): V2's store is refused with
    CommitDeadlineExceeded, nothing written. Returns the storing client."""
    clock = HandClock()
    cfg = PersistConfig(inline_policy=InlinePolicy(0, 0), heartbeat_interval_s=0)
    paused = BeforeNextCas(open_consensus(location.consensus_uri))
    client = client_on_clock(location, clock, config=cfg, consensus=paused)
    with client_on_clock(location, clock, config=cfg) as other:
        tables.store_table(client, "t", V1, ["id"])
        shard = client.resolve("t")

        def the_pause() -> None:
            other.open_writer(shard).expire()
            clock.advance(cfg.gc_orphan_min_age_s / 2 + 1)

        # Armed once V2's writer opened: the next compare-and-set is V2's commit.
        _after_open(client, lambda: paused.arm(the_pause))
        with pytest.raises(CommitDeadlineExceeded):
            tables.store_table(client, "t", V2, ["id"])
    return client


def test_a_store_refused_for_its_deadline_leaves_the_tables_schema(
        durable_location: Location) -> None:
    """A store that evolves its table's schema (a nullable column added) and is refused
    (here its commit deadline passed while its process paused) changes no table: the
    schema is recorded by the store's own commit, never when its writer opens, so the
    table still loads exactly as stored before, without the refused store's column."""
    client = _evolution_refused_for_its_deadline(durable_location)
    with client:
        assert client.schema(client.resolve("t")).columns == ["id", "name"]
        assert tables.load_table(client, "t").sort_by("id").equals(V1.sort_by("id"))


def test_control_schema_recorded_at_open_loads_a_column_never_stored(
        durable_location: Location) -> None:
    """The negative control (table_schema_recorded_at_open): a table writer that records
    the evolved schema when it opens leaves it after the refusal, and the table loads
    with a column it was never stored with. The simulation's table writers rarely pause
    an evolving store past its deadline, so this control is checked here."""
    from persist_pipeline.sim import controls

    with controls.table_schema_recorded_at_open():
        client = _evolution_refused_for_its_deadline(durable_location)
    with client:
        loaded = tables.load_table(client, "t")
        assert loaded.column_names == ["id", "name", "tier"]
        assert loaded.column("tier").null_count == loaded.num_rows


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
        writer = client.open_writer(client.name_registry.resolve("y/_v1", create=True),
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


def test_other_entry_points_read_a_generation_by_the_name_its_store_reported(
        tmp_path: Path) -> None:
    """A name maps to one shard for good: after a schema change the table lives in
    ``name/_v2``, the name its store reports (Dagster's ``dagster/table_name``), and
    ``snapshot``, plans, the CLI and Spark read it by that name; the table's own name
    keeps reading the first generation (only ``load_table`` follows generations)."""
    keyed_by_text = pa.table({"id": pa.array(["k"]), "name": pa.array(["z"])})
    with _client(tmp_path) as client:
        first = tables.store_table(client, "t", V1, ["id"])
        second = tables.store_table(client, "t", keyed_by_text, ["id"])
        assert (first.name, second.name) == ("t", "t/_v2")
        assert client.resolve("t") == first.shard
        assert tables.load_table(client, "t").equals(keyed_by_text)
        for stored, table in ((first, V1), (second, keyed_by_text)):
            reader = client.open_reader(client.resolve(stored.name))
            read = reader.snapshot("latest").select(table.column_names)
            assert read.sort_by("id").equals(table.sort_by("id"))
            with reader.snapshot_plan() as plan:
                assert plan.to_table().select(table.column_names).equals(read)
            reader.expire()


def test_only_a_tables_stores_register_its_generation_names(tmp_path: Path) -> None:
    """``t/_v<N>`` (N > 1) names generation N of table ``t``: registered by any other
    entry point, a load of ``t`` would return whatever it names. Registering one anew
    elsewhere is refused and changes nothing; one a store registered resolves and
    registers as any name (``t/_v1``, which loads read as the first generation, is never
    registered anew); ``_v0`` and ``_v02`` are ordinary names."""
    from persist_pipeline.exceptions import InvalidShardName

    with _client(tmp_path) as client:
        tables.store_table(client, "t", V1, ["id"])
        names = dict(client.shard_names())
        for name in ("t/_v2", "t/_v17", "other/_v3", "t/_v1"):
            with pytest.raises(InvalidShardName, match="only that table's stores"):
                client.resolve(name, create=True)
            with pytest.raises(InvalidShardName, match="only that table's stores"):
                client.register_name(name, client.resolve("t"))
        with pytest.raises(InvalidShardName, match="only that table's stores"), \
                client.transaction() as txn:
            txn.compare_and_append("t/_v2", [(b"k", b"v", 0, 1)], 0, 1)
        assert dict(client.shard_names()) == names
        assert tables.load_table(client, "t").equals(V1)
        for name in ("t/_v0", "t/_v02", "t/v2", "t/_v2x"):
            assert client.resolve(name, create=True) == client.resolve(name)
        second = tables.store_table(client, "t", pa.table({"id": pa.array(["k"])}), ["id"])
        assert second.name == "t/_v2"
        assert client.resolve("t/_v2", create=True) == second.shard
        assert client.register_name("t/_v2", second.shard) == second.shard


def test_a_write_outside_an_ordered_categorical_is_refused_so_the_table_still_loads(
        tmp_path: Path) -> None:
    """A table's ordered categorical keeps its categories in the shard schema: a typed
    write by another entry point (the API here; the CLI's append and Spark writes encode
    the same way) of a value outside them is refused with SchemaMismatch and changes
    nothing, rather than accepted and leaving every load failing; values among them,
    and nulls, are written and load."""
    import pandas as pd

    from persist_pipeline.exceptions import SchemaMismatch

    sizes = pd.CategoricalDtype(["S", "M", "L"], ordered=True)
    frame = pd.DataFrame({"id": [1, 2], "size": pd.Categorical(["S", "M"], dtype=sizes)})
    with _client(tmp_path) as client:
        stored = tables.store_table(client, "sizes", pa.Table.from_pandas(frame), ["id"])
        writer = client.open_writer(stored.shard)
        with pytest.raises(SchemaMismatch, match=r"'XL'.*categories"):
            writer.compare_and_append([{"id": 3, "size": "XL", "t": 1}], 1, 2)
        with pytest.raises(SchemaMismatch, match=r"'XL'.*categories"):
            writer.upsert([{"id": 1, "size": "XL"}])
        assert client.inspect(stored.shard)["upper"] == 1
        writer.compare_and_append([{"id": 3, "size": "L", "t": 1}, {"id": 4, "t": 1}], 1, 2)
        loaded = tables.load_table(client, "sizes").to_pandas().sort_values("id")
        assert loaded["size"].dtype == sizes
        assert loaded["size"].tolist()[:3] == ["S", "M", "L"]
        assert pd.isna(loaded["size"].tolist()[3])
        writer.expire()
