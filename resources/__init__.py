"""Dagster resources of the code location: the persist location, the inline policy,
Spark, alerts and the IO manager (:class:`PersistIOManager`)."""

from resources.io_manager import PersistIOManager

__all__ = ["PersistIOManager"]
