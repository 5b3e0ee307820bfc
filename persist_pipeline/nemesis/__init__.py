"""Nemesis testing: kill processes, inject faults, and check nothing acknowledged is lost.

``persist-pipeline nemesis --seconds N --writers W --seed S`` runs W writer processes
(compare_and_append, each acknowledged write logged to a file before it counts), readers
doing snapshots and one long-lived listen, a compactor and a GC loop, all through
fault-injecting backends, while the nemesis SIGKILLs and restarts writers and the
compactor and restarts PostgreSQL once. The checker then verifies the invariants of
DESIGN.md and prints one line of figures; any violation makes the exit code non-zero.

- ``workload``: the process bodies.
- ``checker``: the invariants, usable on any shard.
- ``runner``: the orchestration and the summary line.
"""
