"""The library's worker threads (:func:`persist_pipeline.internal.sync.new_worker`),
shared pools (:class:`~persist_pipeline.internal.sync.SharedPool`) and events
(:func:`~persist_pipeline.internal.sync.new_event`).

A merge reads its runs' next chunks on one worker and encodes its output on another;
what it relies on: tasks run in order, off the submitting thread; an error reaches the
submitter and stops the rest; memory stays bounded (a full queue blocks the submitter);
leaving the block, as an abandoned generator does, ends the thread; the simulation's
workers run inline. A forked child gets workers and pools of its own (only the forking
thread survives a fork), so its reads and background rollups run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.internal.sync import SharedPool, inline_workers, new_event, new_worker


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_an_event_wakes_every_waiter_and_stays_set_until_cleared() -> None:
    # What group commit relies on: a wake-up set before the wait is not lost, setting
    # twice (two groups ending at once) is harmless, and a cleared event blocks again.
    event = new_event()
    assert not event.wait(0.01)
    event.set()
    event.set()
    assert event.wait(0) and event.wait(0.01)
    event.clear()
    event.clear()
    assert not event.wait(0.01)
    woken: list[bool] = []
    waiters = [threading.Thread(target=lambda: woken.append(event.wait(10)))
               for _ in range(3)]
    for w in waiters:
        w.start()
    event.set()
    for w in waiters:
        w.join(10)
    assert woken == [True, True, True]
    assert event.wait(None)


def test_tasks_run_in_order_off_the_submitting_thread() -> None:
    ran: list[tuple[int, str]] = []
    with new_worker(2, "test-worker") as worker:
        for n in range(50):
            worker.submit(lambda n=n: ran.append((n, threading.current_thread().name)))
        worker.wait()
        assert [n for n, _ in ran] == list(range(50))
        assert {name for _, name in ran} == {"test-worker"}
        assert not _threads_named("test-worker")  # a worker holds a thread only while busy
        worker.submit(lambda: ran.append((50, threading.current_thread().name)))
        worker.wait()
    assert len(ran) == 51
    assert not _threads_named("test-worker")


def test_an_error_reaches_the_submitter_and_stops_the_rest() -> None:
    ran: list[int] = []
    failed = threading.Event()

    def fail() -> None:
        failed.set()
        raise OSError("disk full")

    with new_worker(4, "test-failing") as worker:
        worker.submit(fail)
        failed.wait(5)
        # The worker records the error as the task returns: a later submit raises it
        # (what it submitted meanwhile is skipped).
        deadline = time.monotonic() + 10
        with pytest.raises(OSError, match="disk full"):
            while time.monotonic() < deadline:
                worker.submit(lambda: ran.append(1))
                time.sleep(0.01)
        worker.submit(lambda: ran.append(2))  # after the error was raised: skipped
        worker.wait()
    assert ran == []
    with new_worker(4, "test-failing") as worker:
        worker.submit(fail)
        worker.submit(lambda: ran.append(3))
        with pytest.raises(OSError, match="disk full"):
            worker.wait()
    assert ran == []
    assert not _threads_named("test-failing")


def test_a_full_queue_blocks_the_submitter() -> None:
    """What bounds the memory a merge holds in flight: ``depth`` tasks wait, no more."""
    release = threading.Event()
    submitted: list[int] = []
    with new_worker(1, "test-bounded") as worker:
        def submit_three() -> None:
            for n in range(3):
                worker.submit(lambda: release.wait(10))
                submitted.append(n)

        submitter = threading.Thread(target=submit_three)
        submitter.start()
        try:
            _wait_until(lambda: len(submitted) >= 2)
            time.sleep(0.3)
            # One task runs (blocked), one waits in the queue; the third cannot be queued.
            assert submitted == [0, 1]
        finally:
            release.set()
        submitter.join(5)
        assert submitted == [0, 1, 2]
        worker.wait()


def test_leaving_the_block_cancels_what_has_not_started() -> None:
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def first() -> None:
        started.set()
        release.wait(5)
        ran.append(1)

    def leave_early() -> None:
        with new_worker(4, "test-cancel") as worker:
            worker.submit(first)
            worker.submit(lambda: ran.append(2))
            started.wait(5)

            def release_once_cancelled() -> None:
                _wait_until(lambda: worker._cancelled)  # type: ignore[attr-defined]
                release.set()

            threading.Thread(target=release_once_cancelled).start()
            raise KeyboardInterrupt  # an error in the submitting thread

    with pytest.raises(KeyboardInterrupt):
        leave_early()
    assert ran == [1]  # the running task finished; the queued one never ran
    assert not _threads_named("test-cancel")


def test_inline_workers_run_each_task_at_submit_on_the_caller() -> None:
    ran: list[str] = []
    with inline_workers(), new_worker(1, "test-inline") as worker:
        worker.submit(lambda: ran.append(threading.current_thread().name))
        assert ran == [threading.current_thread().name]
        with pytest.raises(ValueError):
            worker.submit(lambda: int("x"))
        worker.wait()
    assert not _threads_named("test-inline")


def test_leaving_from_the_workers_own_thread_ends_it() -> None:
    """As when a task's allocation lets the garbage collector finalize the generator
    that owns the worker: no join of the current thread, and the thread ends."""
    worker = new_worker(2, "test-own-exit")
    worker.__enter__()
    done = threading.Event()

    def leave() -> None:
        worker.__exit__(None, None, None)
        done.set()

    worker.submit(leave)
    assert done.wait(10)
    worker.wait()  # raises if leaving failed on the worker's thread
    _wait_until(lambda: not _threads_named("test-own-exit"))


def test_a_forked_child_gets_a_worker_of_its_own() -> None:
    ran: list[int] = []
    with new_worker(1, "test-fork") as worker:
        worker.submit(lambda: ran.append(1))
        worker.wait()
        pid = os.fork()
        if pid == 0:  # the child: the worker's thread stayed in the parent
            signal.alarm(10)
            worker.submit(lambda: ran.append(2))
            worker.wait()
            os._exit(0 if ran == [1, 2] else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        worker.submit(lambda: ran.append(3))
        worker.wait()
    assert ran == [1, 3]


def _in_a_forked_child(body: Callable[[], bool], alarm_s: int = 20) -> None:
    """Run ``body`` in a forked child (killed by SIGALRM if it hangs); it must return
    True."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(alarm_s)
        try:
            ok = body()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status), "the forked child hung (killed by SIGALRM)"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_forked_child_gets_a_shared_pool_of_its_own() -> None:
    pool = SharedPool(2, "test-shared")
    assert pool.get().submit(lambda: 1).result(10) == 1
    parent_pool = pool.get()
    # The parent's threads are idle now: the child's copy would count them and start
    # none, so a task submitted to it would never run.
    _in_a_forked_child(lambda: pool.get() is not parent_pool
                       and pool.get().submit(lambda: 2).result(10) == 2)
    assert pool.get() is parent_pool


def test_a_forked_child_reads_blob_parts_through_the_fetch_pool(tmp_path: Path) -> None:
    client = PersistClient.open(f"sqlite:///{tmp_path}/c.db", f"file://{tmp_path}/b",
                                inline_policy=InlinePolicy(0, 0))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    for n in range(3):
        writer.compare_and_append([(b"k%d" % n, b"v", n, 1)], n, n + 1)
    reader = client.open_reader(shard)
    assert reader.snapshot(2).num_rows == 3  # its small parts go through the fetch pool
    time.sleep(0.5)  # the pool's threads go back to idle (the child would count them)
    _in_a_forked_child(lambda: reader.snapshot(2).num_rows == 3)
    client.close()


def test_a_forked_child_writes_background_rollups(tmp_path: Path) -> None:
    client = PersistClient.open(f"sqlite:///{tmp_path}/c.db", f"file://{tmp_path}/b",
                                config=PersistConfig(rollup_threshold=2,
                                                     background_maintenance=True))
    shard = ShardId.new()
    writer = client.open_writer(shard)

    def append(n: int) -> None:
        writer.compare_and_append([(b"k%d" % n, b"v", n, 1)], n, n + 1)

    for n in range(6):
        append(n)
    client.flush_maintenance(5)  # the parent's rollups ran on the maintenance pool

    def child() -> bool:
        for n in range(6, 12):
            append(n)
        client.flush_maintenance(5)
        return max(client._machine(str(shard)).fetch_latest().rollups) > 8

    _in_a_forked_child(child, alarm_s=30)
    client.close()
