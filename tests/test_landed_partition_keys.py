"""Landed-file partition keys: a long path gets a bounded key that is still unique and
readable, and its file is still ingested exactly once.

The rule (:func:`assets.asset_keys.file_partition_key`) is tested on its own (fast tier);
then, on a real instance, the landing sensor and the ingestion asset with a long landed
file name: its key, its run's tag and metadata with the full path, a partition re-run and
one materialized by hand, and a partition keyed by the full path, as every key was before
long ones were shortened, which keeps working with exactly-once intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from assets.asset_keys import (
    MAX_FILE_PARTITION_KEY,
    file_partition_key,
    file_partition_keys,
    is_shortened_file_partition,
    split_file_partition,
)
from assets.ingestion import FILE, UPPER
from assets.runner import SensorTicker
from tests.pipeline_support import Pipeline, failure_messages, make_pipeline, materializations

__all__ = ["make_pipeline"]  # the fixture, imported for pytest

#: A real-world long name: a partner's export, in dated folders.
LONG = ("partner-acme-logistics/exports/2024-11-25/orders-export-full-refresh-region-eu-west-"
        "1-warehouse-rotterdam-batch-000017-of-000032.csv")


def test_short_keys_are_the_path_as_before() -> None:
    for path in ("orders-0001.csv", "2024/11/25/a.parquet", "x" * 27):
        key = file_partition_key("orders", path)
        assert key == f"orders/{path}" and len(key) <= MAX_FILE_PARTITION_KEY
        assert file_partition_keys("orders", path) == (key,)
        assert not is_shortened_file_partition(key)
        assert split_file_partition(key) == ("orders", path)


def test_a_long_path_gets_a_bounded_readable_key() -> None:
    key = file_partition_key("orders", LONG)
    assert len(key) == MAX_FILE_PARTITION_KEY, key
    shard, rest = split_file_partition(key)
    head, digest, tail = rest.split("~")
    # The shard, the path's start and end (its extension among them), a digest.
    assert shard == "orders" and LONG.startswith(head) and LONG.endswith(tail)
    assert tail.endswith("000032.csv") and len(digest) == 8
    assert is_shortened_file_partition(key)
    # The full path, as keys were before: still a key of this file.
    assert file_partition_keys("orders", LONG) == (key, f"orders/{LONG}")
    # The demo's file that fails on purpose is just over the limit: shortened too.
    bad = file_partition_key("orders", "orders-0003-malformed-on-purpose.csv")
    assert len(bad) == MAX_FILE_PARTITION_KEY and bad.endswith("-purpose.csv")


def test_long_paths_that_differ_anywhere_get_different_keys() -> None:
    # The same start and end, one character apart in the middle: the digest tells.
    twin = LONG.replace("batch-000017", "batch-000018")
    key, twin_key = file_partition_key("orders", LONG), file_partition_key("orders", twin)
    (head, digest, tail), (twin_head, twin_digest, twin_tail) = (
        split_file_partition(k)[1].split("~") for k in (key, twin_key))
    assert (head, tail) == (twin_head, twin_tail) and digest != twin_digest
    # The same path in two shards: two keys, each of its shard.
    assert file_partition_key("events", LONG).startswith("events/")


def test_a_long_shard_name_still_keeps_part_of_the_path() -> None:
    shard = "customer_orders_from_partners_eu"
    key = file_partition_key(shard, LONG)
    head, _, tail = split_file_partition(key)[1].split("~")
    assert len(head) + len(tail) >= 8 and tail.endswith(".csv")


@given(shard=st.from_regex(r"[a-z][a-z0-9_]{0,24}", fullmatch=True),
       path=st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1,
                    max_size=300))
def test_every_key_is_bounded_deterministic_and_names_its_shard(shard: str, path: str
                                                                ) -> None:
    key = file_partition_key(shard, path)
    assert key == file_partition_key(shard, path)
    # Over the limit only as far as a long shard name needs to keep 8 path characters.
    bound = max(MAX_FILE_PARTITION_KEY, len(shard) + 1 + 8 + 2 + 8)
    assert key.startswith(f"{shard}/") and len(key) <= bound
    assert (key == f"{shard}/{path}") == (len(shard) + 1 + len(path)
                                          <= MAX_FILE_PARTITION_KEY)
    assert file_partition_keys(shard, path)[0] == key


# --- on a real instance ----------------------------------------------------------------------


def _orders(make_pipeline: Any) -> tuple[Pipeline, Path, dg.JobDefinition]:
    pipeline: Pipeline = make_pipeline({"orders": {"source": {
        "kind": "files", "uri": "{data_dir}/landing/orders"}}})
    landing = pipeline.data_dir / "landing" / "orders"
    landing.mkdir(parents=True)
    return pipeline, landing, pipeline.defs.resolve_job_def("ingest_files_job")


def _land(landing: Path, name: str, text: str, mtime: int) -> Path:
    path = landing / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (1_700_000_000 + mtime, 1_700_000_000 + mtime))
    return path


def _upper(pipeline: Pipeline) -> int | None:
    summary = pipeline.client().shard_summaries().get(pipeline.shard_id("orders"))
    return summary.upper if summary else None


@pytest.mark.slow
def test_a_long_file_name_is_ingested_once_under_its_bounded_key(make_pipeline: Any) -> None:
    pipeline, landing, job = _orders(make_pipeline)
    sensor = "orders_landing_sensor"
    full = _land(landing, LONG, "k,v,t\na,1,0\nb,2,0\n", 1)
    key = file_partition_key("orders", LONG)

    tick = pipeline.ticker(sensor).tick()
    [request] = tick.run_requests
    assert request.partition_key == key and request.tags["persist/file"] == LONG
    assert pipeline.instance.get_dynamic_partitions("landed_files") == [key]
    [result] = pipeline.launch_all(sensor, tick)
    assert result.success
    meta = materializations(result)["ingest/orders"]
    assert meta[FILE] == str(full) and meta[UPPER] == 1  # the full path, in the metadata

    # A re-run of the partition from the UI (no persist/file tag) finds the file through
    # the earlier run's tag, and writes nothing: the file was ingested.
    rerun = job.execute_in_process(instance=pipeline.instance, partition_key=key,
                                   raise_on_error=False)
    assert rerun.success and materializations(rerun) == {} and _upper(pipeline) == 1
    # A sensor that lost its cursor does not request it again.
    fresh = SensorTicker(pipeline.defs, pipeline.instance, sensor)
    assert fresh.tick().run_requests == []

    # A partition added and materialized by hand, no run before it: found by listing.
    other = LONG.replace("000017", "000018")
    _land(landing, other, "k,v,t\nc,3,0\n", 2)
    other_key = file_partition_key("orders", other)
    pipeline.instance.add_dynamic_partitions("landed_files", [other_key])
    manual = job.execute_in_process(instance=pipeline.instance, partition_key=other_key,
                                    raise_on_error=False)
    assert manual.success and materializations(manual)["ingest/orders"][FILE].endswith(other)
    assert _upper(pipeline) == 2
    assert pipeline.ticker(sensor).tick().run_requests == []  # already ingested

    # A shortened key whose file is gone, and no run names it: fails, saying so.
    gone = file_partition_key("orders", LONG.replace("000017", "000019"))
    pipeline.instance.add_dynamic_partitions("landed_files", [gone])
    failed = job.execute_in_process(instance=pipeline.instance, partition_key=gone,
                                    raise_on_error=False)
    assert not failed.success and _upper(pipeline) == 2
    [message] = failure_messages(failed)
    assert f"partition {gone}: no file in" in message and "moved or archived" in message


@pytest.mark.slow
def test_a_partition_keyed_by_the_full_long_path_keeps_working(make_pipeline: Any) -> None:
    """A file landed before keys were shortened has the partition ``orders/<path>``: it is
    still ingested once, re-runs of it work, and its new versions stay in it."""
    pipeline, landing, job = _orders(make_pipeline)
    sensor = "orders_landing_sensor"
    _land(landing, LONG, "k,v,t\na,1,0\n", 1)
    old_key = f"orders/{LONG}"
    # As the landing sensor used to: the partition is the full path, and its run.
    pipeline.instance.add_dynamic_partitions("landed_files", [old_key])
    before = job.execute_in_process(instance=pipeline.instance, partition_key=old_key,
                                    raise_on_error=False, tags={"persist/file": LONG})
    assert before.success and _upper(pipeline) == 1

    # The sensor now (a fresh cursor, as after an upgrade) sees it ingested: no run.
    tick = pipeline.ticker(sensor).tick()
    assert tick.run_requests == [] and "1 already ingested" in (tick.skip_reason or "")
    # Neither the old partition nor the new key writes it again.
    again = job.execute_in_process(instance=pipeline.instance, partition_key=old_key,
                                   raise_on_error=False)
    new_key = file_partition_key("orders", LONG)
    pipeline.instance.add_dynamic_partitions("landed_files", [new_key])
    by_new = job.execute_in_process(instance=pipeline.instance, partition_key=new_key,
                                    raise_on_error=False)
    assert again.success and by_new.success
    assert materializations(again) == {} == materializations(by_new)
    assert _upper(pipeline) == 1
    pipeline.instance.delete_dynamic_partition("landed_files", new_key)

    # A new version of the file is ingested once, in the partition it already has.
    _land(landing, LONG, "k,v,t\nb,2,0\nc,3,0\n", 5)
    tick = pipeline.ticker(sensor).tick()
    [request] = tick.run_requests
    assert request.partition_key == old_key
    [result] = pipeline.launch_all(sensor, tick)
    assert result.success and _upper(pipeline) == 2
    assert pipeline.instance.get_dynamic_partitions("landed_files") == [old_key]
