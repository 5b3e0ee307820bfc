"""Atomic writes to several shards: one consensus round trip, all or nothing.

``client.transaction()`` collects appends to distinct shards and commits them with ONE
multi-shard compare-and-set (:meth:`Consensus.compare_and_set_many`): on SQL one
statement, so a reader of any of the shards sees every append of the transaction or
none, and a process that dies before the commit leaves no shard changed. Blob parts are
uploaded before that round trip; inline batches travel in it.

    with client.transaction() as txn:
        txn.compare_and_append(orders, order_rows, 10, 11)
        txn.compare_and_append(order_lines, line_rows, 10, 11)
    # committed here; an exception inside the block commits nothing
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from persist_pipeline import write as write_module
from persist_pipeline.consensus.base import CasWrite
from persist_pipeline.exceptions import (
    CorruptPart,
    CorruptState,
    Indeterminate,
    InvalidInput,
    LeaseExpired,
    PersistError,
    SchemaMismatch,
    ShardNotFound,
    UntypedUpdates,
    UpperMismatch,
)
from persist_pipeline.frontier import Frontier, less_than
from persist_pipeline.ids import ShardId, check_token, new_token
from persist_pipeline.internal import history, transitions
from persist_pipeline.internal.machine import RecordTaken, Step, apply_many, create_all
from persist_pipeline.names import name_record, refuse_new_generation_name, registry_key
from persist_pipeline.updates import Updates
from persist_pipeline.write import (
    _MISSING_PART_RETRIES,
    CERTAINLY_NOT_COMMITTED,
    Encoding,
    Staged,
    WriteHandle,
    WriteResult,
    check_append_bounds,
    check_new_shard_bounds,
    check_times,
    with_row_counts,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from persist_pipeline.internal.state import State

if TYPE_CHECKING:
    from persist_pipeline.client import PersistClient, ShardLike

log = logging.getLogger(__name__)

#: The refusals of an append retried with its caller's token that its batch's history
#: settles, as :data:`~persist_pipeline.write.RETRY_REFUSALS` for a single write: the
#: deadline and the schema are checked before the upper, so a retry paused past it (or
#: met by a schema recorded since) after compaction merged the batch away sees only that.
_RETRY_REFUSED = (transitions.UpperMismatchResult, transitions.DeadlineExceeded,
                  transitions.SchemaChanged)


@dataclass
class _Op:
    """One shard's append in a transaction. ``lower`` is set for :meth:`Transaction.append`
    (which cuts away what identical writers already wrote), None for compare_and_append.
    ``contents`` is set for :meth:`Transaction.replace_contents`: its updates are planned
    against the shard's latest state at commit, and planned again if it moves.
    ``writer`` is None until the commit for a shard that did not exist when added (see
    :meth:`Transaction._open_new_shards`)."""

    writer: WriteHandle | None
    data: Updates
    expected: int
    upper: Frontier
    lower: int | None
    token: str
    staged: Staged | None = None
    #: Its outcome once known: committed, or left out (an append already written).
    result: WriteResult | None = None
    contents: pa.Table | None = None
    encoding: Encoding | None = None
    #: The caller named the token (a retry of an attempt whose outcome it never
    #: learnt): an upper mismatch is then settled by the batch's id in history.
    given_token: bool = False
    #: Added for a shard that did not exist, from untyped input (tuples, a k/v table),
    #: not rows already encoded: refused if another client types the shard first.
    untyped: bool = False
    #: For a replace: called after each read of the shard's state it plans against
    #: (the first and every one after the shard moved), before it commits; raises to
    #: refuse the transaction (a table store's check that the shard is still the
    #: newest generation of its table).
    check: Callable[[], None] | None = None

    @property
    def handle(self) -> WriteHandle:
        """The shard's writer (opened by the commit's first step for a new shard)."""
        assert self.writer is not None, "a new shard's writer is opened at commit"
        return self.writer

    def plan(self) -> None:
        """For a replace: the updates that make the shard's latest state hold
        ``contents``, at its upper (retried on a collected part, as a handle does)."""
        assert self.contents is not None
        machine = self.handle._machine
        for attempt in range(_MISSING_PART_RETRIES):
            state = machine.fetch_latest()
            try:
                self.data, time, self.encoding = self.handle._replacement(
                    state, None, self.contents, None, "replace_contents")
            except CorruptPart:
                if attempt + 1 == _MISSING_PART_RETRIES or \
                        machine.fetch_latest().seqno <= state.seqno:
                    raise
                continue
            if self.check is not None:
                self.check()
            self.expected, self.upper, self.token = time, time + 1, new_token()
            return


class Transaction:
    """Appends to several shards, committed atomically by :meth:`commit`.

    Obtain one with :meth:`PersistClient.transaction`. Each shard may appear once. The
    shards are given as write handles of the same client (the fast way: nothing is
    registered per transaction) or as shard ids or names (a writer is opened for the
    transaction and expired after it). Not thread-safe: one thread builds and commits
    a transaction.
    """

    def __init__(self, client: PersistClient) -> None:
        self._client = client
        self._ops: dict[str, _Op] = {}
        self._opened: list[WriteHandle] = []
        self._finished = False
        #: Names given for shards that did not exist, and the fresh shard id each was
        #: given: registered only when the transaction commits (names are never deleted,
        #: so a transaction refused or aborted before then must leave none behind).
        self._new_names: dict[str, str] = {}

    def compare_and_append(self, shard: WriteHandle | ShardLike, updates: object,
                           expected_upper: int, new_upper: Frontier, *,
                           idempotency_token: str | None = None) -> None:
        """Add an append of ``updates`` to ``shard`` iff its upper is ``expected_upper``
        at commit; it then advances to ``new_upper``. Arguments and validation are those
        of :meth:`WriteHandle.compare_and_append`; bad input raises here and leaves the
        transaction as it was (a name given for a shard that does not exist yet is
        registered in the commit's own compare-and-set: an abort, or a commit refused,
        leaves no name behind; an
        ``expected_upper`` other than 0, the upper its new shard starts at, is refused
        here with ``UpperMismatch``).
        ``idempotency_token`` names the shard's batch, so a
        process that recorded it before committing can ask
        :meth:`WriteHandle.committed` afterwards (default: a fresh token); it is 1-128
        characters ``[A-Za-z0-9_-]``.

        Raises:
            InvalidInput: the shard is already in this transaction, the handle belongs
                to another client, the transaction has finished, or the
                ``idempotency_token`` is malformed.
            InvalidUpdates / InvalidFrontier / SchemaMismatch: bad updates or uppers.
        """
        if idempotency_token is not None:
            check_token(idempotency_token)
        expected, upper = check_append_bounds(expected_upper, new_upper)
        self._add(shard, updates, expected, upper, lower=None, token=idempotency_token)

    def append(self, shard: WriteHandle | ShardLike, updates: object, lower: int,
               upper: Frontier) -> None:
        """Add a persist ``append`` (see :meth:`WriteHandle.append`): at commit, updates
        below the shard's upper are cut away if it is inside ``(lower, upper)``, and the
        shard is left out if its upper is already at or past ``upper``.

        Raises:
            as :meth:`compare_and_append`.
        """
        lo, hi = check_append_bounds(lower, upper, names=("lower", "upper"))
        self._add(shard, updates, lo, hi, lower=lo)

    def replace_contents(self, shard: WriteHandle | ShardLike, table: object) -> None:
        """Add a :meth:`WriteHandle.replace_contents` of a typed shard: at commit it
        holds exactly the rows of ``table``, at its upper then. If another write lands
        on it first, its rows are read again and the whole transaction retried (until
        ``retry_deadline_s``), so every shard of the transaction is replaced together.

        Raises:
            SchemaMismatch: an untyped shard, or the table does not fit its schema.
            InvalidUpdates: a key appears twice (with value columns).
            InvalidInput: as :meth:`compare_and_append`.
            InvalidFrontier (at commit): the shard is closed, also when it was closed
                while the transaction committed; no shard changed.
        """
        self._check_open()
        if self._is_new(shard):
            # A shard created here would be untyped: refused before its name is
            # registered or the shard created (bad input changes nothing).
            raise SchemaMismatch(f"replace_contents needs a typed shard; {shard} does not "
                                 f"exist yet (a new shard is untyped): create it with "
                                 f"open_writer(..., schema=ShardSchema(...)) first")
        shard_id = self._shard_id(shard)
        self._require_absent(shard_id)
        handle = self._handle(shard, shard_id)
        self._replace_encoded(handle, handle._encode_contents(table))

    def _replace_encoded(self, handle: WriteHandle, contents: pa.Table,
                         check: Callable[[], None] | None = None) -> None:
        """:meth:`replace_contents` of rows already encoded with ``handle``'s schema;
        ``check`` (see :class:`_Op`) runs after each read of the shard it plans on."""
        self._check_open()
        self._require_absent(handle.shard_id)
        self._ops[handle.shard_id] = _Op(handle, Updates.coerce([]), 0, 1, None, new_token(),
                                  contents=contents, check=check)

    def _add(self, shard: WriteHandle | ShardLike, updates: object, expected: int,
             upper: Frontier, lower: int | None, token: str | None = None) -> None:
        """Add an append whose bounds :func:`check_append_bounds` checked."""
        self._check_open()
        handle: WriteHandle | None = None
        if self._is_new(shard):
            # The untyped updates of the shard it will be. Neither its name nor the shard
            # exists until the commit (see _open_new_shards): a transaction refused
            # before then, or aborted, leaves nothing behind.
            data = Updates.coerce(updates)
            check_times(data, expected, upper)
            if isinstance(shard, str) and not _looks_like_id(shard):
                # A new name's shard is a fresh id no other client knows: refused here,
                # before the commit registers the name for good.
                check_new_shard_bounds(expected, shard)
            shard_id = self._shard_id(shard)
            self._require_absent(shard_id)
        else:
            shard_id = self._shard_id(shard)
            self._require_absent(shard_id)
            handle = self._handle(shard, shard_id)
            data = handle._coerce(updates)
        check_times(data, expected, upper)
        self._ops[shard_id] = _Op(handle, data, expected, upper, lower,
                                  new_token() if token is None else token,
                                  given_token=token is not None,
                                  untyped=handle is None and not isinstance(updates, Updates))

    def _require_absent(self, shard_id: str) -> None:
        if shard_id in self._ops:
            raise InvalidInput(f"shard {shard_id} appears twice in one transaction; put all "
                               f"of its updates in one append")

    def _shard_id(self, shard: WriteHandle | ShardLike) -> str:
        if isinstance(shard, WriteHandle):
            if shard._machine is not self._client._machine(shard.shard_id):
                raise InvalidInput(f"the writer of shard {shard.shard_id} belongs to another "
                                   f"client: a transaction commits through one client")
            return shard.shard_id
        if isinstance(shard, str) and not _looks_like_id(shard):
            if shard in self._new_names:
                return self._new_names[shard]
            registry = self._client.name_registry
            found = registry.lookup(shard)
            if found is not None:
                return str(found)
            # Refused now if it may never be registered; registered at commit.
            refuse_new_generation_name(registry, shard)
            self._new_names[shard] = str(ShardId.new())
            return self._new_names[shard]
        return str(ShardId.parse(shard))

    def _is_new(self, shard: WriteHandle | ShardLike) -> bool:
        """Whether ``shard`` (a name or an id) names no shard yet: adding an append to it
        would register the name and create the shard (a handle's shard exists)."""
        if isinstance(shard, WriteHandle):
            return False
        if isinstance(shard, str) and not _looks_like_id(shard):
            found = self._client.name_registry.lookup(shard)
            if found is None:
                return True
            shard = found
        try:
            self._client._machine(shard).fetch_latest()
        except ShardNotFound:
            return True
        return False

    def _handle(self, shard: WriteHandle | ShardLike, shard_id: str) -> WriteHandle:
        if isinstance(shard, WriteHandle):
            shard._check_open()
            return shard
        handle = self._client.open_writer(shard_id, debug="transaction")
        self._opened.append(handle)
        return handle

    def _check_open(self) -> None:
        if self._finished:
            raise InvalidInput("this transaction has already been committed or aborted")

    @property
    def shards(self) -> list[str]:
        """The ids of the shards this transaction appends to, in the order added."""
        return list(self._ops)

    def commit(self) -> dict[str, WriteResult]:
        """Commit every append at once, or none.

        Returns:
            Each shard id's :class:`WriteResult`. All of them share one consensus
            round trip; their ``seqno`` is each shard's own.

        Raises:
            UpperMismatch: a shard's upper was not the expected one (``.shard`` names
                it), or another client registered one of its new names meanwhile
                (``.shard`` is the name); no shard changed (but see below).
            SchemaMismatch / CommitDeadlineExceeded: as for a single write; no shard
                changed (but see below).
            Indeterminate: a lost reply whose outcome cannot be told; read the shards
                (every shard or none has its batch). Uploaded parts are left for GC.
            InvalidInput: the transaction is empty or already finished.
            LeaseExpired: a writer handle given was expired since; no shard changed
                (but see below); the parts it uploaded are deleted.

        Shards added before they existed are created all together or none, after the
        checks that may refuse the commit; one refused after that (by its
        compare-and-set, or a handle expired meanwhile) leaves them empty and unnamed
        (docs/design.md, Transactions).
        """
        self._check_open()
        if not self._ops:
            raise InvalidInput("an empty transaction: add at least one append before commit")
        self._finished = True
        try:
            for op in self._ops.values():
                # A handle expired after its append was added writes nothing more, here
                # as through its own compare_and_append: no shard changes, and none is
                # created (checked before the new shards are).
                if op.writer is not None:
                    op.writer._check_open()
            self._open_new_shards()
            return self._commit()
        finally:
            self._expire_opened()

    def abort(self) -> None:
        """Drop the transaction without committing anything. Idempotent."""
        if not self._finished:
            self._finished = True
            self._expire_opened()

    def _commit(self) -> dict[str, WriteResult]:
        ops = list(self._ops.values())
        clock = self._client.clock
        registry = self._client.name_registry
        created = [CasWrite(key, None, record) for key, record in (
            name_record(name, ShardId.parse(shard_id))
            for name, shard_id in self._new_names.items())]
        deadline = clock.monotonic() + self._client.config.retry_deadline_s
        try:
            for attempt in itertools.count():
                if attempt and any(op.contents is not None and op.staged is None for op in ops):
                    # A replaced shard moved: back off a random while before reading it
                    # again, so that two replacing transactions do not keep colliding.
                    clock.sleep(random.uniform(0, min(0.1, 0.001 * 2 ** min(attempt, 10))))  # noqa: S311
                live = [op for op in ops if op.result is None]
                self._stage_all(live, ops)
                if not live:
                    return self._results(ops)
                staged = [op.staged for op in live if op.staged is not None]
                steps = [Step(s.handle._machine, s.handle._transition(s)) for s in staged]
                try:
                    # New names are created in the same compare-and-set as the appends:
                    # registered exactly when the transaction commits.
                    applied = apply_many(steps, proves_done=write_module.already_appended,
                                         created=created)
                    committed, results = applied.committed, applied.results
                    states = applied.states
                except RecordTaken as e:
                    raise self._name_taken(e.key) from None
                except Indeterminate as e:
                    # Every shard or none has its batch: any one found in its shard's
                    # kept history tells the transaction committed.
                    history.settle_lost_reply([s.attempt for s in staged], e)
                    results = [transitions.Appended(already_committed=True)] * len(staged)
                    committed, states = True, [s.handle._machine.state for s in staged]
                if not committed:
                    if self._retry_refused(live, results, clock.monotonic() < deadline):
                        continue
                    _raise_refusal(staged, results, states)
                for name, shard_id in self._new_names.items():
                    registry._remember(name, ShardId.parse(shard_id))
                for op, s, result, state in zip(live, staged, results, states, strict=True):
                    op.result = s.handle._finish(s, result, state)
                    if op.result is not None and op.result.already_committed:
                        s.handle._drop_superseded(s)
                    if op.contents is not None and op.result is not None:
                        op.result = with_row_counts(op.result, op.data)
                return self._results(ops)
            raise AssertionError("unreachable")
        except (*CERTAINLY_NOT_COMMITTED, LeaseExpired):
            # A handle expired as the commit ran is refused by its append transition
            # only once every lost reply is settled (as a single write's is): nothing
            # landed, and the parts are this commit's own fresh keys.
            for op in ops:
                if op.staged is not None:
                    op.handle._delete_uncommitted(op.staged.parts)
            raise

    def _open_new_shards(self) -> None:
        """Create the shards added before they existed, and open their writers: the
        commit's first step, before any part is uploaded (so GC's orphan sweep of the
        shard finds the parts of a commit that never lands).

        All or none of them: they are created together in one compare-and-set, and only
        after what may refuse the transaction here was checked, so a refusal at this
        step leaves no shard of it behind. A new name another client registered
        meanwhile refuses the commit before anything is created (as the commit's own
        compare-and-set would refuse it, after creating the shards). A shard given by
        id that another client created meanwhile is opened as an existing one: its
        untyped updates are refused if it records a schema, whatever their bytes (as a
        writer opened on it refuses them); when another client creates one between
        that check and the creation, the creation lands nowhere and the shards are
        checked again.

        Raises:
            SchemaMismatch: a shard was typed meanwhile (``UntypedUpdates``: its
                updates were untyped); no shard of the transaction was created or
                changed.
            UpperMismatch: another client registered one of the new names meanwhile
                (``.shard`` is the name); no shard was created.
        """
        client = self._client
        while True:
            pending = [shard_id for shard_id, op in self._ops.items() if op.writer is None]
            if not pending:
                return
            for name in self._new_names:
                if client.name_registry.lookup(name) is not None:
                    raise self._name_taken(registry_key(name))
            absent: list[str] = []
            for shard_id in pending:
                if client.consensus.head(shard_id) is None:
                    absent.append(shard_id)
                else:
                    self._open_new(shard_id)  # created by another client meanwhile
            if absent:
                self._refuse_stale_uppers()
            if absent and not create_all([client._machine(s) for s in absent]):
                continue  # another client created one of them first: check it as such
            for shard_id in absent:
                self._open_new(shard_id)

    def _refuse_stale_uppers(self) -> None:
        """Refuse the commit before its new shards are created when one of its
        ``compare_and_append``s to an existing shard certainly will be: the shard's upper
        (read from consensus now) is already past the one expected, and uppers never go
        back. Not an ``append`` (cut, or left out), a replacement (planned again) or a
        retry with the caller's token (settled by its batch's history): the commit
        decides those.

        Raises:
            UpperMismatch: as the commit would raise it (``.shard`` names the shard).
        """
        for shard_id, op in self._ops.items():
            if op.writer is None or op.lower is not None or op.contents is not None \
                    or op.given_token:
                continue
            current = op.writer._machine.fetch_latest().upper
            if less_than(op.expected, current):
                op.writer._upper = current
                raise UpperMismatch(op.expected, current, shard=shard_id)

    def _open_new(self, shard_id: str) -> None:
        """Open the writer of an append added before its shard existed, which exists
        now; its untyped updates are refused if the shard records a schema."""
        op = self._ops[shard_id]
        handle = self._client.open_writer(shard_id, debug="transaction")
        self._opened.append(handle)
        if op.untyped and handle.schema is not None:
            # Refused as a typed writer refuses the same input, whatever its bytes: an
            # untyped key and value that happen to be valid encodings of the schema's
            # rows are still no typed write, and would land as rows nobody wrote.
            raise UntypedUpdates(f"shard {shard_id} was created and typed "
                                 f"({handle.schema!r}) by another client after this "
                                 f"transaction's untyped append to it was added: a typed "
                                 f"shard takes a table with columns {handle.schema.columns} "
                                 f"(+ t, d), not untyped updates; nothing was written")
        op.data = handle._coerce(op.data)
        op.writer = handle

    def _name_taken(self, key: str) -> UpperMismatch:
        """The refusal of a commit that another client's registration of one of its new
        names (consensus key ``key``) beat. Nothing of the transaction landed."""
        name = next(n for n in self._new_names if registry_key(n) == key)
        return name_taken(self._client, name, self._ops[self._new_names[name]].expected)

    @staticmethod
    def _stage_all(live: list[_Op], ops: list[_Op]) -> None:
        """Stage every live append not staged yet (a replace is planned first). Nothing
        of the transaction was committed when one fails (every earlier attempt was
        refused for certain), so the parts the others uploaded are deleted at once
        rather than left for GC's orphan sweep."""
        try:
            for op in live:
                if op.staged is None:
                    if op.contents is not None:
                        op.plan()
                    op.staged = op.handle._stage(op.data, op.expected, op.upper, op.token,
                                                 op.encoding or op.handle._encoding)
        except CERTAINLY_NOT_COMMITTED:
            raise  # the commit's own handler deletes them
        except PersistError:
            for op in ops:
                if op.staged is not None:
                    op.handle._delete_uncommitted(op.staged.parts)
            raise

    def _retry_refused(self, live: list[_Op], results: list[transitions.AppendResult],
                       replan: bool) -> bool:
        """Adjusts the appends a commit attempt refused in a way that can be retried;
        True if another attempt is due. A shard whose inline budget is full goes to blob;
        an ``append`` whose shard moved inside ``(lower, upper)`` is cut, and one whose
        shard is already past its upper is left out; a replace whose shard moved is
        planned again while ``replan``. Any other refusal is final (the caller raises
        it)."""
        retry = False
        landed = self._earlier_attempt_landed(live, results)
        for op, result in zip(live, results, strict=True):
            staged = op.staged
            assert staged is not None
            if landed and op.given_token and (
                    isinstance(result, _RETRY_REFUSED)
                    or (isinstance(result, transitions.Appended) and result.already_committed)):
                # A retry (the caller's tokens) of a transaction that committed: each of
                # its appends is reported committed, as a single write's retry is, also
                # one holding no rows (no batch of its own to find); the other appends go
                # on. With tokens of this commit's own, some shards holding its batches
                # and others not is a torn commit, refused below (CorruptState).
                state = op.handle._machine.state
                if isinstance(result, transitions.Appended):
                    op.result = op.handle._finish(staged, result, state)
                    op.handle._drop_superseded(staged)
                else:
                    # This commit's own attempts were all refused for certain: the parts
                    # it uploaded are nobody's (the earlier attempt's are kept), deleted
                    # as a single write's retry deletes them.
                    op.handle._delete_uncommitted(staged.parts)
                    op.result = WriteResult("none", 0, state.seqno, state.upper, 0,
                                            already_committed=True)
                retry = True
            elif isinstance(result, transitions.InlineBudgetExceeded):
                op.staged = op.handle._stage(op.data, op.expected, op.upper, op.token,
                                             staged.encoding, to_blob=True)
                retry = True
            elif isinstance(result, transitions.UpperMismatchResult) and \
                    op.contents is not None and replan:
                # Planned again, as a single replace is: a shard closed meanwhile is
                # then refused as closed (InvalidFrontier), as when closed before.
                op.handle._delete_uncommitted(staged.parts)
                op.staged = None
                retry = True
            elif isinstance(result, transitions.UpperMismatchResult) and op.lower is not None:
                current = result.current
                if less_than(current, op.lower):
                    continue  # a gap would open: final
                # A closed shard (None) is past every upper: left out below, as a
                # writer's own append leaves it (nothing written, placement "none").
                op.handle._delete_uncommitted(staged.parts)
                state = op.handle._machine.state
                if current is not None and less_than(current, op.upper):
                    op.data = op.data.filter_times(current)
                    op.expected, op.token, op.staged = current, new_token(), None
                else:
                    op.result = WriteResult("none", 0, state.seqno, current, 0)
                retry = True
        return retry

    @staticmethod
    def _earlier_attempt_landed(live: list[_Op],
                                results: list[transitions.AppendResult]) -> bool:
        """Whether this commit retries (with the caller's tokens) a transaction that
        committed: one of its appends finds its batch in its shard's state or kept
        history (as :meth:`WriteHandle.compare_and_append` settles a retry). All or none
        of a transaction lands, so then every append of it did.

        Raises:
            Indeterminate: no batch was found, and GC truncated the history of one that
                would tell.
        """
        refused: list[history.Attempt] = []
        for op, result in zip(live, results, strict=True):
            staged = op.staged
            if not op.given_token or staged is None:
                continue
            if isinstance(result, transitions.Appended) and result.already_committed:
                return True
            if isinstance(result, _RETRY_REFUSED):
                # Also an append of no rows: its writer's record of the token tells.
                refused.append(staged.attempt)
        return history.retry_landed(refused)

    def _results(self, ops: list[_Op]) -> dict[str, WriteResult]:
        out: dict[str, WriteResult] = {}
        for op in ops:
            assert op.result is not None
            out[op.handle.shard_id] = op.result
        return out

    def _expire_opened(self) -> None:
        opened, self._opened = self._opened, []
        for handle in opened:
            try:
                handle.expire()
            except PersistError as e:  # its lease expires on its own
                log.warning("could not expire transaction writer %s: %s", handle.writer_id, e)

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None and not self._finished:
            self.commit()
        else:
            self.abort()


def name_taken(client: PersistClient, name: str, expected: int) -> UpperMismatch:
    """The refusal of a write to the new name ``name`` that another client registered
    first (a transaction's, a Spark write's): ``.shard`` is the name, ``.current`` the
    upper of the shard registered under it (0 if not written yet, None if closed)."""
    registered = client.name_registry.lookup(name)
    assert registered is not None  # names are never deleted
    try:
        current: Frontier = client._machine(registered).fetch_latest().upper
    except ShardNotFound:
        current = 0  # registered, not written yet
    return UpperMismatch(expected, current, shard=name)


def _raise_refusal(staged: list[Staged], results: list[transitions.AppendResult],
                   states: list[State]) -> None:
    """Raises the typed error of the first append the commit refused."""
    for s, result, state in zip(staged, results, states, strict=True):
        if not isinstance(result, transitions.Appended):
            s.handle._finish(s, result, state)  # raises its refusal
    # Some shards found this transaction's batches and others did not: impossible for
    # an all-or-nothing commit, so the shards' states cannot be trusted.
    raise CorruptState(f"transaction over shards {[s.handle.shard_id for s in staged]}: "
                       f"its batches are in some shards and not in others")


def _looks_like_id(shard: str) -> bool:
    try:
        ShardId.parse(shard)
    except InvalidInput:
        return False
    return True


__all__ = ["Transaction", "UpperMismatch"]
