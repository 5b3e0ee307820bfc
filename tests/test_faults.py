"""Writes, reads, compaction and GC through unreliable backends (Materialize-style).

Every consensus and blob call fails 5% of the time before running and 5% of the time
after running (the lost reply). Nothing acknowledged may be lost or doubled, and nothing
live may be deleted.
"""

from __future__ import annotations

import random

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.blob import FaultConfig, FaultyBlob, open_blob
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.faults import FaultyConsensus
from tests.fixtures.location import INLINE_SETTINGS, Location
from tests.helpers import expected_snapshot, rows, state_history

FAULTS = FaultConfig(fail_before=0.05, fail_after=0.05, seed=0)


def faulty_client(location: Location, policy: InlinePolicy, seed: int) -> PersistClient:
    consensus = FaultyConsensus(open_consensus(location.consensus_uri),
                                FaultConfig(fail_before=0.05, fail_after=0.05, seed=seed))
    blob = FaultyBlob(open_blob(location.blob_uri),
                      FaultConfig(fail_before=0.05, fail_after=0.05, seed=seed + 1))
    cfg = PersistConfig(inline_policy=policy, rollup_threshold=5, gc_orphan_min_age_s=120,
                        blob_cache_bytes=0)
    return PersistClient(consensus, blob, None, cfg)


@pytest.mark.parametrize("setting", list(INLINE_SETTINGS))
@pytest.mark.parametrize("seed", [1, 2])
def test_workload_under_injected_faults(durable_location: Location, setting: str, seed: int):
    policy = INLINE_SETTINGS[setting]
    client = faulty_client(durable_location, policy, seed)
    consensus_faults = client.consensus.inner.faults  # type: ignore[attr-defined]
    blob_faults = client.blobs.main.inner.faults  # type: ignore[attr-defined]
    shard = ShardId.new()
    writer = client.open_writer(shard)
    reader = client.open_reader(shard)
    rng = random.Random(seed)
    acked = []
    for t in range(40):
        n = 400 if t % 13 == 0 else 3
        batch = [(f"k{rng.randrange(50)}".encode(), b"v" * rng.randrange(1, 40), t,
                  rng.choice([1, -1, 2])) for _ in range(n)]
        writer.compare_and_append(batch, t, t + 1)
        acked += batch
        if t % 10 == 9:
            client.compact(shard)
            reader.downgrade_since(t - 5)
            client.gc(shard)
        if t % 7 == 0:
            assert rows(reader.snapshot(t), t) == expected_snapshot(acked, t)
    injected = consensus_faults.injected + blob_faults.injected
    assert injected["fail_after"] > 0 and injected["fail_before"] > 0
    # Checked through a fault-free client: exactly what was acknowledged.
    clean = durable_location.client(policy)
    for as_of in (35, 39):
        assert rows(clean.open_reader(shard).snapshot(as_of), as_of) == \
            expected_snapshot(acked, as_of)
    # GC only deletes parts of truncated versions: every version left is fully readable.
    for state in state_history(clean, str(shard)):
        assert state.inline_bytes <= policy.max_bytes
        for batch in state.batches.values():
            for part in batch.hollow_parts():
                assert clean.blobs.main.get(part.key) is not None, \
                    f"seqno {state.seqno} references missing part {part.key}"
    clean.close()
    client.close()
