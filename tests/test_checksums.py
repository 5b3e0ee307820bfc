"""CRC-32 checksums of stored bytes: every Parquet part and state rollup records the
CRC-32 of the bytes written, every whole read checks it, and every Parquet page carries
its own, which reads in row groups (and a read plan's dataset scan) check. Bytes that
changed in a store after the write (rot, truncation, another object put under the key)
raise :class:`ChecksumMismatch` or :class:`CorruptPart`: never wrong rows, never a
wrong state."""

from __future__ import annotations

import random
import zlib
from dataclasses import replace
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_pipeline import (
    ChecksumMismatch,
    CorruptPart,
    CorruptState,
    InlinePolicy,
    PartChecksumMismatch,
    PersistClient,
    PersistConfig,
    RollupChecksumMismatch,
    ShardId,
)
from persist_pipeline.blob.cache import CachingBlob
from persist_pipeline.internal import state_codec
from persist_pipeline.internal.blobs import WHOLE_FETCH_MAX_BYTES
from persist_pipeline.internal.state import HollowPart, State
from persist_pipeline.proto import persist_pb2 as pb
from tests.fixtures.location import Location, location_kinds, make_location

#: Rows of a write that goes to a Parquet part under any policy.
BIG = 5000


def _rows(n: int, t: int, val: bytes, diff: int = 1) -> pa.Table:
    return pa.table({"k": [b"k%06d" % i for i in range(n)], "v": [val] * n,
                     "t": [t] * n, "d": [diff] * n})


def _hollow(client: PersistClient, shard: ShardId) -> list[HollowPart]:
    state = client._machine(str(shard)).fetch_latest()
    return [p for b in state.batches.values() for p in b.hollow_parts()]


def _stored(client: PersistClient, part: HollowPart) -> bytes:
    data = client.blobs.store(part.store).get(part.key)
    assert data is not None, part.key
    return data


@pytest.fixture(params=location_kinds("embedded", "embedded-wal", "pg-s3", "pg-s3-wal"))
def loc(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    return make_location(request.param, request, tmp_path)


def test_every_part_and_rollup_records_the_crc32_of_its_bytes(loc: Location) -> None:
    """Writes (to the WAL store where there is one), compaction's output and GC's
    rollups, as a fresh client decodes them from consensus and rollups."""
    client = loc.client()
    shard = ShardId.new()
    with client.open_writer(shard) as w:
        w.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
        w.compare_and_append(_rows(BIG, 1, b"x"), 1, 2)
        w.compare_and_append(_rows(BIG, 2, b"y"), 2, 3)
    written = _hollow(client, shard)
    assert len(written) == 2
    for part in written:
        assert part.crc32 == zlib.crc32(_stored(client, part)), part.key
    client.compact(shard)
    client.gc(shard)
    client.close()

    fresh = loc.client()
    state = fresh._machine(str(shard)).fetch_latest()
    parts = _hollow(fresh, shard)
    assert parts and {p.store for p in written} == {"wal" if loc.wal_blob_uri else "main"}
    assert any(p not in written for p in parts)  # compaction's output among them
    for part in parts:
        assert part.crc32 == zlib.crc32(_stored(fresh, part)), part.key
    assert state.rollups
    for rollup in state.rollups.values():
        data = fresh.blobs.main.get(rollup.key)
        assert data is not None and rollup.crc32 == zlib.crc32(data), rollup.key
    # The summary beside the record names the latest rollup's CRC-32 too: a client
    # rebuilding the state from it checks it.
    head = fresh.consensus.head(str(shard))
    assert head is not None
    summary = state_codec.decode_summary(head.summary, "test")
    latest = state.rollups[max(state.rollups)]
    assert summary.latest_rollup_crc32 == latest.crc32
    assert fresh.open_reader(shard).snapshot(2).num_rows == 2 * BIG + 1
    fresh.close()


def test_a_part_swapped_for_another_valid_part_is_an_error_not_wrong_rows(
        loc: Location) -> None:
    """Another part of the same size, rows and bounds under the key: the listing, the
    Parquet decoding and every recorded bound are satisfied; only the CRC-32 tells."""
    client = loc.client(policy=InlinePolicy(0, 0))
    mine, other = ShardId.new(), ShardId.new()
    for shard, diff in ((mine, 1), (other, 2)):
        with client.open_writer(shard) as w:
            w.compare_and_append(_rows(BIG, 0, b"x", diff), 0, 1)
    [part], [theirs] = _hollow(client, mine), _hollow(client, other)
    swapped = _stored(client, theirs)
    assert len(swapped) == part.encoded_size  # the same shape, so the same size
    client.blobs.store(part.store).set(part.key, swapped)
    client.close()

    fresh = loc.client()  # no cached copy of the good bytes
    reader = fresh.open_reader(mine)
    with pytest.raises(PartChecksumMismatch, match="CRC-32") as raised:
        reader.snapshot(0)
    assert isinstance(raised.value, ChecksumMismatch | CorruptPart)
    assert part.key in str(raised.value)
    with pytest.raises(PartChecksumMismatch):
        list(reader.snapshot_batches(0))
    assert fresh.verify(mine).ok  # a listing sees the recorded size
    [problem] = fresh.verify(mine, deep=True).problems
    assert (problem.kind, problem.key) == ("checksum", part.key)
    # Negative control: without the recorded CRC-32 the swapped bytes decode, into the
    # other shard's rows, silently (what the check is there to stop): every count doubled.
    rows = fresh.blobs.fetch_part(replace(part, crc32=None), "test", cached=False)
    assert rows.num_rows == BIG and set(rows.column("d").to_pylist()) == {2}
    reader.expire()
    fresh.close()


def test_a_rotted_page_of_a_part_read_in_row_groups_is_an_error(tmp_path: Path) -> None:
    """A part larger than a whole fetch is read in row groups, not checked whole: the
    pages' own CRC-32s find a flipped byte that zstd would pass (random values are
    stored raw), in snapshots and in a read plan's scans (DuckDB's too)."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0))
    shard = ShardId.new()
    n = 120_000
    rng = random.Random(7).randbytes(40 * n)
    table = pa.table({"k": [b"k%07d" % i for i in range(n)],
                      "v": [rng[40 * i:40 * i + 40] for i in range(n)],
                      "t": [0] * n, "d": [1] * n})
    with client.open_writer(shard) as w:
        w.compare_and_append(table, 0, 1)
    [part] = _hollow(client, shard)
    assert part.encoded_size > WHOLE_FETCH_MAX_BYTES  # streamed, not fetched whole
    good = _stored(client, part)
    path = tmp_path / "rotted.parquet"
    # A byte flipped inside the v column's pages, on a value rather than a length
    # (which fails to decode anyway): the first such byte from the middle on.
    for offset in range(len(good) // 2, len(good) // 2 + 200):
        data = bytearray(good)
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        try:
            # Negative control: without the page checks the rot decodes, silently.
            unchecked = pq.read_table(path, columns=["k", "v"],
                                      page_checksum_verification=False)
        except pa.ArrowInvalid:
            continue
        break
    assert not unchecked.equals(table.select(["k", "v"]))
    client.blobs.main.set(part.key, bytes(data))
    client.close()

    fresh = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
    reader = fresh.open_reader(shard)
    with pytest.raises(CorruptPart, match="CRC"):
        reader.snapshot(0)
    with pytest.raises(CorruptPart, match="CRC"):
        list(reader.snapshot_batches(0))
    with reader.snapshot_plan(0) as plan:
        with pytest.raises(CorruptPart, match="CRC"):
            plan.to_table()
        con = duckdb.connect()
        con.register("parts", plan.to_dataset())
        with pytest.raises(duckdb.Error, match="CRC"):
            con.sql("SELECT count(*), sum(octet_length(v)) FROM parts").fetchall()
    [problem] = fresh.verify(shard, deep=True).problems
    assert (problem.kind, problem.key) == ("checksum", part.key)
    reader.expire()
    fresh.close()


def test_a_bad_copy_in_the_part_cache_is_dropped_for_the_stores_bytes(
        tmp_path: Path) -> None:
    """A cached copy that is not the part (a read that went wrong, admitted to the
    cache) fails its check once: the store's bytes, intact, are read and the copy is
    dropped, so later reads neither fail nor return its rows."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0))
    mine, other = ShardId.new(), ShardId.new()
    for shard, diff in ((mine, 1), (other, 2)):
        with client.open_writer(shard) as w:
            w.compare_and_append(_rows(BIG, 0, b"x", diff), 0, 1)
    [part], [theirs] = _hollow(client, mine), _hollow(client, other)
    cache = client.blobs.cached_main
    assert isinstance(cache, CachingBlob)
    with cache._lock:
        cache._admit(part.key, _stored(client, theirs), cache._epoch)
    assert cache.get(part.key) == _stored(client, theirs)
    reader = client.open_reader(mine)
    counts = reader.snapshot(0).column("d").to_pylist()
    assert counts == [1] * BIG  # mine, not the other shard's doubled counts
    assert cache.get(part.key) == _stored(client, part)  # the bad copy is gone
    assert reader.snapshot(0).column("d").to_pylist() == counts
    reader.expire()
    client.close()


def _shard_with_a_rollup(location: tuple[str, str]) -> tuple[ShardId, str]:
    client = PersistClient.open(*location)
    shard = ShardId.new()
    with client.open_writer(shard) as w:
        for t in range(4):
            w.compare_and_append([(b"k%d" % t, b"v", t, 1)], t, t + 1)
    client.gc(shard)  # a rollup, and the records before it truncated
    state = client._machine(str(shard)).fetch_latest()
    latest = state.rollups[max(state.rollups)]
    assert client.consensus.scan(str(shard), 0, limit=1)[0].seqno > 1
    client.close()
    return shard, latest.key


def test_a_rotted_rollup_is_an_error_not_a_wrong_state(tmp_path: Path) -> None:
    location = (f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
    shard, key = _shard_with_a_rollup(location)
    client = PersistClient.open(*location)
    data = client.blobs.main.get(key)
    assert data is not None
    client.blobs.main.set(key, data[:-1] + bytes([data[-1] ^ 0x01]))
    client.close()

    fresh = PersistClient.open(*location)
    with pytest.raises(RollupChecksumMismatch, match="CRC-32") as raised:
        fresh.open_reader(shard).snapshot(3)
    assert isinstance(raised.value, CorruptState) and key in str(raised.value)
    [problem] = fresh.verify(shard).problems  # the state cannot be rebuilt
    assert problem.kind == "state" and "RollupChecksumMismatch" in problem.detail
    fresh.close()


def test_blobs_recorded_before_checksums_still_read(tmp_path: Path) -> None:
    """A state whose parts and rollups carry no CRC-32 (written by an earlier version)
    decodes to None and reads as before; the checks apply to what records one."""
    hollow = pb.Part()
    hollow.hollow.key, hollow.hollow.store, hollow.hollow.encoded_size = "p", "main", 10
    [decoded] = state_codec._batch_from(pb.Batch(id="b", parts=[hollow],
                                                 desc=_desc())).parts
    assert isinstance(decoded, HollowPart) and decoded.crc32 is None
    rollup = state_codec._rollup_from(pb.Rollup(seqno=3, key="r", encoded_size=5))
    assert rollup.crc32 is None

    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                config=PersistConfig(inline_policy=InlinePolicy(0, 0)))
    shard = ShardId.new()
    with client.open_writer(shard) as w:
        w.compare_and_append(_rows(BIG, 0, b"x"), 0, 1)
    [part] = _hollow(client, shard)
    old = replace(part, crc32=None)
    assert client.blobs.fetch_part(old, "test", cached=False).num_rows == BIG
    data = state_codec.encode_state(State(shard_id=str(shard), seqno=1))
    assert state_codec.decode_rollup(data, None, "test").seqno == 1
    with pytest.raises(RollupChecksumMismatch):
        state_codec.decode_rollup(data, zlib.crc32(data) ^ 1, "test")
    client.close()


def _desc() -> pb.Description:
    desc = pb.Description()
    desc.lower.time, desc.since.time = 0, 0
    desc.upper.time = 1
    return desc
