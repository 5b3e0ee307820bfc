"""Frontiers over non-negative 64-bit times.

A frontier is an ``int`` (the least time not yet complete) or ``None``: the empty
frontier, meaning *closed* (every time is complete; nothing more can be written).
"""

from __future__ import annotations

from typing import Final

from persist_pipeline.exceptions import InvalidFrontier

Frontier = int | None

#: The empty frontier: the shard is closed (upper) or no time is readable (since).
CLOSED: Final = None
#: The largest time an update may carry (times are non-negative signed 64-bit).
MAX_TIME: Final = (1 << 63) - 1


def less_equal(a: Frontier, b: Frontier) -> bool:
    """``a <= b`` where ``None`` (closed) is above every time."""
    if b is None:
        return True
    if a is None:
        return False
    return a <= b


def less_than(a: Frontier, b: Frontier) -> bool:
    """``a < b`` where ``None`` (closed) is above every time."""
    return less_equal(a, b) and a != b


def check_frontier(value: object, name: str) -> Frontier:
    """Validate a user-supplied frontier; raises :class:`InvalidFrontier`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFrontier(f"{name} must be an int time or None (closed), "
                              f"got {type(value).__name__}")
    if value < 0 or value > MAX_TIME:
        raise InvalidFrontier(f"{name}={value} is outside [0, 2**63-1]")
    return value
