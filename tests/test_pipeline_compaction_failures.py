"""Compaction runs that meet trouble: a shard whose since reached its upper, one shard
that cannot be read among many (it fails alone, and the alert names only it), and the
pressure sensor's retry of a run that failed without changing the shard."""

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
    evaluate_failure_sensor,
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



def _alerts_on(pipeline: Pipeline, key: dg.AssetKey) -> list[str]:
    records = pipeline.instance.fetch_observations(key, limit=50).records
    return [r.asset_observation.metadata["alert"].value  # type: ignore[union-attr]
            for r in records]


def _failed_automation_run(pipeline: Pipeline) -> dg.ExecuteInProcessResult:
    """An hourly (automation) compaction run of shards ``good`` and ``bad``, where the
    bad shard's input part is gone (a corrupt store) so its merge cannot run."""
    for _ in range(2):  # two blob batches of one size: one pending merge reading both
        assert pipeline.ingest("good", "bad", events=400).success
    assert pipeline.ingest("good", "bad").success  # and inline data
    bad = pipeline.shard_id("bad")
    part = next(p for p in pipeline.data_dir.rglob("*.parquet") if bad in str(p))
    part.unlink()
    job = pipeline.defs.resolve_job_def("compaction_job")
    result = job.execute_in_process(
        instance=pipeline.instance, raise_on_error=False,
        asset_selection=[compacted_key("good"), compacted_key("bad")],
        tags={TAG_TRIGGER: "automation"})
    assert not result.success
    return result


GOOD_AND_BAD = {"good": {"source": SYNTHETIC}, "bad": {"source": {**SYNTHETIC, "seed": 7}}}


@pytest.mark.slow
@pytest.mark.spark
def test_one_broken_shard_does_not_stop_the_compaction_of_the_others(
        make_pipeline: Any, spark_session: Any) -> None:
    """compact_shards fails a broken shard's merge alone and commits the others
    (docs/design.md); the run's snapshot check, read before compacting, must not turn one
    unreadable shard into no compaction at all for every shard of the hourly run."""
    pipeline: Pipeline = make_pipeline(GOOD_AND_BAD)
    good = pipeline.shard_id("good")
    result = _failed_automation_run(pipeline)
    assert pipeline.client().shard_summaries()[good].inline_bytes == 0, \
        failure_messages(result)
    assert materializations(result)["compact/good"]["applied"] >= 1
    assert check_results(result)["compact/good:snapshot_unchanged"].passed
    assert not check_results(result)["compact/bad:snapshot_unchanged"].passed


@pytest.mark.slow
@pytest.mark.spark
def test_a_compaction_failure_alert_names_only_the_shards_that_failed(
        make_pipeline: Any, spark_session: Any) -> None:
    """The failure alert of a compaction run where one shard failed is recorded on that
    shard, not on every shard the run selected (an hourly run selects them all: at 1,000
    shards, 1,000 observations saying healthy shards' compaction failed)."""
    pipeline: Pipeline = make_pipeline(GOOD_AND_BAD)
    result = _failed_automation_run(pipeline)
    assert evaluate_failure_sensor(pipeline, result) is None
    assert _alerts_on(pipeline, compacted_key("bad")) == ["compaction_run_failed"]
    assert _alerts_on(pipeline, compacted_key("good")) == []


@pytest.mark.slow
@pytest.mark.spark
def test_the_pressure_sensor_retries_a_failed_compaction_run(
        make_pipeline: Any, spark_session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/pipeline.md: after a failed run the sensor asks again after 10 minutes. A run
    that failed before it touched the shard (the database was briefly unreachable) left
    the shard's seqno as it was, so the retry must not reuse the failed run's key, which
    the daemon never launches twice: the shard would wait for its next write."""
    import json

    pipeline: Pipeline = make_pipeline({"clicks": {"source": SYNTHETIC}})
    clicks = pipeline.shard_id("clicks")
    sensor = pipeline.ticker("inline_pressure_sensor")
    requests: list[dg.RunRequest] = []
    for _ in range(6):
        assert pipeline.ingest("clicks").success
        requests = sensor.tick().run_requests
        if requests:
            break
    [request] = requests
    with monkeypatch.context() as m:
        m.setenv("PERSIST_CONSENSUS_URI", "postgresql://app@127.0.0.1:1/persist")
        [failed] = pipeline.launch_all("inline_pressure_sensor", Tick(run_requests=[request]))
    assert not failed.success

    # Ten minutes and more later (the cursor's episode started 601 s ago).
    cursor = json.loads(sensor.cursor or "{}")
    cursor["episodes"][clicks]["at_ms"] -= 601_000
    sensor.cursor = json.dumps(cursor)
    [retry] = sensor.tick().run_requests
    results = pipeline.launch_all("inline_pressure_sensor", Tick(run_requests=[retry]))
    assert [r.success for r in results] == [True], "the retry was never launched"
    assert pipeline.client().shard_summaries()[clicks].inline_bytes == 0


@pytest.mark.slow
def test_the_pressure_sensor_keeps_ticking_after_a_shard_leaves_the_config(
        make_pipeline: Any) -> None:
    """A shard removed from (or renamed in) pipeline.yaml while its compaction was
    requested leaves its crossing in the sensor's cursor: the sensor of the new config
    keeps ticking (it does not fail every tick on the shard it no longer knows) and
    still requests compaction for the shards it has."""
    from assets.runner import SensorTicker

    stock = {**SYNTHETIC, "events_per_write": 5, "seed": 9}
    pipeline: Pipeline = make_pipeline({"clicks": {"source": SYNTHETIC},
                                        "stock": {"source": stock}})
    sensor = pipeline.ticker("inline_pressure_sensor")
    requests: list[dg.RunRequest] = []
    for _ in range(6):
        assert pipeline.ingest("clicks", "stock").success
        requests = sensor.tick().run_requests
        if requests:
            break
    assert [k.path for k in requests[0].asset_selection] == [["compact", "clicks"]]

    # The same location and instance, loaded from a config without clicks.
    without: Pipeline = make_pipeline({"stock": {"source": stock}})
    ticker = SensorTicker(without.defs, pipeline.instance, "inline_pressure_sensor",
                          cursor=sensor.cursor)
    tick = ticker.tick()
    assert tick.run_requests == [] and "clicks" not in (tick.skip_reason or "")
    for _ in range(6):
        assert without.ingest("stock", events=30).success
        tick = ticker.tick()
        if tick.run_requests:
            break
    [request] = tick.run_requests
    assert [k.path for k in request.asset_selection] == [["compact", "stock"]]


@pytest.mark.slow
def test_writes_falling_through_with_nothing_inline_request_no_compaction(
        make_pipeline: Any) -> None:
    """With no inline budget (persist_inline_update_max_bytes 0, as
    PERSIST_INLINE_UPDATE_MAX_BYTES=0 sets it), every small write falls through to blob
    storage. Compaction frees no budget there (nothing is inline), so the pressure
    sensor must not request a compaction run after every batch of writes, forever."""
    pipeline: Pipeline = make_pipeline(
        {"clicks": {"source": SYNTHETIC}},
        inline_policy={"persist_inline_update_threshold_bytes": 4096,
                       "persist_inline_update_max_bytes": 0})
    sensor = pipeline.ticker("inline_pressure_sensor")
    assert sensor.tick().run_requests == []  # no shard yet
    requests: list[dg.RunRequest] = []
    for _ in range(3):
        result = pipeline.ingest("clicks")
        assert result.success
        assert materializations(result)["ingest/clicks"]["Fell back to blob (inline budget "
                                                         "full)"] is True
        tick = sensor.tick()
        requests.extend(tick.run_requests)
        # Launched as the daemon would: they find nothing to compact, and succeed.
        assert all(r.success for r in pipeline.launch_all("inline_pressure_sensor", tick))
    summary = pipeline.client().shard_summaries()[pipeline.shard_id("clicks")]
    assert summary.inline_fallbacks >= 3 and summary.inline_bytes == 0
    assert requests == []
