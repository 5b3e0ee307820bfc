"""CRC-32 checksums of stored bytes: every Parquet part and state rollup records the
CRC-32 of the bytes written, every whole read checks it, and every Parquet page carries
its own, which reads in row groups (and a read plan's dataset scan) check; and every
part records the CRC-32 of its Parquet footer, which every read of its footer alone
(reads in row groups, key lookups, split points) checks. Bytes that changed in a store
after the write (rot, truncation, another object put under the key) raise
:class:`ChecksumMismatch` or :class:`CorruptPart`: never wrong rows, never a wrong
state."""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_pipeline import (
    ChecksumMismatch,
    CorruptPart,
    CorruptState,
    InlinePolicy,
    PartChecksumMismatch,
    PartMissing,
    PersistClient,
    PersistConfig,
    RollupChecksumMismatch,
    ShardId,
)
from persist_pipeline.blob.cache import CachingBlob
from persist_pipeline.internal import blobs as blobs_module
from persist_pipeline.internal import state_codec
from persist_pipeline.internal.blobs import (
    FOOTER_READ_BYTES,
    WHOLE_FETCH_MAX_BYTES,
    DecodedParts,
    ShardBlobs,
    key_starts,
)
from persist_pipeline.internal.lookup import current_rows
from persist_pipeline.internal.merge import memory_plan
from persist_pipeline.internal.state import Description, HollowPart, State
from persist_pipeline.internal.trace import MergeReq
from persist_pipeline.proto import persist_pb2 as pb
from persist_pipeline.spark import split_points
from persist_pipeline.spark_source import plan_partitions
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


def _footer(data: bytes) -> tuple[int, bytes]:
    """Where a Parquet file's footer starts, and its bytes: the file metadata, its
    4-byte little-endian length and "PAR1" (found here from the format, not by the
    library's own code)."""
    assert data[-4:] == b"PAR1"
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    return start, data[start:]


def _large_table(n: int = 120_000) -> pa.Table:
    """Rows whose part is larger than a whole fetch (random values stay raw under zstd),
    so it is read in row groups: three of them."""
    rng = random.Random(7).randbytes(40 * n)
    return pa.table({"k": [b"k%07d" % i for i in range(n)],
                     "v": [rng[40 * i:40 * i + 40] for i in range(n)],
                     "t": [0] * n, "d": [1] * n})


def _write_large_part(client: PersistClient) -> tuple[ShardId, pa.Table, HollowPart]:
    """A new shard holding :func:`_large_table` in one Parquet part: the shard, the
    table and the part."""
    shard = ShardId.new()
    table = _large_table()
    with client.open_writer(shard) as w:
        w.compare_and_append(table, 0, 1)
    [part] = _hollow(client, shard)
    return shard, table, part


def _keys(tables: Any) -> list[bytes]:
    return [k for table in tables for k in table.column("k").to_pylist()]


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
        assert part.footer_crc32 == zlib.crc32(_footer(_stored(client, part))[1]), part.key
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
        assert part.footer_crc32 == zlib.crc32(_footer(_stored(fresh, part))[1]), part.key
    # A read plan's files name both, as the Spark source's readers of footers take them.
    with fresh.open_reader(shard).snapshot_plan(2) as plan:
        assert sorted((f["crc32"], f["footer_crc32"]) for f in plan.describe()["files"]) \
            == sorted((p.crc32, p.footer_crc32) for p in parts)
        assert sorted((f.hollow_part() for f in plan.file_details), key=lambda p: p.key) \
            == sorted(parts, key=lambda p: p.key)
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
    # A read plan's table is read by this library too (equal to snapshot(0)): checked
    # the same. (Its dataset, scanned by other engines, checks only the pages, which
    # are the other part's, intact.)
    with reader.snapshot_plan(0) as plan:
        assert [f.crc32 for f in plan.file_details] == [part.crc32]
        with pytest.raises(PartChecksumMismatch, match="CRC-32") as raised:
            plan.to_table()
        assert part.key in str(raised.value)
        assert set(plan.to_dataset().to_table().column("d").to_pylist()) == {2}
    assert fresh.verify(mine).ok  # a listing sees the recorded size
    [problem] = fresh.verify(mine, deep=True).problems
    assert (problem.kind, problem.key) == ("checksum", part.key)
    # Negative control: without the recorded CRC-32 the swapped bytes decode, into the
    # other shard's rows, silently (what the check is there to stop): every count doubled.
    rows = fresh.blobs.fetch_part(replace(part, crc32=None), "test", cached=False)
    assert rows.num_rows == BIG and set(rows.column("d").to_pylist()) == {2}
    reader.expire()
    fresh.close()


def _random_rows(n: int, t: int, diff: int) -> pa.Table:
    """Rows whose values zstd cannot shrink: the same ones for every call."""
    rng = random.Random(7).randbytes(16 * n)
    return pa.table({"k": [b"k%07d" % i for i in range(n)],
                     "v": [rng[16 * i:16 * i + 16] for i in range(n)],
                     "t": [t] * n, "d": [diff] * n})


def test_a_small_part_streamed_by_a_merge_is_checked_whole(loc: Location) -> None:
    """A part small enough to be fetched whole (so its footer and pages are trusted to
    the part's CRC-32) is streamed instead when a merge's read buffer is smaller (more
    runs, a smaller memory bound): its CRC-32 is checked all the same. Another valid
    part under its key was read into a snapshot's rows, and compaction wrote them into
    its output under a fresh, correct CRC-32 (after which nothing could tell)."""
    bound = 4 << 20
    config = PersistConfig(inline_policy=InlinePolicy(0, 0),
                           compaction_memory_bound_bytes=bound)
    client = loc.client(config=config)
    mine, other = ShardId.new(), ShardId.new()
    n = 40_000
    for shard, diff in ((mine, 1), (other, 2)):
        with client.open_writer(shard) as w:
            w.compare_and_append(_random_rows(n, 0, diff), 0, 1)
            w.compare_and_append(_random_rows(n, 1, 1), 1, 2)
    part, theirs = _hollow(client, mine)[0], _hollow(client, other)[0]
    assert part.crc32 is not None
    good, swapped = _stored(client, part), _stored(client, theirs)
    assert len(swapped) == part.encoded_size  # the same shape, so the same size
    # Small enough for a whole fetch, larger than the merge's read buffer: streamed.
    assert memory_plan(bound, 2, bound).read_bytes < part.encoded_size \
        <= WHOLE_FETCH_MAX_BYTES
    client.blobs.store(part.store).set(part.key, swapped)
    client.close()

    fresh = loc.client(config=config)
    reader = fresh.open_reader(mine)
    with pytest.raises(PartChecksumMismatch, match="CRC-32") as raised:
        reader.snapshot(1)
    assert part.key in str(raised.value)
    with pytest.raises(PartChecksumMismatch, match="CRC-32"):
        fresh.compact(mine)
    # Nothing was laundered: the part is still the one referenced, still found out.
    assert part in _hollow(fresh, mine)
    [problem] = fresh.verify(mine, deep=True).problems
    assert (problem.kind, problem.key) == ("checksum", part.key)
    # Positive control: the intact part passes the same check on the same path, also
    # past a bad copy of it in the part cache (dropped, the store's bytes read again).
    fresh.blobs.store(part.store).set(part.key, good)
    cache = fresh.blobs.store(part.store, cached=True)
    assert isinstance(cache, CachingBlob)
    with cache._lock:
        cache._admit(part.key, swapped, cache._epoch)
    assert reader.snapshot(1).column("d").to_pylist() == [2] * n
    assert part.key not in cache
    assert fresh.compact(mine)["applied"] == 1
    assert fresh.verify(mine, deep=True).ok
    assert reader.snapshot(1).column("d").to_pylist() == [2] * n
    reader.expire()
    fresh.close()


def _rot_a_page(good: bytes, table: pa.Table, tmp_path: Path) -> bytes:
    """``good`` (a part of ``table``) with a byte flipped inside the v column's pages,
    on a value rather than a length (which fails to decode anyway): the first such byte
    from the middle on. Negative control: without the page checks the rot decodes,
    silently, into other rows."""
    path = tmp_path / "rotted.parquet"
    for offset in range(len(good) // 2, len(good) // 2 + 200):
        data = bytearray(good)
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        try:
            unchecked = pq.read_table(path, columns=["k", "v"],
                                      page_checksum_verification=False)
        except pa.ArrowInvalid:
            continue
        break
    assert not unchecked.equals(table.select(["k", "v"]))
    return bytes(data)


def test_a_rotted_page_of_a_part_read_in_row_groups_is_an_error(tmp_path: Path) -> None:
    """A part larger than a whole fetch is read in row groups, not checked whole: the
    pages' own CRC-32s find a flipped byte that zstd would pass (random values are
    stored raw), in snapshots and in a read plan's scans (DuckDB's and polars' too)."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0))
    shard, table, part = _write_large_part(client)
    assert part.encoded_size > WHOLE_FETCH_MAX_BYTES  # streamed, not fetched whole
    client.blobs.main.set(part.key, _rot_a_page(_stored(client, part), table, tmp_path))
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
        with pytest.raises(OSError, match="CRC"):
            pl.scan_pyarrow_dataset(plan.to_dataset()).select(
                pl.col("v").bin.size().sum()).collect()
    [problem] = fresh.verify(shard, deep=True).problems
    assert (problem.kind, problem.key) == ("checksum", part.key)
    reader.expire()
    fresh.close()


@pytest.mark.parametrize("kind", location_kinds("embedded", "pg-s3"))
def test_a_rotted_page_is_an_error_when_a_snapshot_decodes_row_groups_in_parallel(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot of one run reads each column chunk of a large part whole when it fits
    the read buffer (no buffered stream copying pages out), and from a local file
    decodes its row groups two at a time (the second on a pool thread, from a file of
    its own): every page is still checked against its CRC-32 on those paths, natively
    from a local file and through ranged gets from the S3 server, and a rotted page
    found on the pool thread fails the read; the intact part reads the same rows."""
    loc = make_location(kind, request, tmp_path)
    client = loc.client(policy=InlinePolicy(0, 0))
    shard, table, part = _write_large_part(client)
    assert part.encoded_size > WHOLE_FETCH_MAX_BYTES  # streamed, not fetched whole
    good = _stored(client, part)
    assert pq.read_metadata(pa.BufferReader(good)).num_row_groups == 3
    client.close()
    buffers: list[int] = []  # the buffer size of each Parquet reader opened
    pairs: list[tuple[int, int]] = []  # the row groups decoded two at a time
    opened, decode_two = pq.ParquetFile.__init__, blobs_module._decode_two

    def open_spy(self: pq.ParquetFile, *args: Any, **kwargs: Any) -> None:
        buffers.append(kwargs.get("buffer_size", 0))
        opened(self, *args, **kwargs)

    def pair_spy(first: pq.ParquetFile, group: int, second: pq.ParquetFile,
                 next_group: int, exact: bool) -> list[pa.Table]:
        pairs.append((group, next_group))
        return decode_two(first, group, second, next_group, exact)

    monkeypatch.setattr(pq.ParquetFile, "__init__", open_spy)
    monkeypatch.setattr(blobs_module, "_decode_two", pair_spy)
    # Column chunks read whole; row groups paired only from the local file.
    expected_pairs = [(0, 1)] if kind == "embedded" else []
    fresh = loc.client()
    reader = fresh.open_reader(shard)
    assert pa.Table.from_batches(list(reader.snapshot_batches(0))).cast(table.schema) \
        .equals(table)
    assert buffers and set(buffers) == {0}
    assert pairs == expected_pairs
    reader.expire()
    fresh.close()

    buffers.clear()
    pairs.clear()
    rotted = loc.client()
    data = _rot_a_page(good, table, tmp_path)
    rotted.blobs.store(part.store).set(part.key, data)
    # The rot is in the second row group: on the pool thread when paired.
    meta = pq.read_metadata(pa.BufferReader(good))
    offset = next(i for i in range(len(good)) if good[i] != data[i])
    assert meta.row_group(1).column(0).data_page_offset <= offset < \
        meta.row_group(2).column(0).data_page_offset
    reader = rotted.open_reader(shard)
    with pytest.raises(CorruptPart, match="CRC"):
        list(reader.snapshot_batches(0))
    assert set(buffers) == {0}
    assert pairs == expected_pairs
    reader.expire()
    rotted.close()


def _raise_lowest_key(data: bytes, group: int) -> tuple[bytes, bytes, bytes]:
    """``data`` with one byte of its footer changed: row group ``group``'s lowest key in
    the ``k`` statistics, raised past that key (its last byte plus one), so the footer
    still parses and prunes that key's row group. Returns the changed bytes, the row
    group's real lowest key and the one its statistics now state."""
    meta = pq.read_metadata(pa.BufferReader(data))
    k = meta.schema.names.index("k")
    lowest = meta.row_group(group).column(k).statistics.min
    start, footer = _footer(data)
    assert footer.count(lowest) == 1  # the statistic, once (a unique key)
    rotted = bytearray(data)
    rotted[start + footer.index(lowest) + len(lowest) - 1] += 1
    stated = pq.read_metadata(pa.BufferReader(bytes(rotted))).row_group(group) \
        .column(k).statistics.min
    assert stated == lowest[:-1] + bytes([lowest[-1] + 1])
    return bytes(rotted), lowest, stated


def test_a_rotted_footer_of_a_part_read_in_row_groups_is_an_error_not_lost_rows(
        loc: Location) -> None:
    """A large part is read in row groups: its footer and the pages it needs, never its
    whole bytes. One byte of its footer changed (a row group's lowest key in the
    statistics, raised past that key) still parses, no page is touched, and the row
    group holding the key is pruned for it: a key lookup (upserts, deletes) misses the
    row and key ranges split where the footer says lose it. The footer's own CRC-32,
    checked by every read of a footer, makes each of them an error naming the part."""
    client = loc.client(policy=InlinePolicy(0, 0))
    shard, table, part = _write_large_part(client)
    assert part.encoded_size > WHOLE_FETCH_MAX_BYTES  # read in row groups
    good = _stored(client, part)
    rotted, lowest, stated = _raise_lowest_key(good, 1)
    client.blobs.store(part.store).set(part.key, rotted)
    client.close()

    fresh = loc.client()  # no cached footer or bytes of the good part
    state = fresh._machine(str(shard)).fetch_latest()
    reader = fresh.open_reader(shard)
    footer_changed = f"footer of part {part.key!r}.*CRC-32"
    with pytest.raises(PartChecksumMismatch, match=footer_changed) as raised:
        list(reader.snapshot_batches(0))
    assert isinstance(raised.value, ChecksumMismatch | CorruptPart)
    with pytest.raises(PartChecksumMismatch, match=footer_changed):
        current_rows(fresh.blobs, state, [lowest])  # what an upsert or delete looks up
    merge = MergeReq(0, tuple(state.batches.values()), Description(0, 1, 0))
    with pytest.raises(PartChecksumMismatch, match=footer_changed):
        split_points(merge, 4, fresh.blobs)  # Spark compaction's driver
    with reader.snapshot_plan(0) as plan:
        with pytest.raises(PartChecksumMismatch, match=footer_changed):
            plan_partitions(plan, fresh.blobs, partition_bytes=1 << 20)  # Spark reads
        with pytest.raises(PartChecksumMismatch, match=footer_changed):
            plan.to_table()  # its scan prunes row groups by their statistics too
        assert plan.describe()["files"][0]["footer_crc32"] == part.footer_crc32
    with pytest.raises(PartChecksumMismatch):
        reader.snapshot(0)
    [problem] = fresh.verify(shard, deep=True).problems
    assert (problem.kind, problem.key) == ("checksum", part.key)

    # Negative control: the same footer unchecked (a part recording no footer CRC-32)
    # prunes the row group that holds the key, silently.
    unchecked = replace(part, footer_crc32=None)
    assert lowest in table.column("k").to_pylist()
    assert lowest not in _keys(DecodedParts().row_groups(fresh.blobs, unchecked, "test",
                                                         [lowest]))
    starts = [key for key, _ in key_starts(fresh.blobs, unchecked, "test")]
    assert stated in starts and lowest not in starts
    # Two key ranges split at the stated key (as a Spark read's partitions would be)
    # together lose the row: the lower range prunes its row group, the upper holds the
    # rows from the split on.
    ranges = [fresh.blobs.stream_run([unchecked], "test", 1 << 20, key_upper=stated),
              fresh.blobs.stream_run([unchecked], "test", 1 << 20, key_lower=stated)]
    read = [key for keys in ranges for key in _keys(keys)]
    assert lowest not in read and len(read) == table.num_rows - 1
    # The intact part, unchecked alike, holds it in each of those reads.
    fresh.blobs.store(part.store).set(part.key, good)
    intact = ShardBlobs(fresh.blobs.main, fresh.blobs.wal, fresh.blobs.main, fresh.blobs.wal)
    assert lowest in _keys(intact.decoded.row_groups(intact, unchecked, "test", [lowest]))
    assert [key for keys in (intact.stream_run([unchecked], "test", 1 << 20, key_upper=stated),
                             intact.stream_run([unchecked], "test", 1 << 20, key_lower=stated))
            for key in _keys(keys)] == table.column("k").to_pylist()
    reader.expire()
    fresh.close()


def test_a_footer_larger_than_one_ranged_read_is_checked_whole(tmp_path: Path) -> None:
    """A footer longer than the first ranged read from the part's end (many row groups)
    is read in two, and its CRC-32 covers both: a byte changed in its first bytes, which
    the first read does not fetch, is found."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}")
    n = 60_000
    table = pa.table({"k": [b"k%07d" % i for i in range(n)], "v": [b"v"] * n,
                      "t": [0] * n, "d": [1] * n})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=200, write_statistics=["k", "t"])
    data = sink.getvalue().to_pybytes()
    start, footer = _footer(data)
    assert len(footer) > FOOTER_READ_BYTES
    client.blobs.main.set("footer/big.parquet", data)
    part = HollowPart("footer/big.parquet", "main", len(data), n, 0, 0, b"k0000000",
                      b"k0059999", zlib.crc32(data), zlib.crc32(footer))
    meta = client.blobs.footer(part, "test")
    assert [meta.row_group(g).column(0).statistics.min for g in range(meta.num_row_groups)] \
        == [b"k%07d" % i for i in range(0, n, 200)]
    # Read in row groups (a read buffer smaller than the part), through that footer.
    assert _keys(client.blobs.stream_part(part, "test", 1 << 20, read_bytes=1 << 16)) == \
        table.column("k").to_pylist()
    assert _keys(DecodedParts().row_groups(client.blobs, part, "test", [b"k0030000"])) == \
        [b"k%07d" % i for i in range(30_000, 30_200)]
    # A byte of the first row group's statistics, before the last FOOTER_READ_BYTES.
    at = start + footer.index(b"k0000000") + 7
    assert at < len(data) - FOOTER_READ_BYTES
    client.blobs.main.set(part.key, data[:at] + b"9" + data[at + 1:])
    with pytest.raises(PartChecksumMismatch, match=r"footer of part 'footer/big\.parquet'"):
        list(DecodedParts().row_groups(client.blobs, part, "test", [b"k0030000"]))
    # Streamed, a part this small (one a snapshot would fetch whole) is checked whole
    # first; one recording only its footer's CRC-32 is checked by its footer.
    with pytest.raises(PartChecksumMismatch, match=r"bytes have CRC-32"):
        list(client.blobs.stream_part(part, "test", 1 << 20, read_bytes=1 << 16))
    with pytest.raises(PartChecksumMismatch, match=r"footer of part 'footer/big\.parquet'"):
        list(client.blobs.stream_part(replace(part, crc32=None), "test", 1 << 20,
                                      read_bytes=1 << 16))
    # Unchecked, the same bytes parse, and state another lowest key.
    unchecked = client.blobs.footer(replace(part, footer_crc32=None), "test")
    assert unchecked.row_group(0).column(0).statistics.min == b"k0000009"
    client.close()


def test_a_bad_cached_copy_fails_a_footer_once_then_the_stores_bytes_are_read(
        tmp_path: Path) -> None:
    """A footer read from a cached copy that is not the part (a read that went wrong,
    admitted to the cache) is read again from the store itself, as a whole read is: the
    intact footer serves the read and the copy is dropped."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0),
                                config=PersistConfig(blob_cache_bytes=64 << 20))
    shard, table, part = _write_large_part(client)
    rotted, lowest, _ = _raise_lowest_key(_stored(client, part), 1)
    cache = client.blobs.cached_main
    assert isinstance(cache, CachingBlob)
    with cache._lock:
        cache._admit(part.key, rotted, cache._epoch)
    assert part.key in cache
    state = client._machine(str(shard)).fetch_latest()
    found = current_rows(client.blobs, state, [lowest])
    assert found.column("k").to_pylist() == [lowest]  # not pruned by the bad copy
    assert part.key not in cache  # the bad copy is gone
    assert _keys(client.open_reader(shard).snapshot_batches(0)) == \
        table.column("k").to_pylist()
    client.close()


def test_a_large_part_recorded_before_footer_checksums_still_reads(tmp_path: Path) -> None:
    """A part that records a CRC-32 of its bytes but none of its footer (written by an
    earlier version) decodes to None and is read in row groups as before; a footer it
    cannot have checked, unreadable, is a CorruptPart, not a checksum mismatch."""
    hollow = pb.Part()
    hollow.hollow.key, hollow.hollow.store, hollow.hollow.encoded_size = "p", "main", 10
    hollow.hollow.crc32 = 7
    [decoded] = state_codec._batch_from(pb.Batch(id="b", parts=[hollow],
                                                 desc=_desc())).parts
    assert isinstance(decoded, HollowPart)
    assert (decoded.crc32, decoded.footer_crc32) == (7, None)

    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                inline_policy=InlinePolicy(0, 0))
    _, table, part = _write_large_part(client)
    old = replace(part, footer_crc32=None)
    for recorded in (old, part):  # each as recorded, through the state's encoding
        msg = pb.Part()
        state_codec._part_to(recorded, msg)
        assert msg.hollow.HasField("footer_crc32") == (recorded is part)
        assert state_codec._part_from(msg) == recorded
    assert _keys(client.blobs.stream_part(old, "test", 1 << 20)) == \
        table.column("k").to_pylist()
    assert key_starts(client.blobs, old, "test") == key_starts(client.blobs, part, "test")
    lowest = key_starts(client.blobs, old, "test")[1][0]
    assert lowest in _keys(DecodedParts().row_groups(client.blobs, old, "test", [lowest]))
    good = _stored(client, part)
    client.blobs.main.set(part.key, good[:-1] + b"X")  # no longer ends in "PAR1"
    with pytest.raises(CorruptPart, match="no Parquet footer") as raised:
        list(client.blobs.stream_part(old, "test", 1 << 20))
    assert not isinstance(raised.value, ChecksumMismatch)
    with pytest.raises(PartChecksumMismatch, match="no Parquet footer"):
        list(client.blobs.stream_part(part, "test", 1 << 20))
    client.close()


def test_a_plan_file_gc_deleted_before_its_checks_is_named_gone_not_a_checksum_error(
        loc: Location) -> None:
    """``to_table`` checks a large file's footer and a small file whole before its scan;
    a file GC deleted meanwhile (its reader's lease ran out) is the plan's gone file,
    named (PartMissing), as the scan itself reports it: never a checksum mismatch nor an
    unavailable store, for the footer read (one or two ranged reads) as for the whole."""
    client = loc.client(policy=InlinePolicy(0, 0))
    shard, table, _ = _write_large_part(client)
    with client.open_writer(shard) as w:
        w.compare_and_append(_rows(BIG, 1, b"y"), 1, 2)
    reader = client.open_reader(shard)
    with reader.snapshot_plan(1) as plan:
        files = sorted(plan.file_details, key=lambda f: f.size)
        assert len(files) == 2 and files[0].size <= WHOLE_FETCH_MAX_BYTES < files[1].size
        assert None not in (files[0].crc32, files[1].footer_crc32)
        for f in reversed(files):  # the footer-checked file, then the one checked whole
            blob = client.blobs.store(f.store)
            data = _stored(client, f.hollow_part())
            blob.delete(f.key)  # as GC deletes it once the reader's lease ran out
            with pytest.raises(PartMissing, match=re.escape(f.uri) + " of this snapshot "
                               "plan is gone") as raised:
                plan.to_table()
            assert not isinstance(raised.value, ChecksumMismatch)
            blob.set(f.key, data)
        assert plan.to_table().num_rows == table.num_rows + BIG
    reader.expire()
    client.close()


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
    assert decoded.footer_crc32 is None
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
