"""The simulated clients: each a process of one or more threads running the library's
real handles, compaction (in process and the Spark executor's task function) and GC.

Every call's outcome is checked: acknowledged writes and failures go into the model, and
every negative answer (an upper mismatch, fenced out, an expired lease, a missed
deadline) is checked against what consensus actually held during the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from persist_pipeline import spark as spark_driver
from persist_pipeline.exceptions import (
    CommitDeadlineExceeded,
    FencedOut,
    Indeterminate,
    InvalidFrontier,
    LeaseExpired,
    PersistError,
    SinceViolation,
    UnsettledCommit,
    UpperMismatch,
)
from persist_pipeline.frontier import Frontier, less_than
from persist_pipeline.sim.scheduler import Process

if TYPE_CHECKING:
    from persist_pipeline.client import PersistClient
    from persist_pipeline.read import Listen, ReadHandle
    from persist_pipeline.sim.runner import SimRun


@dataclass
class Holder:
    """What the threads of one simulated process share."""

    value: Any = None
    since: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _upper_at_least(current: Frontier, floor: Frontier) -> bool:
    return not less_than(current, floor)


def _unexpected(run: SimRun, what: str, e: BaseException) -> None:
    run.violation(f"{what}: unexpected {type(e).__name__}: {e}")


# --- writers ------------------------------------------------------------------------------


def writer(run: SimRun, proc: Process) -> None:
    client = run.client(proc)
    handle = run.retry_open(lambda: client.open_writer(run.shard))
    if handle is None:
        return
    run.spawn(f"{proc.name}/heartbeat", proc, lambda: heartbeat(run, handle._beat))
    n = 0
    while not run.stopping:
        run.think()
        rng = run.rng
        roll = rng.random()
        if roll < 0.2:
            expected = run.monitor.upper  # learned from another client: a side channel
        elif roll < 0.3:
            try:
                expected = handle.fetch_recent_upper()
            except Indeterminate:
                continue
        else:
            expected = handle.upper
        if expected is None:
            return
        new_upper = expected + rng.randint(1, 3)
        n += 1
        wid = f"{proc.name}.{n}"
        size = rng.choice([0, 1, 1, 3, 12])
        width = rng.choice([4, 40, 700])
        rows = [(f"w/{wid}/{i}".encode(), bytes([97 + i % 26]) * width, expected,
                 rng.choice([1, 2, -1])) for i in range(size)]
        write = None
        if rows:
            rows.append((b"ctr", b"x", expected, 1))
            write = run.model.new_write(wid, expected, rows)
        floor = run.monitor.upper
        started_s = run.clock.monotonic()
        try:
            handle.compare_and_append(rows, expected, new_upper)
            status = "acked"
        except UpperMismatch as e:
            status = "failed"
            if not _upper_at_least(e.current, floor) or e.current == expected:
                run.violation(f"false UpperMismatch: told the upper is {e.current} (expected "
                              f"{expected}) when consensus already had {floor}")
        except CommitDeadlineExceeded:
            status = "failed"
            # The shard's age (the driver's, which created it), or the writer's own
            # when shorter.
            age_s = min(run.config.gc_orphan_min_age_s,
                        run.config_of(proc).gc_orphan_min_age_s)
            deadline = started_s + age_s / 2
            if run.clock.monotonic() <= deadline:
                run.violation("CommitDeadlineExceeded before the deadline passed")
        except UnsettledCommit as e:
            status = "unknown"
            if e.batch_id is not None and run.monitor.kept_history_holds(e.batch_id):
                run.violation(f"Indeterminate for a write whose batch {e.batch_id} a kept "
                              f"state version holds (the head, or a record naming it)")
        except Indeterminate:
            status = "unknown"
        except PersistError as e:
            status = "unknown"
            _unexpected(run, "compare_and_append", e)
        run.ops += 1
        if write is not None:
            run.model.settle(write, status)


def appender(run: SimRun, proc: Process) -> None:
    """Writes definite data with ``append``: racing appenders write each time once."""
    client = run.client(proc)
    handle = run.retry_open(lambda: client.open_writer(run.shard))
    if handle is None:
        return
    run.spawn(f"{proc.name}/heartbeat", proc, lambda: heartbeat(run, handle._beat))
    while not run.stopping:
        run.think()
        lo = run.monitor.upper if run.rng.random() < 0.5 else handle.upper
        if lo is None:
            return
        hi = lo + run.rng.randint(1, 3)
        rows = [(f"def/{t}".encode(), b"d", t, 1) for t in range(lo, hi)]
        run.model.def_attempted.update(range(lo, hi))
        floor = run.monitor.upper
        try:
            res = handle.append(rows, lo, hi)
            if res.placement != "none":
                run.model.def_acked.add(hi - 1)
        except UpperMismatch as e:
            if not _upper_at_least(e.current, floor):
                run.violation(f"false UpperMismatch from append: told {e.current}, consensus "
                              f"already had {floor} (a gap that is not there)")
        except (Indeterminate, CommitDeadlineExceeded):
            pass
        except PersistError as e:
            _unexpected(run, "append", e)
        run.ops += 1


def heartbeat(run: SimRun, beat: Callable[[], None]) -> None:
    while not run.stopping:
        run.clock.sleep(run.heartbeat_interval_s)
        try:
            beat()
        except LeaseExpired:
            return
        except Indeterminate:
            pass
        except PersistError as e:
            _unexpected(run, "heartbeat", e)
        run.ops += 1


# --- readers ------------------------------------------------------------------------------


def _open_reader(run: SimRun, client: PersistClient, holder: Holder) -> ReadHandle | None:
    reader = run.retry_open(lambda: client.open_reader(run.shard))
    holder.value = reader
    holder.since = 0 if reader is None else int(reader.since or 0)
    return reader


def _reader_heartbeat(run: SimRun, holder: Holder) -> None:
    while not run.stopping:
        run.clock.sleep(run.heartbeat_interval_s)
        reader = holder.value
        if reader is None:
            continue
        try:
            reader.heartbeat()
        except (LeaseExpired, Indeterminate):
            pass
        except PersistError as e:
            _unexpected(run, "reader heartbeat", e)
        run.ops += 1


def _check_expired(run: SimRun, reader_id: str, what: str) -> None:
    if reader_id in run.monitor.head.leased_readers:
        run.violation(f"{what}: LeaseExpired for reader {reader_id}, which consensus still has")


def reader(run: SimRun, proc: Process) -> None:
    """Two snapshot threads and a heartbeat thread sharing one leased reader, and a
    compaction thread sharing their client (so the cached state moves under them)."""
    client = run.client(proc)
    holder = Holder()
    if _open_reader(run, client, holder) is None:
        return
    run.spawn(f"{proc.name}/heartbeat", proc, lambda: _reader_heartbeat(run, holder))
    run.spawn(f"{proc.name}/snapshots-2", proc, lambda: _snapshots(run, client, holder))
    if run.rng.random() < 0.5:
        run.spawn(f"{proc.name}/compact", proc, lambda: _compact_loop(run, client))
    _snapshots(run, client, holder)


def _compact_loop(run: SimRun, client: PersistClient) -> None:
    _loop(run, "compact", lambda: client.compact(run.rng.choice(run.shards())), scale=2.0)


def _loop(run: SimRun, what: str, op: Callable[[], object], scale: float,
          tolerated: tuple[type[PersistError], ...] = (Indeterminate,)) -> None:
    """Run ``op`` until the workload stops; outcomes other than ``tolerated`` are
    violations."""
    while not run.stopping:
        run.think(scale=scale)
        try:
            op()
        except tolerated:
            pass
        except PersistError as e:
            _unexpected(run, what, e)
        run.ops += 1


def _snapshots(run: SimRun, client: PersistClient, holder: Holder) -> None:
    while not run.stopping:
        run.think()
        reader = holder.value
        if reader is None:
            return
        upper = run.monitor.upper
        if upper is None or upper == 0:
            continue
        lo = holder.since
        try:
            if run.rng.random() < 0.25 and lo < upper - 1:
                # Half the time all the way to the latest time, so since follows the upper.
                top = upper - 1
                target = top if run.rng.random() < 0.5 else run.rng.randint(lo, top)
                holder.since = max(holder.since, target)  # even if the reply is lost
                reader.downgrade_since(target)
            elif lo <= upper - 1:
                as_of = run.rng.randint(lo, upper - 1)
                table = reader.snapshot(as_of)
                run.model.check(as_of, _rows(table), f"snapshot at {as_of}")
        except LeaseExpired:
            _check_expired(run, reader.reader_id, "snapshot")
            if holder.value is reader:
                _open_reader(run, client, holder)
        except SinceViolation:
            if holder.since <= lo:
                run.violation("SinceViolation for an as_of at or above the reader's since")
        except (Indeterminate, InvalidFrontier):
            pass
        except PersistError as e:
            _unexpected(run, "snapshot", e)
        run.ops += 1


def _rows(table: Any) -> list[tuple[bytes, bytes, int, int]]:
    d = table.to_pydict()
    return list(zip(d["k"], d["v"], d["t"], d["d"], strict=True))


def listener(run: SimRun, proc: Process) -> None:
    """A snapshot followed by a listen, checked at every progress frontier; it also
    releases since past its own frontier now and then. In profiles with
    ``sibling_listens``, a second thread of the process opens a listen of its own on the
    same reader meanwhile, at a time at or above the since (whose release by the first
    listen must not pass it)."""
    client = run.client(proc)
    holder = Holder()
    reader = _open_reader(run, client, holder)
    if reader is None:
        return
    run.spawn(f"{proc.name}/heartbeat", proc, lambda: _reader_heartbeat(run, holder))
    while not run.stopping and (run.monitor.upper or 0) == 0:
        run.think()
    upper = run.monitor.upper
    if upper is None or run.stopping:
        return
    as_of = run.rng.randint(min(holder.since, upper - 1), upper - 1)
    opened = _open_listen(run, reader, holder, as_of, "listen")
    if opened is None:
        return
    if run.profile.sibling_listens:
        run.spawn(f"{proc.name}/listen2", proc,
                  lambda: _sibling_listen(run, reader, holder))
    _follow(run, reader, holder, *opened, releases=True, what="listen")


def _open_listen(run: SimRun, reader: ReadHandle, holder: Holder, as_of: int, what: str
                 ) -> tuple[Listen, dict[tuple[bytes, bytes], int]] | None:
    """The snapshot at ``as_of``, checked, and a listen from there; None when the reader
    expired, the outcome is unknown, or (the sibling's) since moved past ``as_of``."""
    try:
        acc: dict[tuple[bytes, bytes], int] = {}
        for k, v, _t, d in _rows(reader.snapshot(as_of)):
            acc[(k, v)] = acc.get((k, v), 0) + d
        run.model.check(as_of, _acc_rows(acc, as_of), f"{what}'s snapshot at {as_of}")
        return reader.listen(as_of), acc
    except (LeaseExpired, Indeterminate):
        return None
    except SinceViolation:
        # Fine only when another thread of the process asked for a since past as_of
        # meanwhile: nothing else may move it.
        if as_of >= holder.since:
            run.violation(f"{what} setup: SinceViolation at {as_of}, at or above the "
                          f"since {holder.since} the reader asked for")
        return None
    except PersistError as e:
        _unexpected(run, f"{what} setup", e)
        return None


def _sibling_listen(run: SimRun, reader: ReadHandle, holder: Holder) -> None:
    """Listens of the same reader, one after another, each opened while the first
    listen polls and releases since (the release of the first and the registration of
    each race), followed for a few polls and closed."""
    while not run.stopping:
        run.think()
        upper = run.monitor.upper
        if not upper or holder.since >= upper:
            continue
        # Often at the since itself: a release past it is the race's harm.
        as_of = holder.since if run.rng.random() < 0.5 \
            else run.rng.randint(holder.since, upper - 1)
        run.think()  # the since may move meanwhile: then the listen is refused
        opened = _open_listen(run, reader, holder, as_of, "second listen")
        if opened is None:
            continue
        if not _follow(run, reader, holder, *opened, releases=False, what="second listen",
                       polls=run.rng.randint(1, 4)):
            return
        opened[0].close()


def _follow(run: SimRun, reader: ReadHandle, holder: Holder, listen: Listen,
            acc: dict[tuple[bytes, bytes], int], *, releases: bool, what: str,
            polls: int | None = None) -> bool:
    """Polls ``listen`` (``polls`` times, or until the run stops), checking the
    collection at every frontier it reports; when ``releases``, it also moves the
    reader's since now and then. False when the reader can no longer be used."""
    while not run.stopping and (polls is None or polls > 0):
        if polls is not None:
            polls -= 1
        run.think(scale=run.profile.listen_lag)  # a listen that lags behind the writers
        try:
            if releases and run.rng.random() < 0.3 and run.monitor.upper:
                top = max(0, run.monitor.upper - 1)
                # Often all the way up: past this listen's own frontier.
                pick = top if run.rng.random() < 0.5 else run.rng.randint(0, top)
                target = max(holder.since, pick)
                holder.since = target
                reader.downgrade_since(target)  # compaction may run before the next poll
            else:
                for event in listen.poll(0.0):
                    if event.kind == "updates" and event.updates is not None:
                        for k, v, _t, d in _rows(event.updates):
                            acc[(k, v)] = acc.get((k, v), 0) + d
                    elif event.upper is not None:
                        at = event.upper - 1
                        run.model.check(at, _acc_rows(acc, at),
                                        f"{what} at frontier {event.upper}")
        except LeaseExpired:
            _check_expired(run, reader.reader_id, what)
            return False
        except (Indeterminate, InvalidFrontier):
            pass
        except PersistError as e:
            _unexpected(run, what, e)
            return False
        run.ops += 1
    return True


def _acc_rows(acc: dict[tuple[bytes, bytes], int], at: int) -> list[tuple[bytes, bytes, int, int]]:
    return [(k, v, at, d) for (k, v), d in acc.items() if d]


def controller(run: SimRun, proc: Process) -> None:
    """One of two controllers sharing a critical reader, fencing each other by token."""
    client = run.client(proc)
    handle = run.retry_open(lambda: client.open_critical_reader(run.shard, run.critical_id))
    if handle is None:
        return
    expected = handle.opaque
    n = 0
    while not run.stopping:
        run.think()
        n += 1
        token = f"{proc.name}.{n}".encode()
        current = run.monitor.head.critical_readers.get(run.critical_id)
        held = 0 if current is None or current.since is None else current.since
        upper = run.monitor.upper or 0
        if upper and run.rng.random() < 0.5:
            since = max(held, upper - 1)
        else:
            since = min(max(held, upper - 1), held + run.rng.randint(0, 2)) if upper else held
        try:
            handle.compare_and_downgrade_since(expected, token, since)
            expected = token
        except FencedOut as e:
            if e.current == token:
                run.violation(f"FencedOut by its own write: {proc.name} set {token!r}, the "
                              f"reply was lost, and the retry called it fenced")
            if e.current == expected:
                run.violation("FencedOut with the expected token")
            expected = e.current
        except Indeterminate:
            now = run.monitor.head.critical_readers.get(run.critical_id)
            expected = now.opaque if now is not None else expected
        except InvalidFrontier:
            pass
        except PersistError as e:
            _unexpected(run, "compare_and_downgrade_since", e)
        run.ops += 1


# --- maintenance --------------------------------------------------------------------------


def compactor(run: SimRun, proc: Process) -> None:
    _compact_loop(run, run.client(proc))


def spark_compactor(run: SimRun, proc: Process) -> None:
    """The Spark driver's code, with the executor's task function run in this process."""
    client = run.client(proc)

    def run_tasks(tasks: list[Any]) -> tuple[list[Any], str]:
        return [spark_driver._run_task(t) for t in tasks], "sim"

    _loop(run, "spark compaction", lambda: spark_driver.drive_compaction(
        run_tasks, client, run.shards(), blob_uri=run.spark_blob_uri,
        wal_blob_uri=run.spark_wal_uri, max_splits=3), scale=4.0,
        tolerated=(Indeterminate, spark_driver.SparkCompactionFailed))


def collector(run: SimRun, proc: Process) -> None:
    client = run.client(proc)
    _loop(run, "gc", lambda: client.gc(run.rng.choice(run.shards())), scale=4.0)


def opener(run: SimRun, proc: Process) -> None:
    """A new process looking at the shard (a CLI ``inspect``), over and over: it reads the
    head, then the rollup it names, while GCs replace rollups."""
    _loop(run, "opening a shard", lambda: run.client(proc).inspect(run.shard), scale=2.0)


def verifier(run: SimRun, proc: Process) -> None:
    """An operator checking a shard's stores (``verify``, shallow or deep) while
    compaction replaces parts and GC collects them, over and over. Nothing is ever lost
    here, so every report must be clean: a blob replaced and collected between the
    check's state read and its look at the store is no problem."""
    client = run.client(proc)

    def check() -> None:
        report = client.verify(run.rng.choice(run.shards()), deep=run.rng.random() < 0.5)
        if not report.ok:
            run.violation(f"verify reported problems in stores that lost nothing: "
                          f"{[(p.kind, p.key) for p in report.problems[:2]]}")

    _loop(run, "verify", check, scale=2.0)


#: The inline maxima a limiter records for the shard: below what the shard holds as
#: often as above it, and 0 (no inlining).
LIMITS = (0, 600, 3000, 12000)


def limiter(run: SimRun, proc: Process) -> None:
    """An operator changing the shard's recorded inline max while writers configured
    with other maxima append and compaction flushes (``set_inline_max_bytes``)."""
    client = run.client(proc)
    _loop(run, "set_inline_max_bytes",
          lambda: client.set_inline_max_bytes(run.shard, run.rng.choice(LIMITS)), scale=6.0)


ROLES: dict[str, Callable[[SimRun, Process], None]] = {
    "opener": opener,
    "verifier": verifier,
    "limiter": limiter,
    "writer": writer,
    "appender": appender,
    "reader": reader,
    "listener": listener,
    "controller": controller,
    "compactor": compactor,
    "spark_compactor": spark_compactor,
    "gc": collector,
}
