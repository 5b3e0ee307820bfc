"""An in-process consensus: for tests and ``mem://`` URIs.

``MemoryConsensus()`` is a fresh private store. ``MemoryConsensus(name)`` (what
``open_consensus("mem://name")`` returns) shares one store per name within the process,
so two handles opened from the same URI see the same shards. Named stores live until the
process exits.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from persist_pipeline.consensus._checks import (
    check_cas,
    check_cas_many,
    check_int,
    check_limit,
    check_shard,
)
from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.exceptions import ConsensusError, InvalidInput


class _Store:
    """The shards of one store; each shard's records have contiguous seqnos."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.shards: dict[str, list[VersionedData]] = {}


_NAMED: dict[str, _Store] = {}
_NAMED_LOCK = threading.Lock()


class MemoryConsensus(Consensus):
    """A thread-safe, linearizable consensus held in this process's memory."""

    def __init__(self, name: str | None = None) -> None:
        """Opens a store.

        Args:
            name: None for a fresh private store; otherwise the process-wide store
                called ``name``, created on first use and shared by every handle on it.

        Raises:
            InvalidInput: ``name`` is neither None nor a non-empty string.
        """
        if name is None:
            self._store = _Store()
        elif isinstance(name, str) and name:
            with _NAMED_LOCK:
                self._store = _NAMED.setdefault(name, _Store())
        else:
            raise InvalidInput(f"memory consensus name must be a non-empty str, got {name!r}")
        self._name = name
        self._closed = False

    def __repr__(self) -> str:
        return f"MemoryConsensus('mem://{self._name or ''}')"

    def _check_open(self) -> None:
        if self._closed:
            raise ConsensusError(f"{self!r} is closed")

    def _records(self, shard: str) -> list[VersionedData]:
        self._check_open()
        return self._store.shards.get(shard, [])

    def head(self, shard: str) -> VersionedData | None:
        check_shard(shard)
        with self._store.lock:
            records = self._records(shard)
            return records[-1] if records else None

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        check_shard(shard)
        check_cas(expected, new)
        with self._store.lock:
            records = self._records(shard)
            current = records[-1].seqno if records else None
            if current != expected:
                return False
            self._store.shards.setdefault(shard, records).append(new)
            return True

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        ordered = check_cas_many(writes)
        with self._store.lock:
            for write in ordered:
                records = self._records(write.shard)
                if (records[-1].seqno if records else None) != write.expected:
                    return False
            for write in ordered:
                self._store.shards.setdefault(write.shard, []).append(write.new)
            return True

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        check_shard(shard)
        check_int(from_seqno, "from_seqno", 0)
        limit = check_limit(limit)
        with self._store.lock:
            records = self._records(shard)
            if not records:
                return []
            start = max(0, from_seqno - records[0].seqno)
            end = len(records) if limit is None else start + limit
            return records[start:end]

    def truncate(self, shard: str, seqno: int) -> int:
        check_shard(shard)
        check_int(seqno, "seqno", 1)
        with self._store.lock:
            records = self._records(shard)
            head = records[-1].seqno if records else None
            if head is None or seqno > head:
                raise InvalidInput(
                    f"cannot truncate shard {shard!r} below seqno {seqno}: its head is {head}"
                )
            count = max(0, seqno - records[0].seqno)
            del records[:count]
            return count

    def list_shards(self) -> list[str]:
        with self._store.lock:
            self._check_open()
            return sorted(s for s, records in self._store.shards.items() if records)

    def list_heads(self) -> Mapping[str, VersionedData]:
        with self._store.lock:
            self._check_open()
            return {
                shard: VersionedData(records[-1].seqno, b"", records[-1].summary)
                for shard, records in sorted(self._store.shards.items())
                if records
            }

    def close(self) -> None:
        """Closes this handle (a named store keeps its data for other handles)."""
        self._closed = True
