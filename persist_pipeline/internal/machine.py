"""The one narrow compare-and-set retry loop, and fetching state from consensus + blob.

:class:`Machine` caches one shard's latest known state. :meth:`Machine.apply` runs a
pure transition against it and commits the result with ``compare_and_set``; on a seqno
mismatch it catches up (scanning only the records it has not seen) and runs the
transition again. Transient backend errors are retried with backoff until a deadline;
an indeterminate CaS is resolved by re-reading state, which is safe because every
transition that must not apply twice carries an idempotency token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

from persist_pipeline.config import PersistConfig
from persist_pipeline.consensus.base import Consensus, VersionedData
from persist_pipeline.exceptions import (
    CorruptState,
    PersistError,
    ShardNotFound,
    Unavailable,
)
from persist_pipeline.internal import state_codec, transitions
from persist_pipeline.internal.blobs import ShardBlobs
from persist_pipeline.internal.state import Rollup, State
from persist_pipeline.retry import Backoff, retry_transient

log = logging.getLogger(__name__)
R = TypeVar("R")

#: How many times a state fetch retries when GC truncated records under it.
_FETCH_ATTEMPTS = 10


def now_ms() -> int:
    return int(time.time() * 1000)


def rollup_key(shard_id: str, seqno: int) -> str:
    """Rollups are deterministic (the state at a seqno is unique), so is their key."""
    return f"{shard_id}/rollup/{seqno:020d}.pb"


@dataclass
class MachineMetrics:
    """Counters a :class:`Machine` keeps; exposed by ``PersistClient.metrics``."""

    cas_attempts: int = 0
    cas_mismatches: int = 0
    cas_indeterminate: int = 0
    transient_retries: int = 0
    state_fetches: int = 0
    records_scanned: int = 0
    rollups_written: int = 0


class Machine:
    """A shard's cached state plus the CaS loop that changes it."""

    def __init__(self, shard_id: str, consensus: Consensus, blobs: ShardBlobs,
                 config: PersistConfig, metrics: MachineMetrics | None = None) -> None:
        self.shard_id = shard_id
        self.consensus = consensus
        self.blobs = blobs
        self.config = config
        self.metrics = metrics or MachineMetrics()
        self._lock = threading.RLock()
        self._state: State | None = None
        self._maintenance_lock = threading.Lock()
        self._maintenance: Future[None] | None = None
        self._ready_rollup: tuple[Rollup, float] | None = None

    # --- reading ---------------------------------------------------------------------------

    @property
    def state(self) -> State:
        """The cached state (fetching it on first use)."""
        with self._lock:
            if self._state is None:
                self._state = self._fetch_full(create_if_missing=False)
            return self._state

    def fetch_latest(self) -> State:
        """Catch up with consensus and return the latest state."""
        with self._lock:
            if self._state is None:
                self._state = self._fetch_full(create_if_missing=False)
            else:
                caught_up = self._retrying(lambda: self._catch_up(self._state))
                self._state = caught_up or self._fetch_full(create_if_missing=False)
            return self._state

    def open(self, create: bool) -> State:
        """Fetch the state, creating the shard first if ``create`` and it does not exist."""
        with self._lock:
            self._state = self._fetch_full(create_if_missing=create)
            return self._state

    def _fetch_full(self, create_if_missing: bool) -> State:
        for _ in range(_FETCH_ATTEMPTS):
            head = self._retrying(lambda: self.consensus.head(self.shard_id))
            if head is None:
                if not create_if_missing:
                    raise ShardNotFound(f"shard {self.shard_id} does not exist")
                self._create()
                continue
            state = self._retrying(lambda h=head: self._reconstruct(h))  # type: ignore[misc]
            if state is not None:
                return state
        raise CorruptState(f"shard {self.shard_id}: could not read a consistent state "
                           f"after {_FETCH_ATTEMPTS} attempts (records truncated meanwhile)")

    def _create(self) -> None:
        empty = State(shard_id=self.shard_id)
        first = transitions.create(empty, now_ms())
        first = _bump(first)
        data = VersionedData(1, state_codec.encode_diff(empty, first),
                             state_codec.encode_summary(first))
        self._retrying(lambda: self.consensus.compare_and_set(self.shard_id, None, data))

    def _reconstruct(self, head: VersionedData) -> State | None:
        self.metrics.state_fetches += 1
        where = f"shard {self.shard_id} seqno {head.seqno}"
        summary = state_codec.decode_summary(head.summary, where)
        if summary.HasField("latest_rollup_seqno"):
            seqno = summary.latest_rollup_seqno
            key = rollup_key(self.shard_id, seqno)
            data = self.blobs.main.get(key)
            if data is None:
                raise CorruptState(f"shard {self.shard_id}: rollup for seqno {seqno} is "
                                   f"missing from blob key {key!r}")
            base = state_codec.decode_state(data, f"rollup {key}")
            if base.seqno != seqno or base.shard_id != self.shard_id:
                raise CorruptState(f"rollup {key} holds shard {base.shard_id} seqno "
                                   f"{base.seqno}")
        else:
            base = State(shard_id=self.shard_id)
        return self._catch_up(base)

    def _catch_up(self, state: State | None) -> State | None:
        assert state is not None
        records = self.consensus.scan(self.shard_id, state.seqno + 1)
        self.metrics.records_scanned += len(records)
        if records and records[0].seqno != state.seqno + 1:
            # Older than what GC kept: the caller starts over from a rollup.
            return None
        for rec in records:
            where = f"shard {self.shard_id} seqno {rec.seqno}"
            state = state_codec.apply_diff(state, state_codec.decode_diff(rec.data, where), where)
        if state.seqno == 0:
            raise ShardNotFound(f"shard {self.shard_id} does not exist")
        return state

    # --- writing ---------------------------------------------------------------------------

    def apply(self, transition: Callable[[State], tuple[State, R]]) -> tuple[R, State]:
        """Run ``transition`` against the latest state and commit it, retrying races.

        Returns the transition's result and the state it was applied to (or, when it
        changed nothing, the state it saw). Errors raised by the transition propagate.
        """
        with self._lock:
            backoff = self._backoff()
            state = self.state
            while True:
                new, result = transition(state)
                if new is state:
                    return result, state
                new = self._fold_ready_rollup(_bump(new, base=state))
                record = VersionedData(new.seqno, state_codec.encode_diff(state, new),
                                       state_codec.encode_summary(new))
                self.metrics.cas_attempts += 1
                try:
                    ok = self.consensus.compare_and_set(self.shard_id, state.seqno, record)
                except Unavailable as e:
                    # Indeterminate: it may have committed. Re-read and run the
                    # transition again; idempotency tokens make that safe.
                    self.metrics.cas_indeterminate += 1
                    self.metrics.transient_retries += 1
                    backoff.wait(e)
                    state = self._refresh_after_error(backoff)
                    continue
                if ok:
                    self._state = new
                    ready = self._ready_rollup
                    if ready is not None and ready[0].seqno in new.rollups:
                        self._clear_ready(ready)
                    self._maybe_rollup(new)
                    return result, new
                self.metrics.cas_mismatches += 1
                state = self._refresh_after_error(backoff)

    def _refresh_after_error(self, backoff: Backoff) -> State:
        while True:
            try:
                cached = self._state
                caught_up = None if cached is None else self._catch_up(cached)
                self._state = caught_up or self._fetch_full(create_if_missing=False)
                return self._state
            except Unavailable as e:
                self.metrics.transient_retries += 1
                backoff.wait(e)

    def _retrying(self, op: Callable[[], R]) -> R:
        return retry_transient(op, deadline_s=self.config.retry_deadline_s,
                               what=f"shard {self.shard_id}", on_retry=self._count_retry)

    def _count_retry(self) -> None:
        self.metrics.transient_retries += 1

    def _backoff(self) -> Backoff:
        return Backoff(self.config.retry_deadline_s, f"shard {self.shard_id}")

    # --- maintenance -----------------------------------------------------------------------

    def _maybe_rollup(self, state: State) -> None:
        """Routine maintenance after a commit: a rollup every ``rollup_threshold`` seqnos.

        With ``background_maintenance`` the slow part (encoding the whole state and the
        blob PUT) runs on a maintenance thread, and the finished rollup is recorded by
        this machine's next commit (see :meth:`_fold_ready_rollup`): no extra CaS, and no
        lock a busy writer could starve.
        """
        latest = state.latest_rollup()
        since_rollup = state.seqno - (latest.seqno if latest else 0)
        if since_rollup < self.config.rollup_threshold:
            return
        if not self.config.background_maintenance:
            try:
                self.write_rollup(state)
            except PersistError as e:
                # A later commit retries; the shard stays readable from older records.
                log.warning("shard %s: could not write rollup at seqno %d: %s",
                            self.shard_id, state.seqno, e)
            return
        with self._maintenance_lock:
            busy = self._maintenance is not None and not self._maintenance.done()
            if busy or self._ready_rollup is not None:
                return
            self._maintenance = _maintenance_pool().submit(self._store_rollup_quietly, state)

    def _store_rollup_quietly(self, state: State) -> None:
        try:
            rollup = self._store_rollup(state)
        except PersistError as e:
            log.warning("shard %s: could not write rollup at seqno %d: %s",
                        self.shard_id, state.seqno, e)
            return
        with self._maintenance_lock:
            self._ready_rollup = (rollup, time.monotonic())

    def _fold_ready_rollup(self, new: State) -> State:
        """Record a rollup stored in the background in the commit about to be made."""
        with self._maintenance_lock:
            ready = self._ready_rollup
        if ready is None:
            return new
        rollup, stored_at = ready
        # GC may sweep an unreferenced blob once it is gc_orphan_min_age_s old; like a
        # write's parts, a rollup is only referenced while comfortably younger.
        too_old = time.monotonic() - stored_at > self.config.gc_orphan_min_age_s / 2
        if too_old or rollup.seqno in new.rollups or rollup.seqno > new.seqno:
            self._clear_ready(ready)
            return new
        return replace(new, rollups={**new.rollups, rollup.seqno: rollup})

    def _clear_ready(self, ready: tuple[Rollup, float]) -> None:
        with self._maintenance_lock:
            if self._ready_rollup is ready:
                self._ready_rollup = None

    def wait_for_maintenance(self, timeout_s: float | None = None) -> None:
        """Finish background maintenance started so far, recording its rollup now."""
        with self._maintenance_lock:
            pending = self._maintenance
        if pending is not None:
            pending.result(timeout=timeout_s)
        with self._maintenance_lock:
            ready = self._ready_rollup
        if ready is not None:
            self.apply(lambda s: transitions.add_rollup(s, ready[0], now_ms()))
            self._clear_ready(ready)

    def _store_rollup(self, state: State) -> Rollup:
        key = rollup_key(self.shard_id, state.seqno)
        data = state_codec.encode_state(state)
        self.blobs.main.set(key, data)
        self.metrics.rollups_written += 1
        return Rollup(state.seqno, key, len(data))

    def write_rollup(self, state: State) -> None:
        """Store the full ``state`` in blob and record it in the state, now."""
        rollup = self._store_rollup(state)
        self.apply(lambda s: transitions.add_rollup(s, rollup, now_ms()))


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _maintenance_pool() -> ThreadPoolExecutor:
    """The threads that write rollups off the writers' path (shared by all machines)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="persist-maintenance")
        return _POOL


def _bump(new: State, base: State | None = None) -> State:
    seqno = (base.seqno if base is not None else 0) + 1
    return replace(new, seqno=seqno, walltime_ms=max(new.walltime_ms, now_ms()))
