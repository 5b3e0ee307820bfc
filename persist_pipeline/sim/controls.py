"""Negative controls: each one puts back a defect this project fixed, so a test (or
``persist-pipeline simulate --control NAME``) can show the simulation catches it.

Never used outside the simulation and its tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from persist_pipeline import gc, read
from persist_pipeline.exceptions import CorruptState, LeaseExpired
from persist_pipeline.internal import machine, transitions


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def trust_cached_negatives() -> Iterator[None]:
    """Defect 1: a negative answer computed from a stale cache is returned as is."""
    with _patched(machine.Machine, "confirm_negative_answers", False):
        yield


def _guess_lost(self: machine.Machine, attempts: list[Any]) -> None:
    for attempt in attempts:
        attempt.resolution = "lost"
    return None


@contextmanager
def guess_lost_replies() -> Iterator[None]:
    """Defects 2 and 4 (and the critical reader's lost downgrade): an attempt whose reply
    was lost is assumed to have failed; the transition's answer on fresh state decides
    (and a write does not recognise its own batch in the state)."""
    with _patched(machine.Machine, "_resolve", _guess_lost), \
            _patched(transitions, "batch_in_state", lambda state, batch: False):
        yield


@contextmanager
def deadline_before_token() -> Iterator[None]:
    """Defect 3: the commit deadline is checked before the idempotency token (with lost
    replies guessed, as before the fix; the settle rule alone also prevents the loss)."""
    original = transitions.compare_and_append

    def reordered(state: Any, batch: Any, **kw: Any) -> Any:
        deadline = kw.get("commit_deadline_ms")
        if deadline is not None and kw["now_ms"] > deadline:
            return state, transitions.DeadlineExceeded(deadline)
        return original(state, batch, **kw)

    with _patched(transitions, "compare_and_append", reordered), guess_lost_replies():
        yield


@contextmanager
def merge_without_deadline() -> Iterator[None]:
    """Defect 5: a merge result commits however long ago its outputs were uploaded."""
    original = transitions.apply_merge

    def no_deadline(state: Any, res: Any, now_ms: int,
                    commit_deadline_ms: int | None = None) -> Any:
        return original(state, res, now_ms, None)

    with _patched(transitions, "apply_merge", no_deadline):
        yield


@contextmanager
def gc_trusts_its_scan() -> Iterator[None]:
    """Defect 6: GC uses whatever records a scan returns, as if they started where it
    thinks, and a missing rollup is corrupt state rather than a sign to skip."""

    def records(m: machine.Machine, start: int, end: int | None) -> list[Any]:
        limit = None if end is None else end - start
        return m.consensus.scan(m.shard_id, start + 1, limit=limit)

    original_state_at = gc._state_at

    def state_at(m: machine.Machine, head: Any, seqno: int) -> Any:
        try:
            return original_state_at(m, head, seqno)
        except gc._Overtaken as e:
            raise CorruptState(str(e)) from None

    with _patched(gc, "_records", records), _patched(gc, "_state_at", state_at):
        yield


@contextmanager
def reader_hold_race() -> Iterator[None]:
    """Defect 7: a read fetches its state and registers the seqno it reads in two steps."""

    def start_reading(self: read.ReadHandle) -> Any:
        self._check()
        state = self._machine.fetch_latest()
        if self.reader_id not in state.leased_readers:
            self._expired = True
            raise LeaseExpired(f"reader {self.reader_id} was expired")
        with self._reading_lock:
            self._reading[state.seqno] = self._reading.get(state.seqno, 0) + 1
        return state

    with _patched(read.ReadHandle, "_start_reading", start_reading):
        yield


@contextmanager
def listen_without_hold() -> Iterator[None]:
    """Defect 8: a listen does not hold since below its frontier (nor refuses batches
    compacted past it)."""
    with _patched(read.ReadHandle, "_listen_cap", lambda self: None), \
            _patched(read.Listen, "_check_batches", staticmethod(lambda *a: None)):
        yield


@contextmanager
def open_fails_on_replaced_rollup() -> Iterator[None]:
    """Defect 9: opening a shard while GC replaces its rollup raises CorruptState."""
    original = machine.Machine._reconstruct

    def reconstruct(self: machine.Machine, head: Any) -> Any:
        try:
            return original(self, head)
        except machine._RollupMissing as e:
            raise CorruptState(str(e)) from None

    with _patched(machine.Machine, "_reconstruct", reconstruct):
        yield


@contextmanager
def expired_read_reports_corruption() -> Iterator[None]:
    """Defect 9: a reader paused past its lease gets CorruptPart, not LeaseExpired."""

    with _patched(read.ReadHandle, "_raise_if_expired", lambda self, error: None):
        yield


CONTROLS: dict[str, Callable[[], Any]] = {
    "trust_cached_negatives": trust_cached_negatives,
    "guess_lost_replies": guess_lost_replies,
    "deadline_before_token": deadline_before_token,
    "merge_without_deadline": merge_without_deadline,
    "gc_trusts_its_scan": gc_trusts_its_scan,
    "reader_hold_race": reader_hold_race,
    "listen_without_hold": listen_without_hold,
    "open_fails_on_replaced_rollup": open_fails_on_replaced_rollup,
    "expired_read_reports_corruption": expired_read_reports_corruption,
}
