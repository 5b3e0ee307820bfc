"""A background thread that renews a handle's lease until the handle is closed."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from persist_pipeline.exceptions import LeaseExpired, PersistError

log = logging.getLogger(__name__)


class Heartbeater:
    """Calls ``beat`` every ``interval_s`` seconds on a daemon thread until stopped.

    ``beat`` is held weakly: a handle that is dropped without being expired stops
    heartbeating, so its lease runs out and it no longer holds back since or GC.
    """

    def __init__(self, name: str, interval_s: float, beat: Callable[[], None]) -> None:
        self._stop = threading.Event()
        self._beat = weakref.WeakMethod(beat)
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if interval_s > 0:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not self._beat_once():
                return

    def _beat_once(self) -> bool:
        """One heartbeat; False when the handle is gone or expired. Holds no reference
        to the handle between beats."""
        beat = self._beat()
        if beat is None:
            return False
        try:
            beat()
        except LeaseExpired:
            return False
        except PersistError as e:
            log.warning("%s: heartbeat failed (will retry): %s", self._thread.name, e)
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
