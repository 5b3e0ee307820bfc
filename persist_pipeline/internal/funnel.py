"""Group commit: one funnel per client through which its appends reach consensus.

Appends from several threads to different shards that are waiting at the same moment
are committed together, with one multi-shard compare-and-set (one SQL round trip), by
whichever of them holds the funnel's commit lock: the *leader*. The others find their
append done when they get the lock. Nothing waits for a timer unless
``group_commit_window_s`` asks for it: appends that arrive while a group is committing
form the next group, so a lone writer pays nothing and a busy process shares round trips.

Each append still succeeds or fails on its own: a group whose commit is refused because
some shards' transitions changed nothing (an upper mismatch, a lease expired, ...) gives
those appends their confirmed answers and commits the rest again, on fresh state. Only
an outcome that is unknown for the group as a whole (a lost reply that cannot be
settled) is reported to every append in it, which is true of each: all or none landed.

Only mutexes (from :func:`~persist_pipeline.internal.sync.new_lock`) and the clock's
sleep are used, so the deterministic simulation runs every interleaving of it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persist_pipeline.exceptions import Indeterminate, PersistError
from persist_pipeline.internal.clock import Clock
from persist_pipeline.internal.machine import Machine, MachineMetrics, Step, apply_many
from persist_pipeline.internal.sync import new_lock

if TYPE_CHECKING:
    from persist_pipeline.internal.state import State

#: Shards one group commits at most (one statement's rows).
MAX_GROUP = 128
#: How long a writer over the in-flight bound sleeps before looking again.
_ADMIT_POLL_S = 0.001


@dataclass
class _Outcome:
    """A transition's result, or the error it raised (one append's, not the group's)."""

    value: Any = None
    error: PersistError | None = None
    proves_done: Callable[[Any], bool] | None = None

    def done(self) -> bool:
        return self.error is None and self.proves_done is not None and \
            self.proves_done(self.value)


class _Entry:
    """One append waiting in the funnel."""

    def __init__(self, machine: Machine, transition: Callable[[State], tuple[State, Any]],
                 proves_done: Callable[[Any], bool] | None, size: int) -> None:
        self.machine = machine
        self.transition = transition
        self.proves_done = proves_done
        self.size = size
        self.finished = False
        self.outcome: _Outcome | None = None
        self.state: State | None = None
        self.error: BaseException | None = None

    def step(self) -> Step[_Outcome]:
        def capturing(state: State) -> tuple[State, _Outcome]:
            # An error of this append's transition refuses this append alone.
            try:
                new, value = self.transition(state)
            except PersistError as e:
                return state, _Outcome(error=e)
            return new, _Outcome(value, proves_done=self.proves_done)

        return Step(self.machine, capturing)

    def finish(self, outcome: _Outcome, state: State) -> None:
        self.outcome, self.state = outcome, state
        self.error = outcome.error
        self.finished = True

    def fail(self, error: BaseException) -> None:
        # Each waiter raises its own copy: handles annotate the errors they raise.
        self.error = copy.copy(error)
        self.finished = True


class Funnel:
    """The group-commit funnel of one client (see the module docstring)."""

    def __init__(self, clock: Clock, metrics: MachineMetrics, *, window_s: float,
                 max_inflight_bytes: int) -> None:
        self._clock = clock
        self._metrics = metrics
        self._window_s = window_s
        self._max_inflight = max_inflight_bytes
        self._queue_lock = new_lock()
        self._commit_lock = new_lock()
        self._queue: list[_Entry] = []
        self._inflight = 0

    def commit(self, machine: Machine, transition: Callable[[State], tuple[State, Any]],
               proves_done: Callable[[Any], bool] | None = None,
               size: int = 0) -> tuple[Any, State]:
        """Commit ``transition`` on ``machine``'s shard, perhaps in a group with other
        threads' appends: what :meth:`Machine.apply` does for one append. ``size`` is
        what the append holds in memory until it commits (its inline bytes)."""
        entry = _Entry(machine, transition, proves_done, size)
        self._admit(entry)
        try:
            with self._commit_lock:
                while not entry.finished:
                    if self._window_s:
                        self._clock.sleep(self._window_s)
                    group = self._take()
                    if len(group) == 1 and group[0] is entry:
                        # Nobody else is waiting: a group of one, committed as
                        # Machine.apply commits it (no per-append result capture).
                        self._metrics.group_commits += 1
                        self._metrics.group_commit_appends += 1
                        return machine.apply(transition, proves_done=proves_done)
                    self._commit_group(group)
        finally:
            with self._queue_lock:
                self._inflight -= entry.size
        if entry.error is not None:
            raise entry.error
        assert entry.outcome is not None and entry.state is not None
        return entry.outcome.value, entry.state

    def _admit(self, entry: _Entry) -> None:
        """Queue ``entry`` once the in-flight bytes leave room for it (a lone append
        larger than the bound still goes, alone)."""
        while True:
            with self._queue_lock:
                if self._inflight == 0 or self._inflight + entry.size <= self._max_inflight:
                    self._inflight += entry.size
                    self._queue.append(entry)
                    return
            self._clock.sleep(_ADMIT_POLL_S)

    def _take(self) -> list[_Entry]:
        """The oldest waiting append of each shard (a group holds a shard once)."""
        with self._queue_lock:
            queue = self._queue
            if len(queue) == 1:  # the usual case: one append waiting
                self._queue = []
                return queue
            group: list[_Entry] = []
            shards: set[str] = set()
            rest: list[_Entry] = []
            for entry in self._queue:
                if entry.machine.shard_id in shards or len(group) >= MAX_GROUP:
                    rest.append(entry)
                else:
                    shards.add(entry.machine.shard_id)
                    group.append(entry)
            self._queue = rest
            return group

    def _commit_group(self, group: list[_Entry]) -> None:
        """Commit ``group``, giving every entry its outcome whatever happens."""
        remaining = group
        try:
            while remaining:
                self._metrics.group_commits += 1
                self._metrics.group_commit_appends += len(remaining)
                applied = apply_many([e.step() for e in remaining], proves_done=_Outcome.done)
                if applied.committed:
                    for e, outcome, state in zip(remaining, applied.results, applied.states,
                                                 strict=True):
                        e.finish(outcome, state)
                    return
                held: list[_Entry] = []
                for e, outcome, state, refused in zip(remaining, applied.results,
                                                      applied.states, applied.refused,
                                                      strict=True):
                    if refused:
                        e.finish(outcome, state)  # a confirmed answer of its own
                    else:
                        held.append(e)
                remaining = held
        except PersistError as e:
            # Unknown for the group as a whole (all or none of it landed): true of each.
            for entry in remaining:
                entry.fail(e)
        except BaseException:
            for entry in remaining:
                entry.fail(Indeterminate("the group commit holding this append was "
                                         "interrupted; read the shard to find out"))
            raise
