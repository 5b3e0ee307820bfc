"""Asset keys, groups, jobs and partitions names of the code location, in one place.

Each shard ``NAME`` has three assets, one per group: ``ingest/NAME`` (group
``ingestion``: its data, written by ingestion), ``compact/NAME`` (group ``compaction``:
Spark compaction) and ``gc/NAME`` (group ``maintenance``: garbage collection).
"""

from __future__ import annotations

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import (
    UnresolvedAssetJobDefinition,
)

#: What ``dg.define_asset_job`` returns (dagster does not export the type).
AssetJob = UnresolvedAssetJobDefinition

INGESTION_GROUP = "ingestion"
COMPACTION_GROUP = "compaction"
MAINTENANCE_GROUP = "maintenance"
REPORTS_GROUP = "reports"

INGESTION_JOB = "ingestion_job"
COMPACTION_JOB = "compaction_job"
GC_JOB = "gc_job"
CHECKS_JOB = "shard_checks_job"
ALERTS_JOB = "alerts_job"

#: Run tags set by this code location.
TAG_SHARDS = "persist/shards"
TAG_TRIGGER = "persist/trigger"
TAG_FILE = "persist/file"


def shard_key(name: str) -> dg.AssetKey:
    """The ingestion asset of shard ``name``: the shard's data (``ingest/NAME``)."""
    return dg.AssetKey(["ingest", name])


def compacted_key(name: str) -> dg.AssetKey:
    """The Spark compaction asset of shard ``name`` (``compact/NAME``)."""
    return dg.AssetKey(["compact", name])


def gc_key(name: str) -> dg.AssetKey:
    """The garbage collection asset of shard ``name`` (``gc/NAME``)."""
    return dg.AssetKey(["gc", name])


def files_partitions_name(name: str) -> str:
    """The dynamic partitions (one per landed file) of the ``files`` shard ``name``."""
    return f"{name}_files"


def landing_job_name(name: str) -> str:
    """The job the landing sensor of the ``files`` shard ``name`` launches."""
    return f"ingest_{name}_files_job"


def op_name(key: dg.AssetKey) -> str:
    """The op name Dagster gives a single asset (for run config)."""
    return "__".join(key.path)
