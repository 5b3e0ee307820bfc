"""Dagster integration that ships with the library (needs the ``dagster`` extra).

- :class:`PersistIOManager`: store asset outputs (pyarrow, pandas, polars) in typed,
  named shards and load them as inputs; add it to any Dagster project's ``Definitions``.
- :func:`compaction_definitions`: a sensor and a Spark job that compact IO-managed
  shards, for projects that run ``PersistIOManager(maintenance="external")`` (its job
  also needs the ``spark`` extra and dagster-pyspark).
- :mod:`persist_pipeline.tables` (the core, no Dagster): how a table is stored in a
  typed shard, named, and read back.

Importing ``persist_pipeline`` never imports Dagster; importing this package does.
"""

from __future__ import annotations

from persist_pipeline.internal.extras import missing_extra

try:
    import dagster  # noqa: F401
except ModuleNotFoundError as e:
    raise missing_extra("persist_pipeline.dagster_io needs Dagster", "dagster",
                        "dagster>=1.12", e) from e

from persist_pipeline.dagster_io.compaction import compaction_definitions
from persist_pipeline.dagster_io.io_manager import (
    TABLE_NAME,
    AssetNotStored,
    PersistIOManager,
    asset_shard_id,
)
from persist_pipeline.tables import UnsupportedOutput, asset_shard_name

__all__ = ["TABLE_NAME", "AssetNotStored", "PersistIOManager", "UnsupportedOutput",
           "asset_shard_id", "asset_shard_name", "compaction_definitions"]
