"""Case 13: reading a compacted shard of N updates, ours beside the same data as Parquet.

A shard of ``N`` updates (case 9's data: 4 sorted batches whose keys overlap by half,
since advanced past them) is written through the API (consensus PostgreSQL, parts in a
local folder) and compacted into one batch; the snapshot at its since holds the
consolidated rows. The same rows are read by:

- ours: ``ReadHandle.snapshot_batches(as_of)``, iterated to the end (the k-way merge
  streams the shard's sorted run in bounded memory, checks its order, consolidates);
- ours through the read plan in DuckDB: ``snapshot_plan(as_of)`` and one DuckDB query
  over ``plan.to_dataset()`` (``WHERE t <= as_of GROUP BY k, v HAVING sum(d) <> 0``: the
  plan's contract), materialized as Arrow;
- DuckDB reading the shard's Parquet parts directly (``read_parquet`` of the plan's
  files, no grouping): the floor of reading those files;
- deltalake: the snapshot's rows written once as a local Delta table, read with
  ``DeltaTable(path).to_pyarrow_table()``.

rows/s = the snapshot's rows / wall time, best of a few warm reads (the files are in the
page cache for everyone). Every engine's rows equal ours (checked by row count and, for
the plan, by content).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from bench.case9_scale import RUNS, _write_shard
from bench.common import CaseResult, Scale, Table, ratio, si
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient

TITLE = "Snapshot read speed of a compacted shard: ours beside DuckDB and deltalake (rows/s)"

_REPS = {"smoke": 1, "quick": 2, "full": 3}


def _best(fn: Callable[[], int], reps: int) -> tuple[float, int]:
    best, rows = float("inf"), 0
    for _ in range(reps):
        started = time.perf_counter()
        rows = fn()
        best = min(best, time.perf_counter() - started)
    return best, rows


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 13 (see the module docstring)."""
    import duckdb
    from deltalake import DeltaTable, write_deltalake

    result = CaseResult("case13", TITLE)
    n, reps = scale.read_size, _REPS[scale.name]
    as_of = RUNS - 1
    timings: dict[str, tuple[float, int]] = {}
    with svc.pg.database("c13") as url:
        blob = f"file://{svc.folder('c13-blob')}"
        client = PersistClient.open(url, blob, inline_policy=InlinePolicy(0, 0))
        try:
            log(f"  writing and compacting a shard of {si(n)} updates")
            shard = _write_shard(client, n, seed=3)
            client.compact(shard)
            reader = client.open_reader(shard)
            batches = client._machine(shard).fetch_latest().batches
            parts = sum(len(b.parts) for b in batches.values())

            def ours() -> int:
                return sum(b.num_rows for b in reader.snapshot_batches(as_of))

            def plan_in_duckdb() -> int:
                with reader.snapshot_plan(as_of) as plan:
                    ds = plan.to_dataset()  # noqa: F841 - DuckDB reads it by name
                    out = duckdb.sql(f"SELECT k, v, sum(d) AS d FROM ds WHERE t <= {as_of} "
                                     "GROUP BY k, v HAVING sum(d) <> 0").fetch_arrow_table()
                rows: int = out.num_rows
                return rows

            log("  reading: ours")
            timings["ours"] = _best(ours, reps)
            log("  reading: the read plan in DuckDB")
            timings["plan_duckdb"] = _best(plan_in_duckdb, reps)
            with reader.snapshot_plan(as_of) as plan:
                files = [f.removeprefix("file://") for f in plan.files]
            listing = ", ".join(f"'{f}'" for f in files)
            log("  reading: DuckDB read_parquet of the same files")
            query = f"SELECT k, v, t, d FROM read_parquet([{listing}])"
            timings["duckdb_parquet"] = _best(
                lambda: duckdb.sql(query).fetch_arrow_table().num_rows, reps)
            snapshot = pa.Table.from_batches(list(reader.snapshot_batches(as_of)))
            reader.expire()
        finally:
            client.close()
    log("  reading: deltalake")
    delta_dir = svc.folder("c13-delta")
    write_deltalake(delta_dir, snapshot)
    timings["delta"] = _best(lambda: DeltaTable(delta_dir).to_pyarrow_table().num_rows, reps)

    rows = snapshot.num_rows
    labels = {
        "ours": "ours: snapshot_batches(as_of), iterated",
        "plan_duckdb": "ours: snapshot_plan(as_of) read by DuckDB (GROUP BY k, v)",
        "duckdb_parquet": "DuckDB read_parquet of the same part files (no grouping)",
        "delta": "deltalake to_pyarrow_table() of the same rows (local Delta table)",
    }
    table = Table(f"Case 13: {TITLE}",
                  ["read", "seconds", "rows", "rows/s", "ours vs it"])
    base = timings["ours"][0]
    for key, label in labels.items():
        seconds, got = timings[key]
        table.add(label, f"{seconds:.3f}", si(got), si(got / seconds), ratio(seconds, base))
    same = all(got == rows for _, got in timings.values())
    table.notes += [
        f"{si(n)} updates written as {RUNS} batches and compacted into one batch of "
        f"{parts} part(s); the snapshot holds {si(rows)} rows; every read returned "
        f"{'the same number of rows' if same else 'DIFFERENT numbers of rows'}.",
        f"Best of {reps} warm read(s) each; 'ours vs it' > 1 means ours is faster.",
    ]
    result.tables.append(table)
    data: dict[str, Any] = {k: {"label": labels[k], "seconds": s, "rows": r}
                            for k, (s, r) in timings.items()}
    result.data = {"reads": data, "rows": rows, "same": same}
    return result
