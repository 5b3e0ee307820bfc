"""Negative controls: each one puts back a defect this project fixed, so a test (or
``persist-pipeline simulate --control NAME``) can show the simulation catches it.

Never used outside the simulation and its tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa

from persist_pipeline import client as client_module
from persist_pipeline import gc, read, updates, write
from persist_pipeline.exceptions import CommitDeadlineExceeded, CorruptState, LeaseExpired
from persist_pipeline.frontier import MAX_TIME
from persist_pipeline.internal import history, machine, transitions


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
    """Negative answers confirmed: a negative answer computed from a stale cache is returned as
    is."""
    with _patched(machine.Machine, "confirm_negative_answers", False):
        yield


def _guess_lost(self: machine.Machine, attempts: list[Any]) -> None:
    for attempt in attempts:
        attempt.resolution = "lost"
    return None


@contextmanager
def guess_lost_replies() -> Iterator[None]:
    """Lost replies settled (and the critical reader's lost downgrade): an attempt whose reply
    was lost is assumed to have failed; the transition's answer on fresh state decides
    (and a write does not recognise its own batch in the state)."""
    with _patched(machine.Machine, "_resolve", _guess_lost), \
            _patched(transitions, "batch_in_state", lambda state, batch: False):
        yield


@contextmanager
def deadline_before_token() -> Iterator[None]:
    """Idempotency before the commit deadline: the commit deadline is checked before the
    idempotency token (with lost replies guessed, as before the fix; the settle rule alone
    also prevents the loss)."""
    original = transitions.compare_and_append

    def reordered(state: Any, batch: Any, **kw: Any) -> Any:
        deadline = kw.get("commit_deadline")
        if deadline is not None and deadline.passed_in(state):
            return state, transitions.DeadlineExceeded(deadline)
        return original(state, batch, **kw)

    with _patched(transitions, "compare_and_append", reordered), guess_lost_replies():
        yield


@contextmanager
def merge_without_deadline() -> Iterator[None]:
    """The merge commit deadline: a merge result commits however long ago its outputs were
    uploaded."""
    original = transitions.apply_merge

    def no_deadline(state: Any, res: Any, now_ms: int, commit_deadline: Any = None) -> Any:
        return original(state, res, now_ms, None)

    with _patched(transitions, "apply_merge", no_deadline):
        yield


@contextmanager
def gc_trusts_its_scan() -> Iterator[None]:
    """Overlapping and killed GCs: GC uses whatever records a scan returns, as if they started
    where it thinks, and a missing rollup is corrupt state rather than a sign to skip."""

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
    """The reader's seqno hold: a read fetches its state and registers the seqno it reads in
    two steps."""

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
def hold_ignores_open_plans() -> Iterator[None]:
    """A read plan's seqno hold: a heartbeat publishes the reader's latest state as its
    hold, not the oldest version an open plan (or read) still reads."""
    with _patched(read.ReadHandle, "_hold", lambda self: self._machine.state.seqno):
        yield


@contextmanager
def listen_without_hold() -> Iterator[None]:
    """A listen's since hold: a listen does not hold since below its frontier (nor refuses batches
    compacted past it)."""
    with _patched(read.ReadHandle, "_listen_cap", lambda self: None), \
            _patched(read.Listen, "_check_batches", staticmethod(lambda *a: None)):
        yield


@contextmanager
def open_fails_on_replaced_rollup() -> Iterator[None]:
    """Reads racing GC: opening a shard while GC replaces its rollup raises CorruptState."""
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
    """Reads racing GC: a reader paused past its lease gets CorruptPart, not LeaseExpired."""

    with _patched(read.ReadHandle, "_raise_if_expired", lambda self, error: None):
        yield


@contextmanager
def gc_sweeps_on_its_own_clock() -> Iterator[None]:
    """GC's orphan sweep measures blob ages with its own wall clock instead of the blob
    store's: a GC whose clock runs ahead deletes fresh uploads a writer then commits."""
    with _patched(gc, "_store_now", lambda m, store: m.now_ms() / 1000):
        yield


@contextmanager
def orphan_age_per_process() -> Iterator[None]:
    """Every process goes by its own ``gc_orphan_min_age_s`` instead of the shard's: a GC
    configured with a shorter age than a writer's sweeps a part the writer, paused
    within its own deadline, then commits."""
    with _patched(transitions, "orphan_min_age_ms", lambda state, configured_ms: configured_ms):
        yield


@contextmanager
def inline_max_per_process() -> Iterator[None]:
    """Every process inlines up to its own ``persist_inline_update_max_bytes`` instead of
    the shard's recorded one: a process configured with a bigger max pushes the shard's
    inline bytes past the bound the others, and the checks, go by."""
    with _patched(transitions, "inline_write_bound", lambda state, own_max_bytes: own_max_bytes):
        yield


@contextmanager
def deadline_refusal_deletes_parts() -> Iterator[None]:
    """A commit of uploaded parts refused for its deadline deletes them, though another
    commit of the same parts with the token, computed in time, may still land."""
    original = write.WriteHandle.compare_and_append_parts

    def deleting(self: write.WriteHandle, parts: Any, *args: Any, **kw: Any) -> Any:
        try:
            return original(self, parts, *args, **kw)
        except CommitDeadlineExceeded:
            self._delete_uncommitted(parts)
            raise

    with _patched(write.WriteHandle, "compare_and_append_parts", deleting):
        yield


@contextmanager
def spark_commit_rederives_schema() -> Iterator[None]:
    """A Spark write's commit takes the schema of the writer it opens (re-derived from the
    shard as it is now) instead of the one its tasks encoded with: an untyped write
    planned before the shard was typed commits raw bytes into the typed shard."""
    original = write.WriteHandle.compare_and_append_parts

    def rederived(self: write.WriteHandle, *args: Any, **kw: Any) -> Any:
        kw["schema"] = self.schema
        return original(self, *args, **kw)

    with _patched(write.WriteHandle, "compare_and_append_parts", rederived):
        yield


@contextmanager
def upsert_decodes_with_writer_schema() -> Iterator[None]:
    """An upsert or delete writes its batch with the schema its handle opened with, not
    the state's: rows of a newer shape it retracts are decoded with the old schema."""
    with _patched(write.WriteHandle, "_attempt_encoding",
                  lambda self, state: self._encoding):
        yield


@contextmanager
def wrapping_diff_sums() -> Iterator[None]:
    """Diff sums wrap silently in 64 bits (numpy's behaviour), on writes, reads and
    merges alike."""
    def wrapped(diffs: Any, starts: Any) -> Any:
        return np.add.reduceat(diffs, starts), []

    with _patched(updates, "exact_segment_sums", wrapped):
        yield


@contextmanager
def settle_by_token_only() -> Iterator[None]:
    """A lost reply whose settling record GC truncated is Indeterminate even when the
    write's batch is in the head state (the batch id, derived from the token, is not
    looked for once the writer's token expired)."""
    with _patched(write, "already_appended", lambda result: False), \
            _patched(history, "lost_reply_landed", lambda attempt: False):
        yield


@contextmanager
def listen_at_max_time_never_reports() -> Iterator[None]:
    """A listen after the largest time is over at once and never reports the close."""
    original = read.Listen.__init__

    def init(self: read.Listen, reader: Any, as_of: int) -> None:
        original(self, reader, as_of)
        if as_of >= MAX_TIME:
            self.frontier, self._done = None, True

    with _patched(read.Listen, "__init__", init):
        yield


@contextmanager
def environment_overrides_config() -> Iterator[None]:
    """A config's inline policy is replaced by the environment's (or the default), so
    a client whose config turned inlining off still inlines."""
    from persist_pipeline.config import InlinePolicy, PersistConfig

    def old(config: Any, inline_policy: Any, env: Any) -> Any:
        base = config or PersistConfig()
        return replace(base, inline_policy=inline_policy or InlinePolicy.from_env(env))

    with _patched(client_module, "effective_config", old):
        yield


@contextmanager
def non_atomic_transactions() -> Iterator[None]:
    """A multi-shard compare-and-set commits shard by shard, stopping at the first
    mismatch: a transaction that loses the race on one shard stays in the others."""
    from persist_pipeline.consensus.memory import MemoryConsensus

    def one_by_one(self: MemoryConsensus, writes: Any) -> bool:
        for one in sorted(writes, key=lambda w: w.shard):
            if not self.compare_and_set(one.shard, one.expected, one.new):
                return False
        return True

    with _patched(MemoryConsensus, "compare_and_set_many", one_by_one):
        yield


@contextmanager
def group_reports_held_appends() -> Iterator[None]:
    """A group commit refused by some of its appends reports every append's result,
    including the held-back ones that were never committed, as its outcome."""
    from persist_pipeline.internal import funnel

    def all_finished(self: funnel.Funnel, group: list[Any]) -> None:
        if not group:  # another thread's group holds this append
            return
        self._metrics.group_commits += 1
        applied = machine.apply_many([e.step() for e in group],
                                     proves_done=funnel._Outcome.done)
        for e, outcome, state in zip(group, applied.results, applied.states, strict=True):
            e.finish(outcome, state)

    with _patched(funnel.Funnel, "_commit_group", all_finished):
        yield


@contextmanager
def funnel_forgets_successor() -> Iterator[None]:
    """A group commit that ends wakes only its own appends, not the oldest append left
    waiting, which may never be woken when its process appends nothing more."""
    from persist_pipeline.internal import funnel

    def end_group(self: funnel.Funnel, leader: Any) -> list[Any]:
        group = leader.leading
        if group is None:
            return []
        leader.leading = None
        self._leaders -= 1
        self._in_groups -= len(group)
        for entry in group:
            self._busy.discard(entry.machine.shard_id)
        return [e.wake for e in group if e.wake is not None]

    with _patched(funnel.Funnel, "_end_group", end_group):
        yield


@contextmanager
def settle_from_latest_state_only() -> Iterator[None]:
    """A write's outcome settled from the shard's latest state alone: a batch that
    compaction merged away reads as never committed, so the pipeline's next run writes a
    landed file a second time."""
    from persist_pipeline.ids import batch_id

    def latest_only(self: write.WriteHandle, token: str, expected_upper: int) -> bool:
        return batch_id(token) in self._machine.fetch_latest().batches

    with _patched(write.WriteHandle, "committed", latest_only):
        yield


@contextmanager
def retry_settles_earlier_runs_only() -> Iterator[None]:
    """A step retry settles the writes earlier runs recorded, not its own run's earlier
    attempts: a retry after a commit that landed (its reply lost, or the step failing
    after it) writes the landed file a second time."""
    from persist_pipeline.sim import ingestion

    with _patched(ingestion, "_settles", lambda recorded_by, run: recorded_by != run):
        yield


@contextmanager
def contents_read_at_the_upper() -> Iterator[None]:
    """What a replacement retracts is the shard read at ``upper - 1``: rows compaction
    advanced to a since at the upper are missed, and a store leaves them twice."""

    def at_upper(self: write.WriteHandle, state: Any) -> Any:
        if not state.upper:
            return updates.empty_table()
        tables = list(read.stream_snapshot(self._machine, list(state.ordered_batches),
                                           state.upper - 1))
        return pa.concat_tables(tables) if tables else updates.empty_table()

    with _patched(write.WriteHandle, "_contents", at_upper):
        yield


@contextmanager
def pinned_contents_unchecked() -> Iterator[None]:
    """A table load pinned to an upper below the since reads the shard's whole contents
    without checking that no update was written at or after that upper: a later
    store's table is returned for an earlier store's upper."""
    real = read.ReadHandle._contents_with_schema

    def unchecked(self: read.ReadHandle) -> Any:
        table, schema, _ = real(self)
        return table, schema, 0

    with _patched(read.ReadHandle, "_contents_with_schema", unchecked):
        yield


@contextmanager
def table_uppers_memoized() -> Iterator[None]:
    """Table loads and stores remember each generation's upper per client (saving a
    round trip per generation) and a load reads at the upper it remembers: after another
    process's store, it reads the time before it and returns the table that store
    replaced. (A latest load reads at its state's own upper, so remembering alone no
    longer shows; reading at a remembered upper is the defect.)"""
    from persist_pipeline import tables

    seen: dict[tuple[int, str], int | None] = {}
    real = tables._stored_upper

    def memoized(client: Any, shard: Any) -> int | None:
        key = (id(client), str(shard))
        if not seen.get(key):  # nothing stored yet is looked up again
            seen[key] = real(client, shard)
        return seen[key]

    def at_remembered(as_of: int, upper: int | None) -> int | str:
        return as_of

    with _patched(tables, "_stored_upper", memoized), \
            _patched(tables, "_read_at", at_remembered):
        yield


@contextmanager
def table_schema_recorded_at_open() -> Iterator[None]:
    """A table store records its schema (an evolution) when it opens the generation's
    writer, before its commit: a store that is then refused leaves the evolved schema,
    and loads return the table before it with a column it never had."""
    from persist_pipeline import client as client_module

    def at_open(self: Any, shard: Any, schema: Any, debug: str = "") -> Any:
        return self.open_writer(shard, schema=schema, debug=debug)

    with _patched(client_module.PersistClient, "_open_table_writer", at_open):
        yield


@contextmanager
def pinned_loads_with_the_newest_schema() -> Iterator[None]:
    """A table load pinned to an earlier upper decodes with the shard's newest schema,
    forgetting the ones it evolved from: the version stored there comes back with the
    columns a later evolution added (as nulls), a table that was never stored."""
    from persist_pipeline.schema import ShardSchema

    def newest(self: ShardSchema, time: int) -> ShardSchema:
        return self

    with _patched(ShardSchema, "as_of", newest):
        yield


@contextmanager
def latest_load_at_looked_up_upper() -> Iterator[None]:
    """A table load of the latest version reads at the upper it looked up before its
    read, decoding with the schema of the state it then reads: a store evolving the
    schema in between makes the older version come back with the newer columns (as
    nulls), a table never stored."""
    from persist_pipeline import tables

    def looked_up(as_of: int, upper: int | None) -> int | str:
        return as_of

    with _patched(tables, "_read_at", looked_up):
        yield


@contextmanager
def listen_release_raises() -> Iterator[None]:
    """A listen's since release after its frontier moved is best effort: it raises, so
    the events whose frontier the listen already passed are lost (and the reader's own
    downgrade too)."""

    def release(self: read.Listen) -> None:
        if not self._reader._expired:
            self._reader._listen_moved()

    with _patched(read.Listen, "_release", release):
        yield


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@contextmanager
def listen_registration_unserialised() -> Iterator[None]:
    """Moving a reader's since and registering a listen are serialised: a since release
    whose cap was computed before another listen of the reader registered commits after
    that listen's as_of was checked, past it."""
    original = read.ReadHandle.__init__

    def init(self: read.ReadHandle, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._since_lock = _NoLock()

    with _patched(read.ReadHandle, "__init__", init):
        yield


@contextmanager
def retry_not_settled_by_history() -> Iterator[None]:
    """A write retried with the token of an attempt whose outcome its caller never
    learnt is not settled by its batch's history: once compaction merged the committed
    batch away, the retry is refused as if nothing was written, and a retried
    ``compare_and_append_parts`` deletes the parts older versions still reference."""
    with _patched(history, "retry_landed", lambda attempts: False):
        yield


@contextmanager
def transaction_retry_not_settled() -> Iterator[None]:
    """A transaction retried with its tokens is never recognised as one that landed: an
    append found committed is not reported so, and one that held no rows (no batch to
    find) is refused with UpperMismatch, though the transaction committed."""
    from persist_pipeline import transaction

    with _patched(transaction.Transaction, "_earlier_attempt_landed",
                  staticmethod(lambda live, results: False)):
        yield


@contextmanager
def abort_trusts_a_missing_marker() -> Iterator[None]:
    """A Spark write's abort deletes its parts whenever no commit marker is left, as if
    no commit had been attempted: a commit that landed (and removed its marker) but
    whose reply Spark never got has its referenced parts deleted."""
    from persist_pipeline import spark_source

    with _patched(spark_source, "_may_have_landed", lambda job, client: False):
        yield


@contextmanager
def commit_ignores_an_earlier_abort() -> Iterator[None]:
    """A Spark write's commit does not see that an abort of the same write ran before it
    started: the abort deleted the parts, and the commit references them."""
    from persist_pipeline import spark_source

    with _patched(spark_source, "_was_aborted", lambda job: False):
        yield


@contextmanager
def transaction_names_on_add() -> Iterator[None]:
    """A transaction registers a new shard name when its append is added, not before
    its commit: one aborted afterwards leaves the name registered for good."""
    from persist_pipeline import transaction

    def registering(self: Any, shard: Any) -> str:
        if isinstance(shard, str) and not transaction._looks_like_id(shard):
            return str(self._client.resolve(shard, create=True))
        return original(self, shard)

    original = transaction.Transaction._shard_id
    with _patched(transaction.Transaction, "_shard_id", registering):
        yield


@contextmanager
def transaction_creates_shards_on_add() -> Iterator[None]:
    """A transaction creates the shard of a new name or id when its append is added, not
    at its commit: one aborted afterwards leaves an empty shard behind."""
    from persist_pipeline import transaction

    with _patched(transaction.Transaction, "_is_new", lambda self, shard: False):
        yield


@contextmanager
def names_registered_before_commit() -> Iterator[None]:
    """A new name (a transaction's, a Spark write's) is registered by a compare-and-set
    of its own just before the write's: a commit then refused leaves it registered."""
    from persist_pipeline import transaction

    original = machine.apply_many

    def registering_first(steps: Any, **kwargs: Any) -> Any:
        for record in kwargs.pop("created", ()):
            steps[0].machine.consensus.compare_and_set(record.shard, None, record.new)
        return original(steps, **kwargs)

    with _patched(transaction, "apply_many", registering_first), \
            _patched(write, "apply_many", registering_first):
        yield


@contextmanager
def wal_parts_stay() -> Iterator[None]:
    """A Spine entry holding WAL parts is pending only for several batches or inline
    parts: a WAL batch the Spine never fuses with another stays in the WAL store for
    good, and the shard reports no work for compaction."""
    from persist_pipeline.internal.state import Batch

    with _patched(Batch, "num_wal_parts", property(lambda self: 0)):
        yield


@contextmanager
def verify_trusts_its_first_read() -> Iterator[None]:
    """A check of the stores reports every blob it finds gone, without reading the
    shard's state again: a part that compaction replaced and GC collected after the
    check read the state is reported lost."""
    from persist_pipeline import verify

    def everything(_machine: Any, found: list[Any]) -> tuple[list[Any], int]:
        return [f.problem for f in found], 0

    with _patched(verify, "_still_referenced", everything):
        yield


@contextmanager
def blobs_without_checksums() -> Iterator[None]:
    """Parts and rollups are written without a CRC-32 (as before checksums were): a read
    that went bad decodes into wrong rows or fails, and a copy of it in the part cache
    fails or misleads every later read of an intact part."""
    from persist_pipeline.internal import checksum

    with _patched(checksum, "crc32", lambda _data: None):
        yield


@contextmanager
def retry_drops_every_part() -> Iterator[None]:
    """A write found already committed deletes the parts it staged whatever batch the
    shard holds: also when that batch is this very write's (its lost reply landed, and
    its commit found its own batch on the next attempt), whose parts are then gone."""
    def drop(self: write.WriteHandle, staged: write.Staged) -> None:
        self._delete_uncommitted(staged.parts)

    with _patched(write.WriteHandle, "_drop_superseded", drop):
        yield


@contextmanager
def expired_handle_commits() -> Iterator[None]:
    """An append whose handle is expired while it is on its way (waiting in the
    group-commit funnel, uploading, re-run after a lost race) is not asked again: it
    commits, and registers the expired writer again."""
    def unchecked(self: write.WriteHandle, staged: write.Staged) -> Any:
        machine_ = self._machine
        policy = self.policy
        lease = self._lease_ms()

        def transition(state: Any) -> Any:
            return transitions.compare_and_append(
                state, staged.batch, writer_id=self.writer_id, token=staged.token,
                expected_upper=staged.expected, new_upper=staged.upper,
                now_ms=machine_.now_ms(), lease_ms=lease, inline_max_bytes=policy.max_bytes,
                fell_back=staged.fell_back, records_inline_max=policy.threshold_bytes > 0,
                commit_deadline=None if staged.upload_started_s is None
                else machine_.commit_deadline(staged.upload_started_s),
                encoded_with=staged.encoding.recorded, record=staged.encoding.record,
                exact=staged.encoding.exact)

        return transition

    with _patched(write.WriteHandle, "_transition", unchecked):
        yield


@contextmanager
def untyped_rows_taken_as_typed() -> Iterator[None]:
    """A transaction's untyped append to a shard id that another client created and
    typed meanwhile is only checked to decode as rows of the schema: keys and values
    that happen to be valid encodings land in the typed shard as its rows."""
    from persist_pipeline import transaction

    def opening(self: Any, shard_id: str) -> None:
        op = self._ops[shard_id]
        handle = self._client.open_writer(shard_id, debug="transaction")
        self._opened.append(handle)
        op.data = handle._coerce(op.data)
        op.writer = handle

    with _patched(transaction.Transaction, "_open_new", opening):
        yield


@contextmanager
def store_tables_one_by_one() -> Iterator[None]:
    """``store_tables`` stores its tables one after the other, each in its own write,
    instead of in one transaction: a load between the two (or after the second was
    refused) finds the first table of the pair without the second."""
    from persist_pipeline import tables

    def one_by_one(client: Any, entries: Any, *, debug: str = "") -> Any:
        return {name: tables.store_table(client, name, table, keys, debug=debug)
                for name, (table, keys) in entries.items()}

    with _patched(tables, "store_tables", one_by_one):
        yield


@contextmanager
def store_tables_into_superseded_generations() -> Iterator[None]:
    """A table store neither moves the upper of a generation it passes for a newer one,
    nor does ``store_tables`` check its generations are still the newest after reading
    them: a commit into a generation superseded meanwhile lands where no load reads,
    while its other tables land where loads read."""
    from persist_pipeline import tables

    def unchecked(client: Any, name: str, gen_name: str) -> Callable[[], None]:
        return lambda: None

    with _patched(tables, "_seal", lambda client, shard: None), \
            _patched(tables, "_newest_check", unchecked):
        yield


CONTROLS: dict[str, Callable[[], Any]] = {
    "trust_cached_negatives": trust_cached_negatives,
    "guess_lost_replies": guess_lost_replies,
    "deadline_before_token": deadline_before_token,
    "merge_without_deadline": merge_without_deadline,
    "gc_trusts_its_scan": gc_trusts_its_scan,
    "reader_hold_race": reader_hold_race,
    "hold_ignores_open_plans": hold_ignores_open_plans,
    "listen_without_hold": listen_without_hold,
    "open_fails_on_replaced_rollup": open_fails_on_replaced_rollup,
    "expired_read_reports_corruption": expired_read_reports_corruption,
    "gc_sweeps_on_its_own_clock": gc_sweeps_on_its_own_clock,
    "orphan_age_per_process": orphan_age_per_process,
    "inline_max_per_process": inline_max_per_process,
    "deadline_refusal_deletes_parts": deadline_refusal_deletes_parts,
    "spark_commit_rederives_schema": spark_commit_rederives_schema,
    "upsert_decodes_with_writer_schema": upsert_decodes_with_writer_schema,
    "wrapping_diff_sums": wrapping_diff_sums,
    "settle_by_token_only": settle_by_token_only,
    "listen_at_max_time_never_reports": listen_at_max_time_never_reports,
    "environment_overrides_config": environment_overrides_config,
    "non_atomic_transactions": non_atomic_transactions,
    "group_reports_held_appends": group_reports_held_appends,
    "settle_from_latest_state_only": settle_from_latest_state_only,
    "retry_settles_earlier_runs_only": retry_settles_earlier_runs_only,
    "funnel_forgets_successor": funnel_forgets_successor,
    "contents_read_at_the_upper": contents_read_at_the_upper,
    "table_uppers_memoized": table_uppers_memoized,
    "pinned_contents_unchecked": pinned_contents_unchecked,
    "table_schema_recorded_at_open": table_schema_recorded_at_open,
    "pinned_loads_with_the_newest_schema": pinned_loads_with_the_newest_schema,
    "latest_load_at_looked_up_upper": latest_load_at_looked_up_upper,
    "listen_release_raises": listen_release_raises,
    "listen_registration_unserialised": listen_registration_unserialised,
    "retry_not_settled_by_history": retry_not_settled_by_history,
    "transaction_retry_not_settled": transaction_retry_not_settled,
    "abort_trusts_a_missing_marker": abort_trusts_a_missing_marker,
    "verify_trusts_its_first_read": verify_trusts_its_first_read,
    "commit_ignores_an_earlier_abort": commit_ignores_an_earlier_abort,
    "transaction_names_on_add": transaction_names_on_add,
    "transaction_creates_shards_on_add": transaction_creates_shards_on_add,
    "wal_parts_stay": wal_parts_stay,
    "names_registered_before_commit": names_registered_before_commit,
    "blobs_without_checksums": blobs_without_checksums,
    "retry_drops_every_part": retry_drops_every_part,
    "expired_handle_commits": expired_handle_commits,
    "untyped_rows_taken_as_typed": untyped_rows_taken_as_typed,
    "store_tables_one_by_one": store_tables_one_by_one,
    "store_tables_into_superseded_generations": store_tables_into_superseded_generations,
}
