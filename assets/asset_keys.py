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
#: The job of every landing sensor: one landed file (a partition) of one files shard.
LANDING_JOB = "ingest_files_job"
#: The dynamic partitions of every files shard: one per landed file, ``SHARD/path``. One
#: set for all files shards keeps the code location to a handful of jobs however many
#: shards are configured (each job costs Dagster time proportional to every asset).
FILES_PARTITIONS = "landed_files"

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


def file_partition_key(shard: str, path: str) -> str:
    """The partition of ``ingest/SHARD`` for the landed file ``path``: ``SHARD/path``."""
    return f"{shard}/{path}"


def split_file_partition(key: str) -> tuple[str, str]:
    """``(shard, path)`` of a landed-file partition key."""
    shard, _, path = key.partition("/")
    return shard, path


def op_name(key: dg.AssetKey) -> str:
    """The op name Dagster gives a single asset (for run config)."""
    return "__".join(key.path)
