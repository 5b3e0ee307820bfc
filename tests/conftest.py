"""Shared pytest fixtures; backend fixtures live in their own plugin modules."""

from __future__ import annotations

pytest_plugins = [
    "tests.fixtures.postgres",
    "tests.fixtures.s3",
    "tests.fixtures.backends",
    "tests.fixtures.location",
]
