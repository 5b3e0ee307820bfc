"""Asset checks on the shards (``ingest/NAME``).

- ``inline_bytes_within_max``: the shard's inline bytes are within the
  ``persist_inline_update_max_bytes`` the shard recorded (guarantee 4; ERROR if not);
  the ``inline_policy`` resource's for a shard that recorded none yet.
- ``upper_advanced_recently``: freshness: the shard's upper was advanced by an ingestion
  write within the shard's ``freshness_max_age_s`` (WARN if not; a shard never written
  passes, saying so). The ingestion assets also carry a Dagster ``FreshnessPolicy`` with
  the same limit, which the UI shows on the asset.

The snapshot check of compaction lives with compaction (:mod:`assets.compaction`): it
needs the snapshot read just before compaction. Both checks here read every shard's
summary in one consensus query, never a state.
"""

# No `from __future__ import annotations` here: Dagster 1.13 reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

import time
from collections.abc import Iterator

import dagster as dg

from assets.asset_keys import shard_key
from assets.pipeline_config import ShardConfig
from resources.inline_policy import InlinePolicyResource
from resources.persist import PersistResource

INLINE_CHECK = "inline_bytes_within_max"
FRESHNESS_CHECK = "upper_advanced_recently"


def build_shard_checks(shards: tuple[ShardConfig, ...]) -> list[dg.AssetChecksDefinition]:
    """The inline-bytes and freshness checks of every shard."""
    by_key = {shard_key(s.name): s for s in shards}

    @dg.multi_asset_check(
        name="inline_bytes_within_max", can_subset=True,
        specs=[dg.AssetCheckSpec(INLINE_CHECK, asset=k,
                                 description="Inline bytes <= persist_inline_update_max_bytes.")
               for k in by_key])
    def inline_bytes_within_max(context: dg.AssetCheckExecutionContext,
                                persist: PersistResource,
                                inline_policy: InlinePolicyResource
                                ) -> Iterator[dg.AssetCheckResult]:
        summaries = persist.client().shard_summaries()
        for check_key in context.selected_asset_check_keys:
            shard = by_key[check_key.asset_key]
            summary = summaries.get(shard.shard_id)
            # The shard's own bound: writers configured otherwise than this resource
            # keep within it, so it is the one inline bytes are judged by.
            limit = inline_policy.shard_max_bytes(summary)
            inline = summary.inline_bytes if summary else 0
            yield dg.AssetCheckResult(
                asset_key=check_key.asset_key, check_name=INLINE_CHECK,
                passed=inline <= limit, severity=dg.AssetCheckSeverity.ERROR,
                metadata={"inline_bytes": inline, "inline_max_bytes": limit,
                          "inline_parts": summary.num_inline_parts if summary else 0,
                          "fill_fraction": round(inline / limit, 4) if limit else 0.0})

    @dg.multi_asset_check(
        name="upper_advanced_recently", can_subset=True,
        specs=[dg.AssetCheckSpec(FRESHNESS_CHECK, asset=k,
                                 description="An ingestion write advanced the shard's upper "
                                             f"within {by_key[k].freshness_max_age_s} s.")
               for k in by_key])
    def upper_advanced_recently(context: dg.AssetCheckExecutionContext,
                                persist: PersistResource) -> Iterator[dg.AssetCheckResult]:
        summaries = persist.client().shard_summaries()
        now = time.time()
        for check_key in context.selected_asset_check_keys:
            shard = by_key[check_key.asset_key]
            summary = summaries.get(shard.shard_id)
            event = context.instance.get_latest_materialization_event(check_key.asset_key)
            upper = summary.upper if summary and summary.upper is not None else -1
            if event is None or summary is None:
                # Nothing to be fresh about yet: a shard waiting for its first file is not
                # stale (a warning here would fire on every new shard).
                yield dg.AssetCheckResult(
                    asset_key=check_key.asset_key, check_name=FRESHNESS_CHECK, passed=True,
                    severity=dg.AssetCheckSeverity.WARN,
                    description="the shard has never been written by ingestion: freshness "
                                "is checked from its first write on",
                    metadata={"shard_upper": upper})
                continue
            age = now - event.timestamp
            yield dg.AssetCheckResult(
                asset_key=check_key.asset_key, check_name=FRESHNESS_CHECK,
                passed=age <= shard.freshness_max_age_s, severity=dg.AssetCheckSeverity.WARN,
                metadata={"seconds_since_last_write": round(age, 1),
                          "max_age_s": shard.freshness_max_age_s, "shard_upper": upper})

    return [inline_bytes_within_max, upper_advanced_recently]
