"""Simulated read plans: the version a plan was made from, held while compaction moves
its parts (WAL parts to the main store too) and GC collects and truncates.

A plan (:meth:`ReadHandle.snapshot_plan`) holds the state version it read with the
reader's seqno hold and is read later, by another engine, from that version's parts. The
simulated stores are in this process's memory, which plans refuse (no other engine
reaches them), so the actor takes and releases the plan's hold as ``snapshot_plan`` and
``close()`` do, and reads the version's parts through the reader as its engine would,
after a pause: heartbeats meanwhile must keep the parts; a holder paused past its lease
must get ``LeaseExpired`` (its reader gone from consensus), never missing or wrong rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from persist_pipeline.exceptions import (
    Indeterminate,
    InvalidFrontier,
    LeaseExpired,
    NotYetAvailable,
    PersistError,
    SinceViolation,
)
from persist_pipeline.frontier import less_than
from persist_pipeline.sim.actors import Holder, _check_expired, _open_reader, _rows, _unexpected
from persist_pipeline.sim.scheduler import Process
from persist_pipeline.updates import consolidate, naming_shard

if TYPE_CHECKING:
    from persist_pipeline.read import ReadHandle
    from persist_pipeline.sim.runner import SimRun

#: The share of plans whose holder pauses past its reader's lease before reading.
PAUSED_PAST_LEASE = 0.15


def plan_reader(run: SimRun, proc: Process) -> None:
    """Plans of the main shard, each held across a few heartbeats (or a pause past the
    lease) while other processes compact and collect, then read and checked."""
    client = run.client(proc)
    holder = Holder()
    if _open_reader(run, client, holder) is None:
        return
    while not run.stopping:
        run.think()
        reader = holder.value
        if reader is None:
            return
        upper = run.monitor.upper
        if upper is None or upper == 0 or holder.since > upper - 1:
            continue
        try:
            _one_plan(run, reader, run.rng.randint(holder.since, upper - 1))
        except LeaseExpired:
            _check_expired(run, reader.reader_id, "plan")
            _open_reader(run, client, holder)
        except (Indeterminate, InvalidFrontier, NotYetAvailable, SinceViolation):
            pass
        except PersistError as e:
            _unexpected(run, "plan read", e)
        run.ops += 1


def _one_plan(run: SimRun, reader: ReadHandle, as_of: int) -> None:
    state = reader._start_reading()  # what snapshot_plan holds
    try:
        t = reader._check_as_of(as_of, state)
        if not less_than(t, state.upper):
            return
        batches = [b for b in state.ordered_batches if b.desc.lower <= t]
        if run.rng.random() < PAUSED_PAST_LEASE:
            run.clock.sleep(run.config.reader_lease_duration_s * 1.5)
        else:
            _hold_with_heartbeats(run, reader.heartbeat)
        table = reader.fetch(batches, state)  # LeaseExpired if its parts went with it
        with naming_shard(run.shard):
            rows = consolidate(table, as_of=t)
        run.model.check(t, _rows(rows), f"plan at {t} (seqno {state.seqno})")
    finally:
        reader._stop_reading(state, heartbeat=True)  # what close() releases


#: How long a plan is read after it was made, with heartbeats (seconds).
HOLD_S = (0.5, 3.0)


def _hold_with_heartbeats(run: SimRun, beat: Callable[[], None]) -> None:
    """Heartbeats while the plan is open (an engine reading it): each renews the lease
    and must keep the plan's version held."""
    left = run.rng.uniform(*HOLD_S)
    while left > 0:
        step = min(left, run.heartbeat_interval_s)
        run.clock.sleep(step)
        left -= step
        with contextlib.suppress(Indeterminate):
            beat()


ROLES: dict[str, Callable[[SimRun, Process], None]] = {"plan_reader": plan_reader}
