"""The nemesis checker: the invariants of DESIGN.md, verified on one shard.

Given what writers logged (attempted and acknowledged keys), it checks that:

- every state version still in consensus decodes, in seqno order;
- upper and since only move forward across versions;
- inline bytes never exceed the max (and equal the sum of inline parts) in any version;
- no version references a blob that is missing;
- every acknowledged update is in the final snapshot exactly once (none lost, none
  doubled), and nothing appears that no writer attempted;
- after a final GC, no blob is left that no live version references (leaks).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from persist_pipeline.blob.base import Blob
from persist_pipeline.blob.local import LocalBlob
from persist_pipeline.client import PersistClient
from persist_pipeline.exceptions import CorruptData, PersistError
from persist_pipeline.frontier import less_equal
from persist_pipeline.internal import paths, state_codec
from persist_pipeline.internal.state import State


@dataclass
class CheckResult:
    """Figures and violations of one check."""

    versions: int = 0
    acked: int = 0
    attempted: int = 0
    present: int = 0
    lost: int = 0
    duplicated: int = 0
    phantom: int = 0
    leaked_blobs: int = 0
    violations: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "violations": len(self.violations)}


def _history(client: PersistClient, shard: str, result: CheckResult) -> list[State]:
    records = client.consensus.scan(shard, 0)
    if not records:
        result.violations.append(f"shard {shard} has no consensus records")
        return []
    first = records[0].seqno
    states: list[State] = []
    try:
        if first == 1:
            state = State(shard_id=shard)
        else:
            rollup = client._machine(shard).fetch_latest().rollups.get(first)
            rolled = client.blobs.fetch_rollup(rollup.key, rollup.crc32,
                                               f"rollup at seqno {first}") if rollup else None
            if rolled is None:
                result.violations.append(f"no rollup at the earliest record, seqno {first}")
                return []
            state = rolled
            states.append(state)
    except CorruptData as e:
        result.violations.append(f"state does not decode: {e}")
        return []
    for rec in records:
        if rec.seqno <= state.seqno:
            continue
        where = f"seqno {rec.seqno}"
        try:
            state = state_codec.apply_diff(state, state_codec.decode_diff(rec.data, where),
                                           where)
        except CorruptData as e:
            result.violations.append(f"state does not decode at {where}: {e}")
            return states
        states.append(state)
    return states


def check_history(client: PersistClient, shard: str, inline_max_bytes: int,
                  result: CheckResult | None = None, *, concurrent: bool = False
                  ) -> CheckResult:
    """The per-version invariants.

    With ``concurrent`` (writers, compaction and GC still running), blob existence is
    checked only for versions at or above the least seqno readers hold, taken first: GC
    may be between deleting the parts of older versions and truncating them.
    """
    result = result or CheckResult()
    live_from = client._machine(shard).fetch_latest().seqno_since() if concurrent else 0
    states = _history(client, shard, result)
    result.versions = len(states)
    listed: dict[str, set[str]] = {}
    for name, blob in (("main", client.blobs.main), ("wal", client.blobs.wal)):
        if blob is not None:
            listed[name] = {m.key for m in blob.list_keys(paths.shard_prefix(shard))}
    prev: State | None = None
    missing: set[str] = set()
    for s in states:
        if prev is not None:
            if not less_equal(prev.upper, s.upper):
                result.violations.append(f"upper went back from {prev.upper} to {s.upper} "
                                         f"at seqno {s.seqno}")
            if not less_equal(prev.since, s.since):
                result.violations.append(f"since went back from {prev.since} to {s.since} "
                                         f"at seqno {s.seqno}")
        inline = sum(b.inline_bytes for b in s.batches.values())
        if s.inline_bytes > inline_max_bytes or inline > inline_max_bytes:
            result.violations.append(f"inline bytes {max(inline, s.inline_bytes)} exceed the "
                                     f"max {inline_max_bytes} at seqno {s.seqno}")
        if inline != s.inline_bytes:
            result.violations.append(f"inline bytes recorded as {s.inline_bytes} but parts "
                                     f"hold {inline} at seqno {s.seqno}")
        for b in s.batches.values() if s.seqno >= live_from else ():
            for p in b.hollow_parts():
                if p.key not in listed.get(p.store, set()) and p.key not in missing:
                    missing.add(p.key)
                    result.violations.append(f"seqno {s.seqno} references missing blob "
                                             f"{p.store}:{p.key}")
        prev = s
    return result


def check_shard(
    client: PersistClient,
    shard: str,
    *,
    acked: Iterable[bytes],
    attempted: Iterable[bytes],
    inline_max_bytes: int,
    final_gc: bool = True,
) -> CheckResult:
    """Every invariant, once writers, compaction and GC have stopped (GC may have been
    killed halfway: the final GC finishes its work before versions are checked)."""
    result = CheckResult()
    acked_set, attempted_set = set(acked), set(attempted)
    result.acked, result.attempted = len(acked_set), len(attempted_set)
    try:
        upper = client._machine(shard).fetch_latest().upper
        counts: dict[bytes, int] = {}
        if upper is None or upper > 0:
            reader = client.open_reader(shard, debug="nemesis-checker")
            as_of = (1 << 63) - 1 if upper is None else upper - 1
            snap = reader.snapshot(as_of)
            counts = dict(zip(snap.column("k").to_pylist(), snap.column("d").to_pylist(),
                              strict=True))
            reader.expire()
    except PersistError as e:
        result.violations.append(f"final snapshot failed: {type(e).__name__}: {e}")
        return result
    result.present = len(counts)
    lost = acked_set - counts.keys()
    doubled = {k for k, d in counts.items() if d != 1}
    phantom = counts.keys() - attempted_set
    result.lost, result.duplicated, result.phantom = len(lost), len(doubled), len(phantom)
    for name, keys in (("lost", lost), ("duplicated", doubled), ("phantom", phantom)):
        if keys:
            sample = ", ".join(sorted(k.decode(errors="replace") for k in keys)[:5])
            result.violations.append(f"{len(keys)} {name} updates, e.g. {sample}")
    gc_metrics: dict[str, Any] = {}
    if final_gc:
        client.flush_maintenance()  # a rollup stored in the background is recorded first
        gc_metrics = client.gc(shard)
    check_history(client, shard, inline_max_bytes, result)
    if final_gc:
        states = _history(client, shard, CheckResult())
        live: set[tuple[str, str]] = set()
        leaked: list[str] = []
        for s in states:
            live |= {(p.store, p.key) for b in s.batches.values() for p in b.hollow_parts()}
        if states:
            live |= {("main", r.key) for r in states[-1].rollups.values()}
        for name, blob in (("main", client.blobs.main), ("wal", client.blobs.wal)):
            if blob is None:
                continue
            for meta in blob.list_keys(paths.shard_prefix(shard)):
                if (name, meta.key) not in live:
                    result.leaked_blobs += 1
                    leaked.append(f"{meta.key} ({time.time() - meta.last_modified:.0f}s old)")
            # What a writer killed mid-upload left in a local folder: no key names it, so
            # the listing above never shows it; the final GC's sweep must have taken it.
            for path in _partial_writes(blob, paths.shard_prefix(shard)):
                result.leaked_blobs += 1
                leaked.append(f"{path} (a partial upload, "
                              f"{time.time() - os.path.getmtime(path):.0f}s old)")
        if result.leaked_blobs:
            result.violations.append(f"{result.leaked_blobs} blobs left after the final GC "
                                     f"that no live state references, e.g. {leaked[:3]}; "
                                     f"final GC: {gc_metrics}")
    return result


def _partial_writes(blob: Blob, prefix: str) -> list[str]:
    """The temporary files of unfinished writes under ``prefix``, when ``blob`` (through
    its wrappers) is a local folder."""
    inner: object = blob
    while not isinstance(inner, LocalBlob) and hasattr(inner, "inner"):
        inner = inner.inner
    if not isinstance(inner, LocalBlob):
        return []
    top = inner.root.joinpath(*prefix.split("/")[:-1])
    if not top.is_dir():
        return []
    return sorted(str(p) for p in top.rglob(".tmp-*") if p.is_file())
