"""Asset keys, groups, jobs and partitions names of the code location, in one place.

Each shard ``NAME`` has three assets, one per group: ``ingest/NAME`` (group
``ingestion``: its data, written by ingestion), ``compact/NAME`` (group ``compaction``:
Spark compaction) and ``gc/NAME`` (group ``maintenance``: garbage collection).
"""

from __future__ import annotations

import hashlib
import re

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
#: The op (and step) of the compaction multi-asset: failures of other steps of a run
#: that compacts are not compaction failures.
COMPACTION_OP = "spark_compaction"
#: The job of every landing sensor: one landed file (a partition) of one files shard.
LANDING_JOB = "ingest_files_job"
#: The dynamic partitions of every files shard: one per landed file, ``SHARD/path`` (a
#: long path shortened, see :func:`file_partition_key`). One set for all files shards
#: keeps the code location to a handful of jobs however many shards are configured (each
#: job costs Dagster time proportional to every asset).
FILES_PARTITIONS = "landed_files"

#: The longest landed-file partition key, in characters. Dagster's asset page shows the
#: latest materialization's partition key untruncated, after its age ("44 minutes ago"),
#: in one column of its status row, where it runs over the check results badge beside it
#: when too long: 34 characters fit at a window 1920 px wide (about 24 at 1600 px: too
#: few for a key that is readable and unique). The partitions list and the runs list
#: show keys this long whole too. Longer keys are shortened.
MAX_FILE_PARTITION_KEY = 34
#: Hex digits of the path's SHA-256 in a shortened key: what keeps it unique.
KEY_DIGEST_CHARS = 8
#: Path characters a shortened key keeps, at least, however long the shard's name.
_MIN_KEPT = 8
_SHORTENED = re.compile(rf"~[0-9a-f]{{{KEY_DIGEST_CHARS}}}~")

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
    """The partition of ``ingest/SHARD`` for the landed file ``path``.

    ``SHARD/path`` when that is at most :data:`MAX_FILE_PARTITION_KEY` characters (as
    every key was before long ones were shortened, so those keys are unchanged).
    Otherwise ``SHARD/<head>~<digest>~<tail>``: the path's first and last characters
    around the first :data:`KEY_DIGEST_CHARS` hex digits of its SHA-256, within the
    limit (e.g. ``orders/par~b80aed7a~-of-000032.csv``). The tail gets four fifths:
    the end of a name (numbers, extension) tells files with a common prefix apart.
    The key of a path never changes; the full path is in the run's ``persist/file`` tag
    and the materialization's ``File`` metadata.
    """
    key = f"{shard}/{path}"
    if len(key) <= MAX_FILE_PARTITION_KEY:
        return key
    kept = max(MAX_FILE_PARTITION_KEY - len(shard) - 1 - KEY_DIGEST_CHARS - 2, _MIN_KEPT)
    head = kept // 5
    digest = hashlib.sha256(path.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{shard}/{path[:head]}~{digest[:KEY_DIGEST_CHARS]}~{path[-(kept - head):]}"


def file_partition_keys(shard: str, path: str) -> tuple[str, ...]:
    """Every key the landed file ``path`` may have: :func:`file_partition_key`, then
    ``SHARD/path`` if that differs (a long path's key before keys were shortened, which
    an already-landed file keeps)."""
    key, unshortened = file_partition_key(shard, path), f"{shard}/{path}"
    return (key,) if key == unshortened else (key, unshortened)


def split_file_partition(key: str) -> tuple[str, str]:
    """``(shard, rest)`` of a landed-file partition key; ``rest`` is the file's path
    unless the key is shortened (:func:`is_shortened_file_partition`)."""
    shard, _, path = key.partition("/")
    return shard, path


def is_shortened_file_partition(key: str) -> bool:
    """Whether ``key`` has the form of a shortened key, whose path must be looked up
    (a path that itself contains ``~<8 hex digits>~`` looks so too; the look-up finds
    it)."""
    return _SHORTENED.search(split_file_partition(key)[1]) is not None


def op_name(key: dg.AssetKey) -> str:
    """The op name Dagster gives a single asset (for run config)."""
    return "__".join(key.path)
