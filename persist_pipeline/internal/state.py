"""The state of one shard: immutable values, changed only by pure transitions.

A :class:`State` is never mutated: transitions build a new one with
:func:`dataclasses.replace`, copying only the maps they change, so unchanged entries are
shared by identity between versions (which is also how the diff codec finds changes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Literal, NamedTuple

from persist_pipeline.frontier import Frontier, less_equal
from persist_pipeline.internal.records import quick_init

FORMAT_VERSION = 1
Store = Literal["main", "wal"]


@quick_init
@dataclass(frozen=True, slots=True)
class Description:
    """What a batch covers: updates with ``lower <= t < upper``, times advanced to ``since``."""

    lower: int
    upper: Frontier
    since: int


@dataclass(frozen=True, slots=True)
class HollowPart:
    """A Parquet part in blob storage, referenced by key.

    Every part is sorted by ``(k, v, t)`` and consolidated; the parts one writer or one
    merge writes for a batch are in key order, one sorted run (see :meth:`Batch.runs`).
    ``min_key``/``max_key`` bound its keys (inclusive, see :func:`key_bounds`); None in
    parts written before they were recorded. ``crc32`` is the CRC-32 of its bytes as
    written (:func:`checksum`), which every whole read checks; None in parts written
    before it was recorded. ``footer_crc32`` is the CRC-32 of its Parquet footer as
    written (:func:`~persist_pipeline.internal.blobs.footer_bytes`), which every read of
    the part in row groups checks (such a read reads the footer, not the whole part);
    None in parts written before it was recorded.
    """

    key: str
    store: Store
    encoded_size: int
    num_updates: int
    min_time: int
    max_time: int
    min_key: bytes | None = None
    max_key: bytes | None = None
    crc32: int | None = None
    footer_crc32: int | None = None

    def may_hold_keys(self, lower: bytes | None, upper: bytes | None) -> bool:
        """Whether the part may hold a key ``k`` with ``lower <= k < upper`` (None: open)."""
        if lower is not None and self.max_key is not None and self.max_key < lower:
            return False
        return not (upper is not None and self.min_key is not None and self.min_key >= upper)

    def may_hold_times(self, lower: int, upper: int | None) -> bool:
        """Whether the part may hold a time ``t`` with ``lower <= t < upper``."""
        return self.max_time >= lower and (upper is None or self.min_time < upper)


#: Longest key recorded whole in a part's key bounds; longer ones are cut (loose bounds).
KEY_BOUND_MAX_BYTES = 128


def key_bounds(min_key: bytes, max_key: bytes) -> tuple[bytes, bytes | None]:
    """Bounds for a part's keys that stay small in the state: a prefix of ``min_key``
    (never above it) and the shortest cut of ``max_key`` incremented (never below it;
    None when no short bound exists, e.g. a key of only ``0xff`` bytes)."""
    lower = min_key[:KEY_BOUND_MAX_BYTES]
    if len(max_key) <= KEY_BOUND_MAX_BYTES:
        return lower, max_key
    cut = max_key[:KEY_BOUND_MAX_BYTES].rstrip(b"\xff")
    if not cut:
        return lower, None
    return lower, cut[:-1] + bytes([cut[-1] + 1])


@quick_init
@dataclass(frozen=True, slots=True)
class InlinePart:
    """Updates stored inside the state as an encoded ``InlineUpdates`` protobuf."""

    part_id: str
    updates: bytes
    num_updates: int

    @property
    def encoded_size(self) -> int:
        return len(self.updates)


Part = HollowPart | InlinePart


@quick_init
@dataclass(frozen=True, slots=True)
class Batch:
    """An immutable set of updates: a description plus parts."""

    id: str
    desc: Description
    parts: tuple[Part, ...]
    num_updates: int
    #: This batch's ``Batch`` protobuf bytes, kept by the state codec
    #: (``state_codec.batch_bytes``) the first time it encodes the batch: a batch never
    #: changes, so every later rollup reuses them instead of encoding it again. Not part
    #: of equality; :func:`dataclasses.replace` drops it, and so does pickling (a batch
    #: shipped to a Spark task carries its inline updates once, not twice).
    encoded: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> tuple[str, Description, tuple[Part, ...], int]:
        return self.id, self.desc, self.parts, self.num_updates

    def __setstate__(self, state: tuple[str, Description, tuple[Part, ...], int]) -> None:
        Batch.__init__(self, *state)

    @property
    def inline_bytes(self) -> int:
        total = 0
        for p in self.parts:
            if isinstance(p, InlinePart):
                total += len(p.updates)
        return total

    @property
    def num_inline_parts(self) -> int:
        count = 0
        for p in self.parts:
            if isinstance(p, InlinePart):
                count += 1
        return count

    @property
    def num_wal_parts(self) -> int:
        count = 0
        for p in self.parts:
            if isinstance(p, HollowPart) and p.store == "wal":
                count += 1
        return count

    @property
    def encoded_size(self) -> int:
        return sum(p.encoded_size for p in self.parts)

    def hollow_parts(self) -> Iterator[HollowPart]:
        return (p for p in self.parts if isinstance(p, HollowPart))

    def runs(self) -> list[tuple[Part, ...]]:
        """The batch's parts as sorted runs: consecutive parts whose recorded key ranges
        follow each other strictly form one run (a write or a merge writes one run; a
        batch committed from parts written elsewhere, e.g. by Spark executors, may hold
        several). A part without key bounds, or inline, is a run of its own."""
        runs: list[list[Part]] = []
        previous: Part | None = None
        for part in self.parts:
            follows = (isinstance(previous, HollowPart) and isinstance(part, HollowPart)
                       and previous.max_key is not None and part.min_key is not None
                       and previous.max_key < part.min_key)
            if follows:
                runs[-1].append(part)
            else:
                runs.append([part])
            previous = part
        return [tuple(run) for run in runs]


@quick_init
@dataclass(frozen=True, slots=True)
class SpineEntry:
    """A merge group of the Spine: the batches whose lowers lie in ``[lower, upper)``."""

    lower: int
    upper: Frontier
    level: int
    num_batches: int
    num_inline_parts: int
    #: Parts in the WAL blob store. The WAL store holds fresh write parts only
    #: (compaction moves data into the main store), so they are work for compaction
    #: even in a lone batch the Spine never fuses with another.
    num_wal_parts: int = 0

    def contains(self, batch_lower: int) -> bool:
        return self.lower <= batch_lower and (self.upper is None or batch_lower < self.upper)

    @property
    def pending(self) -> bool:
        """Whether compaction has work here: several batches to merge, inline data to
        flush, or parts to move from the WAL store to the main one."""
        return self.num_batches > 1 or self.num_inline_parts > 0 or self.num_wal_parts > 0


@dataclass(frozen=True, slots=True)
class LeasedReader:
    """A reader holding ``since`` and a seqno (its blobs stay live) while it heartbeats."""

    id: str
    since: Frontier
    seqno: int
    last_heartbeat_ms: int
    lease_duration_ms: int
    debug: str = ""

    def expired(self, now_ms: int) -> bool:
        return now_ms > self.last_heartbeat_ms + self.lease_duration_ms


@dataclass(frozen=True, slots=True)
class CriticalReader:
    """A reader that never expires; changes are fenced by an opaque token."""

    id: str
    since: Frontier
    opaque: bytes
    debug: str = ""


@quick_init
@dataclass(frozen=True, slots=True)
class Writer:
    """A registered writer and the idempotency token of its latest committed write, with
    that write's bounds: ``most_recent_write_lower`` (its expected upper) is None in
    states written before it was recorded, where a retry cannot be told from a new write
    reusing the token by its lower."""

    id: str
    last_heartbeat_ms: int
    lease_duration_ms: int
    most_recent_write_token: str = ""
    most_recent_write_upper: Frontier = 0
    debug: str = ""
    most_recent_write_lower: int | None = None

    def expired(self, now_ms: int) -> bool:
        return now_ms > self.last_heartbeat_ms + self.lease_duration_ms


@dataclass(frozen=True, slots=True)
class Rollup:
    """A full copy of the state at ``seqno``, stored in the main blob store, with the
    CRC-32 of its bytes (None in rollups recorded before it was)."""

    seqno: int
    key: str
    encoded_size: int
    crc32: int | None = None


class Appended(NamedTuple):
    """What :meth:`State.note_appended` records: the maps of the state before the
    append (``before_*``), this state's, and the change. A tuple, made once per append."""

    before_batches: Mapping[str, Batch]
    before_spine: Mapping[int, SpineEntry]
    before_writers: Mapping[str, Writer]
    batches: Mapping[str, Batch]
    spine: Mapping[int, SpineEntry]
    writers: Mapping[str, Writer]
    batch_id: str | None
    writer_id: str
    #: The Spine entry the batch made (or fused into) and the lowers of the entries it
    #: absorbed besides the one at the entry's own lower, in no particular order.
    spine_change: tuple[SpineEntry, tuple[int, ...]] | None


@dataclass(frozen=True)
class State:
    """One shard's state at one seqno.

    Attributes:
        shard_id: the shard's id as text.
        seqno: the consensus record this state corresponds to (0: not yet created).
        walltime_ms: when the transition that produced it ran.
        upper: every update with ``t < upper`` is durable and complete.
        since: reads at ``as_of >= since`` are exact.
        inline_bytes: total encoded size of inline parts (bounded by the policy).
        inline_fallbacks: inline-candidate writes that went to blob (budget full).
        orphan_sweep_ms: when GC's orphan sweep last fenced commits (see :mod:`gc`).
        orphan_min_age_ms: the shard's orphan age (0: not recorded yet), the one every
            process's GC and commit deadlines go by (see :mod:`gc`).
        inline_max_bytes: the shard's ``persist_inline_update_max_bytes`` (None: not
            recorded, as in states written before it was; 0: no inlining). Every
            process inlines up to the smaller of it and its own configured max (see
            :func:`~persist_pipeline.internal.transitions.inline_write_bound`).
        batches: by batch id.
        spine: Spine entries by their lower.
        schema: a typed shard's encoded :class:`~persist_pipeline.schema.ShardSchema`
            (empty: untyped).
    """

    shard_id: str
    seqno: int = 0
    walltime_ms: int = 0
    created_ms: int = 0
    upper: Frontier = 0
    since: Frontier = 0
    inline_bytes: int = 0
    inline_fallbacks: int = 0
    orphan_sweep_ms: int = 0
    orphan_min_age_ms: int = 0
    inline_max_bytes: int | None = None
    batches: Mapping[str, Batch] = field(default_factory=dict)
    spine: Mapping[int, SpineEntry] = field(default_factory=dict)
    leased_readers: Mapping[str, LeasedReader] = field(default_factory=dict)
    critical_readers: Mapping[str, CriticalReader] = field(default_factory=dict)
    writers: Mapping[str, Writer] = field(default_factory=dict)
    rollups: Mapping[int, Rollup] = field(default_factory=dict)
    schema: bytes = b""

    def evolve(self, **changes: object) -> State:
        """This state with ``changes`` (field names): :func:`dataclasses.replace` for the
        commit path, at a fraction of its cost. The new state shares every other value
        with this one by identity (the diff codec relies on that) and none of this
        state's cached properties (they describe this state's maps, perhaps not the new
        one's).

        Raises:
            TypeError: a name in ``changes`` is not a field of :class:`State`.
        """
        if not changes.keys() <= _STATE_FIELDS:
            raise TypeError(f"State has no field(s) {sorted(changes.keys() - _STATE_FIELDS)}")
        values = self.__dict__.copy()
        for name in _CACHED:
            values.pop(name, None)
        values.update(changes)
        new = object.__new__(State)
        object.__setattr__(new, "__dict__", values)
        return new

    def note_batch_added(self, before: Mapping[str, Batch], after: Mapping[str, Batch],
                         batch_id: str) -> None:
        """Record that this state's batches map is ``after``, made as a copy of
        ``before`` plus the batch ``batch_id`` and nothing else (an append), so that the
        diff codec finds the change from a state whose batches are ``before`` with one
        lookup instead of comparing key sets that grow with the shard. Maps are never
        changed once made, so the record stays true; it is read (:attr:`batch_added`)
        only while it names both maps. Not a field: equality, repr and encodings
        ignore it; :meth:`evolve` carries it over."""
        object.__setattr__(self, "_batch_added", (before, after, batch_id))

    @property
    def batch_added(self) -> tuple[Mapping[str, Batch], Mapping[str, Batch], str] | None:
        """What :meth:`note_batch_added` recorded (or :meth:`note_appended`, of an
        append that added a batch)."""
        added: tuple[Mapping[str, Batch], Mapping[str, Batch], str] | None = \
            self.__dict__.get("_batch_added")
        if added is None:
            appended = self.appended
            if appended is not None and appended.batch_id is not None:
                return appended.before_batches, appended.batches, appended.batch_id
        return added

    def note_appended(self, before: State, batch_id: str | None, writer_id: str,
                      spine_change: tuple[SpineEntry, tuple[int, ...]] | None) -> None:
        """Record that this state is ``before`` after an append, changed only in its
        scalars, its writer ``writer_id`` (replaced) and, when ``batch_id`` is given, that
        batch added and ``spine_change`` (the entry upserted, the lowers removed) made to
        the Spine, so that the diff codec writes the append's record straight from these
        (see :func:`~persist_pipeline.internal.state_codec.encode_diff`). The maps are
        recorded, not ``before`` itself (states would otherwise hold every state before
        them); the record is read only while it names both states' maps. Not a field,
        as :meth:`note_batch_added`."""
        # tuple.__new__ directly: the named tuple's own __new__ is a Python call.
        object.__setattr__(self, "_appended", _new_tuple(Appended, (
            before.batches, before.spine, before.writers, self.batches, self.spine,
            self.writers, batch_id, writer_id, spine_change)))

    @property
    def appended(self) -> Appended | None:
        """What :meth:`note_appended` recorded."""
        appended: Appended | None = self.__dict__.get("_appended")
        return appended

    @cached_property
    def ordered_batches(self) -> tuple[Batch, ...]:
        """Batches in time order."""
        return tuple(sorted(self.batches.values(), key=lambda b: b.desc.lower))

    @cached_property
    def ordered_spine(self) -> tuple[SpineEntry, ...]:
        """Spine entries in time order (oldest, usually largest, first)."""
        return tuple(self.spine[k] for k in sorted(self.spine))

    def spine_members(self, entry: SpineEntry) -> tuple[Batch, ...]:
        """The batches of one Spine entry, in time order."""
        return tuple(b for b in self.ordered_batches if entry.contains(b.desc.lower))

    def pending_merges(self) -> int:
        return sum(1 for e in self.spine.values() if e.pending)

    def num_inline_parts(self) -> int:
        return sum(e.num_inline_parts for e in self.spine.values())

    def latest_rollup(self) -> Rollup | None:
        return self.rollups[max(self.rollups)] if self.rollups else None

    def reader_since_meet(self) -> Frontier | Literal["none"]:
        """The least since held by any reader, or ``"none"`` when there are no readers."""
        sinces = [r.since for r in self.leased_readers.values()]
        sinces += [r.since for r in self.critical_readers.values()]
        if not sinces:
            return "none"
        least: Frontier = None
        for s in sinces:
            if less_equal(s, least):
                least = s
        return least

    def seqno_since(self) -> int:
        """The least seqno any leased reader may still be reading (GC keeps it live)."""
        holds = [r.seqno for r in self.leased_readers.values()]
        return min([self.seqno, *holds])

    def referenced_blobs(self) -> set[tuple[Store, str]]:
        """Every (store, key) this state version references, rollups included."""
        keys: set[tuple[Store, str]] = {("main", r.key) for r in self.rollups.values()}
        for batch in self.batches.values():
            keys.update((p.store, p.key) for p in batch.hollow_parts())
        return keys


_new_tuple = tuple.__new__

#: The fields of a :class:`State`, and its cached properties (which
#: :meth:`State.evolve` leaves behind).
_STATE_FIELDS = frozenset(f.name for f in fields(State))
_CACHED = tuple(name for name, value in vars(State).items()
                if isinstance(value, cached_property))
