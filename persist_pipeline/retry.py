"""One retry policy for transient backend errors: jittered exponential backoff until a
deadline, then :class:`~persist_pipeline.exceptions.Indeterminate`."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import TypeVar

from persist_pipeline.exceptions import Indeterminate, Unavailable
from persist_pipeline.internal.clock import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)
T = TypeVar("T")

#: First and longest sleep between attempts, in seconds.
BACKOFF_INITIAL_S = 0.005
BACKOFF_MAX_S = 1.0

#: Jitter source (seeded by the deterministic simulation).
JITTER = random.Random()  # noqa: S311 - jitter, not crypto


class Backoff:
    """Sleeps between attempts; raises :class:`Indeterminate` once ``deadline_s`` passed.

    Attributes:
        retries: how many times it slept (for metrics).
    """

    def __init__(self, deadline_s: float, what: str, clock: Clock = SYSTEM_CLOCK, *,
                 started_s: float | None = None) -> None:
        """``started_s``: when the retried work started (``clock.monotonic()``), if
        before now: the deadline counts from then."""
        self.clock = clock
        self.deadline = (clock.monotonic() if started_s is None else started_s) + deadline_s
        self.deadline_s = deadline_s
        self.what = what
        self.attempt = 0
        self.retries = 0

    def wait(self, error: Exception) -> None:
        if self.clock.monotonic() >= self.deadline:
            raise Indeterminate(f"{self.what} kept failing for {self.deadline_s:.0f}s: "
                                f"{error}") from error
        delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(self.attempt, 8))
        delay *= 0.5 + JITTER.random()
        log.debug("%s failed, retrying in %.3fs: %s", self.what, delay, error)
        self.clock.sleep(delay)
        self.attempt += 1
        self.retries += 1


def retry_transient(call: Callable[[], T], *, deadline_s: float, what: str,
                    catch: type[Unavailable] = Unavailable,
                    on_retry: Callable[[], None] | None = None,
                    clock: Clock = SYSTEM_CLOCK) -> T:
    """Run ``call``, retrying ``catch`` errors with :class:`Backoff` until the deadline."""
    backoff = Backoff(deadline_s, what, clock)
    while True:
        try:
            return call()
        except catch as e:
            backoff.wait(e)
            if on_retry is not None:
                on_retry()
