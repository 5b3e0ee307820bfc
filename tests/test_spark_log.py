"""Where the Spark driver JVM's own output goes by default: under ``$DAGSTER_HOME``, but
not in Dagster's telemetry spool (``$DAGSTER_HOME/logs``), whose files ``dagster dev``'s
webserver and daemon upload to Dagster's telemetry server and delete."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster_shared.telemetry import get_or_create_dir_from_dagster_home

from resources.spark import SPARK_LOG_ENV, spark_log_path


def test_the_driver_log_is_under_dagster_home_outside_the_telemetry_spool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPARK_LOG_ENV, raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    path = spark_log_path()
    spool = Path(get_or_create_dir_from_dagster_home("logs"))  # where Dagster looks
    assert path.is_relative_to(tmp_path) and not path.is_relative_to(spool), path


def test_persist_spark_log_names_the_file(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPARK_LOG_ENV, str(tmp_path / "driver.log"))
    assert spark_log_path() == tmp_path / "driver.log"
