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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar

from persist_pipeline.config import PersistConfig
from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.exceptions import (
    CorruptState,
    PersistError,
    ShardNotFound,
    Unavailable,
    UnsettledCommit,
)
from persist_pipeline.internal import state_codec, transitions
from persist_pipeline.internal.blobs import ShardBlobs
from persist_pipeline.internal.clock import SYSTEM_CLOCK, Clock
from persist_pipeline.internal.maintenance import RollupMaintenance
from persist_pipeline.internal.records import quick_init
from persist_pipeline.internal.state import State
from persist_pipeline.internal.sync import LockLike, new_lock
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
    group_commits: int = 0
    group_commit_appends: int = 0


Resolution = Literal["committed", "lost", "pending", "unknown"]


@dataclass
class _Attempt(Generic[R]):
    """A compare-and-set whose reply was lost: it may or may not have committed. Over
    several shards it committed every record or none."""

    writes: list[CasWrite]
    news: list[State]
    results: list[R]
    resolution: Resolution = "pending"


@quick_init
@dataclass(frozen=True, slots=True)
class Step(Generic[R]):
    """One shard's part of :func:`apply_many`: a transition on its machine's state."""

    machine: Machine
    transition: Callable[[State], tuple[State, R]]


@quick_init
@dataclass(frozen=True, slots=True)
class Applied(Generic[R]):
    """What :func:`apply_many` did.

    Attributes:
        committed: every step's state was committed (or a lost reply was found to have
            committed it, or ``proves_done`` showed it was already); False when some
            transition changed nothing, after confirming that against consensus.
        results: each step's transition result, in step order.
        states: each step's committed state (or the fresh state it saw).
        refused: when not committed, which steps' transitions changed nothing (their
            results are confirmed negative answers); the others were only held back.
    """

    committed: bool
    results: list[R]
    states: list[State]
    refused: Sequence[bool] = ()


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

        GC's orphan sweep deletes unreferenced blobs older than the shard's orphan age,
        measured on the blob store's own clock; anything that references fresh blobs (a
        write, a merge result, a rollup) commits within half that age of starting to
        upload them, measured on the committer's monotonic clock, or not at all. Neither
        side compares its clock with another machine's, so skew cannot break this. The
        age is the one recorded in the state the commit lands on (see
        :meth:`~transitions.CommitDeadline.passed_in`), not this process's config alone.
        """
        return transitions.CommitDeadline(int(started_s * 1000), self.orphan_min_age_ms,
                                          int(self.monotonic() * 1000))

    @property
    def orphan_min_age_ms(self) -> int:
        """This process's configured orphan age (``gc_orphan_min_age_s``), in ms."""
        return int(self.config.gc_orphan_min_age_s * 1000)

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

    def first_record(self) -> VersionedData:
        """The record that creates this shard (seqno 1, written expecting no record)."""
        empty = State(shard_id=self.shard_id)
        # The creator's inline max becomes the shard's: every process then inlines only
        # up to it (and its own), whatever each one is configured with. A creator with
        # inlining off records none: its max bounds no write of its own (a reader or a
        # blob-only writer creating a shard must not turn inlining off for everyone).
        policy = self.config.inline_policy
        first = transitions.create(empty, self.now_ms(), self.orphan_min_age_ms,
                                   policy.max_bytes if policy.threshold_bytes else None)
        first = replace(first, seqno=1)
        return VersionedData(1, state_codec.encode_diff(empty, first),
                             state_codec.encode_summary(first))

    def _create(self) -> None:
        data = self.first_record()
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
            crc32 = summary.latest_rollup_crc32 \
                if summary.HasField("latest_rollup_crc32") else None
            rolled = self.blobs.fetch_rollup(key, crc32, f"rollup {key}") if key else None
            if rolled is None:
                raise _RollupMissing(f"shard {self.shard_id}: rollup for seqno {seqno} is "
                                     f"missing from blob key {key!r}")
            base = rolled
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
        with self._lock:  # apply_many of this one step
            applied = _apply_locked((Step(self, transition),), routine, proves_done)
        return applied.results[0], applied.states[0]

    def _resolve(self, attempts: list[_Attempt[R]]) -> _Attempt[R] | None:
        """Settle lost-reply attempts by the record each would have written.

        An attempt over several shards committed all of its records or none, so the
        first shard whose record at ``expected + 1`` is still kept settles it."""
        for attempt in attempts:
            if attempt.resolution in ("lost", "unknown"):
                continue
            attempt.resolution = "unknown"
            pending = False
            for write in attempt.writes:
                # A record the attempt created (expected None) is its shard's first.
                at = 1 if write.expected is None else write.expected + 1
                following = self.consensus.scan(write.shard, at, limit=1)
                if not following:
                    # Nothing at S+1 yet: it may still land, unless another shard's
                    # record shows the one statement cannot (it needed every head).
                    pending = True
                    continue
                if following[0].seqno != at:
                    continue  # GC truncated the record that would tell: ask the next shard
                attempt.resolution = "committed" if following[0].data == write.new.data \
                    else "lost"
                break
            else:
                if pending:
                    attempt.resolution = "pending"
            if attempt.resolution == "committed":
                return attempt
        return None

    def _committed(self, new: State, routine: bool, latest: State | None = None) -> None:
        if latest is None or latest.seqno < new.seqno:
            latest = new
        self._state = latest
        self.maintenance.committed(new, routine)

    def _bump(self, new: State, base: State) -> State:
        """``new`` as the commit after ``base``: the next seqno, and a walltime no
        earlier than now. A transition that already set both (an append sets the seqno,
        and its walltime is usually still the current millisecond) is committed as it
        is: the state is the same either way, without a second copy of it."""
        seqno = base.seqno + 1
        now = self.now_ms()
        if new.seqno == seqno and new.walltime_ms >= now:
            return new
        return new.evolve(seqno=seqno, walltime_ms=max(new.walltime_ms, now))

    def _backoff(self, started_s: float | None = None) -> Backoff:
        return Backoff(self.config.retry_deadline_s, f"shard {self.shard_id}", self.clock,
                       started_s=started_s)

    # --- maintenance (see RollupMaintenance) -----------------------------------------------

    def wait_for_maintenance(self, timeout_s: float | None = None) -> None:
        """Finish background maintenance started so far, recording its rollup now."""
        self.maintenance.wait(timeout_s)

    def write_rollup(self, state: State) -> bool:
        """Store the full ``state`` in blob and record it in the state, now."""
        return self.maintenance.write_now(state)


class _RollupMissing(PersistError):
    """The rollup the head names is gone (GC may have replaced it): re-read the head."""


class RecordTaken(PersistError):
    """A record :func:`apply_many` was to create (``created``) was created by another
    commit first: nothing of this commit landed, and it never can.

    Attributes:
        key: the consensus key of the record (a shard id, a name record's key).
    """

    def __init__(self, key: str) -> None:
        super().__init__(f"the record {key!r} was created by another commit first")
        self.key = key


def _require_settled(lead: Machine, attempts: list[_Attempt[R]]) -> None:
    """Refuse to give a negative answer while a lost-reply attempt may have committed."""
    if any(a.resolution == "pending" for a in attempts):
        # Its record may have appeared since it was last looked for: another commit's
        # settles it lost (ours keeps it open, as it stays when nothing is there yet).
        lead._resolve(attempts)
    open_attempts = [a for a in attempts if a.resolution != "lost"]
    if open_attempts:
        where = "; ".join(", ".join(f"shard {w.shard} seqno {w.new.seqno}" for w in a.writes)
                          for a in open_attempts)
        raise UnsettledCommit(f"a commit whose reply was lost may or may not have landed at "
                              f"{where}; read the shard to find out")


def apply_many(steps: Sequence[Step[R]], *, routine: bool = True,
               proves_done: Callable[[R], bool] | None = None,
               created: Sequence[CasWrite] = ()) -> Applied[R]:
    """Run each step's transition against its shard's latest state and commit all of
    them atomically: the one compare-and-set loop of the library (one step is
    :meth:`Machine.apply`; several are a multi-shard transaction, committed with
    :meth:`Consensus.compare_and_set_many` in one round trip).

    The machines must be distinct shards of one consensus. Their locks are taken in
    shard order, so overlapping calls never deadlock. When any transition changes
    nothing or raises, nothing is committed: that negative answer is confirmed against
    state fetched from consensus during this call, and only given once every lost reply
    is settled. A lost reply over several shards is settled by any one of them.

    ``created``: records (``expected`` None: keys without any record, such as a name's)
    created in the same compare-and-set as the steps' states, so they exist exactly
    when the commit landed.

    Raises:
        Indeterminate: a CaS reply was lost and whether it committed cannot be told,
            or consensus stayed unavailable past the retry deadline.
        RecordTaken: another commit created one of ``created`` first; nothing landed.
    """
    if not steps:
        raise ValueError("apply_many needs at least one step")
    if len(steps) == 1:
        with steps[0].machine._lock:
            return _apply_locked(steps, routine, proves_done, created)
    # Taken in shard order and released in reverse, written out rather than through a
    # context manager (a generator per commit).
    taken: list[LockLike] = []
    try:
        for s in sorted(steps, key=_shard_of):
            lock = s.machine._lock
            lock.__enter__()
            taken.append(lock)
        return _apply_locked(steps, routine, proves_done, created)
    finally:
        for lock in reversed(taken):
            lock.__exit__(None, None, None)


def create_all(machines: Sequence[Machine]) -> bool:
    """Create the shards of ``machines`` (distinct, of one consensus) in ONE
    compare-and-set, each record expecting none: all of them or none.

    Returns True once every one of them exists (this call's statement landed, or, after
    a lost reply, every one has a record: this call's or other creators'), False when
    none was created by this call because another creator got to one first: the caller
    looks at what exists now and decides again.

    Raises:
        Indeterminate: consensus stayed unavailable past the retry deadline.
    """
    lead = machines[0]
    writes = [CasWrite(m.shard_id, None, m.first_record()) for m in machines]
    consensus = lead.consensus
    backoff: Backoff | None = None
    while True:
        try:
            if len(writes) == 1:
                only = writes[0]
                return consensus.compare_and_set(only.shard, None, only.new)
            return consensus.compare_and_set_many(writes)
        except Unavailable as e:
            if backoff is None:
                backoff = lead._backoff()
            backoff.wait(e)
        # A lost reply: the statement created every record or none. Once one exists and
        # another does not, it cannot land any more (it expected none of them); once all
        # exist, they are created, by it or by others (the caller checks each shard's
        # state as it opens it); while none does, it is sent again (identical records:
        # whichever statement lands first, the other inserts nothing).
        present = sum(consensus.head(w.shard) is not None for w in writes)
        if present == len(writes):
            return True
        if present:
            return False


def _shard_of(step: Step[Any]) -> str:
    return step.machine.shard_id


def _refresh_all(machines: list[Machine]) -> list[State]:
    return [m._refresh() for m in machines]


def _apply_locked(steps: Sequence[Step[R]], routine: bool,
                  proves_done: Callable[[R], bool] | None,
                  created: Sequence[CasWrite] = ()) -> Applied[R]:
    """:func:`apply_many` once every step's machine lock is held."""
    # Plain loops rather than comprehensions below: each comprehension is a function
    # call of its own, and this loop runs in every commit.
    machines: list[Machine] = []
    states: list[State] = []
    for step in steps:
        m = step.machine
        machines.append(m)
        # The cached state, read directly: its lock is held here (the property would
        # take it again), and only a first use has none yet to fetch.
        cached = m._state
        states.append(cached if cached is not None else m.state)
    lead = machines[0]
    # The retry deadline runs from the call's start; the Backoff that enforces it is
    # only built once a reply is lost (most calls never need one).
    started_s = lead.clock.monotonic()
    backoff: Backoff | None = None
    attempts: list[_Attempt[R]] = []
    confirmed = not lead.confirm_negative_answers
    while True:
        outputs: list[State] = []
        results: list[R] = []
        unchanged: list[bool] = []
        try:
            for step, state in zip(steps, states, strict=True):
                new, result = step.transition(state)
                outputs.append(new)
                results.append(result)
                unchanged.append(new is state)
        except PersistError:
            if not confirmed:
                lead.metrics.negative_answers_confirmed += 1
                states, confirmed = _refresh_all(machines), True
                continue
            _require_settled(lead, attempts)
            raise
        if True in unchanged:
            if not confirmed:
                lead.metrics.negative_answers_confirmed += 1
                states, confirmed = _refresh_all(machines), True
                continue
            done = bool(attempts) and proves_done is not None and all(
                proves_done(r) for r in results)
            if not done:
                _require_settled(lead, attempts)
            return Applied(done, results, states, [] if done else unchanged)
        news: list[State] = []
        writes: list[CasWrite] = []
        for m, new, state in zip(machines, outputs, states, strict=True):
            new = m.maintenance.fold_ready(m._bump(new, state))
            news.append(new)
            writes.append(CasWrite(m.shard_id, state.seqno, VersionedData(
                new.seqno, state_codec.encode_diff(state, new), state_codec.encode_summary(new))))
        if created:
            writes.extend(created)
        lead.metrics.cas_attempts += 1
        try:
            if len(writes) == 1:
                only = writes[0]
                won = lead.consensus.compare_and_set(only.shard, only.expected, only.new)
            else:
                won = lead.consensus.compare_and_set_many(writes)
            if won:
                for m, new in zip(machines, news, strict=True):
                    m._committed(new, routine)
                return Applied(True, results, news)
            lead.metrics.cas_mismatches += 1
        except Unavailable as e:
            lead.metrics.cas_indeterminate += 1
            lead.metrics.transient_retries += 1
            attempts.append(_Attempt(writes, news, results))
            lost_reply: Unavailable | None = e
        else:
            lost_reply = None
        # Settle lost replies first: however late it is (a pause past the retry
        # deadline), a commit that landed is reported as such.
        states, confirmed = _refresh_all(machines), True
        landed = lead._resolve(attempts)
        if landed is not None:
            lead.metrics.cas_resolved_committed += 1
            for m, new, latest in zip(machines, landed.news, states, strict=True):
                m._committed(new, routine, latest=latest)
            return Applied(True, landed.results, landed.news)
        still_absent: list[CasWrite] = []
        for write in created:
            # Records are never created twice: once another commit created one, this
            # commit can never land (its earlier attempts, if any, settled first). One
            # holding exactly this record (a retry of a commit that created it, such as
            # a Spark write committed again) is this commit's own: not created again.
            head = lead.consensus.head(write.shard)
            if head is None:
                still_absent.append(write)
            elif head.data != write.new.data:
                _require_settled(lead, attempts)
                raise RecordTaken(write.shard)
        created = still_absent
        if lost_reply is not None:
            if backoff is None:
                backoff = lead._backoff(started_s)
            backoff.wait(lost_reply)
            states = _refresh_all(machines)
