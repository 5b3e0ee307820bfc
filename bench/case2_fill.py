"""Case 2: inline append latency as the shard fills up to ``persist_inline_update_max_bytes``.

For each fill level (0%, 50%, 95%, and "full", where the bound forces the blob path) a
fresh shard is filled untimed with the same small appends, then a window of
``scale.fill_window`` appends is timed (a window small enough not to move the level
much); repeated ``scale.fill_reps`` times and pooled. PostgreSQL consensus, blob on the
S3 server. A second, continuous measurement times every append from empty to full and
gives the latency curve of the plot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench import peers
from bench.common import CaseResult, Scale, Table, Target, Timing, measure, ms, ratio
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient, ShardId

TITLE = "Inline append latency as the shard fills"

LEVELS = (("0%", 0.0), ("50%", 0.5), ("95%", 0.95))


def _fill(writer: Any, upper: int, target_bytes: int, bound: int) -> tuple[int, int]:
    """Append small batches until the shard holds ``target_bytes`` inline (or falls
    through, when ``target_bytes`` exceeds the bound); returns (upper, inline bytes)."""
    held = 0
    while held < target_bytes:
        res = writer.compare_and_append(peers.small_batch(upper, seed=upper), upper, upper + 1)
        upper += 1
        if res.placement != "inline":
            break
        held += res.encoded_bytes
        if held > bound:
            raise AssertionError("inline bytes beyond the bound")
    return upper, held


def window(client: PersistClient, fraction: float | None, bound: int, size: int
           ) -> tuple[list[float], list[str], int]:
    """Fill a fresh shard to ``fraction`` of ``bound`` (None: until it falls through), then
    time ``size`` appends; returns samples, their placements and the fill in bytes."""
    writer = client.open_writer(ShardId.new())
    upper = 0
    try:
        if fraction is None:
            upper, held = _fill(writer, upper, bound + 1, bound)
        else:
            upper, held = _fill(writer, upper, int(bound * fraction), bound)
        placements: list[str] = []
        state = {"upper": upper}

        def step(_i: int) -> None:
            u = state["upper"]
            res = writer.compare_and_append(peers.small_batch(u, seed=u), u, u + 1)
            placements.append(res.placement)
            state["upper"] = u + 1

        samples = measure(step, warmup=0, iters=size)
        return samples, placements, held
    finally:
        writer.expire()


def curve(client: PersistClient, bound: int) -> list[tuple[int, float, str]]:
    """Every append from empty until 20 appends past the bound: (inline bytes held
    before it, seconds, placement)."""
    writer = client.open_writer(ShardId.new())
    out = []
    held, upper, past = 0, 0, 0
    try:
        while past < 20:
            batch = peers.small_batch(upper, seed=upper)
            started = time.perf_counter()
            res = writer.compare_and_append(batch, upper, upper + 1)
            out.append((held, time.perf_counter() - started, res.placement))
            upper += 1
            if res.placement == "inline":
                held += res.encoded_bytes
            else:
                past += 1
        return out
    finally:
        writer.expire()


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 2 (see the module docstring)."""
    result = CaseResult("case2", TITLE)
    bound = scale.fill_max_bytes
    policy = InlinePolicy(4096, bound)
    pooled: dict[str, list[float]] = {}
    fills: dict[str, list[int]] = {}
    placements: dict[str, set[str]] = {}
    curves: list[list[tuple[int, float, str]]] = []
    with svc.pg.database("c2") as url:
        bucket = svc.s3.bucket("c2")
        client = PersistClient.open(url, svc.s3.uri(bucket), inline_policy=policy)
        try:
            # Warm-up: connections, prepared statements, code paths.
            window(client, 0.0, bound, 20)
            for rep in range(scale.fill_reps):
                log(f"  repetition {rep + 1}/{scale.fill_reps}")
                for label, fraction in (*LEVELS, ("full: blob path", None)):
                    samples, where, held = window(client, fraction, bound, scale.fill_window)
                    pooled.setdefault(label, []).extend(samples)
                    fills.setdefault(label, []).append(held)
                    placements.setdefault(label, set()).update(where)
            for rep in range(scale.fill_curve_reps):
                log(f"  fill curve {rep + 1}/{scale.fill_curve_reps}")
                curves.append(curve(client, bound))
        finally:
            client.close()

    timings = {k: Timing.of(v) for k, v in pooled.items()}
    empty = timings["0%"].p50
    table = Table(f"Case 2: {TITLE} (persist_inline_update_max_bytes = {bound} bytes)",
                  ["shard fill before the window", "inline bytes held", "placement", "n",
                   "p50 ms", "p90 ms", "p99 ms", "p50 / empty"])
    for label, t in timings.items():
        held = sorted(fills[label])[len(fills[label]) // 2]
        table.add(label, held, "/".join(sorted(placements[label])), t.n, ms(t.p50), ms(t.p90),
                  ms(t.p99), ratio(t.p50, empty))
    table.notes.append(f"Each window is {scale.fill_window} appends of about 1 KiB on a fresh "
                       f"shard filled to the level; {scale.fill_reps} repetitions pooled. "
                       "Consensus: PostgreSQL; blob: the S3 server (moto on loopback). "
                       "p99 includes the state rollup every 128 seqnos (a blob PUT and a "
                       "second CaS).")
    result.tables.append(table)
    result.data = {"pooled": pooled, "curves": curves, "bound": bound}
    r95 = timings["95%"].p50 / empty
    result.targets.append(Target(
        "2", "inline append p50 at 95% full within 1.3x of empty", "<= 1.30x", f"{r95:.2f}x",
        r95 <= 1.3,
        "met" if r95 <= 1.3 else f"missed by {r95 / 1.3:.2f}x ({ms(timings['95%'].p50)} ms "
        f"vs {ms(empty * 1.3)} ms allowed)"))
    return result
