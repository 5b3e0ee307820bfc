"""The ``inline_policy`` resource: the inline-vs-blob decision of every write (Materialize's
inline writes).

Ingestion hands :meth:`InlinePolicyResource.policy` to the library, which decides each
write's placement with it (and re-checks the budget inside the state transition); the
inline pressure sensor, the checks and the alerts read the same ``max_bytes`` from here,
but judge each shard by the max it recorded (:meth:`InlinePolicyResource.shard_max_bytes`):
every process's writes keep within that one, whatever each is configured with.
"""

from __future__ import annotations

from typing import Literal

import dagster as dg
from pydantic import Field

from persist_pipeline import InlinePolicy, ShardSummary
from persist_pipeline.config import INLINE_UPDATE_MAX_BYTES, INLINE_UPDATE_THRESHOLD_BYTES


class InlinePolicyResource(dg.ConfigurableResource):
    """Where a write goes: inline in consensus, or a Parquet part in blob storage."""

    persist_inline_update_threshold_bytes: int = Field(
        default=INLINE_UPDATE_THRESHOLD_BYTES, ge=0,
        description="A write whose encoded size is strictly below this may be inlined "
                    "(0 turns inlining off).")
    persist_inline_update_max_bytes: int = Field(
        default=INLINE_UPDATE_MAX_BYTES, ge=0,
        description="The most inline bytes one shard's state may hold; a write that would "
                    "cross it goes to blob storage instead.")

    def policy(self) -> InlinePolicy:
        """The library's policy object for these settings."""
        return InlinePolicy(self.persist_inline_update_threshold_bytes,
                            self.persist_inline_update_max_bytes)

    @property
    def max_bytes(self) -> int:
        return self.persist_inline_update_max_bytes

    def decide(self, encoded_bytes: int, current_inline_bytes: int) -> Literal["inline", "blob"]:
        """Where a write of ``encoded_bytes`` would go given a shard's inline total."""
        return self.policy().decide(encoded_bytes, current_inline_bytes)

    def shard_max_bytes(self, summary: ShardSummary | None) -> int:
        """The inline max a shard is judged by: the one it recorded (set when it was
        created, changed by ``set_inline_max_bytes``), else this resource's."""
        return summary.inline_bound(self.max_bytes) if summary is not None else self.max_bytes

    def high_water_bytes(self, fraction: float, summary: ShardSummary | None = None) -> int:
        """The inline total at which a shard counts as under pressure (at least 1 byte):
        ``fraction`` of the shard's max (:meth:`shard_max_bytes`)."""
        return max(1, int(self.shard_max_bytes(summary) * fraction))
