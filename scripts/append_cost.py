"""What one small inline append costs in Python: appends/s, or instructions under callgrind.

The append path's own CPU (validation, transition, state diff, encodings) is what
limits group commit (every append's Python runs under one interpreter lock), so it is
measured here without the benchmark's peers. Wall time moves 5-10% between identical
runs on a shared machine (far more under others' load); the threads modes also print
this process's CPU time and context switches per append over the timed run, which
others' load moves much less; instruction counts (callgrind) repeat within about 1%::

    python scripts/append_cost.py single 2000                 # one thread, mem://
    python scripts/append_cost.py single 2000 postgresql://postgres@127.0.0.1/db
    python scripts/append_cost.py threads 300                 # 32 threads, group commit
    python scripts/append_cost.py threads_nogc 300            # 32 threads, without it

    # instructions per append: the difference of two runs over their appends
    valgrind --tool=callgrind --callgrind-out-file=/tmp/a.cg \\
        python scripts/append_cost.py single 200    # "Collected : A"
    valgrind --tool=callgrind --callgrind-out-file=/tmp/b.cg \\
        python scripts/append_cost.py single 1200   # "Collected : B"; (B - A) / 1000

Each thread appends the benchmark's 10-row batch (``bench.peers.small_batch``) and moves
to a fresh shard every 200 appends, as the benchmark's cases 1 and 14 do, so every
append stays inline. Run a mode once before measuring, so that bytecode is compiled.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peers
from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId

#: Appends per shard before a thread moves to a fresh one (the benchmark's rotation).
ROTATE = 200
THREADS = 32


def single(n: int, consensus: str, blob: str) -> str:
    client = PersistClient.open(consensus, blob, inline_policy=InlinePolicy())
    writer, upper = client.open_writer(ShardId.new()), 0
    began = time.perf_counter()
    for i in range(n):
        if upper == ROTATE:
            writer.expire()
            writer, upper = client.open_writer(ShardId.new()), 0
        writer.compare_and_append(peers.small_batch(upper, i), upper, upper + 1)
        upper += 1
    elapsed = time.perf_counter() - began
    writer.expire()
    client.close()
    return f"single: {n} appends in {elapsed:.3f} s, {n / elapsed:.0f}/s, " \
           f"{elapsed / n * 1e6:.1f} us each"


def threads(n: int, consensus: str, blob: str, group_commit: bool) -> str:
    client = PersistClient.open(consensus, blob, inline_policy=InlinePolicy(),
                                config=PersistConfig(group_commit=group_commit))
    first = [client.open_writer(ShardId.new()) for _ in range(THREADS)]
    opened = [[w] for w in first]
    start = threading.Barrier(THREADS + 1)

    def run(i: int) -> None:
        writer, upper = first[i], 0
        start.wait()
        for _ in range(n):
            if upper == ROTATE:
                writer, upper = client.open_writer(ShardId.new()), 0
                opened[i].append(writer)
            writer.compare_and_append(peers.small_batch(upper, i), upper, upper + 1)
            upper += 1

    workers = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for w in workers:
        w.start()
    start.wait()
    used = resource.getrusage(resource.RUSAGE_SELF)
    began = time.perf_counter()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - began
    now = resource.getrusage(resource.RUSAGE_SELF)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    switches = now.ru_nvcsw + now.ru_nivcsw - used.ru_nvcsw - used.ru_nivcsw
    for writers in opened:
        for w in writers:
            w.expire()
    groups, grouped = client.metrics.group_commits, client.metrics.group_commit_appends
    client.close()
    total = n * THREADS
    return (f"{THREADS} threads: {total} appends in {elapsed:.3f} s, {total / elapsed:.0f}/s"
            + (f", {grouped / groups:.1f} appends per round trip" if groups else "")
            + f"; per append: {cpu / total * 1e6:.0f} us of this process's CPU, "
              f"{switches / total:.1f} context switches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["single", "threads", "threads_nogc"])
    parser.add_argument("n", type=int, help="appends (per thread in the threads modes)")
    parser.add_argument("consensus", nargs="?", default="mem://")
    parser.add_argument("blob", nargs="?", default="mem://")
    args = parser.parse_args()
    peers.small_batch(0)  # the batches are made once, outside the timed loop
    if args.mode == "single":
        print(single(args.n, args.consensus, args.blob))
    else:
        print(threads(args.n, args.consensus, args.blob, args.mode == "threads"))


if __name__ == "__main__":
    main()
