"""The entry point: :class:`PersistClient` opens shards on one persist location."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from persist_pipeline.blob import check_blob_uri, open_blob
from persist_pipeline.blob.base import Blob, stores_overlap
from persist_pipeline.blob.cache import CachingBlob
from persist_pipeline.blob.retry import RetryingBlob
from persist_pipeline.compaction import compact_shard
from persist_pipeline.config import InlinePolicy, PersistConfig, shard_inline_max_bytes
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import Consensus
from persist_pipeline.consensus.retry import RetryingConsensus
from persist_pipeline.exceptions import BlobError, InvalidConfig, InvalidInput
from persist_pipeline.frontier import Frontier
from persist_pipeline.gc import gc_shard
from persist_pipeline.ids import ShardId, new_critical_reader_id, new_reader_id, new_writer_id
from persist_pipeline.internal import state_codec, transitions
from persist_pipeline.internal.blobs import ShardBlobs
from persist_pipeline.internal.clock import SYSTEM_CLOCK, Clock
from persist_pipeline.internal.funnel import Funnel
from persist_pipeline.internal.machine import Machine, MachineMetrics
from persist_pipeline.internal.state import HollowPart, InlinePart
from persist_pipeline.internal.trace import merge_requests
from persist_pipeline.names import NameRegistry, is_registry_key, refuse_new_generation_name
from persist_pipeline.read import CriticalReaderHandle, ReadHandle, check_opaque
from persist_pipeline.schema import ShardSchema
from persist_pipeline.transaction import Transaction
from persist_pipeline.verify import VerifyReport, verify_shard
from persist_pipeline.write import WriteHandle

ShardLike = ShardId | str


@dataclass(frozen=True, slots=True)
class ShardSummary:
    """A shard's vital signs, read from consensus without reading its state."""

    shard_id: str
    seqno: int
    upper: Frontier
    since: Frontier
    inline_bytes: int
    num_batches: int
    num_inline_parts: int
    pending_merges: int
    inline_fallbacks: int
    walltime_ms: int
    #: The shard's recorded inline max (None: not recorded, see ``inline_bound``).
    inline_max_bytes: int | None = None

    def inline_bound(self, configured_max_bytes: int) -> int:
        """The bound this shard's inline bytes are judged by (checks, sensors, alerts):
        see :func:`~persist_pipeline.config.shard_inline_max_bytes`."""
        return shard_inline_max_bytes(self.inline_max_bytes, configured_max_bytes)


#: The key the open-time probe reads (it never exists; reading it costs one GET).
_PROBE_KEY = "persist-probe/never-written"


def _probe(blob: Blob, what: str) -> None:
    """One cheap read of an absent key: reaches the endpoint, the bucket and the
    credentials, and changes nothing."""
    try:
        blob.get(_PROBE_KEY)
    except BlobError as e:
        raise type(e)(f"the {what} store cannot be used (checked when the client "
                      f"opened): {e}") from None


def _check_debug(debug: object) -> None:
    # Checked before a handle registers: the state codec would fail on a non-str only
    # when the registration is encoded, with an error that names no argument.
    if not isinstance(debug, str):
        raise InvalidInput(f"debug must be a str (shown in inspect), got {type(debug).__name__}")


def _check_bool(value: object, what: str) -> None:
    # A truthy string such as "no" must not create what the caller declined.
    if not isinstance(value, bool):
        raise InvalidInput(f"{what} must be True or False, got {type(value).__name__}")


def effective_config(config: PersistConfig | None, inline_policy: InlinePolicy | None,
                     env: Mapping[str, str]) -> PersistConfig:
    """The one config a client runs with, however it was given.

    The inline policy comes from ``inline_policy``, else from ``config`` if it was
    built with one, else from the environment (``PERSIST_INLINE_UPDATE_*_BYTES``), else
    the default. A keyword that contradicts a policy given in ``config`` is refused
    rather than one of them silently preferred.

    Raises:
        InvalidConfig: ``inline_policy`` differs from the policy given in ``config``,
            or the WAL blob store shares keys with the main one.
    """
    if config is not None and not isinstance(config, PersistConfig):
        raise InvalidConfig(f"config must be a PersistConfig, got {type(config).__name__}")
    if inline_policy is not None and not isinstance(inline_policy, InlinePolicy):
        raise InvalidConfig(f"inline_policy must be an InlinePolicy, got "
                            f"{type(inline_policy).__name__}")
    base = config or PersistConfig()
    if base.inline_policy_given:
        if inline_policy is not None and inline_policy != base.inline_policy:
            raise InvalidConfig(f"inline_policy={inline_policy} contradicts config."
                                f"inline_policy={base.inline_policy}: give the policy in one "
                                f"place")
        return base
    return replace(base, inline_policy=inline_policy or InlinePolicy.from_env(env))


class PersistClient:
    """A handle on one persist location: a consensus store plus blob store(s).

    Thread-safe. Handles opened from the same client share each shard's cached state.
    """

    def __init__(self, consensus: Consensus, blob: Blob, wal_blob: Blob | None = None,
                 config: PersistConfig | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        if wal_blob is not None and stores_overlap(blob, wal_blob):
            # One key would be two stores' to GC: it would delete a live part through
            # the store that does not reference it.
            raise InvalidConfig(f"the WAL blob store {wal_blob.describe()} shares keys with "
                                f"the main blob store {blob.describe()}: give the WAL a "
                                f"location of its own (another folder, bucket or prefix)")
        self.config = config or PersistConfig()
        self.clock = clock
        cache = self.config.blob_cache_bytes
        deadline = self.config.retry_deadline_s
        self.consensus: Consensus = RetryingConsensus(consensus, deadline, clock)
        blob = RetryingBlob(blob, deadline, clock)
        wal_blob = RetryingBlob(wal_blob, deadline, clock) if wal_blob is not None else None
        self.blobs = ShardBlobs(
            main=blob, wal=wal_blob,
            cached_main=CachingBlob(blob, cache) if cache else blob,
            cached_wal=(CachingBlob(wal_blob, cache) if cache else wal_blob)
            if wal_blob is not None else None)
        self.metrics = MachineMetrics()
        #: The funnel every writer of this client commits through (group commit).
        self._funnel = Funnel(clock, self.metrics, window_s=self.config.group_commit_window_s,
                              max_inflight_bytes=self.config.group_commit_max_inflight_bytes
                              ) if self.config.group_commit else None
        self._machines: dict[str, Machine] = {}
        self._lock = threading.Lock()
        # Handles whose heartbeats stop when the client closes.
        self._handles: weakref.WeakSet[WriteHandle | ReadHandle] = weakref.WeakSet()

    @classmethod
    def open(
        cls,
        consensus_uri: str | None = None,
        blob_uri: str | None = None,
        wal_blob_uri: str | None = None,
        inline_policy: InlinePolicy | None = None,
        config: PersistConfig | None = None,
        env: Mapping[str, str] | None = None,
        probe: bool = True,
        create: bool = True,
    ) -> PersistClient:
        """Open a location by URI; unset arguments come from ``PERSIST_*`` variables.

        Args:
            consensus_uri: ``postgresql://...``, ``cockroachdb://...``,
                ``sqlite:///path.db`` or ``mem://`` (``PERSIST_CONSENSUS_URI``).
            blob_uri: ``s3://bucket/prefix?endpoint_url=...``, ``file:///dir`` or
                ``mem://`` (``PERSIST_BLOB_URI``).
            wal_blob_uri: optional low-latency store for fresh write parts
                (``PERSIST_WAL_BLOB_URI``).
            inline_policy: where writes go. Without it, ``config.inline_policy`` when
                ``config`` is given, else ``PERSIST_INLINE_UPDATE_*_BYTES``.
            config: every other tunable (and the inline policy).
            env: the environment to read (default ``os.environ``).
            probe: read one (absent) key from each blob store now, so that an
                unreachable endpoint, a missing bucket or bad credentials are reported
                here rather than by the first write or compaction.
            create: create a missing SQLite file, consensus tables or ``file://``
                folder. False: open an existing location only and create nothing, so a
                caller that only reads reports a mistyped location instead of leaving
                an empty store there.

        Raises:
            InvalidUri / InvalidConfig: a malformed URI, a missing setting, or an
                ``inline_policy`` that differs from ``config.inline_policy``.
            ConsensusLocationNotFound / BlobLocationNotFound: ``create=False`` and no
                store is at a URI (a :class:`LocationNotFound`).
            BlobUnavailable / BlobLocationNotFound / BlobAuthError: the probe failed.
        """
        env = os.environ if env is None else env
        consensus_uri = consensus_uri or env.get("PERSIST_CONSENSUS_URI")
        blob_uri = blob_uri or env.get("PERSIST_BLOB_URI")
        wal_blob_uri = wal_blob_uri or env.get("PERSIST_WAL_BLOB_URI") or None
        if not consensus_uri:
            raise InvalidConfig("no consensus URI: pass consensus_uri or set "
                                "PERSIST_CONSENSUS_URI (e.g. sqlite:///persist.db)")
        if not blob_uri:
            raise InvalidConfig("no blob URI: pass blob_uri or set PERSIST_BLOB_URI "
                                "(e.g. file:///var/lib/persist)")
        cfg = effective_config(config, inline_policy, env)
        # Every URI is checked before anything is opened: a malformed one creates no
        # database file and no folder.
        check_blob_uri(blob_uri)
        if wal_blob_uri:
            check_blob_uri(wal_blob_uri)
        _check_bool(create, "create")
        consensus = open_consensus(consensus_uri, create=create)
        opened: list[Blob] = []
        try:
            blob = open_blob(blob_uri, create=create)
            opened.append(blob)
            wal = open_blob(wal_blob_uri, create=create) if wal_blob_uri else None
            if wal is not None:
                opened.append(wal)
            if probe:
                _probe(blob, "blob")
                if wal is not None:
                    _probe(wal, "WAL blob")
            return cls(consensus, blob, wal, cfg)
        except BaseException:
            for store in opened:
                store.close()
            consensus.close()
            raise

    @property
    def inline_policy(self) -> InlinePolicy:
        return self.config.inline_policy

    def _machine(self, shard: ShardLike) -> Machine:
        """The shared :class:`Machine` of a shard: internal to the library (its handles,
        the Spark compaction driver, GC); users go through handles and the methods
        here."""
        if type(shard) is str:
            # A known id is canonical (only parsed ids are keys) and machines are never
            # dropped: one dict lookup, atomic, instead of parsing the id again.
            known = self._machines.get(shard)
            if known is not None:
                return known
        shard_id = str(ShardId.parse(shard))
        with self._lock:
            m = self._machines.get(shard_id)
            if m is None:
                m = Machine(shard_id, self.consensus, self.blobs, self.config, self.metrics,
                            self.clock)
                self._machines[shard_id] = m
            return m

    def _existing(self, shard: ShardLike) -> Machine:
        m = self._machine(shard)
        m.fetch_latest()  # raises ShardNotFound
        return m

    def open_writer(self, shard: ShardLike, *, schema: ShardSchema | None = None,
                    debug: str = "") -> WriteHandle:
        """A writer; creates the shard (``since = upper = 0``) if it does not exist.

        Args:
            shard: the shard.
            schema: make (or keep) the shard typed: recorded when the shard has no
                updates yet; on a typed shard it must match the recorded one, or append
                nullable value columns to it (recorded too). Without it, the writer
                takes the shard's recorded schema, if any.
            debug: shown in ``inspect``.

        Raises:
            SchemaMismatch: ``schema`` does not fit the shard (nothing is changed).
        """
        if schema is not None and not isinstance(schema, ShardSchema):
            raise InvalidInput(f"schema must be a ShardSchema, got {type(schema).__name__}")
        _check_debug(debug)
        m = self._machine(shard)
        state = m.open(create=True)
        recorded = ShardSchema.from_bytes(state.schema) if state.schema else None
        if schema is not None:
            recorded, state = m.apply(lambda s: transitions.record_schema(s, schema,
                                                                          m.now_ms()))
        handle = WriteHandle(m, new_writer_id(), self.inline_policy,
                             self.blobs.wal is not None, debug, recorded, state.schema,
                             funnel=self._funnel)
        self._handles.add(handle)
        return handle

    def _open_table_writer(self, shard: ShardLike, schema: ShardSchema, debug: str = ""
                           ) -> WriteHandle:
        """A writer whose replacements store tables of ``schema``, for
        :mod:`persist_pipeline.tables`: as :meth:`open_writer` with ``schema``, except that
        a schema the shard does not record yet (a new shard's, or an evolution) is
        recorded by each replacement's own commit rather than now, so that a store that
        is refused leaves the shard's schema as it was (its table loads as before). A
        replacement commits only into a shard of exactly that schema: one that another
        store evolved past it meanwhile is refused (SchemaMismatch, nothing written), so
        a table never loads with columns it was not stored with.

        Raises:
            SchemaMismatch: ``schema`` does not fit the shard (nothing is changed).
        """
        _check_debug(debug)
        m = self._machine(shard)
        state = m.open(create=True)
        recorded = ShardSchema.from_bytes(state.schema) if state.schema else None
        # What the shard would record for ``schema`` (raises SchemaMismatch), not
        # recorded now: each replacement's commit records it.
        _, target = transitions.record_schema(state, schema, m.now_ms())
        handle = WriteHandle(m, new_writer_id(), self.inline_policy,
                             self.blobs.wal is not None, debug, recorded, state.schema,
                             funnel=self._funnel, table_schema=target)
        self._handles.add(handle)
        return handle

    def create_shard(self, shard: ShardLike) -> None:
        """Create the shard (``since = upper = 0``) unless it exists. Idempotent.

        A shard is also created by its first :meth:`open_writer`; a job that uploads
        parts for a shard before committing them creates it first, so that GC sweeps the
        uploads of attempts that never commit (GC only visits shards that exist).
        """
        self._machine(shard).open(create=True)

    def schema(self, shard: ShardLike) -> ShardSchema | None:
        """The shard's recorded schema (None: an untyped shard).

        Raises:
            ShardNotFound: the shard does not exist.
        """
        state = self._existing(shard).fetch_latest()
        return ShardSchema.from_bytes(state.schema) if state.schema else None

    def open_reader(self, shard: ShardLike, *, create: bool = False,
                    debug: str = "") -> ReadHandle:
        """A leased reader holding the shard's current since.

        Raises:
            ShardNotFound: the shard does not exist and ``create`` is False.
            InvalidInput: ``create`` is not a bool or ``debug`` not a str.
        """
        _check_bool(create, "create")
        _check_debug(debug)
        m = self._machine(shard)
        m.open(create=create)
        handle = ReadHandle(m, new_reader_id(), debug)
        self._handles.add(handle)
        return handle

    def open_critical_reader(self, shard: ShardLike, reader_id: str | None = None,
                             opaque: bytes = b"", *, debug: str = "") -> CriticalReaderHandle:
        """A critical reader (no lease; fenced by ``opaque``). Reuse ``reader_id`` across
        restarts to resume the same hold.

        Args:
            reader_id: a non-empty str (the ``reader_id`` of a critical reader opened
                before resumes its hold); None: a fresh id.
            opaque: the initial fencing token (bytes), kept if the reader exists.
            debug: shown in ``inspect``.

        Raises:
            ShardNotFound: the shard does not exist.
            InvalidInput: an argument of the wrong type or an empty ``reader_id``;
                nothing is registered.
        """
        if reader_id is not None and (not isinstance(reader_id, str) or not reader_id):
            # An empty id would silently mint a fresh reader on every restart, each
            # holding since back forever (critical readers never expire).
            raise InvalidInput(f"reader_id must be a non-empty str (or None for a fresh "
                               f"id), got {reader_id!r:.80}")
        check_opaque(opaque, "opaque")
        _check_debug(debug)
        m = self._existing(shard)
        return CriticalReaderHandle(m, reader_id or new_critical_reader_id(), opaque, debug)

    def inspect(self, shard: ShardLike) -> dict[str, Any]:
        """A JSON-ready description of a shard's state."""
        state = self._existing(shard).fetch_latest()
        own_max = self.inline_policy.max_bytes
        parts = [p for b in state.batches.values() for p in b.parts]
        hollow = [p for p in parts if isinstance(p, HollowPart)]
        return {
            "shard_id": state.shard_id,
            "seqno": state.seqno,
            "upper": state.upper,
            "since": state.since,
            "walltime_ms": state.walltime_ms,
            "batches": len(state.batches),
            "updates": sum(b.num_updates for b in state.batches.values()),
            "parts": {
                "inline": sum(1 for p in parts if isinstance(p, InlinePart)),
                "hollow_main": sum(1 for p in hollow if p.store == "main"),
                "hollow_wal": sum(1 for p in hollow if p.store == "wal"),
            },
            "inline_bytes": state.inline_bytes,
            # The bound the shard's inline bytes are judged by (its recorded max; not
            # recorded yet: this process's), the recorded one, and the one this
            # process's writes go by (its own max, never beyond the recorded one).
            "inline_max_bytes": shard_inline_max_bytes(state.inline_max_bytes, own_max),
            "inline_max_bytes_recorded": state.inline_max_bytes,
            "inline_max_bytes_effective": transitions.inline_write_bound(state, own_max),
            "hollow_bytes": sum(p.encoded_size for p in hollow),
            "inline_fallbacks": state.inline_fallbacks,
            # The age every process's GC and commit deadlines go by (None: not recorded
            # yet; the first orphan sweep records its own).
            "orphan_min_age_s": state.orphan_min_age_ms / 1000 if state.orphan_min_age_ms
            else None,
            "spine": [{"lower": e.lower, "upper": e.upper, "level": e.level,
                       "batches": e.num_batches, "pending": e.pending}
                      for e in state.ordered_spine],
            "pending_merge_requests": len(merge_requests(state)),
            "readers": sorted(state.leased_readers),
            "critical_readers": sorted(state.critical_readers),
            "writers": sorted(state.writers),
            "rollups": sorted(state.rollups),
            "schema": repr(ShardSchema.from_bytes(state.schema)) if state.schema else None,
        }

    def set_inline_max_bytes(self, shard: ShardLike, max_bytes: int) -> int | None:
        """Record ``max_bytes`` as the shard's ``persist_inline_update_max_bytes`` (one
        compare-and-set); returns the max recorded before (None: none was). Every
        process inlines up to the smaller of the recorded max and its own configured
        one, so raising it lets only processes configured with more inline more.
        Lowering it below the shard's inline bytes loses nothing: writes go to blob
        until compaction has flushed the inline parts. 0 turns inlining off.

        Raises:
            InvalidInput: ``max_bytes`` is not an int in ``[0, 2**64)``; nothing changed.
            ShardNotFound: the shard does not exist (nothing is created).
        """
        transitions.check_inline_max_bytes(max_bytes)
        m = self._existing(shard)
        previous, _ = m.apply(lambda s: transitions.set_inline_max_bytes(s, max_bytes,
                                                                         m.now_ms()))
        return previous

    def compact(self, shard: ShardLike) -> dict[str, Any]:
        """Run every pending merge and flush inline parts, in this process."""
        return compact_shard(self._existing(shard))

    def gc(self, shard: ShardLike, *, sweep_orphans: bool = True) -> dict[str, Any]:
        """Delete unreferenced blobs and truncate consensus; returns metrics.

        Raises:
            InvalidInput: ``sweep_orphans`` is not a bool (nothing is deleted).
        """
        _check_bool(sweep_orphans, "sweep_orphans")
        return gc_shard(self._existing(shard), sweep_orphans=sweep_orphans)

    def verify(self, shard: ShardLike, *, deep: bool = False) -> VerifyReport:
        """Check that everything the shard's latest state references is stored as
        recorded: every Parquet part and state rollup present at its recorded size,
        every inline part decodable; ``deep`` also fetches and decodes every part and
        rollup and checks its contents (update count, time and key bounds, sorted and
        consolidated). Reads only; safe beside writers, compaction and GC (a blob they
        replaced and collected meanwhile is counted as ``replaced``, not a problem).
        ``report.ok`` is False when something is lost or damaged; ``report.problems``
        says what.

        Raises:
            InvalidInput: ``deep`` is not a bool (nothing is read).
            ShardNotFound: the shard does not exist (nothing is created).
            InvalidConfig: the shard has parts in the WAL blob store and this client
                was opened without it.
        """
        _check_bool(deep, "deep")
        # Not _existing: a state that cannot be rebuilt is the report's to tell.
        return verify_shard(self._machine(shard), deep=deep)

    def list_shards(self) -> list[str]:
        """Every shard with at least one record (shard names are not shards)."""
        return sorted(k for k in self.consensus.list_shards() if not is_registry_key(k))

    def shard_summaries(self) -> dict[str, ShardSummary]:
        """Every shard's summary in one consensus query (cost independent of state size)."""
        out = {}
        for shard_id, head in self.consensus.list_heads().items():
            if is_registry_key(shard_id):
                continue  # a shard name's record (see resolve), not a shard
            s = state_codec.decode_summary(head.summary, f"shard {shard_id}")
            out[shard_id] = ShardSummary(
                shard_id, head.seqno, state_codec.frontier_from_proto(s.upper),
                state_codec.frontier_from_proto(s.since), s.inline_bytes, s.num_batches,
                s.num_inline_parts, s.pending_merges, s.inline_fallbacks, s.walltime_ms,
                s.inline_max_bytes if s.HasField("inline_max_bytes") else None)
        return out

    @functools.cached_property
    def name_registry(self) -> NameRegistry:
        """The registry of shard names on this location (see :mod:`persist_pipeline.names`)."""
        return NameRegistry(self.consensus, self.config.retry_deadline_s, self.clock)

    def resolve(self, name: str, create: bool = False) -> ShardId:
        """The id of the shard registered under ``name``.

        Names are unique and never change: of concurrent creators of one name all get the
        same id. A name may be registered before its shard is created (by the first
        ``open_writer``).

        Args:
            name: 1-200 characters of ``A-Z a-z 0-9 . _ / -``, not shaped like a shard id.
            create: register a fresh shard id under ``name`` if it has none. A name whose
                last segment is ``_v<N>`` (N > 1) is a table's generation: only that
                table's stores register it.

        Raises:
            InvalidShardName: ``name`` is malformed, or ``create`` would register a table
                generation's name (nothing is written).
            ShardNameNotFound: no such name and ``create`` is False (a ``ShardNotFound``).
            Indeterminate: consensus stayed unavailable past the retry deadline.
            InvalidInput: ``create`` is not a bool.
        """
        _check_bool(create, "create")
        registry = self.name_registry
        if create:
            refuse_new_generation_name(registry, name)
        return registry.resolve(name, create=create)

    def register_name(self, name: str, shard: ShardLike) -> ShardId:
        """Registers ``name`` for ``shard`` unless the name already has an id; returns the
        id registered under ``name`` (compare it with ``shard`` to detect a conflict).

        Raises:
            InvalidShardName: ``name`` is malformed, or is a table generation's name
                (``base/_v<N>``, N > 1) not registered yet (nothing is written).
        """
        registry = self.name_registry
        shard_id = ShardId.parse(shard)
        refuse_new_generation_name(registry, name)
        return registry.register(name, shard_id)

    def shard_names(self) -> dict[str, ShardId]:
        """Every registered shard name and its id, in one consensus query."""
        return self.name_registry.names()

    def transaction(self) -> Transaction:
        """A transaction: appends to several shards committed atomically, in one
        consensus round trip (see :class:`~persist_pipeline.transaction.Transaction`).
        Use it as a context manager to commit on a clean exit and commit nothing on an
        exception."""
        return Transaction(self)

    def flush_maintenance(self, timeout_s: float | None = None) -> None:
        """Wait for background maintenance (state rollups) started so far."""
        with self._lock:
            machines = list(self._machines.values())
        for m in machines:
            m.wait_for_maintenance(timeout_s)

    def close(self) -> None:
        """Release connections after background maintenance finishes. Open handles stop
        heartbeating and stop working; their leases run out unless another process
        expires them first. Later calls of this client and its handles raise
        :class:`~persist_pipeline.exceptions.ClientClosed`."""
        for handle in list(self._handles):
            handle.stop_heartbeats()
        with contextlib.suppress(TimeoutError):
            self.flush_maintenance(timeout_s=self.config.retry_deadline_s)
        self.consensus.close()
        self.blobs.main.close()
        if self.blobs.wal is not None:
            self.blobs.wal.close()

    def __enter__(self) -> PersistClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
