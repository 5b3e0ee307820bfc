"""Garbage collection: delete blobs no live state references, truncate consensus.

A state version is *live* from the oldest seqno any leased reader may still be reading
(its seqno hold) to the head. GC picks the newest rollup at or below that point, R, and:

1. deletes the parts referenced by versions in ``[earliest, R)`` but by none in
   ``[R, head]`` (so it never looks at blobs an in-flight write has not committed yet);
2. truncates consensus below R (R's rollup lets the state be rebuilt from there);
3. drops rollups below R from the state, then deletes their blobs;
4. optionally sweeps orphans: blobs under the shard's prefix that no live version
   references and that are older than ``gc_orphan_min_age_s`` (writes that failed
   between uploading a part and committing it). Writers refuse to commit parts older
   than half that age, so the sweep cannot race a slow commit.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from persist_pipeline.exceptions import CorruptState
from persist_pipeline.internal import state_codec, transitions
from persist_pipeline.internal.machine import Machine, now_ms, rollup_key
from persist_pipeline.internal.state import State, Store

log = logging.getLogger(__name__)

BlobRef = tuple[Store, str]


def _state_at(machine: Machine, seqno: int) -> State:
    """The state at ``seqno``, rebuilt from its rollup (or from scratch for seqno 1)."""
    if seqno <= 1:
        state = State(shard_id=machine.shard_id)
        records = machine.consensus.scan(machine.shard_id, 1, limit=1)
        if not records or records[0].seqno != 1:
            raise CorruptState(f"shard {machine.shard_id}: seqno 1 is gone but has no rollup")
        where = f"shard {machine.shard_id} seqno 1"
        return state_codec.apply_diff(state, state_codec.decode_diff(records[0].data, where),
                                      where)
    key = rollup_key(machine.shard_id, seqno)
    data = machine.blobs.main.get(key)
    if data is None:
        raise CorruptState(f"shard {machine.shard_id}: rollup {key!r} is missing")
    return state_codec.decode_state(data, f"rollup {key}")


def _refs_from(machine: Machine, start: int, end: int | None) -> tuple[set[BlobRef], int]:
    """Blobs referenced by any version in ``[start, end)`` (``end`` None: to the head)."""
    refs: set[BlobRef] = _state_at(machine, start).referenced_blobs()
    records = machine.consensus.scan(machine.shard_id, start + 1,
                                     limit=None if end is None else max(0, end - start - 1))
    last = start
    for rec in records:
        if end is not None and rec.seqno >= end:
            break
        where = f"shard {machine.shard_id} seqno {rec.seqno}"
        refs |= state_codec.diff_blob_refs(state_codec.decode_diff(rec.data, where))
        last = rec.seqno
    return refs, last


def gc_shard(machine: Machine, *, sweep_orphans: bool = True) -> dict[str, Any]:
    """Collect one shard's garbage; returns metrics."""
    started = time.monotonic()
    machine.apply(lambda s: transitions.expire_stale_leases(s, now_ms()))
    state = machine.fetch_latest()
    shard = machine.shard_id
    metrics: dict[str, Any] = {"seqnos_truncated": 0, "blobs_deleted": 0, "bytes_deleted": 0,
                               "rollups_deleted": 0, "orphans_deleted": 0, "live_blobs": 0}
    first = machine.consensus.scan(shard, 0, limit=1)
    earliest = first[0].seqno if first else state.seqno
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
    live, _ = _refs_from(machine, cut, None)
    if cut > earliest:
        old, _ = _refs_from(machine, earliest, cut)
        rollup_refs = {("main", r.key) for r in state.rollups.values() if r.seqno < cut}
        for store, key in sorted(old - live - rollup_refs):
            metrics["bytes_deleted"] += _delete(machine, store, key)
            metrics["blobs_deleted"] += 1
        metrics["seqnos_truncated"] = machine.consensus.truncate(shard, cut)
        removed, _ = machine.apply(lambda s: transitions.remove_rollups_below(s, cut, now_ms()))
        for rollup in removed:
            metrics["bytes_deleted"] += _delete(machine, "main", rollup.key)
            metrics["rollups_deleted"] += 1
    if sweep_orphans:
        metrics["orphans_deleted"] = _sweep_orphans(machine, cut)
    # GC's own commits may have started a background rollup: record it before reporting.
    machine.wait_for_maintenance(timeout_s=machine.config.retry_deadline_s)
    final = machine.fetch_latest()
    metrics["live_blobs"] = len(final.referenced_blobs())
    metrics["seqno"] = final.seqno
    metrics["earliest_seqno"] = cut
    metrics["duration_s"] = time.monotonic() - started
    return metrics


def _sweep_orphans(machine: Machine, earliest: int) -> int:
    min_age = machine.config.gc_orphan_min_age_s
    listed: list[tuple[Store, str, float]] = []
    stores: list[Store] = ["main", "wal"] if machine.blobs.wal is not None else ["main"]
    for store in stores:
        for meta in machine.blobs.store(store).list_keys(f"{machine.shard_id}/"):
            listed.append((store, meta.key, meta.last_modified))
    # Computed after listing, so a part committed meanwhile is seen as live.
    live, _ = _refs_from(machine, earliest, None)
    live |= {("main", r.key) for r in machine.fetch_latest().rollups.values()}
    cutoff = time.time() - min_age
    deleted = 0
    for store, key, modified in listed:
        if (store, key) in live or modified > cutoff:
            continue
        _delete(machine, store, key)
        deleted += 1
    return deleted


def _delete(machine: Machine, store: str, key: str) -> int:
    size = machine.blobs.store("wal" if store == "wal" else "main").delete(key)
    return size or 0
