"""Writers and a compactor SIGKILLed mid-operation: no acknowledged write is lost or doubled,
and the shard stays readable (the "forcibly kill processes" test the persist prototype asked
for)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from persist_pipeline import InlinePolicy, ShardId, UpperMismatch
from tests.fixtures.location import Location
from tests.helpers import process_context

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow

POLICY = InlinePolicy(threshold_bytes=4096, max_bytes=8 * 1024)


def _writer(location: Location, shard: str, name: str, ack_path: str) -> None:
    """Append unique keys forever, logging each one only after it is acknowledged."""
    client = location.client(POLICY)
    writer = client.open_writer(shard, debug=name)
    upper = writer.fetch_recent_upper()
    rng = random.Random(name)
    with open(ack_path, "a") as acks:
        for i in range(1_000_000):
            key = f"{name}-{i}"
            rows = 200 if rng.random() < 0.1 else 2  # some writes take the blob path
            updates = [(f"{key}/{j}".encode(), b"x" * 100, 0, 1) for j in range(rows)]
            while True:
                batch = [(k, v, upper, d) for k, v, _, d in updates]
                try:
                    writer.compare_and_append(batch, upper, upper + 1)
                except UpperMismatch as e:
                    upper = e.current
                    continue
                break
            acks.write(f"{key} {rows}\n")
            acks.flush()
            os.fsync(acks.fileno())
            upper += 1


def _compactor(location: Location, shard: str) -> None:
    client = location.client(POLICY)
    while True:
        client.compact(shard)
        time.sleep(0.05)


def test_sigkilled_writers_and_compactor_lose_and_double_nothing(durable_location: Location,
                                                                 tmp_path: Path):
    client = durable_location.client(POLICY)
    shard = str(ShardId.new())
    client.open_writer(shard).expire()
    ctx = process_context()
    rng = random.Random(5)
    ack_files = []
    kills = 0
    for round_ in range(4):
        procs = []
        for w in range(2):
            ack = tmp_path / f"acks-{round_}-{w}.txt"
            ack_files.append(ack)
            procs.append(ctx.Process(target=_writer,
                                     args=(durable_location, shard, f"r{round_}w{w}", str(ack))))
        procs.append(ctx.Process(target=_compactor, args=(durable_location, shard)))
        for p in procs:
            p.start()
        # Kill once this round's writers are acknowledging writes (start-up under load
        # can take a while), at a random moment a little later.
        round_acks = ack_files[-2:]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sum(
                len(a.read_text().splitlines()) for a in round_acks if a.exists()) < 5:
            time.sleep(0.1)
        time.sleep(rng.random() * 1.5)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            kills += 1
    acked: dict[bytes, int] = {}
    for ack in ack_files:
        if ack.exists():
            for line in ack.read_text().splitlines():
                key, rows = line.split()
                for j in range(int(rows)):
                    acked[f"{key}/{j}".encode()] = 1
    assert len(acked) > 50, "the writers barely wrote anything before being killed"
    upper = client.inspect(shard)["upper"]
    snap = client.open_reader(shard).snapshot(upper - 1)
    counts = dict(zip(snap.column("k").to_pylist(), snap.column("d").to_pylist(), strict=True))
    lost = [k for k in acked if k not in counts]
    doubled = [k for k, d in counts.items() if d != 1]
    assert not lost, f"{len(lost)} acknowledged updates lost, e.g. {lost[:3]}"
    assert not doubled, f"{len(doubled)} updates applied more than once, e.g. {doubled[:3]}"
    # Unacknowledged writes (killed after commit, before the ack) may be present, once.
    client.compact(shard)
    assert client.open_reader(shard).snapshot(upper - 1).equals(snap)
    client.close()
