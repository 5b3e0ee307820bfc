"""One retry policy for transient backend errors: jittered exponential backoff until a
deadline, then :class:`~persist_pipeline.exceptions.Indeterminate`."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from persist_pipeline.exceptions import Indeterminate, Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

#: First and longest sleep between attempts, in seconds.
BACKOFF_INITIAL_S = 0.005
BACKOFF_MAX_S = 1.0


class Backoff:
    """Sleeps between attempts; raises :class:`Indeterminate` once ``deadline_s`` passed.

    Attributes:
        retries: how many times it slept (for metrics).
    """

    def __init__(self, deadline_s: float, what: str) -> None:
        self.deadline = time.monotonic() + deadline_s
        self.deadline_s = deadline_s
        self.what = what
        self.attempt = 0
        self.retries = 0

    def wait(self, error: Exception) -> None:
        if time.monotonic() >= self.deadline:
            raise Indeterminate(f"{self.what} kept failing for {self.deadline_s:.0f}s: "
                                f"{error}") from error
        delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(self.attempt, 8))
        delay *= 0.5 + random.random()  # noqa: S311 - jitter, not crypto
        log.debug("%s failed, retrying in %.3fs: %s", self.what, delay, error)
        time.sleep(delay)
        self.attempt += 1
        self.retries += 1


def retry_transient(call: Callable[[], T], *, deadline_s: float, what: str,
                    catch: type[Unavailable] = Unavailable,
                    on_retry: Callable[[], None] | None = None) -> T:
    """Run ``call``, retrying ``catch`` errors with :class:`Backoff` until the deadline."""
    backoff = Backoff(deadline_s, what)
    while True:
        try:
            return call()
        except catch as e:
            backoff.wait(e)
            if on_retry is not None:
                on_retry()
