"""A seeded cooperative scheduler, a simulated clock and locks that yield to it.

Every simulated thread is a greenlet on the one OS thread. A thread runs until it
reaches a *yield point* (before and after every store call, on a contended lock, when it
sleeps), and the scheduler then picks the next thread with its seeded generator. Time
moves only when the scheduler moves it: a little per step, and straight to the next
wake-up when every thread sleeps. So a run is a function of its seed, and a pause past a
lease or a commit deadline happens exactly where the scheduler put it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from greenlet import greenlet

#: The simulated wall clock starts here (2023-11-14), in seconds since the epoch.
EPOCH_S = 1_700_000_000.0


class SimCrash(BaseException):
    """Unwinds a simulated thread whose process crashed. Never caught by the library."""


@dataclass
class Process:
    """A simulated OS process: its threads die together, without running any cleanup."""

    name: str
    crashable: bool = True
    crashed: bool = False
    #: How far this process's wall clock is from the simulation's true time (a machine
    #: whose clock is off), and where its monotonic clock starts (monotonic values of two
    #: processes are never comparable).
    wall_skew_s: float = 0.0
    mono_origin_s: float = 0.0


@dataclass(eq=False)
class Task:
    """A simulated thread."""

    name: str
    process: Process
    glet: greenlet
    wake_at: float = 0.0
    blocked_on: SimLock | SimEvent | None = None
    done: bool = False


@dataclass
class Nemesis:
    """How often the scheduler injects each fault, per yield point or per store call."""

    fail_before: float = 0.03
    fail_after: float = 0.03
    pause: float = 0.004
    #: Pauses are likelier right before a compare-and-set and right after its reply:
    #: the moments where a lease, a deadline or a peer's commit changes the outcome.
    pause_at_cas: float = 0.03
    crash: float = 0.002
    pause_choices_s: tuple[float, ...] = (0.5, 2.5, 5.0, 9.0, 20.0)
    #: A compare-and-set lands, then its process pauses past its leases (GC expires its
    #: writer and truncates the record that would settle it) and the reply is lost.
    pause_then_lose: float = 0.0
    pause_then_lose_s: tuple[float, ...] = (9.0, 20.0)
    #: One thread stalls while the rest of its process runs on (descheduled under load).
    stall: float = 0.01
    stall_choices_s: tuple[float, ...] = (0.1, 0.5, 1.5, 4.0)
    #: A store (consensus, or one blob store) goes down for every process at once, each
    #: call to it failing before it takes effect: the durations longer than the retry
    #: deadline make retries give up, so every caller's answer to an outage is exercised.
    outage: float = 0.0
    outage_choices_s: tuple[float, ...] = (3.0, 30.0, 45.0)
    #: A read of a part or rollup returns its bytes with one bit flipped (a bad read:
    #: the stored object stays intact; each object's reads go bad at most once, so a
    #: reader that reads again gets the bytes written).
    bad_read: float = 0.0


@dataclass
class Stats:
    steps: int = 0
    lost_replies: int = 0
    failed_calls: int = 0
    pauses: int = 0
    stalls: int = 0
    crashes: int = 0
    outages: int = 0
    bad_reads: int = 0
    ops: int = 0
    counters: dict[str, int] = field(default_factory=dict)


class SimDeadlock(RuntimeError):
    """Every simulated thread left waits for a lock or an event nobody will release."""


class Scheduler:
    """Runs simulated threads one at a time, in an order drawn from ``rng``."""

    def __init__(self, rng: random.Random, nemesis: Nemesis, step_s: float = 0.002) -> None:
        self.rng = rng
        self.nemesis = nemesis
        self.step_s = step_s
        self.now = EPOCH_S
        self.tasks: list[Task] = []
        self.current: Task | None = None
        self.stats = Stats()
        self.faults_enabled = True
        self._main = greenlet.getcurrent()
        #: Simulated time until which each store is down (see ``Nemesis.outage``).
        self._down_until: dict[str, float] = {}

    # --- threads -------------------------------------------------------------------------

    def spawn(self, name: str, process: Process, body: Callable[[], None],
              delay_s: float = 0.0) -> Task:
        def run() -> None:
            try:
                body()
            except SimCrash:
                pass
            finally:
                task.done = True

        task = Task(name, process, greenlet(run, parent=self._main), self.now + delay_s)
        self.tasks.append(task)
        return task

    def _runnable(self) -> list[Task]:
        return [t for t in self.tasks if not t.done and not t.process.crashed
                and t.blocked_on is None and t.wake_at <= self.now]

    def run(self, max_steps: int) -> int:
        """Run until every thread finished or ``max_steps`` steps; returns steps taken."""
        steps = 0
        while steps < max_steps:
            self.tasks = [t for t in self.tasks if not t.done and not t.process.crashed]
            if not self.tasks:
                break
            runnable = self._runnable()
            if not runnable:
                waiting = [t.wake_at for t in self.tasks if t.blocked_on is None]
                if not waiting:
                    raise SimDeadlock("simulated deadlock: every thread waits on a lock or "
                                      "an event: " + ", ".join(t.name for t in self.tasks))
                self.now = max(self.now, min(waiting))
                continue
            task = runnable[self.rng.randrange(len(runnable))]
            self.now += self.rng.expovariate(1.0 / self.step_s)
            self.current = task
            task.glet.switch()
            self.current = None
            steps += 1
        self.stats.steps += steps
        return steps

    def kill_all(self) -> None:
        """Crash every process still running and unwind its threads."""
        for task in list(self.tasks):
            task.process.crashed = True
        for task in list(self.tasks):
            if not task.done and task.glet:
                self.current = task
                task.glet.throw(SimCrash())
                self.current = None
        self.tasks = []

    # --- inside a thread -----------------------------------------------------------------

    def _switch_out(self) -> None:
        task = self.current
        assert task is not None
        if task.process.crashed:  # unwinding a crashed thread never gives up control
            raise SimCrash()
        self._main.switch()
        if task.process.crashed:
            raise SimCrash()

    def in_thread(self) -> bool:
        return self.current is not None

    def yield_point(self, at_cas: bool = False) -> None:
        """Let another thread run; maybe pause this one, or crash its process."""
        task = self.current
        if task is None:
            return
        if greenlet.getcurrent() is not task.glet:
            raise RuntimeError("a simulated store was called from outside the simulation's "
                               "threads (an OS thread started by the code under test?)")
        if task.process.crashed:
            raise SimCrash()
        if self.faults_enabled:
            roll = self.rng.random()
            if task.process.crashable and roll < self.nemesis.crash:
                self.stats.crashes += 1
                task.process.crashed = True
                raise SimCrash()
            pause = self.nemesis.pause_at_cas if at_cas else self.nemesis.pause
            if roll < self.nemesis.crash + pause:
                # The whole process stalls (a stop-the-world pause, a frozen VM): its
                # heartbeat threads too, so its leases and deadlines run out.
                self.stats.pauses += 1
                until = self.now + self.rng.choice(self.nemesis.pause_choices_s)
                for t in self.tasks:
                    if t.process is task.process:
                        t.wake_at = max(t.wake_at, until)
            elif roll < self.nemesis.crash + pause + self.nemesis.stall:
                self.stats.stalls += 1
                task.wake_at = self.now + self.rng.choice(self.nemesis.stall_choices_s)
        self._switch_out()

    def pause_process(self, seconds: float) -> None:
        """Stall the current thread's whole process for ``seconds`` (from a store call)."""
        task = self.current
        if task is None:
            return
        self.stats.pauses += 1
        until = self.now + seconds
        for t in self.tasks:
            if t.process is task.process:
                t.wake_at = max(t.wake_at, until)
        self._switch_out()

    def sleep(self, seconds: float) -> None:
        task = self.current
        if task is None:
            self.now += max(0.0, seconds)
            return
        task.wake_at = self.now + max(0.0, seconds)
        self._switch_out()

    def roll(self, probability: float) -> bool:
        """A fault draw (always False outside threads or with faults off)."""
        if self.current is None or not self.faults_enabled:
            return False
        return self.rng.random() < probability

    def store_down(self, store: str) -> bool:
        """Whether ``store`` is down for this call; an outage may start with it."""
        if self.current is None or not self.faults_enabled:
            return False
        if self._down_until.get(store, 0.0) > self.now:
            return True
        if self.nemesis.outage and self.rng.random() < self.nemesis.outage:
            self.stats.outages += 1
            self._down_until[store] = self.now + self.rng.choice(self.nemesis.outage_choices_s)
            return True
        return False

    def count(self, name: str) -> None:
        self.stats.counters[name] = self.stats.counters.get(name, 0) + 1


class SimClock:
    """The library's :class:`~persist_pipeline.internal.clock.Clock`, read from the
    scheduler: a process's own clocks (skewed wall clock, monotonic clock of its own
    origin), or the true time (``process`` None: the driver)."""

    def __init__(self, scheduler: Scheduler, process: Process | None = None) -> None:
        self._s = scheduler
        self._skew = process.wall_skew_s if process is not None else 0.0
        self._origin = process.mono_origin_s if process is not None else 0.0

    def now_ms(self) -> int:
        return int((self._s.now + self._skew) * 1000)

    def monotonic(self) -> float:
        return self._s.now - EPOCH_S + self._origin

    def sleep(self, seconds: float) -> None:
        self._s.sleep(seconds)


class SimEvent:
    """An event for simulated threads: a waiter yields until another thread sets it.

    ``wait`` ignores its timeout on purpose: a wake-up the code under test forgets to
    give leaves the waiter blocked, and a run where every thread is blocked fails as a
    simulated deadlock instead of being rescued by a timer."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._s = scheduler
        self._flag = False

    def set(self) -> None:
        self._flag = True
        for t in self._s.tasks:
            if t.blocked_on is self:
                t.blocked_on = None

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        me = self._s.current
        if me is None:  # the driver, outside every simulated thread
            return self._flag
        while not self._flag:
            me.blocked_on = self
            self._s._switch_out()
        return True


class SimLock:
    """A mutex for simulated threads: a contended acquire yields until it is released."""

    def __init__(self, scheduler: Scheduler, reentrant: bool) -> None:
        self._s = scheduler
        self._reentrant = reentrant
        self._owner: Task | None = None
        self._depth = 0

    def __enter__(self) -> bool:
        me = self._s.current
        if me is None:  # the driver, outside every simulated thread
            return True
        while self._owner is not None and self._owner is not me:
            me.blocked_on = self
            self._s._switch_out()
        if self._owner is me and not self._reentrant:
            raise RuntimeError(f"{me.name} acquired a non-reentrant lock twice")
        self._owner = me
        self._depth += 1
        return True

    def __exit__(self, *exc: object) -> None:
        me = self._s.current
        if me is None:
            return
        self._depth -= 1
        if self._depth:
            return
        self._owner = None
        for t in self._s.tasks:
            if t.blocked_on is self:
                t.blocked_on = None
        if not me.process.crashed and exc[0] is None:
            # Any thread may run now (a waiter, or another process), and this one may
            # stall here, as an OS thread can right after releasing a lock.
            self._s.yield_point()
