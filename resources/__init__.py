"""Dagster resources of persist-pipeline: the persist location, the inline write policy,
Spark and alerting. Each module holds one resource."""
