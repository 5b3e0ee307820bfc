"""What the simulation checks: every store change against DESIGN.md's guarantees, and
every read against a sequential model of what was acknowledged.

:class:`Monitor` sees each committed consensus record, each blob delete and each
truncation the moment it happens (the simulated stores call it), rebuilds every state
version and checks the invariants that must hold after every step. :class:`Model` keeps
what each simulated client was told (acknowledged, failed, or unknown) and checks each
snapshot and listen against it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from persist_pipeline.config import InlinePolicy
from persist_pipeline.exceptions import CorruptData
from persist_pipeline.frontier import Frontier, less_than
from persist_pipeline.internal import paths, state_codec
from persist_pipeline.internal.state import InlinePart, State
from persist_pipeline.names import is_registry_key

if TYPE_CHECKING:
    from persist_pipeline.consensus.base import VersionedData
    from persist_pipeline.sim.stores import SimBlob

BlobRef = tuple[str, str]


class Monitor:
    """Rebuilds every state version as it is committed and checks the invariants."""

    def __init__(self, shard: str, policy: InlinePolicy, violations: list[str]) -> None:
        self.shard = shard
        self.policy = policy
        #: The bound of a shard without a recorded inline max: the largest max any
        #: process is configured with.
        self.unrecorded_max_bytes = policy.max_bytes
        self.violations = violations
        self.versions: dict[int, State] = {}
        self.head = State(shard_id=shard)
        #: blob -> [first seqno referencing it, first seqno no longer referencing it]
        self.spans: dict[BlobRef, list[int | None]] = {}
        self.stores: dict[str, SimBlob] = {}
        self.earliest_kept = 1

    def violation(self, text: str) -> None:
        self.violations.append(text)

    @property
    def upper(self) -> Frontier:
        return self.head.upper

    # --- consensus -----------------------------------------------------------------------

    def on_commit(self, shard: str, record: VersionedData) -> None:
        prev = self.head
        where = f"seqno {record.seqno}"
        try:
            diff = state_codec.decode_diff(record.data, where)
            new = state_codec.apply_diff(prev, diff, where)
            state_codec.decode_summary(record.summary, where)
        except CorruptData as e:
            self.violation(f"committed state does not decode: {e}")
            return
        self._check_version(prev, new)
        for ref in _added_refs(diff):
            if ref in self.spans:
                self.violation(f"{where} references {ref[1]} again after it was removed")
                continue
            self.spans[ref] = [new.seqno, None]
            store = self.stores.get(ref[0])
            if store is None or ref[1] not in store.objects:
                self.violation(f"{where} commits a reference to missing blob {ref[1]} "
                               f"(swept or deleted before the commit)")
        for ref in _removed_refs(prev, diff):
            span = self.spans.get(ref)
            if span is not None and span[1] is None:
                span[1] = new.seqno
        self.versions[new.seqno] = new
        self.head = new

    def _check_version(self, prev: State, new: State) -> None:
        where = f"seqno {new.seqno}"
        if less_than(new.upper, prev.upper):
            self.violation(f"{where}: upper went back from {prev.upper} to {new.upper}")
        if less_than(new.since, prev.since):
            self.violation(f"{where}: since went back from {prev.since} to {new.since}")
        inline = [p for b in new.batches.values() for p in b.parts if isinstance(p, InlinePart)]
        total = sum(p.encoded_size for p in inline)
        if total != new.inline_bytes:
            self.violation(f"{where}: inline_bytes {new.inline_bytes} but parts hold {total}")
        # The bound is the shard's recorded max (the largest any process is configured
        # with while none is recorded). Above it only after it was lowered: then inline
        # bytes may stay there until compaction flushes them, but never grow.
        bound = new.inline_max_bytes
        if bound is None:
            bound = self.unrecorded_max_bytes
        if total > bound and total > prev.inline_bytes:
            self.violation(f"{where}: {total} inline bytes exceed the shard's bound "
                           f"{bound} (and grew from {prev.inline_bytes})")
        for part in inline:
            if part.encoded_size >= max(1, self.policy.threshold_bytes):
                self.violation(f"{where}: inline part of {part.encoded_size} bytes is not below "
                               f"the threshold {self.policy.threshold_bytes}")
        batches = new.ordered_batches
        for a, b in itertools.pairwise(batches):
            if a.desc.upper is None or a.desc.upper > b.desc.lower:
                self.violation(f"{where}: batches {a.id} and {b.id} overlap")
        if batches and less_than(new.upper, batches[-1].desc.upper):
            self.violation(f"{where}: a batch reaches beyond the upper {new.upper}")
        added = [b for k, b in new.batches.items() if k not in prev.batches]
        removed = [b for k, b in prev.batches.items() if k not in new.batches]
        if removed:
            for out in added:
                if out.num_inline_parts:
                    self.violation(f"{where}: compaction output {out.id} is inlined")
            lo = min(b.desc.lower for b in removed)
            if added and (added[0].desc.lower != lo or len(added) != 1):
                self.violation(f"{where}: a merge result does not replace its inputs exactly")
        holds = [r.seqno for r in new.leased_readers.values()]
        if holds and min(holds) < self.earliest_kept:
            self.violation(f"{where}: a reader holds seqno {min(holds)}, already truncated")

    def kept_history_holds(self, batch_id: str) -> bool:
        """Whether a state version still in consensus (or the head) holds the batch: then
        the batch id finds it (in the head, or in a kept record adding or removing it)."""
        return batch_id in self.head.batches or any(
            batch_id in state.batches for seqno, state in self.versions.items()
            if seqno >= self.earliest_kept)

    def on_truncate(self, shard: str, seqno: int) -> None:
        holds = [r.seqno for r in self.head.leased_readers.values()]
        if holds and seqno > min(holds):
            self.violation(f"truncation below seqno {seqno} passes a reader's hold "
                           f"{min(holds)}")
        self.earliest_kept = max(self.earliest_kept, seqno)

    # --- blobs ---------------------------------------------------------------------------

    def on_delete(self, store: str, key: str) -> None:
        span = self.spans.get((store, key))
        if span is None:
            return  # never referenced: an orphan
        if span[1] is None:
            self.violation(f"deleted blob {key} that the head (seqno {self.head.seqno}) "
                           f"references")
            return
        if paths.is_rollup_key(key):
            return  # only needed by whoever reads the head's summary
        live_from = self.head.seqno_since()
        removed = span[1]
        if removed > live_from:
            self.violation(f"deleted part {key} that live version {removed - 1} references "
                           f"(live from seqno {live_from}, head {self.head.seqno})")

    def leaked(self) -> list[str]:
        """Blobs of this shard left that no version still in consensus references."""
        out = []
        for name, store in self.stores.items():
            for key in store.objects:
                if not key.startswith(f"{self.shard}/"):
                    continue
                span = self.spans.get((name, key))
                if span is None or (span[1] is not None and span[1] <= self.earliest_kept):
                    out.append(key)
        return out


class Monitors:
    """One :class:`Monitor` per shard, made on the shard's first commit; the simulated
    stores report every change here and it goes to the shard's monitor (records of the
    name registry are not shards)."""

    def __init__(self, policy: InlinePolicy, violations: list[str]) -> None:
        self.policy = policy
        #: The largest inline max any process is configured with (see Monitor).
        self.unrecorded_max_bytes = policy.max_bytes
        self.violations = violations
        self.by_shard: dict[str, Monitor] = {}
        self.stores: dict[str, SimBlob] = {}

    def get(self, shard: str) -> Monitor:
        monitor = self.by_shard.get(shard)
        if monitor is None:
            monitor = Monitor(shard, self.policy, self.violations)
            monitor.unrecorded_max_bytes = self.unrecorded_max_bytes
            monitor.stores = self.stores
            self.by_shard[shard] = monitor
        return monitor

    def exists(self, shard: str) -> bool:
        """Whether ``shard`` has been created (committed to at least once)."""
        monitor = self.by_shard.get(shard)
        return monitor is not None and monitor.head.seqno > 0

    def on_commit(self, shard: str, record: VersionedData) -> None:
        if not is_registry_key(shard):
            self.get(shard).on_commit(shard, record)

    def on_truncate(self, shard: str, seqno: int) -> None:
        if not is_registry_key(shard):
            self.get(shard).on_truncate(shard, seqno)

    def on_delete(self, store: str, key: str) -> None:
        monitor = self.by_shard.get(key.split("/", 1)[0])
        if monitor is not None:
            monitor.on_delete(store, key)

    def leaked(self) -> list[str]:
        """Blobs no version of any shard still in consensus references (and blobs under
        no shard's prefix at all)."""
        out = [key for m in self.by_shard.values() for key in m.leaked()]
        for store in self.stores.values():
            out += [key for key in store.objects
                    if key.split("/", 1)[0] not in self.by_shard]
        return out


def _added_refs(diff: object) -> set[BlobRef]:
    return {(s, k) for s, k in state_codec.diff_blob_refs(diff)}  # type: ignore[arg-type]


def _removed_refs(prev: State, diff: object) -> set[BlobRef]:
    out: set[BlobRef] = set()
    for batch_id in diff.batch_deletes:  # type: ignore[attr-defined]
        batch = prev.batches.get(batch_id)
        if batch is not None:
            out.update((p.store, p.key) for p in batch.hollow_parts())
    for seqno in diff.rollup_deletes:  # type: ignore[attr-defined]
        rollup = prev.rollups.get(seqno)
        if rollup is not None:
            out.add(("main", rollup.key))
    return out


# --- the model of acknowledged data -------------------------------------------------------

Row = tuple[bytes, bytes, int, int]


@dataclass
class Write:
    """One compare_and_append and what its caller was told."""

    id: str
    lower: int
    rows: dict[tuple[bytes, bytes], int]
    status: str = "pending"  # pending | acked | failed | unknown
    observed: bool | None = None


@dataclass
class Model:
    """Everything clients were told, and the checks of what they read."""

    violations: list[str]
    writes: dict[str, Write] = field(default_factory=dict)
    def_attempted: set[int] = field(default_factory=set)
    def_acked: set[int] = field(default_factory=set)

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def new_write(self, wid: str, lower: int, rows: Iterable[Row]) -> Write:
        consolidated: dict[tuple[bytes, bytes], int] = defaultdict(int)
        for k, v, _t, d in rows:
            if k != b"ctr":
                consolidated[(k, v)] += d
        w = Write(wid, lower, {kv: d for kv, d in consolidated.items() if d})
        self.writes[wid] = w
        return w

    def settle(self, w: Write, status: str) -> None:
        w.status = status
        self._judge(w)

    def _observe(self, w: Write, present: bool, as_of: int) -> None:
        if w.observed is None:
            w.observed = present
        elif w.observed != present:
            self.violation(f"write {w.id} (t={w.lower}) was {'absent' if present else 'present'}"
                           f" before and is {'present' if present else 'absent'} at {as_of}")
        self._judge(w)

    def _judge(self, w: Write) -> None:
        if w.observed is False and w.status == "acked":
            self.violation(f"LOST: acknowledged write {w.id} (t={w.lower}) is missing")
        if w.observed is True and w.status == "failed":
            self.violation(f"write {w.id} (t={w.lower}) was reported as not written, but it "
                           f"is visible")

    def check(self, as_of: int, rows: Iterable[Row], where: str) -> None:
        """Check a consolidated collection at ``as_of`` against the model."""
        by_write: dict[str, dict[tuple[bytes, bytes], int]] = defaultdict(dict)
        counter = 0
        defs: dict[int, int] = {}
        for k, v, t, d in rows:
            if t != as_of:
                self.violation(f"{where}: row at time {t}, expected {as_of}")
            if k == b"ctr":
                counter += d
            elif k.startswith(b"def/"):
                defs[int(k[4:])] = d
            elif k.startswith(b"w/"):
                by_write[k.split(b"/")[1].decode()][(k, v)] = d
            else:
                self.violation(f"{where}: PHANTOM row {k!r}")
        for t0, d in defs.items():
            if d != 1:
                self.violation(f"{where}: definite update def/{t0} has diff {d} (DUPLICATED)")
            if t0 > as_of or t0 not in self.def_attempted:
                self.violation(f"{where}: PHANTOM definite update def/{t0} at as_of {as_of}")
        for t0 in self.def_acked:
            if t0 <= as_of and t0 not in defs:
                self.violation(f"{where}: LOST acknowledged definite update def/{t0}")
        for wid in by_write:
            if wid not in self.writes or self.writes[wid].lower > as_of:
                self.violation(f"{where}: PHANTOM write {wid} at as_of {as_of}")
        visible = 0
        for w in self.writes.values():
            if w.lower > as_of:
                continue
            got = by_write.get(w.id)
            if got is not None and got != w.rows:
                self.violation(f"{where}: write {w.id} reads back wrong (DUPLICATED or partial): "
                               f"{len(got)} of {len(w.rows)} rows")
            self._observe(w, got is not None, as_of)
            visible += got is not None
        if counter != visible:
            self.violation(f"{where}: counter is {counter} but {visible} writes are visible "
                           f"(a write applied twice or half)")
