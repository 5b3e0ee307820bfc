"""An in-process blob store, for tests and the embedded default.

``mem://`` opens a private, empty store. ``mem://NAME`` opens the store registered
under ``NAME`` in this process, creating it on first use, so every handle opened with
the same name (in the same process) sees the same objects. Nothing survives the process.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

from persist_pipeline.blob._uri import parse_query, split_uri
from persist_pipeline.blob.base import (
    Blob,
    BlobMeta,
    validate_key,
    validate_prefix,
    validate_range,
    validate_value,
)
from persist_pipeline.exceptions import InvalidUri

_NAME_RE = re.compile(r"^[A-Za-z0-9._~-]+(?:/[A-Za-z0-9._~-]+)*$")


class _Store:
    """The objects of one memory store: a dict guarded by a lock."""

    __slots__ = ("lock", "objects")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, tuple[bytes, float]] = {}


_REGISTRY: dict[str, _Store] = {}
_REGISTRY_LOCK = threading.Lock()


def _shared_store(name: str) -> _Store:
    with _REGISTRY_LOCK:
        store = _REGISTRY.get(name)
        if store is None:
            store = _REGISTRY[name] = _Store()
        return store


def forget_shared(name: str | None = None) -> None:
    """Drop the named shared store (all of them if ``name`` is None).

    Handles already open keep their objects; the next ``mem://NAME`` starts empty.
    """
    with _REGISTRY_LOCK:
        if name is None:
            _REGISTRY.clear()
        else:
            _REGISTRY.pop(name, None)


class MemoryBlob(Blob):
    """A thread-safe blob store held in a dict.

    Args:
        name: share the process-wide store of this name; None for a private store.
    """

    kind = "mem"

    def __init__(self, name: str | None = None) -> None:
        if name is not None and not _NAME_RE.match(name):
            raise InvalidUri(
                f"memory blob name must be letters, digits, '._~-' and '/': {name!r}"
            )
        self._name = name
        self._store = _shared_store(name) if name is not None else _Store()

    @classmethod
    def from_uri(cls, uri: str) -> MemoryBlob:
        """Open ``mem://`` (private) or ``mem://NAME`` (shared within the process).

        Raises:
            InvalidUri: if the URI is malformed or has query parameters.
        """
        parts = split_uri(uri, "mem")
        parse_query(parts, frozenset(), uri)
        name = (parts.netloc + parts.path).strip("/")
        return cls(name or None)

    @property
    def name(self) -> str | None:
        """The shared store's name, None for a private store."""
        return self._name

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or None if there is none."""
        validate_key(key)
        with self._store.lock:
            entry = self._store.objects.get(key)
        return None if entry is None else entry[0]

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """``length`` bytes at ``start`` of the value at ``key``."""
        validate_key(key)
        validate_range(start, length)
        with self._store.lock:
            entry = self._store.objects.get(key)
        return None if entry is None else entry[0][start:start + length]

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key`` (replacing any previous value)."""
        validate_key(key)
        data = validate_value(value)
        with self._store.lock:
            self._store.objects[key] = (data, time.time())

    def delete(self, key: str) -> int | None:
        """Delete ``key``; returns its size, or None if it did not exist."""
        validate_key(key)
        with self._store.lock:
            entry = self._store.objects.pop(key, None)
        return None if entry is None else len(entry[0])

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """Every object whose key starts with ``prefix``, in key order (a snapshot)."""
        validate_prefix(prefix)
        with self._store.lock:
            found = [
                BlobMeta(key, len(data), mtime)
                for key, (data, mtime) in self._store.objects.items()
                if key.startswith(prefix)
            ]
        found.sort(key=lambda meta: meta.key)
        return iter(found)

    def location(self) -> tuple[str, str]:
        if self._name is None:
            return super().location()  # private: shared with no other store
        return "mem", self._name

    def describe(self) -> str:
        """``mem://NAME``, or ``mem:// (private)``."""
        return f"mem://{self._name}" if self._name is not None else "mem:// (private)"

    def __repr__(self) -> str:
        return f"MemoryBlob({self.describe()!r})"
