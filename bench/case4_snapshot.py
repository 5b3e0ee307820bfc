"""Case 4: snapshot read of a shard of many inline parts versus the same data compacted.

A shard gets ``scale.snap_parts`` small appends (10 rows each, all inline: the inline
budget is raised to 2 MiB for this case so that 1,000 parts of about 1 KiB fit), and is
read with ``snapshot(as_of=upper-1)``: warm (the reader's client has the state cached
and catches up with one scan) and cold (a new client rebuilds the state from its rollup
and records, and fetches parts without a cache). Then the shard is compacted
(``client.compact``: inline parts flushed to Parquet parts on the S3 server) and read
again; both snapshots must be equal. For the small-file problem of the peers, the same
appends go to a local deltalake table, read before and after ``optimize.compact()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

from bench import peers
from bench.common import CaseResult, Scale, Table, Timing, measure, ms, ratio
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient, ShardId

TITLE = "Snapshot read: many inline parts versus the same data compacted"


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([("k", "ascending"), ("v", "ascending"), ("t", "ascending")])


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 4 (see the module docstring)."""
    result = CaseResult("case4", TITLE)
    parts = scale.snap_parts
    policy = InlinePolicy(4096, 2 << 20)
    iters, warmup = scale.snap_iters, max(1, scale.snap_iters // 10)
    slow = max(2, iters // 3)  # cold reads and 1,000-file reads take 0.1-1 s each
    rows: dict[str, tuple[str, list[float]]] = {}
    with svc.pg.database("c4") as url:
        blob = svc.s3.uri(svc.s3.bucket("c4"))
        client = PersistClient.open(url, blob, inline_policy=policy)
        try:
            shard = ShardId.new()
            writer = client.open_writer(shard)
            log(f"  writing {parts} inline parts")
            delta_dir = svc.folder("c4-delta")
            delta_table: Any = None
            for i in range(parts):
                batch = peers.small_batch(i, seed=i)
                res = writer.compare_and_append(batch, i, i + 1)
                assert res.placement == "inline", res.placement
                if delta_table is None:
                    delta_table = peers.delta_open(delta_dir, peers.as_table(batch))
                else:
                    peers.delta_append(delta_table, peers.as_table(batch))
            writer.expire()
            as_of = parts - 1
            inspect = client.inspect(shard)
            reader = client.open_reader(shard)

            def cold(_i: int) -> pa.Table:
                with PersistClient.open(url, blob, inline_policy=policy) as fresh:
                    r = fresh.open_reader(shard)
                    try:
                        return r.snapshot(as_of)
                    finally:
                        r.expire()

            log("  reading the inline shard")
            before = reader.snapshot(as_of)
            rows["inline_warm"] = (f"ours, {inspect['parts']['inline']} inline parts, warm",
                                   measure(lambda _i: reader.snapshot(as_of), warmup=warmup,
                                           iters=iters))
            rows["inline_cold"] = (f"ours, {inspect['parts']['inline']} inline parts, cold "
                                   "(new client)", measure(cold, warmup=1, iters=slow))
            log("  compacting")
            metrics = client.compact(shard)
            after_inspect = client.inspect(shard)
            after = reader.snapshot(as_of)
            if not _sorted(before).equals(_sorted(after)):
                raise AssertionError("compaction changed the snapshot")
            hollow = after_inspect["parts"]["hollow_main"]
            rows["compacted_warm"] = (f"ours, compacted: {hollow} Parquet part(s), warm",
                                      measure(lambda _i: reader.snapshot(as_of),
                                              warmup=warmup, iters=iters))
            rows["compacted_cold"] = (f"ours, compacted: {hollow} Parquet part(s), cold "
                                      "(new client, parts fetched from S3)",
                                      measure(cold, warmup=1, iters=slow))
            reader.expire()
        finally:
            client.close()

    log("  deltalake reads")
    from deltalake import DeltaTable

    def delta_read(_i: int) -> pa.Table:
        return DeltaTable(delta_dir).to_pyarrow_table()

    delta_rows = delta_read(0).num_rows
    rows["delta_small"] = (f"deltalake, {parts} small files (local), table opened per read",
                           measure(delta_read, warmup=1, iters=slow))
    delta_table.optimize.compact()
    rows["delta_optimized"] = ("deltalake after optimize.compact() (local)",
                               measure(delta_read, warmup=warmup, iters=iters))

    timings = {k: Timing.of(s) for k, (_, s) in rows.items()}
    base = timings["compacted_warm"].p50
    table = Table(f"Case 4: {TITLE}",
                  ["read", "n", "p50 ms", "p90 ms", "p99 ms", "p50 / ours compacted warm"])
    for key, (label, _) in rows.items():
        t = timings[key]
        table.add(label, t.n, ms(t.p50), ms(t.p90), ms(t.p99), ratio(t.p50, base))
    table.notes += [
        f"{parts} appends of 10 rows; the snapshot holds {before.num_rows} rows (deltalake "
        f"table: {delta_rows} rows, it does not consolidate). Snapshots before and after "
        "compaction are equal.",
        f"Compaction: {metrics['parts_in']} parts in ({metrics['inline_parts_in']} inline), "
        f"{metrics['parts_out']} out, {metrics['duration_s'] * 1000:.0f} ms.",
        "Warm reads of compacted parts hit the client's part cache (64 MiB LRU); cold "
        "reads open a new client (state from rollup + records, parts from the S3 server).",
    ]
    result.tables.append(table)
    result.data = {k: {"label": rows[k][0], "samples": rows[k][1]} for k in rows}
    return result
