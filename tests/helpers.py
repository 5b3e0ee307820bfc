"""Shared test helpers: a reference model of a collection, state-history replay, and
clocks that let a test pass time without sleeping."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar
from unittest import mock

import pyarrow as pa

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig
from persist_pipeline.blob import open_blob
from persist_pipeline.blob.base import Blob, BlobMeta
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.internal import state_codec
from persist_pipeline.internal.processes import StartContext, preloaded_context
from persist_pipeline.internal.state import State
from tests.fixtures.location import Location

Update = tuple[bytes, bytes, int, int]

#: How long any wait for another thread or process may take before the test fails.
WAIT_S = 10.0


def expected_snapshot(updates: Iterable[Update], as_of: int) -> list[tuple[bytes, bytes, int]]:
    """The consolidated collection at ``as_of``: sorted (k, v, diff) with diff != 0."""
    sums: dict[tuple[bytes, bytes], int] = defaultdict(int)
    for k, v, t, d in updates:
        if t <= as_of:
            sums[(k, v)] += d
    return sorted((k, v, d) for (k, v), d in sums.items() if d != 0)


def rows(table: pa.Table, as_of: int | None = None) -> list[tuple[bytes, bytes, int]]:
    """A snapshot table as sorted (k, v, diff), checking every time equals ``as_of``."""
    out = []
    for r in table.to_pylist():
        if as_of is not None:
            assert r["t"] == as_of
        out.append((r["k"], r["v"], r["d"]))
    return sorted(out)


def state_history(client: PersistClient, shard: str) -> Iterator[State]:
    """Every state version still in consensus, rebuilt record by record."""
    consensus = client.consensus
    records = consensus.scan(shard, 0)
    if not records:
        return
    first = records[0].seqno
    if first == 1:
        state = State(shard_id=shard)
    else:
        # GC keeps a rollup at the earliest live record.
        rollup = client._machine(shard).fetch_latest().rollups[first]
        data = client.blobs.main.get(rollup.key)
        assert data is not None, f"no rollup at earliest record {first}"
        state = state_codec.decode_state(data, "test")
        yield state
    for rec in records:
        if rec.seqno <= state.seqno:
            continue
        where = f"seqno {rec.seqno}"
        state = state_codec.apply_diff(state, state_codec.decode_diff(rec.data, where), where)
        yield state


class ForwardingConsensus(Consensus):
    """A consensus wrapper that passes every call to ``inner``; test wrappers override
    the calls they interfere with."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner

    def head(self, shard: str) -> VersionedData | None:
        return self.inner.head(shard)

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        return self.inner.compare_and_set(shard, expected, new)

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        return self.inner.compare_and_set_many(writes)

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        return self.inner.scan(shard, from_seqno, limit)

    def truncate(self, shard: str, seqno: int) -> int:
        return self.inner.truncate(shard, seqno)

    def list_shards(self) -> list[str]:
        return self.inner.list_shards()

    def list_heads(self) -> Mapping[str, VersionedData]:
        return self.inner.list_heads()

    def close(self) -> None:
        self.inner.close()


class BeforeNextCas(ForwardingConsensus):
    """Runs a hook right before the next compare_and_set, once armed: a process paused
    between computing its commit (or uploading its parts) and sending it, while others
    act."""

    def __init__(self, inner: Consensus) -> None:
        super().__init__(inner)
        self._hook: Callable[[], None] | None = None

    def arm(self, hook: Callable[[], None]) -> None:
        self._hook = hook

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        return self.inner.compare_and_set(shard, expected, new)


class StoreOnClock(Blob):
    """A blob store whose clock is a test clock's: it stamps each object with the clock's
    offset from real time when it is written, and tells the time (``clock_now``, what GC
    measures blob ages with) with the offset now. So a test that advances its clock ages
    the objects as a real store's clock would, without sleeping. Stamps of one clock are
    shared by every wrapper on it (several clients, one store)."""

    _stamps: ClassVar[dict[int, dict[str, float]]] = {}

    def __init__(self, inner: Blob, clock: Any) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.stamp_resolution_s = inner.stamp_resolution_s
        self._clock = clock
        self._offsets = StoreOnClock._stamps.setdefault(id(clock), {})

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        return self.inner.get_range(key, start, length)

    def set(self, key: str, value: bytes) -> None:
        self._offsets[key] = self._clock.offset_s
        self.inner.set(key, value)

    def delete(self, key: str) -> int | None:
        return self.inner.delete(key)

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        for meta in self.inner.list_keys(prefix):
            yield BlobMeta(meta.key, meta.size,
                           meta.last_modified + self._offsets.get(meta.key, 0.0))

    def clock_now(self, probe_key: str) -> float:
        return self.inner.clock_now(probe_key) + self._clock.offset_s

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe()


class HandClock:
    """Real time plus an offset the test advances, for the wall and monotonic clocks of
    the clients that use it and, through :class:`StoreOnClock`, for the clock of their
    blob stores; sleeps are real (the library's retry backoffs and polls still wait)."""

    def __init__(self) -> None:
        self._offset_ms = 0
        self._lock = threading.Lock()

    @property
    def offset_s(self) -> float:
        with self._lock:
            return self._offset_ms / 1000

    def now_ms(self) -> int:
        with self._lock:
            return int(time.time() * 1000) + self._offset_ms

    def monotonic(self) -> float:
        return time.monotonic() + self.offset_s

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._offset_ms += int(seconds * 1000)


def client_on_clock(location: Location, clock: HandClock, policy: InlinePolicy | None = None,
                    config: PersistConfig | None = None, *,
                    consensus: Consensus | None = None) -> PersistClient:
    """What ``location.client(policy, config)`` opens, on the real backends, with its time
    on ``clock``: the client's leases, walltimes and commit deadlines, and (through
    :class:`StoreOnClock`) the stamps and the time of its blob stores, which GC's orphan
    sweep measures ages with. ``clock.advance`` is then time passing for this client and
    its stores, without a sleep. ``consensus``: the location's, wrapped by the test
    (default: opened here)."""
    cfg = config or PersistConfig()
    if policy is not None:
        cfg = replace(cfg, inline_policy=policy)
    consensus = consensus or open_consensus(location.consensus_uri)
    try:
        blob: Blob = StoreOnClock(open_blob(location.blob_uri), clock)
        wal = (StoreOnClock(open_blob(location.wal_blob_uri), clock)
               if location.wal_blob_uri else None)
    except BaseException:
        consensus.close()
        raise
    return PersistClient(consensus, blob, wal, cfg, clock)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Return once ``condition()`` holds (checked every few milliseconds); fail the test
    saying ``what`` was awaited if it does not within ``timeout_s``. For waiting on a
    background thread or another process, whose progress the test can only observe."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.005)


class SkewedClock:
    """Another machine's clocks: the wall clock ``wall_offset_s`` away from real time, and
    a monotonic clock with its own origin (monotonic values of two machines are never
    comparable); ``advance`` moves both, as time passing (a pause) does."""

    def __init__(self, wall_offset_s: float = 0.0, mono_origin_s: float = 1e6) -> None:
        self.wall_offset_s = wall_offset_s
        self._mono = mono_origin_s
        self._passed = 0.0

    def now_ms(self) -> int:
        return int((time.time() + self.wall_offset_s + self._passed) * 1000)

    def monotonic(self) -> float:
        return self._mono + self._passed

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self._passed += seconds

    def step_wall(self, seconds: float) -> None:
        """A wall-clock step (NTP): the wall clock jumps, the monotonic one does not."""
        self.wall_offset_s += seconds


def examples(n: int) -> int:
    """A hypothesis test's example count: ``n`` under the ``ci`` profile, a fifth under
    ``fast`` (``HYPOTHESIS_PROFILE``, see tests/conftest.py)."""
    return max(5, n // 5) if os.environ.get("HYPOTHESIS_PROFILE") == "fast" else n


def run_cli(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``persist-pipeline ARGS`` run in this process through ``cli.main``, with the
    environment ``env`` and the stdout (text and binary) and stderr of a real
    invocation; the logging levels the command sets are restored after."""
    from persist_pipeline import cli as cli_module

    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    err = io.StringIO()
    root, library = logging.getLogger(), logging.getLogger("persist_pipeline")
    saved = (list(root.handlers), root.level, library.level)
    with mock.patch.dict(os.environ, dict(env), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_module.main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            root.handlers[:] = saved[0]
            root.setLevel(saved[1])
            library.setLevel(saved[2])
    stdout = out.buffer.getvalue().decode()  # type: ignore[attr-defined]
    return subprocess.CompletedProcess(list(args), code, stdout, err.getvalue())


#: What a test's child processes import before their own module: the library and the
#: packages under it (about a second of CPU in each child when started by ``spawn``).
CHILD_PRELOAD = ("persist_pipeline", "persist_pipeline.transaction", "pyarrow.parquet",
                 "sqlalchemy", "psycopg2", "boto3", "botocore.session", "pytest",
                 "tests.helpers", "tests.fixtures.location")


def process_context() -> StartContext:
    """The context tests start worker processes from: children forked from a server
    that preloaded the library (as isolated from the test process as ``spawn``: no
    inherited connections, threads or locks; the working directory, ``sys.path`` and
    the environment are the test's), instead of importing it again in every child."""
    return preloaded_context(CHILD_PRELOAD)
