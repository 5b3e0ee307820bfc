"""Deterministic simulation testing: the library's real code under a seeded scheduler.

Handles, the state machine, transitions, compaction (in process, and the Spark driver
with the executor's task function), GC and rollups all run unmodified; only the clock,
the scheduler and the stores are simulated. Each seed drives writers, ``append``
writers, leased and critical readers, a listen, compactors and GCs through in-memory
consensus and blob stores, with lost replies, failed calls, pauses past leases and
deadlines, and crashed processes, and checks DESIGN.md's guarantees after every step.

- ``scheduler``: greenlet threads, the simulated clock, locks that yield.
- ``stores``: the simulated consensus and blob stores and their faults.
- ``monitor``: the invariants of every state version and blob delete; the model of
  acknowledged data every read is checked against.
- ``actors``: the simulated clients.
- ``controls``: negative controls, each reverting one fix, that the simulation must catch.
- ``runner``: one seed, many seeds, one line of report.

Run it with ``persist-pipeline simulate --seeds N``.
"""

from __future__ import annotations

from persist_pipeline.sim.runner import SeedResult, SimReport, run_seed, run_seeds

__all__ = ["SeedResult", "SimReport", "run_seed", "run_seeds"]
