"""Profiles of our hot path: where an inline append spends its time.

Two windows of inline appends on PostgreSQL (blob on the S3 server) are profiled, each
with cProfile (exact per-function totals, for the tables) and again with pyinstrument
(a sampled call tree, written next to the report for reading):

- a shard going from empty to about 30% of its inline budget;
- a shard going from 50% to 95% of its inline budget (where case 2 measures);

warm snapshots of a shard of ``scale.snap_parts`` inline parts (case 4's slow row); and
one merge (:func:`~persist_pipeline.compaction.run_merge`, bound 256 MiB) of case 9's
curve size in 32 sorted runs.

A function's share is its cumulative time (itself and what it calls) over the whole
window; "self" is time spent in the function's own code.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import peers
from bench.common import CaseResult, Scale, Table, si
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient, ShardId
from persist_pipeline.examples import merge_data

#: Runs of the profiled merge (more than the old fan-in of 20, fewer than the new ~140).
MERGE_RUNS = 32

TITLE = "Profiles of the inline append and of a snapshot (cProfile; pyinstrument in profiles/)"

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(key: tuple[str, int, str]) -> str:
    """``file:function`` relative to the repository (or the library's site-packages)."""
    path, line, func = key
    if path == "~":
        return func  # a builtin, e.g. <method 'execute' of 'psycopg2...cursor' objects>
    if path.startswith(_ROOT):
        path = os.path.relpath(path, _ROOT)
    elif "site-packages" in path:
        path = path.split("site-packages" + os.sep, 1)[1]
    elif f"{os.sep}lib{os.sep}python" in path:  # the standard library
        path = "stdlib/" + path.split(f"{os.sep}lib{os.sep}python", 1)[1].split(os.sep, 1)[1]
    return f"{path}:{func} (line {line})"


class _Window:
    """Appends to a shard from ``start`` to ``stop`` fraction of the inline budget."""

    def __init__(self, client: PersistClient, bound: int, start: float, stop: float) -> None:
        self.client = client
        self.bound = bound
        self.start = start
        self.stop = stop

    def prepare(self) -> None:
        """Untimed: a fresh shard filled to ``start``."""
        self.writer = self.client.open_writer(ShardId.new())
        self.upper = 0
        self.held = 0
        while self.held < self.start * self.bound:
            self._one()

    def _one(self) -> None:
        u = self.upper
        res = self.writer.compare_and_append(peers.small_batch(u, seed=u), u, u + 1)
        assert res.placement == "inline", res.placement
        self.held += res.encoded_bytes
        self.upper += 1

    def appends(self, n: int) -> int:
        """Up to ``n`` appends, stopping at ``stop``; returns how many."""
        done = 0
        while done < n:
            if self.held + 2048 > self.stop * self.bound:
                break
            self._one()
            done += 1
        return done


def _profile(prepare: Callable[[], Callable[[], int]], out_txt: str) -> dict[str, Any]:
    """Profile ``work = prepare(); work()`` with cProfile, then a second time (freshly
    prepared) with pyinstrument into ``out_txt``. ``work`` returns the operations done."""
    work = prepare()
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    done = work()
    profile.disable()
    wall = time.perf_counter() - started

    from pyinstrument import Profiler

    work = prepare()
    profiler = Profiler(interval=0.0002)
    profiler.start()
    work()
    profiler.stop()
    with open(out_txt, "w") as f:
        f.write(profiler.output_text(unicode=False, color=False, show_all=False))

    stats = pstats.Stats(profile)
    rows = []
    raw: Any = stats.stats  # type: ignore[attr-defined]
    for key, (_cc, _nc, tt, ct, _callers) in raw.items():
        rows.append((_where(key), tt, ct))
    return {"ops": done, "wall": wall, "rows": rows}


def _appends(make: Callable[[], _Window], n: int) -> Callable[[], Callable[[], int]]:
    def prepare() -> Callable[[], int]:
        window = make()
        window.prepare()

        def work() -> int:
            try:
                return window.appends(n)
            finally:
                window.writer.expire()

        return work

    return prepare


def _snapshots(client: PersistClient, parts: int, reads: int) -> Callable[[], Callable[[], int]]:
    """Warm snapshots of a shard of ``parts`` inline parts (case 4's slow row)."""
    shard = ShardId.new()
    writer = client.open_writer(shard)
    for i in range(parts):
        writer.compare_and_append(peers.small_batch(i, seed=i), i, i + 1)
    writer.expire()
    reader = client.open_reader(shard)
    reader.snapshot(parts - 1)

    def prepare() -> Callable[[], int]:
        def work() -> int:
            for _ in range(reads):
                reader.snapshot(parts - 1)
            return reads

        return work

    return prepare


def _table(title: str, unit: str, prof: dict[str, Any], txt: str) -> Table:
    wall = prof["wall"]
    ops = max(1, prof["ops"])
    table = Table(f"{title} ({prof['ops']} {unit}s, {wall / ops * 1000:.3f} ms each under "
                  "cProfile)",
                  ["function (file:function)", "cumulative share", "self share",
                   f"ms per {unit} (cumulative)"])
    interesting = sorted((r for r in prof["rows"] if "bench/" not in r[0]),
                         key=lambda r: r[2], reverse=True)
    for where, tt, ct in interesting[:18]:
        if ct / wall < 0.04:
            break
        table.add(where, f"{ct / wall:.0%}", f"{tt / wall:.0%}", f"{ct / ops * 1000:.3f}")
    top_self = sorted(interesting, key=lambda r: r[1], reverse=True)[:6]
    table.notes.append("Largest self times: " + "; ".join(
        f"{w} {tt / wall:.0%}" for w, tt, _ in top_self))
    table.notes.append(f"pyinstrument call tree: profiles/{txt}")
    prof["top"] = [(w, tt / wall, ct / wall) for w, tt, ct in interesting[:40]]
    return table


def run(svc: Services, scale: Scale, out_dir: str,
        log: Callable[[str], None] = print) -> CaseResult:
    """Profile the inline append and the snapshot of many inline parts (see the module
    docstring); pyinstrument trees go to ``out_dir/profiles/``."""
    result = CaseResult("profile", TITLE)
    os.makedirs(os.path.join(out_dir, "profiles"), exist_ok=True)
    bound = scale.fill_max_bytes
    n = scale.profile_appends
    with svc.pg.database("prof") as url:
        blob = svc.s3.uri(svc.s3.bucket("prof"))
        client = PersistClient.open(url, blob, inline_policy=InlinePolicy(4096, bound))
        try:
            warm = _Window(client, bound, 0.0, 1.0)  # warm-up: connections, code, data
            warm.prepare()
            warm.appends(140)  # past a state rollup: the S3 client exists
            warm.writer.expire()
            windows = {
                "empty": ("a shard filling from empty to 30% of its inline budget",
                          lambda: _Window(client, bound, 0.0, 0.3)),
                "filling": ("a shard filling from 50% to 95% of its inline budget",
                            lambda: _Window(client, bound, 0.5, 0.95)),
            }
            for key, (label, make) in windows.items():
                log(f"  profiling {label}")
                txt = f"inline_append_{key}.txt"
                prof = _profile(_appends(make, n), os.path.join(out_dir, "profiles", txt))
                result.tables.append(_table(f"Profile: inline append on {label}", "append",
                                            prof, txt))
                result.data[key] = {"appends": prof["ops"], "wall": prof["wall"],
                                    "top": prof["top"]}
        finally:
            client.close()
        parts = scale.snap_parts
        log(f"  profiling snapshots of {parts} inline parts")
        client = PersistClient.open(url, blob, inline_policy=InlinePolicy(4096, 2 << 20))
        try:
            txt = "snapshot_inline_parts.txt"
            prof = _profile(_snapshots(client, parts, max(2, scale.snap_iters // 5)),
                            os.path.join(out_dir, "profiles", txt))
            result.tables.append(_table(f"Profile: warm snapshot of {parts} inline parts "
                                        "(case 4)", "snapshot", prof, txt))
            result.data["snapshot"] = {"reads": prof["ops"], "wall": prof["wall"],
                                       "top": prof["top"]}
        finally:
            client.close()
    _merge(svc, scale, out_dir, result, log)
    return result


def _merge(svc: Services, scale: Scale, out_dir: str, result: CaseResult,
           log: Callable[[str], None]) -> None:
    n = scale.merge_curve[0]
    log(f"  profiling one merge of {si(n)} updates in {MERGE_RUNS} runs")
    folder = Path(svc.folder("prof-merge"))
    merge_data.write_runs(folder, n, MERGE_RUNS)

    def prepare() -> Callable[[], int]:
        def work() -> int:
            merge_data.merge(folder, 256 << 20)  # deletes its output parts
            return 1

        return work

    txt = "merge_32_runs.txt"
    prof = _profile(prepare, os.path.join(out_dir, "profiles", txt))
    result.tables.append(_table(f"Profile: one merge of {si(n)} updates in {MERGE_RUNS} "
                                "sorted runs (run_merge, bound 256 MiB)", "merge", prof, txt))
    result.data["merge"] = {"n": n, "runs": MERGE_RUNS, "wall": prof["wall"],
                            "top": prof["top"]}
    shutil.rmtree(folder, ignore_errors=True)
