"""The error an integration raises when the optional package it needs is missing."""

from __future__ import annotations


def missing_extra(what: str, extra: str, package: str,
                  error: ModuleNotFoundError) -> ModuleNotFoundError:
    """A ``ModuleNotFoundError`` for ``error`` that says what to install, not only what
    is missing: ``what`` needs ``package``, which the library's ``extra`` extra (one of
    pyproject.toml's optional-dependencies) brings."""
    # The package is not on a package index: the hint installs from a clone or a built
    # wheel, never a `pip install persist-pipeline[...]` that would look the name up there.
    return ModuleNotFoundError(
        f"{what}, which is not installed ({error}): install the library with its {extra} "
        f"extra (pip install '/path/to/persist-pipeline[{extra}]', see README.md), or "
        f"just {package}", name=error.name)
