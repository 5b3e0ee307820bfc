"""Benchmarks of persist-pipeline side by side with its peers (``make bench``).

Run ``python -m bench`` (``--quick`` for the reduced run, ``--help`` for the rest). Every
case measures ours and the peers in the same process and run, prints one table per case
with a ratio column, and the runner writes a Markdown report and PNG plots.

Modules:

- ``common``: timing (warm-up, p50/p90/p99), result tables, targets, scales.
- ``services``: PostgreSQL (throwaway databases), a loopback moto S3 server that counts
  requests and can inject a *simulated* latency, temporary folders.
- ``peers``: deltalake, PyIceberg (SQL catalog) and DuckLake set-ups.
- ``case1_append`` ... ``case7_cost``, ``case8_simulated``: one module per case.
- ``profiling``: profiles of the hot paths (cProfile + pyinstrument).
- ``report`` / ``plots``: the Markdown report and the PNGs.
- ``runner``: the command line.
"""

from __future__ import annotations
