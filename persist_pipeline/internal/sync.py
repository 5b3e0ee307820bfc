"""The locks, events and worker threads of the library, made by one factory.

Production gets :mod:`threading` locks and events, and workers that run tasks on a thread
of their own. The deterministic simulation runs many simulated threads on one OS thread
and swaps in locks that yield to its scheduler when contended (and events whose waiters
yield until set), so every interleaving of two threads of one process is reachable there
too; its workers run each task at once, on the submitting thread, since a real thread
would step outside its scheduler.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
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


class Worker(Protocol):
    """Runs tasks in the order submitted, beside the submitting thread.

    Used as a context manager: leaving the block (an error in the submitting thread, or
    a generator closed early) cancels what has not started, waits for what has and ends
    the thread.
    """

    def submit(self, task: Callable[[], object]) -> None:
        """Queue ``task``; blocks while the worker is a full queue behind. Raises the
        error of an earlier task (the tasks after a failed one never run)."""

    def wait(self) -> None:
        """Wait until every submitted task ran, and for the thread to end (a worker holds
        a thread only while it has tasks); raise the first task's error, if any."""

    def __enter__(self) -> Worker: ...

    def __exit__(self, *exc: object) -> None: ...


LockFactory = Callable[[bool], LockLike]
EventFactory = Callable[[], EventLike]
_FACTORY: LockFactory | None = None
_EVENT_FACTORY: EventFactory | None = None
_INLINE_WORKERS = False


def new_lock(reentrant: bool = False) -> LockLike:
    """A mutex (re-entrant if asked) from the installed factory."""
    if _FACTORY is not None:
        return _FACTORY(reentrant)
    return cast(LockLike, threading.RLock() if reentrant else threading.Lock())


def new_event() -> EventLike:
    """An event (initially clear) from the installed factory."""
    if _EVENT_FACTORY is not None:
        return _EVENT_FACTORY()
    return _Signal()


class _Signal:
    """An event made of one lock, unlocked while set: waiting and setting are single C
    calls, where :class:`threading.Event` runs a condition variable in Python (a lock
    made per wait, and a woken waiter that must take the condition's lock again, often
    still held by the setter: one more sleep and wake-up). Group commit's appends each
    wait on one of these, so their cost is paid per append.

    Every operation is atomic: the lock's own state is the flag, so concurrent setters,
    clearers and waiters need no lock of their own.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # clear

    # try/except, not contextlib.suppress: a context manager object per call on a path
    # every grouped append takes.
    def set(self) -> None:
        try:  # noqa: SIM105
            self._lock.release()
        except RuntimeError:
            pass  # already set

    def clear(self) -> None:
        self._lock.acquire(False)

    def wait(self, timeout: float | None = None) -> bool:
        lock = self._lock
        if not lock.acquire(True, -1 if timeout is None else timeout):
            return False
        # Set again for any other waiter (and for a wait that follows): the lock is only
        # held while clear. A setter may have released it meanwhile: then it is set.
        try:  # noqa: SIM105
            lock.release()
        except RuntimeError:
            pass
        return True


def new_worker(depth: int, name: str) -> Worker:
    """A worker that runs tasks on a thread named ``name`` with at most ``depth`` tasks
    waiting (what bounds the memory they hold), or, inside :func:`inline_workers`, one
    that runs each at once on the submitting thread."""
    if _INLINE_WORKERS:
        return _InlineWorker()
    return _ThreadWorker(depth, name)


class _ThreadWorker:
    def __init__(self, depth: int, name: str) -> None:
        self._depth = max(1, depth)
        self._queue: queue.Queue[Callable[[], object] | None] = queue.Queue(self._depth)
        self._name = name
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._error: BaseException | None = None
        self._cancelled = False  # tasks are skipped: after an error, or when leaving
        self._leaving = False

    def submit(self, task: Callable[[], object]) -> None:
        self._raise_error()
        if self._thread is None or self._pid != os.getpid():
            # A new thread (and queue: in a forked child the old one's tasks stayed
            # with the parent's thread).
            self._queue = queue.Queue(self._depth)
            self._leaving = False
            self._thread = threading.Thread(target=self._run, args=(self._queue,),
                                            name=self._name, daemon=True)
            self._pid = os.getpid()
            self._thread.start()
        self._queue.put(task)

    def _run(self, tasks: queue.Queue[Callable[[], object] | None]) -> None:
        while True:
            task = tasks.get()
            try:
                if task is None:
                    return
                # After a failure (or a cancel) the rest only drains: the queue never
                # stays full, so a submitter is never blocked for good.
                if self._error is None and not self._cancelled:
                    task()
            except BaseException as e:  # handed to the submitter, raised there
                self._error = e
            finally:
                tasks.task_done()
            if self._leaving and tasks.empty():
                return  # the owner left: nothing more will be queued

    def wait(self) -> None:
        # The thread ends here, not when the owner leaves: a worker idle between tasks
        # (a generator suspended at a yield) holds no thread that a process exit could
        # find (exits with one left idle aborted the interpreter now and then) or that
        # a fork could leave behind.
        self._stop()
        self._raise_error()

    def _stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None or self._pid != os.getpid():
            return  # in a forked child the thread and its tasks stayed behind
        if thread is threading.current_thread():
            # Left on the worker's own thread (its owner garbage-collected by a task
            # it runs): the loop ends once this task and what is queued are done.
            self._leaving = True
            return
        self._queue.put(None)
        thread.join()

    def _raise_error(self) -> None:
        error = self._error
        if error is not None:
            # Cancelled before the error is cleared: the thread skips tasks while either
            # is set, so no task runs after a failed one, even one queued meanwhile.
            self._cancelled = True
            self._error = None
            raise error

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cancelled = True
        self._stop()


class SharedPool:
    """A thread pool shared by every caller in one process, made on first use.

    A forked child gets a pool of its own: its copy of the parent's pool has no threads
    (only the forking thread survives a fork) yet counts the parent's idle ones, so a
    task submitted to it would never run and a read waiting for it would hang.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers = max_workers
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()
        # The lock too is made anew: a parent thread may have held it at the fork.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool = None

    def get(self) -> ThreadPoolExecutor:
        """This process's pool."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(max_workers=self._max_workers,
                                                thread_name_prefix=self._name)
                self._pid = os.getpid()
            return self._pool


class _InlineWorker:
    def submit(self, task: Callable[[], object]) -> None:
        task()

    def wait(self) -> None:
        pass

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@contextmanager
def inline_workers() -> Iterator[None]:
    """Run every worker created inside this block inline (the simulation's workers)."""
    global _INLINE_WORKERS
    previous, _INLINE_WORKERS = _INLINE_WORKERS, True
    try:
        yield
    finally:
        _INLINE_WORKERS = previous


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


__all__ = ["EventFactory", "EventLike", "LockFactory", "LockLike", "SharedPool", "Worker",
           "event_factory",
           "inline_workers", "lock_factory", "new_event", "new_lock", "new_worker"]
