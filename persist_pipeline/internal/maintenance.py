"""Routine maintenance of a shard's state: a rollup every ``rollup_threshold`` seqnos.

A rollup is a full copy of the state at one seqno, stored in the main blob store and
recorded in the state, so a fresh process reads one blob plus the diffs after it, and GC
can truncate consensus below it. Maintenance commits never trigger more maintenance.

With ``background_maintenance`` the slow part (encoding the whole state and the PUT)
runs on a maintenance thread and the finished rollup rides along with the machine's next
commit (no extra CaS, no lock a busy writer could starve). Like any reference to fresh
blobs, a rollup is recorded only within the commit deadline of its upload.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from persist_pipeline.exceptions import PersistError
from persist_pipeline.internal import checksum, paths, state_codec, transitions
from persist_pipeline.internal.state import Rollup, State
from persist_pipeline.internal.sync import SharedPool, new_lock

if TYPE_CHECKING:
    from persist_pipeline.internal.machine import Machine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Ready:
    """A stored rollup waiting to be recorded. Once ``folded`` into any CaS attempt it is
    never deleted by this process (that attempt's outcome may be unknown): GC owns it."""

    rollup: Rollup
    #: When its upload started (the machine's monotonic seconds): its commit deadline.
    started_s: float
    folded: bool = False


class RollupMaintenance:
    """Decides when a shard needs a rollup, writes it, and records it."""

    def __init__(self, machine: Machine) -> None:
        self._machine = machine
        self._lock = new_lock()
        self._pending: Future[None] | None = None
        self._pending_pid = 0
        self._ready: _Ready | None = None

    def _pending_here(self) -> Future[None] | None:
        """The rollup started in this process (under the lock). One started by the
        parent of a forked child runs on the parent's pool and never finishes here."""
        return self._pending if self._pending_pid == os.getpid() else None

    def due(self, state: State) -> bool:
        latest = state.latest_rollup()
        since_rollup = state.seqno - (latest.seqno if latest else 0)
        return since_rollup >= self._machine.config.rollup_threshold

    def _start(self, state: State) -> None:
        """Start the rollup of ``state`` (one is due)."""
        machine = self._machine
        if not machine.config.background_maintenance:
            try:
                self.write_now(state)
            except PersistError as e:
                # A later commit retries; the shard stays readable from older records.
                log.warning("shard %s: could not write rollup at seqno %d: %s",
                            machine.shard_id, state.seqno, e)
            return
        with self._lock:
            pending = self._pending_here()
            busy = pending is not None and not pending.done()
            if busy or self._ready is not None:
                return
            self._pending = _MAINTENANCE_POOL.get().submit(self._store_quietly, state)
            self._pending_pid = os.getpid()

    def _store_quietly(self, state: State) -> None:
        try:
            ready = self._store(state)
        except PersistError as e:
            log.warning("shard %s: could not write rollup at seqno %d: %s",
                        self._machine.shard_id, state.seqno, e)
            return
        with self._lock:
            self._ready = ready

    def _store(self, state: State) -> _Ready:
        machine = self._machine
        started_s = machine.monotonic()
        key = paths.rollup_key(machine.shard_id, state.seqno)
        data = state_codec.encode_state(state)
        machine.blobs.main.set(key, data)
        machine.metrics.rollups_written += 1
        return _Ready(Rollup(state.seqno, key, len(data), checksum.crc32(data)), started_s)

    def fold_ready(self, new: State) -> State:
        """Record a rollup stored in the background in the commit about to be made."""
        # Most commits find none ready: one read of the reference tells (a rollup made
        # ready just after it rides along with the next commit, as it would had it
        # been made ready just after the lock below).
        if self._ready is None:
            return new
        with self._lock:
            ready = self._ready
        if ready is None:
            return new
        if new.rollups.get(ready.rollup.seqno) == ready.rollup:
            ready.folded = True  # this very commit records it
            return new
        latest = new.latest_rollup()
        stale = (self._machine.commit_deadline(ready.started_s).passed_in(new)
                 or (latest is not None and latest.seqno >= ready.rollup.seqno)
                 or ready.rollup.seqno > new.seqno)
        if stale:
            self._clear(ready)
            if not ready.folded:
                self._delete(ready)
            return new
        ready.folded = True
        return new.evolve(rollups={**new.rollups, ready.rollup.seqno: ready.rollup})

    def committed(self, state: State, routine: bool) -> None:
        """After every commit of ``state``: forget the ready rollup once the committed
        state holds it; then, after a ``routine`` commit, start a rollup if one is due."""
        if self._ready is not None:  # as in fold_ready: usually none is ready
            with self._lock:
                ready = self._ready
            if ready is not None and state.rollups.get(ready.rollup.seqno) == ready.rollup:
                self._clear(ready)
        if routine and self.due(state):
            self._start(state)

    def _clear(self, ready: _Ready) -> None:
        with self._lock:
            if self._ready is ready:
                self._ready = None

    def wait(self, timeout_s: float | None = None) -> None:
        """Finish the background rollup started so far and record it now."""
        with self._lock:
            pending = self._pending_here()
        if pending is not None:
            pending.result(timeout=timeout_s)
        with self._lock:
            ready = self._ready
        if ready is not None:
            if not self._record(ready) and not ready.folded:
                self._delete(ready)
            self._clear(ready)

    def write_now(self, state: State) -> bool:
        """Store a rollup of ``state`` and record it; False if it was no longer useful."""
        ready = self._store(state)
        added = self._record(ready)
        if not added:
            self._delete(ready)  # certainly unreferenced: the CaS loop settled every attempt
        return added

    def _delete(self, ready: _Ready) -> None:
        try:
            self._machine.blobs.main.delete(ready.rollup.key)
        except PersistError as e:  # GC's orphan sweep gets it later
            log.warning("could not delete unused rollup %s: %s", ready.rollup.key, e)

    def _record(self, ready: _Ready) -> bool:
        machine = self._machine
        added, _ = machine.apply(lambda s: transitions.add_rollup(
            s, ready.rollup, machine.now_ms(), machine.commit_deadline(ready.started_s)),
            routine=False)
        return added


#: The threads that write rollups off the writers' path (shared by all machines).
_MAINTENANCE_POOL = SharedPool(2, "persist-maintenance")
