"""Compaction: run merge requests, flush inline parts to the main blob store.

The work is split so any engine can run it: :func:`run_merge` (stream the inputs, sorted
runs, through the k-way merge of :mod:`~persist_pipeline.internal.merge` in bounded
memory, write output parts to the main store as they fill) is a pure function of a
request, an optional key range and blob stores, safe to run on a Spark executor; the
driver then commits each result with :func:`apply_merge_result`. Output is never inlined.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow as pa

from persist_pipeline.blob.base import Blob
from persist_pipeline.config import COMPACTION_MEMORY_BOUND_BYTES
from persist_pipeline.exceptions import CorruptPart, InvalidInput, PersistError
from persist_pipeline.ids import batch_id as batch_id_of
from persist_pipeline.ids import new_token
from persist_pipeline.internal import transitions
from persist_pipeline.internal.blobs import PartWriter, ShardBlobs, in_key_range
from persist_pipeline.internal.machine import Machine
from persist_pipeline.internal.merge import ROUNDS_IN_FLIGHT, MemoryPlan, memory_plan, merge_runs
from persist_pipeline.internal.state import Batch, HollowPart, InlinePart, Part
from persist_pipeline.internal.sync import new_worker
from persist_pipeline.internal.trace import ApplyMergeOutcome, MergeReq, MergeRes, merge_requests
from persist_pipeline.schema import ShardSchema
from persist_pipeline.updates import consolidate

log = logging.getLogger(__name__)

__all__ = [
    "CompactionMetrics",
    "KeyRange",
    "MergeReq",
    "MergeRes",
    "apply_merge_result",
    "compact_shard",
    "merge_requests",
    "run_merge",
]


@dataclass(frozen=True, slots=True)
class KeyRange:
    """The keys ``k`` with ``lower <= k < upper`` (None: unbounded on that side)."""

    lower: bytes | None = None
    upper: bytes | None = None

    def filter(self, table: pa.Table) -> pa.Table:
        """The rows of ``table`` (sorted by key) whose key lies in this range."""
        return in_key_range(table, self.lower, self.upper)


def run_merge(req: MergeReq, shard_id: str, main: Blob, wal: Blob | None,
              target_size_bytes: int,
              memory_bound_bytes: int = COMPACTION_MEMORY_BOUND_BYTES,
              key_range: KeyRange | None = None, batch_id: str | None = None) -> MergeRes:
    """Consolidate a request's inputs (times advanced to its since) into output parts.

    Streams: every input batch is a sorted run, merged chunk by chunk
    (:func:`~persist_pipeline.internal.merge.merge_runs`) into parts written as they
    fill, holding about ``memory_bound_bytes`` of updates whatever the inputs' size.
    More input runs than one pass can hold are merged in passes, through temporary parts
    that no state ever references (deleted here, or by GC's orphan sweep after a crash).

    Args:
        req: the merge request.
        shard_id: its shard.
        main / wal: the blob stores (output always goes to ``main``, never inline).
        target_size_bytes: the target size of an output part.
        memory_bound_bytes: ``compaction_memory_bound_bytes``.
        key_range: merge only the keys in this range (one task of a split merge).
        batch_id: the output batch's id (the tasks of a split merge share one).
    """
    blobs = ShardBlobs(main, wal, main, wal)
    where = f"shard {shard_id} compaction"
    since = req.desc.since
    keys = key_range or KeyRange()
    batch_id = batch_id or batch_id_of(new_token())
    runs = _input_runs(blobs, req, keys, where)
    plan = memory_plan(memory_bound_bytes, len(runs), target_size_bytes)
    temporary: list[HollowPart] = []
    try:
        while len(runs) > plan.fan_in:
            # One pass over everything does not fit: merge the smallest runs into one,
            # just enough of them that the rest do (the least data written twice).
            runs.sort(key=_run_bytes)
            count = min(plan.fan_in, len(runs) - plan.fan_in + 1)
            group, runs = runs[:count], runs[count:]
            group_plan = memory_plan(memory_bound_bytes, len(group), target_size_bytes)
            writer = PartWriter(shard_id, f"{batch_id}-pass", main, "main",
                                group_plan.part_bytes)
            parts = _write_merged(writer, merge_runs(
                _sources(blobs, group, group_plan, since, keys), group_plan.chunk_bytes,
                overflow="split"))
            temporary.extend(parts)
            if parts:
                runs.append(_Run(parts, f"intermediate run of {where}"))
            plan = memory_plan(memory_bound_bytes, len(runs), target_size_bytes)
        schema = ShardSchema.from_bytes(req.schema) if req.schema else None
        writer = PartWriter(shard_id, batch_id, main, "main",
                            min(target_size_bytes, plan.part_bytes), schema)
        parts = _write_merged(writer, merge_runs(_sources(blobs, runs, plan, since, keys),
                                                 plan.chunk_bytes, overflow="split"))
    finally:
        _delete_temporary(main, temporary)
    return MergeRes(req.input_ids, Batch(batch_id, req.desc, parts,
                                         sum(p.num_updates for p in parts)))


def _write_merged(writer: PartWriter, merged: Generator[pa.Table, None, None]
                  ) -> tuple[HollowPart, ...]:
    """Write a merge's output tables as parts, encoding and uploading each on a worker
    thread while this one merges the next round (pyarrow encodes Parquet without holding
    the GIL). A round's output waits for the one before it, so at most
    :data:`~persist_pipeline.internal.merge.ROUNDS_IN_FLIGHT` is held beyond the round
    being merged, as the merge's memory plan counts. An error on either side stops both;
    parts already uploaded are left to GC's orphan sweep, as after a crash."""
    with closing(merged), new_worker(ROUNDS_IN_FLIGHT, "persist-merge-writer") as worker:
        for table in merged:
            worker.wait()
            worker.submit(partial(writer.write, table))
        worker.wait()
        writer.finish()
    return writer.parts


@dataclass(frozen=True, slots=True)
class _Run:
    """A sorted run to merge: parts in key order, or one in-memory table."""

    parts: tuple[Part, ...]
    where: str
    table: pa.Table | None = None


def _input_runs(blobs: ShardBlobs, req: MergeReq, keys: KeyRange, where: str) -> list[_Run]:
    """One run per input batch; every inline-only batch together forms one in-memory
    run (inline data is bounded by the inline policy and is in memory already)."""
    runs: list[_Run] = []
    inline: list[pa.Table] = []
    for batch in req.inputs:
        if batch.parts and all(isinstance(p, InlinePart) for p in batch.parts):
            inline.extend(keys.filter(blobs.fetch_part(p, where)) for p in batch.parts)
            continue
        for n, run in enumerate(batch.runs()):
            parts = tuple(p for p in run if not isinstance(p, HollowPart)
                          or p.may_hold_keys(keys.lower, keys.upper))
            if parts:
                runs.append(_Run(parts, f"batch {batch.id} (run {n}) of {where}"))
    if inline:
        runs.append(_Run((), f"inline parts of {where}",
                         consolidate(pa.concat_tables(inline), since=req.desc.since,
                                     overflow="split")))
    return runs


def _run_bytes(run: _Run) -> int:
    if run.table is not None:
        return int(run.table.nbytes)
    return sum(p.encoded_size for p in run.parts)


def _sources(blobs: ShardBlobs, runs: list[_Run], plan: MemoryPlan, since: int,
             keys: KeyRange) -> list[tuple[Iterator[pa.Table], str]]:
    return [(_run_chunks(blobs, run, plan, since, keys), run.where) for run in runs]


def _run_chunks(blobs: ShardBlobs, run: _Run, plan: MemoryPlan, since: int,
                keys: KeyRange) -> Iterator[pa.Table]:
    if run.table is not None:
        yield run.table
        return
    yield from blobs.stream_run(run.parts, run.where, plan.chunk_bytes // 2, plan.read_bytes,
                                key_lower=keys.lower, key_upper=keys.upper, since=since)


def _delete_temporary(main: Blob, parts: list[HollowPart]) -> None:
    for part in parts:
        try:
            main.delete(part.key)
        except PersistError as e:  # never referenced: GC's orphan sweep removes it later
            log.warning("could not delete intermediate merge part %s: %s", part.key, e)


def apply_merge_result(machine: Machine, res: MergeRes, started_s: float) -> ApplyMergeOutcome:
    """Commit a merge result from the driver; deletes its outputs if it cannot apply.

    Args:
        machine: the shard's machine.
        res: the result to commit.
        started_s: when the merge began (before any output was uploaded), on the
            machine's monotonic clock (:meth:`Machine.monotonic`): the result commits
            only within the commit deadline of that moment, so GC's orphan sweep can
            never have deleted its outputs.

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
    try:
        outcome, _ = machine.apply(lambda s: transitions.apply_merge(
            s, res, machine.now_ms(), machine.commit_deadline(started_s)))
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
    started_s = machine.monotonic()  # before any output exists: their commit deadline
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
                                cfg.blob_target_size_bytes, cfg.compaction_memory_bound_bytes)
            except CorruptPart:
                if not inputs_replaced(machine, req):
                    raise
                metrics.obsolete += 1

    by_inputs = {r.input_ids: r for r in reqs}
    for res in (executor or local)(reqs):
        outcome = apply_merge_result(machine, res, started_s)
        metrics.record(by_inputs[res.input_ids], res, outcome)
    metrics.inline_bytes_after = machine.fetch_latest().inline_bytes
    metrics.duration_s = time.monotonic() - started
    return metrics.as_dict()
