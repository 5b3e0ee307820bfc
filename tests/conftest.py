"""Shared pytest configuration; backend fixtures live in their own plugin modules.

Tiers (``make test-fast`` / ``make test``): a test that needs PostgreSQL, the S3 server
or Spark carries the ``postgres`` / ``s3`` / ``spark`` mark, given here from the
fixtures it uses (and by the location fixtures' parameters), so ``-m`` selects honestly.
Hypothesis runs under a profile (``HYPOTHESIS_PROFILE``: ``ci``, the default, or
``fast``) rather than example counts fixed in each test.
"""

from __future__ import annotations

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
