"""Did a write's batch land? The write side's one answer from a shard's state history.

A batch id derives from its write's idempotency token, so finding it in the shard's
state, a kept record or a kept rollup tells that an attempt of the write committed,
even after GC expired the writer (and its token) and truncated the record of the
commit, and after compaction merged the batch away. Every write path asks here:

- :func:`settle_lost_reply`: a lost reply the CaS loop could not settle (the record
  that would tell is gone) is reported committed when its batch is found;
- :func:`retry_landed`: a write retried with the token of an attempt whose outcome its
  caller never learnt, refused now (upper moved, deadline passed, schema changed), is
  reported committed when that attempt landed, and deletes parts only when it certainly
  did not;
- :func:`batch_landed`: the lookup itself (``WriteHandle.committed``).

A token names one write: a batch found appended at another lower than the one asked
about is another write's, and the write asking reuses its token (``TokenReused``), never
its retry.

A transaction commits every shard's batch or none, so any one batch found answers for
all of them; a write of no rows has no batch to find (its ``batch_id`` is None): its
writer's record of its token tells instead, while a kept version holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from persist_pipeline.exceptions import (
    Indeterminate,
    PersistError,
    TokenReused,
    UnsettledCommit,
)
from persist_pipeline.frontier import Frontier
from persist_pipeline.internal import state_codec
from persist_pipeline.internal.state import Description

if TYPE_CHECKING:
    from persist_pipeline.internal.machine import Machine

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One shard's batch of a write attempt: ``batch_id`` (None: the write held no rows,
    so it left no batch) appended at ``lower`` (its expected upper); ``token``, when
    known, also finds a write of no rows by its writer's record."""

    machine: Machine
    batch_id: str | None
    lower: int
    token: str | None = None


def token_reused(shard_id: str, batch_id: str | None, lower: int, upper: Frontier,
                 expected: int) -> TokenReused:
    """The error of a new write whose token (batch ``batch_id``; None: the write holds
    no rows) already named a write appended at ``[lower, upper)``."""
    named = f"of batch {batch_id}" if batch_id is not None else "of this write"
    return TokenReused(f"shard {shard_id}: the idempotency token {named} "
                       f"already named a write appended at [{lower}, {upper}); this write "
                       f"at expected_upper {expected} is not a retry of it (a token names "
                       f"one write: give a new write a new token); nothing was written")


def batch_landed(machine: Machine, batch_id: str | None, lower: int,
                 token: str | None = None) -> bool | None:
    """Whether a batch appended at ``lower`` was ever committed, from state history.

    True if the latest state, a kept record (adding it, or a merge removing it) or a
    kept rollup holds it; False if none does and the kept history reaches back to when
    the shard's upper was still ``lower`` (where it would be); None when GC truncated
    that far (``batch_id`` None: a write of no rows, looked for by its ``token`` alone).
    Given the write's ``token``, a writer's record of it (latest state, kept
    record or rollup) also tells: a write of no rows leaves no batch, only that record,
    and False would claim it never committed.

    Raises:
        TokenReused: the batch was found appended at another lower: the token named
            another write, and this one is not its retry.
    """
    def at(desc: Description) -> bool:
        if desc.lower != lower:
            raise token_reused(machine.shard_id, batch_id, desc.lower, desc.upper, lower)
        return True

    def recorded(writer_lower: int | None, upper: Frontier) -> bool:
        # Only a committed append records a token in its writer; a record without its
        # lower (an older state's) cannot tell a reuse, and is taken for this write.
        if writer_lower is not None and writer_lower != lower:
            raise token_reused(machine.shard_id, None, writer_lower, upper, lower)
        return True

    latest = machine.fetch_latest()
    if batch_id is not None and batch_id in latest.batches:
        return at(latest.batches[batch_id].desc)
    if token:
        for w in latest.writers.values():
            if w.most_recent_write_token == token:
                return recorded(w.most_recent_write_lower, w.most_recent_write_upper)
    records = machine.consensus.scan(machine.shard_id, 0)
    merged_away = False
    for rec in records:
        diff = state_codec.decode_diff(rec.data, f"shard {machine.shard_id} seqno {rec.seqno}")
        for b in diff.batch_upserts:
            if b.id == batch_id:
                return at(state_codec.description_from(b.desc))
        merged_away = merged_away or batch_id in diff.batch_deletes
        for pw in diff.writer_upserts if token else ():
            if pw.most_recent_write_token == token:
                return recorded(pw.most_recent_write_lower
                                if pw.HasField("most_recent_write_lower") else None,
                                state_codec.frontier_from_proto(pw.most_recent_write_upper))
    truncated = bool(records) and records[0].seqno > 1
    if not merged_away and not truncated:
        return False
    first = records[0].seqno if records else 0
    base_upper: Frontier | None = None
    known = False
    for seqno, rollup in sorted(latest.rollups.items()):
        rolled = machine.blobs.fetch_rollup(rollup.key, rollup.crc32, f"rollup {rollup.key}")
        if rolled is None:
            continue  # replaced by a concurrent GC: the others still tell
        if batch_id is not None and batch_id in rolled.batches:
            return at(rolled.batches[batch_id].desc)
        for w in rolled.writers.values() if token else ():
            if w.most_recent_write_token == token:
                return recorded(w.most_recent_write_lower, w.most_recent_write_upper)
        if seqno == first:
            base_upper, known = rolled.upper, True
    if merged_away:
        return True  # every kept version naming its bounds is gone: they cannot be checked
    if known and base_upper is not None and base_upper <= lower:
        return False
    return None


def retry_landed(attempts: Iterable[Attempt]) -> bool:
    """Whether an earlier attempt of a refused retry landed: True if one of its batches
    is found; False only if every batch certainly never committed (its parts may then
    be deleted).

    Raises:
        Indeterminate: none was found, and GC truncated the history of one that would
            tell (parts must be left to GC).
        TokenReused: a batch was found appended at another lower (see
            :func:`batch_landed`): not a retry of that write (parts left to GC).
    """
    unknown: str | None = None
    for attempt in attempts:
        if attempt.batch_id is None and attempt.token is None:
            continue  # a write of no rows, its token unknown: nothing can tell
        # A write of no rows is found by its writer's record of the token alone: skipped,
        # a transaction of empty appends only would read as never committed.
        found = batch_landed(attempt.machine, attempt.batch_id, attempt.lower,
                             attempt.token)
        if found:
            return True
        if found is None and unknown is None:
            named = f"batch {attempt.batch_id}" if attempt.batch_id is not None \
                else "write of no rows"
            unknown = f"shard {attempt.machine.shard_id} {named}"
    if unknown is not None:
        raise Indeterminate(f"cannot tell whether the write of {unknown} (retried with its "
                            f"idempotency token) committed: GC truncated the history that "
                            f"would say")
    return False


def lost_reply_landed(attempt: Attempt) -> bool:
    """Whether the batch of a lost reply is found in history (False also when it cannot
    be looked for: consensus still away leaves the outcome unknown, never "lost")."""
    if attempt.batch_id is None and attempt.token is None:
        return False
    try:
        return batch_landed(attempt.machine, attempt.batch_id, attempt.lower,
                            attempt.token) is True
    except PersistError as e:
        log.warning("shard %s: could not look for batch %s in history: %s",
                    attempt.machine.shard_id, attempt.batch_id, e)
        return False


def settle_lost_reply(attempts: Sequence[Attempt], error: Indeterminate) -> None:
    """A lost reply the CaS loop could not settle: returns if one of its batches is found
    in history (it committed), else re-raises ``error``, an ``UnsettledCommit`` naming
    the first batch a caller can look for later."""
    if any(lost_reply_landed(a) for a in attempts):
        return
    if isinstance(error, UnsettledCommit):
        named = next((a.batch_id for a in attempts if a.batch_id is not None), None)
        if named is not None:
            error.batch_id = named
    raise error
