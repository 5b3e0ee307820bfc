"""Settings: every tunable is a named constant with its default and a one-line meaning.

:class:`InlinePolicy` decides where a write goes; :class:`PersistConfig` holds the rest.
Both can be read from the environment (``PERSIST_*`` variables).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

from persist_pipeline.exceptions import InvalidConfig

#: Writes whose encoded size is strictly below this may be inlined into consensus.
INLINE_UPDATE_THRESHOLD_BYTES = 4096
#: The most inline bytes one shard's state may hold (inclusive).
INLINE_UPDATE_MAX_BYTES = 1 << 20
#: Target size of one Parquet part written by a large write or by compaction.
BLOB_TARGET_SIZE_BYTES = 64 << 20
#: Write a full-state rollup to blob every this many seqnos.
ROLLUP_THRESHOLD = 128
#: Leased readers and writers that miss heartbeats for this long are expired.
READER_LEASE_DURATION_S = 15 * 60.0
#: How often handles heartbeat in the background (a fraction of the lease).
HEARTBEAT_INTERVAL_S = 60.0
#: GC only deletes unreferenced blobs older than this (protects in-flight writes), and
#: commits that reference fresh blobs must land within half of it. A shard records the
#: value of the process that created it, and every process goes by the shard's: a GC
#: configured larger sweeps with its own, a writer configured smaller commits within
#: half its own.
GC_ORPHAN_MIN_AGE_S = 3600.0
#: Bytes of fetched parts kept in the in-process LRU cache.
BLOB_CACHE_BYTES = 64 << 20
#: How long a compare-and-set loop retries transient backend errors before giving up.
RETRY_DEADLINE_S = 60.0
#: How often a listen polls consensus for new data.
LISTEN_POLL_INTERVAL_S = 0.1
#: Write rollups on a background thread instead of in the committing writer's call.
BACKGROUND_MAINTENANCE = True
#: Bytes of updates one merge or one streaming snapshot holds in memory (Materialize's
#: ``compaction_memory_bound_bytes``); larger merges stream and, past the fan-in, run in passes.
COMPACTION_MEMORY_BOUND_BYTES = 256 << 20
#: Merges of more input bytes than this are split by key range into several Spark tasks.
COMPACTION_SPLIT_BYTES = 256 << 20
#: Parts one read fetches in parallel (1: one after another, on the caller's thread).
READ_FETCH_THREADS = 8
#: Funnel a process's concurrent appends to different shards into shared consensus
#: round trips (group commit); each still succeeds or fails on its own upper.
GROUP_COMMIT = True
#: How long a group commit waits for more appends before committing. 0: none; appends
#: that arrive while a group is committing form the next group (no added latency).
GROUP_COMMIT_WINDOW_S = 0.0
#: Bytes of staged appends a process's funnel holds at once; writers beyond it wait.
GROUP_COMMIT_MAX_INFLIGHT_BYTES = 64 << 20

Placement = Literal["inline", "wal", "blob", "none"]


@dataclass(frozen=True, slots=True)
class InlinePolicy:
    """Where a write goes: inline in consensus, or a blob part (Materialize's inline writes).

    A write whose encoded size is strictly below ``threshold_bytes`` is an inline
    candidate; it is inlined only if the shard's inline total stays within
    ``max_bytes``, which is checked again inside the state transition (only there is
    the current total known for sure), where it is also held to the max the shard
    recorded: every process inlines up to the smaller of the two (see
    ``PersistClient.set_inline_max_bytes``). ``InlinePolicy(0, 0)`` turns inlining off and
    ``InlinePolicy(4096, 0)`` is permanent backpressure (every write falls through).

    Attributes:
        threshold_bytes: ``persist_inline_update_threshold_bytes`` (exclusive).
        max_bytes: ``persist_inline_update_max_bytes`` (inclusive).
    """

    threshold_bytes: int = INLINE_UPDATE_THRESHOLD_BYTES
    max_bytes: int = INLINE_UPDATE_MAX_BYTES

    def __post_init__(self) -> None:
        for name in ("threshold_bytes", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidConfig(f"InlinePolicy.{name} must be a non-negative int, "
                                    f"got {value!r}")

    def is_candidate(self, encoded_bytes: int) -> bool:
        """Whether a write of this encoded size may be inlined at all."""
        return encoded_bytes < self.threshold_bytes

    def fits(self, encoded_bytes: int, current_inline_bytes: int) -> bool:
        """Whether inlining this write keeps the shard within ``max_bytes``."""
        return self.is_candidate(encoded_bytes) and (
            current_inline_bytes + encoded_bytes <= self.max_bytes
        )

    def decide(self, encoded_bytes: int, current_inline_bytes: int) -> Literal["inline", "blob"]:
        """The destination for a write, given the shard's current inline total."""
        return "inline" if self.fits(encoded_bytes, current_inline_bytes) else "blob"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> InlinePolicy:
        """Read ``PERSIST_INLINE_UPDATE_THRESHOLD_BYTES`` / ``..._MAX_BYTES``."""
        env = os.environ if env is None else env
        return cls(
            threshold_bytes=_env_int(env, "PERSIST_INLINE_UPDATE_THRESHOLD_BYTES",
                                     INLINE_UPDATE_THRESHOLD_BYTES),
            max_bytes=_env_int(env, "PERSIST_INLINE_UPDATE_MAX_BYTES", INLINE_UPDATE_MAX_BYTES),
        )


def shard_inline_max_bytes(recorded: int | None, configured: int) -> int:
    """The bound a shard's inline bytes are judged by (the checks, sensors and alerts):
    the max the shard recorded (no write leaves more inline than it), else, for a shard
    without one (created by an older build, or by a process with inlining off, and not
    appended to since by a process that inlines), the ``configured`` max of the process
    judging. A process's own writes go by the smaller of its configured max
    and the recorded one (``transitions.inline_write_bound``)."""
    return configured if recorded is None else recorded


#: The policy of a config built without one (identity tells "not given" from an explicit
#: ``InlinePolicy()``, so a client may take the policy from elsewhere).
_UNSET_INLINE_POLICY = InlinePolicy()


#: The longest duration a setting may name (about 31 years): longer ones overflow the
#: timestamps and waits they become.
MAX_DURATION_S = 1e9

@dataclass(frozen=True, slots=True)
class PersistConfig:
    """Every tunable; defaults are the constants above.

    ``inline_policy`` left out means the default policy unless the client is told
    otherwise (``PersistClient.open``'s keyword or the environment); given, it wins over
    the environment, and a contradicting keyword is refused.
    """

    inline_policy: InlinePolicy = _UNSET_INLINE_POLICY
    blob_target_size_bytes: int = BLOB_TARGET_SIZE_BYTES
    rollup_threshold: int = ROLLUP_THRESHOLD
    reader_lease_duration_s: float = READER_LEASE_DURATION_S
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    gc_orphan_min_age_s: float = GC_ORPHAN_MIN_AGE_S
    blob_cache_bytes: int = BLOB_CACHE_BYTES
    retry_deadline_s: float = RETRY_DEADLINE_S
    listen_poll_interval_s: float = LISTEN_POLL_INTERVAL_S
    background_maintenance: bool = BACKGROUND_MAINTENANCE
    read_fetch_threads: int = READ_FETCH_THREADS
    compaction_memory_bound_bytes: int = COMPACTION_MEMORY_BOUND_BYTES
    compaction_split_bytes: int = COMPACTION_SPLIT_BYTES
    group_commit: bool = GROUP_COMMIT
    group_commit_window_s: float = GROUP_COMMIT_WINDOW_S
    group_commit_max_inflight_bytes: int = GROUP_COMMIT_MAX_INFLIGHT_BYTES

    @property
    def inline_policy_given(self) -> bool:
        """Whether this config was built with an explicit inline policy."""
        return self.inline_policy is not _UNSET_INLINE_POLICY

    def __post_init__(self) -> None:
        if not isinstance(self.inline_policy, InlinePolicy):
            raise InvalidConfig(f"PersistConfig.inline_policy must be an InlinePolicy, got "
                                f"{type(self.inline_policy).__name__}")
        for f in fields(self):
            if f.name in ("inline_policy", "background_maintenance", "group_commit"):
                continue
            value = getattr(self, f.name)
            # NaN passes every comparison, and an infinite duration overflows the clocks
            # and timestamps it becomes: both are refused here, not by a later crash.
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not math.isfinite(value) or value < 0:
                raise InvalidConfig(f"PersistConfig.{f.name} must be a finite, non-negative "
                                    f"number, got {value!r}")
            if f.name.endswith("_s") and value > MAX_DURATION_S:
                raise InvalidConfig(f"PersistConfig.{f.name} must be at most "
                                    f"{MAX_DURATION_S:.0e} seconds, got {value!r}")
        if self.gc_orphan_min_age_s < 1:
            raise InvalidConfig("PersistConfig.gc_orphan_min_age_s must be at least 1 second: "
                                "writers need half of it to commit the parts they upload")
        if isinstance(self.rollup_threshold, float) or self.rollup_threshold < 1:
            raise InvalidConfig("PersistConfig.rollup_threshold must be an int of at least 1")
        if isinstance(self.read_fetch_threads, float) or self.read_fetch_threads < 1:
            raise InvalidConfig("PersistConfig.read_fetch_threads must be an int of at least 1")
        bound = self.compaction_memory_bound_bytes
        if isinstance(bound, float) or bound < (1 << 20):
            raise InvalidConfig("PersistConfig.compaction_memory_bound_bytes must be an int of "
                                f"at least 1 MiB, got {bound!r}")
        split = self.compaction_split_bytes
        if isinstance(split, float) or split < 1:
            raise InvalidConfig("PersistConfig.compaction_split_bytes must be an int of at "
                                f"least 1, got {split!r}")
        if not isinstance(self.group_commit, bool):
            raise InvalidConfig(f"PersistConfig.group_commit must be a bool, got "
                                f"{self.group_commit!r}")
        if self.group_commit_window_s > 1:
            raise InvalidConfig("PersistConfig.group_commit_window_s must be at most 1 second, "
                                f"got {self.group_commit_window_s!r}")
        if isinstance(self.group_commit_max_inflight_bytes, float) or \
                self.group_commit_max_inflight_bytes < 1:
            raise InvalidConfig("PersistConfig.group_commit_max_inflight_bytes must be an int "
                                "of at least 1")
        if self.blob_target_size_bytes < 1:
            raise InvalidConfig("PersistConfig.blob_target_size_bytes must be at least 1")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise InvalidConfig(f"{name} must be an integer number of bytes, got {raw!r}") from None
    if value < 0:
        raise InvalidConfig(f"{name} must be non-negative, got {value}")
    return value
