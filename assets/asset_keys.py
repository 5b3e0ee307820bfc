"""Asset keys, groups and jobs names of the code location, in one place.

Each shard ``NAME`` has three assets: ``shards/NAME`` (its data, written by ingestion),
``compacted/NAME`` (Spark compaction) and ``gc/NAME`` (garbage collection).
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

INGESTION_JOB = "ingestion_job"
COMPACTION_JOB = "compaction_job"
GC_JOB = "gc_job"
CHECKS_JOB = "shard_checks_job"

#: Run tags set by this code location.
TAG_SHARDS = "persist/shards"
TAG_TRIGGER = "persist/trigger"
TAG_FILE = "persist/file"


def shard_key(name: str) -> dg.AssetKey:
    """The ingestion asset of shard ``name``: the shard's data."""
    return dg.AssetKey(["shards", name])


def compacted_key(name: str) -> dg.AssetKey:
    """The Spark compaction asset of shard ``name``."""
    return dg.AssetKey(["compacted", name])


def gc_key(name: str) -> dg.AssetKey:
    """The garbage collection asset of shard ``name``."""
    return dg.AssetKey(["gc", name])


def op_name(key: dg.AssetKey) -> str:
    """The op name Dagster gives a single asset (for run config)."""
    return "__".join(key.path)
