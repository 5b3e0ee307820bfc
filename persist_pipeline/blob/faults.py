"""A fault-injecting blob wrapper for tests: seeded, so every failure is reproducible.

The faults (slow, fail before running, run then report failure: the lost reply) are
drawn by :class:`~persist_pipeline.faults.FaultInjector` per ``get``, ``set``,
``delete`` and ``list_keys``. Malformed keys raise InvalidInput before any draw, so
input errors are never masked by injected faults.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TypeVar

from persist_pipeline.blob.base import Blob, BlobMeta, validate_key, validate_prefix
from persist_pipeline.exceptions import BlobUnavailable
from persist_pipeline.faults import FaultConfig, FaultInjector

__all__ = ["OPERATIONS", "FaultConfig", "FaultyBlob"]

T = TypeVar("T")

OPERATIONS = frozenset({"get", "set", "delete", "list_keys"})


class FaultyBlob(Blob):
    """Wraps a blob store and injects faults as configured by a :class:`FaultConfig`.

    Attributes:
        injected: how many faults of each kind were injected, keyed by
            ``"fail_before"``, ``"fail_after"`` and ``"slow"``.
        history: ``(operation, fault kinds)`` per call, for comparing runs.
        enabled: set to False to pass every call through untouched (and draw nothing).

    Args:
        inner: the store to wrap.
        config: the faults to inject.
    """

    def __init__(self, inner: Blob, config: FaultConfig) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.stamp_resolution_s = inner.stamp_resolution_s
        self.config = config
        self.faults = FaultInjector(config, OPERATIONS, BlobUnavailable)

    @property
    def injected(self) -> Counter[str]:
        return self.faults.injected

    @property
    def history(self) -> list[tuple[str, tuple[str, ...]]]:
        return self.faults.history

    @property
    def enabled(self) -> bool:
        return self.faults.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.faults.enabled = value

    def _run(self, op: str, what: str, call: Callable[[], T]) -> T:
        return self.faults.run(op, what, call)

    def get(self, key: str) -> bytes | None:
        """The inner ``get``, with faults."""
        validate_key(key)
        return self._run("get", repr(key), lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """The inner ``get_range``, with the faults of ``get``."""
        validate_key(key)
        return self._run("get", repr(key), lambda: self.inner.get_range(key, start, length))

    def set(self, key: str, value: bytes) -> None:
        """The inner ``set``, with faults (``fail_after`` means it *was* written)."""
        validate_key(key)
        self._run("set", repr(key), lambda: self.inner.set(key, value))

    def delete(self, key: str) -> int | None:
        """The inner ``delete``, with faults (``fail_after`` means it *was* deleted)."""
        validate_key(key)
        return self._run("delete", repr(key), lambda: self.inner.delete(key))

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """The inner listing, collected eagerly so faults are injected at the call."""
        validate_prefix(prefix)
        found = self._run("list_keys", repr(prefix), lambda: list(self.inner.list_keys(prefix)))
        return iter(found)

    def sweep_partial_writes(self, prefix: str, stamped_before: float) -> int:
        """The inner sweep, with the faults of ``delete``."""
        validate_prefix(prefix)
        return self._run("delete", repr(prefix), lambda: self.inner.sweep_partial_writes(
            prefix, stamped_before))

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()

    def location(self) -> tuple[str, str]:
        return self.inner.location()

    def describe(self) -> str:
        """The inner store's description, noting the faults."""
        return f"{self.inner.describe()} (fault injection, seed {self.config.seed})"

    def __repr__(self) -> str:
        return f"FaultyBlob({self.inner!r}, {self.config!r})"
