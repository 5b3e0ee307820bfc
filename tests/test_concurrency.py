"""Many writers (threads and processes) on one shard: no lost or doubled update, the
inline bound holds in every state version, and compaction can run meanwhile."""

from __future__ import annotations

import multiprocessing as mp
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId, UpperMismatch
from tests.fixtures.location import Location
from tests.helpers import expected_snapshot, process_context, rows, state_history

#: A small budget so that concurrent writers keep running into the bound.
TIGHT = InlinePolicy(threshold_bytes=4096, max_bytes=2500)


def write_loop(client: PersistClient, shard: str, name: str, count: int) -> list[tuple]:
    """Append ``count`` unique updates, one per compare_and_append, retrying mismatches.

    Returns what was acknowledged, with the time it was written at.
    """
    writer = client.open_writer(shard, debug=name)
    acked = []
    upper = writer.fetch_recent_upper()
    for i in range(count):
        key = f"{name}-{i}".encode()
        while True:
            update = (key, b"x" * 200, upper, 1)
            try:
                writer.compare_and_append([update], upper, upper + 1)
            except UpperMismatch as e:
                upper = e.current
                continue
            acked.append(update)
            upper += 1
            break
    writer.expire()
    return acked


def check_history(client: PersistClient, shard: str, acked: list[tuple],
                  policy: InlinePolicy) -> None:
    upper = client.inspect(shard)["upper"]
    snap = rows(client.open_reader(shard).snapshot(upper - 1), upper - 1)
    assert snap == expected_snapshot(acked, upper - 1)
    assert len(snap) == len(acked) == len({u[0] for u in acked})  # once each
    versions = list(state_history(client, shard))
    assert versions, "no history"
    assert max(s.inline_bytes for s in versions) <= policy.max_bytes
    uppers = [s.upper for s in versions]
    assert uppers == sorted(uppers), "upper went backwards"


def test_threads_append_to_one_shard(durable_location: Location):
    client = durable_location.client(TIGHT)
    shard = str(ShardId.new())
    client.open_writer(shard).expire()
    # One client per thread: each has its own cached state, as separate processes do.
    clients = [durable_location.client(TIGHT) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda n: write_loop(clients[n], shard, f"t{n}", 15), range(8)))
    acked = [u for r in results for u in r]
    assert len(acked) == 120
    assert sum(c.metrics.cas_mismatches for c in clients) > 0, "the writers never raced"
    for c in clients:
        c.close()
    check_history(client, shard, acked, TIGHT)
    inspect = client.inspect(shard)
    assert inspect["upper"] == 120
    client.close()


def _process_writer(location: Location, shard: str, name: str, count: int,
                    out: mp.Queue) -> None:
    client = location.client(TIGHT)
    try:
        out.put((name, write_loop(client, shard, name, count)))
    finally:
        client.close()


def test_processes_append_to_one_shard(durable_location: Location):
    client = durable_location.client(TIGHT)
    shard = str(ShardId.new())
    client.open_writer(shard).expire()
    ctx = process_context()
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_process_writer, args=(durable_location, shard, f"p{n}", 12, out))
             for n in range(4)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    acked = [u for r in results.values() for u in r]
    assert len(acked) == 48
    check_history(client, shard, acked, TIGHT)
    client.close()


@pytest.mark.parametrize("policy", [TIGHT, InlinePolicy(0, 0)], ids=["inline", "blob"])
def test_compaction_runs_while_writers_write(durable_location: Location, policy: InlinePolicy):
    client = durable_location.client(policy)
    shard = str(ShardId.new())
    reader = client.open_reader(shard, create=True)
    stop = threading.Event()
    compactions = []

    def compact_loop() -> None:
        other = durable_location.client(policy)
        while not stop.is_set():
            compactions.append(other.compact(shard))
        other.close()

    compactor = threading.Thread(target=compact_loop)
    compactor.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda n: write_loop(client, shard, f"w{n}", 15), range(4)))
    finally:
        stop.set()
        compactor.join()
    acked = [u for r in results for u in r]
    assert sum(c["applied"] for c in compactions) > 0
    check_history(client, shard, acked, policy)
    client.compact(shard)
    assert client.inspect(shard)["inline_bytes"] == 0
    upper = client.inspect(shard)["upper"]
    assert rows(reader.snapshot(upper - 1), upper - 1) == expected_snapshot(acked, upper - 1)
    client.close()


def test_several_gcs_compaction_readers_and_writers_at_once(durable_location: Location):
    """Guarantee 10 with real concurrency: three GCs, a compactor, readers streaming
    snapshots and writers, each with its own client (its own cache, as a process has),
    all on one shard at once. No acknowledged update is lost or doubled, every read
    returns the collection at its time, and the head references no deleted blob."""
    cfg = PersistConfig(rollup_threshold=3, heartbeat_interval_s=0)
    client = durable_location.client(TIGHT, cfg)
    shard = str(ShardId.new())
    client.open_writer(shard).expire()
    stop = threading.Event()
    errors: list[BaseException] = []
    reads: list[tuple[int, list[tuple]]] = []

    def maintain(kind: str) -> None:
        c = durable_location.client(TIGHT, cfg)
        try:
            while not stop.is_set():
                if kind == "gc":
                    c.gc(shard)
                else:
                    c.compact(shard)
        except BaseException as e:  # reported below: a thread's error would be lost
            errors.append(e)
        finally:
            c.close()

    def read() -> None:
        c = durable_location.client(TIGHT, cfg)
        try:
            reader = c.open_reader(shard)
            while not stop.is_set():
                upper = c.inspect(shard)["upper"]
                if not upper:
                    continue
                got = [(r["k"], r["v"], r["d"])
                       for b in reader.snapshot_batches(upper - 1, max_rows=5)
                       for r in b.to_pylist()]
                reads.append((upper - 1, got))
                reader.heartbeat()
            reader.expire()
        except BaseException as e:
            errors.append(e)
        finally:
            c.close()

    background = [threading.Thread(target=maintain, args=(kind,))
                  for kind in ("gc", "gc", "gc", "compact")]
    background += [threading.Thread(target=read) for _ in range(2)]
    for t in background:
        t.start()
    clients = [durable_location.client(TIGHT, cfg) for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda n: write_loop(clients[n], shard, f"t{n}", 25),
                                    range(4)))
    finally:
        stop.set()
        for t in background:
            t.join()
        for c in clients:
            c.close()
    assert errors == []
    acked = [u for r in results for u in r]
    assert len(acked) == 100
    assert reads, "the readers read while the others wrote"
    for as_of, got in reads:
        assert got == [(k, v, d) for k, v, d in rows_at(acked, as_of)]
    client.gc(shard)
    upper = client.inspect(shard)["upper"]
    snap = rows(client.open_reader(shard).snapshot(upper - 1), upper - 1)
    assert snap == expected_snapshot(acked, upper - 1)
    state = client._machine(shard).fetch_latest()
    assert [key for store, key in state.referenced_blobs()
            if client.blobs.store(store).get(key) is None] == []
    client.close()


def rows_at(acked: list[tuple], as_of: int) -> list[tuple]:
    """The consolidated (k, v, d) rows of ``acked`` at ``as_of``, in key order."""
    return sorted((k, v, d) for k, v, t, d in acked if t <= as_of)
