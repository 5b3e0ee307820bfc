"""The pipeline judges each shard by the inline max the shard recorded, not by its own
``inline_policy`` resource alone: writers configured otherwise keep within the recorded
one, so the pressure sensor, the ``inline_bytes_within_max`` check and the alerts go
by it (a real instance and code location, and a shard changed by
``set_inline_max_bytes``)."""

from __future__ import annotations

from typing import Any

import pytest

from assets.alert_sensors import AlertInputs, over_limit_rule
from assets.pipeline_config import ShardConfig
from persist_pipeline import ShardSummary
from tests.pipeline_support import SYNTHETIC, Pipeline, check_results, make_pipeline

#: The full tier only (``make test``): Dagster runs.
pytestmark = pytest.mark.slow

__all__ = ["make_pipeline"]  # the fixture, imported for pytest

#: pipeline_support's inline_policy resource: 4096 / 8192.
RESOURCE_MAX = 8192


def test_sensor_and_check_go_by_the_recorded_max(make_pipeline: Any) -> None:
    pipeline: Pipeline = make_pipeline({"clicks": {"source": SYNTHETIC},
                                        "stock": {"source": {**SYNTHETIC, "seed": 5}}})
    assert pipeline.ingest("clicks", "stock").success
    client = pipeline.client()
    clicks, stock = pipeline.shard_id("clicks"), pipeline.shard_id("stock")
    summaries = client.shard_summaries()
    # Created by the pipeline's writer: the resource's max is the shards' record.
    assert summaries[clicks].inline_max_bytes == summaries[stock].inline_max_bytes == \
        RESOURCE_MAX
    inline = summaries[clicks].inline_bytes
    assert 0 < inline < RESOURCE_MAX // 2  # below the resource's high-water mark
    sensor = pipeline.ticker("inline_pressure_sensor")
    assert sensor.tick().run_requests == []

    client.set_inline_max_bytes(clicks, inline - 1)  # below what the shard holds now
    [request] = sensor.tick().run_requests
    assert [k.path for k in request.asset_selection] == [["compact", "clicks"]]

    data = pipeline.evaluate_schedule("shard_checks_schedule")
    [run] = data.run_requests
    result = pipeline.launch_schedule_request("shard_checks_schedule", run)
    assert result is not None
    checks = check_results(result)
    over = checks["ingest/clicks:inline_bytes_within_max"]
    assert not over.passed
    assert over.metadata["inline_max_bytes"].value == inline - 1
    fine = checks["ingest/stock:inline_bytes_within_max"]
    assert fine.passed and fine.metadata["inline_max_bytes"].value == RESOURCE_MAX


def _summary(shard_id: str, inline_bytes: int, recorded: int | None) -> ShardSummary:
    return ShardSummary(shard_id, 5, 10, 0, inline_bytes, 1, 1, 0, 0, 0, recorded)


def test_over_limit_alert_goes_by_the_recorded_max() -> None:
    shards = [ShardConfig(name=n, shard_id=f"s-{n}", source=SYNTHETIC)
              for n in ("low", "high", "old")]
    summaries = {"s-low": _summary("s-low", 600, 1000),       # over half its record
                 "s-high": _summary("s-high", 6000, 1 << 20),  # over the resource's half
                 "s-old": _summary("s-old", 6000, None)}       # none recorded: the resource
    rule = over_limit_rule(0.5, 0)
    alerts, _ = rule(AlertInputs(shards, summaries, RESOURCE_MAX, 1000), {})
    assert sorted(a.metadata["shard"] for a in alerts) == ["low", "old"]
    low = next(a for a in alerts if a.metadata["shard"] == "low")
    assert low.metadata["limit_bytes"] == 500 and "is 1000" in low.details
