"""Seeded, reproducible fault injection shared by the blob and consensus wrappers.

Per call, a :class:`FaultInjector` draws three numbers from one ``random.Random(seed)``
under a lock and, in this order:

1. with probability ``slow``, sleeps ``delay`` seconds before the operation;
2. with probability ``fail_before``, raises the backend's ``Unavailable`` error without
   running it;
3. otherwise runs it, then with probability ``fail_after`` raises anyway: the "lost
   reply" case, where e.g. a write *was* applied but the caller cannot know it.

Three numbers are drawn for every call whatever happens, so the fault sequence depends
only on the seed and the sequence of calls (in a single thread; with several threads,
on the order in which they reach the lock). A merge reads and writes blobs on worker
threads of its own (:func:`~persist_pipeline.internal.sync.new_worker`), so its blob
faults replay exactly only in the deterministic simulation, which runs workers inline.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from persist_pipeline.exceptions import InvalidConfig, Unavailable

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """What faults a wrapper injects.

    Attributes:
        fail_before: probability an operation fails without running.
        fail_after: probability an operation runs and then reports failure anyway.
        slow: probability an operation is delayed by ``delay`` seconds first.
        delay: the delay of a slow operation, in seconds.
        seed: the random seed; equal seeds and call sequences give equal faults.
        operations: the operations faults apply to (None: all of the wrapper's).
    """

    fail_before: float = 0.0
    fail_after: float = 0.0
    slow: float = 0.0
    delay: float = 0.05
    seed: int = 0
    operations: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name in ("fail_before", "fail_after", "slow"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise InvalidConfig(f"FaultConfig.{name} must be in [0, 1], got {value!r}")
        if not isinstance(self.delay, int | float) or not 0.0 <= self.delay < float("inf"):
            raise InvalidConfig(f"FaultConfig.delay must be >= 0 seconds, got {self.delay!r}")


class FaultInjector:
    """Decides and applies faults for one wrapped backend.

    Attributes:
        injected: how many faults of each kind were injected (``"fail_before"``,
            ``"fail_after"``, ``"slow"``).
        history: ``(operation, fault kinds)`` per call, for comparing runs.
        enabled: set to False to pass every call through untouched (and draw nothing).
    """

    def __init__(self, config: FaultConfig, operations: frozenset[str],
                 error: type[Unavailable]) -> None:
        unknown = set(config.operations or ()) - operations
        if unknown:
            raise InvalidConfig(f"FaultConfig.operations has unknown {sorted(unknown)}; "
                                f"this backend has {sorted(operations)}")
        self.config = config
        self.operations = config.operations if config.operations is not None else operations
        self.error = error
        self.enabled = True
        self.injected: Counter[str] = Counter()
        self.history: list[tuple[str, tuple[str, ...]]] = []
        self._rng = random.Random(config.seed)  # noqa: S311 - test faults, not crypto
        self._lock = threading.Lock()

    def draw(self, op: str) -> tuple[bool, bool, bool]:
        """Decide (slow, fail_before, fail_after) for one call of ``op``."""
        if not self.enabled or op not in self.operations:
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

    def run(self, op: str, what: str, call: Callable[[], T]) -> T:
        """Run ``call`` with the faults drawn for ``op``."""
        slow, before, after = self.draw(op)
        if slow:
            time.sleep(self.config.delay)
        if before:
            raise self.error(f"injected fault: {op} {what} failed before running")
        result = call()
        if after:
            raise self.error(f"injected fault: {op} {what} ran but its reply was lost")
        return result
