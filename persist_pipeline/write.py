"""Write handles: ``compare_and_append`` and ``append`` with inline-or-blob placement."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.config import InlinePolicy, Placement
from persist_pipeline.exceptions import (
    CommitDeadlineExceeded,
    CorruptPart,
    Indeterminate,
    InvalidFrontier,
    InvalidUpdates,
    LeaseExpired,
    PersistError,
    SchemaMismatch,
    UpperMismatch,
)
from persist_pipeline.frontier import MAX_TIME, Frontier, check_frontier, less_equal, less_than
from persist_pipeline.ids import batch_id as batch_id_of
from persist_pipeline.ids import check_token, new_token
from persist_pipeline.internal import history, transitions
from persist_pipeline.internal.blobs import write_parts
from persist_pipeline.internal.funnel import Funnel
from persist_pipeline.internal.heartbeat import Heartbeater
from persist_pipeline.internal.lookup import current_rows
from persist_pipeline.internal.machine import Machine, Step, apply_many
from persist_pipeline.internal.records import quick_init
from persist_pipeline.internal.state import Batch, Description, HollowPart, InlinePart, Store
from persist_pipeline.schema import ShardSchema
from persist_pipeline.updates import (
    SCHEMA,
    Updates,
    empty_table,
    exact_segment_sums,
    numpy_values,
)

if TYPE_CHECKING:
    from persist_pipeline.consensus.base import CasWrite
    from persist_pipeline.internal.state import State

log = logging.getLogger(__name__)

#: How many times an upsert or delete re-reads its keys after finding a part collected
#: (a compaction replaced it since the state it read) before reporting the part missing.
_MISSING_PART_RETRIES = 10
#: The longest random back-off between an upsert's attempts after losing a race (it
#: retries until ``retry_deadline_s``).
_REPLACE_BACKOFF_MAX_S = 0.1


@dataclass(frozen=True, slots=True)
class Encoding:
    """The schema a write's updates were encoded with (None: untyped), and its recorded
    bytes. It travels with the batch into the append transition, which refuses it if it
    does not fit the shard's recorded schema: a handle never re-derives it later."""

    schema: ShardSchema | None = None
    recorded: bytes = b""
    #: A schema the commit records first, in the same compare-and-set as the rows (the
    #: table path's evolution): a write that is refused leaves the schema as it was.
    record: ShardSchema | None = None
    #: The commit is refused unless the shard's schema (after ``record``) is ``schema``
    #: exactly (a table writer's: its table must load back as stored, never with the
    #: columns another store appended meanwhile).
    exact: bool = False

    @classmethod
    def of(cls, schema: ShardSchema | None) -> Encoding:
        return cls(schema, schema.to_bytes() if schema is not None else b"")

    @classmethod
    def recorded_in(cls, state: State) -> Encoding:
        """The encoding of the schema ``state`` records (what rows read there carry)."""
        return cls(ShardSchema.from_bytes(state.schema) if state.schema else None,
                   state.schema)


UNTYPED = Encoding()


#: The errors after which a write certainly did not commit: the commit loop settles
#: every lost reply before it answers "no", so its uploaded parts may be deleted.
CERTAINLY_NOT_COMMITTED = (UpperMismatch, CommitDeadlineExceeded, InvalidUpdates,
                           SchemaMismatch)
#: The refusals of a retry (a write given the token of an attempt whose outcome its
#: caller never learnt) that the batch's history settles (see
#: :func:`~persist_pipeline.internal.history.retry_landed`): the attempt that landed is
#: no longer in the state (compaction merged its batch away), so the retry's own
#: transition sees only a moved upper, its passed deadline or a schema recorded since.
RETRY_REFUSALS = (UpperMismatch, CommitDeadlineExceeded, SchemaMismatch)


@quick_init
@dataclass(frozen=True, slots=True)
class Staged:
    """A write ready to commit: its batch (inline, or parts already uploaded), where it
    goes, and the encoding it was made with. Built by a handle; committed alone
    (:meth:`WriteHandle._apply`) or with other shards' in one transaction."""

    handle: WriteHandle
    batch: Batch | None
    expected: int
    upper: Frontier
    token: str
    encoding: Encoding
    placement: Placement
    encoded: int
    num_parts: int
    fell_back: bool = False
    upload_started_s: float | None = None
    inline_size: int = 0
    #: Records created in the same compare-and-set (a new name's), so they exist exactly
    #: when this write commits (:func:`~persist_pipeline.internal.machine.apply_many`).
    created: tuple[CasWrite, ...] = ()

    @property
    def parts(self) -> tuple[HollowPart, ...]:
        """The blob parts this write uploaded (none when inline)."""
        if self.batch is None:
            return ()
        return tuple(p for p in self.batch.parts if isinstance(p, HollowPart))

    @property
    def attempt(self) -> history.Attempt:
        """This write's batch, as its shard's history is asked for it."""
        return history.Attempt(self.handle._machine,
                               self.batch.id if self.batch is not None else None,
                               self.expected, self.token)


@quick_init
@dataclass(frozen=True, slots=True)
class WriteResult:
    """What a successful write did.

    Attributes:
        placement: ``"inline"`` (in consensus), ``"wal"`` (WAL blob store), ``"blob"``
            (main blob store), or ``"none"`` (no updates to store, or an ``append`` that
            found its updates already written).
        encoded_bytes: the size of the stored encoding (inline protobuf or Parquet parts).
        seqno: the consensus seqno that committed it (or that was current, for ``"none"``).
        upper: the shard's upper after the write.
        num_updates: updates stored, after consolidation.
        num_parts: blob parts written (0 when inline).
        fell_back: an inline candidate went to blob because the shard's budget was full.
        already_committed: a retry found this write already committed (idempotency).
        inline_size: the size of the inline encoding that the placement compared with
            ``persist_inline_update_threshold_bytes`` (an upper-bound estimate when the
            batch was far too large to encode inline); ``encoded_bytes`` is what was
            stored (for a blob write, the Parquet parts).
        rows_added / rows_retracted: for :meth:`WriteHandle.replace_contents`,
            :meth:`~WriteHandle.upsert` and :meth:`~WriteHandle.delete`, the rows the
            write added and removed (sums of its positive and negative diffs).
    """

    placement: Placement
    encoded_bytes: int
    seqno: int
    upper: Frontier
    num_updates: int
    num_parts: int = 0
    fell_back: bool = False
    already_committed: bool = False
    rows_added: int = 0
    rows_retracted: int = 0
    inline_size: int = 0


class WriteHandle:
    """Appends to one shard. Obtain one with :meth:`PersistClient.open_writer`."""

    def __init__(self, machine: Machine, writer_id: str, policy: InlinePolicy,
                 has_wal: bool, debug: str = "", schema: ShardSchema | None = None,
                 recorded: bytes = b"", funnel: Funnel | None = None,
                 table_schema: ShardSchema | None = None) -> None:
        self._machine = machine
        #: The client's group-commit funnel (None: each append commits on its own).
        self._funnel = funnel
        #: A table writer's schema (see :meth:`PersistClient._open_table_writer`): its
        #: replacements record it in their own commit and commit only into a shard of
        #: exactly this schema, or are refused (SchemaMismatch, nothing written).
        self._table_schema = table_schema
        self.schema = table_schema if table_schema is not None else schema
        #: What this handle encodes typed tables with: the schema recorded when it opened.
        self._encoding = Encoding(schema, recorded) if recorded else Encoding.of(schema)
        # Upsert back-off jitter, seeded by the writer id: replays of the deterministic
        # simulation (seeded ids) back off alike.
        self._jitter = random.Random(writer_id)  # noqa: S311 - jitter, not a secret
        self.writer_id = writer_id
        self.policy = policy
        self._store: Store = "wal" if has_wal else "main"
        self._closed = False
        self._released = False  # expire() committed: the writer is gone from the state
        lease = self._lease_ms()
        _, state = machine.apply(
            lambda s: transitions.register_writer(s, writer_id, machine.now_ms(), lease, debug))
        self._upper: Frontier = state.upper
        self._heartbeat = Heartbeater(f"persist-writer-{writer_id[:9]}",
                                      machine.config.heartbeat_interval_s, self._beat)

    @property
    def shard_id(self) -> str:
        return self._machine.shard_id

    @property
    def upper(self) -> Frontier:
        """The shard's upper as of this handle's latest operation (may be stale)."""
        return self._upper

    def fetch_recent_upper(self) -> Frontier:
        """Ask consensus for the shard's current upper."""
        self._upper = self._machine.fetch_latest().upper
        return self._upper

    def _lease_ms(self) -> int:
        return int(self._machine.config.reader_lease_duration_s * 1000)

    def _beat(self) -> None:
        lease = self._lease_ms()
        machine = self._machine

        def renew(state: State) -> tuple[State, None]:
            # Asked on every attempt: expire() closes the handle before it commits, so
            # a beat whose commit would land after the expiry re-runs here and changes
            # nothing, rather than registering the expired writer again.
            if self._closed:
                return state, None
            return transitions.register_writer(state, self.writer_id, machine.now_ms(),
                                               lease)[0], None

        machine.apply(renew)

    def compare_and_append(
        self, updates: object, expected_upper: int, new_upper: Frontier, *,
        idempotency_token: str | None = None,
    ) -> WriteResult:
        """Append ``updates`` iff the shard's upper is ``expected_upper``; advance it.

        Args:
            updates: ``(key, val, ts, diff)`` tuples or a pyarrow Table with columns k, v,
                t, d. Every ``ts`` must lie in ``[expected_upper, new_upper)``.
            expected_upper: the upper the caller believes the shard has.
            new_upper: the new upper (``None`` closes the shard for good).
            idempotency_token: reuse the token of an attempt that ended indeterminate to
                retry it without any risk of applying it twice. If that attempt had
                committed, the result has ``already_committed=True`` (and placement
                ``"none"`` when only state history could tell). A token is 1-128
                characters ``[A-Za-z0-9_-]`` (``persist_pipeline.ids.new_token()``
                makes one); None: a fresh token.

        Raises:
            UpperMismatch: the shard's upper was not ``expected_upper``; nothing changed.
            InvalidUpdates / InvalidFrontier: bad input; nothing changed.
            SchemaMismatch: a table that does not fit a typed shard's schema, or untyped
                updates (tuples, a k/v table) for a typed shard; nothing changed.
            InvalidInput: a malformed ``idempotency_token``; nothing changed.
            TokenReused: ``idempotency_token`` already named a write appended at
                another ``expected_upper``: this is not its retry; nothing changed.
            Indeterminate: a lost reply (or a retried token) whose outcome cannot be
                told; the parts are left for GC. Read the shard, or retry with the
                same ``idempotency_token``.
        """
        self._check_open()
        if idempotency_token is not None:  # the hot path (no token) pays one test
            check_token(idempotency_token)
        expected, upper = check_append_bounds(expected_upper, new_upper)
        data = self._coerce(updates)
        check_times(data, expected, upper)
        return self._compare_and_append(data, expected, upper, idempotency_token,
                                        self._encoding)

    def _compare_and_append(self, data: Updates, expected: int, upper: Frontier,
                            idempotency_token: str | None, encoding: Encoding) -> WriteResult:
        token = new_token() if idempotency_token is None else idempotency_token
        try:
            return self._commit(data, expected, upper, token, encoding)
        except RETRY_REFUSALS:
            if idempotency_token is None or not self._earlier_attempt_landed(token, expected):
                raise
            return self._found_committed()

    def _earlier_attempt_landed(self, token: str, expected: int) -> bool:
        """Whether a refused retry with ``token`` (:data:`RETRY_REFUSALS`) had an earlier
        attempt that landed at ``expected``, by its batch's history.

        Raises:
            Indeterminate: GC truncated the history that would tell.
        """
        return history.retry_landed(
            [history.Attempt(self._machine, batch_id_of(token), expected, token)])

    def _found_committed(self) -> WriteResult:
        """The result of a retry whose earlier attempt was found committed in history
        (nothing of this attempt was written)."""
        state = self._machine.state
        return WriteResult("none", 0, state.seqno, state.upper, 0, already_committed=True)

    def committed(self, idempotency_token: str, expected_upper: int) -> bool | None:
        """Whether the write made with ``idempotency_token`` at ``expected_upper`` was
        committed: how a process that recorded its intent before a write, and died before
        recording the outcome, settles it later.

        Returns:
            True if the shard's state or its kept history holds the write's batch; False
            if it has not committed; None if GC truncated the history that would tell.
            False is final once the shard's upper has moved past ``expected_upper``; while
            the upper is still there, an attempt still in flight (a process paused, not
            dead) may yet commit, so a caller that then writes the same rows anew must
            commit at the upper it read *before* asking (a late landing makes that
            commit fail with ``UpperMismatch``; ask again then), or retry with the same
            token and ``expected_upper`` (a retry lands once). A write of no updates
            leaves no batch: its writer's record of the token tells instead, while a
            kept version holds it.

        Raises:
            InvalidInput: a malformed ``idempotency_token`` (see
                :meth:`compare_and_append`). InvalidFrontier: ``expected_upper`` is not
                a time. TokenReused: the token's write was appended at another
                ``expected_upper``.
        """
        self._check_open()
        check_token(idempotency_token)
        expected = check_frontier(expected_upper, "expected_upper")
        if expected is None:
            raise InvalidFrontier("expected_upper must be a time")
        return history.batch_landed(self._machine, batch_id_of(idempotency_token), expected,
                                    idempotency_token)

    def compare_and_append_parts(
        self, parts: tuple[HollowPart, ...], num_updates: int, expected_upper: int,
        new_upper: Frontier, *, idempotency_token: str, upload_started_s: float,
        schema: ShardSchema | None, created: tuple[CasWrite, ...] = (),
    ) -> WriteResult:
        """Commit Parquet parts uploaded elsewhere (Spark tasks) as ONE batch, atomically.

        Each part must be a consolidated k/v/t/d Parquet file under this shard's prefix
        (:func:`~persist_pipeline.internal.blobs.write_parts`), written for batch
        ``b<idempotency_token>``, with times in ``[expected_upper, new_upper)``.
        ``upload_started_s`` is a moment before the first upload started, on this
        client's monotonic clock (a Spark driver takes it when it plans the write, on
        the host that commits): later than GC's commit deadline after it, nothing is
        committed. ``schema`` is the schema the parts were
        encoded with (None: untyped), as known where they were written: the commit is
        refused (``SchemaMismatch``, parts deleted) unless it fits the shard's schema.

        When nothing was committed for certain and nothing can commit them any more
        (the upper moved past ``expected_upper``, a schema refusal) the parts are
        deleted; a deadline refusal or an upper still below ``expected_upper`` (another
        commit of the same parts, computed in time, may still land), an
        indeterminate outcome, and bad input (bounds, parts' times or keys that do not
        fit), leave them to GC's orphan sweep. Any call may retry an earlier attempt
        with the same token and parts whose outcome was unknown, so a refusal is settled
        by the batch's history first, as :meth:`compare_and_append`'s retry: found
        committed (perhaps merged away by compaction since), it reports
        ``already_committed`` and keeps the parts (they may be that attempt's); when GC
        truncated the history that would tell, it raises ``Indeterminate`` and leaves
        them to GC. ``created``: records created in the same compare-and-set (a new
        name's, so it is registered exactly when the parts commit).

        Raises:
            UpperMismatch / CommitDeadlineExceeded / InvalidUpdates / Indeterminate: as
                :meth:`compare_and_append`.
            RecordTaken: another commit created one of ``created`` first; nothing
                committed, the parts are left to GC.
            InvalidInput: a malformed ``idempotency_token``; nothing is committed or
                deleted (its parts cannot lie in this shard's batch folders).
        """
        self._check_open()
        # Before the parts' keys are checked against the batch prefix the token names
        # (and before anything is deleted): a malformed token names no folder of this
        # shard, so its parts are left to GC's orphan sweep.
        check_token(idempotency_token)
        # Bad input deletes nothing: the parts may be those of an earlier attempt with
        # this token that committed (a retry given other bounds), or another batch's;
        # GC's orphan sweep deletes them if no state references them.
        expected, upper = check_append_bounds(expected_upper, new_upper)
        prefix = f"{self.shard_id}/p/{batch_id_of(idempotency_token)}/"
        for part in parts:
            if not part.key.startswith(prefix):
                raise InvalidUpdates(f"part {part.key!r} was not written for this "
                                     f"batch (expected keys under {prefix!r})")
            if part.min_time < expected or not less_equal(part.max_time + 1, upper):
                raise InvalidUpdates(f"update times must lie in [{expected}, {upper}); "
                                     f"part {part.key!r} has {part.min_time}.."
                                     f"{part.max_time}")
        since = self._machine.state.since
        desc = Description(expected, upper, since if since is not None else 0)
        batch = Batch(batch_id_of(idempotency_token), desc, parts, num_updates) if parts else None
        placement: Placement = "none" if not parts else (
            "wal" if parts[0].store == "wal" else "blob")
        staged = Staged(self, batch, expected, upper, idempotency_token, Encoding.of(schema),
                        placement, sum(p.encoded_size for p in parts), len(parts),
                        upload_started_s=upload_started_s, created=created)
        try:
            result = self._apply(staged)
        except CERTAINLY_NOT_COMMITTED as refused:
            # This attempt certainly did not commit (the CaS loop settled every lost reply
            # first), but these parts may be those of an earlier attempt with this token
            # that did, merged away since by compaction while older versions still
            # reference them: whatever the refusal, they are deleted only if that never
            # committed either (and left to GC, with Indeterminate, when history cannot
            # tell).
            if batch is not None and self._earlier_attempt_landed(idempotency_token, expected):
                return self._found_committed()
            if _fences_commits_at(refused, expected):
                self._delete_uncommitted(parts)
            # Otherwise another commit of these very parts (the same write committed
            # again while its first attempt, computed in time, is still on its way) may
            # still land and reference them. GC's orphan sweep fences before it deletes
            # them.
            raise
        assert result is not None  # hollow batches never exceed the inline budget
        return result

    def append(self, updates: object, lower: int, upper: Frontier) -> WriteResult:
        """Persist's ``append``: like compare_and_append with ``expected_upper=lower``,
        for writers of definite data that may race with identical writers.

        If the shard's upper is already inside ``(lower, upper)``, the updates below it are
        cut away (another writer wrote them) and the rest is appended; if it is at or past
        ``upper``, nothing is written and the result's placement is ``"none"``.

        Raises:
            UpperMismatch: the shard's upper is below ``lower`` (a gap would open).
        """
        self._check_open()
        lo, hi = check_append_bounds(lower, upper, names=("lower", "upper"))
        data = self._coerce(updates)
        check_times(data, lo, hi)
        token = new_token()
        while True:
            try:
                return self._commit(data, lo, hi, token, self._encoding)
            except UpperMismatch as mismatch:
                current = mismatch.current
                if less_than(current, lo):
                    raise
                if less_than(current, hi):
                    assert current is not None
                    lo = current
                    data = data.filter_times(current)
                    token = new_token()
                    continue
                state = self._machine.state
                return WriteResult("none", 0, state.seqno, current, 0)

    def upsert(self, table: object, ts: int | None = None) -> WriteResult:
        """Make each row of ``table`` the value of its key at ``ts`` (typed shards).

        The previous rows of those keys (found through the parts whose key bounds can
        hold them) are retracted and the new ones added, in ONE compare-and-set append
        that advances the upper to ``ts + 1``. If another write lands first, the keys are
        read again and the append retried, as long as ``ts`` is still at or beyond the
        shard's upper.

        Args:
            table: the key and value columns (a pyarrow Table, pandas/polars DataFrame,
                Arrow stream or list of row dicts); each key at most once.
            ts: the time of the change, at or beyond the shard's upper; None: at the
                shard's upper when the write commits (a retry takes the new upper).

        Raises:
            SchemaMismatch: an untyped shard, or the table does not fit the schema.
            InvalidUpdates: a key appears twice. InvalidFrontier: ``ts`` is not a time.
            UpperMismatch: the shard's upper is beyond ``ts`` (the past cannot change;
                nothing was written).
        """
        schema = self._require_schema("upsert")
        rows = schema.encode(table, with_times=False)
        keys = rows.column("k")
        if pc.count_distinct(keys).as_py() != rows.num_rows:
            raise InvalidUpdates("upsert: a key appears more than once in the table (which "
                                 "value would win is undefined)")
        return self._replace_keys(keys, rows, ts, "upsert")

    def delete(self, keys: object, ts: int | None = None) -> WriteResult:
        """Remove the rows of ``keys`` (a table of the key columns) at ``ts``; keys
        without rows are ignored. Atomic and retried like :meth:`upsert`."""
        schema = self._require_schema("delete")
        return self._replace_keys(schema.encode_keys(keys), None, ts, "delete")

    def _require_schema(self, what: str) -> ShardSchema:
        self._check_open()
        if self.schema is None:
            raise SchemaMismatch(f"{what} needs a typed shard (open the writer with a "
                                 f"ShardSchema); shard {self.shard_id} is untyped")
        return self.schema

    def _encode_contents(self, table: object) -> pa.Table:
        """``table`` encoded as the shard's whole contents (see :meth:`replace_contents`)."""
        return encode_contents(self._require_schema("replace_contents"), table)

    def _replace_encoded(self, rows: pa.Table) -> WriteResult:
        """:meth:`replace_contents` of rows :func:`encode_contents` encoded with this
        handle's schema."""
        self._check_open()
        return self._replace_keys(None, rows, None, "replace_contents")

    def replace_contents(self, table: object, ts: int | None = None) -> WriteResult:
        """Make the shard hold exactly the rows of ``table`` at ``ts`` (typed shards).

        One compare-and-set append retracts every row no longer in ``table`` and adds
        every row not yet in the shard; rows in both are left alone. With value columns,
        each key may appear once (a key's row is replaced, absent keys are deleted);
        without, the whole row is the key and equal rows keep their multiplicity (a
        collection, like a SQL table). Retried like :meth:`upsert`: the shard always
        equals one whole ``table``, never a mix of two writers'.

        Raises:
            SchemaMismatch: an untyped shard, or the table does not fit the schema.
            InvalidUpdates: a key appears twice (with value columns).
            UpperMismatch: the shard's upper is beyond ``ts``.
        """
        return self._replace_keys(None, self._encode_contents(table), ts, "replace_contents")

    def _replace_keys(self, keys: pa.ChunkedArray | pa.Array | None, rows: pa.Table | None,
                      ts: int | None, what: str) -> WriteResult:
        """The one loop that makes the shard equal what it is asked: the rows of ``keys``
        (None: of every key) become ``rows``, in one append at the upper it read, read
        again and retried when another write lands first."""
        wanted = None if ts is None else check_frontier(ts, "ts")
        sorted_keys = None if keys is None else sorted(set(keys.to_pylist()))
        machine = self._machine
        clock = machine.clock
        deadline = clock.monotonic() + machine.config.retry_deadline_s
        missing_parts = 0
        expected: Frontier = 0
        for attempt in itertools.count():
            if attempt:
                # Lost a race: back off a random while, so that upserters of hot keys
                # do not keep invalidating each other's reads.
                ceiling = min(_REPLACE_BACKOFF_MAX_S, 0.001 * 2 ** min(attempt, 10))
                clock.sleep(self._jitter.uniform(0, ceiling))
                if clock.monotonic() > deadline:
                    current_upper = machine.fetch_latest().upper
                    raise UpperMismatch(expected, current_upper, shard=self.shard_id)
            state = machine.fetch_latest()
            expected = state.upper if state.upper is not None else 0
            try:
                data, time, encoding = self._replacement(state, sorted_keys, rows, wanted,
                                                         what)
            except CorruptPart:
                # A part collected after compaction replaced it: read a newer state.
                missing_parts += 1
                if missing_parts < _MISSING_PART_RETRIES and \
                        machine.fetch_latest().seqno > state.seqno:
                    continue
                raise
            try:
                result = self._compare_and_append(data, expected, time + 1, None, encoding)
            except UpperMismatch:
                continue  # another write landed: read the keys again
            return with_row_counts(result, data)
        raise AssertionError("unreachable")

    def _replacement(self, state: State, sorted_keys: list[bytes] | None,
                     rows: pa.Table | None, wanted: Frontier, what: str
                     ) -> tuple[Updates, int, Encoding]:
        """The updates that make ``state``'s rows of ``sorted_keys`` (None: of every
        key) equal ``rows``, at ``wanted`` (None: the state's upper); with that time and
        the encoding they carry (the state's schema).

        Raises:
            InvalidFrontier: the shard is closed. UpperMismatch: ``wanted`` is below the
                upper. CorruptPart: a part was collected (read a newer state).
        """
        expected = state.upper
        if expected is None:
            raise InvalidFrontier(f"{what}: shard {self.shard_id} is closed")
        time = expected if wanted is None else wanted
        if time < expected:
            raise UpperMismatch(time, expected, shard=self.shard_id)
        if time >= MAX_TIME:
            # Its new upper would be time + 1, past the largest time: not a frontier.
            raise InvalidFrontier(
                f"{what} at time {time}: its new upper would be past the largest time "
                f"{MAX_TIME}; to write at the largest time, close the shard with "
                f"compare_and_append(updates, upper, None)")
        encoding = self._attempt_encoding(state)
        current = (current_rows(self._machine.blobs, state, sorted_keys)
                   if sorted_keys is not None else self._contents(state))
        retract = current.set_column(2, "t", pa.array([time] * current.num_rows, pa.int64()))
        try:
            negated = pc.negate_checked(current.column("d"))
        except pa.ArrowInvalid:
            # -2**63 has no negation in 64 bits: refused like any write whose sums leave
            # them (diffs never wrap).
            raise InvalidUpdates(f"{what}: a row it would retract has the diff -2**63, "
                                 f"whose retraction does not fit in 64 bits; nothing was "
                                 f"written") from None
        retract = retract.set_column(3, "d", negated)
        pieces = [retract.cast(SCHEMA)]
        if rows is not None:
            pieces.append(rows.set_column(2, "t", pa.array([time] * rows.num_rows,
                                                           pa.int64())).cast(SCHEMA))
        return Updates.coerce(pa.concat_tables(pieces)), time, encoding

    def _contents(self, state: State) -> pa.Table:
        """Every row of ``state`` (k/v/t/d, consolidated over all times).

        Every update counts, whatever its time: compaction advances times to the since,
        which readers may have moved up to the upper or past it, so a read at
        ``upper - 1`` would miss rows that are still there, and a replacement computed
        from it would store them twice."""
        from persist_pipeline.read import stream_snapshot

        if not state.upper:
            return empty_table()
        tables = list(stream_snapshot(self._machine, list(state.ordered_batches), MAX_TIME))
        return pa.concat_tables(tables) if tables else empty_table()

    def _attempt_encoding(self, state: State) -> Encoding:
        """How an upsert or delete attempt against ``state`` writes its batch: the rows
        it retracts carry the state's schema (perhaps evolved since this handle opened),
        so its parts are written and committed with that schema, never this handle's.
        A table writer writes with its own schema, recorded by the commit itself when
        ``state`` does not record it yet.

        Raises:
            SchemaMismatch: the table writer's schema no longer is what ``state`` would
                record (another store evolved it otherwise or further); nothing is
                written.
        """
        wanted = self._table_schema
        if wanted is None:
            return Encoding.recorded_in(state)
        recorded, target = transitions.record_schema(state, wanted, 0)
        if target != wanted:
            # Another store evolved the shard past this table's schema since this
            # handle opened: its table would load with the other store's columns.
            raise SchemaMismatch(f"shard {self.shard_id}'s schema became {target!r} after "
                                 f"this writer opened for {wanted!r}; nothing was written")
        if recorded is state:
            return Encoding(target, state.schema, exact=True)
        return Encoding(target, target.to_bytes(), record=target, exact=True)

    def _coerce(self, updates: object) -> Updates:
        """Validated, consolidated updates: typed tables encoded for a typed shard."""
        if self.schema is None:
            return Updates.coerce(updates)
        if isinstance(updates, Updates):
            # Already encoded: committed only if they really are rows of this schema.
            try:
                self.schema.decode(updates.table(), f"a write to shard {self.shard_id}")
            except CorruptPart as e:
                raise SchemaMismatch(f"the encoded updates are not rows of the shard's "
                                     f"schema {self.schema!r}: {e}") from None
            return updates
        return self.schema.to_updates(updates)

    def _commit(self, data: Updates, expected: int, upper: Frontier, token: str,
                encoding: Encoding) -> WriteResult:
        staged = self._stage(data, expected, upper, token, encoding)
        try:
            result = self._apply(staged)
            if result is None:
                # The shard's inline budget is full: this write falls through to blob.
                staged = self._stage(data, expected, upper, token, encoding, to_blob=True)
                result = self._apply(staged)
                assert result is not None  # blob batches never exceed the inline budget
            if result.already_committed:
                self._drop_superseded(staged)
            return result
        except (*CERTAINLY_NOT_COMMITTED, LeaseExpired):
            # The CaS loop settles every lost reply before it answers "no" (a handle
            # expired while its write waited is such an answer: see _transition), and
            # these parts are this attempt's own fresh keys. Indeterminate (and any
            # other error) leaves the parts to GC.
            self._delete_uncommitted(staged.parts)
            raise

    def _stage(self, data: Updates, expected: int, upper: Frontier, token: str,
               encoding: Encoding, *, to_blob: bool = False) -> Staged:
        """The batch a write commits: inline when it is a candidate (and ``to_blob`` is
        not set, as after the shard's inline budget turned it away), else Parquet parts
        uploaded now."""
        batch_id = batch_id_of(token)
        desc_since = self._machine.state.since
        desc = Description(expected, upper, desc_since if desc_since is not None else 0)
        n = len(data)
        if n == 0:
            return Staged(self, None, expected, upper, token, encoding, "none", 0, 0)
        inline_size = data.estimated_inline_size()
        threshold = self.policy.threshold_bytes
        if not to_blob and threshold and inline_size < 4 * threshold:
            encoded_inline = data.encode_inline()
            inline_size = len(encoded_inline)
            if self.policy.is_candidate(inline_size):
                inline = Batch(batch_id, desc, (InlinePart(token, encoded_inline, n),), n)
                return Staged(self, inline, expected, upper, token, encoding, "inline",
                              inline_size, 0, inline_size=inline_size)
        machine = self._machine
        started_s = machine.monotonic()
        # Typed columns are decoded with the schema the rows were encoded with, never
        # with an older one this handle may hold (it would misread newer rows).
        parts = write_parts(data.table(), self.shard_id, batch_id,
                            machine.blobs.store(self._store), self._store,
                            machine.config.blob_target_size_bytes, schema=encoding.schema)
        placement: Placement = "wal" if self._store == "wal" else "blob"
        return Staged(self, Batch(batch_id, desc, parts, len(data)), expected, upper, token,
                      encoding, placement, sum(p.encoded_size for p in parts), len(parts),
                      fell_back=to_blob, upload_started_s=started_s, inline_size=inline_size)

    def _drop_superseded(self, staged: Staged) -> None:
        """Delete the parts of ``staged``, a write found already committed, when the
        batch that committed is another attempt's (a retry uploads fresh keys before its
        commit finds its batch there): the shard's state holds the batch with none of
        these parts. A batch id lands once and a batch's parts never change, so no
        version references them. Found only in history or by its writer's record, the
        batch may be this very attempt's (merged away since): its parts are left to GC.
        """
        parts = staged.parts
        if not parts or staged.batch is None:
            return
        landed = self._machine.state.batches.get(staged.batch.id)
        if landed is None or landed.desc.lower != staged.expected:
            return
        if {p.key for p in landed.hollow_parts()}.isdisjoint(p.key for p in parts):
            self._delete_uncommitted(parts)

    def _delete_uncommitted(self, parts: tuple[HollowPart, ...]) -> None:
        for part in parts:
            try:
                self._machine.blobs.store(part.store).delete(part.key)
            except PersistError as e:  # GC's orphan sweep gets it later
                log.warning("could not delete uncommitted part %s: %s", part.key, e)

    def _transition(self, staged: Staged) -> Callable[[State], tuple[State,
                                                                     transitions.AppendResult]]:
        """The append transition of ``staged``: what this handle's commit (and a
        transaction holding it) runs against the shard's latest state."""
        machine = self._machine
        policy = self.policy
        # A process with inlining off records no max on a shard that has none (its
        # max bounds none of its own writes).
        records = policy.threshold_bytes > 0
        lease = self._lease_ms()
        deadline_from = staged.upload_started_s

        def transition(state: State) -> tuple[State, transitions.AppendResult]:
            new, result = transitions.compare_and_append(
                state, staged.batch, writer_id=self.writer_id, token=staged.token,
                expected_upper=staged.expected, new_upper=staged.upper,
                now_ms=machine.now_ms(), lease_ms=lease, inline_max_bytes=policy.max_bytes,
                fell_back=staged.fell_back, records_inline_max=records,
                commit_deadline=None if deadline_from is None
                else machine.commit_deadline(deadline_from),
                encoded_with=staged.encoding.recorded, record=staged.encoding.record,
                exact=staged.encoding.exact)
            # Asked on every attempt, as a heartbeat asks: expire() closes the handle
            # before its own commit, so a write still waiting (queued in the funnel
            # behind another group, or re-run after a lost race) once it is closed is
            # refused as it would be at its start, changing nothing, instead of
            # committing and registering the expired writer again. A write found
            # already committed (an earlier attempt landed before the expiry) is
            # still reported so.
            if self._closed and not already_appended(result):
                raise LeaseExpired(f"writer {self.writer_id} was expired")
            return new, result

        return transition

    def _apply(self, staged: Staged) -> WriteResult | None:
        """Commit ``staged`` alone; None when the shard's inline budget turned it away."""
        machine = self._machine
        try:
            if staged.created:
                # Alone, not through the funnel: the records travel in its CaS.
                applied = apply_many([Step(machine, self._transition(staged))],
                                     proves_done=already_appended, created=staged.created)
                result, state = applied.results[0], applied.states[0]
            elif self._funnel is not None:
                size = staged.encoded if staged.placement == "inline" else 0
                result, state = self._funnel.commit(machine, self._transition(staged),
                                                    already_appended, size)
            else:
                result, state = machine.apply(self._transition(staged),
                                              proves_done=already_appended)
        except Indeterminate as e:
            # The record that would settle a lost reply may be gone (GC truncated it,
            # perhaps after expiring this writer and its token); the batch's id may
            # still be found in the state's kept history.
            history.settle_lost_reply([staged.attempt], e)
            result, state = transitions.Appended(already_committed=True), machine.state
        return self._finish(staged, result, state)

    def _finish(self, staged: Staged, result: transitions.AppendResult,
                state: State) -> WriteResult | None:
        """The :class:`WriteResult` of a committed ``staged``, the typed error of a
        refused one, or None when the shard's inline budget turned it away."""
        if isinstance(result, transitions.SchemaChanged):
            raise SchemaMismatch(_schema_changed(self.shard_id, result.recorded,
                                                 staged.encoding))
        if isinstance(result, transitions.TokenReusedResult):
            raise history.token_reused(self.shard_id,
                                       staged.batch.id if staged.batch is not None else None,
                                       result.lower, result.upper, staged.expected)
        if isinstance(result, transitions.DeadlineExceeded):
            raise CommitDeadlineExceeded(
                f"shard {self.shard_id}: parts uploaded too long ago to commit safely (GC "
                f"may sweep them); nothing was written")
        if isinstance(result, transitions.UpperMismatchResult):
            self._upper = result.current
            raise UpperMismatch(staged.expected, result.current, shard=self.shard_id)
        if isinstance(result, transitions.InlineBudgetExceeded):
            return None
        self._upper = state.upper
        n = staged.batch.num_updates if staged.batch is not None else 0
        return WriteResult(staged.placement, staged.encoded, state.seqno, state.upper, n,
                           staged.num_parts, fell_back=staged.fell_back,
                           already_committed=result.already_committed,
                           inline_size=staged.inline_size)

    def _check_open(self) -> None:
        if self._closed:
            raise LeaseExpired(f"writer {self.writer_id} was expired")

    def expire(self) -> None:
        """Unregister this writer. The handle cannot write afterwards. Idempotent."""
        if self._released:
            return
        self._closed = True
        self._heartbeat.stop()
        machine = self._machine
        # Only a committed expiry is done: after a failure (consensus away, an
        # indeterminate commit) a retry expires again, rather than leaving the writer's
        # entry in the state until its lease runs out.
        machine.apply(lambda s: transitions.expire_writer(s, self.writer_id, machine.now_ms()))
        self._released = True

    close = expire

    def stop_heartbeats(self) -> None:
        """Stop the background heartbeat without expiring (the client is closing)."""
        self._heartbeat.stop()

    def __enter__(self) -> WriteHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.expire()


def _schema_changed(shard_id: str, recorded: bytes, encoding: Encoding) -> str:
    shard = (f"shard {shard_id} is typed ({ShardSchema.from_bytes(recorded)!r})" if recorded
             else f"shard {shard_id} is untyped")
    written = (f"encoded with {encoding.schema!r}" if encoding.schema is not None
               else "untyped")
    return (f"{shard} but this write's updates are {written}: its schema was recorded or "
            f"changed after the write was planned (reopen the writer, or plan the write "
            f"again); nothing was written")


def encode_contents(schema: ShardSchema, table: object) -> pa.Table:
    """``table`` encoded as a typed shard's whole contents: k/v rows (no times).

    Raises:
        SchemaMismatch: the table does not fit ``schema``.
        InvalidUpdates: a key appears twice (with value columns).
    """
    rows = schema.encode(table, with_times=False)
    if len(schema.value) and pc.count_distinct(rows.column("k")).as_py() != rows.num_rows:
        raise InvalidUpdates("replace_contents: a key appears more than once in the "
                             "table (which value would win is undefined)")
    return rows


def with_row_counts(result: WriteResult, data: Updates) -> WriteResult:
    """``result`` with the rows its updates added and retracted (sums of the positive
    and the negative diffs).

    Summed exactly: a replacement retracts rows with the counts other writers left on
    them (any 64-bit count), whose totals may leave 64 bits, where an int64 sum would
    wrap into a wrong number (diffs never wrap, counts of rows neither)."""
    diffs = numpy_values(data.table().column("d"))
    return replace(result, rows_added=_exact_total(diffs[diffs > 0]),
                   rows_retracted=-_exact_total(diffs[diffs < 0]))


def _exact_total(diffs: np.ndarray) -> int:
    """The sum of ``diffs``, exact (a Python int, also beyond 64 bits)."""
    if not len(diffs):
        return 0
    sums, beyond = exact_segment_sums(diffs, np.zeros(1, np.int64))
    return beyond[0][1] if beyond else int(sums[0])


def _fences_commits_at(refused: PersistError, expected: int) -> bool:
    """Whether a refusal of a parts commit at ``expected`` means no commit of the same
    parts can land any more (so they may be deleted). A deadline refusal changes no
    state, so it fences nothing; nor does an upper still below ``expected`` (a gap):
    once another write fills it, a commit at ``expected`` lands. An upper past
    ``expected`` (or closed) never comes back, nor does a recorded schema."""
    if isinstance(refused, CommitDeadlineExceeded):
        return False
    if isinstance(refused, UpperMismatch):
        current = refused.current
        return current is None or not less_than(current, expected)
    return True


def already_appended(result: transitions.AppendResult) -> bool:
    """Whether an append result that changed nothing found the write's own batch."""
    return isinstance(result, transitions.Appended) and result.already_committed


def check_append_bounds(expected_upper: object, new_upper: object, *,
                        names: tuple[str, str] = ("expected_upper", "new_upper")
                        ) -> tuple[int, Frontier]:
    """An append's ``(expected_upper, new_upper)``, checked: the one bounds check of
    every write entry point (handles, parts commits, transactions, Spark options, the
    CLI), so that they refuse alike. ``names`` are the arguments' names in messages
    (``append`` calls them lower and upper).

    Raises:
        InvalidFrontier: either is not a frontier, expected_upper is closed, or new_upper
            is not beyond it.
    """
    if type(expected_upper) is int and type(new_upper) is int \
            and 0 <= expected_upper < new_upper <= MAX_TIME:
        # The usual append, decided without the checks that explain a refusal (every
        # input that takes the checks below refuses or accepts as before).
        return expected_upper, new_upper
    lower_name, upper_name = names
    expected = check_frontier(expected_upper, lower_name)
    if expected is None:
        raise InvalidFrontier(f"{lower_name} must be a time: a closed shard takes no writes")
    upper = check_frontier(new_upper, upper_name)
    if not less_than(expected, upper):
        raise InvalidFrontier(f"{upper_name} ({upper}) must be beyond {lower_name} "
                              f"({expected})")
    return expected, upper


def check_new_shard_bounds(expected: int, shard: str) -> None:
    """Refuses an append to a shard that does not exist yet unless it expects upper 0.

    A new shard starts at upper 0, so its first commit at any other expected upper is
    refused; every entry point that creates a shard on the way to that commit (the CLI's
    ``append --create``, transactions, Spark writes) asks here first, so that a write
    bound to be refused registers no name and creates no shard.

    Raises:
        UpperMismatch: ``expected`` is not 0 (its ``current`` is 0, ``shard`` as given).
    """
    if expected != 0:
        raise UpperMismatch(expected, 0, shard=shard)


def check_times(data: Updates, lower: int, upper: Frontier) -> None:
    bounds = data.time_bounds()
    if bounds is None:
        return
    lo, hi = bounds
    if lo < lower or not less_equal(hi + 1, upper):
        raise InvalidUpdates(f"update times must lie in [{lower}, {upper}); got times "
                             f"{lo}..{hi}")
