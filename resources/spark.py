"""The ``pyspark`` resource: dagster-pyspark's ``PySparkResource`` for compaction.

``spark.master`` defaults to ``local[*]``; a cluster master (``spark://``, ``k8s://``,
``yarn``) comes from the config file or ``SPARK_MASTER`` and runs the same code. For a
local master the driver binds to loopback and Python workers run this interpreter
(see :mod:`persist_pipeline.spark`). The session is created on first use, so runs with
nothing to compact never start a JVM; it lives as long as the run's process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import dagster as dg
from dagster_pyspark import PySparkResource
from dagster_pyspark.resources import spark_session_from_config

from persist_pipeline.spark import prepare_spark_environment, spark_conf


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
            self._spark_session = spark_session_from_config(self.spark_config)
        return self._spark_session

    @property
    def spark_context(self) -> Any:
        return self.spark_session.sparkContext


def build_pyspark_resource(master: str = "local[*]", conf: Mapping[str, Any] | None = None,
                           app_name: str = "persist-pipeline") -> PersistPySparkResource:
    """The ``pyspark`` resource for ``master`` plus extra ``spark.*`` settings ``conf``."""
    extra = {str(k): str(v) for k, v in (conf or {}).items()}
    return PersistPySparkResource(spark_config=spark_conf(master, app_name, extra=extra))
