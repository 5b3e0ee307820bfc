"""The inline pressure sensor and Spark compaction (PySpark ``local[2]``, one session).

Covers: the sensor, evaluated on a real instance, requests exactly one compaction run
per crossing of the high-water mark (and reads shard summaries, never a state); the run
it requests compacts on Spark, inline bytes go to zero and every snapshot is unchanged;
the Spark executor compacts several shards (inline, main and WAL parts) in ONE Spark
job, reports a failed task without losing the other shards' results, and refuses
in-memory blob stores.
"""

from __future__ import annotations

import itertools
import random
import zlib
from pathlib import Path
from typing import Any

import pytest

from assets.change_stream import ChangeStream
from assets.runner import Tick
from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.compaction import merge_requests
from persist_pipeline.config import COMPACTION_MEMORY_BOUND_BYTES
from persist_pipeline.exceptions import InvalidConfig
from persist_pipeline.internal.blobs import key_starts, split_keys
from persist_pipeline.spark import (
    JIT_OPTIONS,
    SparkCompactionFailed,
    compact_shards,
    prestart_workers,
    spark_conf,
    split_points,
)
from tests.pipeline_support import (
    SYNTHETIC,
    Pipeline,
    check_results,
    make_pipeline,
    materializations,
    spark_session,
)

__all__ = ["make_pipeline", "spark_session"]  # fixtures, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.spark]

STREAM = ChangeStream(**{k: v for k, v in SYNTHETIC.items() if k != "kind"})


def _snapshots(client: PersistClient, shard_id: str, upper: int) -> dict[int, Any]:
    """The snapshot at every time from the shard's since to ``upper - 1``."""
    reader = client.open_reader(shard_id)
    try:
        since = reader.since or 0
        return {t: reader.snapshot(t) for t in range(since, upper)}
    finally:
        reader.expire()


def test_inline_pressure_sensor_requests_one_compaction_per_crossing(
        make_pipeline: Any, spark_session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline: Pipeline = make_pipeline({
        "clicks": {"source": SYNTHETIC},
        "stock": {"source": {**SYNTHETIC, "events_per_write": 5, "seed": 9}},
    })
    client = pipeline.client()
    clicks, stock = pipeline.shard_id("clicks"), pipeline.shard_id("stock")
    sensor = pipeline.ticker("inline_pressure_sensor")
    assert sensor.tick().run_requests == []  # no shard yet

    # Each clicks write is ~1.2 KB inline; the mark is 0.5 * 8192 = 4096 bytes.
    requests = []
    for _ in range(6):
        assert pipeline.ingest("clicks", "stock").success
        tick = sensor.tick()
        requests.extend(tick.run_requests)
        if tick.run_requests:
            break
    [request] = requests
    assert client.shard_summaries()[clicks].inline_bytes >= 4096
    assert [k.path for k in request.asset_selection] == [["compact", "clicks"]]
    assert request.run_key.startswith("inline-pressure:clicks@")

    # Same crossing, run not done yet: no second request, however often it ticks.
    assert pipeline.ingest("clicks", "stock").success
    assert sensor.tick().run_requests == []
    assert sensor.tick().run_requests == []

    # The sensor reads one summary per shard: it never needs a shard's state.
    def no_states(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the sensor read a shard's state")

    with monkeypatch.context() as m:
        m.setattr(PersistClient, "_machine", no_states)
        assert sensor.tick().run_requests == []

    upper = client.shard_summaries()[clicks].upper
    before = _snapshots(client, clicks, upper)
    [result] = pipeline.launch_all("inline_pressure_sensor", Tick(run_requests=[request]))
    assert result.success
    meta = materializations(result)
    assert list(meta) == ["compact/clicks"]  # only the crossing shard
    m = meta["compact/clicks"]
    assert m["requests"] >= 1 and m["inline_parts_in"] >= 1 and m["parts_out"] >= 1
    assert m["inline_bytes_before"] >= 4096 and m["inline_bytes_after"] == 0
    assert m["spark_tasks"] == m["requests"] and m["failed_tasks"] == 0
    assert m["rows_per_s"] > 0 and m["spark_master"] == "local[2]"
    check = check_results(result)["compact/clicks:snapshot_unchanged"]
    assert check.passed and check.metadata["rows_before"].value > 0

    summary = client.shard_summaries()[clicks]
    assert summary.inline_bytes == 0 and summary.num_inline_parts == 0
    assert client.inspect(clicks)["parts"]["inline"] == 0
    after = _snapshots(client, clicks, upper)
    assert after.keys() == before.keys()
    for t in before:
        assert after[t].equals(before[t]), f"snapshot at {t} changed"
    last = after[upper - 1]
    assert dict(zip(last.column("k").to_pylist(), last.column("v").to_pylist(),
                    strict=True)) == STREAM.collection(upper)
    assert client.shard_summaries()[stock].inline_bytes > 0  # not selected, not touched

    # Compacted: the crossing is over. Writing up to the mark again is a new crossing.
    assert sensor.tick().run_requests == []
    again = []
    for _ in range(6):
        assert pipeline.ingest("clicks").success
        again.extend(sensor.tick().run_requests)
        if again:
            break
    [second] = again
    assert second.run_key != request.run_key
    assert [k.path for k in second.asset_selection] == [["compact", "clicks"]]


def _client(root: Path, wal: bool) -> tuple[PersistClient, str, str | None]:
    blob = f"file://{root}/blob"
    wal_uri = f"file://{root}/wal" if wal else None
    (root / "blob").mkdir(parents=True)
    if wal_uri:
        (root / "wal").mkdir()
    client = PersistClient.open(f"sqlite:///{root}/consensus.db", blob, wal_uri,
                                inline_policy=InlinePolicy(4096, 1 << 20))
    return client, blob, wal_uri


def _fill(client: PersistClient, shard: ShardId, writes: int, big_at: int) -> None:
    writer = client.open_writer(shard)
    for t in range(writes):
        rows = 3000 if t == big_at else 15
        updates = [(f"k{(t * 7 + j) % 60}".encode(), f"v{t}-{j}".encode(), t, 1)
                   for j in range(rows)]
        writer.compare_and_append(updates, t, t + 1)
    writer.expire()


def test_spark_executor_compacts_many_shards_in_one_job(tmp_path: Path,
                                                        spark_session: Any) -> None:
    client, blob, wal = _client(tmp_path, wal=True)
    shards = [ShardId.new() for _ in range(3)]
    for i, shard in enumerate(shards):
        _fill(client, shard, writes=9, big_at=3 + i)  # inline parts and WAL parts
    assert all(client.inspect(s)["parts"]["hollow_wal"] == 1 for s in shards)
    before = {s: _snapshots(client, str(s), 9) for s in shards}
    missing = ShardId.new()

    metrics = compact_shards(spark_session, client, [*shards, missing], blob_uri=blob,
                             wal_blob_uri=wal)
    groups = {m["spark_job_group"] for m in metrics.values()}
    [group] = groups
    assert len(spark_session.sparkContext.statusTracker().getJobIdsForGroup(group)) == 1
    assert metrics[str(missing)]["found"] is False
    for shard in shards:
        m = metrics[str(shard)]
        assert m["requests"] == m["applied"] == m["spark_tasks"] >= 1
        assert m["inline_bytes_before"] > 0 and m["inline_bytes_after"] == 0
        info = client.inspect(shard)
        assert info["parts"]["inline"] == 0 and info["parts"]["hollow_wal"] == 0
        assert info["pending_merge_requests"] == 0
        after = _snapshots(client, str(shard), 9)
        for t, table in before[shard].items():
            assert after[t].equals(table), f"shard {shard}: snapshot at {t} changed"
        # The executors' parts record the CRC-32 of the bytes they stored, as the
        # driver's do: reads check it.
        state = client._machine(str(shard)).fetch_latest()
        for part in (p for b in state.batches.values() for p in b.hollow_parts()):
            data = client.blobs.store(part.store).get(part.key)
            assert data is not None and part.crc32 == zlib.crc32(data), part.key

    # Nothing pending: no Spark job at all.
    idle = compact_shards(spark_session, client, shards, blob_uri=blob, wal_blob_uri=wal)
    assert {m["spark_jobs"] for m in idle.values()} == {0}
    client.close()


def _loaded(_: int) -> bool:
    import sys
    return "persist_pipeline.compaction" in sys.modules


def test_the_session_comes_with_its_python_workers_started(spark_session: Any) -> None:
    """``local_spark_session`` prestarted the workers (with the merge code loaded) once
    for this SparkContext: asking again does nothing, and tasks run on loaded workers."""
    assert prestart_workers(spark_session) == 0.0
    sc = spark_session.sparkContext
    assert all(sc.parallelize(range(4), 4).map(_loaded).collect())


def _pool_peak(_: int) -> int:
    import pyarrow as pa
    return int(pa.default_memory_pool().max_memory())


def _prestart_then_pool_peak(index: int) -> int:
    from persist_pipeline.spark import _prestart_task

    _prestart_task(index, heap_bytes=COMPACTION_MEMORY_BOUND_BYTES)
    return _pool_peak(index)


def test_prestarted_workers_have_grown_their_memory_pool_to_a_merges_bound(
        spark_session: Any) -> None:
    """A prestart task has its Python worker's Arrow memory pool reach a merge's memory
    bound once, so the kernel maps that heap before the first compaction, not in it; and
    ``prestart_workers`` asks for that bound by default. (Checked in the task itself: the
    session's workers are shared with every other test, which may have replaced them.)"""
    import inspect

    sc = spark_session.sparkContext
    peaks = sc.parallelize(range(4), 4).map(_prestart_then_pool_peak).collect()
    assert min(peaks) >= COMPACTION_MEMORY_BOUND_BYTES
    default = inspect.signature(prestart_workers).parameters["heap_bytes"].default
    assert default == COMPACTION_MEMORY_BOUND_BYTES


def _numpy_huge_pages(_: int) -> bool:
    from numpy._core import multiarray
    enabled: bool = multiarray._set_madvise_hugepage(False)
    multiarray._set_madvise_hugepage(enabled)
    return enabled


def test_the_sessions_python_workers_run_numpy_without_huge_pages(
        spark_session: Any) -> None:
    """Every master's configuration turns numpy's huge-page advice off in the Python
    workers (a merge's short-lived large arrays faulted 2 MiB pages in), and the
    session's workers run that way; a caller's setting wins."""
    for master in ("local[2]", "spark://127.0.0.1:7077"):
        assert spark_conf(master)["spark.executorEnv.NUMPY_MADVISE_HUGEPAGE"] == "0"
    assert spark_conf("local[2]", extra={"spark.executorEnv.NUMPY_MADVISE_HUGEPAGE": "1"}
                      )["spark.executorEnv.NUMPY_MADVISE_HUGEPAGE"] == "1"
    sc = spark_session.sparkContext
    assert not any(sc.parallelize(range(4), 4).map(_numpy_huge_pages).collect())


def test_the_sessions_jvms_take_the_jit_options(spark_session: Any) -> None:
    """The driver's and executors' JVM options (C2 for hot code only) are in the
    configuration of every master, reach the running JVM, and give way to a caller's."""
    for master in ("local[2]", "spark://127.0.0.1:7077"):
        conf = spark_conf(master)
        assert conf["spark.driver.extraJavaOptions"] == JIT_OPTIONS
        assert conf["spark.executor.extraJavaOptions"] == JIT_OPTIONS
    mine = spark_conf("local[2]", extra={"spark.executor.extraJavaOptions": "-Xss4m"})
    assert mine["spark.executor.extraJavaOptions"] == "-Xss4m"
    assert mine["spark.driver.extraJavaOptions"] == JIT_OPTIONS
    jvm = spark_session.sparkContext._jvm
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
                .getInputArguments())
    assert set(JIT_OPTIONS.split()) <= set(args), args


def test_spark_executor_failures_and_bad_uris(tmp_path: Path, spark_session: Any) -> None:
    client, blob, _ = _client(tmp_path, wal=False)
    good, broken = ShardId.new(), ShardId.new()
    _fill(client, good, writes=4, big_at=1)
    _fill(client, broken, writes=4, big_at=1)
    [part] = [p for p in (tmp_path / "blob").rglob("*.parquet") if str(broken) in str(p)]
    part.unlink()  # the broken shard's blob part is gone

    with pytest.raises(SparkCompactionFailed) as info:
        compact_shards(spark_session, client, [good, broken], blob_uri=blob)
    assert list(info.value.failures) == [str(broken)]
    assert "PartMissing" in str(info.value) and str(broken) in str(info.value)
    assert info.value.metrics[str(good)]["inline_bytes_after"] == 0  # committed anyway
    assert client.inspect(good)["parts"]["inline"] == 0
    assert client.inspect(broken)["parts"]["inline"] > 0  # unchanged

    with pytest.raises(InvalidConfig, match="in-memory"):
        compact_shards(spark_session, client, [good], blob_uri="mem://x")
    client.close()


def test_spark_splits_a_large_merge_by_key_range_and_commits_it_once(
        tmp_path: Path, spark_session: Any) -> None:
    (tmp_path / "blob").mkdir()
    blob = f"file://{tmp_path}/blob"
    client = PersistClient.open(
        f"sqlite:///{tmp_path}/consensus.db", blob, inline_policy=InlinePolicy(0, 0),
        config=PersistConfig(blob_target_size_bytes=16 << 10, compaction_split_bytes=64 << 10))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    rng = random.Random(3)
    for t in range(4):  # four batches of 2,000 rows over one key space, each many parts
        writer.compare_and_append([(f"key-{(t * 31 + i * 7) % 5000:05d}".encode(),
                                    rng.randbytes(40), t, 1) for i in range(2000)], t, t + 1)
    # The last batch retracts some of the first's rows.
    first = client.open_reader(shard).snapshot(0).slice(0, 500)
    writer.compare_and_append([(r["k"], r["v"], 4, -r["d"]) for r in first.to_pylist()], 4, 5)
    reader = client.open_reader(shard)
    before = reader.snapshot_fingerprint(4)
    expected = reader.snapshot(4)

    # The driver reads the parts' footers concurrently: the same split points as one
    # after the other.
    [req] = merge_requests(client._machine(str(shard)).fetch_latest())
    serial = [s for b in req.inputs for p in b.hollow_parts()
              for s in key_starts(client.blobs, p, "test")]
    assert split_points(req, 4, client.blobs) == split_keys(serial, 4) != []

    [m] = compact_shards(spark_session, client, [shard], blob_uri=blob).values()
    assert m["requests"] == m["applied"] == m["split_requests"] == 1
    assert m["spark_tasks"] > 2  # one request, several key-range tasks, one commit
    assert m["spark_jobs"] == 1 and m["failed_tasks"] == 0
    # The run's wall time on the driver, by phase: planning, the Spark job, committing.
    phases = [m["plan_s"], m["run_s"], m["commit_s"]]
    assert min(phases) >= 0 and sum(phases) == pytest.approx(m["duration_s"])
    state = client._machine(str(shard)).fetch_latest()
    # The first four batches (one Spine entry) were replaced by one; the fifth stays.
    [batch] = [b for b in state.batches.values() if b.desc.lower == 0]
    assert batch.desc.upper == 4 and len(state.batches) == 2
    keys = [(p.min_key, p.max_key) for p in batch.hollow_parts()]
    assert all(a is not None and b is not None and a <= b for a, b in keys)
    # One sorted run: a part's keys end where the next one's begin (a key may span two).
    assert all(prev[1] <= nxt[0] for prev, nxt in itertools.pairwise(keys))  # type: ignore[operator]
    assert reader.snapshot(4).equals(expected) and expected.num_rows == 8000 - 500
    assert reader.snapshot_fingerprint(4) == before
    reader.expire()
    client.close()
