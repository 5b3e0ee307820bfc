"""Merges and snapshots in bounded memory.

- the streaming k-way merge equals a plain model of consolidation on random data
  (hypothesis), through every path: chunked runs, several rounds, multi-pass merges with
  intermediate parts, ranged row-group reads, key ranges;
- ``snapshot_batches`` streams the exact snapshot in ``(k, v)`` order on every backend;
- peak memory of a merge many times the bound stays flat (measured in a subprocess),
  with a negative control: the in-memory merge of the same data does not;
- a merge split by key range commits exactly once, also when the reply of its commit is
  lost; a failing task (any exception) fails its own merge only.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline import spark as spark_driver
from persist_pipeline.blob.memory import MemoryBlob
from persist_pipeline.compaction import KeyRange, merge_requests, run_merge
from persist_pipeline.exceptions import BlobUnavailable, CorruptPart, PartMissing
from persist_pipeline.internal import blobs as blobs_module
from persist_pipeline.internal import merge as merge_module
from persist_pipeline.internal.blobs import PartWriter
from persist_pipeline.internal.merge import merge_runs
from persist_pipeline.internal.state import Batch, Description
from persist_pipeline.internal.trace import MergeReq
from persist_pipeline.updates import SCHEMA, consolidate, decode_parquet
from tests.fixtures.location import Location
from tests.helpers import examples, rows, state_history
from tests.test_regressions_lost_replies import Clients

Update = tuple[bytes, bytes, int, int]

keys = st.binary(min_size=0, max_size=3)
vals = st.sampled_from([b"", b"a", b"b", b"\xff"])
updates = st.lists(st.tuples(keys, vals, st.integers(0, 6), st.integers(-2, 2)),
                   max_size=60)


def model(runs: list[list[Update]], since: int = 0,
          key_range: KeyRange | None = None) -> list[Update]:
    """Consolidation by definition: times advanced to ``since``, diffs summed, zeros gone."""
    sums: dict[tuple[bytes, bytes, int], int] = defaultdict(int)
    for run in runs:
        for k, v, t, d in run:
            if key_range and ((key_range.lower is not None and k < key_range.lower) or
                              (key_range.upper is not None and k >= key_range.upper)):
                continue
            sums[(k, v, max(t, since))] += d
    return sorted((k, v, t, d) for (k, v, t), d in sums.items() if d)


def table_of(run: list[Update]) -> pa.Table:
    return consolidate(pa.table({"k": pa.array([u[0] for u in run], pa.binary()),
                                 "v": pa.array([u[1] for u in run], pa.binary()),
                                 "t": pa.array([u[2] for u in run], pa.int64()),
                                 "d": pa.array([u[3] for u in run], pa.int64())}))


def as_updates(tables: list[pa.Table]) -> list[Update]:
    return [(r["k"], r["v"], r["t"], r["d"]) for t in tables for r in t.to_pylist()]


@pytest.fixture
def tiny_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounds small enough that a few dozen updates take many chunks, rounds and passes."""
    monkeypatch.setattr(merge_module, "MIN_CHUNK_BYTES", 64)
    monkeypatch.setattr(merge_module, "RUN_OVERHEAD_BYTES", 256)
    monkeypatch.setattr(merge_module, "MIN_READ_BYTES", 16)
    monkeypatch.setattr(blobs_module, "MIN_BATCH_ROWS", 1)
    monkeypatch.setattr(blobs_module, "WHOLE_FETCH_MAX_BYTES", 0)  # ranged reads always


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(updates, min_size=1, max_size=6), st.integers(1, 300), st.data())
def test_merge_runs_equals_consolidation_of_everything(runs: list[list[Update]],
                                                       chunk_bytes: int,
                                                       data: st.DataObject) -> None:
    sources = []
    for n, run in enumerate(runs):
        table = table_of(run)
        cuts = sorted(data.draw(st.lists(st.integers(0, table.num_rows), max_size=4)))
        bounds = [0, *cuts, table.num_rows]
        chunks = [table.slice(a, b - a) for a, b in itertools.pairwise(bounds)]
        sources.append((iter(chunks), f"run {n}"))
    out = list(merge_runs(sources, chunk_bytes))
    assert as_updates(out) == model(runs)
    # Rounds come out in order, each consolidated.
    flat = as_updates(out)
    assert flat == sorted(flat) and len({u[:3] for u in flat}) == len(flat)


def _chunked(table: pa.Table, data: st.DataObject) -> list[pa.Table]:
    cuts = sorted(data.draw(st.lists(st.integers(0, table.num_rows), max_size=4)))
    return [table.slice(a, b - a) for a, b in itertools.pairwise([0, *cuts, table.num_rows])]


#: Keys that exercise every way a round is ordered: short keys and keys one zero byte
#: longer (their 8-byte prefixes tie), keys of one width (the matrix path), and keys
#: sharing 9 or more bytes past the round's common prefix (their prefixes tie and are
#: sorted again on the whole key).
merge_keys = st.one_of(
    st.binary(max_size=3),
    st.binary(min_size=10, max_size=10),
    st.builds(lambda head, tail: head + tail,
              st.sampled_from([b"", b"k", b"shared-prefix-", b"\x00" * 9, b"\xff" * 12]),
              st.binary(max_size=3)))
merge_updates = st.lists(st.tuples(merge_keys, vals, st.integers(0, 6), st.integers(-2, 2)),
                         max_size=40)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(merge_updates, min_size=2, max_size=40), st.integers(1, 2000), st.data())
def test_merge_of_many_runs_equals_consolidation_whatever_the_keys(
        runs: list[list[Update]], chunk_bytes: int, data: st.DataObject) -> None:
    sources = [(iter(_chunked(table_of(run), data)), f"run {n}") for n, run in enumerate(runs)]
    out = list(merge_runs(sources, chunk_bytes))
    flat = as_updates(out)
    assert flat == model(runs)
    assert all(t.schema == SCHEMA for t in out)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(merge_updates, min_size=1, max_size=8), st.integers(1, 500), st.data())
def test_a_merge_with_an_unsorted_run_is_refused_or_exact(
        runs: list[list[Update]], chunk_bytes: int, data: st.DataObject) -> None:
    """A run that is not sorted is reported as corrupt when its rows would come out of
    order; whenever the merge does not refuse, its result is the exact consolidation."""
    tables = [table_of(run) for run in runs]
    bad = data.draw(st.integers(0, len(tables) - 1))
    rows = tables[bad].to_pylist()
    data.draw(st.randoms()).shuffle(rows)
    tables[bad] = pa.Table.from_pylist(rows, schema=SCHEMA)
    sources = [(iter(_chunked(t, data)), f"run {n}") for n, t in enumerate(tables)]
    try:
        out = list(merge_runs(sources, chunk_bytes))
    except CorruptPart as e:
        assert "not sorted" in str(e)
        return
    assert as_updates(out) == model(runs)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(merge_keys, min_size=1, max_size=30), st.integers(0, 12))
def test_key_prefixes_are_the_eight_bytes_after_the_skipped_ones(keys: list[bytes],
                                                                 skip: int) -> None:
    array = pa.array([b"pad", *keys], pa.binary()).slice(1)  # an offset into the buffers
    got = merge_module._key_prefixes(array, skip).tolist()
    assert got == [int.from_bytes(k[skip:skip + 8].ljust(8, b"\x00"), "big") for k in keys]


def test_merge_runs_refuses_a_run_that_is_not_sorted() -> None:
    unsorted = pa.table({"k": [b"b", b"a"], "v": [b"", b""], "t": [0, 0], "d": [1, 1]},
                        schema=SCHEMA)
    with pytest.raises(CorruptPart, match="not sorted"):
        list(merge_runs([(iter([unsorted]), "run x")], 1 << 20))


def _piece(*updates: Update) -> pa.Table:
    return pa.table({"k": [u[0] for u in updates], "v": [u[1] for u in updates],
                     "t": [u[2] for u in updates], "d": [u[3] for u in updates]},
                    schema=SCHEMA)


def test_one_run_taken_in_pieces_is_passed_on_only_when_nothing_needs_merging() -> None:
    """A round that takes one run's rows in several pieces (a large part's row groups)
    passes them on as they are, uncopied, when every row sorts above the one before it
    and no diff is zero; rows equal within or across pieces are still summed, a zero
    diff dropped, and a row below the previous piece's last refused as not sorted."""
    def merged(*pieces: pa.Table) -> list[pa.Table]:
        return list(merge_runs([(iter(pieces), "run x")], 1 << 20))

    clean = [_piece((b"a", b"", 3, 1), (b"b", b"", 3, 2)), _piece((b"b", b"x", 3, -1))]
    [out] = merged(*clean)
    assert out.column("k").num_chunks == 2  # the pieces as they are
    assert as_updates([out]) == as_updates(clean)
    equal_across = [_piece((b"a", b"", 3, 1), (b"b", b"", 3, 2)),
                    _piece((b"b", b"", 3, 3), (b"c", b"", 3, 1))]
    assert as_updates(merged(*equal_across)) == \
        [(b"a", b"", 3, 1), (b"b", b"", 3, 5), (b"c", b"", 3, 1)]
    equal_within = [_piece((b"a", b"", 3, 1), (b"a", b"", 3, 1)), _piece((b"b", b"", 3, 1))]
    assert as_updates(merged(*equal_within)) == [(b"a", b"", 3, 2), (b"b", b"", 3, 1)]
    zero = [_piece((b"a", b"", 3, 1), (b"b", b"", 3, 0)), _piece((b"c", b"", 3, 1))]
    assert as_updates(merged(*zero)) == [(b"a", b"", 3, 1), (b"c", b"", 3, 1)]
    with pytest.raises(CorruptPart, match="not sorted"):
        merged(_piece((b"a", b"", 3, 1), (b"c", b"", 3, 1)), _piece((b"b", b"", 3, 1)))
    with pytest.raises(CorruptPart, match="not sorted"):
        merged(_piece((b"a", b"", 3, 1)), _piece((b"c", b"", 3, 1), (b"b", b"", 3, 1)))


def _request(blob: MemoryBlob, runs: list[list[Update]], part_bytes: int,
             writers_per_batch: int = 1) -> MergeReq:
    """One batch per run; with several writers a batch's updates are dealt to them in
    turn, so its parts form overlapping sorted runs (as parts written by Spark tasks)."""
    inputs = []
    for n, run in enumerate(runs):
        parts: tuple[Any, ...] = ()
        rows_in = 0
        for w in range(writers_per_batch):
            writer = PartWriter("s1", f"b{n}", blob, "main", part_bytes)
            table = table_of(run[w::writers_per_batch])
            for start in range(0, table.num_rows, 7):
                writer.write(table.slice(start, 7))
            parts += writer.finish()
            rows_in += table.num_rows
        inputs.append(Batch(f"b{n}", Description(n, n + 1, 0), parts, rows_in))
    return MergeReq(0, tuple(inputs), Description(0, len(runs), 3))


#: With ``tiny_memory``: 64 KiB for the output part, and room for three runs a pass.
THREE_RUNS_A_PASS = (64 << 10) + 3 * (256 + 4 * 16 + 64 * merge_module._CHUNKS_PER_RUN)


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(updates, min_size=1, max_size=7), st.integers(200, 3000),
       st.sampled_from([None, b"\x01", b"a"]), st.sampled_from([None, b"\x02", b"b"]),
       st.sampled_from([1, 1, 2, 3]))
def test_run_merge_streams_the_same_result_in_bounded_passes(
        tiny_memory: None, runs: list[list[Update]], part_bytes: int,
        lower: bytes | None, upper: bytes | None, writers_per_batch: int) -> None:
    blob = MemoryBlob()
    req = _request(blob, runs, part_bytes, writers_per_batch)
    key_range = KeyRange(lower, upper)
    res = run_merge(req, "s1", blob, None, part_bytes, THREE_RUNS_A_PASS, key_range=key_range)
    tables = [blobs_module.ShardBlobs(blob, None, blob, None).fetch_part(p, "test")
              for p in res.output.parts]
    assert as_updates(tables) == model(runs, since=3, key_range=key_range)
    assert res.output.num_updates == sum(t.num_rows for t in tables)
    assert res.output.num_inline_parts == 0
    for part, table in zip(res.output.parts, tables, strict=True):
        assert part.min_key is not None and part.min_key <= table.column("k")[0].as_py()
        assert part.max_key is None or part.max_key >= table.column("k")[-1].as_py()
    # Only the inputs and the output remain: intermediate runs were deleted.
    live = {p.key for b in req.inputs for p in b.hollow_parts()}
    live |= {p.key for p in res.output.hollow_parts()}
    assert {m.key for m in blob.list_keys()} == live


def test_a_merge_of_many_runs_goes_in_passes(tiny_memory: None) -> None:
    plan = merge_module.memory_plan(THREE_RUNS_A_PASS, 50, 1 << 20)
    assert plan.fan_in == 3
    runs = [[(bytes([n % 5]), b"v", n, 1), (b"z", b"v", n, 1)] for n in range(50)]
    blob = MemoryBlob()
    req = _request(blob, runs, 4096)
    res = run_merge(req, "s1", blob, None, 4096, THREE_RUNS_A_PASS)
    table = blobs_module.ShardBlobs(blob, None, blob, None).fetch_part(
        res.output.parts[0], "test") if len(res.output.parts) == 1 else pa.concat_tables(
        [blobs_module.ShardBlobs(blob, None, blob, None).fetch_part(p, "t")
         for p in res.output.parts])
    assert as_updates([table]) == model(runs, since=3)


def test_the_default_bound_merges_128_runs_in_one_pass() -> None:
    """At the default ``compaction_memory_bound_bytes`` a merge of 128 runs (many small
    batches between compactions) needs no intermediate pass."""
    from persist_pipeline.config import BLOB_TARGET_SIZE_BYTES, COMPACTION_MEMORY_BOUND_BYTES

    plan = merge_module.memory_plan(COMPACTION_MEMORY_BOUND_BYTES, 128, BLOB_TARGET_SIZE_BYTES)
    assert plan.fan_in >= 128
    assert plan.chunk_bytes >= merge_module.MIN_CHUNK_BYTES
    assert plan.read_bytes >= merge_module.MIN_READ_BYTES


class _Recording(MemoryBlob):
    """A memory store that remembers every value written under a key with ``marker``."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.written: list[bytes] = []

    def set(self, key: str, value: bytes) -> None:
        if self.marker in key:
            self.written.append(bytes(value))
        super().set(key, value)


def test_a_pass_merges_only_the_smallest_runs_it_must(tiny_memory: None) -> None:
    """Four runs and room for three: one pass merges the two smallest runs into one, and
    the large runs are read once, by the final merge."""
    sizes = [40, 3, 2, 40]
    runs = [[(b"%03d" % i, b"v%d" % n, n, 1) for i in range(size)]
            for n, size in enumerate(sizes)]
    blob = _Recording("-pass/")
    req = _request(blob, runs, 1 << 20)
    blob.written.clear()
    res = run_merge(req, "s1", blob, None, 1 << 20, THREE_RUNS_A_PASS)
    reader = blobs_module.ShardBlobs(blob, None, blob, None)
    assert as_updates([reader.fetch_part(p, "t") for p in res.output.parts]) == \
        model(runs, since=3)
    intermediate = sum(decode_parquet(v, "t").num_rows for v in blob.written)
    assert intermediate == 3 + 2  # the two smallest runs, nothing else


# --- snapshot_batches on every backend ----------------------------------------------------


def test_snapshot_batches_stream_the_exact_snapshot(open_client: Any) -> None:
    client = open_client(PersistConfig(blob_target_size_bytes=2048))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    written: list[Update] = []
    upper = 0
    rng = random.Random(7)
    for n in range(12):
        size = rng.choice([1, 3, 400])
        batch = [(rng.randbytes(2), rng.choice([b"x", b"y"]), upper + rng.randrange(2),
                  rng.choice([1, 1, -1])) for _ in range(size)]
        writer.compare_and_append(batch, upper, upper + 2)
        written += batch
        upper += 2
        if n == 6:
            client.compact(shard)
    reader = client.open_reader(shard)
    for as_of in (0, 9, upper - 1):
        batches = list(reader.snapshot_batches(as_of, max_rows=50))
        assert all(b.num_rows <= 50 for b in batches)
        got = [(r["k"], r["v"], r["d"]) for b in batches for r in b.to_pylist()]
        sums: dict[tuple[bytes, bytes], int] = defaultdict(int)
        for k, v, t, d in written:
            if t <= as_of:
                sums[(k, v)] += d
        want = sorted((k, v, d) for (k, v), d in sums.items() if d)
        assert got == want  # in (k, v) order, consolidated
        assert rows(reader.snapshot(as_of), as_of) == want
    reader.expire()


# --- memory, measured in a subprocess -----------------------------------------------------

_BOUND_MIB = 16
#: What a merge may add to its process's peak RSS at that bound (decoding buffers, the
#: part being written, allocator slack). The data merged below is 5M updates, 480 MB as
#: Arrow; merging it in memory takes well over 1 GB more (the control).
_ALLOWED_GROWTH_MIB = 192

_MEASURE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import pyarrow as pa
    from persist_pipeline.examples import merge_data
    from persist_pipeline.blob.local import LocalBlob
    from persist_pipeline.internal.blobs import ShardBlobs
    from persist_pipeline.updates import consolidate
    from persist_pipeline.examples.merge_data import peak_rss_bytes
    base = peak_rss_bytes()
    folder, how, bound = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) << 20
    if how == "stream":
        out = merge_data.merge(folder, bound)
    else:  # the negative control: the pre-streaming merge, everything decoded at once
        req = merge_data.load_request(folder)
        blobs = ShardBlobs(LocalBlob(folder / "blobs"), None, LocalBlob(folder / "blobs"), None)
        tables = [blobs.fetch_part(p, "x") for b in req.inputs for p in b.parts]
        merged = consolidate(pa.concat_tables(tables), since=req.desc.since)
        out = {"rows_in": req.num_updates, "rows_out": merged.num_rows,
               "peak_rss_bytes": peak_rss_bytes()}
    out["baseline_rss_bytes"] = base
    print(json.dumps(out))
""")


def _measure(folder: Path, how: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(folder), how, str(_BOUND_MIB)],
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_merge_memory_is_bounded_not_proportional_to_data(tmp_path: Path) -> None:
    from persist_pipeline.examples.merge_data import write_runs

    manifest = write_runs(tmp_path, 5_000_000, 2)
    rows_in = int(str(manifest["rows"]))
    assert rows_in * 96 > 2 * _ALLOWED_GROWTH_MIB << 20  # the data exceeds the allowance
    streamed = _measure(tmp_path, "stream")
    assert streamed["rows_in"] == rows_in and 0 < streamed["rows_out"] < rows_in
    growth = streamed["peak_rss_bytes"] - streamed["baseline_rss_bytes"]
    assert growth < _ALLOWED_GROWTH_MIB << 20, (growth >> 20, streamed)
    # The control: holding the whole merge in memory does not fit in that allowance.
    control = _measure(tmp_path, "in_memory")
    assert control["rows_out"] == streamed["rows_out"]
    assert control["peak_rss_bytes"] - control["baseline_rss_bytes"] > \
        3 * (_ALLOWED_GROWTH_MIB << 20)


def _streamed_shard(monkeypatch: pytest.MonkeyPatch, rows: int) -> Any:
    """A reader of three blob batches of ``rows`` updates each, which snapshots stream
    through the merge (none fetched whole)."""
    from persist_pipeline import read as read_module

    monkeypatch.setattr(read_module, "WHOLE_FETCH_MAX_BYTES", 0)
    client = PersistClient.open("mem://", "mem://", inline_policy=InlinePolicy(0, 0),
                                config=PersistConfig(blob_target_size_bytes=2048))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    for n in range(3):
        writer.compare_and_append([(bytes([n]) + i.to_bytes(4, "big"), b"v", n, 1)
                                   for i in range(rows)], n, n + 1)
    return client.open_reader(shard)


def test_a_forked_child_continues_a_suspended_snapshot(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    snapshot = _streamed_shard(monkeypatch, 5000).snapshot_batches(2, max_rows=100)
    rows = next(snapshot).num_rows
    pid = os.fork()
    if pid == 0:  # the child continues the iteration the parent started
        signal.alarm(20)
        os._exit(0 if rows + sum(b.num_rows for b in snapshot) == 15_000 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert rows + sum(b.num_rows for b in snapshot) == 15_000


# --- split merges: exactly once, and failures isolated ------------------------------------


@pytest.fixture
def clients(location: Location) -> Any:
    c = Clients(location)
    yield c
    c.close()


def _in_process(tasks: list[Any]) -> tuple[list[Any], str]:
    return [spark_driver._run_task(t) for t in tasks], "in-process"


def _big_shard(client: PersistClient, batches: int = 4, per_batch: int = 300) -> ShardId:
    shard = ShardId.new()
    writer = client.open_writer(shard)
    for n in range(batches):
        writer.compare_and_append(
            [(f"key-{(n * 7919 + i) % 997:04d}".encode(), b"v" * 20, n, 1)
             for i in range(per_batch)], n, n + 1)
    return shard


SPLIT = {"blob_target_size_bytes": 1024, "compaction_split_bytes": 2048}


def test_a_split_merge_commits_once_when_its_reply_is_lost(clients: Clients) -> None:
    lossy_client, lossy = clients.lossy(InlinePolicy(0, 0), **SPLIT)
    shard = _big_shard(clients.plain(InlinePolicy(0, 0), **SPLIT))
    expected = clients.snapshot(shard, 3)
    (req,) = merge_requests(lossy_client._machine(shard).fetch_latest())
    assert len(spark_driver.split_points(req, 4)) == 3
    lossy.arm()
    metrics = spark_driver.drive_compaction(
        _in_process, lossy_client, [shard], blob_uri=clients.location.blob_uri,
        wal_blob_uri=clients.location.wal_blob_uri, max_splits=4)[str(shard)]
    assert lossy.lost == 1
    assert metrics["spark_tasks"] == 4 and metrics["split_requests"] == 1
    assert metrics["applied"] == 1
    latest = clients.plain()._machine(shard).fetch_latest()
    (batch,) = latest.batches.values()  # the four inputs, replaced once by one batch
    assert batch.desc.lower == 0 and batch.desc.upper == 4
    keys = [p.min_key for p in batch.parts]
    assert keys == sorted(keys) and len(batch.parts) >= 4
    assert clients.snapshot(shard, 3) == expected
    # Every state version still references only blobs that exist.
    observer = clients.plain()
    for state in state_history(observer, str(shard)):
        for b in state.batches.values():
            for p in b.hollow_parts():
                assert observer.blobs.store(p.store).get(p.key) is not None, p.key


def test_a_failing_task_fails_its_own_merge_only(clients: Clients,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    client = clients.plain(InlinePolicy(0, 0), **SPLIT)
    good, python_error, memory_error = (_big_shard(client) for _ in range(3))
    real = spark_driver._run_merge

    def run_merge_failing(req: MergeReq, shard_id: str, *args: Any, **kwargs: Any) -> Any:
        key_range = kwargs.get("key_range")
        if shard_id == str(python_error):
            raise RuntimeError("a bug in a task")
        if shard_id == str(memory_error) and key_range is not None and \
                key_range.lower is not None and key_range.upper is None:
            raise MemoryError("the last key range ran out of memory")
        return real(req, shard_id, *args, **kwargs)

    monkeypatch.setattr(spark_driver, "_run_merge", run_merge_failing)
    before = {s: clients.snapshot(s, 3) for s in (good, python_error, memory_error)}
    with pytest.raises(spark_driver.SparkCompactionFailed) as info:
        spark_driver.drive_compaction(_in_process, client, [good, python_error, memory_error],
                                      blob_uri=clients.location.blob_uri,
                                      wal_blob_uri=clients.location.wal_blob_uri, max_splits=4)
    failures = info.value.failures
    assert set(failures) == {str(python_error), str(memory_error)}
    assert any("RuntimeError: a bug in a task" in m for m in failures[str(python_error)])
    assert failures[str(memory_error)] == ["MemoryError: the last key range ran out of memory"]
    metrics = info.value.metrics
    assert metrics[str(good)]["applied"] == 1
    assert metrics[str(memory_error)]["applied"] == 0
    observer = clients.plain()
    assert len(observer._machine(good).fetch_latest().batches) == 1
    assert len(observer._machine(memory_error).fetch_latest().batches) == 4
    # The ranges of the failed split merge that did finish left no parts behind.
    live = {p.key for b in observer._machine(memory_error).fetch_latest().batches.values()
            for p in b.hollow_parts() if p.store == "main"}
    stored = {m.key for m in observer.blobs.main.list_keys(f"{memory_error}/p/")}
    assert stored == live
    for shard, rows_before in before.items():
        assert clients.snapshot(shard, 3) == rows_before


# --- fingerprints -------------------------------------------------------------------------


def test_fingerprint_identifies_the_collection_not_its_layout(open_client: Any) -> None:
    client = open_client(PersistConfig(blob_target_size_bytes=1024))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    rng = random.Random(11)
    for t in range(6):
        writer.compare_and_append([(rng.randbytes(3), rng.choice([b"", b"x"]), t, 1)
                                   for _ in range(rng.choice([2, 300]))], t, t + 1)
    reader = client.open_reader(shard)
    before = reader.snapshot_fingerprint(5)
    snapshot = reader.snapshot(5)
    assert before.rows == snapshot.num_rows
    assert before.diff_sum == sum(snapshot.column("d").to_pylist())
    client.compact(shard)
    assert reader.snapshot_fingerprint(5) == before  # compacted: same collection
    from persist_pipeline.fingerprint import fingerprint_batches

    assert fingerprint_batches(snapshot.to_batches(max_chunksize=7)) == before
    # One more update changes it, and so does moving one byte between key and value.
    k, v = snapshot.column("k")[0].as_py(), snapshot.column("v")[0].as_py()
    writer.compare_and_append([(k, v, 6, 1)], 6, 7)
    assert reader.snapshot_fingerprint(6) != before
    moved = pa.table({"k": [b"ab"], "v": [b"c"], "t": [0], "d": [1]})
    assert fingerprint_batches([moved]) != fingerprint_batches(
        [pa.table({"k": [b"a"], "v": [b"bc"], "t": [0], "d": [1]})])
    reader.expire()


def test_a_missing_part_fails_its_own_split_merge_only(clients: Clients,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Split points come from the parts' Parquet footers, which the driver reads.
    monkeypatch.setattr(blobs_module, "WHOLE_FETCH_MAX_BYTES", 0)
    client = clients.plain(InlinePolicy(0, 0), **SPLIT)
    good, broken = _big_shard(client), _big_shard(client)
    state = client._machine(broken).fetch_latest()
    victim = next(p for b in state.batches.values() for p in b.hollow_parts())
    client.blobs.store(victim.store).delete(victim.key)  # lost from the store
    with pytest.raises(spark_driver.SparkCompactionFailed) as info:
        spark_driver.drive_compaction(_in_process, client, [good, broken],
                                      blob_uri=clients.location.blob_uri,
                                      wal_blob_uri=clients.location.wal_blob_uri, max_splits=4)
    assert set(info.value.failures) == {str(broken)}
    assert all(m.startswith("PartMissing") and victim.key in m
               for m in info.value.failures[str(broken)])
    assert info.value.metrics[str(good)]["applied"] == 1
    assert info.value.metrics[str(good)]["split_requests"] == 1
    assert len(client._machine(broken).fetch_latest().batches) == 4  # unchanged


def test_bad_streaming_settings_are_refused_with_typed_errors(open_client: Any) -> None:
    from persist_pipeline.exceptions import InvalidConfig, InvalidInput

    for bad in ({"compaction_memory_bound_bytes": 1000},
                {"compaction_memory_bound_bytes": 2.0 ** 30},
                {"compaction_split_bytes": 0}):
        with pytest.raises(InvalidConfig):
            PersistConfig(**bad)
    client = open_client()
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"k", b"v", 0, 1)], 0, 1)
    reader = client.open_reader(shard)
    seqno = client._machine(str(shard)).fetch_latest().seqno
    for max_rows in (0, -1, 1.5, True):
        with pytest.raises(InvalidInput):
            list(reader.snapshot_batches(0, max_rows=max_rows))
    assert client._machine(str(shard)).fetch_latest().seqno == seqno  # nothing changed
    reader.expire()


def _merge_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("persist-merge")]


class _FailingSets(MemoryBlob):
    """A store whose writes of keys containing ``marker`` fail, as a full or gone S3."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def set(self, key: str, value: bytes) -> None:
        if self.marker in key:
            raise BlobUnavailable(f"the store refused {key}")
        super().set(key, value)


def test_an_output_upload_failing_on_the_writer_thread_fails_the_merge(
        tiny_memory: None) -> None:
    """Output parts are encoded and uploaded on the merge's writer thread: its error is
    the merge's error, and neither of the merge's threads outlives it."""
    runs = [[(bytes([n, i]), b"v", n, 1) for i in range(40)] for n in range(6)]
    blob = _FailingSets("never")
    req = _request(blob, runs, 512)
    blob.marker = "/"  # every write from now on: the merge's first output part
    with pytest.raises(BlobUnavailable, match="refused"):
        run_merge(req, "s1", blob, None, 512, THREE_RUNS_A_PASS)
    assert _merge_threads() == []


def test_a_part_missing_on_the_reader_thread_fails_the_merge(tiny_memory: None) -> None:
    runs = [[(bytes([n, i]), b"v", n, 1) for i in range(40)] for n in range(3)]
    blob = MemoryBlob()
    req = _request(blob, runs, 512)
    last = list(req.inputs[-1].hollow_parts())[-1]
    blob.delete(last.key)  # read late in the merge, on the reader thread
    with pytest.raises(PartMissing, match=re.escape(last.key)):
        run_merge(req, "s1", blob, None, 512, THREE_RUNS_A_PASS)
    assert _merge_threads() == []


def test_a_suspended_or_abandoned_snapshot_iterator_holds_no_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reader = _streamed_shard(monkeypatch, 2000)
    batches = reader.snapshot_batches(2, max_rows=100)
    first = next(batches)
    assert first.num_rows == 100
    assert _merge_threads() == []  # nothing runs while the caller holds the iterator
    del batches  # dropped before the end, as a caller that found what it wanted
    assert _merge_threads() == []
    reader.expire()


def test_a_streaming_read_holds_about_the_memory_bound_not_the_data(tmp_path: Path) -> None:
    """Guarantee 11 for reads: ``snapshot_batches`` of a shard whose batches are large
    streams them through the merge; the Arrow memory it holds while it yields stays a
    small multiple of ``compaction_memory_bound_bytes``, far below the data's size (a
    read that fetched the batches whole would hold all of it)."""
    bound = 2 << 20
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0),
                                config=PersistConfig(compaction_memory_bound_bytes=bound))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    rows_per_batch, runs = 100_000, 4
    for n in range(runs):
        keys = [(i * runs + n).to_bytes(8, "big") for i in range(rows_per_batch)]
        writer.compare_and_append(pa.table({
            "k": pa.array(keys, pa.binary()),
            "v": pa.array([os.urandom(64) for _ in keys], pa.binary()),
            "t": pa.array([n] * rows_per_batch, pa.int64()),
            "d": pa.array([1] * rows_per_batch, pa.int64())}), n, n + 1)
    data_bytes = runs * rows_per_batch * (8 + 64 + 16)
    reader = client.open_reader(shard)
    baseline = pa.total_allocated_bytes()
    peak, seen, last = 0, 0, b""
    for batch in reader.snapshot_batches(runs - 1, max_rows=1000):
        peak = max(peak, pa.total_allocated_bytes() - baseline)
        first = batch.column(0)[0].as_py()
        assert first > last  # in key order, each row once
        last = batch.column(0)[-1].as_py()
        seen += batch.num_rows
        del batch
    assert seen == runs * rows_per_batch
    assert peak < 6 * bound < data_bytes / 2, (peak >> 20, data_bytes >> 20)
    reader.expire()
    client.close()


def test_a_snapshot_decoding_row_groups_in_pairs_holds_about_the_memory_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guarantee 11 for a snapshot of one run whose large local part is decoded two row
    groups at a time (each row group one batch): the pair's second batch is held beyond
    what the run's buffer counts, within the plan; the Arrow memory held while it yields
    stays a small multiple of the bound, far below the data's size."""
    bound = 2 << 20
    monkeypatch.setattr(blobs_module, "_ROW_GROUP_BYTES", 32 << 10)  # row groups of a batch
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0),
                                config=PersistConfig(compaction_memory_bound_bytes=bound))
    shard = ShardId.new()
    rows = 400_000
    keys = [i.to_bytes(8, "big") for i in range(rows)]
    with client.open_writer(shard) as writer:
        writer.compare_and_append(pa.table({
            "k": pa.array(keys, pa.binary()),
            "v": pa.array([os.urandom(64) for _ in keys], pa.binary()),
            "t": pa.array([0] * rows, pa.int64()),
            "d": pa.array([1] * rows, pa.int64())}), 0, 1)
    data_bytes = rows * (8 + 64 + 16)
    pairs = 0
    decode_two = blobs_module._decode_two

    def counted(*args: Any) -> list[pa.Table]:
        nonlocal pairs
        pairs += 1
        return decode_two(*args)

    monkeypatch.setattr(blobs_module, "_decode_two", counted)
    reader = client.open_reader(shard)
    baseline = pa.total_allocated_bytes()
    peak, seen, last = 0, 0, b""
    for batch in reader.snapshot_batches(0, max_rows=1000):
        peak = max(peak, pa.total_allocated_bytes() - baseline)
        assert batch.column(0)[0].as_py() > last  # in key order, each row once
        last = batch.column(0)[-1].as_py()
        seen += batch.num_rows
        del batch
    assert seen == rows
    assert pairs > 100  # the paired path read (nearly) all of it
    assert peak < 6 * bound < data_bytes / 2, (peak >> 20, data_bytes >> 20)
    reader.expire()
    client.close()

