"""Smoke test of the benchmarks (``make bench``): every case's code path on tiny sizes.

It runs ``python -m bench --smoke`` in this process (sharing the suite's Spark session
if one is running) and asserts only that every case ran and wrote its report and plots;
no timing is asserted. The peers (deltalake, PyIceberg, DuckLake) come with the ``bench``
extra, which the ``dev`` extra includes: if one is missing this test fails, it never
skips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import plots, runner
from tests.pipeline_support import spark_session

__all__ = ["spark_session"]  # a fixture, imported for pytest

pytestmark = [pytest.mark.postgres, pytest.mark.s3, pytest.mark.spark, pytest.mark.slow]


def test_every_case_runs_on_tiny_sizes(tmp_path: Path, pg_server: object,
                                      spark_session: object) -> None:
    """``pg_server`` makes sure PostgreSQL runs (the runner then finds it); the suite's
    ``spark_session`` is reused by case 5 (and left running)."""
    assert runner.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "BENCH.md").read_text()
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["failures"] == {}
    for key in ("case1", "case2", "case3", "case4", "case5", "case6", "case7", "case8",
                "case9", "case10", "case11", "case12", "case13", "profile"):
        assert summary["tables"][key], f"{key} produced no table"
    for name, _ in plots.PLOTS.values():
        assert (tmp_path / name).stat().st_size > 0, name
        assert f"]({name})" in report
    assert (tmp_path / "profiles" / "inline_append_empty.txt").exists()
    assert "## Targets" in report and "synchronous_commit=" in report
