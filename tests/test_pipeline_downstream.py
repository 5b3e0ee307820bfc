"""A user's own asset downstream of an ingestion asset, in the code location.

Covers: an asset whose input is ``ingest/NAME`` (the ingestion asset's own key, as the
asset graph shows it) loads that shard's rows through the code location's IO manager,
the same rows the CLI's snapshot prints; for a synthetic shard and for a files shard
(partitioned by landed file: the input is the whole shard, not one shard per partition).
"""

# No `from __future__ import annotations`: Dagster reads the asset functions' annotations.

import csv
import io
from collections import Counter
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from persist_pipeline import cli
from tests.pipeline_support import SYNTHETIC, Pipeline, make_pipeline

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow

__all__ = ["make_pipeline"]  # the fixture, imported for pytest


def _downstream(name: str) -> dg.AssetsDefinition:
    @dg.asset(name=f"{name}_rows", ins={"rows": dg.AssetIn(key=dg.AssetKey(["ingest", name]))})
    def rows_of(rows: pa.Table) -> pa.Table:
        return rows

    return rows_of


def _load_downstream(pipeline: Pipeline, name: str) -> pa.Table:
    """Materialize the user's asset in the code location (its Definitions merged with the
    user's) and return what its input loaded."""
    user = _downstream(name)
    defs = dg.Definitions.merge(pipeline.defs, dg.Definitions(assets=[user]))
    result = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        instance=pipeline.instance, asset_selection=[user.key])
    assert result.success
    return result.output_for_node(f"{name}_rows")


def _cli_rows(pipeline: Pipeline, name: str, capsys: pytest.CaptureFixture[str]
              ) -> Counter[tuple[str, str]]:
    """The shard's rows as the CLI's snapshot prints them, each as often as its count."""
    consensus, blob = pipeline.defs.resources["persist"].uris()[:2]  # type: ignore[attr-defined]
    capsys.readouterr()
    assert cli.main(["--consensus", consensus, "--blob", blob,
                     "snapshot", name, "--as-of", "latest"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    out: Counter[tuple[str, str]] = Counter()
    for r in rows:
        out[(r["k"], r["v"])] += int(r["d"])
    return +out


def _loaded_rows(table: pa.Table) -> Counter[tuple[str, str]]:
    return Counter((r["k"].decode(), r["v"].decode()) for r in table.to_pylist())


def test_an_asset_downstream_of_a_synthetic_ingestion_asset_loads_its_shard(
        make_pipeline: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pipeline: Pipeline = make_pipeline({"clicks": {"source": SYNTHETIC}})
    for _ in range(2):
        assert pipeline.ingest("clicks").success
    loaded = _load_downstream(pipeline, "clicks")
    assert loaded.column_names == ["k", "v"] and loaded.num_rows > 0
    assert _loaded_rows(loaded) == _cli_rows(pipeline, "clicks", capsys)


def test_an_asset_downstream_of_a_files_ingestion_asset_loads_the_whole_shard(
        make_pipeline: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pipeline: Pipeline = make_pipeline({"orders": {"source": {
        "kind": "files", "uri": "{data_dir}/landing/orders"}}})
    landing = pipeline.data_dir / "landing" / "orders"
    landing.mkdir(parents=True)
    job = pipeline.defs.resolve_job_def("ingest_files_job")
    for file, text in (("day1.csv", "k,v,t\na,1,0\nb,2,0\n"), ("day2.csv", "k,v,t\nc,3,0\n")):
        (landing / file).write_text(text)
        pipeline.instance.add_dynamic_partitions("landed_files", [f"orders/{file}"])
        assert job.execute_in_process(instance=pipeline.instance,
                                      partition_key=f"orders/{file}").success
    loaded = _load_downstream(pipeline, "orders")
    assert _loaded_rows(loaded) == Counter({("a", "1"): 1, ("b", "2"): 1, ("c", "3"): 1})
    assert _loaded_rows(loaded) == _cli_rows(pipeline, "orders", capsys)


def test_an_asset_named_like_a_shard_is_refused_and_leaves_the_shard_its_readers(
        make_pipeline: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A user's asset keyed like a pipeline shard (``clicks``, cleaned from
    ``ingest/clicks``) would be stored by the IO manager in the shard named ``clicks``:
    ingestion's untyped shard, which holds no table. It is refused with ``NotATable``
    and nothing is stored, instead of a table generation ``clicks/_v2`` that every
    later table load of ``clicks`` (``ingest/clicks``'s downstream assets included)
    would read in place of the shard ingestion writes and the CLI reads."""
    from persist_pipeline.exceptions import NotATable

    pipeline: Pipeline = make_pipeline({"clicks": {"source": SYNTHETIC}})
    assert pipeline.ingest("clicks").success
    before = _cli_rows(pipeline, "clicks", capsys)

    @dg.asset(name="clicks", ins={"rows": dg.AssetIn(key=dg.AssetKey(["ingest", "clicks"]))})
    def cleaned(rows: pa.Table) -> pa.Table:
        return pa.table({"n": [rows.num_rows]})

    defs = dg.Definitions.merge(pipeline.defs, dg.Definitions(assets=[cleaned]))
    result = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        instance=pipeline.instance, asset_selection=[cleaned.key], raise_on_error=False)
    assert not result.success
    [failure] = [e for e in result.all_events
                 if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    error: Any = failure.event_specific_data
    assert error.error.cause.cls_name == NotATable.__name__
    assert "clicks" in error.error.cause.message
    assert "clicks/_v2" not in pipeline.client().shard_names()
    # ingest/clicks's downstream assets still load the shard ingestion writes.
    assert pipeline.ingest("clicks").success
    loaded = _load_downstream(pipeline, "clicks")
    assert _loaded_rows(loaded) == _cli_rows(pipeline, "clicks", capsys) != before
