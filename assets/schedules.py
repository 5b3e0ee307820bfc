"""Schedules: periodic compaction, garbage collection and shard checks.

- ``compaction_schedule`` (hourly by default): one compaction run selecting every shard
  with pending work (pending merges or inline data), read from the shards' summaries
  in one query; skipped when there is none.
- ``gc_schedule`` (daily): garbage collection of every shard.
- ``shard_checks_schedule`` (every 15 minutes): the inline-bytes and freshness checks.
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

from collections.abc import Sequence

import dagster as dg

from assets.asset_keys import TAG_SHARDS, TAG_TRIGGER, AssetJob, compacted_key
from assets.pipeline_config import ShardConfig
from resources.persist import PersistResource


def _status(running: bool) -> dg.DefaultScheduleStatus:
    return dg.DefaultScheduleStatus.RUNNING if running else dg.DefaultScheduleStatus.STOPPED


def build_compaction_schedule(shards: Sequence[ShardConfig], *, cron: str,
                              job: AssetJob, timezone: str = "UTC",
                              running: bool = True) -> dg.ScheduleDefinition:
    """Compacts every shard with pending work, on ``cron``."""

    @dg.schedule(name="compaction_schedule", cron_schedule=cron, job=job,
                 execution_timezone=timezone, default_status=_status(running),
                 description="Compacts every shard with pending merges or inline data.")
    def compaction_schedule(context: dg.ScheduleEvaluationContext,
                            persist: PersistResource) -> dg.RunRequest | dg.SkipReason:
        summaries = persist.client().shard_summaries()
        due = [s for s in shards
               if (summary := summaries.get(s.shard_id)) is not None
               and (summary.pending_merges or summary.inline_bytes)]
        if not due:
            return dg.SkipReason("no shard has pending compaction work")
        names = ",".join(s.name for s in due)
        return dg.RunRequest(asset_selection=[compacted_key(s.name) for s in due],
                             tags={TAG_SHARDS: names, TAG_TRIGGER: "schedule"})

    return compaction_schedule


def build_gc_schedule(*, cron: str, job: AssetJob,
                      timezone: str = "UTC", running: bool = True) -> dg.ScheduleDefinition:
    """Garbage-collects every shard, on ``cron``."""
    return dg.ScheduleDefinition(name="gc_schedule", cron_schedule=cron, job=job,
                                 execution_timezone=timezone, default_status=_status(running),
                                 tags={TAG_TRIGGER: "schedule"},
                                 description="Garbage collection of every shard.")


def build_checks_schedule(*, cron: str, job: AssetJob,
                          timezone: str = "UTC", running: bool = True) -> dg.ScheduleDefinition:
    """Runs the shard checks (inline bytes, freshness), on ``cron``."""
    return dg.ScheduleDefinition(name="shard_checks_schedule", cron_schedule=cron, job=job,
                                 execution_timezone=timezone, default_status=_status(running),
                                 tags={TAG_TRIGGER: "schedule"},
                                 description="Inline-bytes and freshness checks of every shard.")
