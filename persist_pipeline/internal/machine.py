"""A shard's cached state and the one narrow compare-and-set loop that changes it.

:class:`Machine` caches one shard's latest known state. :meth:`Machine.apply` runs a
pure transition against it and commits the result with ``compare_and_set``; on a seqno
mismatch it catches up (scanning only the records it has not seen) and runs the
transition again.

Two rules make its answers trustworthy:

- **A negative answer is never computed from a cache alone.** A transition that changes
  nothing (an upper mismatch, a fenced reader, "already done") or raises is re-run
  against state fetched from consensus during this call before its answer is returned.
- **An indeterminate compare-and-set is resolved, never guessed.** When a CaS at seqno
  ``S`` fails with an unknown outcome, the record at ``S + 1`` decides it: if it holds
  exactly the bytes we sent, our commit won; if it holds anything else, ours lost. A
  call returns a negative answer only when every such attempt is known to have lost;
  otherwise (the record was truncated, or never appeared) it raises
  :class:`~persist_pipeline.exceptions.Indeterminate` and callers keep their blobs for
  GC. This holds even when the writer's lease (and idempotency token) expired meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Generic, Literal, TypeVar

from persist_pipeline.config import PersistConfig
from persist_pipeline.consensus.base import Consensus, VersionedData
from persist_pipeline.exceptions import (
    CorruptState,
    PersistError,
    ShardNotFound,
    Unavailable,
    UnsettledCommit,
)
from persist_pipeline.frontier import Frontier
from persist_pipeline.internal import state_codec, transitions
from persist_pipeline.internal.blobs import ShardBlobs
from persist_pipeline.internal.clock import SYSTEM_CLOCK, Clock
from persist_pipeline.internal.maintenance import RollupMaintenance
from persist_pipeline.internal.state import State
from persist_pipeline.internal.sync import new_lock
from persist_pipeline.retry import Backoff

log = logging.getLogger(__name__)
R = TypeVar("R")

#: How many times a state fetch starts over when GC truncated records or replaced the
#: rollup under it.
_FETCH_ATTEMPTS = 10


@dataclass
class MachineMetrics:
    """Counters a :class:`Machine` keeps; exposed by ``PersistClient.metrics``."""

    cas_attempts: int = 0
    cas_mismatches: int = 0
    cas_indeterminate: int = 0
    cas_resolved_committed: int = 0
    negative_answers_confirmed: int = 0
    transient_retries: int = 0
    state_fetches: int = 0
    records_scanned: int = 0
    rollups_written: int = 0


Resolution = Literal["committed", "lost", "pending", "unknown"]


@dataclass
class _Attempt(Generic[R]):
    """A compare-and-set whose reply was lost: it may or may not have committed."""

    expected_seqno: int
    data: bytes
    new: State
    result: R
    resolution: Resolution = "pending"


class Machine:
    """A shard's cached state plus the CaS loop that changes it."""

    #: Re-run a transition against fresh state before returning a negative answer. Only
    #: the simulation's negative controls turn this off, to show what it prevents.
    confirm_negative_answers = True

    def __init__(self, shard_id: str, consensus: Consensus, blobs: ShardBlobs,
                 config: PersistConfig, metrics: MachineMetrics | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.shard_id = shard_id
        self.consensus = consensus
        self.blobs = blobs
        self.config = config
        self.clock = clock
        self.metrics = metrics or MachineMetrics()
        self._lock = new_lock(reentrant=True)
        self._state: State | None = None
        self.maintenance = RollupMaintenance(self)

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def monotonic(self) -> float:
        """Seconds on this process's monotonic clock: what commit deadlines start from."""
        return self.clock.monotonic()

    def commit_deadline(self, started_s: float) -> transitions.CommitDeadline:
        """The deadline, as of now, of a commit referencing blobs whose upload started at
        ``started_s`` (:meth:`monotonic`, taken before the first upload).

        GC's orphan sweep deletes unreferenced blobs older than ``gc_orphan_min_age_s``,
        measured on the blob store's own clock; anything that references fresh blobs (a
        write, a merge result, a rollup) commits within half that age of starting to
        upload them, measured on the committer's monotonic clock, or not at all. Neither
        side compares its clock with another machine's, so skew cannot break this.
        """
        at_ms = int(started_s * 1000) + int(self.config.gc_orphan_min_age_s * 500)
        return transitions.CommitDeadline(at_ms, int(self.monotonic() * 1000))

    # --- reading ---------------------------------------------------------------------------

    @property
    def state(self) -> State:
        """The cached state (fetching it on first use). May be stale."""
        with self._lock:
            if self._state is None:
                self._state = self._fetch_full(create_if_missing=False)
            return self._state

    def fetch_latest(self) -> State:
        """Catch up with consensus and return the latest state."""
        with self._lock:
            return self._refresh()

    def open(self, create: bool) -> State:
        """Fetch the state, creating the shard first if ``create`` and it does not exist."""
        with self._lock:
            self._state = self._fetch_full(create_if_missing=create)
            return self._state

    def _refresh(self) -> State:
        cached = self._state
        caught_up = None if cached is None else self._catch_up(cached)
        self._state = caught_up or self._fetch_full(create_if_missing=False)
        return self._state

    def _fetch_full(self, create_if_missing: bool) -> State:
        missing_rollup_at: int | None = None
        for _ in range(_FETCH_ATTEMPTS):
            head = self.consensus.head(self.shard_id)
            if head is None:
                if not create_if_missing:
                    raise ShardNotFound(f"shard {self.shard_id} does not exist")
                self._create()
                continue
            try:
                state = self._reconstruct(head)
            except _RollupMissing as e:
                if missing_rollup_at == head.seqno:
                    # The head did not move, so GC did not replace the rollup: it is gone.
                    raise CorruptState(str(e)) from None
                missing_rollup_at = head.seqno
                continue
            if state is not None:
                return state
        raise CorruptState(f"shard {self.shard_id}: could not read a consistent state "
                           f"after {_FETCH_ATTEMPTS} attempts (records truncated meanwhile)")

    def _create(self) -> None:
        empty = State(shard_id=self.shard_id)
        first = transitions.create(empty, self.now_ms())
        first = replace(first, seqno=1)
        data = VersionedData(1, state_codec.encode_diff(empty, first),
                             state_codec.encode_summary(first))
        backoff = self._backoff()
        while True:
            try:
                self.consensus.compare_and_set(self.shard_id, None, data)
                return
            except Unavailable as e:
                # Whoever created it, the caller re-reads the head next.
                backoff.wait(e)
                if self.consensus.head(self.shard_id) is not None:
                    return

    def _reconstruct(self, head: VersionedData) -> State | None:
        self.metrics.state_fetches += 1
        where = f"shard {self.shard_id} seqno {head.seqno}"
        summary = state_codec.decode_summary(head.summary, where)
        if summary.HasField("latest_rollup_seqno"):
            seqno = summary.latest_rollup_seqno
            key = summary.latest_rollup_key
            data = self.blobs.main.get(key) if key else None
            if data is None:
                raise _RollupMissing(f"shard {self.shard_id}: rollup for seqno {seqno} is "
                                     f"missing from blob key {key!r}")
            base = state_codec.decode_state(data, f"rollup {key}")
            if base.seqno != seqno or base.shard_id != self.shard_id:
                raise CorruptState(f"rollup {key} holds shard {base.shard_id} seqno "
                                   f"{base.seqno}")
        else:
            base = State(shard_id=self.shard_id)
        return self._catch_up(base)

    def _catch_up(self, state: State) -> State | None:
        """``state`` brought up to the head, or None when GC truncated records it needs."""
        records = self.consensus.scan(self.shard_id, state.seqno + 1)
        self.metrics.records_scanned += len(records)
        if records and records[0].seqno != state.seqno + 1:
            return None
        for rec in records:
            where = f"shard {self.shard_id} seqno {rec.seqno}"
            state = state_codec.apply_diff(state, state_codec.decode_diff(rec.data, where), where)
        if state.seqno == 0:
            raise ShardNotFound(f"shard {self.shard_id} does not exist")
        return state

    # --- writing ---------------------------------------------------------------------------

    def apply(self, transition: Callable[[State], tuple[State, R]], *,
              routine: bool = True,
              proves_done: Callable[[R], bool] | None = None) -> tuple[R, State]:
        """Run ``transition`` against the latest state and commit it, retrying races.

        Returns the transition's result and the state it committed (or, when it changed
        nothing, the state it saw, which was fetched from consensus during this call).
        Errors raised by the transition propagate, also only once confirmed against
        consensus. ``routine`` runs routine maintenance (rollups) after a commit.
        ``proves_done``: whether a result that changes nothing shows, from consensus,
        that this call's effect is already in the state (a write finding its own batch):
        lost-reply attempts need no settling then, since the outcome is known.

        Raises:
            Indeterminate: a CaS reply was lost and whether it committed cannot be told,
                or consensus stayed unavailable past the retry deadline.
        """
        with self._lock:
            backoff = self._backoff()
            attempts: list[_Attempt[R]] = []
            state = self.state
            confirmed = not self.confirm_negative_answers
            while True:
                try:
                    new, result = transition(state)
                except PersistError:
                    if not confirmed:
                        self.metrics.negative_answers_confirmed += 1
                        state, confirmed = self._refresh(), True
                        continue
                    _require_settled(attempts, self.shard_id)
                    raise
                if new is state:
                    if not confirmed:
                        self.metrics.negative_answers_confirmed += 1
                        state, confirmed = self._refresh(), True
                        continue
                    if not (attempts and proves_done is not None and proves_done(result)):
                        _require_settled(attempts, self.shard_id)
                    return result, state
                new = self.maintenance.fold_ready(self._bump(new, state))
                record = VersionedData(new.seqno, state_codec.encode_diff(state, new),
                                       state_codec.encode_summary(new))
                self.metrics.cas_attempts += 1
                try:
                    if self.consensus.compare_and_set(self.shard_id, state.seqno, record):
                        self._committed(new, routine)
                        return result, new
                    self.metrics.cas_mismatches += 1
                except Unavailable as e:
                    self.metrics.cas_indeterminate += 1
                    self.metrics.transient_retries += 1
                    attempts.append(_Attempt(state.seqno, record.data, new, result))
                    lost_reply: Unavailable | None = e
                else:
                    lost_reply = None
                # Settle lost replies first: however late it is (a pause past the retry
                # deadline), a commit that landed is reported as such.
                state, confirmed = self._refresh(), True
                won = self._resolve(attempts)
                if won is not None:
                    self.metrics.cas_resolved_committed += 1
                    self._committed(won.new, routine, latest=state)
                    return won.result, won.new
                if lost_reply is not None:
                    backoff.wait(lost_reply)
                    state = self._refresh()

    def batch_committed(self, batch_id: str, lower: int) -> bool | None:
        """Whether a batch starting at ``lower`` was ever committed, from state history.

        A batch id derives from its write's token, so finding it settles a write whose
        reply was lost even after GC expired the writer and truncated the record of the
        commit. True if the latest state, a kept record (adding it, or a merge removing
        it) or a kept rollup holds it; False if none does and the kept history reaches
        back to when the shard's upper was still ``lower`` (where it would be); None
        when GC truncated that far.
        """
        latest = self.fetch_latest()
        if batch_id in latest.batches:
            return True
        records = self.consensus.scan(self.shard_id, 0)
        for rec in records:
            diff = state_codec.decode_diff(rec.data, f"shard {self.shard_id} seqno {rec.seqno}")
            if batch_id in diff.batch_deletes or any(b.id == batch_id
                                                     for b in diff.batch_upserts):
                return True
        if not records or records[0].seqno <= 1:
            return False
        first = records[0].seqno
        base_upper: Frontier | None = None
        known = False
        for seqno, rollup in sorted(latest.rollups.items()):
            data = self.blobs.main.get(rollup.key)
            if data is None:
                continue  # replaced by a concurrent GC: the others still tell
            rolled = state_codec.decode_state(data, f"rollup {rollup.key}")
            if batch_id in rolled.batches:
                return True
            if seqno == first:
                base_upper, known = rolled.upper, True
        if known and base_upper is not None and base_upper <= lower:
            return False
        return None

    def _resolve(self, attempts: list[_Attempt[R]]) -> _Attempt[R] | None:
        """Settle lost-reply attempts by the record each would have written."""
        for attempt in attempts:
            if attempt.resolution in ("lost", "unknown"):
                continue
            following = self.consensus.scan(self.shard_id, attempt.expected_seqno + 1, limit=1)
            if not following:
                attempt.resolution = "pending"  # nothing at S+1 yet: it may still land
            elif following[0].seqno != attempt.expected_seqno + 1:
                attempt.resolution = "unknown"  # GC truncated the record that would tell
            elif following[0].data == attempt.data:
                attempt.resolution = "committed"
                return attempt
            else:
                attempt.resolution = "lost"
        return None

    def _committed(self, new: State, routine: bool, latest: State | None = None) -> None:
        if latest is None or latest.seqno < new.seqno:
            latest = new
        self._state = latest
        self.maintenance.recorded(new)
        if routine:
            self.maintenance.after_commit(new)

    def _bump(self, new: State, base: State) -> State:
        return replace(new, seqno=base.seqno + 1,
                       walltime_ms=max(new.walltime_ms, self.now_ms()))

    def _backoff(self) -> Backoff:
        return Backoff(self.config.retry_deadline_s, f"shard {self.shard_id}", self.clock)

    # --- maintenance (see RollupMaintenance) -----------------------------------------------

    def wait_for_maintenance(self, timeout_s: float | None = None) -> None:
        """Finish background maintenance started so far, recording its rollup now."""
        self.maintenance.wait(timeout_s)

    def write_rollup(self, state: State) -> bool:
        """Store the full ``state`` in blob and record it in the state, now."""
        return self.maintenance.write_now(state)


class _RollupMissing(PersistError):
    """The rollup the head names is gone (GC may have replaced it): re-read the head."""


def _require_settled(attempts: list[_Attempt[R]], shard_id: str) -> None:
    """Refuse to give a negative answer while a lost-reply attempt may have committed."""
    open_attempts = [a for a in attempts if a.resolution in ("pending", "unknown")]
    if open_attempts:
        seqnos = ", ".join(str(a.expected_seqno + 1) for a in open_attempts)
        raise UnsettledCommit(f"shard {shard_id}: a commit whose reply was lost may or may not "
                            f"have landed at seqno {seqnos}; read the shard to find out")
