"""The landing sensor of a ``files`` shard or of a route.

``NAME_landing_sensor`` (one per ``files`` shard and one per route): each new landed file
becomes a dynamic partition ``NAME/<file>`` of ``ingest/NAME`` (of every shard routed from
route ``NAME``) and one run of ``ingest_files_job`` whose run key is the file's identity
(name, size, mtime). A long path's key is shortened so it fits the UI
(:func:`assets.asset_keys.file_partition_key`; the run's ``persist/file`` tag has the
path), and a file that already has a partition under its full path keeps it. The cursor
remembers the identities
already requested, Dagster never reuses a run key, files already ingested by a run
launched by hand are not requested, and the asset itself writes nothing for a file
version it already ingested: a file is ingested exactly once. A run that fails for a
transient reason (a backend away, a commit whose outcome could not be confirmed) retries
its step with backoff, ``ingestion.retries`` times (:mod:`assets.retries`), settling
rather than repeating a write an earlier attempt made; a bad file's run fails once and
is not retried, and neither is a run whose retries ran out (land a fixed file, or
re-run its partition). Files of a ``times: source``
location are requested one run at a time, in landing order, since a later file's commit
would refuse an earlier one's times. A missing or unreadable
landing location fails the tick with a message saying so; files of other formats
are named in the tick's skip reason.
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

import json

import dagster as dg

from assets.asset_keys import (
    FILES_PARTITIONS,
    LANDING_JOB,
    TAG_FILE,
    TAG_SHARDS,
    TAG_TRIGGER,
    AssetJob,
    file_partition_keys,
    shard_key,
)
from assets.ingestion import ACTIVE_STATUSES, LANDED_FILES, ingested_by
from assets.pipeline_config import FileSource, RouteConfig, ShardConfig
from assets.sensor_support import load_cursor, sensor_status
from assets.sources import describe, scan_landing
from resources.env import redact_text

# --- landing files -------------------------------------------------------------------------


def build_landing_sensor(shard: ShardConfig, job: AssetJob, *,
                         running: bool = True) -> dg.SensorDefinition:
    """One partition and one ingestion run per new file in the ``files`` source of
    ``shard``."""
    source = shard.source
    assert isinstance(source, FileSource), "landing sensors watch files sources"
    return _landing_sensor(shard.name, source, [shard.name], job, running,
                           what=f"ingest/{shard.name}")


def build_route_landing_sensor(route: RouteConfig, job: AssetJob, *,
                               running: bool = True) -> dg.SensorDefinition:
    """One partition and one ingestion run (writing every shard of the route in one
    transaction) per new file landed for ``route``."""
    shards = list(route.targets.values())
    return _landing_sensor(route.name, route.source, shards, job, running,
                           what=", ".join(f"ingest/{s}" for s in shards) + " (route "
                                f"{route.name}, one transaction per file)")


def _landing_sensor(owner: str, source: FileSource, shards: list[str], job: AssetJob,
                    running: bool, what: str) -> dg.SensorDefinition:
    keys = [shard_key(s) for s in shards]

    @dg.sensor(name=f"{owner}_landing_sensor", job=job,
               minimum_interval_seconds=source.sensor_interval_s,
               default_status=sensor_status(running),
               description=f"Each new file in {describe_source_template(source)} becomes a "
                           f"partition of {what} ({owner}/<file>) and one run of "
                           f"{LANDING_JOB} (run key: the file's name, size, mtime and "
                           "S3 ETag). "
                           "Fails the tick if the location is missing or cannot be listed.")
    def landing_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        seen = set(load_cursor(context.cursor).get("seen", []))
        landing = scan_landing(source)  # LandingLocationError fails the tick, clearly
        requests, already, added, deferred = [], [], [], set()
        # Source times: a file's times must be at or beyond the shard's upper when it
        # commits, so a later file committing first refuses every earlier one. Such
        # files are ingested one run at a time, in landing order; the rest wait (not
        # marked seen) for a tick with no run of this sensor's files in flight.
        serial = source.times == "source"
        in_flight = _in_flight(context.instance, shards) if serial else None
        busy = in_flight is not None
        for f in landing.files:
            if f.identity in seen:
                continue
            if busy:
                deferred.add(f.identity)
                continue
            # A long path's partition from before keys were shortened is kept: one
            # partition per file, and its runs' history stays with it.
            candidates = file_partition_keys(owner, f.name)
            existing = [p for p in candidates
                        if context.instance.has_dynamic_partition(FILES_PARTITIONS, p)]
            partition = existing[0] if existing else candidates[0]
            if existing:
                if ingested_by(context.instance, keys[0], candidates, f.identity):
                    already.append(f.name)  # e.g. materialized by hand: not again
                    continue
            else:
                added.append(partition)
            requests.append(dg.RunRequest(
                run_key=f"{owner}:{f.identity}", partition_key=partition,
                asset_selection=keys,
                tags={TAG_SHARDS: ",".join(shards), TAG_FILE: f.name,
                      TAG_TRIGGER: "landing"}))
            busy = serial
        # Only identities still landed are kept: the cursor stays as small as the folder.
        cursor = json.dumps({"seen": sorted(f.identity for f in landing.files
                                            if f.identity not in deferred)})
        notes = []
        if deferred:
            after = f"run {in_flight}" if in_flight else "the run requested now"
            notes.append(f"{len(deferred)} file(s) wait for {after}: source times are "
                         "ingested one file at a time, in landing order")
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


def _in_flight(instance: dg.DagsterInstance, shards: list[str]) -> str | None:
    """The id of a run this sensor requested for ``shards`` that is queued or running."""
    runs = instance.get_runs(filters=dg.RunsFilter(
        job_name=LANDING_JOB, tags={TAG_SHARDS: ",".join(shards), TAG_TRIGGER: "landing"},
        statuses=ACTIVE_STATUSES), limit=1)
    return runs[0].run_id if runs else None


def describe_source_template(source: FileSource) -> str:
    """The landing location as configured (templates unexpanded), redacted."""
    return redact_text(source.uri)
