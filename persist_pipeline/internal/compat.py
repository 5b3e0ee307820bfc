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

from persist_pipeline.exceptions import VersionMismatch

__all__ = ["check_same_code", "code_fingerprint"]


@functools.cache
def code_fingerprint() -> str:
    """This process's persist-pipeline: its version and a digest of its state format
    (the protobuf schema, which changes whenever a recorded field is added)."""
    from persist_pipeline import __version__
    from persist_pipeline.proto import persist_pb2

    digest = hashlib.sha256(persist_pb2.DESCRIPTOR.serialized_pb).hexdigest()[:12]
    return f"{__version__}+{digest}"


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
