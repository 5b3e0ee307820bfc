"""Compaction: run merge requests, flush inline parts to the main blob store.

The work is split so any engine can run it: :func:`run_merge` (fetch inputs,
:func:`~persist_pipeline.updates.consolidate`, write output parts to the main store)
is a pure function of a request and blob stores, safe to run on a Spark executor; the
driver then commits each result with :func:`apply_merge_result`. Output is never inlined.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from persist_pipeline.blob.base import Blob
from persist_pipeline.exceptions import CorruptPart, InvalidInput, PersistError
from persist_pipeline.ids import new_token
from persist_pipeline.internal import transitions
from persist_pipeline.internal.blobs import ShardBlobs, write_parts
from persist_pipeline.internal.machine import Machine
from persist_pipeline.internal.state import Batch
from persist_pipeline.internal.trace import ApplyMergeOutcome, MergeReq, MergeRes, merge_requests
from persist_pipeline.updates import consolidate, empty_table

log = logging.getLogger(__name__)

__all__ = [
    "CompactionMetrics",
    "MergeReq",
    "MergeRes",
    "apply_merge_result",
    "compact_shard",
    "merge_requests",
    "run_merge",
]


def run_merge(req: MergeReq, shard_id: str, main: Blob, wal: Blob | None,
              target_size_bytes: int) -> MergeRes:
    """Consolidate a request's inputs (times advanced to its since) into output parts."""
    blobs = ShardBlobs(main, wal, main, wal)
    where = f"shard {shard_id} compaction"
    tables = [blobs.fetch_part(p, where) for b in req.inputs for p in b.parts]
    merged = consolidate(pa.concat_tables(tables), since=req.desc.since) if tables \
        else empty_table()
    batch_id = f"b{new_token()}"
    parts = write_parts(merged, shard_id, batch_id, main, "main", target_size_bytes)
    return MergeRes(req.input_ids, Batch(batch_id, req.desc, parts, merged.num_rows))


def apply_merge_result(machine: Machine, res: MergeRes, started_ms: int) -> ApplyMergeOutcome:
    """Commit a merge result from the driver; deletes its outputs if it cannot apply.

    Args:
        machine: the shard's machine.
        res: the result to commit.
        started_ms: when the merge began (before any output was uploaded), on the
            machine's clock: the result commits only within the commit deadline of that
            moment, so GC's orphan sweep can never have deleted its outputs.

    Returns:
        ``"applied"``, ``"already_applied"`` (an earlier attempt whose reply was lost),
        ``"no_match"`` (its inputs were replaced meanwhile) or ``"deadline_exceeded"``.

    Raises:
        InvalidInput: the result cannot come from a correct merge (its outputs are
            deleted; nothing changed).
        Indeterminate: whether it committed cannot be told; its outputs are left to GC.

    Outputs are deleted only when the result certainly did not commit: the CaS loop
    settles every lost reply before it gives a negative answer.
    """
    deadline = machine.commit_deadline_ms(started_ms)
    try:
        outcome, _ = machine.apply(lambda s: transitions.apply_merge(
            s, res, machine.now_ms(), deadline))
    except InvalidInput:
        _delete_outputs(machine, res)
        raise
    if outcome in ("no_match", "deadline_exceeded"):
        _delete_outputs(machine, res)
    return outcome


def _delete_outputs(machine: Machine, res: MergeRes) -> None:
    for part in res.output.hollow_parts():
        try:
            machine.blobs.main.delete(part.key)
        except PersistError as e:  # the orphan sweep of GC removes it later
            log.warning("could not delete unused compaction output %s: %s", part.key, e)


@dataclass
class CompactionMetrics:
    """What a compaction run did; ``as_dict()`` is what the API returns."""

    requests: int = 0
    applied: int = 0
    not_applied: int = 0
    parts_in: int = 0
    parts_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    updates_in: int = 0
    updates_out: int = 0
    inline_parts_in: int = 0
    inline_bytes_before: int = 0
    inline_bytes_after: int = 0
    obsolete: int = 0
    duration_s: float = 0.0
    outcomes: list[str] = field(default_factory=list)

    def record(self, req: MergeReq, res: MergeRes, outcome: ApplyMergeOutcome) -> None:
        self.parts_in += sum(len(b.parts) for b in req.inputs)
        self.inline_parts_in += sum(b.num_inline_parts for b in req.inputs)
        self.bytes_in += req.encoded_bytes
        self.updates_in += req.num_updates
        self.parts_out += len(res.output.parts)
        self.bytes_out += res.output.encoded_size
        self.updates_out += res.output.num_updates
        self.outcomes.append(outcome)
        if outcome in ("no_match", "deadline_exceeded"):
            self.not_applied += 1
        else:
            self.applied += 1

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "outcomes"}
        out["rows_per_s"] = (self.updates_in / self.duration_s) if self.duration_s else 0.0
        return out


def inputs_replaced(machine: Machine, req: MergeReq) -> bool:
    """Whether another compactor replaced some of ``req``'s inputs since it was planned.

    A merge holds no lease on its inputs: once they are replaced, GC may delete their
    parts, and the merge is simply obsolete. Only a part missing while its batch is still
    in the latest state is corruption. (Asked of consensus, never of a cached state.)
    """
    batches = machine.fetch_latest().batches
    return any(i not in batches for i in req.input_ids)


def compact_shard(
    machine: Machine,
    executor: Callable[[list[MergeReq]], Iterable[MergeRes]] | None = None,
) -> dict[str, Any]:
    """Run every pending merge request of a shard and commit the results.

    Args:
        machine: the shard's machine.
        executor: runs requests and yields results (default: in this process, one by
            one). The Spark executor plugs in here.
    """
    started = time.monotonic()
    started_ms = machine.now_ms()
    state = machine.fetch_latest()
    metrics = CompactionMetrics(inline_bytes_before=state.inline_bytes)
    reqs = merge_requests(state)
    metrics.requests = len(reqs)
    cfg = machine.config
    blobs = machine.blobs

    def local(requests: list[MergeReq]) -> Iterable[MergeRes]:
        for req in requests:
            try:
                yield run_merge(req, machine.shard_id, blobs.main, blobs.wal,
                                cfg.blob_target_size_bytes)
            except CorruptPart:
                if not inputs_replaced(machine, req):
                    raise
                metrics.obsolete += 1

    by_inputs = {r.input_ids: r for r in reqs}
    for res in (executor or local)(reqs):
        outcome = apply_merge_result(machine, res, started_ms)
        metrics.record(by_inputs[res.input_ids], res, outcome)
    metrics.inline_bytes_after = machine.fetch_latest().inline_bytes
    metrics.duration_s = time.monotonic() - started
    return metrics.as_dict()
