"""Sensors: landing files, inline pressure (starts compaction), and alerts.

- ``NAME_landing_sensor`` (one per ``files`` shard): each new landed file becomes a
  dynamic partition ``NAME/<file>`` of ``ingest/NAME`` and one run of ``ingest_files_job`` whose run
  key is the file's identity (name, size, mtime). The cursor remembers the identities
  already requested, Dagster never reuses a run key, files already ingested by a run
  launched by hand are not requested, and the asset itself writes nothing for a file
  version it already ingested: a file is ingested exactly once. A bad file's failed run
  is not retried (land a fixed file, or re-run its partition). A missing or unreadable
  landing location fails the tick with a message saying so; files of other formats
  are named in the tick's skip reason.
- ``inline_pressure_sensor``: finds the shards whose inline bytes reached the high-water
  mark (``high_water_fraction`` of ``persist_inline_update_max_bytes``, read from the
  ``inline_policy`` resource) or whose writes started falling through to blob storage,
  and requests ONE compaction run for them, with a run key per crossing. While that run
  has not finished, the shard is not requested again; a shard that is still (or again)
  over the mark after its run succeeded is a new crossing (after a failed run, the
  sensor waits ``retry_after_s`` before asking again).
- Alert sensors (to the ``alerts`` resource): ``inline_over_limit_alert_sensor`` (a shard
  above its high-water mark for longer than ``over_limit_for_s``),
  ``compaction_backlog_alert_sensor`` (pending merges over ``backlog_threshold``),
  ``inline_fallthrough_alert_sensor`` (writes falling through to blob storage because
  the inline budget is exhausted), and ``compaction_failure_alert_sensor`` (any failed
  compaction run).

Every shard-level sensor reads ``PersistClient.shard_summaries()``, one consensus query
whatever the size of the shards' states; none of them reads a state.
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

from assets.asset_keys import (
    COMPACTION_JOB,
    FILES_PARTITIONS,
    LANDING_JOB,
    TAG_FILE,
    TAG_SHARDS,
    TAG_TRIGGER,
    AssetJob,
    compacted_key,
    file_partition_key,
    shard_key,
)
from assets.ingestion import LANDED_FILES, ingested_by
from assets.pipeline_config import FileSource, ShardConfig
from assets.sources import describe, scan_landing
from persist_pipeline import ShardSummary
from resources.alerts import Alert, AlertsResource
from resources.env import redact_text
from resources.inline_policy import InlinePolicyResource
from resources.persist import PersistResource

RUN_KEY_TAG = "dagster/run_key"


def _status(running: bool) -> dg.DefaultSensorStatus:
    return dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED


def _load_cursor(cursor: str | None) -> dict[str, Any]:
    if not cursor:
        return {}
    try:
        value = json.loads(cursor)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _now_ms() -> int:
    return int(time.time() * 1000)


# --- landing files -------------------------------------------------------------------------


def build_landing_sensor(shard: ShardConfig, job: AssetJob, *,
                         running: bool = True) -> dg.SensorDefinition:
    """One partition and one ingestion run per new file in the ``files`` source of
    ``shard``."""
    source = shard.source
    assert isinstance(source, FileSource), "landing sensors watch files sources"
    key = shard_key(shard.name)

    @dg.sensor(name=f"{shard.name}_landing_sensor", job=job,
               minimum_interval_seconds=source.sensor_interval_s,
               default_status=_status(running),
               description=f"Each new file in {describe_source_template(source)} becomes a "
                           f"partition of ingest/{shard.name} ({shard.name}/<file>) and one "
                           f"run of {LANDING_JOB} (run key: the file's name, size and "
                           "mtime). Fails the tick if the location is missing or cannot be "
                           "listed.")
    def landing_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        seen = set(_load_cursor(context.cursor).get("seen", []))
        landing = scan_landing(source)  # LandingLocationError fails the tick, clearly
        requests, already, added = [], [], []
        for f in landing.files:
            if f.identity in seen:
                continue
            partition = file_partition_key(shard.name, f.name)
            if context.instance.has_dynamic_partition(FILES_PARTITIONS, partition):
                if ingested_by(context.instance, key, partition, f.identity):
                    already.append(f.name)  # e.g. materialized by hand: not again
                    continue
            else:
                added.append(partition)
            requests.append(dg.RunRequest(
                run_key=f"{shard.name}:{f.identity}", partition_key=partition,
                asset_selection=[key],
                tags={TAG_SHARDS: shard.name, TAG_FILE: f.name, TAG_TRIGGER: "landing"}))
        # Only identities still landed are kept: the cursor stays as small as the folder.
        cursor = json.dumps({"seen": sorted(f.identity for f in landing.files)})
        notes = []
        if already:
            notes.append(f"{len(already)} already ingested ({', '.join(already[:5])})")
        if landing.ignored:
            shown = ", ".join(landing.ignored[:5]) + (", ..." if len(landing.ignored) > 5
                                                       else "")
            notes.append(f"{len(landing.ignored)} file(s) ignored, not "
                         f"{'/'.join(source.formats)}: {shown}")
            context.log.warning(f"{describe(source)}: {notes[-1]}")
        if not requests:
            reason = f"no new file in {describe(source)}"
            return dg.SensorResult(skip_reason="; ".join([reason, *notes]), cursor=cursor)
        return dg.SensorResult(
            run_requests=requests, cursor=cursor,
            dynamic_partitions_requests=[LANDED_FILES.build_add_request(added)] if added
            else [])

    return landing_sensor


def describe_source_template(source: FileSource) -> str:
    """The landing location as configured (templates unexpanded), redacted."""
    return redact_text(source.uri)


# --- inline pressure -----------------------------------------------------------------------


def _run_state(instance: dg.DagsterInstance, run_key: str) -> str:
    """``none`` (no run yet), ``active``, ``succeeded`` or ``failed`` for ``run_key``."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={RUN_KEY_TAG: run_key}), limit=1)
    if not runs:
        return "none"
    if not runs[0].is_finished:
        return "active"
    return "succeeded" if runs[0].is_success else "failed"


def build_inline_pressure_sensor(shards: Sequence[ShardConfig], *,
                                 high_water_fraction: float, interval_s: int,
                                 job: AssetJob | dg.JobDefinition,
                                 running: bool = True,
                                 retry_after_s: int = 600) -> dg.SensorDefinition:
    """The sensor that requests one compaction run per crossing of the high-water mark.

    Args:
        shards: the shards to watch.
        high_water_fraction: the fraction of ``persist_inline_update_max_bytes`` at which
            a shard needs compaction.
        interval_s: minimum seconds between ticks.
        job: the compaction job (runs select a subset of its assets).
        running: the sensor's default status.
        retry_after_s: a crossing whose run failed, or was requested but never
            launched, is requested again after this long (a failing compaction does not
            become a run per tick; ``compaction_failure_alert_sensor`` reports it).
    """
    by_id = {s.shard_id: s for s in shards}

    @dg.sensor(name="inline_pressure_sensor", job=job, minimum_interval_seconds=interval_s,
               default_status=_status(running),
               description="Requests one Spark compaction run for the shards whose inline "
                           f"bytes reached {high_water_fraction:.0%} of "
                           "persist_inline_update_max_bytes, or whose writes fall through to "
                           "blob storage. Reads one summary per shard (one query).")
    def inline_pressure_sensor(context: dg.SensorEvaluationContext, persist: PersistResource,
                               inline_policy: InlinePolicyResource) -> dg.SensorResult:
        cursor = _load_cursor(context.cursor)
        episodes: dict[str, dict[str, Any]] = dict(cursor.get("episodes", {}))
        fallbacks: dict[str, int] = dict(cursor.get("fallbacks", {}))
        summaries = persist.client().shard_summaries()
        high_water = inline_policy.high_water_bytes(high_water_fraction)
        now = _now_ms()
        crossing: list[tuple[ShardConfig, ShardSummary]] = []
        for shard_id, shard in by_id.items():
            summary = summaries.get(shard_id)
            if summary is None:
                episodes.pop(shard_id, None)
                continue
            previous = fallbacks.get(shard_id, summary.inline_fallbacks)
            fallbacks[shard_id] = summary.inline_fallbacks
            hot = summary.inline_bytes >= high_water or summary.inline_fallbacks > previous
            if not hot:
                episodes.pop(shard_id, None)
                continue
            episode = episodes.get(shard_id)
            if episode is not None:
                state = _run_state(context.instance, episode["run_key"])
                waiting = state == "active" or (
                    state in ("none", "failed")
                    and now - episode["at_ms"] < retry_after_s * 1000)
                if waiting:
                    continue  # this crossing's run is still to come, or backing off
            crossing.append((shard, summary))
        if crossing:
            run_key = "inline-pressure:" + ",".join(
                f"{shard.name}@{summary.seqno}" for shard, summary in crossing)
            for shard, _ in crossing:
                episodes[shard.shard_id] = {"run_key": run_key, "at_ms": now}
            names = ",".join(shard.name for shard, _ in crossing)
            context.log.info(f"inline pressure on {names}: requesting compaction ({run_key})")
            request = dg.RunRequest(
                run_key=run_key,
                asset_selection=[compacted_key(shard.name) for shard, _ in crossing],
                tags={TAG_SHARDS: names, TAG_TRIGGER: "inline_pressure"})
        new_cursor = json.dumps({"episodes": episodes, "fallbacks": fallbacks},
                                sort_keys=True)
        if not crossing:
            waiting = sorted(by_id[s].name for s in episodes)
            reason = (f"compaction already requested for {', '.join(waiting)}" if waiting
                      else f"no shard at {high_water} inline bytes or falling through")
            return dg.SensorResult(skip_reason=reason, cursor=new_cursor)
        return dg.SensorResult(run_requests=[request], cursor=new_cursor)

    return inline_pressure_sensor


# --- alerts --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlertInputs:
    """What an alert rule sees on one tick."""

    shards: Sequence[ShardConfig]
    summaries: Mapping[str, ShardSummary]
    inline_max_bytes: int
    now_ms: int


#: A rule maps (inputs, its state from the previous tick) to (alerts, its new state).
AlertRule = Callable[[AlertInputs, dict[str, Any]], tuple[list[Alert], dict[str, Any]]]


def over_limit_rule(high_water_fraction: float, over_for_s: int) -> AlertRule:
    """A shard at or above its high-water mark for longer than ``over_for_s``: once per
    episode."""

    def rule(inputs: AlertInputs, state: dict[str, Any]) -> tuple[list[Alert], dict[str, Any]]:
        high_water = max(1, int(inputs.inline_max_bytes * high_water_fraction))
        alerts, new = [], {}
        for shard in inputs.shards:
            summary = inputs.summaries.get(shard.shard_id)
            if summary is None or summary.inline_bytes < high_water:
                continue
            entry = state.get(shard.shard_id) or {"since_ms": inputs.now_ms, "alerted": False}
            over_s = (inputs.now_ms - entry["since_ms"]) / 1000
            if not entry["alerted"] and over_s >= over_for_s:
                entry = {**entry, "alerted": True}
                alerts.append(Alert(
                    kind="inline_over_limit",
                    title=f"shard {shard.name}: {summary.inline_bytes} inline bytes, above its "
                          f"limit of {high_water} for {over_s:.0f} s",
                    details=f"persist_inline_update_max_bytes is {inputs.inline_max_bytes}; "
                            f"{summary.pending_merges} pending merge(s). Compaction has not "
                            "brought it down: check the compaction runs.",
                    asset_keys=(shard_key(shard.name),),
                    metadata={"shard": shard.name, "inline_bytes": summary.inline_bytes,
                              "limit_bytes": high_water, "seconds_over": round(over_s, 1)}))
            new[shard.shard_id] = entry
        return alerts, new

    return rule


def backlog_rule(threshold: int) -> AlertRule:
    """A shard with more than ``threshold`` pending merge requests: once per episode."""

    def rule(inputs: AlertInputs, state: dict[str, Any]) -> tuple[list[Alert], dict[str, Any]]:
        alerts, new = [], {}
        for shard in inputs.shards:
            summary = inputs.summaries.get(shard.shard_id)
            if summary is None or summary.pending_merges <= threshold:
                continue
            if not state.get(shard.shard_id):
                alerts.append(Alert(
                    kind="compaction_backlog",
                    title=f"shard {shard.name}: compaction backlog of "
                          f"{summary.pending_merges} pending merges (threshold {threshold})",
                    details=f"{summary.num_batches} batches, {summary.inline_bytes} inline "
                            "bytes.",
                    asset_keys=(shard_key(shard.name), compacted_key(shard.name)),
                    metadata={"shard": shard.name, "pending_merges": summary.pending_merges,
                              "threshold": threshold, "batches": summary.num_batches}))
            new[shard.shard_id] = True
        return alerts, new

    return rule


def fallthrough_rule() -> AlertRule:
    """Writes of a shard falling through to blob storage (inline budget exhausted): once
    when it starts, again only after a tick without new fall-throughs."""

    def rule(inputs: AlertInputs, state: dict[str, Any]) -> tuple[list[Alert], dict[str, Any]]:
        alerts, new = [], {}
        for shard in inputs.shards:
            summary = inputs.summaries.get(shard.shard_id)
            if summary is None:
                continue
            entry = state.get(shard.shard_id)
            count = summary.inline_fallbacks
            if entry is None:  # first sight: a baseline, not news
                new[shard.shard_id] = {"fallbacks": count, "alerting": False}
                continue
            delta = count - entry["fallbacks"]
            alerting = delta > 0
            if alerting and not entry["alerting"]:
                alerts.append(Alert(
                    kind="inline_fallthrough",
                    title=f"shard {shard.name}: {delta} write(s) fell through to blob storage "
                          "(inline budget exhausted)",
                    details=f"{summary.inline_bytes} of {inputs.inline_max_bytes} inline bytes "
                            "used; each such write costs an object-store PUT. Compaction "
                            "frees the budget.",
                    asset_keys=(shard_key(shard.name),),
                    metadata={"shard": shard.name, "new_fallthroughs": delta,
                              "total_fallthroughs": count,
                              "inline_bytes": summary.inline_bytes}))
            new[shard.shard_id] = {"fallbacks": count, "alerting": alerting}
        return alerts, new

    return rule


def build_alert_sensor(name: str, description: str, shards: Sequence[ShardConfig],
                       rule: AlertRule, *, interval_s: int,
                       running: bool = True) -> dg.SensorDefinition:
    """A sensor that evaluates ``rule`` on the shards' summaries and sends its alerts."""

    @dg.sensor(name=name, minimum_interval_seconds=interval_s,
               default_status=_status(running), description=description)
    def alert_sensor(context: dg.SensorEvaluationContext, persist: PersistResource,
                     inline_policy: InlinePolicyResource,
                     alerts: AlertsResource) -> dg.SensorResult:
        state = _load_cursor(context.cursor)
        inputs = AlertInputs(shards, persist.client().shard_summaries(),
                             inline_policy.max_bytes, _now_ms())
        fired, new_state = rule(inputs, state)
        for alert in fired:
            alerts.send(alert, context)
        reason = f"{len(fired)} alert(s) sent" if fired else "nothing to alert"
        return dg.SensorResult(skip_reason=reason, cursor=json.dumps(new_state, sort_keys=True))

    return alert_sensor


def build_shard_alert_sensors(shards: Sequence[ShardConfig], *, high_water_fraction: float,
                              over_limit_for_s: int, backlog_threshold: int, interval_s: int,
                              running: bool = True) -> list[dg.SensorDefinition]:
    """The three shard-level alert sensors."""
    return [
        build_alert_sensor(
            "inline_over_limit_alert_sensor",
            f"Alerts when a shard stays at or above {high_water_fraction:.0%} of its inline "
            f"budget for more than {over_limit_for_s} s.", shards,
            over_limit_rule(high_water_fraction, over_limit_for_s), interval_s=interval_s,
            running=running),
        build_alert_sensor(
            "compaction_backlog_alert_sensor",
            f"Alerts when a shard has more than {backlog_threshold} pending merge requests.",
            shards, backlog_rule(backlog_threshold), interval_s=interval_s, running=running),
        build_alert_sensor(
            "inline_fallthrough_alert_sensor",
            "Alerts when writes fall through to blob storage because a shard's inline "
            "budget is exhausted.", shards, fallthrough_rule(), interval_s=interval_s,
            running=running),
    ]


def _failure_text(event: dg.DagsterEvent) -> str:
    """A step failure's message: a ``dg.Failure``'s description, else the error's."""
    data: Any = event.event_specific_data
    user = getattr(data, "user_failure_data", None)
    if user is not None and user.description:
        return str(user.description).strip()
    error = getattr(data, "error", None)
    if error is None:
        return ""
    if error.cls_name == "DagsterExecutionStepExecutionError" and error.cause is not None:
        error = error.cause  # the exception the step raised
    return str(error.message).strip()


def build_compaction_failure_sensor(shards: Sequence[ShardConfig], *,
                                    running: bool = True) -> dg.SensorDefinition:
    """Alerts on every failed run that compacts shards (the compaction job, or any run
    selecting a ``compact/NAME`` asset)."""
    compaction_keys = {compacted_key(s.name) for s in shards}

    @dg.run_failure_sensor(name="compaction_failure_alert_sensor",
                           default_status=_status(running),
                           description="Alerts when a compaction run fails.")
    def compaction_failure_alert_sensor(context: dg.RunFailureSensorContext,
                                        alerts: AlertsResource) -> dg.SkipReason | None:
        run = context.dagster_run
        selected = set(run.asset_selection or ()) & compaction_keys
        if run.job_name != COMPACTION_JOB and not selected:
            return dg.SkipReason(f"run {run.run_id} does not compact")
        if not run.asset_selection:  # the whole compaction job
            selected = set(compaction_keys)
        steps = [_failure_text(e) for e in context.get_step_failure_events()]
        reason = next((r for r in steps if r), None) or context.failure_event.message or \
            "run failed"
        shards = run.tags.get(TAG_SHARDS, "")
        alerts.send(Alert(
            kind="compaction_run_failed", severity="error",
            title=f"compaction run {run.run_id} failed"
                  + (f" (shards {shards})" if shards else ""),
            details=reason[:1500],
            asset_keys=tuple(sorted(selected, key=str)),
            metadata={"run_id": run.run_id, "job": run.job_name, "shards": shards}), context)
        return None

    return compaction_failure_alert_sensor
