"""Group commit: one funnel per client through which its appends reach consensus.

Appends from several threads to different shards that are waiting at the same moment
are committed together, with one multi-shard compare-and-set (one SQL round trip), by
one of their threads: the group's *leader*. The others sleep until their append is done
and are woken by the leader, each on its own event, so a finished group releases its
threads at once instead of one by one through a lock. Nothing waits for a timer unless
``group_commit_window_s`` asks for it: appends that arrive while a group is committing
form the next group, so a lone writer pays nothing and a busy process shares round trips.

Up to :data:`GROUPS_IN_FLIGHT` groups commit at once, on disjoint shards: while one group
waits for its round trip (most of it the database's commit flush), the threads it does
not hold build their next appends and commit them as the next group. That next group
starts once as many appends wait as the group in flight holds (a lone writer, with
nothing in flight, never waits): its threads are about to come back, and an append that
took the free slot alone would spend a round trip on itself while they queue. A shard is
in at most one group at a time and its appends commit in the order they arrived.

Each append still succeeds or fails on its own: a group whose commit is refused because
some shards' transitions changed nothing (an upper mismatch, a lease expired, ...) gives
those appends their confirmed answers and commits the rest again, on fresh state. Only
an outcome that is unknown for the group as a whole (a lost reply that cannot be
settled) is reported to every append in it, which is true of each: all or none landed.

Only mutexes and events (from :mod:`~persist_pipeline.internal.sync`) and the clock's
sleep are used, so the deterministic simulation runs every interleaving of it.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persist_pipeline.exceptions import Indeterminate, PersistError
from persist_pipeline.internal.clock import Clock
from persist_pipeline.internal.machine import Machine, MachineMetrics, Step, apply_many
from persist_pipeline.internal.sync import EventLike, new_event, new_lock

if TYPE_CHECKING:
    from persist_pipeline.internal.state import State

#: Shards one group commits at most (one statement's rows).
MAX_GROUP = 128
#: Groups of one client committing at once (on disjoint shards): one prepares while the
#: other waits for the database, which is what a round trip's time mostly is.
GROUPS_IN_FLIGHT = 2
#: How long a writer over the in-flight bound sleeps before looking again.
_ADMIT_POLL_S = 0.001
#: A waiting append looks again after this long even without a wake-up: a guard for
#: liveness only (every hand-off wakes someone; the simulation's events have no timeout,
#: so a forgotten wake-up fails there as a deadlock).
_WAKE_GUARD_S = 1.0


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
        self.taken = False  # in a group being committed
        self.finished = False
        # What this append's thread holds in the funnel, recorded under the lock in the
        # step that claims it, so that whatever ends the thread (an interrupt landing
        # right after a claim, before any try around it) gives back exactly that:
        # the in-flight bytes it counted, and while it leads, the group it took.
        self.counted = 0
        self.leading: list[_Entry] | None = None
        # Made (under the funnel's lock) only when the append has to wait: most appends
        # commit alone and never do.
        self.wake: EventLike | None = None
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
        # Under _queue_lock: appends not yet in a group (oldest first), the shards of
        # the groups being committed, and how many groups those are.
        self._queue: list[_Entry] = []
        self._busy: set[str] = set()
        self._leaders = 0
        #: Under _queue_lock: how many appends the groups being committed hold.
        self._in_groups = 0
        self._inflight = 0
        #: Under _queue_lock: appends waiting for room in the in-flight bound, oldest first.
        self._wanting_room: deque[_Entry] = deque()

    def commit(self, machine: Machine, transition: Callable[[State], tuple[State, Any]],
               proves_done: Callable[[Any], bool] | None = None,
               size: int = 0) -> tuple[Any, State]:
        """Commit ``transition`` on ``machine``'s shard, perhaps in a group with other
        threads' appends: what :meth:`Machine.apply` does for one append. ``size`` is
        what the append holds in memory until it commits (its inline bytes)."""
        # The usual append commits at once as a group of its own, without an entry; the
        # claim is recorded in ``held`` under the lock, so that whatever ends this thread
        # right after it (an interrupt) gives back exactly that.
        held: list[int] = []
        try:
            if self._claim_alone(machine.shard_id, size, held):
                return self._commit_alone(machine, transition, proves_done)
        finally:
            if held:
                self._leave_alone(machine.shard_id, held[0])
        entry = _Entry(machine, transition, proves_done, size)
        try:
            if self._admit(entry):
                return self._commit_alone(machine, transition, proves_done)
            while True:
                wake: EventLike | None = None
                with self._queue_lock:
                    if entry.finished:
                        break
                    if (not entry.taken and self._may_lead()
                            and machine.shard_id not in self._busy):
                        self._leaders += 1
                        entry.leading = []
                    else:
                        if entry.wake is None:
                            entry.wake = new_event()
                        wake = entry.wake
                        wake.clear()
                if wake is not None:
                    # Woken when its group finished it, or when a group ended and it may
                    # lead the next one.
                    wake.wait(_WAKE_GUARD_S)
                    continue
                alone = self._lead(entry)
                if alone is not None:
                    return alone
        finally:
            self._leave(entry)
        if entry.error is not None:
            raise entry.error
        assert entry.outcome is not None and entry.state is not None
        return entry.outcome.value, entry.state

    def _admit(self, entry: _Entry) -> bool:
        """Queue ``entry`` once the in-flight bytes leave room for it (a lone append
        larger than the bound still goes, alone). True when nothing else waits and no
        window is set: then ``entry`` is not queued but taken at once, as a group of
        its own, whose slot its thread holds."""
        shard = entry.machine.shard_id
        waiting = False
        try:
            while True:
                with self._queue_lock:
                    # Room goes to the writers waiting for it oldest first: were a later,
                    # smaller append let in ahead, a stream of them would keep a larger
                    # one out for as long as the stream lasts.
                    turn = self._wanting_room[0] is entry if waiting \
                        else not self._wanting_room
                    if turn and (self._inflight == 0
                                 or self._inflight + entry.size <= self._max_inflight):
                        if waiting:
                            self._wanting_room.popleft()
                            waiting = False
                        self._inflight += entry.size
                        entry.counted = entry.size
                        if self._may_go_alone(shard):
                            self._take_alone(shard)
                            entry.taken = True
                            entry.leading = [entry]
                            return True
                        self._queue.append(entry)
                        return False
                    if not waiting:
                        self._wanting_room.append(entry)
                        waiting = True
                self._clock.sleep(_ADMIT_POLL_S)
        except BaseException:
            # Wherever an interrupt lands (in the sleep, or taking the lock between two
            # of them): out of the line, or nobody behind it gets in.
            if waiting:
                with self._queue_lock:
                    self._wanting_room.remove(entry)
            raise

    def _may_lead(self, arriving: int = 0) -> bool:
        """Whether a new group may start now (under the lock), with ``arriving`` more
        appends than those waiting: at once when no group is in flight; beside one only
        once as many appends wait as that group holds. Each of those will be back soon
        with its next append: a lone arrival that took the free slot would spend a round
        trip on one append while they queue behind it (a third of the round trips of 32
        busy threads carried a single append), and the groups after it would stay
        lopsided. No append waits for more than the groups in flight: they wait for
        nothing, and each one's end wakes the oldest waiting append."""
        leaders = self._leaders
        if leaders == 0:
            return True
        return leaders < GROUPS_IN_FLIGHT and \
            len(self._queue) + arriving >= self._in_groups

    def _claim_alone(self, shard: str, size: int, held: list[int]) -> bool:
        """Take an append to ``shard`` of ``size`` bytes as a group of its own at once,
        when :meth:`_admit` would (nothing waits, no window, room in the bound, a group
        may start, the shard is free): its slot, shard and bytes are then held by the
        calling thread, and ``size`` is appended to ``held`` in the same step. False
        (nothing claimed) otherwise: the append goes the general way."""
        with self._queue_lock:
            if self._wanting_room \
                    or (self._inflight and self._inflight + size > self._max_inflight) \
                    or not self._may_go_alone(shard):
                return False
            self._inflight += size
            self._take_alone(shard)
            held.append(size)
            return True

    def _may_go_alone(self, shard: str) -> bool:
        """Whether an append to ``shard`` admitted now commits at once as a group of its
        own (under the lock): nothing queued, no window, a group may start, and the
        shard is in no group being committed."""
        return not self._queue and not self._window_s \
            and (self._leaders == 0 or self._may_lead(1)) and shard not in self._busy

    def _take_alone(self, shard: str) -> None:
        """Record an append to ``shard`` taken as a group of its own (under the lock)."""
        self._leaders += 1
        self._in_groups += 1
        self._busy.add(shard)

    def _commit_alone(self, machine: Machine,
                      transition: Callable[[State], tuple[State, Any]],
                      proves_done: Callable[[Any], bool] | None) -> tuple[Any, State]:
        """Commit one append as a group of one, as :meth:`Machine.apply` commits it
        (its slot and bytes are given back as its thread leaves :meth:`commit`)."""
        self._metrics.group_commits += 1
        self._metrics.group_commit_appends += 1
        return machine.apply(transition, proves_done=proves_done)

    def _lead(self, entry: _Entry) -> tuple[Any, State] | None:
        """Commit one group as its leader (one of :data:`GROUPS_IN_FLIGHT` slots is
        held). Returns ``entry``'s result when the group was ``entry`` alone, committed
        as :meth:`Machine.apply` commits it; otherwise None, every append of the group
        finished (``entry`` may be in another group)."""
        try:
            if self._window_s:
                self._clock.sleep(self._window_s)
            group = self._take(entry)
            if len(group) == 1 and group[0] is entry:
                self._metrics.group_commits += 1
                self._metrics.group_commit_appends += 1
                return entry.machine.apply(entry.transition, proves_done=entry.proves_done)
            if group:
                self._commit_group(group)
            return None
        finally:
            self._hand_off(entry)

    def _take(self, leader: _Entry) -> list[_Entry]:
        """The oldest waiting append of each shard not in a group being committed,
        recorded as the group ``leader`` holds."""
        with self._queue_lock:
            queue, busy = self._queue, self._busy
            if len(queue) == 1 and not busy:  # the usual case: one append waiting
                only = queue[0]
                only.taken = True
                busy.add(only.machine.shard_id)
                self._in_groups += 1
                self._queue = []
                leader.leading = queue
                return queue
            group: list[_Entry] = []
            rest: list[_Entry] = []
            for entry in queue:
                shard = entry.machine.shard_id
                if shard in busy or len(group) >= MAX_GROUP:
                    rest.append(entry)
                else:
                    busy.add(shard)
                    entry.taken = True
                    group.append(entry)
            self._queue = rest
            self._in_groups += len(group)
            leader.leading = group
            return group

    def _hand_off(self, leader: _Entry) -> None:
        """End the group ``leader`` leads, if it leads one: free its slot and shards,
        wake its appends and the oldest waiting append that may now lead the next
        group. Which events to set is decided under the lock, where a waiter makes its
        event before it waits, so no wake-up is missed."""
        with self._queue_lock:
            wakes = self._end_group(leader)
        for wake in wakes:
            wake.set()

    def _end_group(self, leader: _Entry) -> list[EventLike]:
        """:meth:`_hand_off` under the lock: the events to set."""
        group = leader.leading
        if group is None:
            return []
        leader.leading = None
        self._leaders -= 1
        self._in_groups -= len(group)
        busy = self._busy
        back: list[_Entry] = []
        for entry in group:
            busy.discard(entry.machine.shard_id)
            if not entry.finished and entry is not leader:
                # Taken but never tried (its leader was interrupted before the commit
                # it would have sent, which finishes every append it holds): its own
                # thread still waits for it, so it goes back, first in line.
                entry.taken = False
                back.append(entry)
        if back:
            self._queue[:0] = back
        wakes = [e.wake for e in group if e.wake is not None]
        successor = self._successor()
        if successor is not None:
            wakes.append(successor)
        return wakes

    def _leave(self, entry: _Entry) -> None:
        """Give back whatever ``entry``'s thread holds as it leaves :meth:`commit`,
        however it leaves: the group it leads, its in-flight bytes, and its place in
        the queue if it was never tried."""
        with self._queue_lock:
            wakes = self._end_group(entry)
            self._inflight -= entry.counted
            entry.counted = 0
            if not entry.taken and entry in self._queue:
                # Its thread leaves without it having been tried (an error in a group
                # it led, an interrupt): no later group may commit it behind its
                # caller's back, nor be left waiting for it to lead.
                self._queue.remove(entry)
                successor = self._successor()
                if successor is not None:
                    wakes.append(successor)
        for wake in wakes:
            wake.set()

    def _leave_alone(self, shard: str, size: int) -> None:
        """:meth:`_leave` of an append that :meth:`commit` took as a group of its own
        without an entry: give back its slot, shard and bytes, and wake the oldest
        waiting append that may lead the next group."""
        with self._queue_lock:
            self._leaders -= 1
            self._in_groups -= 1
            self._busy.discard(shard)
            self._inflight -= size
            successor = self._successor()
        if successor is not None:
            successor.set()

    def _successor(self) -> EventLike | None:
        """The event of the oldest waiting append that may lead the next group now, if
        one may start (under the lock). None when none may: one woken then would only go
        back to sleep (two context switches for nothing), and whatever lets a group start
        wakes one itself (an arrival leads, a group's end looks again)."""
        if not self._may_lead():
            return None
        for waiting in self._queue:
            if waiting.machine.shard_id not in self._busy:
                return waiting.wake
        return None

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
