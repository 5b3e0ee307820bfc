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
from pathlib import Path

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
    digest.update(source_digest(Path(__file__).resolve().parents[1]).encode())
    return f"{__version__}+{digest.hexdigest()[:12]}"


def source_digest(package: Path) -> str:
    """A digest of the Python sources under ``package`` (their paths and bytes): equal
    for two installs of the same release, different for a changed file. Computed once
    per process (about 100 files)."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


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
