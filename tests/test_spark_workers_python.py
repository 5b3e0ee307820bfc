"""A local Spark session whose Python workers cannot import the library is refused when
the data source is registered, with what to do, not at its first read deep in Spark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from persist_pipeline.exceptions import InvalidConfig
from persist_pipeline.spark_source import _check_local_workers_python


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter without this environment's packages (a venv of its own, as the
    system ``python3`` a plain session's workers run typically is)."""
    env = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    return str(Path(env) / "bin" / "python")


def test_workers_without_the_library_are_refused_with_what_to_do(bare_python: str):
    with pytest.raises(InvalidConfig) as e:
        _check_local_workers_python("local[2]", bare_python)
    message = str(e.value)
    assert "No module named 'pyarrow'" in message
    assert f"PYSPARK_PYTHON={sys.executable}" in message
    assert "local_spark_session" in message


def test_a_missing_worker_interpreter_is_refused():
    with pytest.raises(InvalidConfig, match="not found"):
        _check_local_workers_python("local[*]", "no-such-python-for-spark-workers")


def test_workers_running_this_interpreter_pass():
    _check_local_workers_python("local[*]", sys.executable)


def test_workers_of_another_interpreter_with_the_library_pass(tmp_path: Path):
    # Another path to an interpreter of this environment (as a PATH's python3 in an
    # activated venv is): it imports both, nothing to refuse.
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    _check_local_workers_python("local[*]", str(python))


def test_a_cluster_session_is_not_checked_here(bare_python: str):
    # Its workers run on other machines: this machine's interpreters say nothing.
    _check_local_workers_python("spark://127.0.0.1:7077", bare_python)
