"""Process bodies of a nemesis run. Each runs until SIGKILLed or told to stop."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from persist_pipeline.blob import FaultyBlob, open_blob
from persist_pipeline.client import PersistClient
from persist_pipeline.config import InlinePolicy, PersistConfig
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.faults import FaultyConsensus
from persist_pipeline.exceptions import CorruptData, PersistError, UpperMismatch
from persist_pipeline.faults import FaultConfig
from persist_pipeline.ids import new_token


@dataclass(frozen=True)
class NemesisSetup:
    """What every process of a run shares (picklable: only URIs and numbers)."""

    consensus_uri: str
    blob_uri: str
    wal_blob_uri: str | None
    shard: str
    workdir: str
    seed: int
    fault_rate: float
    policy: InlinePolicy
    config: PersistConfig

    def client(self, role: str, faults: bool = True) -> PersistClient:
        """A client for one process; with ``faults``, both backends are unreliable."""
        consensus = open_consensus(self.consensus_uri)
        blob = open_blob(self.blob_uri)
        wal = open_blob(self.wal_blob_uri) if self.wal_blob_uri else None
        if faults and self.fault_rate > 0:
            seed = random.Random(f"{self.seed}-{role}-{os.getpid()}").randrange(1 << 30)
            cfg = FaultConfig(fail_before=self.fault_rate, fail_after=self.fault_rate,
                              seed=seed)
            consensus = FaultyConsensus(consensus, cfg)
            blob = FaultyBlob(blob, replace(cfg, seed=seed + 1))
            if wal is not None:
                wal = FaultyBlob(wal, replace(cfg, seed=seed + 2))
        return PersistClient(consensus, blob, wal, replace(self.config,
                                                           inline_policy=self.policy))

    def path(self, name: str) -> Path:
        return Path(self.workdir) / name


T = TypeVar("T")


def _patiently(opening: Callable[[], T]) -> T:
    """Retry what a process does at start-up until the backends answer (the nemesis
    may be restarting the database just then)."""
    while True:
        try:
            return opening()
        except PersistError:
            time.sleep(0.2)


def injected_faults(client: PersistClient) -> int:
    """Faults injected so far into this client's backends."""
    total = 0
    for backend in (client.consensus, client.blobs.main, client.blobs.wal):
        inner = getattr(backend, "inner", None)
        faults = getattr(inner, "faults", None)
        if faults is not None:
            total += sum(faults.injected.values())
    return total


def _report_faults(setup: NemesisSetup, name: str, client: PersistClient) -> None:
    """Record the faults this process injected so far, in a file of its own (the runner
    adds up every process's, also those of processes it killed since)."""
    setup.path(f"{name}-{os.getpid()}.faults").write_text(str(injected_faults(client)))


def _log(f: object, line: str) -> None:
    """Append a line durably before the caller goes on."""
    assert hasattr(f, "write")
    f.write(line + "\n")
    f.flush()  # type: ignore[attr-defined]
    os.fsync(f.fileno())  # type: ignore[attr-defined]


def writer(setup: NemesisSetup, name: str) -> None:
    """Append unique keys; log each attempt before it and each ack after it."""
    client = _patiently(lambda: setup.client(name))
    handle = _patiently(lambda: client.open_writer(setup.shard, debug=name))
    rng = random.Random(f"{setup.seed}-{name}")
    upper = _patiently(handle.fetch_recent_upper)
    with setup.path(f"{name}.attempts").open("a") as attempts, \
            setup.path(f"{name}.acks").open("a") as acks:
        for i in range(10**9):
            rows = rng.choice([1, 1, 2, 3, 40, 400])
            keys = [f"{name}/{i}/{j}" for j in range(rows)]
            _log(attempts, json.dumps(keys))
            value = b"v" * rng.randrange(1, 200)
            token = new_token()
            while True:
                assert upper is not None
                batch = [(k.encode(), value, upper, 1) for k in keys]
                try:
                    handle.compare_and_append(batch, upper, upper + 1,
                                              idempotency_token=token)
                except UpperMismatch as e:
                    # Definitely not applied: try again at the new upper, as a new write.
                    upper = e.current
                    token = new_token()
                    continue
                except PersistError:
                    # Indeterminate: retry the very same call with the same token, which
                    # can never apply it twice.
                    time.sleep(0.01)
                    continue
                break
            _log(acks, json.dumps(keys))
            upper += 1
            # After every acknowledged write: writers are killed at random, often before
            # their tenth, and the faults of a process killed before reporting are lost.
            _report_faults(setup, name, client)


def compactor(setup: NemesisSetup) -> None:
    client = _patiently(lambda: setup.client("compactor"))
    name = "compactor"
    while True:
        with contextlib.suppress(PersistError):
            client.compact(setup.shard)
        _report_faults(setup, name, client)
        time.sleep(0.05)


def collector(setup: NemesisSetup) -> None:
    client = _patiently(lambda: setup.client("gc"))
    while True:
        with contextlib.suppress(PersistError):
            client.gc(setup.shard)
        time.sleep(0.5)


def reader(setup: NemesisSetup, name: str) -> None:
    """Snapshots at random times; every key must have diff 1 (never doubled)."""
    client = _patiently(lambda: setup.client(name))
    handle = _patiently(lambda: client.open_reader(setup.shard, debug=name))
    rng = random.Random(f"{setup.seed}-{name}")
    stop = setup.path("stop")
    snapshots = 0
    violations: list[str] = []
    while not stop.exists():
        try:
            upper = client._machine(setup.shard).fetch_latest().upper
            since = handle.since or 0
            if upper is None or upper <= since:
                time.sleep(0.05)
                continue
            as_of = rng.randrange(since, upper)
            snap = handle.snapshot(as_of)
            bad = [d for d in snap.column("d").to_pylist() if d != 1]
            if bad:
                violations.append(f"snapshot at {as_of}: diffs {sorted(set(bad))}")
            snapshots += 1
            if rng.random() < 0.3:
                handle.downgrade_since(max(since, as_of - 3))
        except CorruptData as e:
            violations.append(f"snapshot failed on stored data: {e}")
        except PersistError:
            time.sleep(0.05)
    _report_faults(setup, name, client)
    setup.path(f"{name}.json").write_text(json.dumps({"snapshots": snapshots,
                                                     "violations": violations}))


def listener(setup: NemesisSetup, name: str) -> None:
    """One long-lived listen; at the end its accumulated collection must equal a
    fresh snapshot at the same frontier."""
    client = _patiently(lambda: setup.client(name))
    handle = _patiently(lambda: client.open_reader(setup.shard, debug=name))
    as_of = max(0, (_patiently(client._machine(setup.shard).fetch_latest).upper or 1) - 1)
    acc: dict[bytes, int] = {}
    stop = setup.path("stop")
    while True:
        try:
            for k, _v, d in _snapshot_rows(handle, as_of):
                acc[k] = acc.get(k, 0) + d
            break
        except PersistError:
            if stop.exists():  # nothing was ever written: the run is over all the same
                setup.path(f"{name}.json").write_text(json.dumps(
                    {"frontier": 0, "listened": 0, "mismatches": [], "mismatch_count": 0}))
                return
            time.sleep(0.05)
    listen = handle.listen(as_of)
    frontier = as_of + 1
    while not stop.exists():
        try:
            events = listen.poll(timeout_s=0.5)
        except PersistError:
            continue
        for event in events:
            if event.kind == "updates":
                assert event.updates is not None
                for k, d in zip(event.updates.column("k").to_pylist(),
                                event.updates.column("d").to_pylist(), strict=True):
                    acc[k] = acc.get(k, 0) + d
            elif event.upper is not None:
                frontier = event.upper
    _report_faults(setup, name, client)
    acc = {k: d for k, d in acc.items() if d}
    result = {"frontier": frontier, "listened": len(acc), "mismatches": []}
    fresh = _patiently(lambda: setup.client(name + "-check", faults=False))
    snap = {k: d for k, _v, d in _patiently(lambda: _snapshot_rows(
        fresh.open_reader(setup.shard), frontier - 1))}
    diff = set(snap.items()) ^ set(acc.items())
    result["mismatches"] = sorted(k.decode(errors="replace") for k, _ in diff)[:20]
    result["mismatch_count"] = len(diff)
    setup.path(f"{name}.json").write_text(json.dumps(result))


def _snapshot_rows(handle: object, as_of: int) -> list[tuple[bytes, bytes, int]]:
    snap = handle.snapshot(as_of)  # type: ignore[attr-defined]
    return list(zip(snap.column("k").to_pylist(), snap.column("v").to_pylist(),
                    snap.column("d").to_pylist(), strict=True))
