"""Pure state transitions: ``(state, args) -> (new_state, result)``.

A transition never mutates its input and never does I/O. Returning the input state
object unchanged means "nothing to commit". Expected races (an upper mismatch, a full
inline budget, a fenced critical reader) are returned as result values, not raised, so
the CaS loop in :mod:`persist_pipeline.internal.machine` can hand them back as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from persist_pipeline.exceptions import (
    InvalidFrontier,
    InvalidInput,
    LeaseExpired,
    SchemaMismatch,
)
from persist_pipeline.frontier import Frontier, less_equal, less_than
from persist_pipeline.internal.state import (
    Batch,
    CriticalReader,
    LeasedReader,
    Rollup,
    State,
    Writer,
)
from persist_pipeline.internal.trace import ApplyMergeOutcome, MergeRes, apply_merge_res, push_batch
from persist_pipeline.schema import ShardSchema, encoded_with_fits


@dataclass(frozen=True, slots=True)
class Appended:
    """The batch was committed (or had been, by an earlier attempt with the same token)."""

    already_committed: bool = False


@dataclass(frozen=True, slots=True)
class UpperMismatchResult:
    current: Frontier


@dataclass(frozen=True, slots=True)
class CommitDeadline:
    """The deadline of a commit that references freshly uploaded blobs: half the orphan
    age after ``started_ms``, when the first upload started. Times are milliseconds of
    the committing process's monotonic clock (never a wall clock, so neither skew
    between machines nor a wall-clock step can stretch it). The age is the shard's
    (:func:`orphan_min_age_ms`), never more than this process's ``own_age_ms``: a
    process configured with a longer age than GC's cannot commit a blob GC swept."""

    started_ms: int
    own_age_ms: int
    now_ms: int

    def passed_in(self, state: State) -> bool:
        """Whether the deadline has passed, for a commit on ``state``."""
        age_ms = min(self.own_age_ms, orphan_min_age_ms(state, self.own_age_ms))
        return self.now_ms > self.started_ms + age_ms // 2


def orphan_min_age_ms(state: State, configured_ms: int) -> int:
    """The shard's orphan age: the one recorded in ``state`` (when the shard was
    created, or by the first orphan sweep of a shard older than the record), else the
    ``configured_ms`` of the process asking."""
    return state.orphan_min_age_ms or configured_ms


@dataclass(frozen=True, slots=True)
class DeadlineExceeded:
    """The blobs this commit references were uploaded too long ago: GC may have swept them."""

    deadline: CommitDeadline


@dataclass(frozen=True, slots=True)
class InlineBudgetExceeded:
    """Inlining this batch would push the shard past ``max_bytes``: write it to blob."""

    current_inline_bytes: int


@dataclass(frozen=True, slots=True)
class SchemaChanged:
    """The write's updates were encoded with a schema (or none) that does not fit the
    one the shard has recorded: e.g. an untyped writer or Spark write planned before the
    shard's schema was recorded. ``recorded`` is the shard's encoded schema."""

    recorded: bytes


@dataclass(frozen=True, slots=True)
class TokenReusedResult:
    """The write's token names a write already appended at another lower (its batch in
    the state, or the writer's record of its last write): not a retry of that write but
    a new write reusing its token."""

    lower: int
    upper: Frontier


#: The result of an append that committed (results are immutable: one is shared).
APPENDED = Appended()

AppendResult = (Appended | UpperMismatchResult | InlineBudgetExceeded | DeadlineExceeded
                | SchemaChanged | TokenReusedResult)


def _with_since(state: State, **changes: object) -> State:
    """Apply ``changes`` then recompute since as the meet of readers (never regressing)."""
    new = replace(state, **changes)  # type: ignore[arg-type]
    held = new.reader_since_meet()
    if held == "none":
        return new
    since = held if less_equal(new.since, held) else new.since
    return new if since == new.since else replace(new, since=since)


#: The largest inline max a state can record (the field is a uint64).
MAX_INLINE_MAX_BYTES = (1 << 64) - 1


def create(state: State, now_ms: int, orphan_min_age_ms: int,
           inline_max_bytes: int | None = None) -> State:
    """The first state of a new shard (seqno 1): empty, ``since = upper = 0``, with the
    creating process's orphan age and inline max recorded as the shard's (None records
    no inline max, as a build before it was recorded did)."""
    return replace(state, walltime_ms=now_ms, created_ms=now_ms,
                   orphan_min_age_ms=orphan_min_age_ms,
                   inline_max_bytes=None if inline_max_bytes is None
                   else min(inline_max_bytes, MAX_INLINE_MAX_BYTES))


def inline_write_bound(state: State, own_max_bytes: int) -> int:
    """The most inline bytes an append by a process configured with ``own_max_bytes``
    may leave the shard holding: its own max, never more than the shard's recorded one.
    Going by the recorded max keeps a process configured with a bigger max from pushing
    the shard past the bound every other process, and the checks, go by; going by its
    own too keeps a raised record from making a process inline beyond its config."""
    recorded = state.inline_max_bytes
    return own_max_bytes if recorded is None or recorded >= own_max_bytes else recorded


def check_inline_max_bytes(value: object) -> int:
    """``value`` as a shard's inline max.

    Raises:
        InvalidInput: not an int in ``[0, 2**64)`` (a bool is not one).
    """
    if isinstance(value, bool) or not isinstance(value, int) or \
            not 0 <= value <= MAX_INLINE_MAX_BYTES:
        raise InvalidInput(f"inline max_bytes must be a non-negative int below 2**64, "
                           f"got {value!r:.80}")
    return value


def set_inline_max_bytes(state: State, max_bytes: int, now_ms: int
                         ) -> tuple[State, int | None]:
    """Record ``max_bytes`` as the shard's inline max; returns the one recorded before
    (None: none was). Lowering it below the shard's inline bytes loses nothing: appends
    stop inlining until compaction has flushed the inline parts below the new bound.

    Raises:
        InvalidInput: ``max_bytes`` is not a valid inline max (nothing changed).
    """
    check_inline_max_bytes(max_bytes)
    previous = state.inline_max_bytes
    if previous == max_bytes:
        return state, previous
    return replace(state, inline_max_bytes=max_bytes, walltime_ms=now_ms), previous


def register_writer(
    state: State, writer_id: str, now_ms: int, lease_ms: int, debug: str = ""
) -> tuple[State, Writer]:
    existing = state.writers.get(writer_id)
    writer = Writer(writer_id, now_ms, lease_ms, debug=debug) if existing is None else replace(
        existing, last_heartbeat_ms=now_ms)
    writers = dict(state.writers)
    writers[writer_id] = writer
    return replace(state, writers=writers, walltime_ms=now_ms), writer


def compare_and_append(
    state: State,
    batch: Batch | None,
    *,
    writer_id: str,
    token: str,
    expected_upper: int,
    new_upper: Frontier,
    now_ms: int,
    lease_ms: int,
    inline_max_bytes: int,
    fell_back: bool,
    records_inline_max: bool = True,
    commit_deadline: CommitDeadline | None = None,
    encoded_with: bytes = b"",
    record: ShardSchema | None = None,
    exact: bool = False,
) -> tuple[State, AppendResult]:
    """Append ``batch`` (None: no updates) iff the shard's upper is ``expected_upper``.

    The writer's idempotency token makes a retried commit a no-op: if this writer's most
    recent committed write carried ``token`` and spanned ``[expected_upper, new_upper)``,
    the append is reported as already committed; at another ``expected_upper`` it is a
    new write reusing the token (:class:`TokenReusedResult`). An inline batch is
    refused (:class:`InlineBudgetExceeded`) if it would leave the shard with more
    inline bytes than :func:`inline_write_bound` of ``inline_max_bytes`` (this
    process's configured max) allows; on a shard without a recorded max, a committed
    append records ``inline_max_bytes`` if ``records_inline_max`` (the process inlines
    at all). ``fell_back`` counts an
    inline candidate that went to blob because the budget was full. Idempotency is
    checked before ``commit_deadline``: a write that committed is reported as such
    however late the retry. ``encoded_with``
    is the encoded schema the batch's updates (and its parts' typed columns) were
    written with, empty for untyped updates: it travels with the batch from where it was
    encoded, and must fit the schema recorded in this state
    (:func:`~persist_pipeline.schema.encoded_with_fits`), or nothing is appended.
    ``record``, if given, is recorded first (:func:`record_schema`) in the same new
    state as the batch, so that a refused append leaves the schema as it was; one that
    does not fit is refused like a batch whose encoding does not. ``exact``: refused
    too unless the schema then recorded is ``encoded_with``'s exactly (a table's store:
    not one another store evolved past it).
    """
    if batch_in_state(state, batch):
        assert batch is not None
        # Committed, even if the writer (and its token) expired meanwhile; unless it
        # landed at another lower: then this is a new write reusing the token.
        desc = state.batches[batch.id].desc
        if desc.lower != expected_upper:
            return state, TokenReusedResult(desc.lower, desc.upper)
        return state, Appended(already_committed=True)
    writer = state.writers.get(writer_id)
    if (writer is not None and writer.most_recent_write_token == token
            and writer.most_recent_write_upper == new_upper):
        # The batch may be merged away (or the write held no rows): the record's lower
        # tells a new write reusing the token from its retry, whose rows a report of
        # "already committed" would drop. A record without one (an older state's)
        # cannot tell: taken for the retry, as before.
        lower = writer.most_recent_write_lower
        if lower is not None and lower != expected_upper:
            return state, TokenReusedResult(lower, new_upper)
        return state, Appended(already_committed=True)
    if commit_deadline is not None and commit_deadline.passed_in(state):
        return state, DeadlineExceeded(commit_deadline)
    # Every refusal below returns the state as it was (unchanged): only a committed
    # append carries the recorded schema.
    base = state
    if record is not None:
        try:
            base, _ = record_schema(state, record, now_ms)
        except SchemaMismatch:
            return state, SchemaChanged(state.schema)
    if not encoded_with_fits(base.schema, encoded_with):
        return state, SchemaChanged(state.schema)
    if exact and base.schema != encoded_with and \
            ShardSchema.from_bytes(base.schema) != ShardSchema.from_bytes(encoded_with):
        return state, SchemaChanged(state.schema)
    if state.upper != expected_upper:
        return state, UpperMismatchResult(state.upper)
    inline = batch.inline_bytes if batch is not None else 0
    # The shard's recorded max bounds every process's inline appends; a shard without
    # one (created by an older build, or by a process with inlining off) records this
    # process's with its first append.
    recorded = state.inline_max_bytes
    if recorded is None and records_inline_max:
        recorded = min(inline_max_bytes, MAX_INLINE_MAX_BYTES)
    if inline and state.inline_bytes + inline > inline_write_bound(state, inline_max_bytes):
        return state, InlineBudgetExceeded(state.inline_bytes)
    writers = dict(state.writers)
    # Every field of Writer is named here (cheaper than dataclasses.replace on the
    # commit path): a new field must be carried over here too.
    if writer is None:
        writers[writer_id] = Writer(writer_id, now_ms, lease_ms, token, new_upper, "",
                                    expected_upper)
    else:
        writers[writer_id] = Writer(writer_id, now_ms, writer.lease_duration_ms, token,
                                    new_upper, writer.debug, expected_upper)
    fallbacks = state.inline_fallbacks + 1 if fell_back else state.inline_fallbacks
    if batch is not None and batch.num_updates > 0:
        batches = dict(state.batches)
        batches[batch.id] = batch
        spine = dict(state.spine)
        spine_change = push_batch(spine, batch)
        # The seqno its commit carries (the machine's bump then copies nothing).
        new = base.evolve(upper=new_upper, writers=writers, walltime_ms=now_ms,
                          inline_fallbacks=fallbacks, batches=batches, spine=spine,
                          inline_bytes=state.inline_bytes + inline,
                          inline_max_bytes=recorded, seqno=state.seqno + 1)
        if spine_change is None:
            new.note_batch_added(state.batches, batches, batch.id)
        else:
            new.note_appended(state, batch.id, writer_id, spine_change)
        return new, APPENDED
    new = base.evolve(upper=new_upper, writers=writers, walltime_ms=now_ms,
                      inline_fallbacks=fallbacks, inline_max_bytes=recorded,
                      seqno=state.seqno + 1)
    new.note_appended(state, None, writer_id, None)
    return new, APPENDED


def record_schema(state: State, requested: ShardSchema, now_ms: int
                  ) -> tuple[State, ShardSchema]:
    """Record a typed shard's schema: at creation (a shard without updates), or evolved
    (nullable value columns appended). Returns the schema now recorded.

    Raises:
        SchemaMismatch: the shard holds untyped updates, or the schemas are incompatible.
    """
    if not state.schema:
        if any(b.num_updates for b in state.batches.values()):
            raise SchemaMismatch(f"shard {state.shard_id} holds untyped updates: a schema "
                                 f"can only be given when a shard is created")
        return replace(state, schema=requested.to_bytes(), walltime_ms=now_ms), requested
    stored = ShardSchema.from_bytes(state.schema)
    evolved = stored.evolve(requested)
    if evolved is stored:
        return state, stored
    # Remembered with the upper it was replaced at: a table loaded as of an earlier time
    # reads back with the columns it was stored with.
    evolved = evolved.evolved_from(stored, state.upper, state.since)
    return replace(state, schema=evolved.to_bytes(), walltime_ms=now_ms), evolved


def batch_in_state(state: State, batch: Batch | None) -> bool:
    """Whether this very batch (by its id, derived from the write's token) is in the state."""
    return batch is not None and batch.id in state.batches


def apply_merge(state: State, res: MergeRes, now_ms: int,
                commit_deadline: CommitDeadline | None = None
                ) -> tuple[State, ApplyMergeOutcome]:
    """Replace a merge result's inputs with its output (see :func:`trace.apply_merge_res`).

    Returns ``"deadline_exceeded"`` (nothing changed) when the result's outputs were
    uploaded too long ago to be committed safely; an already applied result is still
    recognised as such.

    Raises:
        InvalidInput: the result cannot come from a correct merge of its inputs (inline
            output, more updates than its inputs, a since behind its inputs' since).
    """
    if res.output.num_inline_parts:
        raise InvalidInput("compaction output must never be inlined")
    if res.output.id in state.batches:
        return state, "already_applied"
    inputs = [state.batches[i] for i in res.input_ids if i in state.batches]
    if len(inputs) == len(res.input_ids):
        _check_merge_result(res, inputs)
    if commit_deadline is not None and commit_deadline.passed_in(state):
        return state, "deadline_exceeded"
    batches = dict(state.batches)
    spine = dict(state.spine)
    removed_inline = sum(b.inline_bytes for b in inputs)
    outcome = apply_merge_res(batches, spine, state.ordered_batches, res)
    if outcome != "applied":
        return state, outcome
    if state.since is not None and less_than(state.since, res.output.desc.since):
        # Times were advanced beyond what readers hold: never commit that.
        return state, "no_match"
    return replace(state, batches=batches, spine=spine, walltime_ms=now_ms,
                   inline_bytes=state.inline_bytes - removed_inline), "applied"


def _check_merge_result(res: MergeRes, inputs: list[Batch]) -> None:
    """Refuse results no correct merge of these inputs produces (as Materialize does)."""
    updates_in = sum(b.num_updates for b in inputs)
    if res.output.num_updates > updates_in:
        raise InvalidInput(f"merge result {res.output.id} has {res.output.num_updates} updates, "
                           f"more than its inputs' {updates_in}")
    input_since = max(b.desc.since for b in inputs)
    if res.output.desc.since < input_since:
        raise InvalidInput(f"merge result {res.output.id} has since {res.output.desc.since}, "
                           f"behind its inputs' since {input_since}")


def register_leased_reader(
    state: State, reader_id: str, now_ms: int, lease_ms: int, debug: str = ""
) -> tuple[State, LeasedReader]:
    """Add a leased reader holding the current since and the new seqno."""
    existing = state.leased_readers.get(reader_id)
    if existing is not None:
        return heartbeat_leased_reader(state, reader_id, now_ms, existing.seqno)
    reader = LeasedReader(reader_id, state.since, state.seqno + 1, now_ms, lease_ms, debug)
    readers = dict(state.leased_readers)
    readers[reader_id] = reader
    return replace(state, leased_readers=readers, walltime_ms=now_ms), reader


def heartbeat_leased_reader(
    state: State, reader_id: str, now_ms: int, seqno_hold: int
) -> tuple[State, LeasedReader]:
    """Renew a reader's lease and move its seqno hold to ``seqno_hold``.

    Raises:
        LeaseExpired: the reader is gone (expired by another process, or by itself).
    """
    reader = state.leased_readers.get(reader_id)
    if reader is None:
        raise LeaseExpired(f"leased reader {reader_id} has expired")
    new = replace(reader, last_heartbeat_ms=now_ms, seqno=max(reader.seqno, seqno_hold))
    readers = dict(state.leased_readers)
    readers[reader_id] = new
    return replace(state, leased_readers=readers, walltime_ms=now_ms), new


def downgrade_since(
    state: State, reader_id: str, new_since: Frontier, now_ms: int, seqno_hold: int
) -> tuple[State, LeasedReader]:
    """Let a leased reader release times below ``new_since``."""
    reader = state.leased_readers.get(reader_id)
    if reader is None:
        raise LeaseExpired(f"leased reader {reader_id} has expired")
    if less_than(new_since, reader.since):
        raise InvalidFrontier(f"since may only advance: reader holds {reader.since}, "
                              f"asked for {new_since}")
    new = replace(reader, since=new_since, last_heartbeat_ms=now_ms,
                  seqno=max(reader.seqno, seqno_hold))
    readers = dict(state.leased_readers)
    readers[reader_id] = new
    return _with_since(state, leased_readers=readers, walltime_ms=now_ms), new


def expire_leased_reader(state: State, reader_id: str, now_ms: int) -> tuple[State, bool]:
    if reader_id not in state.leased_readers:
        return state, False
    readers = dict(state.leased_readers)
    del readers[reader_id]
    return _with_since(state, leased_readers=readers, walltime_ms=now_ms), True


def expire_writer(state: State, writer_id: str, now_ms: int) -> tuple[State, bool]:
    if writer_id not in state.writers:
        return state, False
    writers = dict(state.writers)
    del writers[writer_id]
    return replace(state, writers=writers, walltime_ms=now_ms), True


def expire_stale_leases(state: State, now_ms: int) -> tuple[State, list[str]]:
    """Remove leased readers and writers whose leases ran out; returns their ids."""
    stale_r = [r.id for r in state.leased_readers.values() if r.expired(now_ms)]
    stale_w = [w.id for w in state.writers.values() if w.expired(now_ms)]
    if not stale_r and not stale_w:
        return state, []
    readers = {k: v for k, v in state.leased_readers.items() if k not in stale_r}
    writers = {k: v for k, v in state.writers.items() if k not in stale_w}
    return _with_since(state, leased_readers=readers, writers=writers,
                       walltime_ms=now_ms), stale_r + stale_w


def register_critical_reader(
    state: State, reader_id: str, opaque: bytes, now_ms: int, debug: str = ""
) -> tuple[State, CriticalReader]:
    existing = state.critical_readers.get(reader_id)
    if existing is not None:
        return state, existing
    reader = CriticalReader(reader_id, state.since, opaque, debug)
    readers = dict(state.critical_readers)
    readers[reader_id] = reader
    return replace(state, critical_readers=readers, walltime_ms=now_ms), reader


@dataclass(frozen=True, slots=True)
class Fenced:
    current_opaque: bytes


def compare_and_downgrade_critical_since(
    state: State, reader_id: str, expected_opaque: bytes, new_opaque: bytes,
    new_since: Frontier, now_ms: int,
) -> tuple[State, CriticalReader | Fenced]:
    """Move a critical reader's since (and token) iff its token is ``expected_opaque``."""
    reader = state.critical_readers.get(reader_id)
    if reader is None:
        raise LeaseExpired(f"critical reader {reader_id} is not registered")
    if reader.opaque != expected_opaque:
        return state, Fenced(reader.opaque)
    if less_than(new_since, reader.since):
        raise InvalidFrontier(f"since may only advance: critical reader holds {reader.since}, "
                              f"asked for {new_since}")
    new = replace(reader, since=new_since, opaque=new_opaque)
    readers = dict(state.critical_readers)
    readers[reader_id] = new
    return _with_since(state, critical_readers=readers, walltime_ms=now_ms), new


def expire_critical_reader(state: State, reader_id: str, now_ms: int) -> tuple[State, bool]:
    if reader_id not in state.critical_readers:
        return state, False
    readers = dict(state.critical_readers)
    del readers[reader_id]
    return _with_since(state, critical_readers=readers, walltime_ms=now_ms), True


def add_rollup(state: State, rollup: Rollup, now_ms: int,
               commit_deadline: CommitDeadline | None = None) -> tuple[State, bool]:
    """Record a stored rollup; False (nothing changed) if it is not newer than the latest
    rollup, or was stored too long ago to be referenced safely."""
    latest = state.latest_rollup()
    if latest is not None and latest.seqno >= rollup.seqno:
        return state, False
    if rollup.seqno > state.seqno:
        return state, False
    if commit_deadline is not None and commit_deadline.passed_in(state):
        return state, False
    rollups = dict(state.rollups)
    rollups[rollup.seqno] = rollup
    return replace(state, rollups=rollups, walltime_ms=now_ms), True


def fence_orphan_sweep(state: State, now_ms: int, configured_age_ms: int
                       ) -> tuple[State, int]:
    """Record the start of an orphan sweep. Committing it fences every transition computed
    on an older state: those commits now fail their CaS and re-check their deadline,
    with the shard's orphan age (recorded now from ``configured_age_ms`` if the shard
    has none yet). Returns the age the sweep must use: the shard's, or the sweeper's
    own when that is longer (a longer age only keeps more)."""
    stamp = max(now_ms, state.orphan_sweep_ms + 1)
    recorded = orphan_min_age_ms(state, configured_age_ms)
    return (replace(state, orphan_sweep_ms=stamp, orphan_min_age_ms=recorded,
                    walltime_ms=now_ms),
            max(recorded, configured_age_ms))


def remove_rollups_below(state: State, seqno: int, now_ms: int) -> tuple[State, list[Rollup]]:
    removed = [r for s, r in state.rollups.items() if s < seqno]
    if not removed:
        return state, []
    rollups = {s: r for s, r in state.rollups.items() if s >= seqno}
    return replace(state, rollups=rollups, walltime_ms=now_ms), removed
