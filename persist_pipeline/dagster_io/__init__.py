"""Dagster integration that ships with the library (needs the ``pipeline`` extra).

- :class:`PersistIOManager`: store asset outputs (pyarrow, pandas, polars) in shards and
  load them as inputs; add it to any Dagster project's ``Definitions``.
- :mod:`~persist_pipeline.dagster_io.encoding`: how a table is laid out in a shard.

Importing ``persist_pipeline`` never imports Dagster; importing this package does.
"""

from __future__ import annotations

from persist_pipeline.dagster_io.io_manager import (
    AssetNotStored,
    PersistIOManager,
    UnsupportedOutput,
    asset_shard_id,
)

__all__ = ["AssetNotStored", "PersistIOManager", "UnsupportedOutput", "asset_shard_id"]
