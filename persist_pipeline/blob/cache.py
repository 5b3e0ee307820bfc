"""An LRU cache of blob values, for stores whose keys are written once (immutable).

Persist writes every part under a fresh key and never rewrites it, so a fetched value
can be kept until memory is needed. The cache is still safe for overwrites and deletes
made *through it*: a mutation invalidates the key first, and a value fetched or written
concurrently with a mutation of the same key is not cached (see
:meth:`CachingBlob._admit`). Writes by other processes to an existing key are not seen
while the old value is cached: that is what "immutable keys" buys.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from persist_pipeline.blob.base import (
    Blob,
    BlobMeta,
    validate_key,
    validate_range,
    validate_value,
)
from persist_pipeline.exceptions import InvalidConfig
from persist_pipeline.internal import checksum


class CachingBlob(Blob):
    """Wraps a blob store with a byte-bounded, thread-safe LRU cache of values.

    ``get`` serves hits from memory and caches misses that found a value (never None);
    ``set`` writes through and caches the value when ``cache_on_set``; ``delete``
    invalidates; ``list_keys`` always asks the inner store. Values larger than
    ``max_bytes`` are never cached.

    Attributes:
        hits: gets answered from the cache.
        misses: gets that went to the inner store.
        evictions: values dropped to make room.

    Args:
        inner: the store to cache.
        max_bytes: the most value bytes to hold (0 disables caching).
        cache_on_set: also cache values as they are written.

    Raises:
        InvalidConfig: if ``max_bytes`` is negative or not an int.
    """

    def __init__(self, inner: Blob, max_bytes: int, *, cache_on_set: bool = True) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidConfig(f"cache max_bytes must be a non-negative int, got {max_bytes!r}")
        self.inner = inner
        self.kind = inner.kind
        self.stamp_resolution_s = inner.stamp_resolution_s
        self.max_bytes = max_bytes
        self.cache_on_set = cache_on_set
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._lock = threading.Lock()
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        # Bumped by every mutation; a fetch started before a bump must not be cached.
        self._epoch = 0
        # Mutations of a key in flight: while any is, nothing is cached for the key.
        self._inflight: dict[str, int] = {}
        # The CRC-32 each held value was found to have by held_matching: a held value
        # never changes, so it is checked once, not on every read of it.
        self._checked: dict[str, int] = {}

    @property
    def cached_bytes(self) -> int:
        """The bytes held by the cache now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._values

    def clear(self) -> None:
        """Drop every cached value (counters are kept)."""
        with self._lock:
            self._values.clear()
            self._checked.clear()
            self._bytes = 0
            self._epoch += 1

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, from the cache when it holds it."""
        validate_key(key)
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
                self.hits += 1
                return value
            self.misses += 1
            epoch = self._epoch
        value = self.inner.get(key)
        if value is not None:
            with self._lock:
                self._admit(key, value, epoch)
        return value

    def held_matching(self, key: str, crc32: int | None) -> bytes | None:
        """``key``'s cached value if its CRC-32 is ``crc32`` (None: nothing recorded to
        check), else None; a held value that does not match is dropped, so the next read
        goes to the inner store. Each held value is checked once."""
        with self._lock:
            value = self._values.get(key)
            if value is None or crc32 is None or self._checked.get(key) == crc32:
                return value
        ok = checksum.matches(value, crc32)  # outside the lock: a few ms for a large part
        with self._lock:
            if self._values.get(key) is value:
                if ok:
                    self._checked[key] = crc32
                else:
                    self._drop(key)
        return value if ok else None

    def forget(self, key: str) -> None:
        """Drop ``key``'s cached value, if any: a reader found it is not the value
        written (its checksum failed), so the next read goes to the inner store."""
        with self._lock:
            self._drop(key)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """A range of the cached value when the cache holds it, else of the inner store
        (ranges are not admitted: streaming reads must not evict whole parts)."""
        validate_key(key)
        validate_range(start, length)
        with self._lock:
            value = self._values.get(key)
        if value is not None:
            return value[start:start + length]
        return self.inner.get_range(key, start, length)

    def local_file(self, key: str) -> str | None:
        """The inner store's file for ``key`` (values are immutable: it is the value)."""
        return self.inner.local_file(key)

    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` through to the inner store (and cache it when enabled)."""
        validate_key(key)
        data = validate_value(value)
        epoch = self._begin_mutation(key)
        try:
            self.inner.set(key, data)
        finally:
            with self._lock:
                self._end_mutation(key)
        if self.cache_on_set:
            with self._lock:
                self._admit(key, data, epoch)

    def delete(self, key: str) -> int | None:
        """Delete ``key`` in the inner store and from the cache."""
        validate_key(key)
        self._begin_mutation(key)
        try:
            return self.inner.delete(key)
        finally:
            with self._lock:
                self._end_mutation(key)

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """The inner store's listing (never cached)."""
        return self.inner.list_keys(prefix)

    def sweep_partial_writes(self, prefix: str, stamped_before: float) -> int:
        """The inner store's (nothing it deletes was ever a value, so never cached)."""
        return self.inner.sweep_partial_writes(prefix, stamped_before)

    def close(self) -> None:
        """Drop the cache and close the inner store."""
        self.clear()
        self.inner.close()

    def location(self) -> tuple[str, str]:
        return self.inner.location()

    def describe(self) -> str:
        """The inner store's description, noting the cache."""
        return f"{self.inner.describe()} (LRU cache {self.max_bytes} bytes)"

    def __repr__(self) -> str:
        return f"CachingBlob({self.inner!r}, max_bytes={self.max_bytes})"

    # --- internals (callers hold no lock unless stated) -----------------------------------

    def _begin_mutation(self, key: str) -> int:
        with self._lock:
            self._drop(key)
            self._epoch += 1
            self._inflight[key] = self._inflight.get(key, 0) + 1
            return self._epoch

    def _end_mutation(self, key: str) -> None:
        """Called with the lock held."""
        remaining = self._inflight[key] - 1
        if remaining:
            self._inflight[key] = remaining
        else:
            del self._inflight[key]
        # A concurrent get may have cached the old value between begin and here.
        self._drop(key)

    def _admit(self, key: str, value: bytes, epoch: int) -> None:
        """Cache ``value`` unless the key changed since ``epoch``. Called with the lock held.

        A value is admitted only if no mutation began after the caller's read or write
        started (``epoch`` is still current) and none of the key is still in flight, so
        a stale value can never be cached over a newer one.
        """
        size = len(value)
        if size > self.max_bytes or epoch != self._epoch or key in self._inflight:
            return
        self._drop(key)
        while self._bytes + size > self.max_bytes and self._values:
            evicted_key, evicted = self._values.popitem(last=False)
            self._checked.pop(evicted_key, None)
            self._bytes -= len(evicted)
            self.evictions += 1
        self._values[key] = value
        self._bytes += size

    def _drop(self, key: str) -> None:
        """Forget ``key``. Called with the lock held."""
        old = self._values.pop(key, None)
        self._checked.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
