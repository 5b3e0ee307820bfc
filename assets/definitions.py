"""The code location: ``defs``, built from the pipeline config file.

``workspace.yaml`` loads this module. Everything is made by the factories of the other
modules from :class:`~assets.pipeline_config.PipelineConfig`; :func:`build_definitions`
is public so other configs can be loaded the same way.
"""

from __future__ import annotations

import dagster as dg

from assets.alert_sensors import build_compaction_failure_sensor, build_shard_alert_sensors
from assets.asset_keys import (
    CHECKS_JOB,
    COMPACTION_GROUP,
    COMPACTION_JOB,
    GC_JOB,
    INGESTION_JOB,
    LANDING_JOB,
    MAINTENANCE_GROUP,
    shard_key,
)
from assets.checks import build_shard_checks
from assets.compaction import build_compaction_assets
from assets.compaction_sensors import build_inline_pressure_sensor
from assets.gc import build_gc_assets
from assets.ingestion import build_ingestion_assets
from assets.landing_sensor import build_landing_sensor, build_route_landing_sensor
from assets.pipeline_config import (
    FileSource,
    PipelineConfig,
    is_landed,
    load_pipeline_config,
)
from assets.reports import build_report_asset
from assets.schedules import build_automation_sensor, build_checks_schedule
from resources.alerts import AlertsResource
from resources.inline_policy import InlinePolicyResource
from resources.io_manager import PersistIOManager
from resources.persist import PersistResource
from resources.spark import build_pyspark_resource


def build_resources(config: PipelineConfig) -> dict[str, dg.ConfigurableResource]:
    """The resources of the code location for ``config``."""
    return {
        "persist": PersistResource(consensus_uri=config.location.consensus_uri,
                                   blob_uri=config.location.blob_uri,
                                   wal_blob_uri=config.location.wal_blob_uri),
        "inline_policy": InlinePolicyResource(
            persist_inline_update_threshold_bytes=config.threshold_bytes,
            persist_inline_update_max_bytes=config.max_bytes),
        "pyspark": build_pyspark_resource(config.spark.master, config.spark.conf),
        "alerts": AlertsResource(webhook_url=config.alerts.webhook_url),
        # Assets added to this code location that return a table are stored in shards.
        "io_manager": PersistIOManager(
            consensus_uri=config.location.consensus_uri, blob_uri=config.location.blob_uri,
            wal_blob_uri=config.location.wal_blob_uri,
            persist_inline_update_threshold_bytes=config.threshold_bytes,
            persist_inline_update_max_bytes=config.max_bytes),
    }


def build_definitions(config: PipelineConfig) -> dg.Definitions:
    """Assets, checks, jobs, sensors and schedules for ``config``."""
    shards = config.shards
    running = config.automation_running
    ingestion = build_ingestion_assets(shards, config.routes, config.ingestion)
    compaction = build_compaction_assets(shards, cron=config.compaction.schedule,
                                         timezone=config.timezone)
    gc = build_gc_assets(shards, cron=config.gc_schedule, timezone=config.timezone)
    checks = build_shard_checks(shards)

    synthetic = [shard_key(s.name) for s in shards if not is_landed(s)]
    jobs = []
    files = [shard_key(s.name) for s in shards if is_landed(s)]
    landing_job = dg.define_asset_job(
        LANDING_JOB, selection=dg.AssetSelection.assets(*files),
        description="Ingests one landed file (a partition SHARD/path or ROUTE/path) into "
                    "its shard, or into every shard of its route in one transaction; the "
                    "landing sensors launch it selecting those ingest/SHARD assets.")
    if files:
        jobs.append(landing_job)
    if synthetic:  # file shards are written by their landing sensors, one file per run
        jobs.append(dg.define_asset_job(
            INGESTION_JOB, selection=dg.AssetSelection.assets(*synthetic),
            description="One write of the synthetic change stream into every synthetic "
                        "shard."))
    compaction_job = dg.define_asset_job(
        COMPACTION_JOB, selection=dg.AssetSelection.groups(COMPACTION_GROUP),
        description="Spark compaction of the selected shards (one Spark job per run).")
    gc_job = dg.define_asset_job(GC_JOB, selection=dg.AssetSelection.groups(MAINTENANCE_GROUP),
                                 description="Garbage collection of every shard.")
    checks_job = dg.define_asset_job(
        CHECKS_JOB,
        selection=dg.AssetSelection.checks_for_assets(*[shard_key(s.name) for s in shards]),
        description="The inline-bytes and freshness checks of every shard.")

    sensors = [
        *(build_landing_sensor(s, landing_job, running=running)
          for s in shards if isinstance(s.source, FileSource)),
        *(build_route_landing_sensor(r, landing_job, running=running)
          for r in config.routes),
        build_inline_pressure_sensor(
            shards, high_water_fraction=config.compaction.high_water_fraction,
            interval_s=config.compaction.sensor_interval_s, job=compaction_job,
            running=running),
        *build_shard_alert_sensors(
            shards, high_water_fraction=config.compaction.high_water_fraction,
            over_limit_for_s=config.alerts.over_limit_for_s,
            backlog_threshold=config.alerts.backlog_threshold,
            interval_s=config.alerts.sensor_interval_s, running=running),
        build_compaction_failure_sensor(shards, running=running),
        build_automation_sensor(running=running),
    ]
    schedules = [
        build_checks_schedule(cron=config.checks_schedule, job=checks_job,
                              timezone=config.timezone, running=running),
    ]
    return dg.Definitions(
        assets=[*ingestion, compaction, gc, build_report_asset(shards)],
        asset_checks=checks,
        jobs=[*jobs, compaction_job, gc_job, checks_job],
        sensors=sensors,
        schedules=schedules,
        resources=build_resources(config),
        executor=dg.in_process_executor,
        metadata={"pipeline_config": str(config.path)},
    )


defs = build_definitions(load_pipeline_config())
