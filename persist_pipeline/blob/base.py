"""The blob interface: an immutable key-value object store (S3, a directory, memory)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from persist_pipeline.exceptions import BlobError, ClockProbeLost, InvalidInput

#: Characters no key or listing prefix may contain.
_FORBIDDEN_CHARS = ("\x00", "\\")


def validate_key(key: str) -> str:
    """Check ``key`` against the rules of :class:`Blob` and return it unchanged.

    A key is a non-empty string of ``/``-separated segments with no leading ``/``, no
    empty, ``.`` or ``..`` segment (so no ``//`` and no trailing ``/``), and no NUL or
    backslash.

    Args:
        key: the key to check.

    Returns:
        ``key`` itself.

    Raises:
        InvalidInput: if ``key`` is not a string or breaks a rule.
    """
    if not isinstance(key, str):
        raise InvalidInput(f"blob key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidInput("blob key must not be empty")
    _check_chars(key, "key")
    if key.startswith("/"):
        raise InvalidInput(f"blob key must be relative (no leading '/'): {key!r}")
    for segment in key.split("/"):
        _check_segment(segment, key, "key")
    return key


def validate_prefix(prefix: str) -> str:
    """Check a listing prefix and return it unchanged.

    A prefix is ``""`` or the beginning of a valid key: the same rules as
    :func:`validate_key`, except that its last segment may be partial (any text,
    including empty, so ``"a/"`` and ``"a/.."`` are accepted: they only filter).

    Args:
        prefix: the prefix to check.

    Returns:
        ``prefix`` itself.

    Raises:
        InvalidInput: if ``prefix`` is not a string or cannot begin any valid key.
    """
    if not isinstance(prefix, str):
        raise InvalidInput(f"blob prefix must be a str, got {type(prefix).__name__}")
    _check_chars(prefix, "prefix")
    if prefix.startswith("/"):
        raise InvalidInput(f"blob prefix must be relative (no leading '/'): {prefix!r}")
    for segment in prefix.split("/")[:-1]:
        _check_segment(segment, prefix, "prefix")
    return prefix


def _check_chars(text: str, what: str) -> None:
    for char in _FORBIDDEN_CHARS:
        if char in text:
            raise InvalidInput(f"blob {what} must not contain NUL or backslash: {text!r}")


def _check_segment(segment: str, text: str, what: str) -> None:
    if segment in ("", ".", ".."):
        raise InvalidInput(
            f"blob {what} must not have an empty, '.' or '..' segment: {text!r}"
        )


@dataclass(frozen=True, slots=True)
class BlobMeta:
    """What a listing says of one object.

    Attributes:
        key: the object's key, relative to the store's root/prefix.
        size: its size in bytes.
        last_modified: seconds since the epoch when it was written (store's clock).
        etag: a tag of its content where the store keeps one (S3's ETag), else "".
    """

    key: str
    size: int
    last_modified: float
    etag: str = ""


class Blob(ABC):
    """An object store holding immutable values under ``/``-separated keys.

    Keys are relative to the store's root (for S3, the URI's prefix). A key is
    non-empty, has no leading ``/``, no empty, ``.`` or ``..`` segments and no NUL or
    backslash; anything else raises :class:`~persist_pipeline.exceptions.InvalidInput`.
    Errors are raised as :class:`~persist_pipeline.exceptions.BlobError` subclasses.
    """

    #: "s3", "file", "mem", ... for metrics and messages.
    kind: str = "blob"
    #: How coarsely the store stamps ``last_modified`` (rounded down): an object may be
    #: up to this much younger than its stamp says. S3's listings give whole seconds.
    stamp_resolution_s: float = 0.0

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or None if there is none."""

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """``length`` bytes of the value at ``key`` from offset ``start`` (fewer at its
        end), or None if there is none.

        Streaming reads use it to hold one Parquet row group, not a whole part. This
        default fetches the whole value; stores that can read a range override it.
        """
        validate_range(start, length)
        value = self.get(key)
        return None if value is None else value[start:start + length]

    def local_file(self, key: str) -> str | None:
        """The path of a file on this machine holding the value at ``key``, if the store
        keeps its values as files (a local folder), else None.

        Streaming reads of a large part open it natively (no Python on the read path);
        values are immutable, so the file is the value. None does not mean missing.
        """
        return None

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` at ``key`` atomically: a reader sees all of it or nothing."""

    @abstractmethod
    def delete(self, key: str) -> int | None:
        """Delete ``key``; returns the deleted size if known, None if it did not exist."""

    @abstractmethod
    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """Every object whose key starts with ``prefix``."""

    def sweep_partial_writes(self, prefix: str, stamped_before: float) -> int:
        """Delete what writes that died left under ``prefix`` and that no key names (a
        local folder's temporary files), stamped before ``stamped_before`` on the
        store's own clock (:meth:`clock_now`); returns how many. GC's orphan sweep calls
        it with its cutoff: nothing else ever deletes them, since no listing shows them.

        Default: nothing (a store whose writes leave nothing behind, such as S3's
        single-request PUT).
        """
        return 0

    def clock_now(self, probe_key: str) -> float:
        """The store's current time, on the clock that stamps ``last_modified``.

        GC measures blob ages with it, so that an age never mixes the store's clock
        with the caller's (guarantee: the orphan sweep is safe under clock skew). This
        writes an empty probe object at ``probe_key`` (fresh; where an orphan sweep
        finds it if this process dies before deleting it), reads its stamp from a
        listing and deletes it: ``last_modified`` is whatever the store stamps on a
        write, so this is exactly the clock it is compared with. Stamps may be rounded
        down (:attr:`stamp_resolution_s`); callers allow for that.

        Raises:
            ClockProbeLost: the probe was swept before it was listed (a long pause).
            BlobError: the probe could not be written or listed.
        """
        key = probe_key
        self.set(key, b"")
        try:
            stamps = [m.last_modified for m in self.list_keys(key) if m.key == key]
        finally:
            with contextlib.suppress(BlobError):
                self.delete(key)
        if not stamps:
            raise ClockProbeLost(f"{self.describe()}: the clock probe written at {key} was "
                                 f"gone before it was listed")
        return stamps[0]

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients. Idempotent."""

    def describe(self) -> str:
        """A human-readable location with credentials removed, for logs and errors."""
        return self.kind

    def location(self) -> tuple[str, str]:
        """Where the keys live: a namespace (a file system, a bucket at an endpoint, a
        named memory store) and a ``/``-separated path in it. Two stores whose paths
        nest in one namespace share keys (:func:`stores_overlap`). A store that cannot
        tell is its own namespace."""
        return f"{type(self).__name__}@{id(self):x}", ""


def validate_range(start: int, length: int) -> None:
    """Check the byte range of :meth:`Blob.get_range`.

    Raises:
        InvalidInput: ``start`` or ``length`` is not a non-negative int.
    """
    for name, value in (("start", start), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInput(f"blob range {name} must be a non-negative int, got {value!r}")


def validate_value(value: bytes) -> bytes:
    """Check a value to store and return it as immutable ``bytes``.

    ``bytearray`` and ``memoryview`` are accepted and copied, so a caller mutating its
    buffer later cannot change what was stored.

    Args:
        value: the value to store.

    Returns:
        ``value`` as ``bytes``.

    Raises:
        InvalidInput: if ``value`` is not bytes-like.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise InvalidInput(f"blob value must be bytes, got {type(value).__name__}")


def stores_overlap(a: Blob, b: Blob) -> bool:
    """Whether two stores can hold the same keys: one namespace, and one path inside
    (or equal to) the other."""
    (space_a, path_a), (space_b, path_b) = a.location(), b.location()
    if space_a != space_b:
        return False
    path_a, path_b = path_a.strip("/"), path_b.strip("/")
    return (not path_a or not path_b or path_a == path_b
            or path_a.startswith(path_b + "/") or path_b.startswith(path_a + "/"))
