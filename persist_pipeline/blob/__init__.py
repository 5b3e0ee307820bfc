"""Blob stores: immutable values under ``/``-separated keys.

Open one by URI with :func:`open_blob`:

* ``mem://`` (private) or ``mem://NAME`` (shared within the process): :class:`MemoryBlob`;
* ``file:///absolute/dir``: :class:`LocalBlob`;
* ``s3://bucket/prefix?endpoint_url=...&region=...``: :class:`S3Blob`.

Wrappers: :class:`CachingBlob` (an LRU of values) and :class:`FaultyBlob` (seeded
fault injection for tests).
"""

from __future__ import annotations

from typing import Any

from persist_pipeline.blob._uri import redact_uri
from persist_pipeline.blob.base import (
    Blob,
    BlobMeta,
    validate_key,
    validate_prefix,
    validate_value,
)
from persist_pipeline.blob.cache import CachingBlob
from persist_pipeline.blob.faults import FaultConfig, FaultyBlob
from persist_pipeline.blob.local import LocalBlob
from persist_pipeline.blob.memory import MemoryBlob
from persist_pipeline.exceptions import InvalidConfig, InvalidUri

__all__ = [
    "SUPPORTED_SCHEMES",
    "Blob",
    "BlobMeta",
    "CachingBlob",
    "FaultConfig",
    "FaultyBlob",
    "LocalBlob",
    "MemoryBlob",
    "S3Blob",
    "check_blob_uri",
    "open_blob",
    "redact_uri",
    "validate_key",
    "validate_prefix",
    "validate_value",
]

#: The URI schemes :func:`open_blob` understands.
SUPPORTED_SCHEMES = ("mem", "file", "s3")

_EXAMPLES = "mem://NAME, file:///absolute/dir, s3://bucket/prefix?endpoint_url=..."


def open_blob(uri: str, *, cache_bytes: int = 0, create: bool = True) -> Blob:
    """Open the blob store a URI names.

    Args:
        uri: a ``mem://``, ``file://`` or ``s3://`` URI (see the package docstring).
        cache_bytes: when positive, wrap the store in a :class:`CachingBlob` of that many
            bytes.
        create: create a missing ``file://`` directory. False: it must exist, and
            nothing is created (S3 buckets are never created; ``mem://`` stores live in
            the process).

    Returns:
        The store.

    Raises:
        InvalidUri: if the URI is not a string, is empty, names another scheme or is
            malformed for its scheme; the message never quotes secrets.
        InvalidConfig: if ``cache_bytes`` is negative.
        BlobLocationNotFound: ``create=False`` and the ``file://`` directory is missing.
    """
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise InvalidConfig(f"cache_bytes must be a non-negative int, got {cache_bytes!r}")
    blob = _from_uri(uri, dry=False, create=create)
    assert blob is not None
    return CachingBlob(blob, cache_bytes) if cache_bytes else blob


def check_blob_uri(uri: str) -> None:
    """Raise what :func:`open_blob` would for a malformed ``uri``, creating nothing (no
    folder is made, no connection opened)."""
    _from_uri(uri, dry=True)


def _from_uri(uri: str, *, dry: bool, create: bool = True) -> Blob | None:
    if not isinstance(uri, str):
        raise InvalidUri(f"blob URI must be a str, got {type(uri).__name__}")
    if any(ord(c) < 32 or ord(c) == 127 for c in uri):
        raise InvalidUri("blob URI contains control characters (NUL, newline, ...); "
                         f"supported: {_EXAMPLES}")
    text = uri.strip()
    if not text:
        raise InvalidUri(f"blob URI is empty; supported: {_EXAMPLES}")
    scheme, sep, _ = text.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SUPPORTED_SCHEMES:
        raise InvalidUri(
            f"unsupported blob URI {redact_uri(text)!r}: supported schemes are "
            f"{', '.join(s + '://' for s in SUPPORTED_SCHEMES)} (e.g. {_EXAMPLES})"
        )
    if scheme == "mem":
        return MemoryBlob.from_uri(text)  # nothing outside the process
    if scheme == "file":
        if dry:
            LocalBlob.parse_uri(text)
            return None
        return LocalBlob.from_uri(text, create=create)
    from persist_pipeline.blob.s3 import S3Blob

    return S3Blob.from_uri(text)  # connects on first use only


def __getattr__(name: str) -> Any:
    # S3Blob is imported on first use: boto3 is slow to import.
    if name == "S3Blob":
        from persist_pipeline.blob.s3 import S3Blob

        return S3Blob
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
