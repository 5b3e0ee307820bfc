"""The sensor that starts compaction when inline bytes cross the high-water mark.

``inline_pressure_sensor``: finds the shards whose inline bytes reached the high-water
mark (``high_water_fraction`` of the ``persist_inline_update_max_bytes`` the shard
recorded; the ``inline_policy`` resource's for a shard that recorded none) or whose
writes started falling through to blob storage while it holds inline data (with none,
compaction frees no budget), and requests ONE compaction run for them, with a run key
per crossing. While that run has not finished,
the shard is not requested again; a shard that is still (or again) over the mark after
its run succeeded is a new crossing (after a failed run, the sensor waits
``retry_after_s`` before asking again).

It reads ``PersistClient.shard_summaries()``, one consensus query
whatever the size of the shards' states; none of them reads a state.
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

import json
from collections.abc import Sequence
from typing import Any

import dagster as dg

from assets.asset_keys import (
    TAG_SHARDS,
    TAG_TRIGGER,
    AssetJob,
    compacted_key,
)
from assets.pipeline_config import ShardConfig
from assets.sensor_support import RUN_KEY_TAG, load_cursor, now_ms, sensor_status
from persist_pipeline import ShardSummary
from resources.inline_policy import InlinePolicyResource
from resources.persist import PersistResource

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
               default_status=sensor_status(running),
               description="Requests one Spark compaction run for the shards whose inline "
                           f"bytes reached {high_water_fraction:.0%} of "
                           "persist_inline_update_max_bytes, or whose writes fall through to "
                           "blob storage. Reads one summary per shard (one query).")
    def inline_pressure_sensor(context: dg.SensorEvaluationContext, persist: PersistResource,
                               inline_policy: InlinePolicyResource) -> dg.SensorResult:
        cursor = load_cursor(context.cursor)
        # Only the configured shards: a cursor written under another config (a shard
        # removed or renamed since) must not make every tick fail on an unknown shard.
        episodes: dict[str, dict[str, Any]] = {
            k: v for k, v in cursor.get("episodes", {}).items() if k in by_id}
        fallbacks: dict[str, int] = {
            k: v for k, v in cursor.get("fallbacks", {}).items() if k in by_id}
        summaries = persist.client().shard_summaries()
        now = now_ms()
        crossing: list[tuple[ShardConfig, ShardSummary]] = []
        for shard_id, shard in by_id.items():
            summary = summaries.get(shard_id)
            if summary is None:
                episodes.pop(shard_id, None)
                continue
            previous = fallbacks.get(shard_id, summary.inline_fallbacks)
            fallbacks[shard_id] = summary.inline_fallbacks
            # A write falls through when the inline bytes plus its own would cross the
            # budget: compaction frees that only if something is inline. With nothing
            # inline (no budget at all, or a write larger than it) a run would change
            # nothing, and the next fall-through would ask again, forever.
            fell_through = summary.inline_fallbacks > previous and summary.inline_bytes > 0
            high_water = inline_policy.high_water_bytes(high_water_fraction, summary)
            hot = summary.inline_bytes >= high_water or fell_through
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
            # A shard requested again without having been below the mark in between (a
            # retry after a failed run, or still hot after its run) counts its requests:
            # a run that failed before touching the shard left its seqno as it was, and
            # the daemon never launches a run key twice.
            attempts = {shard.shard_id: episodes[shard.shard_id].get("attempt", 0) + 1
                        if shard.shard_id in episodes else 0 for shard, _ in crossing}
            run_key = "inline-pressure:" + ",".join(
                f"{shard.name}@{summary.seqno}"
                + (f"~{attempts[shard.shard_id]}" if attempts[shard.shard_id] else "")
                for shard, summary in crossing)
            for shard, _ in crossing:
                episodes[shard.shard_id] = {"run_key": run_key, "at_ms": now,
                                            "attempt": attempts[shard.shard_id]}
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
                      else f"no shard at {high_water_fraction:.0%} of its inline max or "
                           "falling through")
            return dg.SensorResult(skip_reason=reason, cursor=new_cursor)
        return dg.SensorResult(run_requests=[request], cursor=new_cursor)

    return inline_pressure_sensor
