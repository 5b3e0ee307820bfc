"""``python -m bench``: run the cases, print one table per case, write the report.

Usage::

    python -m bench             # the full run; report in results/bench/
    python -m bench --quick     # a reduced run (a couple of minutes); results/tmp/bench-quick/
    python -m bench --smoke     # tiny sizes, every code path (the test suite's smoke test)
    python -m bench --cases 1,2 # only some cases (profile = the profiler section)

Exit status: 0 when every case ran (missed targets are reported, not failures), 1 when
a case raised.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from bench import (
    case1_append,
    case2_fill,
    case3_throughput,
    case4_snapshot,
    case5_compaction,
    case6_sensor,
    case7_cost,
    case8_simulated,
    case9_scale,
    case10_spark_read,
    case11_pipeline,
    case12_typed,
    case13_read,
    case14_transactions,
    peers,
    plots,
    profiling,
    report,
)
from bench.common import FULL, QUICK, SMOKE, CaseResult, Scale
from bench.services import Services

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Case name -> module; run in this order (Spark last, so its JVM does not sit beside
#: the latency cases).
CASES: dict[str, Any] = {
    "1": case1_append,
    "2": case2_fill,
    "3": case3_throughput,
    "4": case4_snapshot,
    "6": case6_sensor,
    "7": case7_cost,
    "8": case8_simulated,
    "11": case11_pipeline,
    "12": case12_typed,
    "13": case13_read,
    "14": case14_transactions,
    "profile": profiling,
    "5": case5_compaction,
    "9": case9_scale,
    "10": case10_spark_read,
}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a reduced run")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes (for the tests)")
    parser.add_argument("--cases", default="",
                        help="comma-separated cases to run (1-9, profile); default all")
    parser.add_argument("--out", default="", help="where to write the report and plots")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser.parse_args(argv)


def closing_note(results: Sequence[CaseResult]) -> list[str]:
    """The bottleneck paragraph, from the profiler's numbers of this run."""
    prof = next((r for r in results if r.key == "profile"), None)
    missed = [t for r in results for t in r.targets if not t.met]
    lines = []
    if missed:
        lines.append("Targets missed in this run: " + "; ".join(
            f"case {t.case}: {t.name} ({t.detail})" for t in missed) + ".")
        lines.append("")
    if prof is None:
        lines.append("(The profiler section did not run.)")
        return lines
    for key, label in (("empty", "an inline append to a shard under 30% full"),
                       ("filling", "an inline append to a shard 50-95% full")):
        data = prof.data.get(key)
        if not data:
            continue
        top = data["top"]
        execute = next((c for w, _, c in top if "execute" in w and "cursor" in w), 0.0)
        library = [(w, c) for w, _, c in top if w.startswith("persist_pipeline/")
                   and "consensus/" not in w and "write.py" not in w
                   and "machine.py:apply" not in w]
        selfs = sorted(top, key=lambda r: r[1], reverse=True)[:4]
        lines.append(
            f"- In {label} (cProfile, {data['appends']} appends): the PostgreSQL round trip "
            f"(`psycopg2 cursor.execute` of the CaS INSERT, durable commit included) takes "
            f"{execute:.0%} of the time. Library functions outside the round trip, by "
            "cumulative share: " + ", ".join(f"`{w}` {c:.0%}" for w, c in library[:5])
            + ". Largest self times: " + ", ".join(f"`{w}` {s:.0%}" for w, s, _ in selfs)
            + ".")
    snap = prof.data.get("snapshot")
    if snap:
        top = snap["top"]

        def share(fragment: str) -> float:
            return max((c for w, _, c in top if fragment in w), default=0.0)

        pool = share("_base.py:map")
        pool_note = (f"of which the thread pool, `concurrent/futures/_base.py:map` + "
                     f"`thread.py:submit`, {pool:.0%}" if pool >= 0.05 else
                     "inline parts decoded in the calling thread; the fetch pool is "
                     "used only for hollow parts")
        lines.append(
            f"- In a warm snapshot of many inline parts (case 4, {snap['reads']} reads): "
            f"`persist_pipeline/read.py:fetch_batches` {share('read.py:fetch_batches'):.0%} "
            f"({pool_note}), "
            f"`persist_pipeline/updates.py:consolidate` {share('updates.py:consolidate'):.0%}.")
    merge = prof.data.get("merge")
    if merge:
        top = merge["top"]

        def cum(fragment: str) -> float:
            return max((c for w, _, c in top if fragment in w), default=0.0)

        lines.append(
            f"- In one merge of {merge['n'] / 1e6:g}M updates in {merge['runs']} sorted runs "
            f"(cProfile, {merge['wall']:.1f} s under the profiler; one pass): reading and "
            f"decoding Parquet (`blobs.py:stream_run`) {cum('blobs.py:stream_run'):.0%}, "
            f"merging and consolidating rounds (`merge.py:_merge_round`) "
            f"{cum('merge.py:_merge_round'):.0%} (of which ordering rows by key prefix, "
            f"`merge.py:_key_prefixes` and numpy's argsort, "
            f"{cum('merge.py:_key_prefixes') + cum('argsort'):.0%}, and checking neighbours, "
            f"`merge.py:neighbours`, {cum('merge.py:neighbours'):.0%}), the runs' buffers "
            f"(`merge.py:take`) {cum('merge.py:take'):.0%}, encoding and writing the output "
            f"(`blobs.py:_encode_pending`) {cum('blobs.py:_encode_pending'):.0%}, of which "
            f"durable writes of parts (`blob/local.py:set`) {cum('blob/local.py:set'):.0%}.")
        lines.append(
            "- Before the merge rework (measured on commit 3590e76 with cProfile, "
            "10M updates): in 4 runs, decoding took 28%, the full multi-key sort of every "
            "round and the take it needs 27%, consolidating 9%, encoding and writing 27% and "
            "checking every chunk's order 3%; 32 runs (more than the fan-in of 20) took two "
            "passes and 2.5x as long: decoding 24% (twice the data, in chunks of a few "
            "hundred rows), sorting 19%, encoding and writing 31%, order checks 7%.")
    lines.append("")
    lines.append("The pyinstrument call trees are in `profiles/`.")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks; returns the exit status."""
    args = _parse(argv)
    scale: Scale = SMOKE if args.smoke else QUICK if args.quick else FULL
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()] or list(CASES)
    unknown = [c for c in wanted if c not in CASES]
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)}; choose from {', '.join(CASES)}",
              file=sys.stderr)
        return 2
    default_out = {"full": "results/bench", "quick": "results/tmp/bench-quick",
                   "smoke": "results/tmp/bench-smoke"}[scale.name]
    out_dir = os.path.abspath(args.out or os.path.join(_ROOT, default_out))
    os.makedirs(out_dir, exist_ok=True)
    command = "make bench" if scale is FULL and not args.cases else \
        "make bench-quick" if scale is QUICK and not args.cases else \
        "python -m bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started_at = datetime.datetime.now(datetime.UTC)
    started = time.monotonic()
    results: list[CaseResult] = []
    failures: dict[str, str] = {}
    log: Callable[[str], None] = lambda text: print(text, flush=True)  # noqa: E731
    peers.small_batch(0)  # build the test data before anything is timed
    spark_before = _spark_active()
    load_start = os.getloadavg()[0]
    with Services() as svc:
        pg_settings = svc.pg.settings()
        log(f"persist-pipeline benchmarks ({scale.name}); PostgreSQL "
            f"{pg_settings['server_version']}, synchronous_commit="
            f"{pg_settings['synchronous_commit']}; "
            f"S3 server {svc.s3.main.url}; scratch {svc.workdir}")
        for name in [c for c in CASES if c in wanted]:
            module = CASES[name]
            log(f"\n== {module.TITLE}")
            case_started = time.monotonic()
            try:
                if name == "profile":
                    result = module.run(svc, scale, out_dir, log=log)
                else:
                    result = module.run(svc, scale, log=log)
            except Exception as exc:
                traceback.print_exc()
                failures[f"case {name}"] = f"{type(exc).__name__}: {exc}"
                continue
            result.seconds = time.monotonic() - case_started
            if not args.no_plots:
                plots.draw(result, out_dir)
            for table in result.tables:
                log("\n" + table.to_text())
            for target in result.targets:
                verdict = "met" if target.met else f"MISSED ({target.detail})"
                log(f"  target [{target.name}]: {target.measured} -> {verdict}")
            log(f"  ({result.seconds:.0f} s)")
            results.append(result)
        if not spark_before:
            _stop_spark()
    seconds = time.monotonic() - started
    path = report.write(out_dir, results, scale=scale, command=command, started=started_at,
                        seconds=seconds, pg=pg_settings, pg_where=svc.pg.where,
                        versions=peers.versions(), failures=failures,
                        closing=closing_note(results),
                        load=(load_start, os.getloadavg()[0]))
    log(f"\nreport: {os.path.relpath(path, os.getcwd())} ({seconds / 60:.1f} min)")
    if failures:
        log("FAILED: " + "; ".join(f"{k}: {v}" for k, v in failures.items()))
        return 1
    return 0


def _spark_active() -> bool:
    """Whether this process already has a Spark session (e.g. the test suite's)."""
    if "pyspark" not in sys.modules:
        return False
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() is not None


def _stop_spark() -> None:
    """Stop the Spark session case 5 started, if any."""
    if "pyspark" not in sys.modules:
        return
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is not None:
        session.stop()
