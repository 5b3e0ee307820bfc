"""Case 8 (optional in the issue): small appends with a SIMULATED S3 latency.

The S3 server answers in about 2 ms whatever the request, which flatters every system
that PUTs. Here two extra endpoints of the same moto backend add a fixed delay per
request before answering: "S3 Standard (simulated)" and "S3 Express One Zone
(simulated)", with delays inside the published ranges the issue quotes (20-50 ms per PUT
on Standard, 5-10 ms on Express). These numbers are a SIMULATION of what users would see
on AWS, not a measurement of AWS.
"""

from __future__ import annotations

from collections.abc import Callable

from bench import case1_append, peers
from bench.common import CaseResult, Scale, Table, Timing, measure, ms, ratio
from bench.services import Latency, Services
from persist_pipeline import InlinePolicy
from persist_pipeline.updates import SCHEMA

TITLE = "Small append latency with SIMULATED S3 latency"

STANDARD = Latency("S3 Standard (simulated)", put=0.030, other=0.020)
EXPRESS = Latency("S3 Express One Zone (simulated)", put=0.007, other=0.005)


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 8 (see the module docstring)."""
    result = CaseResult("case8", TITLE)
    standard = svc.s3.endpoint("sim-standard")
    express = svc.s3.endpoint("sim-express")
    if scale.name == "smoke":  # the code path only: a tenth of the delays
        standard.set_latency(Latency(STANDARD.label, STANDARD.put / 10, STANDARD.other / 10))
        express.set_latency(Latency(EXPRESS.label, EXPRESS.put / 10, EXPRESS.other / 10))
    else:
        standard.set_latency(STANDARD)
        express.set_latency(EXPRESS)
    n = scale.sim_iters
    w = 1 if scale.name == "smoke" else 2
    rows: dict[str, tuple[str, list[float]]] = {}
    with svc.pg.database("c8") as url:
        bucket = svc.s3.bucket("c8")
        wal_bucket = svc.s3.bucket("c8-wal")
        log("  ours inline")
        rows["ours_inline"] = ("ours, inline (PostgreSQL; main blob on simulated Standard)",
                               case1_append.ours(url, svc.s3.uri(bucket, "inline", standard),
                                                 policy=None, rotate=scale.shard_rotate,
                                                 warmup=5, iters=max(n, scale.append_iters // 3)
                                                 )[0])
        log("  ours blob path")
        rows["ours_blob"] = ("ours, inline off: blob part on simulated Standard",
                             case1_append.ours(url, svc.s3.uri(bucket, "blob", standard),
                                               policy=InlinePolicy(0, 0),
                                               rotate=scale.shard_rotate, warmup=w,
                                               iters=n)[0])
        log("  ours WAL")
        rows["ours_wal"] = ("ours, inline off: WAL store on simulated Express "
                            "(main on simulated Standard)",
                            case1_append.ours(url, svc.s3.uri(bucket, "walmain", standard),
                                              policy=InlinePolicy(0, 0),
                                              rotate=scale.shard_rotate, warmup=w, iters=n,
                                              wal_uri=svc.s3.uri(wal_bucket, "wal",
                                                                 express))[0])
        log("  deltalake")
        rows["delta"] = ("deltalake append on simulated Standard (table kept open)",
                         case1_append.delta(f"s3://{bucket}/delta",
                                            svc.s3.delta_options(standard), warmup=w, iters=n))
        log("  PyIceberg")
        table = peers.iceberg_table(url, f"s3://{bucket}/iceberg", SCHEMA,
                                    svc.s3.iceberg_properties(standard))
        data = [peers.as_table(peers.small_batch(i, i)) for i in range(w + max(2, n // 2))]
        rows["iceberg"] = ("PyIceberg append, warehouse on simulated Standard",
                           measure(lambda i: table.append(data[i]), warmup=w,
                                   iters=max(2, n // 2)))
    standard.set_latency(Latency())
    express.set_latency(Latency())
    timings = {k: Timing.of(s) for k, (_, s) in rows.items()}
    base = timings["ours_inline"].p50
    out = Table(f"Case 8: {TITLE}",
                ["system (SIMULATED S3 latency)", "n", "p50 ms", "p90 ms", "p99 ms",
                 "p50 / ours inline"])
    for key, (label, _) in rows.items():
        t = timings[key]
        out.add(label, t.n, ms(t.p50), ms(t.p90), ms(t.p99), ratio(t.p50, base))
    out.notes += [
        f"SIMULATION: {STANDARD.label} adds {STANDARD.put * 1000:.0f} ms per PUT/POST and "
        f"{STANDARD.other * 1000:.0f} ms per other request; {EXPRESS.label} adds "
        f"{EXPRESS.put * 1000:.0f} ms / {EXPRESS.other * 1000:.0f} ms; on top of the moto "
        "server's own time. Not a measurement of AWS.",
        "Ours inline touches S3 only for the state rollup every 128 appends (p99).",
    ]
    result.tables.append(out)
    result.data = {k: {"label": rows[k][0], "samples": rows[k][1]} for k in rows}
    return result
