"""Shared pytest configuration; backend fixtures live in their own plugin modules.

Tiers (``make test-fast`` / ``make test``): a test that needs PostgreSQL, the S3 server
or Spark carries the ``postgres`` / ``s3`` / ``spark`` mark, given here from the
fixtures it uses (and by the location fixtures' parameters), so ``-m`` selects honestly.
Hypothesis runs under a profile (``HYPOTHESIS_PROFILE``: ``ci``, the default, or
``fast``) rather than example counts fixed in each test.

With ``-n`` workers (``make test``), tests are handed out one at a time, slow ones
first, and the modules of :data:`ONE_WORKER_MODULES` each to one worker (see
:func:`pytest_xdist_make_scheduler`).
"""

from __future__ import annotations

import gc
import os

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = [
    "tests.fixtures.postgres",
    "tests.fixtures.s3",
    "tests.fixtures.backends",
    "tests.fixtures.location",
]

settings.register_profile("ci", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fast", max_examples=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: Fixtures that need a service, and the mark a test using them gets.
_SERVICE_FIXTURES = {
    "pg_server": "postgres", "pg_url": "postgres", "pg_restartable": "postgres",
    "pg_password_server": "postgres",
    "s3_server": "s3", "s3_uri": "s3", "s3_client": "s3", "s3_auth_enforced": "s3",
    "spark_session": "spark",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = getattr(item, "fixturenames", ())
        for fixture, mark in _SERVICE_FIXTURES.items():
            if fixture in names:
                item.add_marker(getattr(pytest.mark, mark))
    # Slow tests first (a stable sort: file order otherwise): with two workers, the
    # short tests fill in at the end instead of a long one starting last and leaving
    # the other worker idle.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection built (every test module, Dagster, PySpark, hypothesis) out
    of the cyclic collector's sight: those objects live for the whole session, and each
    full collection scanned them all again (a third of a second each in a worker; the
    collector's time over the API, routes and IO manager modules fell from 10.2 s to
    7.4 s)."""
    gc.collect()
    gc.freeze()


#: Modules whose tests share a module fixture too costly to set up on every worker:
#: tests/test_ui_browser.py's runs the demo pipeline and ``dg dev`` (35-70 s).
ONE_WORKER_MODULES = frozenset({"tests/test_ui_browser.py"})


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``-n``'s default distribution (``--dist load``), scheduled test by test.

    xdist's own ``load`` sends each worker a quarter of its share of the suite at
    once, in file order, and splits a module across workers; ``loadgroup``, which would
    keep one on one worker, ignores its mark under pytest 9.2 (pytest-xdist issue
    #1386: the group travels in the node id, which pytest no longer lets it change).
    Here each module of :data:`ONE_WORKER_MODULES` is one unit of work, given whole to
    one worker, first; every other test is a unit of its own, given to whichever worker
    has fewer than three waiting, in collection order (slow tests first).
    """
    if config.getvalue("dist") != "load":
        return None  # any other --dist keeps xdist's scheduler
    from xdist.scheduler import LoadScopeScheduling

    class OneAtATime(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return OneAtATime(config, log)  # type: ignore[arg-type]
