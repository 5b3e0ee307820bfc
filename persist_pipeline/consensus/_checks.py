"""Argument checks shared by every consensus backend.

Each check raises :class:`~persist_pipeline.exceptions.InvalidInput` before anything is
sent to a backend, so a rejected call never changes a shard.
"""

from __future__ import annotations

from collections.abc import Sequence

from persist_pipeline.consensus.base import CasWrite, VersionedData
from persist_pipeline.exceptions import InvalidInput

#: The largest seqno a record may have (a signed 64-bit ``BIGINT``).
MAX_SEQNO = 2**63 - 1


def check_shard(shard: object) -> str:
    """Returns ``shard`` if it is a non-empty string without NUL characters."""
    if type(shard) is str and shard and "\x00" not in shard:
        return shard  # the usual case, decided without the checks that explain a refusal
    if not isinstance(shard, str):
        raise InvalidInput(f"shard must be a str, got {type(shard).__name__}")
    if not shard:
        raise InvalidInput("shard must be a non-empty string")
    if "\x00" in shard:
        raise InvalidInput("shard must not contain NUL characters")
    return shard


def check_int(value: object, what: str, minimum: int) -> int:
    """Returns ``value`` if it is an int (not a bool) in ``[minimum, MAX_SEQNO]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{what} must be an int, got {type(value).__name__}")
    if not minimum <= value <= MAX_SEQNO:
        raise InvalidInput(f"{what} must be in [{minimum}, {MAX_SEQNO}], got {value}")
    return value


def check_limit(limit: object) -> int | None:
    """Returns ``limit`` if it is None or a non-negative int."""
    if limit is None:
        return None
    return check_int(limit, "limit", 0)


def check_cas(expected: object, new: object) -> None:
    """Checks the arguments of ``compare_and_set``.

    ``expected`` is None or a seqno >= 1, ``new`` a :class:`VersionedData` with bytes
    ``data`` and ``summary`` whose seqno is ``expected + 1`` (1 when ``expected`` is None).
    """
    if (type(expected) is int and type(new) is VersionedData and type(new.data) is bytes
            and type(new.summary) is bytes and type(new.seqno) is int
            and 1 <= expected < MAX_SEQNO and new.seqno == expected + 1):
        return  # the usual case, decided without the checks that explain a refusal
    previous = None if expected is None else check_int(expected, "expected", 1)
    if not isinstance(new, VersionedData):
        raise InvalidInput(f"new must be a VersionedData, got {type(new).__name__}")
    check_int(new.seqno, "new.seqno", 1)
    want = 1 if previous is None else previous + 1
    if new.seqno != want:
        raise InvalidInput(f"new.seqno must be {want} when expected is {expected}, got {new.seqno}")
    for field in ("data", "summary"):
        value = getattr(new, field)
        if not isinstance(value, bytes):
            raise InvalidInput(f"new.{field} must be bytes, got {type(value).__name__}")


def check_cas_many(writes: object) -> list[CasWrite]:
    """Checks the argument of ``compare_and_set_many``: a non-empty sequence of
    :class:`CasWrite` to distinct shards (``expected >= 1``, or None for a shard's first
    record); returns it sorted
    by shard, the order every backend takes locks in, so two overlapping multi-shard
    commits never wait for each other in a cycle."""
    if not isinstance(writes, Sequence) or isinstance(writes, str | bytes):
        raise InvalidInput(f"writes must be a sequence of CasWrite, got {type(writes).__name__}")
    if not writes:
        raise InvalidInput("compare_and_set_many needs at least one write")
    seen: set[str] = set()
    for write in writes:
        if not isinstance(write, CasWrite):
            raise InvalidInput(f"writes must hold CasWrite, got {type(write).__name__}")
        check_shard(write.shard)
        if write.shard in seen:
            raise InvalidInput(f"shard {write.shard!r} appears twice in one multi-shard commit")
        seen.add(write.shard)
        if write.expected is not None:
            check_int(write.expected, "expected", 1)
        check_cas(write.expected, write.new)
    return sorted(writes, key=lambda w: w.shard)
