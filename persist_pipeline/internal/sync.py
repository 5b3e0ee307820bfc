"""The locks of the library's handles and machines, made by one factory.

Production gets :mod:`threading` locks. The deterministic simulation runs many simulated
threads on one OS thread and swaps in locks that yield to its scheduler when contended,
so every interleaving of two threads of one process is reachable there too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, cast


class LockLike(Protocol):
    """What the library uses of a lock: a context manager."""

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> object: ...


LockFactory = Callable[[bool], LockLike]
_FACTORY: LockFactory | None = None


def new_lock(reentrant: bool = False) -> LockLike:
    """A mutex (re-entrant if asked) from the installed factory."""
    if _FACTORY is not None:
        return _FACTORY(reentrant)
    return cast(LockLike, threading.RLock() if reentrant else threading.Lock())


@contextmanager
def lock_factory(factory: LockFactory) -> Iterator[None]:
    """Make every lock created inside this block with ``factory``."""
    global _FACTORY
    previous, _FACTORY = _FACTORY, factory
    try:
        yield
    finally:
        _FACTORY = previous


__all__ = ["LockFactory", "LockLike", "lock_factory", "new_lock"]
