"""``report/shard_health``: a table asset stored through ``PersistIOManager``.

It is both an operator's view (one row per shard: upper, since, inline bytes against
the limit, batches, pending merges, fall-throughs) and the example of a user's own asset
in this code location: it returns a pyarrow Table, and the ``io_manager`` resource
stores it in a shard named after its key, recording ``dagster/row_count`` and the column
schema. A downstream asset that takes ``shard_health: pa.Table`` (or a pandas / polars
DataFrame) loads it back with the same types.
"""

# No `from __future__ import annotations` here: Dagster reads the annotations of
# decorated functions (context, config and resource parameters) at definition time.

from collections.abc import Sequence

import dagster as dg
import pyarrow as pa

from assets.asset_keys import REPORTS_GROUP, shard_key
from assets.pipeline_config import ShardConfig
from resources.inline_policy import InlinePolicyResource
from resources.persist import PersistResource

REPORT_KEY = dg.AssetKey(["report", "shard_health"])

def _field(name: str, type_: pa.DataType, description: str, nullable: bool = False
           ) -> pa.Field:
    return pa.field(name, type_, nullable, metadata={"description": description})


#: The report's columns; descriptions show in the UI's column schema.
HEALTH_SCHEMA = pa.schema([
    _field("shard", pa.string(), "shard name in pipeline.yaml"),
    _field("shard_id", pa.string(), "the shard's id: 's' followed by a UUID"),
    _field("upper", pa.int64(), "write frontier (null: closed or never written)", True),
    _field("since", pa.int64(), "read frontier (null: closed or never written)", True),
    _field("inline_bytes", pa.int64(), "bytes inlined in consensus"),
    _field("inline_fill", pa.float64(),
           "inline_bytes / the shard's recorded persist_inline_update_max_bytes"),
    _field("batches", pa.int32(), "batches in the shard's trace"),
    _field("pending_merges", pa.int32(), "merge requests waiting for compaction"),
    _field("inline_fallbacks", pa.int64(),
           "writes that went to blob storage because the inline budget was full"),
])


def build_report_asset(shards: Sequence[ShardConfig]) -> dg.AssetsDefinition:
    """``report/shard_health`` over ``shards``."""

    @dg.asset(key=REPORT_KEY, group_name=REPORTS_GROUP, kinds={"persist", "pyarrow"},
              deps=[shard_key(s.name) for s in shards],
              description="One row per shard: upper, since, inline bytes and how full the "
                          "inline budget is, batches, pending merges, writes that fell "
                          "through to blob storage. Stored by PersistIOManager (its own "
                          "shard); load it downstream as a pyarrow Table or DataFrame.")
    def shard_health(persist: PersistResource, inline_policy: InlinePolicyResource
                     ) -> pa.Table:
        summaries = persist.client().shard_summaries()
        rows = []
        for shard in shards:
            s = summaries.get(shard.shard_id)
            limit = inline_policy.shard_max_bytes(s)  # the shard's recorded max
            inline = s.inline_bytes if s else 0
            rows.append({
                "shard": shard.name, "shard_id": shard.shard_id,
                "upper": s.upper if s else None, "since": s.since if s else None,
                "inline_bytes": inline,
                "inline_fill": round(inline / limit, 4) if limit else 0.0,
                "batches": s.num_batches if s else 0,
                "pending_merges": s.pending_merges if s else 0,
                "inline_fallbacks": s.inline_fallbacks if s else 0})
        return pa.Table.from_pylist(rows, schema=HEALTH_SCHEMA)

    return shard_health
