"""Shared test helpers: a reference model of a collection, and state-history replay."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping

import pyarrow as pa

from persist_pipeline import PersistClient
from persist_pipeline.consensus.base import Consensus, VersionedData
from persist_pipeline.internal import state_codec
from persist_pipeline.internal.state import State

Update = tuple[bytes, bytes, int, int]


def expected_snapshot(updates: Iterable[Update], as_of: int) -> list[tuple[bytes, bytes, int]]:
    """The consolidated collection at ``as_of``: sorted (k, v, diff) with diff != 0."""
    sums: dict[tuple[bytes, bytes], int] = defaultdict(int)
    for k, v, t, d in updates:
        if t <= as_of:
            sums[(k, v)] += d
    return sorted((k, v, d) for (k, v), d in sums.items() if d != 0)


def rows(table: pa.Table, as_of: int | None = None) -> list[tuple[bytes, bytes, int]]:
    """A snapshot table as sorted (k, v, diff), checking every time equals ``as_of``."""
    out = []
    for r in table.to_pylist():
        if as_of is not None:
            assert r["t"] == as_of
        out.append((r["k"], r["v"], r["d"]))
    return sorted(out)


def state_history(client: PersistClient, shard: str) -> Iterator[State]:
    """Every state version still in consensus, rebuilt record by record."""
    consensus = client.consensus
    records = consensus.scan(shard, 0)
    if not records:
        return
    first = records[0].seqno
    if first == 1:
        state = State(shard_id=shard)
    else:
        # GC keeps a rollup at the earliest live record.
        rollup = client.machine(shard).fetch_latest().rollups[first]
        data = client.blobs.main.get(rollup.key)
        assert data is not None, f"no rollup at earliest record {first}"
        state = state_codec.decode_state(data, "test")
        yield state
    for rec in records:
        if rec.seqno <= state.seqno:
            continue
        where = f"seqno {rec.seqno}"
        state = state_codec.apply_diff(state, state_codec.decode_diff(rec.data, where), where)
        yield state


class ForwardingConsensus(Consensus):
    """A consensus wrapper that passes every call to ``inner``; test wrappers override
    the calls they interfere with."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner

    def head(self, shard: str) -> VersionedData | None:
        return self.inner.head(shard)

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        return self.inner.compare_and_set(shard, expected, new)

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        return self.inner.scan(shard, from_seqno, limit)

    def truncate(self, shard: str, seqno: int) -> int:
        return self.inner.truncate(shard, seqno)

    def list_shards(self) -> list[str]:
        return self.inner.list_shards()

    def list_heads(self) -> Mapping[str, VersionedData]:
        return self.inner.list_heads()

    def close(self) -> None:
        self.inner.close()
