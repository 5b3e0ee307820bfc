"""The Dagster code location of persist-pipeline: assets, checks, sensors and schedules.

``workspace.yaml`` loads :mod:`assets.definitions`, whose ``defs`` are built from the
pipeline config file (``pipeline.yaml``) by the factories of the modules here.
"""
