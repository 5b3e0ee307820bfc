"""Retry transient consensus errors on the operations that are safe to repeat."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.exceptions import ClientClosed, ConsensusUnavailable
from persist_pipeline.internal.clock import SYSTEM_CLOCK, Clock
from persist_pipeline.retry import retry_transient

T = TypeVar("T")


class RetryingConsensus(Consensus):
    """Retries :class:`ConsensusUnavailable` on reads and on ``truncate``.

    ``compare_and_set`` is passed through untouched: a failed CaS is indeterminate, and
    only the state machine (which re-reads state and checks idempotency tokens) may
    decide what to do about it.

    The client owns this wrapper: after :meth:`close` every call raises
    :class:`ClientClosed` (a usage error) rather than the closed store's
    ``ConsensusError`` (which would read as a backend failure).
    """

    def __init__(self, inner: Consensus, deadline_s: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self.inner = inner
        self.clock = clock
        self.deadline_s = deadline_s
        self.retries = 0
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"the PersistClient of {self.inner!r} was closed: open a new "
                               f"client (its handles stop working with it)")

    def _retry(self, op: str, call: Callable[[], T]) -> T:
        self._check_open()
        return retry_transient(call, deadline_s=self.deadline_s, catch=ConsensusUnavailable,
                               what=f"consensus {op}", on_retry=self._count, clock=self.clock)

    def _count(self) -> None:
        self.retries += 1

    def head(self, shard: str) -> VersionedData | None:
        return self._retry("head", lambda: self.inner.head(shard))

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        self._check_open()
        return self.inner.compare_and_set(shard, expected, new)

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        self._check_open()
        return self.inner.compare_and_set_many(writes)

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        return self._retry("scan", lambda: self.inner.scan(shard, from_seqno, limit))

    def truncate(self, shard: str, seqno: int) -> int:
        return self._retry("truncate", lambda: self.inner.truncate(shard, seqno))

    def list_shards(self) -> list[str]:
        return self._retry("list_shards", self.inner.list_shards)

    def list_heads(self) -> Mapping[str, VersionedData]:
        return self._retry("list_heads", self.inner.list_heads)

    def close(self) -> None:
        self._closed = True
        self.inner.close()
