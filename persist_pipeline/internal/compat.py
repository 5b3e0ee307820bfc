"""What a Spark driver and its executors must share to exchange tasks and results: the
same persist-pipeline. Tasks carry the driver's :func:`code_fingerprint`, executors
return theirs, and each side refuses the other's on a mismatch.

Why: tasks, parts and merge results cross between processes as pickled dataclasses,
which an older or newer version decodes field by field without complaint (a field it
does not know is dropped, one it expects is left unset), and as Parquet parts of its
own encoding. A cluster whose workers were not upgraded with the driver would write
parts the driver cannot describe, or drop what the driver records (their CRC-32s):
refused with :class:`VersionMismatch` naming both versions, before anything is used.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
from collections.abc import Iterator
from importlib.resources.abc import Traversable

from persist_pipeline.exceptions import VersionMismatch

__all__ = ["check_same_code", "code_fingerprint", "source_digest"]


@functools.cache
def code_fingerprint() -> str:
    """This process's persist-pipeline: its version and a digest of its code (the state
    format, the protobuf schema, which changes whenever a recorded field is added, and
    the package's Python sources, which define what crosses between processes pickled:
    a dataclass can change within one version number)."""
    from persist_pipeline import __version__
    from persist_pipeline.proto import persist_pb2

    digest = hashlib.sha256(persist_pb2.DESCRIPTOR.serialized_pb)
    digest.update(source_digest(importlib.resources.files("persist_pipeline")).encode())
    return f"{__version__}+{digest.hexdigest()[:12]}"


def source_digest(package: Traversable) -> str:
    """A digest of the Python sources under ``package`` (their paths and bytes): equal
    for two installs of the same release, whether a folder or a zip (Spark's
    ``--py-files``), different for a changed file. About 100 files: a few ms, computed
    once per process."""
    digest = hashlib.sha256()
    for name, source in sorted(_sources(package, "")):
        digest.update(name.encode() + b"\0")
        digest.update(source.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def _sources(folder: Traversable, prefix: str) -> Iterator[tuple[str, Traversable]]:
    for entry in folder.iterdir():
        if entry.is_dir():
            if entry.name != "__pycache__":
                yield from _sources(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith(".py"):
            yield f"{prefix}{entry.name}", entry


def check_same_code(theirs: str | None, other: str, here: str) -> None:
    """Raise :class:`VersionMismatch` unless ``theirs`` (the ``other`` side's
    fingerprint; None or empty from a version that sent none) is this process's; ``here``
    names this side (the driver, an executor)."""
    mine = code_fingerprint()
    if theirs != mine:
        raise VersionMismatch(
            f"the {other} runs persist-pipeline {theirs or 'of a version that does not say'}, "
            f"the {here} {mine}: Spark's driver and executors must run the same version "
            "(install the driver's on the cluster's workers, or use a session whose "
            "workers run this Python environment); nothing was written")
