"""CRC-32 of blob bytes: recorded when a part or rollup is written, checked when it is
read whole (and, of a part's Parquet footer, recorded beside it and checked when the
footer is read alone: :func:`~persist_pipeline.internal.blobs.read_footer`), so that
bytes changed in the store after the write (rot, truncation, an object replaced or
swapped) raise :class:`~persist_pipeline.exceptions.ChecksumMismatch` instead of
decoding into wrong rows or a wrong state.

zlib's CRC-32 runs at several GB/s here, a few percent of decoding the same Parquet.
It guards against accidents, not against an adversary who can write the store (who
could write a matching CRC as easily as the bytes).
"""

from __future__ import annotations

import zlib

from persist_pipeline.exceptions import ChecksumMismatch

__all__ = ["check", "crc32", "matches"]


def crc32(data: bytes | bytearray | memoryview) -> int:
    """The CRC-32 recorded for ``data`` (an unsigned 32-bit integer)."""
    return zlib.crc32(data) & 0xFFFFFFFF


def matches(data: bytes | bytearray | memoryview, expected: int | None) -> bool:
    """Whether ``data``'s CRC-32 is ``expected`` (None: nothing was recorded, as for
    blobs written before checksums were, so nothing to check)."""
    return expected is None or crc32(data) == expected


def check(data: bytes | bytearray | memoryview, expected: int | None, described: str,
          error: type[ChecksumMismatch]) -> None:
    """Raise ``error`` naming ``described`` unless ``data`` :func:`matches`
    ``expected``."""
    if expected is None:
        return
    found = crc32(data)
    if found != expected:
        raise error(f"{described}: its {len(data)} bytes have CRC-32 {found:08x}, "
                    f"{expected:08x} recorded when it was written; the stored object "
                    "changed after the write (rot, truncation, or another object put "
                    "under its key)")
