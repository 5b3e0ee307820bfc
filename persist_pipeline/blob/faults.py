"""A fault-injecting blob wrapper for tests: seeded, so every failure is reproducible.

Per operation (``get``, ``set``, ``delete``, ``list_keys``) :class:`FaultyBlob` draws
three numbers from one ``random.Random(seed)`` under a lock and, in this order:

1. with probability ``slow``, sleeps ``delay`` seconds before the operation;
2. with probability ``fail_before``, raises BlobUnavailable without running it;
3. otherwise runs it, then with probability ``fail_after`` raises BlobUnavailable
   anyway: the "lost reply" case, where e.g. a write *was* applied but the caller cannot
   know it.

Three numbers are drawn for every call whatever happens, so the fault sequence depends
only on the seed and the sequence of calls (in a single thread; with several threads,
on the order in which they reach the lock). Malformed keys raise InvalidInput before
any draw, so input errors are never masked by injected faults.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from persist_pipeline.blob.base import Blob, BlobMeta, validate_key, validate_prefix
from persist_pipeline.exceptions import BlobUnavailable, InvalidConfig

T = TypeVar("T")

OPERATIONS = frozenset({"get", "set", "delete", "list_keys"})


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """What faults a :class:`FaultyBlob` injects.

    Attributes:
        fail_before: probability an operation fails without running.
        fail_after: probability an operation runs and then reports failure anyway.
        slow: probability an operation is delayed by ``delay`` seconds first.
        delay: the delay of a slow operation, in seconds.
        seed: the random seed; equal seeds and call sequences give equal faults.
        operations: the operations faults apply to (default: all four).
    """

    fail_before: float = 0.0
    fail_after: float = 0.0
    slow: float = 0.0
    delay: float = 0.05
    seed: int = 0
    operations: frozenset[str] = field(default=OPERATIONS)

    def __post_init__(self) -> None:
        for name in ("fail_before", "fail_after", "slow"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise InvalidConfig(f"FaultConfig.{name} must be in [0, 1], got {value!r}")
        if not isinstance(self.delay, int | float) or not 0.0 <= self.delay < float("inf"):
            raise InvalidConfig(f"FaultConfig.delay must be >= 0 seconds, got {self.delay!r}")
        unknown = set(self.operations) - OPERATIONS
        if unknown:
            raise InvalidConfig(f"FaultConfig.operations has unknown {sorted(unknown)}")


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
        self.config = config
        self.enabled = True
        self.injected: Counter[str] = Counter()
        self.history: list[tuple[str, tuple[str, ...]]] = []
        self._rng = random.Random(config.seed)  # noqa: S311 - test faults, not crypto
        self._lock = threading.Lock()

    def _draw(self, op: str) -> tuple[bool, bool, bool]:
        """Decide (slow, fail_before, fail_after) for one call of ``op``."""
        if not self.enabled or op not in self.config.operations:
            return False, False, False
        cfg = self.config
        with self._lock:
            slow = self._rng.random() < cfg.slow
            before = self._rng.random() < cfg.fail_before
            after = self._rng.random() < cfg.fail_after and not before
            kinds = tuple(
                name
                for name, hit in (("slow", slow), ("fail_before", before), ("fail_after", after))
                if hit
            )
            self.injected.update(kinds)
            self.history.append((op, kinds))
        return slow, before, after

    def _run(self, op: str, what: str, call: Callable[[], T]) -> T:
        slow, before, after = self._draw(op)
        if slow:
            time.sleep(self.config.delay)
        if before:
            raise BlobUnavailable(f"injected fault: {op} {what} failed before running")
        result = call()
        if after:
            raise BlobUnavailable(f"injected fault: {op} {what} ran but its reply was lost")
        return result

    def get(self, key: str) -> bytes | None:
        """The inner ``get``, with faults."""
        validate_key(key)
        return self._run("get", repr(key), lambda: self.inner.get(key))

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

    def close(self) -> None:
        """Close the inner store."""
        self.inner.close()

    def describe(self) -> str:
        """The inner store's description, noting the faults."""
        return f"{self.inner.describe()} (fault injection, seed {self.config.seed})"

    def __repr__(self) -> str:
        return f"FaultyBlob({self.inner!r}, {self.config!r})"
