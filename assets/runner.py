"""Running sensors, schedules and their run requests in this process, as the daemon would.

``make run`` (headless) and the tests use these on a real ``DagsterInstance``: a
:class:`SensorTicker` evaluates a sensor tick after tick, keeping its cursor, and
:func:`launch` executes a run request in process unless a run with its run key already
exists for that sensor (the daemon's exactly-once rule), tagging the run as the daemon
does so the UI shows where it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import dagster as dg

RUN_KEY_TAG = "dagster/run_key"
SENSOR_TAG = "dagster/sensor_name"
SCHEDULE_TAG = "dagster/schedule_name"


@dataclass
class Tick:
    """What one evaluation returned."""

    run_requests: list[dg.RunRequest] = field(default_factory=list)
    skip_reason: str | None = None
    cursor: str | None = None


class SensorTicker:
    """Evaluates one sensor of ``defs`` on ``instance``, tick after tick."""

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance, name: str,
                 cursor: str | None = None) -> None:
        self.defs = defs
        self.instance = instance
        self.sensor = defs.resolve_sensor_def(name)
        self.cursor = cursor

    @property
    def name(self) -> str:
        return self.sensor.name

    def tick(self) -> Tick:
        """Evaluate once; the cursor advances as the daemon would advance it."""
        # The instance ref lets Dagster check a run request's partition against the
        # partitions the same tick adds (as the daemon's context does).
        with dg.build_sensor_context(instance=self.instance, cursor=self.cursor,
                                     instance_ref=self.instance.get_ref(),
                                     definitions=self.defs, sensor_name=self.name,
                                     resources=self.defs.resources) as context:
            data = self.sensor.evaluate_tick(context)
        self.cursor = data.cursor
        # As the daemon does: partitions a sensor adds exist before its runs launch.
        for change in data.dynamic_partitions_requests or []:
            if isinstance(change, dg.AddDynamicPartitionsRequest):
                self.instance.add_dynamic_partitions(change.partitions_def_name,
                                                     list(change.partition_keys))
            elif isinstance(change, dg.DeleteDynamicPartitionsRequest):
                for key in change.partition_keys:
                    self.instance.delete_dynamic_partition(change.partitions_def_name, key)
        return Tick(list(data.run_requests or []), data.skip_message, data.cursor)

    def job_name(self, request: dg.RunRequest) -> str:
        if request.job_name:
            return request.job_name
        return self.sensor.job_name


def _job(defs: dg.Definitions, job_name: str | None) -> dg.JobDefinition:
    if job_name:  # includes the anonymous job of a sensor that targets assets
        return defs.get_repository_def().get_job(job_name)
    return defs.resolve_implicit_global_asset_job_def()


def merge_run_config(base: object, extra: Mapping[str, object] | None) -> dict[str, object]:
    """``base`` (a dict or ``dg.RunConfig``) with ``extra`` merged into it, recursively."""
    if isinstance(base, dg.RunConfig):
        merged: dict[str, object] = dict(base.to_config_dict())
    else:
        merged = dict(base) if isinstance(base, Mapping) else {}
    for key, value in (extra or {}).items():
        current = merged.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            merged[key] = merge_run_config(current, value)
        else:
            merged[key] = value
    return merged


def run_key_used(instance: dg.DagsterInstance, run_key: str, origin_tag: str,
                 origin: str) -> bool:
    """Whether a run with this key was already created by this sensor/schedule."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={RUN_KEY_TAG: run_key,
                                                         origin_tag: origin}), limit=1)
    return bool(runs)


def launch(defs: dg.Definitions, instance: dg.DagsterInstance, request: dg.RunRequest, *,
           job_name: str | None = None, sensor_name: str | None = None,
           schedule_name: str | None = None,
           resources: Mapping[str, object] | None = None,
           run_config: Mapping[str, object] | None = None) -> dg.ExecuteInProcessResult | None:
    """Execute ``request`` in this process; None if its run key was already used.

    ``run_config`` is merged into the request's (e.g. to set the console log level).
    Failures do not raise: inspect ``result.success``.
    """
    tags = {str(k): str(v) for k, v in (request.tags or {}).items()}
    if sensor_name:
        tags[SENSOR_TAG] = sensor_name
    if schedule_name:
        tags[SCHEDULE_TAG] = schedule_name
    if request.run_key:
        origin_tag, origin = ((SENSOR_TAG, sensor_name) if sensor_name
                              else (SCHEDULE_TAG, schedule_name or ""))
        if run_key_used(instance, request.run_key, origin_tag, origin):
            return None
        tags[RUN_KEY_TAG] = request.run_key
    job = _job(defs, request.job_name or job_name)
    selection = request.asset_selection
    return job.execute_in_process(
        run_config=merge_run_config(request.run_config, run_config), instance=instance,
        tags=tags, partition_key=request.partition_key,
        asset_selection=list(selection) if selection else None,
        raise_on_error=False, resources=resources)


def launch_sensor_requests(ticker: SensorTicker, tick: Tick, *,
                           resources: Mapping[str, object] | None = None,
                           run_config: Mapping[str, object] | None = None
                           ) -> list[dg.ExecuteInProcessResult]:
    """Launch every request of ``tick`` (skipping used run keys); returns the results."""
    results = []
    for request in tick.run_requests:
        result = launch(ticker.defs, ticker.instance, request,
                        job_name=ticker.job_name(request), sensor_name=ticker.name,
                        resources=resources, run_config=run_config)
        if result is not None:
            results.append(result)
    return results
