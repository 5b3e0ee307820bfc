"""The locks of the library's handles and machines, made by one factory.

Production gets :mod:`threading` locks and events. The deterministic simulation runs many
simulated threads on one OS thread and swaps in locks that yield to its scheduler when
contended (and events whose waiters yield until set), so every interleaving of two
threads of one process is reachable there too.
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


class EventLike(Protocol):
    """What the library uses of an event: set by one thread, waited on by another."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...


LockFactory = Callable[[bool], LockLike]
EventFactory = Callable[[], EventLike]
_FACTORY: LockFactory | None = None
_EVENT_FACTORY: EventFactory | None = None


def new_lock(reentrant: bool = False) -> LockLike:
    """A mutex (re-entrant if asked) from the installed factory."""
    if _FACTORY is not None:
        return _FACTORY(reentrant)
    return cast(LockLike, threading.RLock() if reentrant else threading.Lock())


def new_event() -> EventLike:
    """An event (initially clear) from the installed factory."""
    if _EVENT_FACTORY is not None:
        return _EVENT_FACTORY()
    return threading.Event()


@contextmanager
def event_factory(factory: EventFactory) -> Iterator[None]:
    """Make every event created inside this block with ``factory``."""
    global _EVENT_FACTORY
    previous, _EVENT_FACTORY = _EVENT_FACTORY, factory
    try:
        yield
    finally:
        _EVENT_FACTORY = previous


@contextmanager
def lock_factory(factory: LockFactory) -> Iterator[None]:
    """Make every lock created inside this block with ``factory``."""
    global _FACTORY
    previous, _FACTORY = _FACTORY, factory
    try:
        yield
    finally:
        _FACTORY = previous


__all__ = ["EventFactory", "EventLike", "LockFactory", "LockLike", "event_factory",
           "lock_factory", "new_event", "new_lock"]
