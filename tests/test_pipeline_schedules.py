"""Time-based automation, evaluated on a real instance, and the runs it requests.

Covers: declarative automation (``persist_automation_sensor``) requests compaction once
per tick of the compaction cron and the run compacts exactly the shards with work
(Spark), and GCs every shard on the daily tick; the GC job collects every shard;
``shard_checks_schedule`` runs the inline-bytes and freshness checks (a never-written
shard is not stale).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
import pytest

from assets import checks as checks_module
from assets.runner import launch
from tests.pipeline_support import (
    SYNTHETIC,
    Pipeline,
    check_results,
    make_pipeline,
    materializations,
)

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow

__all__ = ["make_pipeline"]  # the fixture, imported for pytest

SHARDS = {"clicks": {"source": SYNTHETIC},
          "stock": {"source": {**SYNTHETIC, "seed": 5}, "freshness_max_age_s": 1},
          "idle": {"source": {**SYNTHETIC, "seed": 6}}}


def _requested(pipeline: Pipeline, when: datetime, cursor: Any = None) -> tuple[list[str], Any]:
    """The assets declarative automation requests at ``when`` (and the new cursor)."""
    result = dg.evaluate_automation_conditions(
        defs=pipeline.defs, instance=pipeline.instance, evaluation_time=when, cursor=cursor,
        asset_selection=dg.AssetSelection.groups("compaction", "maintenance"))
    keys = pipeline.defs.resolve_asset_graph().get_all_asset_keys()
    return sorted(k.to_user_string() for k in keys if result.get_requested_partitions(k)), \
        result.cursor


def test_automation_compacts_shards_with_work_and_collects_daily(
        make_pipeline: Any) -> None:
    pipeline: Pipeline = make_pipeline(SHARDS, compaction={"schedule": "15 * * * *"})
    sensor = pipeline.defs.resolve_sensor_def("persist_automation_sensor")
    assert isinstance(sensor, dg.AutomationConditionSensorDefinition)
    assert {s.name for s in pipeline.defs.schedules or []} == {"shard_checks_schedule"}
    start = datetime(2026, 11, 23, 10, 20, tzinfo=UTC)  # just after a :15 tick

    requested, cursor = _requested(pipeline, start)
    assert requested == []  # no tick passed yet
    assert pipeline.ingest("clicks", "stock").success
    requested, cursor = _requested(pipeline, start + timedelta(minutes=10), cursor)
    assert requested == []  # the next :15 tick has not passed yet
    requested, cursor = _requested(pipeline, start + timedelta(minutes=56), cursor)
    assert requested == ["compact/clicks", "compact/idle", "compact/stock"]
    # Requested once per tick: the next evaluation does not ask again.
    assert _requested(pipeline, start + timedelta(minutes=57), cursor)[0] == []

    # The run compacts the shards with work; the idle one is skipped, not materialized.
    request = dg.RunRequest(asset_selection=[dg.AssetKey(k.split("/")) for k in requested],
                            tags={"persist/trigger": "automation"})
    result = launch(pipeline.defs, pipeline.instance, request, job_name="compaction_job")
    assert result is not None and result.success
    meta = materializations(result)
    assert set(meta) == {"compact/clicks", "compact/stock"}
    assert meta["compact/clicks"]["inline_bytes_after"] == 0
    checks = check_results(result)
    assert set(checks) == {"compact/clicks:snapshot_unchanged",
                           "compact/stock:snapshot_unchanged", "compact/idle:snapshot_unchanged"}
    assert all(c.passed for c in checks.values())
    # The idle shard's check says why it compared nothing.
    assert "nothing to compact" in (checks["compact/idle:snapshot_unchanged"].description or "")

    # The daily GC tick (30 3 * * *) requests GC of every shard, written or not.
    requested, _ = _requested(pipeline, start + timedelta(hours=18), cursor)
    assert {"gc/clicks", "gc/stock", "gc/idle"} <= set(requested)


def test_gc_run_collects_every_shard(make_pipeline: Any) -> None:
    pipeline: Pipeline = make_pipeline(SHARDS)
    assert pipeline.ingest("clicks").success
    result = pipeline.defs.resolve_job_def("gc_job").execute_in_process(
        instance=pipeline.instance, raise_on_error=False)
    assert result.success
    meta = materializations(result)
    assert set(meta) == {"gc/clicks", "gc/stock", "gc/idle"}
    assert meta["gc/clicks"]["shard_found"] is True
    assert meta["gc/idle"]["shard_found"] is False  # never written: nothing to collect
    for m in meta.values():
        assert {"seqnos_truncated", "blobs_deleted", "bytes_deleted", "live_blobs"} <= set(m)
    # After each GC, its shard's stores are checked: all intact here.
    checks = check_results(result)
    assert set(checks) == {"gc/clicks:stores_intact", "gc/stock:stores_intact",
                           "gc/idle:stores_intact"}
    assert all(c.passed for c in checks.values())
    clicks = checks["gc/clicks:stores_intact"].metadata
    assert clicks["inline_parts"].value >= 1 and clicks["rollups"].value >= 1
    assert clicks["problems"].value == 0
    assert "never been written" in (checks["gc/idle:stores_intact"].description or "")


def test_the_gc_check_fails_naming_a_lost_part(make_pipeline: Any) -> None:
    """A part the shard references deleted behind the library's back (a bucket
    lifecycle rule, a hand-made delete): the next GC run's check fails, naming it."""
    pipeline: Pipeline = make_pipeline(SHARDS)
    assert pipeline.ingest("clicks").success
    client = pipeline.client()
    shard = pipeline.shard_id("clicks")
    upper = client.inspect(shard)["upper"]
    n = 5000
    with client.open_writer(shard) as writer:  # a write too big to inline: a Parquet part
        writer.compare_and_append(
            [(b"key-%06d" % i, b"v", upper, 1) for i in range(n)], upper, upper + 1)
    state = client._machine(shard).fetch_latest()
    [part] = [p for b in state.batches.values() for p in b.hollow_parts()]
    client.blobs.store(part.store).delete(part.key)
    result = pipeline.defs.resolve_job_def("gc_job").execute_in_process(
        instance=pipeline.instance, raise_on_error=False)
    assert result.success  # the check fails, not the step: GC itself did its work
    check = check_results(result)["gc/clicks:stores_intact"]
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    assert check.metadata["problems"].value == 1
    assert part.key in check.metadata["lost_or_damaged"].value
    assert "1 blob(s)" in (check.description or "") and "missing" in check.description
    assert check_results(result)["gc/stock:stores_intact"].passed


class _WallClockAhead:
    """The ``time`` module as the shard checks read it, ``by_s`` seconds ahead: their wall
    clock (the one clock the freshness check reads) has moved on as a wait would."""

    def __init__(self, by_s: float) -> None:
        self.by_s = by_s

    def time(self) -> float:
        return time.time() + self.by_s


def test_checks_schedule_runs_the_shard_checks(make_pipeline: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline: Pipeline = make_pipeline(SHARDS)
    assert pipeline.ingest("clicks", "stock").success
    data = pipeline.evaluate_schedule("shard_checks_schedule")
    [request] = data.run_requests
    result = pipeline.launch_schedule_request("shard_checks_schedule", request)
    assert result is not None and result.success
    assert materializations(result) == {}  # checks only
    checks = check_results(result)
    for shard in ("clicks", "stock", "idle"):
        inline = checks[f"ingest/{shard}:inline_bytes_within_max"]
        assert inline.passed
        assert inline.metadata["inline_max_bytes"].value == 8192
    assert checks["ingest/clicks:upper_advanced_recently"].passed
    # Never written: nothing to be fresh about yet, so no warning.
    idle = checks["ingest/idle:upper_advanced_recently"]
    assert idle.passed and "never been written" in idle.description
    # Written once, longer ago than its 1 s limit: stale, a warning. The age is the
    # check's wall clock minus the run's materialization time in Dagster's event log.
    monkeypatch.setattr(checks_module, "time", _WallClockAhead(1.2))
    again = pipeline.launch_schedule_request("shard_checks_schedule", request)
    assert again is not None and again.success
    stale = check_results(again)["ingest/stock:upper_advanced_recently"]
    assert not stale.passed and stale.severity.value == "WARN"


def test_gc_runs_when_its_tick_comes_with_the_compaction_tick(make_pipeline: Any) -> None:
    """GC at 03:00 and compaction hourly: both ticks pass at once, and declarative
    automation requests compact/* and gc/* in one run. Compaction skips the shards with
    nothing to compact (no materialization); GC must still collect every shard, not be
    skipped as a step downstream of an output that was not materialized."""
    pipeline: Pipeline = make_pipeline(SHARDS, gc={"schedule": "0 3 * * *"})
    assert pipeline.ingest("clicks").success
    client = pipeline.client()
    client.compact(pipeline.shard_id("clicks"))  # in process: nothing left to compact
    start = datetime(2026, 11, 23, 2, 30, tzinfo=UTC)
    _, cursor = _requested(pipeline, start)
    requested, _ = _requested(pipeline, start + timedelta(hours=1), cursor)
    assert requested == ["compact/clicks", "compact/idle", "compact/stock",
                         "gc/clicks", "gc/idle", "gc/stock"]
    # One run for all of them: the automation sensor groups assets without partitions.
    request = dg.RunRequest(asset_selection=[dg.AssetKey(k.split("/")) for k in requested],
                            tags={"persist/trigger": "automation"})
    result = launch(pipeline.defs, pipeline.instance, request,
                    sensor_name="persist_automation_sensor")
    assert result is not None and result.success
    meta = materializations(result)
    assert {k for k in meta if k.startswith("gc/")} == {"gc/clicks", "gc/idle", "gc/stock"}
    assert meta["gc/clicks"]["shard_found"] is True
    assert not [k for k in meta if k.startswith("compact/")]  # nothing had work


def test_the_gc_check_fails_naming_a_lost_state_rollup_and_the_others_still_run(
        make_pipeline: Any) -> None:
    """The rollup the shard's state is rebuilt from deleted behind the library's back:
    the state cannot be rebuilt, so GC of that shard cannot run; its check fails naming
    the lost rollup, and the other shards are still collected and checked."""
    pipeline: Pipeline = make_pipeline(SHARDS)
    assert pipeline.ingest("clicks").success
    assert pipeline.defs.resolve_job_def("gc_job").execute_in_process(
        instance=pipeline.instance, raise_on_error=False).success
    client = pipeline.client()
    shard = pipeline.shard_id("clicks")
    latest = client._machine(shard).fetch_latest().latest_rollup()
    assert latest is not None
    client.blobs.main.delete(latest.key)
    result = pipeline.defs.resolve_job_def("gc_job").execute_in_process(
        instance=pipeline.instance, raise_on_error=False)
    checks = check_results(result)
    check = checks["gc/clicks:stores_intact"]
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    assert latest.key in (check.description or "")
    assert checks["gc/stock:stores_intact"].passed
    meta = materializations(result)
    assert "gc/stock" in meta and "gc/clicks" not in meta
    # That shard's GC did not run: the step fails, with the typed cause.
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert "CorruptState" in str(failure.step_failure_data.error)
