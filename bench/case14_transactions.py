"""Case 14: atomic multi-shard commits, ours and DuckLake's multi-table transactions.

Rows, all in one process and one run, PostgreSQL for every catalog:

- ours: a single inline append (10 rows) to one shard: the reference the target uses;
- ours: a transaction of the same 10-row append to 2 and to 8 shards, committed all or
  none in one consensus round trip; timed in alternating blocks with the single append,
  so a change of the machine's load hits all three alike;
- DuckLake (data inlining, PostgreSQL catalog): ``BEGIN``; the same 10 rows inserted
  into each of 2 and 8 tables; ``COMMIT``.

Group commit: appends/s of 1 to 64 threads, each appending the small batch to a shard
of its own through one client on PostgreSQL, with the client's funnel (group commit, the
default) and without it (every append its own round trip).

Targets: a 2-shard atomic commit p50 <= 1.3x a single inline append; 32 threads on 32
shards >= 4x the appends/s without group commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bench import peers
from bench.case1_append import interleaved
from bench.common import CaseResult, Scale, Table, Target, Timing, measure, ms, ratio
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId

TITLE = "Atomic multi-shard commits (10 rows per shard)"

#: Appends per shard before it is replaced by a fresh one (untimed), keeping every
#: shard's inline bytes low, as in case 1.
_ROTATE = 200


class Committer:
    """Commits the small batch to ``width`` shards at once (1: a plain append)."""

    def __init__(self, client: PersistClient, width: int) -> None:
        self.client = client
        self.width = width
        self.writers: list[Any] = []
        self.upper = 0
        self.count = 0

    def before(self, i: int) -> None:
        if self.count % _ROTATE == 0:
            for w in self.writers:
                w.expire()
            self.writers = [self.client.open_writer(ShardId.new()) for _ in range(self.width)]
            self.upper = 0
        self.count += 1

    def __call__(self, i: int) -> None:
        batch = peers.small_batch(self.upper, i)
        lo, hi = self.upper, self.upper + 1
        if self.width == 1:
            self.writers[0].compare_and_append(batch, lo, hi)
        else:
            txn = self.client.transaction()
            for w in self.writers:
                txn.compare_and_append(w, batch, lo, hi)
            txn.commit()
        self.upper = hi

    def close(self) -> None:
        for w in self.writers:
            w.expire()


def ducklake(catalog: str, data_path: str, width: int, *, warmup: int,
             iters: int) -> list[float]:
    """DuckLake transactions inserting the small batch into ``width`` tables."""
    con = peers.ducklake_connect(catalog, data_path, inline_rows=1000)
    try:
        for j in range(width):
            con.execute(f"CREATE TABLE lake.t{j} (k VARCHAR, v VARCHAR, t BIGINT, d BIGINT)")
        inserts = [peers.ducklake_insert_sql(peers.small_batch(i, i))
                   for i in range(warmup + iters)]

        def commit(i: int) -> None:
            con.execute("BEGIN TRANSACTION")
            for j in range(width):
                con.execute(inserts[i].replace("INSERT INTO lake.t ", f"INSERT INTO lake.t{j} "))
            con.execute("COMMIT")

        return measure(commit, warmup=warmup, iters=iters)
    finally:
        con.close()


def appends_per_s(consensus_uri: str, blob_uri: str, threads: int, seconds: float,
                  group_commit: bool, rotate: int = _ROTATE) -> tuple[float, float]:
    """Appends/s of ``threads`` threads, each appending to a shard of its own for
    ``seconds``; and appends per consensus round trip (1.0 without group commit). Each
    thread moves to a fresh shard every ``rotate`` appends (opening its writer inside
    the timed loop, in both modes alike), so every append is inline, as in case 1: a
    lone thread would otherwise fill its shard's inline budget within the run and
    measure blob writes instead."""
    client = PersistClient.open(consensus_uri, blob_uri, inline_policy=InlinePolicy(),
                                config=PersistConfig(group_commit=group_commit))
    first = [client.open_writer(ShardId.new()) for _ in range(threads)]
    opened: list[list[Any]] = [[w] for w in first]
    # The batches are generated once per process; generating them here, not in 32
    # threads at once inside the timed window, keeps that out of the figure.
    peers.small_batch(0)
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def run(i: int) -> None:
        writer = first[i]
        start.wait()
        upper = done = 0
        while not stop.is_set():
            if upper == rotate:
                writer = client.open_writer(ShardId.new())
                opened[i].append(writer)
                upper = 0
            writer.compare_and_append(peers.small_batch(upper, i), upper, upper + 1)
            upper += 1
            done += 1
        counts[i] = done

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    before = (client.metrics.group_commits, client.metrics.group_commit_appends)
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - began
    groups = client.metrics.group_commits - before[0]
    grouped = client.metrics.group_commit_appends - before[1]
    for writers in opened:
        for w in writers:
            w.expire()
    client.close()
    return sum(counts) / elapsed, (grouped / groups if groups else 1.0)


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 14 (see the module docstring)."""
    result = CaseResult("case14", TITLE)
    w, n = scale.append_warmup, scale.append_iters
    rows: dict[str, tuple[str, list[float]]] = {}
    with svc.pg.database("c14") as url:
        bucket = svc.s3.bucket("c14")
        client = PersistClient.open(url, svc.s3.uri(bucket, "ours"),
                                    inline_policy=InlinePolicy())
        committers = {key: Committer(client, width)
                      for key, width in (("ours_1", 1), ("ours_2", 2), ("ours_8", 8))}
        log("  ours: single append and 2- and 8-shard transactions, interleaved")
        try:
            timed = interleaved({k: (c, c.before) for k, c in committers.items()},
                                warmup=w, iters=n, blocks=10)
        finally:
            for c in committers.values():
                c.close()
            client.close()
        rows["ours_1"] = ("ours, one inline append, PostgreSQL (the reference)",
                          timed["ours_1"])
        rows["ours_2"] = ("ours, atomic transaction over 2 shards", timed["ours_2"])
        rows["ours_8"] = ("ours, atomic transaction over 8 shards", timed["ours_8"])
    for width in (2, 8):
        log(f"  DuckLake {width}-table transaction")
        with svc.pg.database(f"c14dl{width}") as dl_url:
            rows[f"ducklake_{width}"] = (
                f"DuckLake transaction over {width} tables, data inlining, PostgreSQL catalog",
                ducklake(peers.ducklake_pg_catalog(dl_url), svc.folder(f"c14-ducklake{width}"),
                         width, warmup=max(2, w // 10), iters=scale.ducklake_iters))
    timings = {key: Timing.of(s) for key, (_, s) in rows.items()}
    base = timings["ours_1"].p50
    table = Table(f"Case 14: {TITLE}",
                  ["system", "n", "p50 ms", "p90 ms", "p99 ms", "p50 / one append (ours)"])
    order = ["ours_1", "ours_2", "ours_8", "ducklake_2", "ducklake_8"]
    for key in order:
        t = timings[key]
        table.add(rows[key][0], t.n, ms(t.p50), ms(t.p90), ms(t.p99), ratio(t.p50, base))
    for width in (2, 8):
        ours, theirs = timings[f"ours_{width}"].p50, timings[f"ducklake_{width}"].p50
        table.notes.append(f"{width} shards: DuckLake's p50 is {ratio(theirs, ours)} ours.")
    table.notes.append("Every transaction is one consensus round trip for us (one INSERT ... "
                       "SELECT over every shard's head); DuckLake runs its catalog "
                       "transaction over several statements.")
    result.tables.append(table)
    result.data = {key: {"label": rows[key][0], "samples": rows[key][1]} for key in order}
    # Smoke: the code path only, in a quarter second (every thread still moves to fresh
    # shards: a few hundred appends in all, tens per thread).
    seconds = {"full": 3.0, "quick": 1.0}.get(scale.name, 0.25)
    rotate = _ROTATE if scale.name != "smoke" else 10
    widths = (1, 8, 32, 64) if scale.name != "smoke" else (1, 8)
    grid = Table("Case 14: group commit, appends/s of N threads on N shards (PostgreSQL)",
                 ["threads = shards", "appends/s, one round trip each",
                  "appends/s, group commit", "speed-up", "appends per round trip",
                  "appends/s, no database (mem://)", "ceiling / one round trip each"])
    speedups: dict[int, float] = {}
    ceilings: dict[int, float] = {}
    with svc.pg.database("c14gc") as url:
        blob = svc.s3.uri(svc.s3.bucket("c14gc"), "ours")
        for width in widths:
            log(f"  group commit: {width} threads")
            alone, _ = appends_per_s(url, blob, width, seconds, group_commit=False,
                                     rotate=rotate)
            grouped, per_trip = appends_per_s(url, blob, width, seconds, group_commit=True,
                                              rotate=rotate)
            # The same threads on an in-memory consensus: what the Python path alone
            # sustains, an upper bound on any batching of the database's round trips.
            python_only, _ = appends_per_s("mem://", "mem://", width, seconds,
                                           group_commit=False, rotate=rotate)
            speedups[width] = grouped / alone
            ceilings[width] = python_only / alone
            grid.add(width, f"{alone:.0f}", f"{grouped:.0f}", f"{grouped / alone:.2f}x",
                     f"{per_trip:.1f}", f"{python_only:.0f}", f"{python_only / alone:.2f}x")
    grid.notes.append(f"Each configuration runs {seconds:g} s per mode, one client, small "
                      f"inline appends (each thread moves to a fresh shard every {rotate} "
                      "appends); the funnel batches appends that wait at the same "
                      "moment (no timer: group_commit_window_s = 0), two groups on "
                      "different shards at a time (the second once as many appends wait "
                      "as the first holds).")
    grid.notes.append("The no-database column runs the same threads and appends against an "
                      "in-memory consensus (no round trip at all): every append's own "
                      "Python (validation, state transition, encoding) under one "
                      "interpreter lock. Group commit removes round trips, not that work, "
                      "so no batching can exceed the ceiling column's speed-up here.")
    result.tables.append(grid)
    if 32 in speedups:
        gain = speedups[32]
        result.targets.append(Target(
            "14", "32 threads on 32 shards >= 4x the appends/s without group commit",
            ">= 4.00x", f"{gain:.2f}x", gain >= 4.0,
            "met" if gain >= 4.0 else
            f"missed by {4.0 / gain:.2f}x; the Python path alone, with no database, "
            f"sustains {ceilings[32]:.2f}x"))
    over = timings["ours_2"].p50 / base
    result.targets.append(Target(
        "14", "2-shard atomic commit p50 <= 1.3x a single inline append", "<= 1.30x",
        f"{over:.2f}x ({ms(timings['ours_2'].p50)} vs {ms(base)} ms)", over <= 1.3,
        "met" if over <= 1.3 else f"missed by {over / 1.3:.2f}x"))
    return result
