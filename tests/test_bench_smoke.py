"""Smoke test of the benchmarks (``make bench``): every case's code path on tiny sizes.

It runs ``python -m bench --smoke`` in this process (sharing the suite's Spark session
if one is running) and asserts only that every case ran and wrote its report and plots;
no timing is asserted. The peers (deltalake, PyIceberg, DuckLake) come with the ``bench``
extra, which the ``dev`` extra includes: if one is missing this test fails, it never
skips.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import plots, runner
from tests.pipeline_support import spark_session

__all__ = ["spark_session"]  # a fixture, imported for pytest

pytestmark = [pytest.mark.postgres, pytest.mark.s3, pytest.mark.spark, pytest.mark.slow]


#: The cases, in groups of about equal smoke time, one test each (parallel workers share
#: them; the Spark ones share a worker's session).
GROUPS = {"latency": ["1", "2", "3", "8"], "reads": ["4", "7", "13", "14", "profile"],
          "pipeline": ["6", "11", "12"], "spark": ["5", "10"], "scale": ["9"]}


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The test worker's objects moved out of the collector's sight for the run.

    ``bench.common.measure`` runs a full collection before each timed block. In a test
    worker the heap holds every imported test module, Dagster, PySpark and the session's
    fixtures: each collection took about 0.34 s there (94 of them, 32 s of the latency
    and reads groups' 82 s). What exists before the run is frozen (:func:`gc.freeze`),
    so the collections scan the benchmark's own objects, as in a run of its own (0.05 s
    each); no timing is asserted here.
    """
    gc.collect()
    gc.freeze()
    yield  # left frozen: the session froze its heap too (tests/conftest.py)


@pytest.mark.parametrize("group", list(GROUPS))
def test_every_case_runs_on_tiny_sizes(tmp_path: Path, pg_server: object,
                                      spark_session: object, frozen_heap: None,
                                      group: str) -> None:
    """``pg_server`` makes sure PostgreSQL runs (the runner then finds it); the suite's
    ``spark_session`` is reused by case 5 (and left running)."""
    cases = GROUPS[group]
    assert runner.main(["--smoke", "--cases", ",".join(cases), "--out", str(tmp_path)]) == 0
    report = (tmp_path / "BENCH.md").read_text()
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["failures"] == {}
    for case in cases:
        key = case if case == "profile" else f"case{case}"
        assert summary["tables"][key], f"{key} produced no table"
        if key in plots.PLOTS:
            name = plots.PLOTS[key][0]
            assert (tmp_path / name).stat().st_size > 0, name
            assert f"]({name})" in report
    if "profile" in cases:
        assert (tmp_path / "profiles" / "inline_append_empty.txt").exists()
    if "1" in cases:
        assert "synchronous_commit=" in report
    assert "## Targets" in report


def test_groups_cover_every_case() -> None:
    grouped = [c for cases in GROUPS.values() for c in cases]
    assert sorted(grouped) == sorted(runner.CASES) and len(grouped) == len(set(grouped))
