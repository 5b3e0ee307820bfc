"""Time-based automation: compaction and GC by declarative automation, checks by schedule.

- ``persist_automation_sensor``: Dagster's automation condition sensor for the
  ``compact/*`` and ``gc/*`` assets, whose conditions (set where they are defined) are
  ``AutomationCondition.cron_tick_passed(compaction.schedule)`` (the run compacts only
  the shards with pending work) and ``AutomationCondition.cron_tick_passed(gc.schedule)``.
- ``shard_checks_schedule`` (every 15 minutes): the inline-bytes and freshness checks.
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

import dagster as dg

from assets.asset_keys import COMPACTION_GROUP, MAINTENANCE_GROUP, TAG_TRIGGER, AssetJob


def _status(running: bool) -> dg.DefaultScheduleStatus:
    return dg.DefaultScheduleStatus.RUNNING if running else dg.DefaultScheduleStatus.STOPPED


def _sensor_status(running: bool) -> dg.DefaultSensorStatus:
    return dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED


def build_automation_sensor(*, running: bool = True,
                            interval_s: int = 30) -> dg.AutomationConditionSensorDefinition:
    """``persist_automation_sensor``: evaluates the automation conditions of the
    compaction and GC assets (hourly compaction of shards with work, daily GC)."""
    return dg.AutomationConditionSensorDefinition(
        "persist_automation_sensor",
        target=dg.AssetSelection.groups(COMPACTION_GROUP, MAINTENANCE_GROUP),
        default_status=_sensor_status(running), minimum_interval_seconds=interval_s,
        run_tags={TAG_TRIGGER: "automation"},
        description="Declarative automation of compact/* (each tick of compaction.schedule; "
                    "the run compacts the shards with pending work) and gc/* (each tick of "
                    "gc.schedule).")


def build_checks_schedule(*, cron: str, job: AssetJob,
                          timezone: str = "UTC", running: bool = True) -> dg.ScheduleDefinition:
    """Runs the shard checks (inline bytes, freshness), on ``cron``."""
    return dg.ScheduleDefinition(name="shard_checks_schedule", cron_schedule=cron, job=job,
                                 execution_timezone=timezone, default_status=_status(running),
                                 tags={TAG_TRIGGER: "schedule"},
                                 description="Inline-bytes and freshness checks of every shard.")
