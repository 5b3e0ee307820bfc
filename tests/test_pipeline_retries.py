"""Step retries of a landed file's run: a transient failure is retried, a bad file is not.

Covers, on the embedded default (SQLite + local folder) with a real Dagster instance (the
lost reply on PostgreSQL + S3 too):
the database away during a file's commit (for longer than the library's own retries,
faults injected by ``persist_pipeline/faults.py``) fails the first attempt and the
step's retry writes the file, once; a commit that landed but whose reply was lost (and
could not be confirmed) is settled by the retry from the write it recorded, not written
again; a bad file fails after exactly one attempt with its own message; with
``ingestion.retries: 0`` a transient failure fails the run after one attempt, and a
re-run of the partition then writes the file once; a run whose retries all fail says
the failure was transient and what to do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from assets.ingestion import RECOVERED_FROM, UPPER
from persist_pipeline import PersistClient
from persist_pipeline.blob import open_blob
from persist_pipeline.config import InlinePolicy, PersistConfig
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.consensus.faults import FaultConfig, FaultyConsensus
from persist_pipeline.transaction import Transaction
from persist_pipeline.write import WriteHandle
from tests.pipeline_support import Pipeline, failure_messages, make_pipeline, materializations

#: The full tier only (``make test``): Dagster runs.
pytestmark = pytest.mark.slow

__all__ = ["make_pipeline"]  # the fixture, imported for pytest

#: Retries fast enough for tests (the shipped default waits 5 s, then 15 s, 35 s).
FAST = {"retries": 2, "retry_delay_s": 0.01, "retry_backoff": "exponential",
        "retry_jitter": "none"}
ROUTED = {"orders": {"source": {"kind": "routed", "route": "commerce", "value": "order"}},
          "refunds": {"source": {"kind": "routed", "route": "commerce", "value": "refund"}}}
ROUTES = {"commerce": {"column": "table",
                       "source": {"kind": "files", "uri": "{data_dir}/landing/commerce"}}}
#: The database cannot be reached: a call fails without running, nothing lands.
UNREACHABLE = FaultConfig(fail_before=1.0)
#: Every call runs and its reply is lost: a commit lands and nobody can tell.
REPLIES_LOST = FaultConfig(fail_after=1.0)
#: How long the pipeline's client retries a transient error itself before it gives up
#: (60 s by default): the outages below outlast it.
LIBRARY_DEADLINE_S = 0.05


class _Outage(Consensus):
    """The pipeline's consensus store; while an outage is on, every call goes through
    faults.py's :class:`FaultyConsensus` (with probability 1, so nothing is random)."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.active: Consensus = inner

    def head(self, shard: str) -> VersionedData | None:
        return self.active.head(shard)

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        return self.active.compare_and_set(shard, expected, new)

    def compare_and_set_many(self, writes: Any) -> bool:
        writes_: list[CasWrite] = list(writes)
        return self.active.compare_and_set_many(writes_)

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        return self.active.scan(shard, from_seqno, limit)

    def truncate(self, shard: str, seqno: int) -> int:
        return self.active.truncate(shard, seqno)

    def list_shards(self) -> list[str]:
        return self.active.list_shards()

    def list_heads(self) -> Any:
        return self.active.list_heads()

    def close(self) -> None:
        self.inner.close()


def _outage_at_commits(monkeypatch: pytest.MonkeyPatch, faults: FaultConfig,
                       commits: int, *, lasting: bool = False) -> list[str]:
    """The next ``commits`` commits of the pipeline (a shard's append or a route's
    transaction) run while consensus is away as ``faults`` says, and it is back as soon
    as each returns (``lasting``: it stays away from the first one on). Returns what
    each commit from now on did: ``ok`` or the error's class name."""
    import resources.persist as persist_module

    outages: list[_Outage] = []

    class Client(PersistClient):
        @classmethod
        def open(cls, consensus_uri: str | None = None, blob_uri: str | None = None,
                 wal_blob_uri: str | None = None, inline_policy: InlinePolicy | None = None,
                 **kwargs: Any) -> PersistClient:
            assert consensus_uri and blob_uri
            outage = _Outage(open_consensus(consensus_uri))
            outages.append(outage)
            return cls(outage, open_blob(blob_uri),
                       open_blob(wal_blob_uri) if wal_blob_uri else None,
                       config=PersistConfig(inline_policy=inline_policy or InlinePolicy(),
                                            retry_deadline_s=LIBRARY_DEADLINE_S))

    monkeypatch.setattr(persist_module, "PersistClient", Client)
    left, outcomes, inside = [commits], [], [False]

    def during_outage(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if inside[0]:  # a transaction's commit inside another: counted once
                return real(*args, **kwargs)
            inside[0] = True
            if left[0]:
                left[0] -= 1
                for outage in outages:
                    outage.active = FaultyConsensus(outage.inner, faults)
            try:
                result = real(*args, **kwargs)
            except Exception as e:
                outcomes.append(type(e).__name__)
                raise
            finally:
                inside[0] = False
                for outage in outages:
                    if not lasting:
                        outage.active = outage.inner
            outcomes.append("ok")
            return result
        return call

    monkeypatch.setattr(WriteHandle, "compare_and_append",
                        during_outage(WriteHandle.compare_and_append))
    monkeypatch.setattr(Transaction, "commit", during_outage(Transaction.commit))
    return outcomes


def _setup(make_pipeline: Any, routed: bool, retries: dict[str, Any] | None = None
           ) -> tuple[Pipeline, Path, str, list[str]]:
    """A pipeline whose landed files go to the shard ``orders``, or to ``orders`` and
    ``refunds`` by a route: the pipeline, its landing folder, sensor and shards."""
    sections = {"ingestion": retries if retries is not None else FAST}
    if routed:
        pipeline: Pipeline = make_pipeline(ROUTED, routes=ROUTES, **sections)
        owner, names = "commerce", list(ROUTED)
    else:
        pipeline = make_pipeline({"orders": {"source": {
            "kind": "files", "uri": "{data_dir}/landing/orders"}}}, **sections)
        owner, names = "orders", ["orders"]
    landing = pipeline.data_dir / "landing" / owner
    landing.mkdir(parents=True)
    return pipeline, landing, f"{owner}_landing_sensor", names


def _land(landing: Path, name: str, routed: bool, order: int = 1) -> None:
    path = landing / name
    path.write_text("k,v,t,table\no1,10,0,order\nr1,-10,0,refund\n" if routed
                    else "k,v,t\no1,10,0\no2,20,0\n")
    stamp = 1_700_000_000 + order
    os.utime(path, (stamp, stamp))


def _attempts(result: dg.ExecuteInProcessResult) -> int:
    """How many times the run's ingestion step ran."""
    return 1 + sum(1 for e in result.all_events
                   if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY)


def _policy(pipeline: Pipeline, name: str) -> dg.RetryPolicy | None:
    """The retry policy of the step that writes shard ``name``."""
    return pipeline.defs.resolve_assets_def(dg.AssetKey(["ingest", name])).op.retry_policy


def _rows(pipeline: Pipeline, name: str) -> tuple[int | None, list[tuple[bytes, int]]]:
    """The shard's upper and its (key, diff) rows: a file written twice shows d=2."""
    client = pipeline.client()
    summary = client.shard_summaries().get(pipeline.shard_id(name))
    if summary is None or not summary.upper:
        return None, []
    reader = client.open_reader(pipeline.shard_id(name))
    try:
        snap = reader.snapshot(summary.upper - 1)
    finally:
        reader.expire()
    return summary.upper, sorted(zip(snap.column("k").to_pylist(),
                                     snap.column("d").to_pylist(), strict=True))


def _expected(routed: bool) -> dict[str, tuple[int, list[tuple[bytes, int]]]]:
    if routed:
        return {"orders": (1, [(b"o1", 1)]), "refunds": (1, [(b"r1", 1)])}
    return {"orders": (1, [(b"o1", 1), (b"o2", 1)])}


@pytest.mark.parametrize("routed", [False, True], ids=["files", "route"])
def test_a_commit_during_a_database_outage_is_retried_and_writes_the_file_once(
        make_pipeline: Any, monkeypatch: pytest.MonkeyPatch, routed: bool) -> None:
    pipeline, landing, sensor, names = _setup(make_pipeline, routed)
    assert _policy(pipeline, names[0]) == dg.RetryPolicy(
        max_retries=2, delay=0.01, backoff=dg.Backoff.EXPONENTIAL)
    _land(landing, "a.csv", routed)
    commits = _outage_at_commits(monkeypatch, UNREACHABLE, commits=1)
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert commits == ["Indeterminate", "ok"]
    assert result.success and _attempts(result) == 2
    meta = materializations(result)
    assert set(meta) == {f"ingest/{n}" for n in names}
    for m in meta.values():
        assert m[UPPER] == 1 and RECOVERED_FROM not in m  # written by the retry itself
    assert {n: _rows(pipeline, n) for n in names} == _expected(routed)


@pytest.fixture(params=["sqlite+files", pytest.param("postgres+s3", marks=[
    pytest.mark.postgres, pytest.mark.s3])])
def location(request: pytest.FixtureRequest, make_pipeline: Any,
             monkeypatch: pytest.MonkeyPatch) -> str:
    """The pipeline's persist location: the embedded default, or PostgreSQL + S3 (moto
    server). After ``make_pipeline``, which clears the machine's settings."""
    if request.param == "postgres+s3":
        monkeypatch.setenv("PERSIST_CONSENSUS_URI", request.getfixturevalue("pg_url"))
        monkeypatch.setenv("PERSIST_BLOB_URI", request.getfixturevalue("s3_uri"))
    return str(request.param)


@pytest.mark.parametrize("routed", [False, True], ids=["files", "route"])
def test_a_retry_after_a_lost_commit_reply_settles_the_write_instead_of_repeating_it(
        make_pipeline: Any, location: str, monkeypatch: pytest.MonkeyPatch,
        routed: bool) -> None:
    """The first attempt's commit lands, but its reply and every call after it are lost
    until the library gives up (Indeterminate). The retry finds that write committed
    (from the intent it recorded) and records it: the rows are in the shard once."""
    pipeline, landing, sensor, names = _setup(make_pipeline, routed)
    persist: Any = pipeline.defs.resources["persist"]
    assert persist.uris()[0].startswith("postgresql" if location == "postgres+s3"
                                        else "sqlite")
    _land(landing, "a.csv", routed)
    commits = _outage_at_commits(monkeypatch, REPLIES_LOST, commits=1)
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert commits == ["Indeterminate"]  # the retry committed nothing: it settled
    assert result.success and _attempts(result) == 2
    meta = materializations(result)
    assert set(meta) == {f"ingest/{n}" for n in names}
    for m in meta.values():
        assert m[RECOVERED_FROM] == result.run_id and m[UPPER] == 1
    assert {n: _rows(pipeline, n) for n in names} == _expected(routed)
    # The file is ingested: a re-run of its partition writes nothing.
    job = pipeline.defs.resolve_job_def("ingest_files_job")
    again = job.execute_in_process(instance=pipeline.instance, raise_on_error=False,
                                   partition_key=result.dagster_run.tags["dagster/partition"])
    assert again.success and materializations(again) == {}
    assert {n: _rows(pipeline, n) for n in names} == _expected(routed)


@pytest.mark.parametrize("routed", [False, True], ids=["files", "route"])
def test_a_transient_failure_after_the_commit_is_retried_and_recorded_not_rewritten(
        make_pipeline: Any, monkeypatch: pytest.MonkeyPatch, routed: bool) -> None:
    """The commit lands, then reading the shard's summary for a materialization fails
    (the database went away just then); for a route, after the first shard's
    materialization was recorded. The retry records what is missing and writes
    nothing."""
    import assets.ingestion as ingestion
    from persist_pipeline.exceptions import ConsensusUnavailable

    pipeline, landing, sensor, names = _setup(make_pipeline, routed)
    _land(landing, "a.csv", routed)
    real, calls = ingestion.write_metadata, []

    def failing_once(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == len(names):  # the last shard's, so a route records one first
            raise ConsensusUnavailable("connection refused")
        return real(*args, **kwargs)

    monkeypatch.setattr(ingestion, "write_metadata", failing_once)
    commits = _outage_at_commits(monkeypatch, UNREACHABLE, commits=0)
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert commits == ["ok"] and result.success and _attempts(result) == 2
    assert set(materializations(result)) == {f"ingest/{n}" for n in names}
    recorded_by_retry = [e for e in result.get_asset_materialization_events()
                         if RECOVERED_FROM in e.step_materialization_data.materialization
                         .metadata]
    assert len(recorded_by_retry) == 1  # the shard whose record the failure cut off
    assert {n: _rows(pipeline, n) for n in names} == _expected(routed)


@pytest.mark.parametrize("routed", [False, True], ids=["files", "route"])
def test_a_bad_file_fails_after_one_attempt_with_its_own_message(
        make_pipeline: Any, routed: bool) -> None:
    pipeline, landing, sensor, names = _setup(make_pipeline, routed)
    bad = landing / "bad.csv"
    bad.write_text("k,v,t,table\no1,10,zero,order\n" if routed else "k,v,t\no1,10,zero\n")
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert not result.success and _attempts(result) == 1
    [message] = failure_messages(result)
    assert f"{bad}: line 2" in message and "column t" in message
    assert "transient" not in message
    assert {n: _rows(pipeline, n) for n in names} == {n: (None, []) for n in names}


def test_a_file_of_route_values_no_shard_takes_fails_after_one_attempt(
        make_pipeline: Any) -> None:
    pipeline, landing, sensor, names = _setup(make_pipeline, routed=True)
    (landing / "a.csv").write_text("k,v,t,table\no1,10,0,invoice\n")
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert not result.success and _attempts(result) == 1
    [message] = failure_messages(result)
    assert "names no shard of route commerce ('invoice')" in message
    assert {n: _rows(pipeline, n) for n in names} == {n: (None, []) for n in names}


def test_with_retries_off_a_transient_failure_fails_once_and_a_rerun_writes_the_file(
        make_pipeline: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline, landing, sensor, _ = _setup(make_pipeline, False, {"retries": 0})
    assert _policy(pipeline, "orders") is None
    _land(landing, "a.csv", False)
    commits = _outage_at_commits(monkeypatch, UNREACHABLE, commits=1)
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert commits == ["Indeterminate"]
    assert not result.success and _attempts(result) == 1
    [message] = failure_messages(result)
    assert "transient" in message and "re-run this partition" in message
    assert _rows(pipeline, "orders") == (None, [])
    # What the message says to do: a re-run of the partition writes the file, once.
    job = pipeline.defs.resolve_job_def("ingest_files_job")
    rerun = job.execute_in_process(instance=pipeline.instance, raise_on_error=False,
                                   partition_key="orders/a.csv")
    assert rerun.success and commits == ["Indeterminate", "ok"]
    assert _rows(pipeline, "orders") == _expected(False)["orders"]


def test_a_run_whose_every_attempt_fails_transiently_says_so(
        make_pipeline: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """retries: 2 is three attempts, and the database is away at each one's commit: the
    run fails saying the failure was transient, on which attempt, and what to do."""
    pipeline, landing, sensor, _ = _setup(make_pipeline, False)
    _land(landing, "a.csv", False)
    commits = _outage_at_commits(monkeypatch, UNREACHABLE, commits=3)
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert commits == ["Indeterminate"] * 3
    assert not result.success and _attempts(result) == 3
    message = failure_messages(result)[-1]
    assert "Indeterminate" in message and "transient" in message
    assert "attempt 3 of 3" in message and "re-run this partition" in message
    assert _rows(pipeline, "orders") == (None, [])


@pytest.mark.parametrize("routed", [False, True], ids=["files", "route"])
def test_an_outage_that_outlasts_the_commit_fails_the_run_with_the_commits_error(
        make_pipeline: Any, monkeypatch: pytest.MonkeyPatch, routed: bool) -> None:
    """The database is still away when the step would expire its writers: the run fails
    with the commit's error (what decides the retry and what the user must read), never
    the expiry's, and the writers are left to their leases."""
    pipeline, landing, sensor, _ = _setup(make_pipeline, routed, {"retries": 0})
    _land(landing, "a.csv", routed)
    expiries: list[str] = []
    expire = WriteHandle.expire

    def counted(self: WriteHandle) -> None:
        expiries.append(self.shard_id)
        expire(self)

    monkeypatch.setattr(WriteHandle, "expire", counted)
    commits = _outage_at_commits(monkeypatch, UNREACHABLE, commits=1, lasting=True)
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert commits == ["Indeterminate"]
    assert not result.success and _attempts(result) == 1
    [message] = failure_messages(result)
    assert "Indeterminate" in message and "transient" in message
    assert expiries == []
