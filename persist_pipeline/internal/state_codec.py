"""State <-> protobuf: full rollups, per-seqno diffs, and the per-shard summary.

A consensus record holds the :class:`StateDiff` from ``seqno - 1`` to ``seqno``; a rollup
in blob holds the whole :class:`State`. Diffs are found by identity: a transition that did
not touch a map leaves the very same object in the new state, and unchanged entries of a
touched map are the same objects too, so a diff costs what changed, not the state's size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from persist_pipeline.exceptions import CorruptState, RollupChecksumMismatch
from persist_pipeline.frontier import Frontier
from persist_pipeline.internal import checksum
from persist_pipeline.internal.state import (
    FORMAT_VERSION,
    Appended,
    Batch,
    CriticalReader,
    Description,
    HollowPart,
    InlinePart,
    LeasedReader,
    Part,
    Rollup,
    SpineEntry,
    State,
    Store,
    Writer,
)
from persist_pipeline.proto import persist_pb2 as pb

K = TypeVar("K")
V = TypeVar("V")


# --- leaves -------------------------------------------------------------------------------


def frontier_to_proto(f: Frontier, out: pb.Frontier) -> None:
    """Set ``out``, a field of a message being built (so still empty: nothing to clear,
    and clearing costs as much as setting, nine times per state diff)."""
    if f is not None:
        out.time = f
    else:
        out.SetInParent()


def frontier_from_proto(p: pb.Frontier) -> Frontier:
    return p.time if p.HasField("time") else None


def _desc_to(d: Description, out: pb.Description) -> None:
    out.lower.time = d.lower  # lower and since are times, never empty
    frontier_to_proto(d.upper, out.upper)
    out.since.time = d.since


def _desc_from(p: pb.Description) -> Description:
    lower = frontier_from_proto(p.lower)
    since = frontier_from_proto(p.since)
    if lower is None or since is None:
        raise CorruptState("batch description with an empty lower or since")
    return Description(lower, frontier_from_proto(p.upper), since)


def description_from(p: pb.Description) -> Description:
    """A batch description decoded from a record's diff (e.g. a batch it adds)."""
    return _desc_from(p)


def _part_to(part: Part, out: pb.Part) -> None:
    if isinstance(part, HollowPart):
        h = out.hollow
        h.key, h.store, h.encoded_size = part.key, part.store, part.encoded_size
        h.num_updates, h.min_time, h.max_time = part.num_updates, part.min_time, part.max_time
        if part.min_key is not None:
            h.min_key = part.min_key
        if part.max_key is not None:
            h.max_key = part.max_key
        if part.crc32 is not None:
            h.crc32 = part.crc32
        if part.footer_crc32 is not None:
            h.footer_crc32 = part.footer_crc32
    else:
        i = out.inline
        i.part_id, i.updates, i.num_updates = part.part_id, part.updates, part.num_updates


def _part_from(p: pb.Part) -> Part:
    kind = p.WhichOneof("kind")
    if kind == "hollow":
        h = p.hollow
        if h.store not in ("main", "wal"):
            raise CorruptState(f"part {h.key!r} names unknown store {h.store!r}")
        store: Any = h.store
        return HollowPart(h.key, store, h.encoded_size, h.num_updates, h.min_time, h.max_time,
                          h.min_key if h.HasField("min_key") else None,
                          h.max_key if h.HasField("max_key") else None,
                          h.crc32 if h.HasField("crc32") else None,
                          h.footer_crc32 if h.HasField("footer_crc32") else None)
    if kind == "inline":
        i = p.inline
        return InlinePart(i.part_id, i.updates, i.num_updates)
    raise CorruptState("part with neither hollow nor inline contents")


def _batch_to(b: Batch, out: pb.Batch) -> None:
    out.id = b.id
    _desc_to(b.desc, out.desc)
    for part in b.parts:
        _part_to(part, out.parts.add())
    out.num_updates = b.num_updates


def _batch_from(p: pb.Batch) -> Batch:
    return Batch(p.id, _desc_from(p.desc), tuple(_part_from(x) for x in p.parts), p.num_updates)


#: The tag of ``State.batches`` (field 5, length-delimited).
_BATCHES_TAG = bytes(((5 << 3) | 2,))
assert pb.State.DESCRIPTOR.fields_by_name["batches"].number == 5


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _keep(b: Batch, encoded: pb.Batch) -> None:
    """Keep ``encoded`` (``b`` as a message) serialized on ``b`` for later rollups.

    Set on a frozen instance on purpose: a cache of the value's own encoding, never a
    change of the value (two threads racing here store equal bytes)."""
    object.__setattr__(b, "encoded", encoded.SerializeToString())


def batch_bytes(b: Batch) -> bytes:
    """``b``'s ``Batch`` message bytes, encoded at most once per batch (batches are
    immutable): kept on the batch by the first diff or rollup that holds it."""
    data = b.encoded
    if data is None:
        msg = pb.Batch()
        _batch_to(b, msg)
        _keep(b, msg)
        data = b.encoded
        assert data is not None
    return data


def _spine_to(e: SpineEntry, out: pb.SpineEntry) -> None:
    out.lower, out.level = e.lower, e.level
    frontier_to_proto(e.upper, out.upper)
    out.num_batches, out.num_inline_parts = e.num_batches, e.num_inline_parts
    out.num_wal_parts = e.num_wal_parts  # always present (absent: an older record)


#: ``SpineEntry.num_wal_parts`` of an entry recorded before the count existed, until
#: :func:`_with_wal_counts` counts it from the state's batches.
_UNCOUNTED = -1


def _spine_from(p: pb.SpineEntry) -> SpineEntry:
    return SpineEntry(p.lower, frontier_from_proto(p.upper), p.level, p.num_batches,
                      p.num_inline_parts,
                      p.num_wal_parts if p.HasField("num_wal_parts") else _UNCOUNTED)


def _with_wal_counts(spine: Mapping[int, SpineEntry], batches: Mapping[str, Batch]
                     ) -> Mapping[int, SpineEntry]:
    """``spine`` with the WAL parts of entries recorded before they were counted
    counted from ``batches`` (so that compaction moves those parts out of the WAL store
    too); ``spine`` itself when every entry has its count."""
    if all(e.num_wal_parts != _UNCOUNTED for e in spine.values()):
        return spine
    counted = dict(spine)
    for lower, e in spine.items():
        if e.num_wal_parts == _UNCOUNTED:
            wal = sum(b.num_wal_parts for b in batches.values() if e.contains(b.desc.lower))
            counted[lower] = replace(e, num_wal_parts=wal)
    return counted


def _reader_to(r: LeasedReader, out: pb.LeasedReader) -> None:
    out.id, out.seqno, out.debug = r.id, r.seqno, r.debug
    frontier_to_proto(r.since, out.since)
    out.last_heartbeat_ms, out.lease_duration_ms = r.last_heartbeat_ms, r.lease_duration_ms


def _reader_from(p: pb.LeasedReader) -> LeasedReader:
    return LeasedReader(p.id, frontier_from_proto(p.since), p.seqno, p.last_heartbeat_ms,
                        p.lease_duration_ms, p.debug)


def _critical_to(r: CriticalReader, out: pb.CriticalReader) -> None:
    out.id, out.opaque, out.debug = r.id, r.opaque, r.debug
    frontier_to_proto(r.since, out.since)


def _critical_from(p: pb.CriticalReader) -> CriticalReader:
    return CriticalReader(p.id, frontier_from_proto(p.since), p.opaque, p.debug)


def _writer_to(w: Writer, out: pb.Writer) -> None:
    out.id, out.debug = w.id, w.debug
    out.last_heartbeat_ms, out.lease_duration_ms = w.last_heartbeat_ms, w.lease_duration_ms
    out.most_recent_write_token = w.most_recent_write_token
    frontier_to_proto(w.most_recent_write_upper, out.most_recent_write_upper)
    if w.most_recent_write_lower is not None:
        out.most_recent_write_lower = w.most_recent_write_lower


def _writer_from(p: pb.Writer) -> Writer:
    # Absent in states written before the lower was recorded: None, "cannot tell".
    lower = p.most_recent_write_lower if p.HasField("most_recent_write_lower") else None
    return Writer(p.id, p.last_heartbeat_ms, p.lease_duration_ms, p.most_recent_write_token,
                  frontier_from_proto(p.most_recent_write_upper), p.debug, lower)


def _rollup_to(r: Rollup, out: pb.Rollup) -> None:
    out.seqno, out.key, out.encoded_size = r.seqno, r.key, r.encoded_size
    if r.crc32 is not None:
        out.crc32 = r.crc32


def _rollup_from(p: pb.Rollup) -> Rollup:
    return Rollup(p.seqno, p.key, p.encoded_size, p.crc32 if p.HasField("crc32") else None)


def _scalars_to(s: State, out: pb.Scalars) -> None:
    out.walltime_ms, out.created_ms = s.walltime_ms, s.created_ms
    # frontier_to_proto, written out: this runs in every commit.
    if s.upper is not None:
        out.upper.time = s.upper
    else:
        out.upper.SetInParent()
    if s.since is not None:
        out.since.time = s.since
    else:
        out.since.SetInParent()
    out.inline_bytes, out.inline_fallbacks = s.inline_bytes, s.inline_fallbacks
    out.orphan_sweep_ms, out.orphan_min_age_ms = s.orphan_sweep_ms, s.orphan_min_age_ms
    if s.inline_max_bytes is not None:  # absent: not recorded (0 is a recorded value)
        out.inline_max_bytes = s.inline_max_bytes


def _scalars_from(p: pb.Scalars) -> dict[str, Any]:
    return {
        "walltime_ms": p.walltime_ms,
        "created_ms": p.created_ms,
        "upper": frontier_from_proto(p.upper),
        "since": frontier_from_proto(p.since),
        "inline_bytes": p.inline_bytes,
        "inline_fallbacks": p.inline_fallbacks,
        "orphan_sweep_ms": p.orphan_sweep_ms,
        "orphan_min_age_ms": p.orphan_min_age_ms,
        "inline_max_bytes": p.inline_max_bytes if p.HasField("inline_max_bytes") else None,
    }


# --- full state (rollups) -----------------------------------------------------------------


def encode_state(state: State) -> bytes:
    """The whole state, deterministically (maps in key order), as ``State`` protobuf."""
    # A message's encoding is its fields' encodings in field-number order, and a repeated
    # message field's is each element's tag, length and bytes: so fields 1-4, then the
    # batches (field 5) from their kept bytes, then fields 6-11 are exactly the bytes
    # SerializeToString gives for the whole message, with no batch encoded again.
    head = pb.State(format_version=FORMAT_VERSION, shard_id=state.shard_id, seqno=state.seqno)
    _scalars_to(state, head.scalars)
    batches = state.batches
    encoded = [head.SerializeToString(deterministic=True)]
    for k in sorted(batches):
        data = batch_bytes(batches[k])
        n = len(data)
        encoded.append(_BATCHES_TAG + (bytes((n,)) if n < 0x80 else _varint(n)))
        encoded.append(data)
    msg = pb.State()
    for lo in sorted(state.spine):
        _spine_to(state.spine[lo], msg.spine.add())
    for k in sorted(state.leased_readers):
        _reader_to(state.leased_readers[k], msg.leased_readers.add())
    for k in sorted(state.critical_readers):
        _critical_to(state.critical_readers[k], msg.critical_readers.add())
    for k in sorted(state.writers):
        _writer_to(state.writers[k], msg.writers.add())
    for seqno in sorted(state.rollups):
        _rollup_to(state.rollups[seqno], msg.rollups.add())
    msg.schema = state.schema
    encoded.append(msg.SerializeToString(deterministic=True))
    return b"".join(encoded)


def decode_rollup(data: bytes, crc32: int | None, where: str) -> State:
    """Decode a rollup's bytes after checking them against the CRC-32 recorded for it
    (None: none was); raises :class:`RollupChecksumMismatch` or :class:`CorruptState`
    naming ``where``. Every read of a rollup goes through here: a rollup whose bytes
    changed in the store could otherwise decode into a wrong state."""
    checksum.check(data, crc32, where, RollupChecksumMismatch)
    return decode_state(data, where)


def decode_state(data: bytes, where: str) -> State:
    """Decode a rollup; raises :class:`CorruptState` naming ``where`` on garbage."""
    msg = pb.State()
    try:
        msg.ParseFromString(data)
        _check_version(msg.format_version, where)
        batches = {b.id: _batch_from(b) for b in msg.batches}
        return State(
            shard_id=msg.shard_id,
            seqno=msg.seqno,
            batches=batches,
            spine=_with_wal_counts({e.lower: _spine_from(e) for e in msg.spine}, batches),
            leased_readers={r.id: _reader_from(r) for r in msg.leased_readers},
            critical_readers={r.id: _critical_from(r) for r in msg.critical_readers},
            writers={w.id: _writer_from(w) for w in msg.writers},
            rollups={r.seqno: _rollup_from(r) for r in msg.rollups},
            schema=msg.schema,
            **_scalars_from(msg.scalars),
        )
    except (DecodeError, ValueError, TypeError) as e:
        raise CorruptState(f"corrupt state rollup at {where}: {e}") from None


def _check_version(version: int, where: str) -> None:
    if version != FORMAT_VERSION:
        raise CorruptState(f"{where}: unsupported state format version {version} "
                           f"(this build reads {FORMAT_VERSION})")


# --- diffs --------------------------------------------------------------------------------


def _map_diff(old: Mapping[K, V], new: Mapping[K, V]) -> tuple[list[V], list[K]]:
    if old is new:
        return [], []
    upserts = []
    for k, v in new.items():  # a loop, not a comprehension: maps here are small
        if old.get(k) is not v:
            upserts.append(v)
    # Usually nothing was removed, which the key views tell in C.
    deletes = [] if old.keys() <= new.keys() else [k for k in old if k not in new]
    return upserts, deletes


def _batch_diff(old: State, new: State) -> tuple[list[Batch], list[str]]:
    """The batches added and removed from ``old`` to ``new``: as the append that made
    ``new`` noted (:meth:`State.note_batch_added`), else by comparing the maps."""
    added = new.batch_added
    if added is not None and added[0] is old.batches and added[1] is new.batches:
        return [new.batches[added[2]]], []
    return _immutable_map_diff(old.batches, new.batches)


def _immutable_map_diff(old: Mapping[K, V], new: Mapping[K, V]) -> tuple[list[V], list[K]]:
    """The diff of a map whose entries never change once written (batches, rollups):
    only added and removed keys matter, found by set operations in C."""
    if old is new:
        return [], []
    if isinstance(new, dict) and len(new) == len(old) + 1:
        # The common change, one entry added (an append's batch): maps keep insertion
        # order, so it is the last one; the subset test proves nothing else changed,
        # without building the two key sets.
        last: K = next(reversed(new))
        if last not in old and old.keys() <= new.keys():
            return [new[last]], []
    return [new[k] for k in new.keys() - old.keys()], list(old.keys() - new.keys())


@dataclass(frozen=True)
class _MapField:
    """How one map of the state travels in a diff."""

    attr: str  # the State attribute
    upserts: str  # the StateDiff repeated message field
    deletes: str  # the StateDiff repeated key field
    to_proto: Callable[[Any, Any], None]
    from_proto: Callable[[Any], Any]
    key: Callable[[Any], Any]
    immutable: bool  # entries never change once written: diff by key sets


_MAP_FIELDS = (
    _MapField("batches", "batch_upserts", "batch_deletes", _batch_to, _batch_from,
              lambda b: b.id, True),
    _MapField("spine", "spine_upserts", "spine_deletes", _spine_to, _spine_from,
              lambda e: e.lower, False),
    _MapField("leased_readers", "reader_upserts", "reader_deletes", _reader_to, _reader_from,
              lambda r: r.id, False),
    _MapField("critical_readers", "critical_upserts", "critical_deletes", _critical_to,
              _critical_from, lambda c: c.id, False),
    _MapField("writers", "writer_upserts", "writer_deletes", _writer_to, _writer_from,
              lambda w: w.id, False),
    _MapField("rollups", "rollup_upserts", "rollup_deletes", _rollup_to, _rollup_from,
              lambda r: r.seqno, True),
)


def encode_diff(old: State, new: State) -> bytes:
    """The ``StateDiff`` that turns ``old`` into ``new`` (``new.seqno == old.seqno + 1``).

    An append noted by its transition (:meth:`State.note_appended`) is written from
    what the note says it changed (:func:`_appended_diff`), without comparing maps;
    any other diff is written out map by map (in :data:`_MAP_FIELDS` order) rather than
    looping over them: it runs in every commit, and most maps are shared by both
    states. Both give the same bytes for an append.
    """
    appended = new.appended
    if appended is not None and _note_describes(appended, old, new):
        return _appended_diff(new, appended, old.spine)
    msg = pb.StateDiff(format_version=FORMAT_VERSION, shard_id=new.shard_id, seqno=new.seqno)
    _scalars_to(new, msg.scalars)
    if old.batches is not new.batches:
        upserts, deletes = _batch_diff(old, new)
        if upserts:
            out = msg.batch_upserts
            for b in upserts:
                element = out.add()
                _batch_to(b, element)
                if b.encoded is None:
                    _keep(b, element)  # for the rollups that will hold it
        if deletes:
            msg.batch_deletes.extend(deletes)
    if old.spine is not new.spine:
        _emit(_map_diff(old.spine, new.spine), msg, "spine_upserts", "spine_deletes",
              _spine_to)
    if old.leased_readers is not new.leased_readers:
        _emit(_map_diff(old.leased_readers, new.leased_readers), msg, "reader_upserts",
              "reader_deletes", _reader_to)
    if old.critical_readers is not new.critical_readers:
        _emit(_map_diff(old.critical_readers, new.critical_readers), msg, "critical_upserts",
              "critical_deletes", _critical_to)
    if old.writers is not new.writers:
        _emit(_map_diff(old.writers, new.writers), msg, "writer_upserts", "writer_deletes",
              _writer_to)
    if old.rollups is not new.rollups:
        _emit(_immutable_map_diff(old.rollups, new.rollups), msg, "rollup_upserts",
              "rollup_deletes", _rollup_to)
    if new.schema != old.schema:
        msg.schema = new.schema
    return msg.SerializeToString()


def _note_describes(appended: Appended, old: State, new: State) -> bool:
    """Whether the note of an append in ``new`` tells every change from ``old`` to
    ``new`` besides the scalars: ``old`` has the maps the append started from, ``new``
    those it made, and no other map nor the schema changed (a rollup folded into the
    commit, a schema recorded with the append: then the maps are compared)."""
    return (old.batches is appended.before_batches and new.batches is appended.batches
            and old.spine is appended.before_spine and new.spine is appended.spine
            and old.writers is appended.before_writers and new.writers is appended.writers
            and old.leased_readers is new.leased_readers and old.rollups is new.rollups
            and old.critical_readers is new.critical_readers
            and (old.schema is new.schema or old.schema == new.schema))


def _appended_diff(new: State, appended: Appended, old_spine: Mapping[int, SpineEntry]
                   ) -> bytes:
    """:func:`encode_diff` of an append its note describes (:func:`_note_describes`):
    the entries the map comparison would find, in the order it lists them: the
    append's batch, the Spine entry it made and the keys it removed (in the old
    Spine's order), and its writer."""
    msg = pb.StateDiff(format_version=FORMAT_VERSION, shard_id=new.shard_id, seqno=new.seqno)
    _scalars_to(new, msg.scalars)
    if appended.batch_id is not None:
        batch = new.batches[appended.batch_id]
        element = msg.batch_upserts.add()
        _batch_to(batch, element)
        if batch.encoded is None:
            _keep(batch, element)  # for the rollups that will hold it
        assert appended.spine_change is not None
        entry, removed = appended.spine_change
        _spine_to(entry, msg.spine_upserts.add())
        if removed:
            if len(removed) > 1:
                gone = set(removed)
                removed = tuple(k for k in old_spine if k in gone)
            msg.spine_deletes.extend(removed)
    _writer_to(new.writers[appended.writer_id], msg.writer_upserts.add())
    return msg.SerializeToString()


def _emit(diff: tuple[list[Any], list[Any]], msg: pb.StateDiff, upserts: str, deletes: str,
          to_proto: Callable[[Any, Any], None]) -> None:
    """Add a map's upserted entries and deleted keys to ``msg`` (its repeated fields are
    only touched when there is something to add: each access makes a wrapper)."""
    ups, dels = diff
    if ups:
        out = getattr(msg, upserts)
        for value in ups:
            to_proto(value, out.add())
    if dels:
        getattr(msg, deletes).extend(dels)


def decode_diff(data: bytes, where: str) -> pb.StateDiff:
    msg = pb.StateDiff()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise CorruptState(f"corrupt state diff at {where}: {e}") from None
    _check_version(msg.format_version, where)
    return msg


def _apply_map(
    old: Mapping[K, V], upserts: list[V], deletes: list[K], key: Callable[[V], K]
) -> Mapping[K, V]:
    if not upserts and not deletes:
        return old
    out = dict(old)
    for k in deletes:
        out.pop(k, None)
    for v in upserts:
        out[key(v)] = v
    return out


def apply_diff(state: State, diff: pb.StateDiff, where: str) -> State:
    """Apply a decoded diff; raises :class:`CorruptState` if it does not follow ``state``."""
    if diff.seqno != state.seqno + 1:
        raise CorruptState(f"{where}: diff for seqno {diff.seqno} cannot follow seqno "
                           f"{state.seqno}")
    if state.shard_id and diff.shard_id != state.shard_id:
        raise CorruptState(f"{where}: diff belongs to shard {diff.shard_id!r}")
    try:
        maps: dict[str, Any] = {f.attr: _apply_map(getattr(state, f.attr),
                                   [f.from_proto(v) for v in getattr(diff, f.upserts)],
                                   list(getattr(diff, f.deletes)), f.key)
                for f in _MAP_FIELDS}
        if maps["spine"] is not state.spine:  # entries this diff upserted
            maps["spine"] = _with_wal_counts(maps["spine"], maps["batches"])
        schema = diff.schema if diff.HasField("schema") else state.schema
        return replace(state, shard_id=diff.shard_id, seqno=diff.seqno, **maps,
                       schema=schema, **_scalars_from(diff.scalars))
    except (ValueError, TypeError) as e:
        raise CorruptState(f"corrupt state diff at {where}: {e}") from None


def diff_blob_refs(diff: pb.StateDiff) -> set[tuple[Store, str]]:
    """Blobs that a diff adds references to (parts of upserted batches, new rollups)."""
    refs: set[tuple[Store, str]] = {("main", r.key) for r in diff.rollup_upserts}
    for b in diff.batch_upserts:
        for p in b.parts:
            if p.WhichOneof("kind") == "hollow":
                refs.add(("wal" if p.hollow.store == "wal" else "main", p.hollow.key))
    return refs


# --- summary ------------------------------------------------------------------------------


def encode_summary(state: State) -> bytes:
    msg = pb.ShardSummary()
    frontier_to_proto(state.upper, msg.upper)
    frontier_to_proto(state.since, msg.since)
    msg.inline_bytes = state.inline_bytes
    msg.num_batches = len(state.batches)
    # State.num_inline_parts() and pending_merges(), in one pass over the spine.
    inline_parts = pending = 0
    for entry in state.spine.values():
        parts = entry.num_inline_parts
        inline_parts += parts
        if entry.num_batches > 1 or parts > 0 or entry.num_wal_parts > 0:  # .pending
            pending += 1
    msg.num_inline_parts = inline_parts
    msg.pending_merges = pending
    msg.walltime_ms = state.walltime_ms
    msg.inline_fallbacks = state.inline_fallbacks
    if state.inline_max_bytes is not None:
        msg.inline_max_bytes = state.inline_max_bytes
    if state.rollups:
        latest = state.rollups[max(state.rollups)]  # State.latest_rollup()
        msg.latest_rollup_seqno = latest.seqno
        msg.latest_rollup_key = latest.key
        if latest.crc32 is not None:
            msg.latest_rollup_crc32 = latest.crc32
    return msg.SerializeToString()


def decode_summary(data: bytes, where: str) -> pb.ShardSummary:
    msg = pb.ShardSummary()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise CorruptState(f"corrupt shard summary at {where}: {e}") from None
    return msg
