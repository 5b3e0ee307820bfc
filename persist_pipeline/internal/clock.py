"""Time, injected: every deadline, lease and walltime the library uses reads a :class:`Clock`.

Production uses :data:`SYSTEM_CLOCK`; the deterministic simulation substitutes a clock it
advances itself, so a pause past a lease or a commit deadline happens exactly when the
simulation decides.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Wall time in milliseconds, a monotonic time in seconds, and sleeping."""

    def now_ms(self) -> int:
        """Milliseconds since the epoch (leases, walltimes, commit deadlines)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (retry deadlines)."""

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (retry backoff, listen polls)."""


class SystemClock:
    """The real clock."""

    def now_ms(self) -> int:
        return int(time.time() * 1000)

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK: Clock = SystemClock()
