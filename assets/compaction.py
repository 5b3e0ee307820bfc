"""Spark compaction: ``compact/NAME`` for every shard, computed by one multi-asset.

A run selects the shards to compact. Two triggers: the inline pressure sensor (a shard
nearing its inline limit, within seconds), and declarative automation: once per tick of
``compaction.schedule`` (hourly), ``persist_automation_sensor`` requests every
``compact/NAME`` (:func:`compaction_condition`), and the run compacts the shards with
pending merges or inline data and skips the others (no materialization).

The step runs every pending merge request of every selected shard, which flushes every
inline part to the main blob store, as the tasks of ONE Spark job
(:func:`persist_pipeline.spark.compact_shards`); the driver commits each result to
consensus. Tasks read and write parts through the library's blob code, so S3, MinIO and
local folders work without Hadoop connectors.

Each selected shard gets a materialization with the compaction metrics and a
``snapshot_unchanged`` check: the fingerprint of the shard's snapshot at its latest
complete time, streamed before compaction (under a reader that holds ``since``) and again
after, must be equal; it holds one record batch in memory, never the snapshot.
When no selected shard has pending work, no Spark session is started.
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

from collections.abc import Iterator
from typing import Any

import dagster as dg

from assets.asset_keys import (
    COMPACTION_GROUP,
    COMPACTION_OP,
    TAG_TRIGGER,
    compacted_key,
    shard_key,
)
from assets.pipeline_config import ShardConfig
from persist_pipeline import PersistClient, ReadHandle
from persist_pipeline.exceptions import PersistError
from persist_pipeline.fingerprint import SnapshotFingerprint
from persist_pipeline.frontier import Frontier
from persist_pipeline.spark import SparkCompactionFailed, compact_shards
from resources.persist import PersistResource
from resources.spark import PersistPySparkResource

SNAPSHOT_CHECK = "snapshot_unchanged"

#: Metrics reported per shard (all numeric, so the UI plots them), most telling first in
#: the metadata table: how much inline data the run flushed.
METRIC_KEYS = ("inline_bytes_before", "inline_bytes_after", "requests", "applied",
               "not_applied", "rows_per_s", "duration_s", "spark_tasks", "failed_tasks",
               "parts_in", "parts_out", "inline_parts_in", "bytes_in", "bytes_out",
               "updates_in", "updates_out")


#: What :meth:`_Snapshot._fingerprint` returns when the contents it compares changed by
#: writes (their upper moved), not by compaction.
_MOVED = SnapshotFingerprint(-1, 0, "")


class _Snapshot:
    """A reader holding ``since`` and the fingerprint of the snapshot before compaction.

    Fingerprints stream (:meth:`ReadHandle.snapshot_fingerprint`): the check never holds
    a shard's snapshot in memory, whatever its size.
    """

    def __init__(self, client: PersistClient, shard_id: str) -> None:
        self.reader: ReadHandle | None = None
        self.as_of: int | None = None
        self.before: SnapshotFingerprint | None = None
        summary = client.shard_summaries().get(shard_id)
        if summary is None or summary.upper is None or summary.upper == 0:
            return  # no shard, a closed shard or nothing written: nothing to compare
        self.upper: int = summary.upper
        #: With since at the upper: the upper of the contents compared (see _fingerprint).
        self.contents_upper: Frontier | None = None
        self.reader = client.open_reader(shard_id, debug="compaction snapshot check")
        since = self.reader.since if self.reader.since is not None else 0
        self.as_of = max(since, summary.upper - 1)
        try:
            self.before = self._fingerprint()
        except BaseException:
            self.release()
            raise

    def _fingerprint(self) -> SnapshotFingerprint:
        assert self.reader is not None and self.as_of is not None
        if self.as_of >= self.upper:
            # Readers released every time up to the upper (since == upper): no time is
            # complete and exact, so compare the shard's whole contents (every update
            # summed whatever its time), which compaction must not change either.
            fingerprint, upper = self.reader._contents_fingerprint()
            if self.contents_upper is None:
                self.contents_upper = upper
            elif upper != self.contents_upper:
                return _MOVED
            return fingerprint
        return self.reader.snapshot_fingerprint(self.as_of)

    def verify(self) -> dg.AssetCheckResult:
        if self.reader is None or self.before is None or self.as_of is None:
            return dg.AssetCheckResult(passed=True, metadata={"rows": 0, "note": "empty shard"})
        after = self._fingerprint()
        if after is _MOVED:
            return dg.AssetCheckResult(
                passed=True, description="not compared: since had reached the upper (no "
                "time is exact) and writes landed during compaction",
                metadata={"skipped": "writes landed meanwhile"})
        same = after == self.before
        return dg.AssetCheckResult(
            passed=same, severity=dg.AssetCheckSeverity.ERROR,
            description=None if same else "compaction changed the snapshot",
            metadata={"as_of": self.as_of, "rows_before": self.before.rows,
                      "rows_after": after.rows, "diff_sum_before": self.before.diff_sum,
                      "diff_sum_after": after.diff_sum,
                      "fingerprint_before": self.before.digest[:16],
                      "fingerprint_after": after.digest[:16]})

    def release(self) -> None:
        if self.reader is not None:
            self.reader.expire()


def _unreadable(shard: ShardConfig, when: str, error: str) -> dg.AssetCheckResult:
    """The snapshot check of a shard whose snapshot could not be read ``when``
    (``before`` or ``after``) compaction: failed, with the error."""
    return dg.AssetCheckResult(
        asset_key=compacted_key(shard.name), check_name=SNAPSHOT_CHECK, passed=False,
        severity=dg.AssetCheckSeverity.ERROR,
        description=f"could not read the snapshot {when} compaction: {error}"[:1000],
        metadata={"error": error[:1000]})


def _with_work(client: PersistClient, shard_ids: list[str]) -> set[str]:
    """The shards among ``shard_ids`` with pending merges or inline data (one query)."""
    summaries = client.shard_summaries()
    return {s for s in shard_ids
            if s in summaries and (summaries[s].pending_merges or summaries[s].inline_bytes)}


def _needs_work(client: PersistClient, shard_ids: list[str]) -> bool:
    return bool(_with_work(client, shard_ids))


def compaction_condition(cron: str, timezone: str = "UTC") -> dg.AutomationCondition:
    """Once per tick of ``cron``. Deliberately the cheapest condition: evaluating it for
    1,000 assets takes a fraction of a second, where conditions that look at upstream
    updates or runs in progress take seconds; the run itself skips the shards with
    nothing to compact (one summary query), so the effect is the same."""
    return dg.AutomationCondition.cron_tick_passed(cron, timezone).with_label(
        f"tick of {cron}")


def build_compaction_assets(shards: tuple[ShardConfig, ...], *, cron: str = "0 * * * *",
                            timezone: str = "UTC") -> dg.AssetsDefinition:
    """The multi-asset computing ``compact/NAME`` for every configured shard.

    Each asset is requested by declarative automation on every tick of ``cron``; such a
    run compacts only the shards with pending work.
    """
    by_key = {compacted_key(s.name): s for s in shards}
    condition = compaction_condition(cron, timezone)
    specs = [dg.AssetSpec(compacted_key(s.name), deps=[shard_key(s.name)],
                          group_name=COMPACTION_GROUP, kinds={"spark"},
                          automation_condition=condition, skippable=True,
                          description=f"Shard {s.name} compacted by Spark: pending merges run "
                                      "and inline parts flushed to the main blob store, so "
                                      "its inline bytes drop to zero. Requested by "
                                      "inline_pressure_sensor when the shard nears its inline "
                                      f"limit, and on '{cron}' when it has pending work.",
                          metadata={"shard_id": s.shard_id})
             for s in shards]
    check_specs = [dg.AssetCheckSpec(SNAPSHOT_CHECK, asset=compacted_key(s.name),
                                     description="The shard's snapshot at its latest complete "
                                                 "time is the same before and after compaction.")
                   for s in shards]

    @dg.multi_asset(name=COMPACTION_OP, specs=specs, check_specs=check_specs,
                    can_subset=True)
    def spark_compaction(context: dg.AssetExecutionContext, persist: PersistResource,
                         pyspark: PersistPySparkResource) -> Iterator[Any]:
        selected = [by_key[k] for k in sorted(context.selected_asset_keys, key=str)]
        checked = {ck.asset_key for ck in context.selected_asset_check_keys}
        client = persist.client()
        if context.run.tags.get(TAG_TRIGGER) == "automation":
            # The hourly tick selects every shard: compact (and report) only those with
            # work, so 1,000 idle shards cost one query, not 1,000 materializations.
            busy = _with_work(client, [s.shard_id for s in selected])
            idle = [s.name for s in selected if s.shard_id not in busy]
            for shard in selected:
                if shard.shard_id not in busy and compacted_key(shard.name) in checked:
                    # Say why the check did not compare snapshots, instead of leaving it
                    # "not executed" without a reason.
                    yield dg.AssetCheckResult(
                        asset_key=compacted_key(shard.name), check_name=SNAPSHOT_CHECK,
                        passed=True, description="skipped: nothing to compact (no pending "
                        "merges or inline data), so this run did not change the shard",
                        metadata={"skipped": "nothing to compact"})
            selected = [s for s in selected if s.shard_id in busy]
            if idle:
                context.log.info(f"nothing to compact in {len(idle)} shard(s) "
                                 f"({', '.join(idle[:10])}{', ...' if len(idle) > 10 else ''})"
                                 ": skipped")
        _, blob_uri, wal_uri = persist.uris()
        snapshots: dict[str, _Snapshot] = {}
        # Shards whose check could not read their snapshot: {shard_id: error}. Each fails
        # alone (it is not compacted, unverified); the other shards are compacted.
        failed: dict[str, str] = {}
        try:
            for shard in selected:
                if compacted_key(shard.name) not in checked:
                    continue
                try:
                    snapshots[shard.shard_id] = _Snapshot(client, shard.shard_id)
                except PersistError as e:
                    failed[shard.shard_id] = f"{type(e).__name__}: {e}"
                    context.log.error(f"shard {shard.name}: cannot read its snapshot, so it "
                                      f"is not compacted: {failed[shard.shard_id]}")
                    yield _unreadable(shard, "before", failed[shard.shard_id])
        except BaseException:
            for snap in snapshots.values():
                snap.release()
            raise
        selected = [s for s in selected if s.shard_id not in failed]
        ids = [s.shard_id for s in selected]
        failure: SparkCompactionFailed | None = None
        try:
            if _needs_work(client, ids):
                spark = pyspark.spark_session
                try:
                    metrics = compact_shards(spark, client, ids, blob_uri=blob_uri,
                                             wal_blob_uri=wal_uri)
                except SparkCompactionFailed as e:
                    failure, metrics = e, e.metrics
                master = pyspark.master
            else:
                context.log.info("no selected shard has pending work: Spark not started")
                metrics = {}
                master = "none"
            for shard in selected:
                m = metrics.get(shard.shard_id, {})
                meta: dict[str, Any] = {k: m.get(k, 0) for k in METRIC_KEYS}
                meta["rows_per_s"] = round(float(meta["rows_per_s"]), 1)
                meta["duration_s"] = round(float(meta["duration_s"]), 3)
                meta["spark_master"] = master
                context.log.info(
                    f"shard {shard.name}: {meta['requests']} merge(s), {meta['parts_in']} "
                    f"parts in -> {meta['parts_out']} out, inline bytes "
                    f"{meta['inline_bytes_before']} -> {meta['inline_bytes_after']}")
                yield dg.MaterializeResult(asset_key=compacted_key(shard.name), metadata=meta)
                snap = snapshots.get(shard.shard_id)
                if snap is not None:
                    try:
                        result = snap.verify()
                    except PersistError as e:
                        failed[shard.shard_id] = f"{type(e).__name__}: {e}"
                        yield _unreadable(shard, "after", failed[shard.shard_id])
                        continue
                    yield dg.AssetCheckResult(
                        asset_key=compacted_key(shard.name), check_name=SNAPSHOT_CHECK,
                        passed=result.passed, severity=result.severity,
                        description=result.description, metadata=result.metadata)
        finally:
            for snap in snapshots.values():
                snap.release()
        if failure is not None or failed:
            names = {s.shard_id: s.name for s in by_key.values()}
            messages = [f"shard {names.get(i, i)}: {m}" for i, m in sorted(failed.items())]
            if failure is not None:
                messages.insert(0, str(failure))
            ids = sorted({*failed, *(failure.failures if failure is not None else ())})
            raise dg.Failure(description="; ".join(messages),
                             metadata={"failed_shards": ", ".join(ids)})

    return spark_compaction
