"""The ``io_manager`` resource: :class:`PersistIOManager`, assets stored in shards.

The class ships with the library (``persist_pipeline.dagster_io``) so any Dagster project
can use it; the code location configures it with the same location and inline policy as
the ``persist`` resource, so assets added here that return a pyarrow Table or a pandas /
polars DataFrame are stored in shards named after their asset keys.
"""

from __future__ import annotations

from persist_pipeline.dagster_io import AssetNotStored, PersistIOManager, asset_shard_id

__all__ = ["AssetNotStored", "PersistIOManager", "asset_shard_id"]
