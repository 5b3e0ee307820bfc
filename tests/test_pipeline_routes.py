"""Routes: one landed file written to several shards in one transaction (Dagster runs on
the embedded default).

Covers: the route's landing sensor requests one run per file selecting every routed
shard; the file's rows go to the shard their route column names, all shards commit
together (each advancing its upper, with no rows where the file has none); a row naming
no shard fails the run and writes nothing anywhere; a file is ingested once however its
run was launched; a run selecting only some of the route's shards writes nothing; a
writer moving one shard's upper mid-run makes the commit re-plan, never half-apply; a
run that died between its commit and Dagster's record of it is settled by the next run
(for a files shard too), never written twice, as is one that died between its shards'
records; a run that died before its commit leaves the file to be written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from assets.ingestion import (
    RECOVERED_FROM,
    ROUTE,
    ROUTE_SHARDS,
    UPDATES_WRITTEN,
    UPPER,
    commit_routed,
    split_routed,
)
from assets.pipeline_config import FileSource, RouteConfig
from persist_pipeline import PersistClient
from persist_pipeline.exceptions import InvalidUpdates
from persist_pipeline.ingest import read_updates_file
from tests.pipeline_support import Pipeline, failure_messages, make_pipeline, materializations

#: The full tier only (``make test``): Dagster runs.
pytestmark = pytest.mark.slow

__all__ = ["make_pipeline"]  # the fixture, imported for pytest

SENSOR = "commerce_landing_sensor"
ROUTED = {"orders": {"source": {"kind": "routed", "route": "commerce", "value": "order"}},
          "refunds": {"source": {"kind": "routed", "route": "commerce", "value": "refund"}}}
ROUTES = {"commerce": {"column": "table", "description": "orders and refunds together",
                       "source": {"kind": "files", "uri": "{data_dir}/landing/commerce"}}}


def _pipeline(make_pipeline: Any) -> tuple[Pipeline, Path]:
    pipeline: Pipeline = make_pipeline(ROUTED, routes=ROUTES)
    landing = pipeline.data_dir / "landing" / "commerce"
    landing.mkdir(parents=True)
    return pipeline, landing


def _land(landing: Path, name: str, text: str, order: int) -> Path:
    path = landing / name
    path.write_text(text)
    stamp = 1_700_000_000 + order
    os.utime(path, (stamp, stamp))
    return path


def _contents(client: PersistClient, shard_id: str) -> list[tuple[bytes, bytes, int]]:
    """The shard's (k, v, d) at its latest readable time."""
    reader = client.open_reader(shard_id)
    try:
        upper = client.shard_summaries()[shard_id].upper
        if not upper:
            return []
        snap = reader.snapshot(upper - 1)
    finally:
        reader.expire()
    return sorted(zip(*(snap.column(c).to_pylist() for c in "kvd"), strict=True))


def _state(pipeline: Pipeline) -> dict[str, Any]:
    client = pipeline.client()
    summaries = client.shard_summaries()
    return {name: (summaries[pipeline.shard_id(name)].upper
                   if pipeline.shard_id(name) in summaries else None,
                   _contents(client, pipeline.shard_id(name))
                   if pipeline.shard_id(name) in summaries else [])
            for name in ROUTED}


def test_a_routed_file_commits_to_every_shard_at_once(make_pipeline: Any) -> None:
    pipeline, landing = _pipeline(make_pipeline)
    _land(landing, "a.csv", "k,v,t,table\no1,10,0,order\nr1,-10,0,refund\no2,20,0,order\n", 1)
    tick = pipeline.ticker(SENSOR).tick()
    [request] = tick.run_requests
    assert request.partition_key == "commerce/a.csv"
    assert sorted(k.path[-1] for k in request.asset_selection or []) == ["orders", "refunds"]
    [result] = pipeline.launch_all(SENSOR, tick)
    assert result.success
    meta = materializations(result)
    assert set(meta) == {"ingest/orders", "ingest/refunds"}
    assert meta["ingest/orders"][UPDATES_WRITTEN] == 2
    assert meta["ingest/refunds"][UPDATES_WRITTEN] == 1
    for m in meta.values():
        assert m[ROUTE] == "commerce" and m[ROUTE_SHARDS] == 2 and m[UPPER] == 1
    assert _state(pipeline) == {
        "orders": (1, [(b"o1", b"10", 1), (b"o2", b"20", 1)]),
        "refunds": (1, [(b"r1", b"-10", 1)])}

    # A file with rows for one shard only still advances both: they stay in step.
    _land(landing, "b.jsonl", '{"k": "o3", "v": "30", "t": 9, "table": "order"}\n', 2)
    [result] = pipeline.launch_all(SENSOR, pipeline.ticker(SENSOR).tick())
    assert result.success
    meta = materializations(result)
    assert meta["ingest/refunds"][UPDATES_WRITTEN] == 0
    state = _state(pipeline)
    assert state["orders"][0] == state["refunds"][0] == 2
    assert (b"o3", b"30", 1) in state["orders"][1] and len(state["refunds"][1]) == 1

    # Once per file: the sensor does not request it again, a re-run writes nothing.
    assert pipeline.ticker(SENSOR).tick().run_requests == []
    job = pipeline.defs.resolve_job_def("ingest_files_job")
    rerun = job.execute_in_process(instance=pipeline.instance,
                                   partition_key="commerce/a.csv", raise_on_error=False)
    assert rerun.success and materializations(rerun) == {}
    assert _state(pipeline) == state

    # Materializing one shard of a route's file would break its atomicity: refused.
    _land(landing, "c.csv", "k,v,t,table\no4,40,0,order\nr4,-40,0,refund\n", 3)
    pipeline.instance.add_dynamic_partitions("landed_files", ["commerce/c.csv"])
    partial = job.execute_in_process(instance=pipeline.instance, raise_on_error=False,
                                     partition_key="commerce/c.csv",
                                     asset_selection=[dg.AssetKey(["ingest", "orders"])])
    assert not partial.success
    [message] = failure_messages(partial)
    assert "ingest/orders, ingest/refunds together: select all of them" in message
    assert _state(pipeline) == state


def test_a_run_that_died_between_its_shards_records_is_completed_by_a_rerun(
        make_pipeline: Any) -> None:
    """The route's shards committed together, but the run recorded only the first
    shard's materialization before its process died: a re-run of the partition records
    the other shard's (from the commit that happened), writing nothing again."""
    pipeline, landing = _pipeline(make_pipeline)
    _land(landing, "a.csv", "k,v,t,table\no1,10,0,order\nr1,-10,0,refund\n", 1)
    [first] = pipeline.launch_all(SENSOR, pipeline.ticker(SENSOR).tick())
    assert first.success
    state = _state(pipeline)
    refunds = dg.AssetKey(["ingest", "refunds"])
    pipeline.instance.wipe_assets([refunds])
    assert not pipeline.instance.fetch_materializations(refunds, limit=10).records

    job = pipeline.defs.resolve_job_def("ingest_files_job")
    rerun = job.execute_in_process(instance=pipeline.instance,
                                   partition_key="commerce/a.csv", raise_on_error=False)
    assert rerun.success
    meta = materializations(rerun)
    assert set(meta) == {"ingest/refunds"}
    assert meta["ingest/refunds"][RECOVERED_FROM] == first.run_id
    assert meta["ingest/refunds"][UPPER] == 1
    assert _state(pipeline) == state  # nothing written twice
    # Now both are recorded: a further re-run records nothing.
    again = job.execute_in_process(instance=pipeline.instance,
                                   partition_key="commerce/a.csv", raise_on_error=False)
    assert again.success and materializations(again) == {}


def test_a_row_naming_no_shard_fails_the_file_and_writes_nothing(make_pipeline: Any
                                                                 ) -> None:
    pipeline, landing = _pipeline(make_pipeline)
    _land(landing, "a.csv", "k,v,t,table\no1,10,0,order\n", 1)
    [first] = pipeline.launch_all(SENSOR, pipeline.ticker(SENSOR).tick())
    assert first.success
    before = _state(pipeline)
    bad = _land(landing, "b.csv", "k,v,t,table\no2,20,0,order\nx,1,0,invoice\n"
                                  "y,1,0,invoice\n", 2)
    [result] = pipeline.launch_all(SENSOR, pipeline.ticker(SENSOR).tick())
    assert not result.success and materializations(result) == {}
    [message] = failure_messages(result)
    assert f"{bad}: row 2: 2 row(s) have a table that names no shard of route commerce " \
           "('invoice'); accepted: 'order', 'refund'" in message
    assert _state(pipeline) == before


def _files_or_route(make_pipeline: Any, routed: bool) -> tuple[Any, Any, str, list[str]]:
    """A pipeline whose landed files go to several shards by a route column, or to the
    one shard ``orders``: the pipeline, its landing folder, its sensor and the shards."""
    if routed:
        pipeline, landing = _pipeline(make_pipeline)
        return pipeline, landing, SENSOR, list(ROUTED)
    pipeline = make_pipeline({"orders": {"source": {
        "kind": "files", "uri": "{data_dir}/landing/orders"}}})
    landing = pipeline.data_dir / "landing" / "orders"
    landing.mkdir(parents=True)
    return pipeline, landing, "orders_landing_sensor", ["orders"]


@pytest.mark.parametrize("routed", [False, True], ids=["files", "route"])
def test_a_landed_column_the_shard_lacks_fails_the_file_and_writes_nothing(
        make_pipeline: Any, routed: bool) -> None:
    """A landed file with a column besides k, v, t, d (and the route column) is refused
    as the CLI's append refuses it: the run fails naming the column, and no shard
    changes (a dropped column would be data the user thinks is stored)."""
    pipeline, landing, sensor, names = _files_or_route(make_pipeline, routed)
    text = ("k,v,t,table,amount\no1,10,0,order,3\nr1,-10,0,refund,4\n" if routed
            else "k,v,t,amount\no1,10,0,3\n")
    bad = _land(landing, "a.csv", text, 1)
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert not result.success and materializations(result) == {}
    [message] = failure_messages(result)
    assert f"{bad}: line 1: unexpected column(s) amount" in message
    summaries = pipeline.client().shard_summaries()
    assert [pipeline.shard_id(n) for n in names if pipeline.shard_id(n) in summaries] == []


def test_a_moved_upper_replans_the_whole_transaction(tmp_path: Path) -> None:
    """Another writer appends to one shard between the run's read of the uppers and its
    commit: the transaction is refused as a whole and re-planned, so each shard gets the
    file exactly once and the other writer's rows stay."""
    path = tmp_path / "f.csv"
    path.write_text("k,v,t,table\no1,10,0,order\nr1,-10,0,refund\n")
    source = FileSource(uri=str(tmp_path))
    route = RouteConfig(name="commerce", targets={"order": "orders", "refund": "refunds"},
                        source=source, column="table")
    parts = split_routed(read_updates_file(path, route="table"), route, str(path))
    with PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}",
                            f"file://{tmp_path / 'blobs'}") as client:
        writers = {"orders": client.open_writer(client.resolve("orders", create=True)),
                   "refunds": client.open_writer(client.resolve("refunds", create=True))}
        other = client.open_writer(writers["orders"].shard_id)
        real = writers["orders"].fetch_recent_upper
        calls = []

        def stale_then_real() -> int | None:
            upper = real()
            if not calls:  # the other writer commits right after this read
                other.compare_and_append([(b"other", b"x", 0, 1)], 0, 1)
            calls.append(upper)
            return upper

        writers["orders"].fetch_recent_upper = stale_then_real  # type: ignore[method-assign]
        results, plans, _ = commit_routed(client, writers, parts, source, str(path), "id")
        assert plans["orders"].new_upper == 2 and plans["refunds"].new_upper == 1
        assert calls == [0, 1]  # planned at 0, refused, re-planned at 1
        assert results["orders"].upper == 2 and results["refunds"].upper == 1
        orders = _contents(client, str(writers["orders"].shard_id))
        assert orders == [(b"o1", b"10", 1), (b"other", b"x", 1)]
        assert _contents(client, str(writers["refunds"].shard_id)) == [(b"r1", b"-10", 1)]


def test_split_routed_names_unknown_values(tmp_path: Path) -> None:
    route = RouteConfig(name="r", targets={"a": "sa"}, source=FileSource(uri=str(tmp_path)),
                        column="c")
    path = tmp_path / "f.jsonl"
    path.write_text("".join(f'{{"k": "k", "v": "v", "t": 0, "c": "{c}"}}\n'
                            for c in ["a", "b1", "b2", "b3", "b4", "b5", "b6"]))
    with pytest.raises(InvalidUpdates, match=r"row 2: 6 row\(s\) have a c that names no "
                                             r"shard of route r \('b1', 'b2', 'b3', 'b4', "
                                             r"'b5', \.\.\.\); accepted: 'a'"):
        split_routed(read_updates_file(path, route="c"), route, str(path))


class _Died(Exception):
    """Stands for the run's process dying after its commit, before Dagster recorded it."""


def _die_after_commit(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The next ingestion write commits and then its run dies (once)."""
    import assets.ingestion as ingestion

    real, died = ingestion.write_metadata, []

    def dying(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if not died:
            died.append(1)
            raise _Died("killed between the commit and the materialization")
        return real(*args, **kwargs)

    monkeypatch.setattr(ingestion, "write_metadata", dying)
    return died


@pytest.mark.parametrize("routed", [False, True], ids=["files", "route"])
def test_a_run_that_died_after_its_commit_is_settled_not_written_twice(
        make_pipeline: Any, monkeypatch: pytest.MonkeyPatch, routed: bool) -> None:
    pipeline, landing, sensor, names = _files_or_route(make_pipeline, routed)
    partition = "commerce/a.csv" if routed else "orders/a.csv"
    text = ("k,v,t,table\no1,10,0,order\nr1,-10,0,refund\n" if routed
            else "k,v,t\no1,10,0\n")
    _land(landing, "a.csv", text, 1)
    died = _die_after_commit(monkeypatch)
    [crashed] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert died and not crashed.success and materializations(crashed) == {}
    client = pipeline.client()
    committed = {n: client.shard_summaries()[pipeline.shard_id(n)].upper for n in names}
    assert set(committed.values()) == {1}  # the commit happened; Dagster never heard

    # Re-running the partition (from the UI, a retry) settles it: no second write.
    job = pipeline.defs.resolve_job_def("ingest_files_job")
    rerun = job.execute_in_process(instance=pipeline.instance, partition_key=partition,
                                   raise_on_error=False)
    assert rerun.success
    meta = materializations(rerun)
    assert set(meta) == {f"ingest/{n}" for n in names}
    for m in meta.values():
        assert m["Committed by run"] == crashed.run_id and m[UPPER] == 1
    for n in names:
        summary = client.shard_summaries()[pipeline.shard_id(n)]
        assert summary.upper == 1
        assert all(d == 1 for _, _, d in _contents(client, pipeline.shard_id(n)))
    # And from then on the file is ingested: nothing more to do.
    again = job.execute_in_process(instance=pipeline.instance, partition_key=partition,
                                   raise_on_error=False)
    assert again.success and materializations(again) == {}

    # A recorded write that never committed (the run died after recording its intent,
    # before its commit) does not stop the file's first real write.
    from persist_pipeline.transaction import Transaction
    from persist_pipeline.write import WriteHandle

    def killed(*args: Any, **kwargs: Any) -> Any:
        raise _Died("killed before the commit")

    _land(landing, "b.csv", text.replace("o1", "o2").replace("r1", "r2"), 2)
    with monkeypatch.context() as patch:
        patch.setattr(Transaction, "commit", killed)
        patch.setattr(WriteHandle, "compare_and_append", killed)
        [before] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert not before.success
    assert {client.shard_summaries()[pipeline.shard_id(n)].upper for n in names} == {1}
    b_partition = partition.replace("a.csv", "b.csv")
    retried = job.execute_in_process(instance=pipeline.instance, partition_key=b_partition,
                                     raise_on_error=False)
    assert retried.success
    assert all("Committed by run" not in m for m in materializations(retried).values())
    assert {client.shard_summaries()[pipeline.shard_id(n)].upper for n in names} == {2}


def test_settling_takes_a_committed_write_over_one_whose_history_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Two earlier runs recorded writes of this file version: the first one's outcome
    # can no longer be told, the second one committed. The file is settled (recorded,
    # not written again); only when no recorded write is found committed does an
    # unknown one fail the run.
    import logging
    import types

    import assets.ingestion as ingestion
    from persist_pipeline import ShardId
    from persist_pipeline.write import WriteHandle

    client = PersistClient.open("mem://settle-intents", "mem://settle-intents")
    shard = types.SimpleNamespace(name="orders", shard_id=str(ShardId.new()))
    intents = [("run-1", "token-unknown", 0), ("run-2", "token-committed", 0)]
    answers: dict[str, bool | None] = {"token-unknown": None, "token-committed": True}
    monkeypatch.setattr(ingestion, "_intents", lambda *args: list(intents))
    monkeypatch.setattr(WriteHandle, "committed",
                        lambda self, token, expected_upper: answers[token])
    context = types.SimpleNamespace(instance=None, run=types.SimpleNamespace(run_id="run-3"),
                                    log=logging.getLogger("test"))
    settle = lambda: ingestion.settle_intents(  # noqa: E731
        context, client, [shard], ["orders/a.csv"], "a.csv@1:2", "a.csv")
    [recorded] = settle()
    assert recorded.metadata[ingestion.RECOVERED_FROM] == "run-2"
    answers["token-committed"] = False
    with pytest.raises(dg.Failure, match="no longer tells"):
        settle()
    client.close()


@pytest.mark.parametrize("routed", [False, True], ids=["files", "route"])
def test_a_run_that_only_seemed_dead_and_commits_late_never_writes_the_file_twice(
        make_pipeline: Any, monkeypatch: pytest.MonkeyPatch, routed: bool) -> None:
    """Run A records its write and pauses before committing; Dagster declares it failed
    (run monitoring, a user) and run B ingests the file: A's write had not landed, so B
    writes it. Then A wakes and commits: its attempt at the old upper is refused, and
    its next attempt must find B's write of the same file, not write the file again."""
    import threading

    from persist_pipeline.transaction import Transaction
    from persist_pipeline.write import WriteHandle

    pipeline, landing, sensor, names = _files_or_route(make_pipeline, routed)
    partition = "commerce/a.csv" if routed else "orders/a.csv"
    _land(landing, "a.csv", "k,v,t,table\no1,10,0,order\nr1,-10,0,refund\n" if routed
          else "k,v,t\no1,10,0\n", 1)
    paused, resume = threading.Event(), threading.Event()
    real_commit, real_append = Transaction.commit, WriteHandle.compare_and_append

    def pausing(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == "run-a" and not paused.is_set():
                paused.set()
                assert resume.wait(60), "run A was never resumed"
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(Transaction, "commit", pausing(real_commit))
    monkeypatch.setattr(WriteHandle, "compare_and_append", pausing(real_append))
    tick = pipeline.ticker(sensor).tick()
    outcome: list[Any] = []
    run_a = threading.Thread(name="run-a", daemon=True,
                             target=lambda: outcome.extend(pipeline.launch_all(sensor, tick)))
    run_a.start()
    try:
        assert paused.wait(60), "run A never reached its commit"
        [a_record] = pipeline.instance.get_run_records(
            filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
        pipeline.instance.report_run_failed(a_record.dagster_run)  # declared dead
        job = pipeline.defs.resolve_job_def("ingest_files_job")
        run_b = job.execute_in_process(instance=pipeline.instance, partition_key=partition,
                                       raise_on_error=False)
        assert run_b.success and set(materializations(run_b)) == {
            f"ingest/{n}" for n in names}
    finally:
        resume.set()
        run_a.join(120)
    client = pipeline.client()
    for n in names:
        assert client.shard_summaries()[pipeline.shard_id(n)].upper == 1, n
        assert all(d == 1 for _, _, d in _contents(client, pipeline.shard_id(n)))
    [a_result] = outcome
    assert a_result.success
    for m in materializations(a_result).values():
        assert m["Committed by run"] == run_b.run_id
