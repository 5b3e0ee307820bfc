"""Alerts: the alert sensors and the ``alerts`` resource, with a real loopback webhook.

Covers: a shard above its limit, a compaction backlog and writes falling through to
blob storage each POST one Slack-compatible ``{"text": ...}`` message per episode and
record an observation in the Dagster event log; a failed compaction run alerts through
``compaction_failure_alert_sensor``; no alert text carries a secret; an unreachable
webhook does not break anything.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
import pytest

from assets.asset_keys import compacted_key, gc_key, shard_key
from assets.runner import launch
from resources.alerts import Alert, AlertsResource
from tests.pipeline_support import (
    SYNTHETIC,
    Pipeline,
    Webhook,
    evaluate_failure_sensor,
    make_pipeline,
    webhook,
)

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow

__all__ = ["make_pipeline", "webhook"]  # fixtures, imported for pytest

ALERT_SENSORS = ("inline_over_limit_alert_sensor", "compaction_backlog_alert_sensor",
                 "inline_fallthrough_alert_sensor")


def _tick_all(pipeline: Pipeline) -> None:
    for name in ALERT_SENSORS:
        tick = pipeline.ticker(name).tick()
        assert tick.run_requests == []  # alert sensors never start runs


def _observations(pipeline: Pipeline, key: dg.AssetKey) -> list[dict[str, Any]]:
    records = pipeline.instance.fetch_observations(key, limit=50).records
    return [{k: getattr(v, "value", v) for k, v in
             r.asset_observation.metadata.items()} for r in records]  # type: ignore[union-attr]



def test_shard_alerts_post_to_the_webhook_once_per_episode(
        make_pipeline: Any, webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSIST_ALERT_WEBHOOK_URL", webhook.url)
    pipeline: Pipeline = make_pipeline(
        {"clicks": {"source": SYNTHETIC}},
        inline_policy={"persist_inline_update_max_bytes": 2048},
        alerts={"over_limit_for_s": 0, "backlog_threshold": 0})
    _tick_all(pipeline)  # no shard yet: nothing to say
    assert webhook.bodies == []

    # One ~1.2 KB inline write: above the mark (0.5 * 2048) and one pending merge.
    assert pipeline.ingest("clicks").success
    _tick_all(pipeline)
    texts = [b["text"] for b in webhook.bodies]
    assert len(texts) == 2, texts
    assert "shard clicks" in texts[0] and "inline bytes, above its limit of 1024" in texts[0]
    assert "compaction backlog of 1 pending merges (threshold 0)" in texts[1]

    # The next writes cannot fit the 2048-byte budget: they fall through to blob.
    assert pipeline.ingest("clicks").success
    assert pipeline.ingest("clicks").success
    _tick_all(pipeline)
    assert len(webhook.bodies) == 3
    fell = webhook.bodies[2]["text"]
    assert "shard clicks: 2 write(s) fell through to blob storage" in fell
    assert "inline budget exhausted" in fell

    # Same episodes: no repeats.
    _tick_all(pipeline)
    assert len(webhook.bodies) == 3
    for body in webhook.bodies:
        assert set(body) == {"text"} and body["text"].startswith(":warning: *persist-pipeline*")
        assert "s3cr3tT0ken" not in body["text"] and "/services/" not in body["text"]
    assert all(path == "/services/T0001/B0002/s3cr3tT0ken" for path in webhook.paths)

    # Every alert is also in the Dagster event log, on the shard's asset.
    kinds = [o["alert"] for o in _observations(pipeline, shard_key("clicks"))]
    assert sorted(kinds) == ["compaction_backlog", "inline_fallthrough", "inline_over_limit"]
    assert [o["alert"] for o in _observations(pipeline, compacted_key("clicks"))] == [
        "compaction_backlog"]


def test_failed_compaction_run_alerts(make_pipeline: Any, webhook: Webhook,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERSIST_ALERT_WEBHOOK_URL", webhook.url)
    pipeline: Pipeline = make_pipeline({"clicks": {"source": SYNTHETIC}})
    # A consensus database that refuses connections, with a password in its URI.
    monkeypatch.setenv("PERSIST_CONSENSUS_URI",
                       "postgresql://app:hunter22@127.0.0.1:1/persist")
    job = pipeline.defs.resolve_job_def("compaction_job")
    result = job.execute_in_process(instance=pipeline.instance, raise_on_error=False,
                                    tags={"persist/shards": "clicks"})
    assert not result.success

    run = result.dagster_run
    assert evaluate_failure_sensor(pipeline, result) is None
    [body] = webhook.bodies
    text = body["text"]
    assert text.startswith(":rotating_light: *persist-pipeline* compaction run")
    assert run.run_id in text and "(shards clicks)" in text
    assert "127.0.0.1:1" in text  # the cause, with the database named ...
    assert "hunter22" not in text  # ... but never its password
    kinds = [o["alert"] for o in _observations(pipeline, compacted_key("clicks"))]
    assert kinds == ["compaction_run_failed"]

    # Failed runs that do not compact are not its business.
    failed_ingestion = pipeline.ingest("clicks")
    assert not failed_ingestion.success
    skip = evaluate_failure_sensor(pipeline, failed_ingestion)
    assert isinstance(skip, dg.SkipReason) and "does not compact" in skip.skip_message
    assert len(webhook.bodies) == 1


def test_alerts_resource_without_a_working_webhook(caplog: pytest.LogCaptureFixture) -> None:
    alert = Alert(kind="test", title="hello from s3://b/p?secret_access_key=K3Y")
    assert "K3Y" not in alert.text()
    assert AlertsResource().send(alert) is False  # no webhook: log only
    closed = AlertsResource(webhook_url="http://127.0.0.1:9/hooks/T/s3cr3t", timeout_s=2)
    assert closed.send(alert) is False  # unreachable: logged, not raised
    assert "s3cr3t" not in caplog.text and "http://127.0.0.1:9/***" in caplog.text
    assert AlertsResource(webhook_url="file:///etc/passwd").send(alert) is False


def test_a_failed_gc_step_in_a_compaction_run_is_not_a_compaction_alert(
        make_pipeline: Any, webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the GC and compaction crons tick together (gc at 03:00, compaction hourly),
    declarative automation requests compact/* and gc/* in one run. A GC step that fails
    there (a corrupt state record) after compaction went fine is no compaction failure:
    compaction_failure_alert_sensor does not report the shards' compaction as failed."""
    from persist_pipeline.consensus.base import VersionedData

    monkeypatch.setenv("PERSIST_ALERT_WEBHOOK_URL", webhook.url)
    pipeline: Pipeline = make_pipeline({"clicks": {"source": SYNTHETIC}},
                                       gc={"schedule": "0 3 * * *"})
    # A shard with nothing to compact, whose state record is corrupt: GC fails on it.
    client = pipeline.client()
    shard = pipeline.shard_id("clicks")
    client.open_writer(shard).expire()
    head = client.consensus.head(shard)
    assert head is not None
    assert client.consensus.compare_and_set(
        shard, head.seqno, VersionedData(head.seqno + 1, b"not a state", head.summary))

    request = dg.RunRequest(asset_selection=[compacted_key("clicks"), gc_key("clicks")],
                            tags={"persist/trigger": "automation"})
    result = launch(pipeline.defs, pipeline.instance, request,
                    sensor_name="persist_automation_sensor")
    assert result is not None and not result.success
    failures = [e for e in result.all_events
                if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert [e.step_key for e in failures] == ["persist_gc"]
    checks = {c.asset_key: c for c in result.get_asset_check_evaluations()}
    assert set(checks) == {compacted_key("clicks"), gc_key("clicks")}
    assert checks[compacted_key("clicks")].passed
    # The GC step's own check still ran and names the state that cannot be rebuilt.
    assert not checks[gc_key("clicks")].passed
    assert "CorruptState" in (checks[gc_key("clicks")].description or "")

    skip = evaluate_failure_sensor(pipeline, result)
    assert isinstance(skip, dg.SkipReason) and "persist_gc" in skip.skip_message
    assert webhook.bodies == []
    assert _observations(pipeline, compacted_key("clicks")) == []
