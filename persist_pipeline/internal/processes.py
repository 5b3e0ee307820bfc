"""Worker processes started from a server that imported the library once.

The nemesis (and the test suite) start many short-lived processes, killed and started
again. ``spawn`` gives each a clean interpreter but pays the library's imports (about a
second of CPU) every time; ``fork`` copies whatever threads, locks and connections the
parent holds. ``forkserver`` forks each child from a single-threaded server that only
imported modules: as clean as ``spawn``, at the cost of a fork.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
from collections.abc import Sequence
from typing import Any


class _ProcessInCurrentEnvironment(multiprocessing.context.ForkServerProcess):
    """A forkserver child that runs with the environment of the moment it was created.

    Children of a fork server inherit the server's environment, fixed when it started;
    a child started later must see what its parent set since (credentials for the
    object store, say), as a ``spawn`` child would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._environment = dict(os.environ)

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environment)
        super().run()


class _ForkServerContext(multiprocessing.context.ForkServerContext):
    Process = _ProcessInCurrentEnvironment


#: What :func:`preloaded_context` returns: both start processes with ``Process``.
StartContext = multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext

_FORKSERVER = _ForkServerContext()
_PRELOAD: set[str] = set()


def preloaded_context(preload: Sequence[str]) -> StartContext:
    """A context whose children start with ``preload`` (module names) already imported.

    Where the platform has no fork server, ``spawn``. The fork server is one per
    process: modules named after it started are imported by each child instead."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    _PRELOAD.update(preload)
    _FORKSERVER.set_forkserver_preload(sorted(_PRELOAD))
    return _FORKSERVER
