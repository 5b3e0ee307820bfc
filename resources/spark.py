"""The ``pyspark`` resource: dagster-pyspark's ``PySparkResource`` for compaction.

``spark.master`` defaults to ``local[*]``; a cluster master (``spark://``, ``k8s://``,
``yarn``) comes from the config file or ``SPARK_MASTER`` and runs the same code. For a
local master the driver binds to loopback and Python workers run this interpreter
(see :mod:`persist_pipeline.spark`). The session is created on first use, so runs with
nothing to compact never start a JVM; it lives as long as the run's process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from dagster_pyspark import PySparkResource
from dagster_pyspark.resources import spark_session_from_config

from persist_pipeline.spark import prepare_spark_environment, spark_conf

log = logging.getLogger(__name__)

#: Where the Spark driver JVM's own output goes (``PERSIST_SPARK_LOG`` overrides): its
#: start-up notices and log4j lines belong in a file, not among the run's messages.
SPARK_LOG_ENV = "PERSIST_SPARK_LOG"
#: The folder of the default log under ``$DAGSTER_HOME``. Not ``logs``: that is Dagster's
#: telemetry spool, whose files the webserver and the daemon (``dg dev``, ``make ui``) send to
#: Dagster's telemetry server and delete, whatever dagster.yaml's ``telemetry`` says.
SPARK_LOG_DIR = "spark"


def spark_log_path() -> Path:
    """``$PERSIST_SPARK_LOG``, else ``$DAGSTER_HOME/spark/spark-driver.log``, else the same
    under the temporary folder."""
    given = os.environ.get(SPARK_LOG_ENV)
    if given:
        return Path(given)
    home = os.environ.get("DAGSTER_HOME")
    base = Path(home) if home else Path(tempfile.gettempdir()) / "persist-pipeline"
    return base / SPARK_LOG_DIR / "spark-driver.log"


@contextlib.contextmanager
def _jvm_output_to(path: Path) -> Iterator[None]:
    """Processes started inside this block write their stderr to ``path`` (this
    process's own stderr is back as before when it ends)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


class PersistPySparkResource(PySparkResource):
    """``PySparkResource`` with a lazily created, correctly bound session.

    Configure it like ``PySparkResource`` (``spark_config`` holds ``spark.*`` keys);
    build one with :func:`build_pyspark_resource`.
    """

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """Nothing to do until a step asks for the session."""

    @property
    def master(self) -> str:
        return str(self.spark_config.get("spark.master", "local[*]"))

    @property
    def spark_session(self) -> Any:
        if self._spark_session is None:
            prepare_spark_environment(self.master,
                                      self.spark_config.get("spark.pyspark.python"))
            path = spark_log_path()
            with _jvm_output_to(path):
                self._spark_session = spark_session_from_config(self.spark_config)
            log.info("Spark driver started (master %s); its own log: %s", self.master, path)
        return self._spark_session

    @property
    def spark_context(self) -> Any:
        return self.spark_session.sparkContext


def build_pyspark_resource(master: str = "local[*]", conf: Mapping[str, Any] | None = None,
                           app_name: str = "persist-pipeline") -> PersistPySparkResource:
    """The ``pyspark`` resource for ``master`` plus extra ``spark.*`` settings ``conf``."""
    extra = {str(k): str(v) for k, v in (conf or {}).items()}
    return PersistPySparkResource(spark_config=spark_conf(master, app_name, extra=extra))
