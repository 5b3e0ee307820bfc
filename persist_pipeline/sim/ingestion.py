"""Simulated pipeline ingestion: landed files written to both shards of the transaction
pair, exactly once, by runs that may die between their commit and their record of it,
and whose step is retried after a transient failure.

An ingester lands a file (one row, the same key in both shards), records its intent (each
shard's write id and expected upper) and commits both shards in one transaction with
those ids, as the Dagster pipeline does. Afterwards it records the file as ingested,
unless its "run" dies first: on purpose (a sixth of the time, right after the commit)
or by the simulation's crashes. Its step fails for a transient reason on a lost reply it
cannot settle, and on purpose (another sixth, right after the commit, as when reading
the shard's summary for the materialization times out): the run retries the step, up to
``STEP_RETRIES`` times, as the pipeline's retry policy does, and every attempt first
settles what was recorded, its own run's earlier attempts included. The next run of an
unrecorded file (any ingester's, once the file's owner crashed or gave up) first settles
every recorded intent with ``WriteHandle.committed`` and writes the file only if none
committed, while compaction merges the batches away and GC truncates the history.

What it checks: no file's row is in a shard twice (d is 1, never 2); every file recorded
as ingested is in both shards; a file whose earlier write could not be settled (history
truncated) is never written again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from persist_pipeline.exceptions import (
    CommitDeadlineExceeded,
    Indeterminate,
    LeaseExpired,
    NotYetAvailable,
    PersistError,
    SinceViolation,
    UpperMismatch,
)
from persist_pipeline.ids import new_token
from persist_pipeline.sim.transactions import _ledger, _open_writers, latest_diffs

if TYPE_CHECKING:
    from persist_pipeline.client import PersistClient
    from persist_pipeline.sim.runner import SimRun
    from persist_pipeline.sim.scheduler import Process
    from persist_pipeline.write import WriteHandle

#: Landed files' keys start with this.
FILE_PREFIX = b"file/"
#: How often a run re-plans a refused transaction before it gives up (the file stays
#: unrecorded: the next run takes it).
_ATTEMPTS = 4


#: How many times a run retries its step after a transient failure (the pipeline's
#: ``ingestion.retries``).
STEP_RETRIES = 2


class StepFailed(Exception):
    """A transient failure of a run's step, perhaps after its commit: the run retries it."""


@dataclass
class LandedFile:
    """One landed file and what the pipeline's event log holds about it."""

    key: bytes
    #: Every write recorded before a commit, with the run that recorded it:
    #: [(run, [(shard index, write id, expected upper)])].
    intents: list[tuple[int, list[tuple[int, str, int]]]] = field(default_factory=list)
    recorded: bool = False
    #: An earlier write's outcome could not be told: never written again.
    unsettled: bool = False
    #: The process whose run has the file (None: no run now).
    owner: Process | None = None


@dataclass
class Ingestion:
    files: list[LandedFile] = field(default_factory=list)
    count: int = 0
    runs: int = 0


def _settles(recorded_by: int, run: int) -> bool:
    """Whether run ``run`` settles a write run ``recorded_by`` recorded before writing:
    every one, its own earlier attempts' too (a step retry after a commit that landed)."""
    return True


def _settled(writers: list[WriteHandle], f: LandedFile, run_id: int) -> bool | None:
    """Whether an earlier write of ``f`` committed (None: cannot tell)."""
    for recorded_by, attempt in f.intents:
        if not _settles(recorded_by, run_id):
            continue
        for index, write_id, expected in attempt:
            found = writers[index].committed(write_id, expected)
            if found is None or found:
                return found
    return False


def _ingest(run: SimRun, client: PersistClient, writers: list[WriteHandle],
            f: LandedFile) -> None:
    """One run of ``f``'s partition: its step, retried after a transient failure; when
    the retries run out, the file stays unrecorded (a re-run takes it)."""
    ingestion: Ingestion = run.ingestion
    ingestion.runs += 1
    for _ in range(1 + STEP_RETRIES):
        try:
            _step(run, client, writers, f, ingestion.runs)
            return
        except StepFailed:
            continue


def _step(run: SimRun, client: PersistClient, writers: list[WriteHandle],
          f: LandedFile, run_id: int) -> None:
    """One attempt of a run's step: settle what earlier attempts and runs recorded, else
    write.

    Raises:
        StepFailed: a transient failure; the run retries the step.
    """
    found = _settled(writers, f, run_id)
    if found is None:
        f.unsettled = True
        return
    if found:
        f.recorded = True
        return
    for _ in range(_ATTEMPTS):
        uppers = [w.fetch_recent_upper() for w in writers]
        if any(u is None for u in uppers):
            return
        attempt = [(i, new_token(), u) for i, u in enumerate(uppers) if u is not None]
        f.intents.append((run_id, attempt))  # recorded before the commit, as the pipeline does
        txn = client.transaction()
        for i, write_id, upper in attempt:
            txn.compare_and_append(writers[i], [(f.key, b"x", upper, 1)], upper, upper + 1,
                                   idempotency_token=write_id)
        try:
            txn.commit()
        except (UpperMismatch, CommitDeadlineExceeded):
            continue
        except Indeterminate as e:
            raise StepFailed("commit outcome unknown: the retry settles it") from e
        roll = run.rng.random()
        if roll < 0.17:
            return  # the run dies before Dagster records the materialization
        if roll < 0.33:
            raise StepFailed("the materialization's summary read timed out")
        f.recorded = True
        return


def ingester(run: SimRun, proc: Process) -> None:
    """Lands files and runs them (and the unrecorded files of runs that died), with
    checks."""
    client = run.client(proc)
    ledger = _ledger(run)
    assert ledger.pair is not None
    pair = ledger.pair
    ingestion: Ingestion = run.ingestion
    writers = _open_writers(run, client, pair)
    if writers is None:
        return
    while not run.stopping:
        run.think()
        orphans = [f for f in ingestion.files if not f.recorded and not f.unsettled
                   and (f.owner is None or f.owner.crashed)]
        roll = run.rng.random()
        try:
            if roll < 0.15:
                check(run, client, "ingester")
            else:
                if orphans and roll < 0.5:
                    f = run.rng.choice(orphans)
                else:
                    ingestion.count += 1
                    f = LandedFile(FILE_PREFIX + b"%d" % ingestion.count)
                    ingestion.files.append(f)
                f.owner = proc
                try:
                    _ingest(run, client, writers, f)
                finally:
                    f.owner = None
        except LeaseExpired:
            writers = _open_writers(run, client, pair)
            if writers is None:
                return
        except (Indeterminate, NotYetAvailable, SinceViolation):
            pass
        except PersistError as e:
            run.violation(f"ingester: unexpected {type(e).__name__}: {e}")
        run.ops += 1


def check(run: SimRun, client: PersistClient, where: str) -> None:
    """No file twice in a shard; every recorded file in both."""
    ingestion: Ingestion = run.ingestion
    ledger = run.txns
    if ledger.pair is None or not ingestion.files:
        return
    recorded = [f.key for f in ingestion.files if f.recorded]  # before the reads
    for shard in ledger.pair:
        diffs = latest_diffs(client, shard, FILE_PREFIX)
        if diffs is None:
            continue
        twice = sorted(k for k, d in diffs.items() if d != 1)
        if twice:
            run.violation(f"{where}: landed file {twice[0]!r} DUPLICATED in shard {shard} "
                          f"(d={diffs[twice[0]]}): a file was ingested twice")
        for key in recorded:
            if key not in diffs:
                run.violation(f"{where}: landed file {key!r} recorded as ingested is "
                              f"missing from shard {shard}")


ROLES = {"ingester": ingester}
