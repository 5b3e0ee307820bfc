"""Retry transient blob errors: every blob operation persist uses is idempotent."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from persist_pipeline.blob.base import Blob, BlobMeta
from persist_pipeline.exceptions import BlobUnavailable
from persist_pipeline.internal.clock import SYSTEM_CLOCK, Clock
from persist_pipeline.retry import retry_transient

T = TypeVar("T")


class RetryingBlob(Blob):
    """Retries :class:`BlobUnavailable` with jittered exponential backoff.

    Safe because keys are written once with fixed contents: re-running a ``set`` whose
    reply was lost writes the same bytes again, and ``get``/``delete``/``list_keys``
    have no side effects beyond their first success. After ``deadline_s`` of failures
    the last error is raised as :class:`Indeterminate`.
    """

    def __init__(self, inner: Blob, deadline_s: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self.inner = inner
        self.clock = clock
        self.kind = inner.kind
        self.stamp_resolution_s = inner.stamp_resolution_s
        self.deadline_s = deadline_s
        self.retries = 0

    def _retry(self, op: str, call: Callable[[], T]) -> T:
        return retry_transient(call, deadline_s=self.deadline_s, catch=BlobUnavailable,
                               what=f"{self.inner.describe()}: {op}", on_retry=self._count,
                               clock=self.clock)

    def _count(self) -> None:
        self.retries += 1

    def get(self, key: str) -> bytes | None:
        return self._retry("get", lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        return self._retry("get", lambda: self.inner.get_range(key, start, length))

    def local_file(self, key: str) -> str | None:
        return self.inner.local_file(key)  # a local file: nothing to retry

    def set(self, key: str, value: bytes) -> None:
        self._retry("set", lambda: self.inner.set(key, value))

    def delete(self, key: str) -> int | None:
        return self._retry("delete", lambda: self.inner.delete(key))

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        return iter(self._retry("list_keys", lambda: list(self.inner.list_keys(prefix))))

    def sweep_partial_writes(self, prefix: str, stamped_before: float) -> int:
        return self._retry("sweep", lambda: self.inner.sweep_partial_writes(
            prefix, stamped_before))

    def close(self) -> None:
        self.inner.close()

    def location(self) -> tuple[str, str]:
        return self.inner.location()

    def describe(self) -> str:
        return self.inner.describe()
