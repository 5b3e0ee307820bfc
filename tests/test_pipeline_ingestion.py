"""Ingestion assets and the landing sensor, on real backends.

Covers: synthetic ingestion on the embedded default (SQLite + local folder) with its
metadata and inline/blob placement; file ingestion against real PostgreSQL + S3 (moto
server), with files landing under an S3 prefix, exactly once per file; a bad file
(malformed row, wrong column types) fails its run naming the file and line and writes
nothing, and the next good file still ingests.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg2
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assets.change_stream import ChangeStream
from assets.ingestion import (
    BLOB_PUTS,
    FILE,
    INLINE_BYTES,
    INLINE_LIMIT,
    INLINE_SIZE,
    PLACEMENT,
    SEQNO,
    UPDATES_WRITTEN,
    UPPER,
    WRITE_BYTES,
    WRITE_LATENCY,
)
from persist_pipeline import PersistClient
from tests.pipeline_support import (
    SYNTHETIC,
    Pipeline,
    check_results,
    failure_messages,
    make_pipeline,
    materializations,
)

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow

__all__ = ["make_pipeline"]  # the fixture, imported for pytest


def _collection(client: PersistClient, shard_id: str, as_of: int) -> dict[bytes, bytes]:
    reader = client.open_reader(shard_id)
    try:
        snap = reader.snapshot(as_of)
    finally:
        reader.expire()
    assert set(snap.column("d").to_pylist()) <= {1}
    return dict(zip(snap.column("k").to_pylist(), snap.column("v").to_pylist(), strict=True))


def test_synthetic_ingestion_on_the_embedded_default(make_pipeline: Any) -> None:
    pipeline: Pipeline = make_pipeline({"clicks": {"source": SYNTHETIC}})
    assert pipeline.defs.resources["persist"].uris()[0].startswith("sqlite:///")
    uppers, inline = [], []
    for _ in range(3):
        result = pipeline.ingest("clicks")
        assert result.success
        meta = materializations(result)["ingest/clicks"]
        assert meta[PLACEMENT] == "inline" and meta[BLOB_PUTS] == 0
        assert meta[UPDATES_WRITTEN] == (meta["Stream inserts"] * 1
                                         + meta["Stream updates"] * 2 + meta["Stream deletes"])
        # Inline: what was stored is the inline encoding the placement measured.
        assert 0 < meta[WRITE_BYTES] == meta[INLINE_SIZE] < 4096
        assert meta[WRITE_LATENCY] > 0
        assert meta[INLINE_LIMIT] == 8192
        uppers.append(meta[UPPER])
        inline.append(meta[INLINE_BYTES])
        # The most useful entry first, no duplicates.
        assert list(meta)[:3] == [INLINE_BYTES, INLINE_LIMIT, PLACEMENT]
        checks = check_results(result)
        assert checks["ingest/clicks:inline_bytes_within_max"].passed
        assert checks["ingest/clicks:upper_advanced_recently"].passed
    assert uppers == [1, 2, 3]
    assert inline[0] < inline[1] < inline[2]

    # A write too big to inline goes to the main blob store as a Parquet part.
    big = materializations(pipeline.ingest("clicks", events=2000))["ingest/clicks"]
    assert big[PLACEMENT] == "blob" and big[BLOB_PUTS] == 1
    assert big[WRITE_BYTES] > 0 and big[INLINE_BYTES] == inline[-1]
    # Both sizes, labelled: the inline encoding the placement compared with the 4096-byte
    # threshold, and the Parquet part stored instead (which may well be smaller).
    assert big[INLINE_SIZE] >= 4096 and big[WRITE_BYTES] != big[INLINE_SIZE]
    parts = list((pipeline.data_dir / "blobs").rglob("*.parquet"))
    assert len(parts) == 1

    # The first three writes are exactly the change stream's first three steps.
    stream = ChangeStream(**{k: v for k, v in SYNTHETIC.items() if k != "kind"})
    assert _collection(pipeline.client(), pipeline.shard_id("clicks"), 2) == \
        stream.collection(3)


def _put(s3_client: Any, bucket: str, key: str, body: bytes) -> None:
    s3_client.put_object(Bucket=bucket, Key=key, Body=body)


@pytest.mark.postgres
@pytest.mark.s3
def test_file_ingestion_on_postgres_and_s3(make_pipeline: Any, pg_url: str, s3_uri: str,
                                           s3_client: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_uri.removeprefix("s3://").split("/", 1)[0]
    endpoint = s3_uri.split("?", 1)[1]
    monkeypatch.setenv("PERSIST_CONSENSUS_URI", pg_url)
    monkeypatch.setenv("PERSIST_BLOB_URI", s3_uri)
    monkeypatch.setenv("TEST_LANDING_URI", f"s3://{bucket}/landing/orders?{endpoint}")
    pipeline: Pipeline = make_pipeline({"orders": {"source": {
        "kind": "files", "uri": "${TEST_LANDING_URI}", "times": "ingest"}}})
    sensor = "orders_landing_sensor"

    assert pipeline.ticker(sensor).tick().run_requests == []
    small = "k,v,t,d\n" + "".join(f"order-{i},qty={i},0,1\n" for i in range(20))
    _put(s3_client, bucket, "landing/orders/2026/day1.csv", small.encode())
    big = "".join(json.dumps({"k": f"o{i}", "v": "x" * 40, "t": 5}) + "\n"
                  for i in range(400))
    _put(s3_client, bucket, "landing/orders/2026/day2.jsonl", big.encode())
    _put(s3_client, bucket, "landing/orders/notes.txt", b"not data")  # not a format

    tick = pipeline.ticker(sensor).tick()
    assert sorted(r.tags["persist/file"] for r in tick.run_requests) == [
        "2026/day1.csv", "2026/day2.jsonl"]
    results = pipeline.launch_all(sensor, tick)
    assert [r.success for r in results] == [True, True]
    metas = [materializations(r)["ingest/orders"] for r in results]
    by_file = {m[FILE].split("/landing/orders/")[1]: m for m in metas}
    assert by_file["2026/day1.csv"][PLACEMENT] == "inline"
    assert by_file["2026/day2.jsonl"][PLACEMENT] == "blob"
    assert by_file["2026/day2.jsonl"][BLOB_PUTS] == 1
    assert "secret" not in json.dumps(metas).lower()

    # Each file is a partition of ingest/orders.
    assert sorted(pipeline.instance.get_dynamic_partitions("landed_files")) == [
        "orders/2026/day1.csv", "orders/2026/day2.jsonl"]
    assert {r.dagster_run.job_name for r in results} == {"ingest_files_job"}

    # Exactly once: the next tick requests nothing; a sensor that lost its cursor sees
    # the files were ingested and requests nothing either (the non-data file is named).
    next_tick = pipeline.ticker(sensor).tick()
    assert next_tick.run_requests == []
    assert "1 file(s) ignored, not csv/jsonl/parquet: notes.txt" in next_tick.skip_reason
    from assets.runner import SensorTicker

    amnesiac = SensorTicker(pipeline.defs, pipeline.instance, sensor).tick()
    assert amnesiac.run_requests == []
    assert "2 already ingested" in amnesiac.skip_reason

    # The data is in PostgreSQL (consensus) and S3 (the blob part) and reads back.
    shard_id = pipeline.shard_id("orders")
    conn = psycopg2.connect(pg_url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM consensus WHERE shard = %s", (shard_id,))
            (records,) = cur.fetchone()
    finally:
        conn.close()
    assert records >= 4  # create, writer registrations, two appends, expiries
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert any(k.startswith(f"some/prefix/{shard_id}/p/") and k.endswith(".parquet")
               for k in keys)
    client = pipeline.client()
    snapshot = _collection(client, shard_id, 1)
    assert len(snapshot) == 420
    assert snapshot[b"order-3"] == b"qty=3" and snapshot[b"o7"] == b"x" * 40
    assert client.shard_summaries()[shard_id].upper == 2


def _set_mtime(path: Path, order: int) -> None:
    stamp = 1_700_000_000 + order
    os.utime(path, (stamp, stamp))


def test_bad_files_fail_their_run_and_write_nothing(make_pipeline: Any) -> None:
    pipeline: Pipeline = make_pipeline({"orders": {"source": {
        "kind": "files", "uri": "{data_dir}/landing/orders", "times": "source"}}})
    landing = pipeline.data_dir / "landing" / "orders"
    landing.mkdir(parents=True)
    sensor = "orders_landing_sensor"
    shard_id = pipeline.shard_id("orders")

    first = landing / "a-first.csv"
    first.write_text("k,v,t\nk1,v1,0\nk2,v2,1\n")
    _set_mtime(first, 1)
    [result] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert result.success
    before = pipeline.client().shard_summaries()[shard_id]
    assert before.upper == 2

    malformed = landing / "b-malformed.csv"
    malformed.write_text("k,v,t\nk3,v3,2\nk4,v4,two\nk5,v5,3\n")
    wrong_types = landing / "c-types.parquet"
    pq.write_table(pa.table({"k": ["k6"], "v": ["v6"], "t": ["later"]}), wrong_types)
    stale = landing / "d-stale.jsonl"  # times below the shard's upper
    stale.write_text(json.dumps({"k": "k7", "v": "v7", "t": 0}) + "\n")
    good = landing / "e-good.jsonl"
    good.write_text(json.dumps({"k": "k8", "v": "v8", "t": 2}) + "\n"
                    + json.dumps({"k": "k1", "v": "v1", "t": 3, "d": -1}) + "\n")
    for order, path in enumerate((malformed, wrong_types, stale, good), start=2):
        _set_mtime(path, order)

    # Source times: one file per run, in landing order, each once the previous is done.
    results = []
    for name in ("b-malformed.csv", "c-types.parquet", "d-stale.jsonl", "e-good.jsonl"):
        tick = pipeline.ticker(sensor).tick()
        assert [r.tags["persist/file"] for r in tick.run_requests] == [name]
        results += pipeline.launch_all(sensor, tick)
    assert [r.success for r in results] == [False, False, False, True]

    [malformed_msg] = failure_messages(results[0])
    assert f"{malformed}: line 3" in malformed_msg and "column t" in malformed_msg
    [types_msg] = failure_messages(results[1])
    assert str(wrong_types) in types_msg and "column t" in types_msg
    [stale_msg] = failure_messages(results[2])
    assert str(stale) in stale_msg and "below the shard's upper" in stale_msg
    for failed in results[:3]:
        assert materializations(failed) == {}

    # The failed runs changed nothing: the good file committed right after the first.
    after = pipeline.client().shard_summaries()[shard_id]
    assert after.upper == 4
    meta = materializations(results[3])["ingest/orders"]
    assert meta[SEQNO] > before.seqno and meta[UPPER] == 4
    assert _collection(pipeline.client(), shard_id, 3) == {b"k2": b"v2", b"k8": b"v8"}

    # A failed file is not retried by the sensor (its run key was used) ...
    assert pipeline.ticker(sensor).tick().run_requests == []
    # ... but a corrected file (new identity) is ingested.
    malformed.write_text("k,v,t\nk3,v3,4\n")
    _set_mtime(malformed, 10)
    [fixed] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert fixed.success
    assert _collection(pipeline.client(), shard_id, 4)[b"k3"] == b"v3"


def test_source_times_files_are_ingested_one_run_at_a_time_in_landing_order(
        make_pipeline: Any) -> None:
    """Two files of a ``times: source`` shard landed together: if the later one's run
    committed first, the earlier one's times would be below the upper and refused. The
    sensor holds the later file back while the earlier one's run is queued or running;
    with ``times: ingest`` every new file is requested at once."""
    pipeline: Pipeline = make_pipeline({
        "orders": {"source": {"kind": "files", "uri": "{data_dir}/landing/orders",
                              "times": "source"}},
        "events": {"source": {"kind": "files", "uri": "{data_dir}/landing/events"}}})
    for shard in ("orders", "events"):
        (pipeline.data_dir / "landing" / shard).mkdir(parents=True)
    orders = pipeline.data_dir / "landing" / "orders"
    early, late = orders / "z-early.csv", orders / "a-late.csv"  # landing order, not names
    early.write_text("k,v,t\nk1,v1,5\n")
    late.write_text("k,v,t\nk2,v2,9\n")
    _set_mtime(early, 1)
    _set_mtime(late, 2)
    for order, name in enumerate(("e1.csv", "e2.csv"), start=1):
        (pipeline.data_dir / "landing" / "events" / name).write_text("k,v,t\na,1,0\n")
        _set_mtime(pipeline.data_dir / "landing" / "events" / name, order)

    events = pipeline.ticker("events_landing_sensor").tick()
    assert [r.tags["persist/file"] for r in events.run_requests] == ["e1.csv", "e2.csv"]

    sensor = "orders_landing_sensor"
    first = pipeline.ticker(sensor).tick()
    assert [r.tags["persist/file"] for r in first.run_requests] == ["z-early.csv"]
    # Its run has started (as the daemon launches it) but not finished: the late file waits.
    job = pipeline.defs.resolve_job_def("ingest_files_job")
    started = pipeline.instance.create_run_for_job(
        job, status=dg.DagsterRunStatus.STARTED, tags=dict(first.run_requests[0].tags),
        asset_selection={dg.AssetKey(["ingest", "orders"])})
    waiting = pipeline.ticker(sensor).tick()
    assert waiting.run_requests == []
    assert f"1 file(s) wait for run {started.run_id}" in waiting.skip_reason
    pipeline.instance.delete_run(started.run_id)

    [ran] = pipeline.launch_all(sensor, first)
    assert ran.success and materializations(ran)["ingest/orders"][UPPER] == 6
    [second] = pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    assert second.success and materializations(second)["ingest/orders"][UPPER] == 10
    assert _collection(pipeline.client(), pipeline.shard_id("orders"), 9) == {
        b"k1": b"v1", b"k2": b"v2"}
    assert pipeline.ticker(sensor).tick().run_requests == []


@pytest.mark.s3
def test_s3_landing_errors_name_the_object(make_pipeline: Any, s3_uri: str, s3_client: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_uri.removeprefix("s3://").split("/", 1)[0]
    query = s3_uri.split("?", 1)[1]
    monkeypatch.setenv("TEST_LANDING_URI", f"s3://{bucket}/in?{query}")
    pipeline: Pipeline = make_pipeline({"events": {"source": {
        "kind": "files", "uri": "${TEST_LANDING_URI}"}}})
    name = f"bad-{uuid.uuid4().hex[:6]}.csv"
    _put(s3_client, bucket, f"in/{name}", b"k,v,t\nk1,v1,0\nk2,v2\n")
    [result] = pipeline.launch_all("events_landing_sensor",
                                   pipeline.ticker("events_landing_sensor").tick())
    assert not result.success
    [message] = failure_messages(result)
    assert f"s3://{bucket}/in/{name}" in message and "line 3" in message
    assert "persist-landing-" not in message  # not the temporary download


def _orders_with_file(make_pipeline: Any, name: str, text: str) -> tuple[Pipeline, Path, Any]:
    """A pipeline with one files shard, ``orders``, whose landing folder holds ``name``."""
    pipeline: Pipeline = make_pipeline({"orders": {"source": {
        "kind": "files", "uri": "{data_dir}/landing/orders"}}})
    landing = pipeline.data_dir / "landing" / "orders"
    landing.mkdir(parents=True)
    (landing / name).write_text(text)
    return pipeline, landing, pipeline.defs.resolve_job_def("ingest_files_job")


def test_a_file_is_ingested_once_however_its_run_was_launched(make_pipeline: Any) -> None:
    """Materialized by hand first (a partition re-run from the UI), then picked up by the
    landing sensor: one write, not two (the snapshot has d=1, never d=2)."""
    pipeline, landing, job = _orders_with_file(make_pipeline, "day1.csv", "k,v,t\na,1,0\nb,2,0\n")
    shard_id = pipeline.shard_id("orders")

    # By hand: the user adds the partition and materializes it (as the UI does).
    pipeline.instance.add_dynamic_partitions("landed_files", ["orders/day1.csv"])
    manual = job.execute_in_process(instance=pipeline.instance,
                                    partition_key="orders/day1.csv", raise_on_error=False)
    assert manual.success and materializations(manual)["ingest/orders"][UPPER] == 1

    # The sensor then sees the file: already ingested, no run.
    tick = pipeline.ticker("orders_landing_sensor").tick()
    assert tick.run_requests == [] and "1 already ingested (day1.csv)" in tick.skip_reason
    # Re-running the partition writes nothing either: the step succeeds, no materialization.
    rerun = job.execute_in_process(instance=pipeline.instance,
                                   partition_key="orders/day1.csv", raise_on_error=False)
    assert rerun.success and materializations(rerun) == {}
    assert pipeline.client().shard_summaries()[shard_id].upper == 1
    assert _collection(pipeline.client(), shard_id, 0) == {b"a": b"1", b"b": b"2"}

    # A new version of the file (new size and mtime) is new data: ingested once more.
    (landing / "day1.csv").write_text("k,v,t\nc,3,0\n")
    _set_mtime(landing / "day1.csv", 50)
    [result] = pipeline.launch_all("orders_landing_sensor",
                                   pipeline.ticker("orders_landing_sensor").tick())
    assert result.success and pipeline.client().shard_summaries()[shard_id].upper == 2
    assert _collection(pipeline.client(), shard_id, 1) == {b"a": b"1", b"b": b"2",
                                                            b"c": b"3"}

    # Partitions are shared by every files shard: another shard's file is not ours.
    pipeline.instance.add_dynamic_partitions("landed_files", ["events/day1.csv"])
    foreign = job.execute_in_process(instance=pipeline.instance,
                                     partition_key="events/day1.csv", raise_on_error=False,
                                     asset_selection=[dg.AssetKey(["ingest", "orders"])])
    assert foreign.success and materializations(foreign) == {}
    assert pipeline.client().shard_summaries()[shard_id].upper == 2

    # "Materialize" of a partition whose file is gone fails clearly, writing nothing.
    pipeline.instance.add_dynamic_partitions("landed_files", ["orders/gone.csv"])
    gone = job.execute_in_process(instance=pipeline.instance,
                                  partition_key="orders/gone.csv", raise_on_error=False)
    assert not gone.success
    [message] = failure_messages(gone)
    assert "gone.csv: no such file" in message
    assert pipeline.client().shard_summaries()[shard_id].upper == 2


def test_a_missing_landing_location_fails_the_tick(make_pipeline: Any) -> None:
    pipeline: Pipeline = make_pipeline({"orders": {"source": {
        "kind": "files", "uri": "{data_dir}/landing/nowhere"}}})
    from assets.sources import LandingLocationError

    with pytest.raises(LandingLocationError,
                       match=r"landing folder .*/landing/nowhere does not exist"):
        pipeline.ticker("orders_landing_sensor").tick()
    (pipeline.data_dir / "landing").mkdir(parents=True)
    (pipeline.data_dir / "landing" / "nowhere").write_text("a file, not a folder")
    with pytest.raises(LandingLocationError, match="is not a folder"):
        pipeline.ticker("orders_landing_sensor").tick()


@pytest.mark.s3
def test_an_unreachable_s3_landing_location_fails_the_tick(
        make_pipeline: Any, s3_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    query = s3_uri.split("?", 1)[1]
    monkeypatch.setenv("TEST_LANDING_URI", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/in?"
                                           f"{query}")
    pipeline: Pipeline = make_pipeline({"events": {"source": {
        "kind": "files", "uri": "${TEST_LANDING_URI}"}}})
    from assets.sources import LandingLocationError

    with pytest.raises(LandingLocationError, match="cannot list the landing location s3://"):
        pipeline.ticker("events_landing_sensor").tick()


def test_two_runs_of_one_file_at_once_write_it_once(make_pipeline: Any) -> None:
    """A run of a file's partition that starts while an earlier run of the same file is
    still in flight writes nothing and says which run has it; after that run failed
    (without writing), a re-run ingests the file."""
    pipeline, _, job = _orders_with_file(make_pipeline, "day2.csv", "k,v,t\na,1,0\n")
    shard_id = pipeline.shard_id("orders")
    pipeline.instance.add_dynamic_partitions("landed_files", ["orders/day2.csv"])

    # The earlier run: created (as the daemon or the UI would), not finished.
    earlier = pipeline.instance.create_run_for_job(
        job, status=dg.DagsterRunStatus.STARTED,
        tags={"dagster/partition": "orders/day2.csv"},
        asset_selection={dg.AssetKey(["ingest", "orders"])})
    later = job.execute_in_process(instance=pipeline.instance,
                                   partition_key="orders/day2.csv", raise_on_error=False)
    assert not later.success
    [message] = failure_messages(later)
    assert f"run {earlier.run_id} is already ingesting" in message
    assert shard_id not in pipeline.client().shard_summaries()  # nothing written

    pipeline.instance.report_run_failed(earlier)  # it died before writing
    retry = job.execute_in_process(instance=pipeline.instance,
                                   partition_key="orders/day2.csv", raise_on_error=False)
    assert retry.success and materializations(retry)["ingest/orders"][UPPER] == 1
    assert _collection(pipeline.client(), shard_id, 0) == {b"a": b"1"}


@pytest.mark.s3
def test_an_s3_file_overwritten_within_its_second_is_ingested_again(
        make_pipeline: Any, s3_uri: str, s3_client: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 stamps LastModified in whole seconds: a landed object overwritten with other
    content of the same size within the second its run read it keeps name, size and
    time. Its ETag tells the versions apart: the run sees the file changed while it was
    read, and the sensor ingests the version now landed."""
    import time

    import assets.ingestion as ingestion

    bucket = s3_uri.removeprefix("s3://").split("/", 1)[0]
    query = s3_uri.split("?", 1)[1]
    monkeypatch.setenv("TEST_LANDING_URI", f"s3://{bucket}/in?{query}")
    pipeline: Pipeline = make_pipeline({"orders": {"source": {
        "kind": "files", "uri": "${TEST_LANDING_URI}"}}})
    key = "in/day.csv"
    v1, v2 = b"k,v,t\naa,1,0\n", b"k,v,t\nbb,2,0\n"  # the same size
    s3_client.put_object(Bucket=bucket, Key=key, Body=v1)
    sensor = "orders_landing_sensor"
    tick = pipeline.ticker(sensor).tick()
    assert len(tick.run_requests) == 1
    real_stat, real_read = ingestion.stat_landed, ingestion.read_landed
    calls = {"stat": 0}

    def stat(source: Any, name: str) -> Any:
        calls["stat"] += 1
        if calls["stat"] == 1:  # v1 lands again at the start of a second
            while time.time() % 1 > 0.3:
                time.sleep(0.02)
            s3_client.put_object(Bucket=bucket, Key=key, Body=v1)
        return real_stat(source, name)

    def read(source: Any, name: str, **kw: Any) -> Any:
        table = real_read(source, name, **kw)
        s3_client.put_object(Bucket=bucket, Key=key, Body=v2)  # overwritten in place
        return table

    monkeypatch.setattr(ingestion, "stat_landed", stat)
    monkeypatch.setattr(ingestion, "read_landed", read)
    [result] = pipeline.launch_all(sensor, tick)
    monkeypatch.setattr(ingestion, "stat_landed", real_stat)
    monkeypatch.setattr(ingestion, "read_landed", real_read)
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]
    assert len({o["LastModified"] for o in listed}) == 1  # the same second
    assert not result.success  # it saw the file change while it read it
    pipeline.launch_all(sensor, pipeline.ticker(sensor).tick())
    client = pipeline.client()
    upper = client.inspect(pipeline.shard_id("orders"))["upper"]
    assert _collection(client, pipeline.shard_id("orders"), upper - 1) == {b"bb": b"2"}


def test_an_identity_recorded_before_content_tags_still_names_its_file() -> None:
    from assets.sources import LandedFile, same_file_version

    tagged = LandedFile("in/a#1.csv", 12, 1_700_000_000.0, "9b2cf535f27731c974343645a3985328")
    legacy = LandedFile("in/a#1.csv", 12, 1_700_000_000.0).identity
    assert tagged.identity == f"{legacy}:etag=9b2cf535f27731c974343645a3985328"
    assert same_file_version(tagged.identity, tagged.identity)
    assert same_file_version(legacy, tagged.identity)  # ingested before: not again
    assert same_file_version(legacy, legacy)
    other = LandedFile("in/a#1.csv", 12, 1_700_000_000.0, "0" * 32).identity
    assert not same_file_version(other, tagged.identity)
    assert not same_file_version(tagged.identity, legacy)
    assert not same_file_version(None, tagged.identity)
    # A name holding ":etag=" is no tag: that file is another one.
    odd = LandedFile("f@5:100:etag=zz", 3, 7.0).identity
    assert not same_file_version("f@5:100", odd)
    multipart = LandedFile("big.csv", 9, 7.0, "0a1b-3")
    assert same_file_version(LandedFile("big.csv", 9, 7.0).identity, multipart.identity)
