"""Alert sensors (to the ``alerts`` resource).

``inline_over_limit_alert_sensor`` (a shard
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

from assets.asset_keys import (
    COMPACTION_JOB,
    COMPACTION_OP,
    TAG_SHARDS,
    compacted_key,
    shard_key,
)
from assets.pipeline_config import ShardConfig
from assets.sensor_support import load_cursor, now_ms, sensor_status
from persist_pipeline import ShardSummary
from resources.alerts import Alert, AlertsResource
from resources.inline_policy import InlinePolicyResource
from resources.persist import PersistResource

# --- alerts --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlertInputs:
    """What an alert rule sees on one tick."""

    shards: Sequence[ShardConfig]
    summaries: Mapping[str, ShardSummary]
    #: The ``inline_policy`` resource's max: a shard is judged by the one it recorded
    #: (:meth:`shard_max_bytes`), this only for a shard that recorded none.
    inline_max_bytes: int
    now_ms: int

    def shard_max_bytes(self, summary: ShardSummary) -> int:
        return summary.inline_bound(self.inline_max_bytes)


#: A rule maps (inputs, its state from the previous tick) to (alerts, its new state).
AlertRule = Callable[[AlertInputs, dict[str, Any]], tuple[list[Alert], dict[str, Any]]]


def over_limit_rule(high_water_fraction: float, over_for_s: int) -> AlertRule:
    """A shard at or above its high-water mark for longer than ``over_for_s``: once per
    episode."""

    def rule(inputs: AlertInputs, state: dict[str, Any]) -> tuple[list[Alert], dict[str, Any]]:
        alerts, new = [], {}
        for shard in inputs.shards:
            summary = inputs.summaries.get(shard.shard_id)
            if summary is None:
                continue
            limit = inputs.shard_max_bytes(summary)
            high_water = max(1, int(limit * high_water_fraction))
            if summary.inline_bytes < high_water:
                continue
            entry = state.get(shard.shard_id) or {"since_ms": inputs.now_ms, "alerted": False}
            over_s = (inputs.now_ms - entry["since_ms"]) / 1000
            if not entry["alerted"] and over_s >= over_for_s:
                entry = {**entry, "alerted": True}
                alerts.append(Alert(
                    kind="inline_over_limit",
                    title=f"shard {shard.name}: {summary.inline_bytes} inline bytes, above its "
                          f"limit of {high_water} for {over_s:.0f} s",
                    details=f"the shard's persist_inline_update_max_bytes is {limit}; "
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
                    details=f"{summary.inline_bytes} of {inputs.shard_max_bytes(summary)} "
                            "inline bytes "
                            "used; each such write costs an object-store PUT. Compaction "
                            "frees the budget.",
                    asset_keys=(shard_key(shard.name),),
                    metadata={"shard": shard.name, "new_fallbacks": delta,
                              "total_fallbacks": count,
                              "inline_bytes": summary.inline_bytes}))
            new[shard.shard_id] = {"fallbacks": count, "alerting": alerting}
        return alerts, new

    return rule


def build_alert_sensor(name: str, description: str, shards: Sequence[ShardConfig],
                       rule: AlertRule, *, interval_s: int,
                       running: bool = True) -> dg.SensorDefinition:
    """A sensor that evaluates ``rule`` on the shards' summaries and sends its alerts."""

    @dg.sensor(name=name, minimum_interval_seconds=interval_s,
               default_status=sensor_status(running), description=description)
    def alert_sensor(context: dg.SensorEvaluationContext, persist: PersistResource,
                     inline_policy: InlinePolicyResource,
                     alerts: AlertsResource) -> dg.SensorResult:
        state = load_cursor(context.cursor)
        inputs = AlertInputs(shards, persist.client().shard_summaries(),
                             inline_policy.max_bytes, now_ms())
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


def _failed_shard_keys(events: Sequence[dg.DagsterEvent],
                       key_of: Mapping[str, dg.AssetKey]) -> set[dg.AssetKey] | None:
    """The ``compact/NAME`` keys of the shards a compaction step reported failed (its
    ``dg.Failure`` metadata ``failed_shards``: shard ids), or None when no step said."""
    found: set[dg.AssetKey] | None = None
    for event in events:
        data: Any = event.event_specific_data
        user = getattr(data, "user_failure_data", None)
        entry = (user.metadata or {}).get("failed_shards") if user is not None else None
        text = getattr(entry, "value", entry)
        if not isinstance(text, str):
            continue
        ids = [i.strip() for i in text.split(",") if i.strip()]
        keys = {key_of[i] for i in ids if i in key_of}
        if keys:
            found = (found or set()) | keys
    return found


def build_compaction_failure_sensor(shards: Sequence[ShardConfig], *,
                                    running: bool = True) -> dg.SensorDefinition:
    """Alerts on every failed run that compacts shards (the compaction job, or any run
    selecting a ``compact/NAME`` asset)."""
    compaction_keys = {compacted_key(s.name) for s in shards}
    key_of = {s.shard_id: compacted_key(s.name) for s in shards}

    @dg.run_failure_sensor(name="compaction_failure_alert_sensor",
                           default_status=sensor_status(running),
                           description="Alerts when a compaction run fails.")
    def compaction_failure_alert_sensor(context: dg.RunFailureSensorContext,
                                        alerts: AlertsResource) -> dg.SkipReason | None:
        run = context.dagster_run
        selected = set(run.asset_selection or ()) & compaction_keys
        if run.job_name != COMPACTION_JOB and not selected:
            return dg.SkipReason(f"run {run.run_id} does not compact")
        if not run.asset_selection:  # the whole compaction job
            selected = set(compaction_keys)
        failures = context.get_step_failure_events()
        # A run may hold other steps than compaction (automation requests compact/* and
        # gc/* in one run when their crons tick together): when steps failed and none of
        # them compacts, compaction went fine and this alert would name it wrongly. A run
        # that failed without a failed step (killed, lost) still alerts: none can tell.
        if failures and not any(e.step_key == COMPACTION_OP for e in failures):
            steps = ", ".join(sorted({str(e.step_key) for e in failures}))
            return dg.SkipReason(f"run {run.run_id} failed in {steps}, not in compaction")
        failed = _failed_shard_keys(failures, key_of)
        if failed is not None:
            # The step said which shards failed (the others' results were committed):
            # the alert concerns those, not every shard the run selected.
            selected = (selected & failed) or failed
        steps = [_failure_text(e) for e in failures]
        reason = next((r for r in steps if r), None) or context.failure_event.message or \
            "run failed"
        shards = run.tags.get(TAG_SHARDS, "")
        if failed is not None:
            shards = ",".join(sorted(k.path[-1] for k in selected))
        alerts.send(Alert(
            kind="compaction_run_failed", severity="error",
            title=f"compaction run {run.run_id} failed"
                  + (f" (shards {shards})" if shards else ""),
            details=reason[:1500],
            asset_keys=tuple(sorted(selected, key=str)),
            metadata={"run_id": run.run_id, "job": run.job_name, "shards": shards}), context)
        return None

    return compaction_failure_alert_sensor
