"""Schedules, evaluated on a real instance, and the runs they request.

Covers: ``compaction_schedule`` selects exactly the shards with pending work (and skips
when there is none); ``gc_schedule`` runs GC of every shard; ``shard_checks_schedule``
runs the inline-bytes and freshness checks.
"""

from __future__ import annotations

from typing import Any

from tests.pipeline_support import (
    SYNTHETIC,
    Pipeline,
    check_results,
    make_pipeline,
    materializations,
)

__all__ = ["make_pipeline"]  # the fixture, imported for pytest

SHARDS = {"clicks": {"source": SYNTHETIC},
          "stock": {"source": {**SYNTHETIC, "seed": 5}},
          "idle": {"source": {**SYNTHETIC, "seed": 6}}}


def test_compaction_schedule_selects_shards_with_pending_work(make_pipeline: Any) -> None:
    pipeline: Pipeline = make_pipeline(SHARDS, compaction={"schedule": "15 * * * *"})
    schedule = pipeline.defs.resolve_schedule_def("compaction_schedule")
    assert schedule.cron_schedule == "15 * * * *"
    assert schedule.job_name == "compaction_job"

    data = pipeline.evaluate_schedule("compaction_schedule")
    assert not data.run_requests
    assert "no shard has pending compaction work" in data.skip_message

    assert pipeline.ingest("clicks", "stock").success
    data = pipeline.evaluate_schedule("compaction_schedule")
    [request] = data.run_requests
    assert sorted(k.path[-1] for k in request.asset_selection) == ["clicks", "stock"]
    assert all(k.path[0] == "compacted" for k in request.asset_selection)
    assert request.tags["persist/trigger"] == "schedule"


def test_gc_schedule_collects_every_shard(make_pipeline: Any) -> None:
    pipeline: Pipeline = make_pipeline(SHARDS)
    assert pipeline.ingest("clicks").success
    data = pipeline.evaluate_schedule("gc_schedule")
    [request] = data.run_requests
    result = pipeline.launch_schedule_request("gc_schedule", request)
    assert result is not None and result.success
    assert result.dagster_run.tags["dagster/schedule_name"] == "gc_schedule"
    meta = materializations(result)
    assert set(meta) == {"gc/clicks", "gc/stock", "gc/idle"}
    assert meta["gc/clicks"]["shard_found"] is True
    assert meta["gc/idle"]["shard_found"] is False  # never written: nothing to collect
    for m in meta.values():
        assert {"seqnos_truncated", "blobs_deleted", "bytes_deleted", "live_blobs"} <= set(m)


def test_checks_schedule_runs_the_shard_checks(make_pipeline: Any) -> None:
    pipeline: Pipeline = make_pipeline(SHARDS)
    assert pipeline.ingest("clicks", "stock").success
    data = pipeline.evaluate_schedule("shard_checks_schedule")
    [request] = data.run_requests
    result = pipeline.launch_schedule_request("shard_checks_schedule", request)
    assert result is not None and result.success
    assert materializations(result) == {}  # checks only
    checks = check_results(result)
    for shard in ("clicks", "stock", "idle"):
        inline = checks[f"shards/{shard}:inline_bytes_within_max"]
        assert inline.passed
        assert inline.metadata["inline_max_bytes"].value == 8192
    assert checks["shards/clicks:upper_advanced_recently"].passed
    stale = checks["shards/idle:upper_advanced_recently"]
    assert not stale.passed and stale.severity.value == "WARN"
