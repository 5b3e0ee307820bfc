"""Garbage collection: ``gc/NAME`` for every shard, computed by one multi-asset.

Each ``gc/NAME`` has ``AutomationCondition.cron_tick_passed(gc.schedule)``, so
``persist_automation_sensor`` collects every shard once per cron tick.

For each selected shard, deletes the blobs no live state version references and
truncates consensus below every reader's hold (:meth:`PersistClient.gc`), and reports
what it removed. Runs on the driver only (GC is metadata work plus deletes).

Each ``gc/NAME`` has a ``stores_intact`` check, run right after its GC: every part and
rollup the shard's latest state references is still stored at its recorded size, and
every inline part decodes (:meth:`PersistClient.verify`, one listing per store). It
fails (severity ERROR) naming each blob lost or damaged, whoever lost it: this GC, a
hand-made delete or a bucket lifecycle rule. A shard whose state cannot be rebuilt (its
rollup lost) is not collected, but its check still runs and fails naming the rollup, and
the other shards are collected and checked before the step fails with that error.
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

from collections.abc import Iterator
from typing import Any

import dagster as dg

from assets.asset_keys import MAINTENANCE_GROUP, gc_key
from assets.pipeline_config import ShardConfig
from persist_pipeline import PersistClient
from persist_pipeline.exceptions import CorruptData, ShardNotFound
from resources.persist import PersistResource

STORES_CHECK = "stores_intact"

#: Problems listed in a failed check's metadata (the description counts them all).
_PROBLEMS_SHOWN = 20

METRIC_KEYS = ("seqnos_truncated", "blobs_deleted", "bytes_deleted", "rollups_deleted",
               "orphans_deleted", "live_blobs", "duration_s")


class GcConfig(dg.Config):
    """Run config of the GC step."""

    sweep_orphans: bool = True


def build_gc_assets(shards: tuple[ShardConfig, ...], *, cron: str = "30 3 * * *",
                    timezone: str = "UTC") -> dg.AssetsDefinition:
    """The multi-asset computing ``gc/NAME`` for every configured shard, requested by
    declarative automation once per tick of ``cron``."""
    by_key = {gc_key(s.name): s for s in shards}
    # The cheapest condition (see compaction_condition): once per tick.
    condition = dg.AutomationCondition.cron_tick_passed(cron, timezone).with_label(
        f"tick of {cron}")
    # No dependency on compact/NAME: when both crons tick together, automation requests
    # compact/* and gc/* in one run, and a dependency would skip the whole GC step as
    # soon as one selected shard had nothing to compact (no compact/NAME materialized).
    # GC is safe beside any compaction, in any order.
    specs = [dg.AssetSpec(gc_key(s.name),
                          group_name=MAINTENANCE_GROUP, kinds={"python"},
                          automation_condition=condition,
                          description=f"Garbage collection of shard {s.name}: deletes the "
                                      "blobs no live state version references and truncates "
                                      f"old consensus versions. Runs on '{cron}'.",
                          metadata={"shard_id": s.shard_id})
             for s in shards]

    check_specs = [dg.AssetCheckSpec(STORES_CHECK, asset=gc_key(s.name),
                                     description="After GC, every part and rollup the shard's "
                                                 "latest state references is stored at its "
                                                 "recorded size and every inline part "
                                                 "decodes (PersistClient.verify).")
                   for s in shards]

    @dg.multi_asset(name="persist_gc", specs=specs, check_specs=check_specs,
                    can_subset=True)
    def persist_gc(context: dg.AssetExecutionContext, config: GcConfig,
                   persist: PersistResource) -> Iterator[Any]:
        client = persist.client()
        checked = {ck.asset_key for ck in context.selected_asset_check_keys}
        unreadable: list[CorruptData] = []
        for key in sorted(context.selected_asset_keys, key=str):
            shard = by_key[key]
            try:
                metrics = client.gc(shard.shard_id, sweep_orphans=config.sweep_orphans)
                found = True
            except ShardNotFound:
                metrics, found = {}, False
            except CorruptData as e:
                # The shard's state cannot be rebuilt (its rollup lost), so it cannot be
                # collected; its check still says what is lost (a report, not an error:
                # guarantee 22), and the other shards are still collected and checked.
                # The step fails afterwards: this GC did not run.
                context.log.error(f"gc of shard {shard.name}: {type(e).__name__}: {e}")
                unreadable.append(e)
                if key in checked:
                    yield _stores_intact(client, shard, key, True)
                continue
            meta: dict[str, Any] = {k: metrics.get(k, 0) for k in METRIC_KEYS}
            meta["duration_s"] = round(float(meta["duration_s"]), 3)
            meta["shard_found"] = found
            context.log.info(f"gc of shard {shard.name}: {meta}")
            yield dg.MaterializeResult(asset_key=key, metadata=meta)
            if key in checked:
                yield _stores_intact(client, shard, key, found)
        if unreadable:
            raise unreadable[0]

    return persist_gc


def _stores_intact(client: PersistClient, shard: ShardConfig, key: dg.AssetKey,
                   found: bool) -> dg.AssetCheckResult:
    if not found:
        return dg.AssetCheckResult(asset_key=key, check_name=STORES_CHECK, passed=True,
                                   description="the shard has never been written: nothing "
                                               "to check", metadata={"shard_found": False})
    report = client.verify(shard.shard_id)
    meta: dict[str, Any] = {"parts": report.parts, "inline_parts": report.inline_parts,
                            "rollups": report.rollups, "bytes_checked": report.bytes_checked,
                            "replaced": report.replaced, "problems": len(report.problems),
                            "seqno": report.seqno,
                            "duration_s": round(report.duration_s, 3)}
    if report.ok:
        return dg.AssetCheckResult(asset_key=key, check_name=STORES_CHECK, passed=True,
                                   metadata=meta)
    shown = [f"{p.kind}: {p.store} {p.key} (batch {p.batch or '-'}): {p.detail}"
             for p in report.problems[:_PROBLEMS_SHOWN]]
    meta["lost_or_damaged"] = dg.MetadataValue.md("\n".join(f"- `{line}`" for line in shown))
    return dg.AssetCheckResult(
        asset_key=key, check_name=STORES_CHECK, passed=False,
        severity=dg.AssetCheckSeverity.ERROR,
        description=f"{len(report.problems)} blob(s) the state of shard {shard.name} "
                    f"references are lost or damaged; first: {shown[0]}"[:1000],
        metadata=meta)
