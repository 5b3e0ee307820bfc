"""The error an integration raises when the optional package it needs is missing."""

from __future__ import annotations


def missing_extra(what: str, package: str, error: ModuleNotFoundError) -> ModuleNotFoundError:
    """A ``ModuleNotFoundError`` for ``error`` that says what to install, not only what
    is missing: ``what`` needs ``package`` (the ``pipeline`` extra brings it)."""
    return ModuleNotFoundError(
        f"{what}, which is not installed ({error}): install the library with its pipeline "
        f"extra (pip install '/path/to/persist-pipeline[pipeline]', see README.md), or "
        f"just {package}", name=error.name)
