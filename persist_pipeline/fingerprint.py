"""A snapshot's fingerprint: a digest of the collection computed while it streams.

A snapshot streams in ``(k, v)`` order, consolidated, so equal collections produce the
same rows in the same order, whatever their parts, compaction or record-batch sizes.
The fingerprint hashes that stream column by column (key lengths, key bytes, value
lengths, value bytes, diffs: each column's concatenation does not depend on where the
batches are cut), so it needs one record batch in memory, never the snapshot. Dagster's
``snapshot_unchanged`` check compares the fingerprints before and after compaction.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["SnapshotFingerprint", "fingerprint_batches"]


@dataclass(frozen=True, slots=True)
class SnapshotFingerprint:
    """What identifies a consolidated collection.

    Attributes:
        rows: distinct ``(k, v)`` with a non-zero diff.
        diff_sum: the sum of their diffs (the collection's size as a multiset).
        digest: BLAKE2b of the ordered rows (hex).
    """

    rows: int
    diff_sum: int
    digest: str


def _binary_column(array: pa.Array) -> tuple[bytes, bytes]:
    """(lengths as little-endian int64, the values' bytes) of a binary array slice."""
    array = array.cast(pa.binary())
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32)[array.offset:array.offset + len(array)
                                                         + 1]
    lengths = np.diff(offsets).astype("<i8")
    data = b"" if data_buf is None or not len(array) else \
        memoryview(data_buf)[offsets[0]:offsets[-1]].tobytes()
    return lengths.tobytes(), data


def fingerprint_batches(batches: Iterable[pa.RecordBatch | pa.Table]) -> SnapshotFingerprint:
    """The fingerprint of a snapshot given as its record batches, in order."""
    hashers = [hashlib.blake2b(digest_size=32, person=name) for name in
               (b"k-len", b"k", b"v-len", b"v", b"d")]
    rows = 0
    diff_sum = 0
    for batch in batches:
        parts = batch.to_batches() if isinstance(batch, pa.Table) else [batch]
        for part in parts:
            if not part.num_rows:
                continue
            k_len, k = _binary_column(part.column("k"))
            v_len, v = _binary_column(part.column("v"))
            d = part.column("d").to_numpy(zero_copy_only=False).astype("<i8")
            for hasher, data in zip(hashers, (k_len, k, v_len, v, d.tobytes()), strict=True):
                hasher.update(data)
            rows += part.num_rows
            # Exact: summed as 32-bit halves, which cannot overflow int64 here.
            diff_sum += (int((d >> 32).sum()) << 32) + int((d & 0xFFFFFFFF).sum())
    total = hashlib.blake2b(digest_size=32)
    for hasher in hashers:
        total.update(hasher.digest())
    return SnapshotFingerprint(rows, diff_sum, total.hexdigest())
