"""Case 3: write throughput with 1, 2, 4 and 8 writer processes.

Two layouts: every process appends to ONE shard (contention: a writer whose expected
upper is stale gets an upper mismatch, catches up and retries; retries are counted), and
every process appends to its OWN shard. Each run writes ``scale.tp_appends`` small
appends per shard in total (shared: split across the writers; separate: each writer's
own), which stays below the 1 MiB inline budget, so every append is inline. The writer
processes are started once (spawn) and reused; a run starts when every writer is ready
(client open, connection warm), and its wall time runs from the first writer's start to
the last writer's end. PostgreSQL consensus, blob on the S3 server; median of
``scale.tp_reps`` runs.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any

from bench import peers
from bench.common import CaseResult, Scale, Table, ratio, si
from bench.services import Services

TITLE = "Write throughput, writer processes on one shard and on separate shards"


def _worker(commands: Any, results: Any) -> None:
    """A writer process: runs tasks from ``commands`` until it gets None."""
    from persist_pipeline import InlinePolicy, PersistClient, ShardId, UpperMismatch

    clients: dict[tuple[str, str], Any] = {}
    while True:
        task = commands.get()
        if task is None:
            break
        url, blob_uri, shard, quota, seed = task
        client = clients.get((url, blob_uri))
        if client is None:
            client = clients[(url, blob_uri)] = PersistClient.open(
                url, blob_uri, inline_policy=InlinePolicy())
        warm = client.open_writer(ShardId.new())
        for i in range(3):
            warm.compare_and_append(peers.small_batch(i), i, i + 1)
        warm.expire()
        writer = client.open_writer(shard)
        batches = [peers.small_batch(0, seed=seed * 100_000 + i) for i in range(quota)]
        attempts0 = client.metrics.cas_attempts
        seq_mismatch0 = client.metrics.cas_mismatches
        results.put(("ready", None))
        if commands.get() != "go":
            raise RuntimeError("expected go")
        done = retries = nbytes = 0
        started = time.monotonic()
        expected = writer.fetch_recent_upper()
        while done < quota:
            batch = [(k, v, expected, d) for k, v, _, d in batches[done]]
            try:
                res = writer.compare_and_append(batch, expected, expected + 1)
            except UpperMismatch as mismatch:
                retries += 1
                expected = mismatch.current
                continue
            done += 1
            nbytes += res.encoded_bytes
            expected = res.upper
        ended = time.monotonic()
        counts = {"cas_attempts": client.metrics.cas_attempts - attempts0,
                  "seqno_mismatches": client.metrics.cas_mismatches - seq_mismatch0}
        writer.expire()
        results.put(("done", {"appends": done, "retries": retries, "bytes": nbytes,
                              "start": started, "end": ended, **counts}))
    for client in clients.values():
        client.close()


class WriterPool:
    """``n`` spawned writer processes, reused across runs."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.results: Any = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=_worker, args=(q, self.results), daemon=True)
                      for q in self.commands]
        self.closed = False
        for p in self.procs:
            p.start()

    def _get(self, timeout: float = 300) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.results.get(timeout=1)  # type: ignore[no-any-return]
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs):
                    raise RuntimeError("a writer process died") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("writer processes did not answer") from None

    def run(self, tasks: list[tuple[str, str, str, int, int]]) -> list[dict[str, Any]]:
        """Run one task per writer (the first ``len(tasks)`` writers) at the same time."""
        for q, task in zip(self.commands, tasks, strict=False):
            q.put(task)
        for _ in tasks:
            kind, _payload = self._get()
            assert kind == "ready", kind
        for q in self.commands[:len(tasks)]:
            q.put("go")
        out = []
        for _ in tasks:
            kind, payload = self._get()
            assert kind == "done", kind
            out.append(payload)
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 3 (see the module docstring)."""
    from persist_pipeline import PersistClient, ShardId

    result = CaseResult("case3", TITLE)
    table = Table(f"Case 3: {TITLE}",
                  ["layout", "writers", "appends", "appends/s", "MB/s", "vs 1 writer",
                   "API retries (upper mismatch)", "CaS attempts / append"])
    data: dict[str, list[dict[str, Any]]] = {"shared": [], "separate": []}
    pool = WriterPool(max(scale.tp_writers))
    try:
        with svc.pg.database("c3") as url:
            blob = svc.s3.uri(svc.s3.bucket("c3"))
            setup = PersistClient.open(url, blob)
            try:
                for layout in ("shared", "separate"):
                    base = 0.0
                    for n in scale.tp_writers:
                        runs = []
                        for rep in range(scale.tp_reps):
                            log(f"  {layout}: {n} writer(s), run {rep + 1}/{scale.tp_reps}")
                            if layout == "shared":
                                shard = ShardId.new()
                                setup.open_writer(shard).expire()  # create it
                                quotas = [scale.tp_appends // n] * n
                                quotas[0] += scale.tp_appends - sum(quotas)
                                tasks = [(url, blob, str(shard), q, i)
                                         for i, q in enumerate(quotas)]
                            else:
                                tasks = [(url, blob, str(ShardId.new()), scale.tp_appends, i)
                                         for i in range(n)]
                            out = pool.run(tasks)
                            wall = max(o["end"] for o in out) - min(o["start"] for o in out)
                            appends = sum(o["appends"] for o in out)
                            runs.append({
                                "writers": n, "appends": appends, "wall": wall,
                                "per_s": appends / wall,
                                "mb_s": sum(o["bytes"] for o in out) / wall / 1e6,
                                "retries": sum(o["retries"] for o in out),
                                "cas": sum(o["cas_attempts"] for o in out),
                            })
                        runs.sort(key=lambda r: r["per_s"])
                        median = runs[len(runs) // 2]
                        data[layout].append(median)
                        if n == scale.tp_writers[0]:
                            base = median["per_s"]
                        table.add(layout if n == scale.tp_writers[0] else "", n,
                                  median["appends"], si(median["per_s"]),
                                  f"{median['mb_s']:.2f}", ratio(median["per_s"], base),
                                  median["retries"],
                                  f"{median['cas'] / max(1, median['appends']):.2f}")
            finally:
                # The writers close their clients, which finish background maintenance
                # (commits), while the database still exists.
                pool.close()
                setup.close()
    finally:
        pool.close()
    table.notes += [
        "shared: all writers append to one shard; each append must win the shard's upper, "
        "so the shard's appends are serialized by its compare-and-set; a loser catches up "
        "and retries (API retries). CaS attempts / append counts every consensus write "
        "the writers made (a lost seqno race inside the library's loop is a second attempt "
        "of the same append; re-runs after PostgreSQL serialization failures happen inside "
        "one attempt and are not counted).",
        "separate: each writer appends to its own shard (no contention).",
        "The machine has 2 cores: with 4 and 8 writers the processes and PostgreSQL share "
        "them.",
    ]
    result.tables.append(table)
    result.data = data
    return result
