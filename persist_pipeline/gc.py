"""Garbage collection: delete blobs no live state references, truncate consensus.

A state version is *live* from the oldest seqno any leased reader may still be reading
(its seqno hold) to the head. GC picks the newest rollup at or below that point, the
cut C, and:

1. replays the records from the earliest one kept up to C and deletes the parts and
   rollups those diffs *removed* from the state. Batches are immutable and every blob key
   is written once (:mod:`persist_pipeline.internal.paths`), so nothing removed at or
   before C is referenced by C or any later version;
2. truncates consensus below C (C's rollup lets the state be rebuilt from there);
3. drops rollups below C from the state, then deletes their blobs (the versions from C
   to that commit still list them, but nothing can use them: a state is rebuilt from
   the head's latest rollup or from a cached state, and records below C are gone);
4. optionally sweeps orphans: blobs under the shard's prefix that no kept version
   references (for rollups: that the head does not list) and that are older than
   the shard's orphan age A (uploads whose commit failed, rollups a killed GC dropped),
   and what uploads killed mid-write left that no key names (a local folder's
   temporary files, :meth:`Blob.sweep_partial_writes`), by the same age.
   Writes, merge results and rollups only commit references to blobs whose upload
   started less than half that age before their transition ran, measured on the
   committer's monotonic clock (:meth:`Machine.commit_deadline`). The sweep first reads
   the store's own time T0 (:meth:`Blob.clock_now`), then commits a *fence* (a state
   change): a commit computed on an older state then loses its CaS and runs its
   transition again, after T0, where the deadline refuses any blob uploaded before
   ``T0 - A / 2``, while the sweep only deletes blobs the store
   stamped before ``T0 - A``. So every reference to such a blob is
   in a version the sweep reads, however long either side pauses. No clock is compared
   with another machine's: wall-clock skew between writers, GC and the store does not
   matter; clock *rates* must agree within a factor of two. A is recorded in the state
   (:func:`transitions.orphan_min_age_ms`): every process goes by it, never only by its
   own ``gc_orphan_min_age_s``, so processes configured differently stay safe.

Any number of GCs may run at once, or die anywhere. A GC that finds another one got
ahead of it (the rollup it starts from is gone, or records it needs were truncated)
stops and reports ``skipped``: everything it did up to then was safe on its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from persist_pipeline.exceptions import (
    BackendError,
    ClockProbeLost,
    InvalidConfig,
    PersistError,
)
from persist_pipeline.internal import paths, state_codec, transitions
from persist_pipeline.internal.machine import Machine
from persist_pipeline.internal.state import State, Store

log = logging.getLogger(__name__)

BlobRef = tuple[Store, str]


class _Overtaken(PersistError):
    """Another GC truncated or removed what this one was about to read."""


def _earliest_seqno(machine: Machine, head: State) -> int:
    first = machine.consensus.scan(machine.shard_id, 0, limit=1)
    return first[0].seqno if first else head.seqno


def _state_at(machine: Machine, head: State, seqno: int) -> State:
    """The state at ``seqno`` (the earliest record kept), from its rollup or record 1."""
    if seqno <= 1:
        records = machine.consensus.scan(machine.shard_id, 1, limit=1)
        if not records or records[0].seqno != 1:
            raise _Overtaken("seqno 1 was truncated meanwhile")
        where = f"shard {machine.shard_id} seqno 1"
        return state_codec.apply_diff(State(shard_id=machine.shard_id),
                                      state_codec.decode_diff(records[0].data, where), where)
    rollup = head.rollups.get(seqno)
    rolled = machine.blobs.fetch_rollup(rollup.key, rollup.crc32, f"rollup {rollup.key}") \
        if rollup is not None else None
    if rolled is None:
        raise _Overtaken(f"the rollup at seqno {seqno} was removed meanwhile")
    return rolled


def _records(machine: Machine, start: int, end: int | None) -> list[Any]:
    """Records ``start+1 .. end`` (to the head if ``end`` is None), exactly and in order."""
    limit = None if end is None else end - start
    records = machine.consensus.scan(machine.shard_id, start + 1, limit=limit)
    expected = start + 1
    for rec in records:
        if rec.seqno != expected:
            raise _Overtaken(f"records after seqno {start} were truncated meanwhile")
        expected += 1
    if end is not None and expected != end + 1:
        raise _Overtaken(f"records {start + 1}..{end} are no longer all there")
    return records


def _removed_up_to(machine: Machine, head: State, earliest: int, cut: int) -> set[BlobRef]:
    """Blobs that the diffs in ``(earliest, cut]`` removed from the state."""
    state = _state_at(machine, head, earliest)
    removed: set[BlobRef] = set()
    for rec in _records(machine, earliest, cut):
        where = f"shard {machine.shard_id} seqno {rec.seqno}"
        diff = state_codec.decode_diff(rec.data, where)
        for batch_id in diff.batch_deletes:
            batch = state.batches.get(batch_id)
            if batch is not None:
                removed.update((p.store, p.key) for p in batch.hollow_parts())
        for rollup_seqno in diff.rollup_deletes:
            rollup = state.rollups.get(rollup_seqno)
            if rollup is not None:
                removed.add(("main", rollup.key))
        state = state_codec.apply_diff(state, diff, where)
    return removed


def _referenced_by_kept(machine: Machine, head: State) -> set[BlobRef]:
    """Every blob any version still in consensus references (a superset of the live)."""
    earliest = _earliest_seqno(machine, head)
    refs = _state_at(machine, head, earliest).referenced_blobs()
    for rec in _records(machine, earliest, None):
        where = f"shard {machine.shard_id} seqno {rec.seqno}"
        refs |= state_codec.diff_blob_refs(state_codec.decode_diff(rec.data, where))
    return refs


def gc_shard(machine: Machine, *, sweep_orphans: bool = True) -> dict[str, Any]:
    """Collect one shard's garbage; returns metrics.

    The metrics include ``skipped``: empty, or why this GC stopped early because a
    concurrent GC got ahead of it (a later GC picks up whatever is left).

    Raises:
        InvalidConfig: parts to delete live in the WAL blob store and this client was
            opened without it; no blob was deleted and consensus was not truncated.
    """
    started = time.monotonic()
    machine.apply(lambda s: transitions.expire_stale_leases(s, machine.now_ms()))
    state = machine.fetch_latest()
    shard = machine.shard_id
    metrics: dict[str, Any] = {"seqnos_truncated": 0, "blobs_deleted": 0, "bytes_deleted": 0,
                               "rollups_deleted": 0, "orphans_deleted": 0, "live_blobs": 0,
                               "skipped": ""}
    earliest = _earliest_seqno(machine, state)
    hold = state.seqno_since()
    latest = state.latest_rollup()
    if hold == state.seqno and (latest is None or latest.seqno < hold) and hold > earliest:
        # Nobody reads an older version: a rollup of the head lets GC truncate up to it
        # now, instead of waiting for the writers' next periodic rollup.
        machine.write_rollup(state)
        state = machine.fetch_latest()
        hold = min(state.seqno_since(), state.seqno - 1)
    candidates = [s for s in state.rollups if earliest < s <= hold]
    cut = max(candidates) if candidates else earliest
    try:
        if cut > earliest:
            _collect(machine, state, earliest, cut, metrics)
        if sweep_orphans:
            metrics["orphans_deleted"] = _sweep_orphans(machine)
    except _Overtaken as e:
        metrics["skipped"] = f"another GC got ahead: {e}"
        log.info("shard %s: GC stopped early, %s", shard, metrics["skipped"])
    # GC's own commits may have started a background rollup: record it before reporting.
    machine.wait_for_maintenance(timeout_s=machine.config.retry_deadline_s)
    final = machine.fetch_latest()
    metrics["live_blobs"] = len(final.referenced_blobs())
    metrics["seqno"] = final.seqno
    metrics["earliest_seqno"] = cut
    metrics["duration_s"] = time.monotonic() - started
    return metrics


def _collect(machine: Machine, state: State, earliest: int, cut: int,
             metrics: dict[str, Any]) -> None:
    removed = _removed_up_to(machine, state, earliest, cut)
    # Defence in depth: never delete what the state GC started from still references.
    removed -= state.referenced_blobs()
    if machine.blobs.wal is None and any(store == "wal" for store, _ in removed):
        # Refused before any delete or truncation (a bad configuration gets a typed error
        # and changes nothing), rather than collecting half and truncating the records
        # that name the other half.
        raise InvalidConfig(
            f"shard {machine.shard_id}: GC must delete parts in the WAL blob store, but "
            "this client has none configured: open it with the location's WAL blob URI "
            "(wal_blob_uri / --wal-blob / PERSIST_WAL_BLOB_URI); nothing was deleted")
    for store, key in sorted(removed):
        metrics["bytes_deleted"] += _delete(machine, store, key)
        metrics["blobs_deleted"] += 1
    metrics["seqnos_truncated"] = machine.consensus.truncate(machine.shard_id, cut)
    dropped, _ = machine.apply(lambda s: transitions.remove_rollups_below(
        s, cut, machine.now_ms()))
    for rollup in dropped:
        metrics["bytes_deleted"] += _delete(machine, "main", rollup.key)
        metrics["rollups_deleted"] += 1


def _sweep_orphans(machine: Machine) -> int:
    stores: list[Store] = ["main", "wal"] if machine.blobs.wal is not None else ["main"]
    # Each store's own time, read before the fence commits: an age is its clock minus
    # its own stamp, never GC's clock minus the store's (guarantee: safe under skew).
    store_now = {store: _store_now(machine, store) for store in stores}
    # The age is the shard's (the fence records this GC's own on a shard without one),
    # never only this process's config: a GC configured with a shorter age than the
    # writers' would sweep parts they may still commit.
    age_ms, _ = machine.apply(lambda s: transitions.fence_orphan_sweep(
        s, machine.now_ms(), machine.orphan_min_age_ms))
    cutoffs = {store: now - age_ms / 1000 - machine.blobs.store(store).stamp_resolution_s
               for store, now in store_now.items()}
    listed: list[tuple[Store, str, float]] = []
    for store in stores:
        for meta in machine.blobs.store(store).list_keys(paths.shard_prefix(machine.shard_id)):
            listed.append((store, meta.key, meta.last_modified))
    # Read after the fence committed, so it holds every reference to an old blob. Of the
    # rollups only the head's count: a state is rebuilt from the head's latest rollup, GC
    # starts from the one at the earliest record (also the head's), and one a GC dropped
    # from the state (but died before deleting) is never read again.
    head = machine.fetch_latest()
    parts = {ref for ref in _referenced_by_kept(machine, head)
             if not paths.is_rollup_key(ref[1])}
    live = parts | head.referenced_blobs()
    deleted = 0
    for store, key, modified in listed:
        if (store, key) in live or modified > cutoffs[store]:
            continue
        _delete(machine, store, key)
        deleted += 1
    # What uploads that died mid-write left (a local folder's temporary files): no key
    # names them, so no listing above shows them and nothing else deletes them. Older
    # than the cutoff, their upload started too long ago for any commit to reference it.
    for store in stores:
        try:
            deleted += machine.blobs.store(store).sweep_partial_writes(
                paths.shard_prefix(machine.shard_id), cutoffs[store])
        except BackendError as e:  # left for the next GC
            log.warning("shard %s: could not sweep partial uploads in the %s store: %s",
                        machine.shard_id, store, e)
    return deleted


#: How many fresh probes GC writes before it gives up reading a store's clock (a probe
#: is only lost when this process paused past the orphan age right after writing it).
_CLOCK_PROBES = 3


def _store_now(machine: Machine, store: Store) -> float:
    """The blob store's own time (seconds), on the clock that stamps its objects."""
    blob = machine.blobs.store(store)
    for attempt in range(_CLOCK_PROBES):
        try:
            return blob.clock_now(paths.clock_probe_key(machine.shard_id))
        except ClockProbeLost:
            if attempt == _CLOCK_PROBES - 1:
                raise
    raise AssertionError("unreachable")


def _delete(machine: Machine, store: str, key: str) -> int:
    try:
        size = machine.blobs.store("wal" if store == "wal" else "main").delete(key)
    except BackendError as e:  # left for the next GC
        log.warning("shard %s: could not delete %s: %s", machine.shard_id, key, e)
        return 0
    return size or 0
