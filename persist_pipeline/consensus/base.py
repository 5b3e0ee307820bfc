"""The consensus interface: a linearizable, versioned log of small records per shard."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from persist_pipeline.internal.records import quick_init


@quick_init
@dataclass(frozen=True, slots=True)
class VersionedData:
    """One consensus record.

    Attributes:
        seqno: the record's sequence number; a shard's records are numbered 1, 2, 3, ...
        data: the opaque payload (an encoded state diff).
        summary: a small opaque per-shard summary written with the record, returned by
            :meth:`Consensus.list_heads` so monitoring never has to read whole states.
    """

    seqno: int
    data: bytes
    summary: bytes = b""


@quick_init
@dataclass(frozen=True, slots=True)
class CasWrite:
    """One shard's part of :meth:`Consensus.compare_and_set_many`: append ``new`` iff
    the shard's head seqno is ``expected`` (None: the shard has no record yet, and
    ``new`` is its first, seqno 1)."""

    shard: str
    expected: int | None
    new: VersionedData


class Consensus(ABC):
    """A set of shards, each a sequence of :class:`VersionedData` changed only by CaS.

    Implementations must be linearizable per shard: of all concurrent
    ``compare_and_set`` calls with the same ``expected`` seqno, at most one returns True.
    Errors are raised as :class:`~persist_pipeline.exceptions.ConsensusError` subclasses;
    a :class:`~persist_pipeline.exceptions.ConsensusUnavailable` from
    ``compare_and_set`` means the outcome is unknown (the write may have committed).
    """

    @abstractmethod
    def head(self, shard: str) -> VersionedData | None:
        """The record with the highest seqno, or None if the shard has no records."""

    @abstractmethod
    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        """Append ``new`` iff the shard's head seqno is ``expected`` (None: no records).

        ``new.seqno`` must be ``expected + 1`` (or 1 when ``expected`` is None), else
        :class:`~persist_pipeline.exceptions.InvalidInput` is raised. Returns True if
        ``new`` was written, False if the head did not match. One round trip.
        """

    @abstractmethod
    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        """Append every write's ``new`` iff every shard's head seqno is its ``expected``.

        All or nothing, in one round trip: either every record is written or none is,
        and a reader of any of the shards sees either all of them or none. The shards
        must be distinct, else :class:`~persist_pipeline.exceptions.InvalidInput` is
        raised; a write with ``expected`` None creates its shard (its first record,
        seqno 1), only if the shard has no record at all, as :meth:`compare_and_set`
        does. Returns False (writing nothing) if any head did not match. A
        :class:`~persist_pipeline.exceptions.ConsensusUnavailable` means the outcome is
        unknown, as for :meth:`compare_and_set`; the record at ``expected + 1`` (1 for
        a created shard) of any one shard settles it for all of them.
        """

    @abstractmethod
    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        """Records with ``seqno >= from_seqno`` in ascending order, at most ``limit``."""

    @abstractmethod
    def truncate(self, shard: str, seqno: int) -> int:
        """Delete records with ``seqno < seqno``; returns how many were deleted.

        Raises :class:`~persist_pipeline.exceptions.InvalidInput` if ``seqno`` is above
        the head (the head record is never deleted).
        """

    @abstractmethod
    def list_shards(self) -> list[str]:
        """Every shard that has at least one record."""

    @abstractmethod
    def list_heads(self) -> Mapping[str, VersionedData]:
        """Each shard's head record with ``data`` left empty (only seqno and summary).

        One query whatever the number of shards or the size of their records.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Idempotent."""

    def __enter__(self) -> Consensus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
