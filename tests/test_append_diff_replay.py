"""Every record a busy shard's history holds, folded from its first by a reader that
knows nothing else, gives exactly the state the committing client holds: appends
grouped by the funnel across threads and shards, a typed writer recording its schema
with its first append, inline appends falling through to blob once the budget is full,
empty appends, leased readers registering, heartbeating and moving their since, rollups
written in the background and folded into appends, compaction, writers expired, and
closing appends (upper None). The append records written from the transition's note
(``State.note_appended``) must describe each commit whole, or the fold drifts from the
writer's state."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import (
    InlinePolicy,
    PersistClient,
    PersistConfig,
    ShardId,
    ShardSchema,
    UpperMismatch,
)
from persist_pipeline.internal import state_codec
from persist_pipeline.internal.state import State
from tests.fixtures.location import Location, make_location

SCHEMA = ShardSchema({"id": pa.int64()}, {"a": pa.string()})


def _fold(client: PersistClient, shard: str) -> State:
    consensus = client.consensus
    state = State(shard_id=shard)
    for record in consensus.scan(shard, 1):
        assert record.seqno == state.seqno + 1, "history truncated: the test keeps it all"
        state = state_codec.apply_diff(state, state_codec.decode_diff(record.data, "t"), "t")
        assert state.seqno == record.seqno
    return state


@pytest.mark.parametrize("run", range(3))  # the threads interleave differently each run
def test_a_fresh_fold_of_every_record_is_the_writers_state(
        request: pytest.FixtureRequest, tmp_path: Path, run: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    used = {"note": 0, "refused": 0}
    describes = state_codec._note_describes

    def counting(appended: Any, old: State, new: State) -> bool:
        ok = describes(appended, old, new)
        used["note" if ok else "refused"] += 1
        return ok

    monkeypatch.setattr(state_codec, "_note_describes", counting)
    location: Location = make_location("embedded", request, tmp_path)
    config = PersistConfig(group_commit_window_s=0.002, rollup_threshold=3)
    # A small inline budget: some inline candidates fall through to blob.
    client = location.client(InlinePolicy(4096, 3000), config)
    shards = [str(ShardId.new()) for _ in range(3)]
    typed = shards[0]
    errors: list[BaseException] = []

    def run(shard: str, k: int) -> None:
        try:
            if shard == typed:
                writer = client.open_writer(shard, schema=SCHEMA)
            else:
                writer = client.open_writer(shard)
            reader = client.open_reader(shard, create=True) if k == 0 else None
            since = 0
            for i in range(12):
                upper = writer.upper
                if upper is None:
                    break
                if shard == typed:
                    updates: object = pa.table({"id": [k * 100 + i], "a": ["x" * (i * 40)],
                                                "t": [upper], "d": [1]})
                else:
                    updates = [] if i % 5 == 4 else [
                        (f"k{k}-{i}".encode(), b"v" * (i * 60), upper, 1)]
                # Racing writers of the shard move its upper: a refusal is theirs.
                with contextlib.suppress(UpperMismatch):
                    writer.compare_and_append(updates, upper, upper + 1)
                if reader is not None and i % 3 == 2:
                    since = max(since, (writer.upper or 1) - 2)
                    reader.downgrade_since(since)
            if k == 1 and shard != typed:
                upper = writer.upper
                while upper is not None:
                    try:
                        writer.compare_and_append([], upper, None)
                        break
                    except UpperMismatch:
                        upper = writer.upper
            writer.expire()
        except BaseException as e:  # asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s, k)) for s in shards for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    client.flush_maintenance()
    for shard in shards:
        client.compact(shard)
    other = location.client(InlinePolicy(4096, 3000), config)
    for shard in shards:
        held = client._machine(shard).state
        folded = _fold(client, shard)
        assert folded == held
        assert other._machine(shard).state == held
    other.close()
    # The fold went through both paths: records written from notes, and commits whose
    # note no longer described them (rollups folded in, readers, schemas, heartbeats);
    # and through groups of several appends.
    assert used["note"] > 0 and used["refused"] > 0, used
    assert client._funnel is not None
    metrics = client._funnel._metrics
    assert metrics.group_commit_appends > metrics.group_commits, "no group held two"
    client.close()
