"""A fault-injecting consensus wrapper for tests: seeded, so every failure reproduces.

Faults are drawn per ``head``, ``compare_and_set``, ``scan``, ``truncate``,
``list_shards`` and ``list_heads`` by :class:`~persist_pipeline.faults.FaultInjector`.
A ``fail_after`` on ``compare_and_set`` is the hardest case for callers: the record *was*
written, but they see :class:`~persist_pipeline.exceptions.ConsensusUnavailable`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.exceptions import ConsensusUnavailable
from persist_pipeline.faults import FaultConfig, FaultInjector

__all__ = ["OPERATIONS", "FaultConfig", "FaultyConsensus"]

OPERATIONS = frozenset({"head", "compare_and_set", "scan", "truncate", "list_shards", "list_heads"})


class FaultyConsensus(Consensus):
    """Wraps a consensus store and injects the faults a :class:`FaultConfig` describes."""

    def __init__(self, inner: Consensus, config: FaultConfig) -> None:
        self.inner = inner
        self.config = config
        self.faults = FaultInjector(config, OPERATIONS, ConsensusUnavailable)

    def head(self, shard: str) -> VersionedData | None:
        return self.faults.run("head", shard, lambda: self.inner.head(shard))

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        return self.faults.run(
            "compare_and_set",
            f"{shard}@{expected}",
            lambda: self.inner.compare_and_set(shard, expected, new),
        )

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        where = ",".join(f"{w.shard}@{w.expected}" for w in writes)
        return self.faults.run("compare_and_set", where,
                               lambda: self.inner.compare_and_set_many(writes))

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        return self.faults.run("scan", shard, lambda: self.inner.scan(shard, from_seqno, limit))

    def truncate(self, shard: str, seqno: int) -> int:
        return self.faults.run("truncate", shard, lambda: self.inner.truncate(shard, seqno))

    def list_shards(self) -> list[str]:
        return self.faults.run("list_shards", "", self.inner.list_shards)

    def list_heads(self) -> Mapping[str, VersionedData]:
        return self.faults.run("list_heads", "", self.inner.list_heads)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"FaultyConsensus({self.inner!r}, {self.config!r})"
