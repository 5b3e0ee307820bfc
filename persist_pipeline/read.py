"""Read handles: snapshots, listens, and since holds (leased and critical readers)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.exceptions import (
    CorruptPart,
    FencedOut,
    InvalidFrontier,
    InvalidInput,
    LeaseExpired,
    NotYetAvailable,
    PersistError,
    SinceViolation,
)
from persist_pipeline.fingerprint import SnapshotFingerprint, fingerprint_batches
from persist_pipeline.frontier import MAX_TIME, Frontier, check_frontier, less_than
from persist_pipeline.internal import transitions
from persist_pipeline.internal.blobs import WHOLE_FETCH_MAX_BYTES
from persist_pipeline.internal.heartbeat import Heartbeater
from persist_pipeline.internal.machine import Machine
from persist_pipeline.internal.merge import memory_plan, merge_runs
from persist_pipeline.internal.state import Batch, HollowPart, InlinePart, State
from persist_pipeline.internal.sync import SharedPool, new_lock
from persist_pipeline.plan import (
    LATEST,
    PlanFile,
    SnapshotPlan,
    file_uri,
    latest_complete_time,
)
from persist_pipeline.schema import ShardSchema
from persist_pipeline.updates import consolidate, decode_inline, empty_table, naming_shard

#: The most rows in one record batch of :meth:`ReadHandle.snapshot_batches`.
SNAPSHOT_BATCH_ROWS = 64 * 1024

#: Parallel blob fetches per read.
_FETCH_THREADS = 8

#: A snapshot streaming at most this many runs decodes a large local part on two threads
#: (row groups two at a time, else columns in parallel: see ``ShardBlobs.stream_part``):
#: the merge of a few runs waits on decoding, its own work is light.
DECODE_THREADS_MAX_RUNS = 4


#: One shared pool for blob fetches (threads are reused across reads).
_FETCH_POOL = SharedPool(_FETCH_THREADS, "persist-fetch")


def stream_snapshot(machine: Machine, batches: list[Batch], as_of: int) -> Iterator[pa.Table]:
    """The consolidated collection at ``as_of`` of ``batches``, as sorted tables.

    Inline batches and small hollow ones (up to an eighth of the memory bound in all)
    are fetched whole, in parallel, and form one in-memory run; every other batch is
    streamed as its own run through the k-way merge.
    """
    bound = machine.config.compaction_memory_bound_bytes
    small: list[Batch] = []
    small_bytes = 0
    large: list[Batch] = []
    for b in batches:
        size = sum(p.encoded_size for p in b.hollow_parts())
        if size <= WHOLE_FETCH_MAX_BYTES and small_bytes + size <= bound // 8:
            small.append(b)
            small_bytes += size
        elif b.parts:
            large.append(b)
    where = f"shard {machine.shard_id}"
    runs: list[tuple[Iterator[pa.Table], str]] = []
    if small:
        table = consolidate(fetch_batches(machine, small, where), as_of=as_of)
        if not large:
            if table.num_rows:
                yield table
            return
        runs.append((iter([table]), f"small batches of {where}"))
    large_runs = [(b, run) for b in large for run in b.runs()]
    plan = memory_plan(bound, len(runs) + len(large_runs), bound)
    threads = len(large_runs) <= DECODE_THREADS_MAX_RUNS
    for n, (b, run) in enumerate(large_runs):
        runs.append((machine.blobs.stream_run(run, where, plan.chunk_bytes // 2,
                                              plan.read_bytes, as_of=as_of,
                                              decode_threads=threads),
                     f"batch {b.id} (run {n}) of {where}"))
    yield from merge_runs(runs, plan.chunk_bytes)


def fetch_batches(machine: Machine, batches: list[Batch], where: str) -> pa.Table:
    """Fetch and concatenate every part of ``batches``.

    Inline parts are decoded right here (no I/O); hollow parts are fetched in parallel.
    """
    parts = [p for b in batches for p in b.parts]
    if not parts:
        return empty_table()
    hollow = [p for p in parts if isinstance(p, HollowPart)]
    tables = [machine.blobs.fetch_part(p, where) for p in parts
              if not isinstance(p, HollowPart)]
    if len(hollow) == 1 or machine.config.read_fetch_threads <= 1:
        tables += [machine.blobs.fetch_part(p, where) for p in hollow]
    elif hollow:
        tables += _FETCH_POOL.get().map(lambda p: machine.blobs.fetch_part(p, where), hollow)
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _shown_as_of(as_of: object) -> str:
    """A refused ``as_of``, with a hint for the near misses a user types."""
    if isinstance(as_of, str):
        shown, text = repr(as_of[:40]), as_of.strip()
        if text.lower() == LATEST:
            return f"{shown} (spelled exactly 'latest', lower case)"
        if text.isascii() and text.isdigit() and len(text) <= 19:
            return f"{shown} (a str: pass the int {int(text)})"
        return shown
    if as_of is None:
        return "None"
    return f"{type(as_of).__name__} {as_of!r:.40}"


class ReadHandle:
    """A leased reader of one shard: holds back ``since`` and GC while it heartbeats.

    Obtain one with :meth:`PersistClient.open_reader`.
    """

    def __init__(self, machine: Machine, reader_id: str, debug: str = "") -> None:
        self._machine = machine
        self.reader_id = reader_id
        self._lease_ms = int(machine.config.reader_lease_duration_s * 1000)
        self._reading: dict[int, int] = {}
        self._reading_lock = new_lock()
        self._expired = False
        self._released = False  # expire() committed: nothing of this reader is left
        self._listens: weakref.WeakSet[Listen] = weakref.WeakSet()
        # Serialises moving this reader's since with opening a listen: a release that
        # computed its cap before a new listen was registered must not commit after
        # that listen's as_of was checked against the since (it would release the
        # times the listen has yet to emit to compaction).
        self._since_lock = new_lock(reentrant=True)
        reader, _ = machine.apply(lambda s: transitions.register_leased_reader(
            s, reader_id, machine.now_ms(), self._lease_ms, debug))
        self._since: Frontier = reader.since
        self._wanted_since: Frontier = reader.since
        self._heartbeat = Heartbeater(f"persist-reader-{reader_id[:9]}",
                                      machine.config.heartbeat_interval_s, self.heartbeat)

    @property
    def shard_id(self) -> str:
        return self._machine.shard_id

    @property
    def since(self) -> Frontier:
        """This reader's since: reads at ``as_of >= since`` are exact."""
        return self._since

    def _hold(self) -> int:
        """The seqno this reader must keep live: the oldest state it is reading."""
        with self._reading_lock:
            current = self._machine.state.seqno
            return min([current, *self._reading.keys()])

    @contextlib.contextmanager
    def _reading_state(self) -> Iterator[State]:
        state = self._start_reading()
        try:
            yield state
        finally:
            self._stop_reading(state)

    def fetch(self, batches: list[Batch], state: State) -> pa.Table:
        """Every part of ``batches``; a part GC deleted because this reader's lease ran out
        raises :class:`LeaseExpired`, not :class:`CorruptPart`."""
        try:
            return fetch_batches(self._machine, batches, f"shard {self.shard_id}")
        except CorruptPart as e:
            self._raise_if_expired(e)
            raise

    def _raise_if_expired(self, error: CorruptPart) -> None:
        """Raise :class:`LeaseExpired` if this reader was expired (asked of consensus):
        then GC may have collected what it was reading, which is not corruption."""
        latest = self._machine.fetch_latest()
        if self.reader_id not in latest.leased_readers:
            self._expired = True
            raise LeaseExpired(f"reader {self.reader_id} was expired while reading (it "
                               f"missed heartbeats) and GC collected what it was "
                               f"reading") from error

    def heartbeat(self) -> None:
        """Renew the lease (done in the background; call it to renew now)."""
        self._check()
        hold = self._hold()
        machine = self._machine
        try:
            reader, _ = machine.apply(lambda s: transitions.heartbeat_leased_reader(
                s, self.reader_id, machine.now_ms(), hold))
        except LeaseExpired:
            self._expired = True
            raise
        self._since = reader.since

    def _check_as_of(self, as_of: object, state: State) -> int:
        """``as_of`` as a time: an int, or ``"latest"`` (the shard's ``upper - 1``); the
        one convention of every read (Python, the CLI, read plans, Spark)."""
        if as_of == LATEST:
            as_of = latest_complete_time(state.shard_id, state.upper)
        elif as_of is None or isinstance(as_of, bool) or not isinstance(as_of, int):
            # check_frontier's own message would offer None (closed), which no read takes.
            raise InvalidFrontier(f"as_of must be an int time or 'latest', got "
                                  f"{_shown_as_of(as_of)}")
        t = check_frontier(as_of, "as_of")
        assert t is not None
        reader = state.leased_readers[self.reader_id]
        if less_than(t, reader.since) or less_than(t, state.since):
            raise SinceViolation(f"as_of {t} is below since {reader.since}: times before it "
                                 f"may have been compacted together")
        return t

    def snapshot(self, as_of: int | str) -> pa.Table:
        """The collection at ``as_of``: a consolidated k/v/t/d table, every ``t == as_of``,
        sorted by ``(k, v)`` (the concatenation of :meth:`snapshot_batches`). A typed
        shard's snapshot has its key and value columns instead of ``k`` and ``v``.

        Args:
            as_of: an int time, or exactly ``"latest"`` (the latest complete time,
                ``upper - 1``); the same for every read.

        Raises:
            InvalidFrontier: ``as_of`` is neither an int time nor ``"latest"``.
            SinceViolation: ``as_of`` is below this reader's since.
            NotYetAvailable: the shard's upper is not yet beyond ``as_of``.
        """
        return self._snapshot_with_schema(as_of)[0]

    def _snapshot_with_schema(self, as_of: int | str) -> tuple[pa.Table, ShardSchema | None]:
        """:meth:`snapshot` and the schema its rows were decoded with (that of the
        state it read, which a concurrent evolution may have made older than
        :meth:`schema`, the cached one)."""
        read: list[bytes] = []
        batches = list(self._snapshot_batches(as_of, SNAPSHOT_BATCH_ROWS, typed=True,
                                              schema_read=read))
        schema = ShardSchema.from_bytes(read[0]) if read and read[0] else None
        if batches:
            return pa.Table.from_batches(batches), schema
        return (empty_table() if schema is None else schema.arrow_schema().empty_table(),
                schema)

    def _contents_with_schema(self) -> tuple[pa.Table, ShardSchema | None, int]:
        """Every row of the latest state, each update counted whatever its time (its
        times as compaction left them), decoded with that state's schema, and the
        upper of the last batch holding any update (0: none): a shard's whole contents
        even when its since reached its upper, so that no time below the upper is exact
        any more (what a table load reads then). They are the collection as of every
        time from that batch's ``upper - 1`` on: every update was written below it,
        and appends after it (empty ones: a seal) moved the upper without a row."""
        with self._reading_state() as state:
            schema = ShardSchema.from_bytes(state.schema) if state.schema else None
            # A batch's upper bounds the times its updates were written at, however
            # compaction advanced them since (merged batches span their inputs).
            written = max((b.desc.upper for b in state.ordered_batches
                           if b.parts and b.desc.upper is not None), default=0)
            if any(b.parts and b.desc.upper is None for b in state.ordered_batches):
                written = MAX_TIME + 1  # a closed shard's last batch: never exact below
            try:
                with naming_shard(self.shard_id):
                    tables = list(stream_snapshot(self._machine,
                                                  list(state.ordered_batches), MAX_TIME))
            except CorruptPart as e:
                self._raise_if_expired(e)
                raise
        table = pa.concat_tables(tables) if tables else empty_table()
        if schema is not None:
            table = schema.decode(table, f"shard {self.shard_id}")
        return table, schema, written

    def schema(self) -> ShardSchema | None:
        """The shard's schema as last seen (None: untyped). Reads of a typed shard
        return its key and value columns plus ``t`` and ``d`` instead of ``k``/``v``."""
        data = self._machine.state.schema
        return ShardSchema.from_bytes(data) if data else None

    def snapshot_batches(self, as_of: int | str,
                         max_rows: int = SNAPSHOT_BATCH_ROWS) -> Iterator[pa.RecordBatch]:
        """The collection at ``as_of`` as consolidated record batches in ``(k, v)`` order,
        read in bounded memory (about ``compaction_memory_bound_bytes``, whatever the
        shard's size): every batch of the shard is a sorted run, merged as it streams.
        A reader does not write, so unlike a merge it cannot go in passes: runs past the
        fan-in (128 at the default bound) each cost a read buffer beyond the bound,
        which compaction keeps few (the Spine holds O(log n) batches).

        The state being read stays held (its parts are not collected) until the
        iterator is exhausted or closed. Errors are raised as for :meth:`snapshot`, when
        the iteration starts.

        Args:
            as_of: the time to read at.
            max_rows: the most rows in one record batch.
        """
        return self._snapshot_batches(as_of, max_rows, typed=True)

    def _snapshot_batches(self, as_of: int | str, max_rows: int, typed: bool,
                          schema_read: list[bytes] | None = None
                          ) -> Iterator[pa.RecordBatch]:
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise InvalidInput(f"max_rows must be a positive int, got {max_rows!r}")
        with self._reading_state() as state:
            if schema_read is not None:
                schema_read.append(state.schema)
            schema = ShardSchema.from_bytes(state.schema) if typed and state.schema else None
            t = self._check_as_of(as_of, state)
            if not less_than(t, state.upper):
                raise NotYetAvailable(f"as_of {t} is not complete yet: the shard's upper is "
                                      f"{state.upper}")
            batches = [b for b in state.ordered_batches if b.desc.lower <= t]
            try:
                with naming_shard(self.shard_id):
                    for table in stream_snapshot(self._machine, batches, t):
                        if schema is not None:
                            table = schema.decode(table, f"shard {self.shard_id}")
                        yield from table.to_batches(max_chunksize=max_rows)
            except CorruptPart as e:
                self._raise_if_expired(e)
                raise

    def _contents_fingerprint(self) -> tuple[SnapshotFingerprint, Frontier]:
        """The fingerprint of every row of the latest state, each update counted whatever
        its time (as :meth:`_contents_with_schema`), streamed in bounded memory, and that
        state's upper: what can still be compared when no time at or above since is
        complete (since reached the upper), as long as the upper did not move."""
        with self._reading_state() as state:
            try:
                with naming_shard(self.shard_id):
                    return fingerprint_batches(stream_snapshot(
                        self._machine, list(state.ordered_batches), MAX_TIME)), state.upper
            except CorruptPart as e:
                self._raise_if_expired(e)
                raise

    def snapshot_fingerprint(self, as_of: int | str) -> SnapshotFingerprint:
        """A digest of the collection at ``as_of``, computed from
        :meth:`snapshot_batches` in bounded memory: equal collections, and only those
        (up to BLAKE2b collisions), have equal fingerprints."""
        return fingerprint_batches(self._snapshot_batches(as_of, SNAPSHOT_BATCH_ROWS,
                                                          typed=False))

    def listen(self, as_of: int | str) -> Listen:
        """Every update with ``t > as_of``, in time order, with progress frontiers.

        ``snapshot(as_of)`` followed by this listen reproduces the whole collection, for
        the same *time*: ``"latest"`` is resolved (to ``upper - 1``) by each call, so a
        write landing between a ``snapshot("latest")`` and a ``listen("latest")`` would
        be in neither. Open the listen first and read ``snapshot(listen.as_of)`` (before
        downgrading this reader's since past it).
        """
        with self._since_lock:
            with self._reading_state() as state:
                t = self._check_as_of(as_of, state)
            listen = Listen(self, t)
            self._listens.add(listen)
        return listen

    def snapshot_plan(self, as_of: int | str = "latest") -> SnapshotPlan:
        """The live Parquet files and inline rows of the snapshot at ``as_of``, for
        other engines (DuckDB, polars, Spark); see :mod:`persist_pipeline.plan`.

        The plan holds the state version it was made from: GC deletes none of its files
        until the plan is closed (``close()`` or a ``with`` block) or this reader's
        lease runs out. Heartbeats meanwhile keep the lease without releasing the hold.

        Args:
            as_of: the time to read, or ``"latest"`` (the latest complete time,
                ``upper - 1``; the default).

        Raises:
            SinceViolation: ``as_of`` is below this reader's since.
            NotYetAvailable: the shard's upper is not yet beyond ``as_of`` (or, with
                ``as_of="latest"``, nothing is complete yet).
            InvalidConfig: a part lives in an in-memory blob store.
        """
        state = self._start_reading()
        try:
            t = self._check_as_of(as_of, state)
            if not less_than(t, state.upper):
                raise NotYetAvailable(f"as_of {t} is not complete yet: the shard's upper is "
                                      f"{state.upper}")
            files: list[PlanFile] = []
            inline: list[pa.Table] = []
            for batch in state.ordered_batches:
                if batch.desc.lower > t:
                    continue
                for index, part in enumerate(batch.parts):
                    if isinstance(part, InlinePart):
                        inline.append(decode_inline(part.updates, f"{part.part_id} (shard "
                                                    f"{self.shard_id})"))
                        continue
                    uri, path = file_uri(self._machine.blobs.store(part.store), part.key)
                    files.append(PlanFile(uri, part.store, part.key, path, part.encoded_size,
                                          part.num_updates, part.min_time, part.max_time,
                                          batch.id, index, part.min_key, part.max_key,
                                          part.crc32, part.footer_crc32))
            stores = {"main": self._machine.blobs.main}
            if self._machine.blobs.wal is not None:
                stores["wal"] = self._machine.blobs.wal
            table = pa.concat_tables(inline) if inline else empty_table()
            schema = ShardSchema.from_bytes(state.schema) if state.schema else None
            return SnapshotPlan(shard_id=self.shard_id, as_of=t, since=state.since,
                                upper=state.upper, seqno=state.seqno, files=tuple(files),
                                inline=table, stores=stores, schema=schema,
                                release=lambda: self._stop_reading(state, heartbeat=True),
                                expired=lambda: self._expired)
        except BaseException:
            self._stop_reading(state)
            raise

    def _start_reading(self) -> State:
        """Fetch the latest state and hold its seqno until :meth:`_stop_reading` (every
        read does this; a plan keeps it for its life)."""
        self._check()
        # Fetch and register the seqno being read in one step: a heartbeat in between
        # would otherwise publish a newer hold and let GC delete what this read needs.
        with self._reading_lock:
            state = self._machine.fetch_latest()
            if self.reader_id not in state.leased_readers:
                self._expired = True
                raise LeaseExpired(f"reader {self.reader_id} was expired (missed heartbeats)")
            self._reading[state.seqno] = self._reading.get(state.seqno, 0) + 1
        return state

    def _stop_reading(self, state: State, heartbeat: bool = False) -> None:
        """Release the hold :meth:`_start_reading` took. When nothing is read any more,
        publish the released hold at once if asked to (``heartbeat``) or if the reader
        holds versions far behind (so GC can truncate below them), rather than at the
        next background beat."""
        with self._reading_lock:
            self._reading[state.seqno] -= 1
            if not self._reading[state.seqno]:
                del self._reading[state.seqno]
            idle = not self._reading
        held = state.leased_readers[self.reader_id].seqno
        behind = state.seqno - held > self._machine.config.rollup_threshold
        if idle and not self._expired and (heartbeat or behind):
            with contextlib.suppress(PersistError):
                self.heartbeat()

    def downgrade_since(self, new_since: Frontier) -> None:
        """Release times below ``new_since`` (compaction may then merge them).

        While a :class:`Listen` of this reader is open, since stays at most its
        frontier - 1 (compaction must not fold the updates it already emitted into times
        it has yet to emit); the rest is released as the listen moves on.
        """
        self._check()
        since = check_frontier(new_since, "new_since")
        if less_than(since, self._wanted_since):
            raise InvalidFrontier(f"since may only advance: reader holds "
                                  f"{self._wanted_since}, asked for {since}")
        previous, self._wanted_since = self._wanted_since, since
        try:
            self._downgrade_to(since)
        except BaseException:
            # Not known to be committed: what the reader holds is what consensus says
            # (a retry, or the transition's own check, settles it), never this ask.
            self._wanted_since = previous
            raise

    def _listen_cap(self) -> Frontier:
        cap: Frontier = None
        for listen in list(self._listens):
            f = listen.frontier
            if f is not None and (cap is None or f - 1 < cap):
                cap = f - 1
        return cap

    def _downgrade_to(self, wanted: Frontier) -> None:
        with self._since_lock:
            cap = self._listen_cap()
            target = cap if cap is not None and less_than(cap, wanted) else wanted
            if less_than(target, self._since):
                target = self._since
            hold = self._hold()
            machine = self._machine
            reader, _ = machine.apply(lambda s: transitions.downgrade_since(
                s, self.reader_id, target, machine.now_ms(), hold))
            self._since = reader.since

    def _listen_moved(self) -> None:
        """A listen advanced: release what the user asked for and the listen no longer
        needs held."""
        if less_than(self._since, self._wanted_since):
            self._downgrade_to(self._wanted_since)

    def expire(self) -> None:
        """Unregister this reader, releasing its holds. Idempotent."""
        if self._released:
            return
        self._expired = True
        self._heartbeat.stop()
        machine = self._machine
        # Only a committed expiry is done: after a failure (consensus away, an
        # indeterminate commit) a retry expires again, rather than leaving the reader's
        # since and seqno holds in the state until its lease runs out.
        machine.apply(lambda s: transitions.expire_leased_reader(s, self.reader_id,
                                                                 machine.now_ms()))
        self._released = True

    close = expire

    def stop_heartbeats(self) -> None:
        """Stop the background heartbeat without expiring (the client is closing)."""
        self._heartbeat.stop()

    def _check(self) -> None:
        if self._expired:
            raise LeaseExpired(f"reader {self.reader_id} was expired")

    def __enter__(self) -> ReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.expire()


@dataclass(frozen=True, slots=True)
class ListenEvent:
    """One step of a listen: new updates, or progress (all times below ``upper`` done).

    Attributes:
        kind: ``"updates"`` or ``"progress"``.
        updates: for ``"updates"``, a consolidated k/v/t/d table (times kept); a typed
            shard's key and value columns instead of ``k``/``v``.
        upper: for ``"progress"``, the new frontier (``None``: the shard is closed).
    """

    kind: Literal["updates", "progress"]
    updates: pa.Table | None = None
    upper: Frontier = None


class Listen:
    """An iterator of :class:`ListenEvent` after ``as_of``; blocks waiting for new data."""

    def __init__(self, reader: ReadHandle, as_of: int) -> None:
        self._reader = reader
        #: The time this listen follows (``"latest"`` resolved): ``snapshot(as_of)`` and
        #: this listen's updates together are the whole collection.
        self.as_of = as_of
        # After the largest time (``as_of == MAX_TIME``) no update can come, but the
        # shard can still close: that listen waits for the close and reports it, as a
        # listen at any other time does. Its frontier is then past every time.
        self.frontier: Frontier = as_of + 1
        self._done = False

    def close(self) -> None:
        """Stop listening; the reader's since is no longer held back for this listen."""
        self._done = True
        self._reader._listens.discard(self)
        self._release()

    def _release(self) -> None:
        """Release the since the reader's open listens no longer hold back. Best effort:
        a failure leaves it held (never wrong), for the next move or downgrade."""
        if self._reader._expired:
            return
        with contextlib.suppress(PersistError):
            self._reader._listen_moved()

    def poll(self, timeout_s: float = 0.0) -> list[ListenEvent]:
        """Events available within ``timeout_s`` seconds (possibly none)."""
        machine = self._reader._machine
        clock = machine.clock
        deadline = clock.monotonic() + timeout_s
        while True:
            if self._done:
                return []
            with self._reader._reading_state() as state:
                if less_than(self.frontier, state.upper):
                    return self._emit(state)
            if clock.monotonic() >= deadline:
                return []
            clock.sleep(min(machine.config.listen_poll_interval_s,
                            max(0.0, deadline - clock.monotonic())))

    def _emit(self, state: State) -> list[ListenEvent]:
        lo = self.frontier
        assert lo is not None
        hi = state.upper
        if lo > MAX_TIME:
            # Past every time: only the close is left to report (``hi`` is None here).
            self.frontier = hi
            self.close()
            return [ListenEvent("progress", upper=hi)]
        batches = [b for b in state.ordered_batches
                   if less_than(lo, b.desc.upper) and less_than(b.desc.lower, hi)]
        self._check_batches(batches, lo, state)
        events = []
        # Only the parts whose time range can hold updates in [lo, hi).
        batches = [replace(b, parts=tuple(
            p for p in b.parts if not isinstance(p, HollowPart) or p.may_hold_times(lo, hi)))
            for b in batches]
        table = self._reader.fetch(batches, state)
        mask = pc.greater_equal(table.column("t"), lo)
        if hi is not None:
            mask = pc.and_(mask, pc.less(table.column("t"), hi))
        with naming_shard(state.shard_id):
            table = consolidate(table.filter(mask))
        if table.num_rows:
            if state.schema:
                table = ShardSchema.from_bytes(state.schema).decode(
                    table, f"shard {state.shard_id}")
            events.append(ListenEvent("updates", updates=table))
        events.append(ListenEvent("progress", upper=hi))
        self.frontier = hi
        # The events are taken (the frontier moved): releasing the since the listen no
        # longer needs is best effort, so a failure there does not lose them.
        if hi is None:
            self.close()
        else:
            self._release()
        return events

    @staticmethod
    def _check_batches(batches: list[Batch], lo: int, state: State) -> None:
        for b in batches:
            if b.desc.lower < lo <= b.desc.since:
                # Its updates below the frontier were advanced into times still to emit.
                raise SinceViolation(f"shard {state.shard_id}: batch {b.id} was compacted to "
                                     f"since {b.desc.since}, past this listen's frontier {lo}")

    def __iter__(self) -> Iterator[ListenEvent]:
        while not self._done:
            yield from self.poll(timeout_s=3600.0)


def check_opaque(value: object, what: str) -> bytes:
    """``value`` if it is a fencing token (bytes), else :class:`InvalidInput`: checked
    before the state is touched, so a wrong type changes nothing (and a str never reads
    as a mismatched token)."""
    if not isinstance(value, bytes):
        raise InvalidInput(f"{what} must be bytes (a fencing token), got "
                           f"{type(value).__name__}")
    return value


class CriticalReaderHandle:
    """A reader that never expires, for controllers; its since moves only by
    :meth:`compare_and_downgrade_since` with the right fencing token."""

    def __init__(self, machine: Machine, reader_id: str, opaque: bytes, debug: str = "") -> None:
        self._machine = machine
        self.reader_id = reader_id
        reader, _ = machine.apply(lambda s: transitions.register_critical_reader(
            s, reader_id, opaque, machine.now_ms(), debug))
        self._since: Frontier = reader.since
        self._opaque = reader.opaque

    @property
    def since(self) -> Frontier:
        return self._since

    @property
    def opaque(self) -> bytes:
        """The fencing token last seen (refreshed by every call)."""
        return self._opaque

    def compare_and_downgrade_since(self, expected_opaque: bytes, new_opaque: bytes,
                                    new_since: Frontier) -> Frontier:
        """Advance since to ``new_since`` and set the token, iff the token is expected.

        Raises:
            FencedOut: another controller changed the token; nothing changed.
            InvalidInput: a token that is not bytes; InvalidFrontier: a bad
                ``new_since``. Nothing changed.
        """
        check_opaque(expected_opaque, "expected_opaque")
        check_opaque(new_opaque, "new_opaque")
        since = check_frontier(new_since, "new_since")
        machine = self._machine
        result, _ = machine.apply(
            lambda s: transitions.compare_and_downgrade_critical_since(
                s, self.reader_id, expected_opaque, new_opaque, since, machine.now_ms()))
        if isinstance(result, transitions.Fenced):
            self._opaque = result.current_opaque
            raise FencedOut(expected_opaque, result.current_opaque)
        self._since, self._opaque = result.since, result.opaque
        return self._since

    def expire(self) -> None:
        """Unregister this critical reader for good, releasing its since hold."""
        machine = self._machine
        machine.apply(lambda s: transitions.expire_critical_reader(
            s, self.reader_id, machine.now_ms()))
