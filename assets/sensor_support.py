"""What the pipeline's sensors share: default status, JSON cursors, the run-key tag."""

# No `from __future__ import annotations`: Dagster reads decorated functions' annotations.

import json
import time
from typing import Any

import dagster as dg

RUN_KEY_TAG = "dagster/run_key"


def sensor_status(running: bool) -> dg.DefaultSensorStatus:
    """A sensor's default status: running, or stopped (automation off in the config)."""
    return dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED


def load_cursor(cursor: str | None) -> dict[str, Any]:
    """A sensor's JSON cursor as a dict ({} when unset or unreadable)."""
    if not cursor:
        return {}
    try:
        value = json.loads(cursor)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def now_ms() -> int:
    """Wall-clock milliseconds (what alert episodes and retry waits are measured in)."""
    return int(time.time() * 1000)
