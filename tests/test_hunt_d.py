"""Adversarial tests (hunt D): Spark compaction, the compaction sensor and runs,
critical readers, leases, the IO manager."""

from __future__ import annotations

from typing import Any

import dagster as dg
import pytest

from assets.asset_keys import TAG_TRIGGER, compacted_key
from assets.runner import Tick
from tests.pipeline_support import (
    SYNTHETIC,
    Pipeline,
    check_results,
    failure_messages,
    make_pipeline,
    materializations,
    spark_session,
)

__all__ = ["make_pipeline", "spark_session"]


@pytest.mark.slow
@pytest.mark.spark
def test_compaction_run_of_a_shard_whose_since_reached_its_upper(
        make_pipeline: Any, spark_session: Any) -> None:
    """A shard whose readers released every time up to the upper (since == upper, a
    state docs/design.md names as legitimate) must still be compactable: the run's
    snapshot check must not refuse to read it and fail the whole run."""
    pipeline: Pipeline = make_pipeline({"clicks": {"source": SYNTHETIC}})
    client = pipeline.client()
    clicks = pipeline.shard_id("clicks")
    for _ in range(3):
        assert pipeline.ingest("clicks").success
    upper = client.shard_summaries()[clicks].upper
    reader = client.open_reader(clicks)
    reader.downgrade_since(upper)
    reader.expire()
    summary = client.shard_summaries()[clicks]
    assert summary.since == upper and summary.inline_bytes > 0

    request = dg.RunRequest(run_key="hunt-d-since-upper",
                            asset_selection=[compacted_key("clicks")],
                            tags={TAG_TRIGGER: "inline_pressure"})
    [result] = pipeline.launch_all("inline_pressure_sensor", Tick(run_requests=[request]))
    assert result.success, failure_messages(result)
    assert materializations(result)["compact/clicks"]["inline_bytes_after"] == 0
    assert check_results(result)["compact/clicks:snapshot_unchanged"].passed
