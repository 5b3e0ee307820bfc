"""Checksums where they meet other features: the part cache beside a store's local
files, a read plan's own scan, parts recorded before checksums were, footers longer
than one ranged read in real typed parts, and a Spark read task. Each test attacks
one seam on the real backends (SQLite + local files, PostgreSQL + S3, with and without
a WAL store) and asserts what a user sees: the right rows, or a typed error."""

from __future__ import annotations

import contextlib
import random
import re
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_pipeline import (
    CorruptPart,
    InlinePolicy,
    PartChecksumMismatch,
    PersistConfig,
    ShardId,
    ShardSchema,
    Unavailable,
)
from persist_pipeline.blob.cache import CachingBlob
from persist_pipeline.internal.blobs import (
    FOOTER_READ_BYTES,
    PART_KEY_METADATA,
    WHOLE_FETCH_MAX_BYTES,
)
from persist_pipeline.internal.lookup import current_rows
from tests.fixtures.location import Location, location_kinds, make_location
from tests.test_checksums import (
    _footer,
    _hollow,
    _large_table,
    _random_rows,
    _stored,
    _write_large_part,
)


@pytest.fixture(params=location_kinds("embedded", "embedded-wal", "pg-s3", "pg-s3-wal"))
def loc(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    return make_location(request.param, request, tmp_path)


def _with_diff(table: pa.Table, diff: int) -> pa.Table:
    return table.set_column(3, "d", pa.array([diff] * table.num_rows, pa.int64()))


def test_a_part_the_cache_holds_is_decoded_from_the_copy_its_check_read(
        loc: Location) -> None:
    """A streamed part's check (its footer, or the whole of a part up to 4 MiB) reads
    the part cache's copy when the cache holds one (a listen fetched it whole): its
    pages must be decoded from that same copy. Decoded from the store's local file
    instead, another valid part put under the key after the copy was cached (a bad
    restore) passed the checked footer's offsets and its own pages' CRC-32s: its rows
    came back as this shard's, silently."""
    config = PersistConfig(inline_policy=InlinePolicy(0, 0),
                           compaction_memory_bound_bytes=4 << 20)
    client = loc.client(config=config)
    mine, other = ShardId.new(), ShardId.new()
    for shard, diff in ((mine, 1), (other, 2)):
        with client.open_writer(shard) as w:
            w.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
            # Read in row groups, its footer checked...
            w.compare_and_append(_with_diff(_large_table().set_column(
                2, "t", pa.array([1] * 120_000, pa.int64())), diff), 1, 2)
            # ...and small enough to be checked whole, streamed all the same (a snapshot
            # of three runs under a 4 MiB bound reads each through a smaller buffer).
            w.compare_and_append(_random_rows(40_000, 2, diff), 2, 3)
    mine_parts, their_parts = _hollow(client, mine), _hollow(client, other)
    client.close()

    fresh = loc.client(config=config)
    reader = fresh.open_reader(mine)
    expected = reader.snapshot(2)
    assert set(expected.column("d").to_pylist()) == {1}  # the other shard's are 2
    listen = reader.listen(0)
    assert any(e.kind == "updates" for e in listen.poll())  # fetched whole: now cached
    listen.close()
    swapped = []
    for part in mine_parts:
        if part.encoded_size < 64 << 10:
            continue  # the one-row part: fetched whole, checked whole
        [theirs] = [p for p in their_parts if p.encoded_size == part.encoded_size]
        cache = fresh.blobs.store(part.store, cached=True)
        assert isinstance(cache, CachingBlob) and part.key in cache
        # Put straight into the store, as a bad restore would: the cached copy stays.
        fresh.blobs.store(part.store).set(part.key, _stored(fresh, theirs))
        swapped.append(part)
    assert len(swapped) == 2

    got = reader.snapshot(2)
    assert set(got.column("d").to_pylist()) == {1}  # not the other shard's rows
    assert got.equals(expected)
    assert pa.Table.from_batches(list(reader.snapshot_batches(2))).equals(expected)
    # Positive control: without the cached copies the store's bytes are what is read,
    # and they are found out.
    bare = loc.client(config=config)
    with pytest.raises(PartChecksumMismatch) as raised:
        bare.open_reader(mine).snapshot(2)
    assert any(p.key in str(raised.value) for p in swapped)
    reader.expire()
    bare.close()
    fresh.close()


def test_a_plans_scan_of_a_damaged_page_header_is_corrupt_not_unavailable(
        loc: Location) -> None:
    """A page header is not covered by its page's CRC-32, and a part larger than a
    whole fetch has only its footer checked before a plan's scan: a byte changed there
    fails the scan with a decoding error. ``to_table`` reported that as
    ``BlobUnavailable`` (an ``Unavailable``: transient, safe to retry), so a caller
    retried a read that fails the same way for ever; ``snapshot`` of the same part says
    ``CorruptPart``. Every flip of the header's first bytes is either harmless (the same
    rows) or a ``CorruptPart`` naming the part, in each read; DuckDB scanning the plan's
    dataset fails too, never counting wrong rows."""
    client = loc.client(policy=InlinePolicy(0, 0))
    shard, table, part = _write_large_part(client)
    good = _stored(client, part)
    meta = pq.read_metadata(pa.BufferReader(good))
    header = meta.row_group(1).column(meta.schema.names.index("v")).data_page_offset
    reader = client.open_reader(shard)
    expected = reader.snapshot(0)
    assert expected.num_rows == table.num_rows
    counted = (table.num_rows, table.num_rows)  # count(*), sum(d): every diff is 1
    blob = client.blobs.store(part.store)
    failed = 0
    for at in range(header, header + 8):
        data = bytearray(good)
        data[at] ^= 0x01
        blob.set(part.key, bytes(data))
        with reader.snapshot_plan(0) as plan:
            try:
                got = plan.to_table()
            except CorruptPart as e:
                assert not isinstance(e, Unavailable)
                assert part.key in str(e), e
                failed += 1
            else:
                assert got.equals(expected), at
            con = duckdb.connect()
            con.register("parts", plan.to_dataset())
            with contextlib.suppress(duckdb.Error):
                assert con.sql("SELECT count(*), sum(d) FROM parts").fetchone() == counted
        try:
            assert reader.snapshot(0).equals(expected), at
        except CorruptPart as e:
            assert part.key in str(e)
    assert failed >= 4  # most flips of a header fail to decode
    blob.set(part.key, good)
    with reader.snapshot_plan(0) as plan:
        assert plan.to_table().equals(expected)
    reader.expire()
    client.close()


def test_a_cached_copy_of_a_large_part_with_a_rotted_page_is_dropped_for_the_store(
        loc: Location) -> None:
    """A copy of a large part in the part cache (a listen fetched it whole) that went
    bad in a page, its footer intact: its footer passes its check, so the pages were
    read from that copy (ranged reads of the cache) and failed their CRC-32, every read
    of an intact part failing while the copy stayed cached. The copy is checked whole
    before its pages are read from it (it is in memory: a CRC-32 costs a few ms), and a
    bad one is dropped for the store's bytes, as a whole read's is."""
    client = loc.client(policy=InlinePolicy(0, 0))
    shard, table, part = _write_large_part(client)
    good = _stored(client, part)
    meta = pq.read_metadata(pa.BufferReader(good))
    chunk = meta.row_group(1).column(meta.schema.names.index("v"))
    rotted = bytearray(good)
    rotted[chunk.data_page_offset + chunk.total_compressed_size // 2] ^= 0xFF
    cache = client.blobs.store(part.store, cached=True)
    assert isinstance(cache, CachingBlob)
    with cache._lock:
        cache._admit(part.key, bytes(rotted), cache._epoch)
    reader = client.open_reader(shard)
    got = reader.snapshot(0)
    assert got.column("k").to_pylist() == table.column("k").to_pylist()
    assert got.column("v").to_pylist() == table.column("v").to_pylist()
    assert part.key not in cache  # the bad copy is gone
    assert pa.Table.from_batches(list(reader.snapshot_batches(0))).equals(got)
    # A key lookup (what an upsert or delete reads) of a key in that row group alike.
    with cache._lock:
        cache._admit(part.key, bytes(rotted), cache._epoch)
    key = meta.row_group(1).column(meta.schema.names.index("k")).statistics.min
    state = client._machine(str(shard)).fetch_latest()
    assert current_rows(client.blobs, state, [key]).column("k").to_pylist() == [key]
    assert part.key not in cache
    reader.expire()
    client.close()


@pytest.fixture(params=location_kinds("embedded-wal", "pg-s3"))
def two_locs(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """Both consensus backends, both kinds of store, with and without a WAL store."""
    return make_location(request.param, request, tmp_path)


@pytest.mark.parametrize("unrecorded", [("crc32", "footer_crc32"), ("footer_crc32",)],
                         ids=["no-checksums", "no-footer-checksum"])
def test_parts_recorded_before_checksums_read_compact_and_plan_as_before(
        two_locs: Location, monkeypatch: pytest.MonkeyPatch,
        unrecorded: tuple[str, ...]) -> None:
    """A shard whose parts were recorded by an earlier version (the state's encoding
    without the fields, as that version wrote it): every read of them (snapshots,
    streamed ones, a plan's table, a Spark read's partitions and tasks, key lookups,
    verify --deep) returns what the same rows recorded with checksums return, with no
    false mismatch; compaction merges them into parts that record both."""
    from persist_pipeline.internal import state_codec
    from persist_pipeline.proto import persist_pb2 as pb
    from persist_pipeline.spark_source import _read_partition, make_read_plan

    config = PersistConfig(inline_policy=InlinePolicy(0, 0),
                           compaction_memory_bound_bytes=4 << 20)
    earlier = two_locs.client(config=config)
    current = two_locs.client(config=config)
    part_to = state_codec._part_to

    def as_earlier_versions_wrote(part: object, out: pb.Part) -> None:
        part_to(part, out)  # type: ignore[arg-type]
        for name in unrecorded:
            if out.HasField("hollow"):
                out.hollow.ClearField(name)

    old, new = ShardId.new(), ShardId.new()
    for shard, client in ((old, earlier), (new, current)):
        if client is earlier:
            monkeypatch.setattr(state_codec, "_part_to", as_earlier_versions_wrote)
        with client.open_writer(shard) as w:
            w.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
            w.compare_and_append(_large_table().set_column(
                2, "t", pa.array([1] * 120_000, pa.int64())), 1, 2)
            w.compare_and_append(_random_rows(40_000, 2, 1), 2, 3)
        monkeypatch.setattr(state_codec, "_part_to", part_to)
    earlier.close()

    fresh = two_locs.client(config=config)  # decodes the earlier version's records
    parts = _hollow(fresh, old)
    assert len(parts) == 3 and all(getattr(p, name) is None for p in parts
                                   for name in unrecorded)
    assert all(p.crc32 is not None and p.footer_crc32 is not None
               for p in _hollow(fresh, new))
    expected = current.open_reader(new).snapshot(2)
    reader = fresh.open_reader(old)
    assert reader.snapshot(2).equals(expected)
    assert pa.Table.from_batches(list(reader.snapshot_batches(2))).equals(expected)
    with reader.snapshot_plan(2) as plan:
        assert plan.to_table().equals(expected)
    keys = [b"a", b"k0000000", b"k0060000", b"k0119999"]
    assert current_rows(fresh.blobs, fresh._machine(str(old)).fetch_latest(), keys).equals(
        current_rows(current.blobs, current._machine(str(new)).fetch_latest(), keys))
    # A Spark read, its driver's split points and its tasks (no Spark needed).
    opts = {"consensus": two_locs.consensus_uri, "blob": two_locs.blob_uri, "shard": str(old),
            "as_of": "2", "partition_bytes": str(1 << 20)}
    if two_locs.wal_blob_uri:
        opts["wal_blob"] = two_locs.wal_blob_uri
    location, as_of, partitions, lease, _, reader_id, _ = make_read_plan(opts)
    assert len(partitions) > 1
    read = pa.Table.from_batches([b for p in partitions for b in _read_partition(
        location, as_of, p, lease, reader_id=reader_id)])
    assert read.sort_by([("k", "ascending"), ("v", "ascending")]).to_pydict() == \
        expected.to_pydict()
    assert fresh.verify(old, deep=True).ok
    assert fresh.compact(old)["applied"] >= 1
    merged = [p for p in _hollow(fresh, old) if p not in parts]
    assert merged and all(p.crc32 is not None and p.footer_crc32 is not None
                          for p in merged)
    assert fresh.open_reader(old).snapshot(2).equals(expected)
    assert fresh.verify(old, deep=True).ok
    reader.expire()
    fresh.close()
    current.close()


def _wide_schema(columns: int) -> ShardSchema:
    return ShardSchema([("id", pa.int64())],
                       [(f"measurement_with_a_long_descriptive_name_{i:03d}", pa.int64())
                        for i in range(columns)])


def test_a_wide_typed_parts_footer_longer_than_one_ranged_read(two_locs: Location) -> None:
    """A typed shard of 200 value columns writes parts whose footers (a column chunk's
    metadata per column and row group, the typed columns' long names in each) exceed
    the first ranged read of a footer: every read of such a part in row groups
    (snapshots, a plan's table, a Spark read's split points and tasks, an upsert's
    lookup) takes the footer in two reads, checks it whole, and reads the same rows; a
    byte changed in the footer's first bytes, which the first read does not fetch, is a
    PartChecksumMismatch in each."""
    from persist_pipeline.spark_source import _read_partition, make_read_plan

    client = two_locs.client(policy=InlinePolicy(0, 0))
    schema = _wide_schema(200)
    n = 10_000
    rng = random.Random(3)
    columns: dict[str, list[int]] = {"id": list(range(n)), "t": [0] * n, "d": [1] * n}
    for name in schema.value.names:
        columns[name] = [rng.getrandbits(62) for _ in range(n)]
    shard = ShardId.new()
    writer = client.open_writer(shard, schema=schema)
    writer.compare_and_append(pa.table(columns), 0, 1)
    [part] = _hollow(client, shard)
    good = _stored(client, part)
    start, footer = _footer(good)
    assert len(footer) > FOOTER_READ_BYTES and part.encoded_size > WHOLE_FETCH_MAX_BYTES
    assert pq.read_metadata(pa.BufferReader(good)).num_row_groups > 1

    reader = client.open_reader(shard)
    expected = reader.snapshot(0)
    assert expected.num_rows == n
    assert expected.column("id").to_pylist() == list(range(n))
    name = schema.value.names[-1]
    assert expected.column(name).to_pylist() == columns[name]
    assert pa.Table.from_batches(list(reader.snapshot_batches(0))).equals(expected)
    with reader.snapshot_plan(0) as plan:
        assert plan.to_table().equals(expected)
    opts = {"consensus": two_locs.consensus_uri, "blob": two_locs.blob_uri,
            "shard": str(shard), "as_of": "0", "partition_bytes": str(8 << 20)}
    if two_locs.wal_blob_uri:
        opts["wal_blob"] = two_locs.wal_blob_uri
    location, as_of, partitions, lease, encoded, reader_id, _ = make_read_plan(opts)
    assert len(partitions) > 1
    read = pa.Table.from_batches([b for p in partitions for b in _read_partition(
        location, as_of, p, lease, encoded, reader_id=reader_id)])
    assert sorted(read.column("id").to_pylist()) == list(range(n))
    assert sorted(read.column(name).to_pylist()) == sorted(columns[name])

    # A byte of the footer's schema (a typed column's name), before its last
    # FOOTER_READ_BYTES: changed, every read through the footer says so.
    at = start + footer.index(b"measurement_with_a_long_descriptive_name_000") + 3
    assert at < len(good) - FOOTER_READ_BYTES
    client.blobs.store(part.store).set(part.key, good[:at] + b"X" + good[at + 1:])
    fresh = two_locs.client(policy=InlinePolicy(0, 0))
    fresh_reader = fresh.open_reader(shard)
    with pytest.raises(PartChecksumMismatch, match="footer of part"):
        fresh_reader.snapshot(0)
    with fresh_reader.snapshot_plan(0) as plan, \
            pytest.raises(PartChecksumMismatch, match="footer of part"):
        plan.to_table()
    with pytest.raises(PartChecksumMismatch, match="footer of part"):
        make_read_plan(opts)
    with pytest.raises(PartChecksumMismatch, match="footer of part"):
        for p in partitions:
            list(_read_partition(location, as_of, p, lease, encoded, reader_id=reader_id))
    upsert = {"id": [5], **{c: [0] for c in schema.value.names}}
    with pytest.raises(PartChecksumMismatch, match="footer of part"):
        fresh.open_writer(shard).upsert(pa.table(upsert), 1)
    # The intact part again: the same upsert's lookup finds the old row and retracts it.
    client.blobs.store(part.store).set(part.key, good)
    fresh.open_writer(shard).upsert(pa.table(upsert), 1)
    after = fresh_reader.snapshot(1)
    assert after.num_rows == n
    row = after.filter(pa.compute.equal(after.column("id"), 5))
    assert row.column(name).to_pylist() == [0]
    fresh_reader.expire()
    reader.expire()
    fresh.close()
    client.close()


@pytest.fixture(params=location_kinds("embedded-wal", "pg-s3-wal"))
def wal_loc(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    return make_location(request.param, request, tmp_path)


def test_cli_verify_reports_damaged_wal_parts_as_the_readme_says(wal_loc: Location) -> None:
    """``verify`` lists each store and finds parts present at their recorded size: a
    WAL part swapped for another of its size and a large one whose footer was zeroed
    pass that (exit 0); ``--deep`` checks their CRC-32s and reports each as
    ``checksum`` in the ``wal`` store (exit 1), naming only the damaged shard."""
    import json
    import os

    from tests.helpers import run_cli

    assert wal_loc.wal_blob_uri is not None
    env = {**os.environ, "PERSIST_CONSENSUS_URI": wal_loc.consensus_uri,
           "PERSIST_BLOB_URI": wal_loc.blob_uri, "PERSIST_WAL_BLOB_URI": wal_loc.wal_blob_uri}
    client = wal_loc.client(policy=InlinePolicy(0, 0))
    mine, other = ShardId.new(), ShardId.new()
    for shard, diff in ((mine, 1), (other, 2)):
        with client.open_writer(shard) as w:
            w.compare_and_append(_random_rows(40_000, 0, diff), 0, 1)
            w.compare_and_append(_large_table().set_column(
                2, "t", pa.array([1] * 120_000, pa.int64())), 1, 2)
    small, large = sorted(_hollow(client, mine), key=lambda p: p.encoded_size)
    [theirs] = [p for p in _hollow(client, other) if p.encoded_size == small.encoded_size]
    assert {small.store, large.store} == {"wal"}
    wal = client.blobs.store("wal")
    wal.set(small.key, _stored(client, theirs))
    data = _stored(client, large)
    wal.set(large.key, data[:-100] + bytes(100))
    out = run_cli(env, "verify", str(mine))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] is True
    out = run_cli(env, "verify", "--all", "--deep")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["shards"][str(other)]["ok"] is True
    problems = report["shards"][str(mine)]["problems"]
    assert sorted((p["kind"], p["store"], p["key"]) for p in problems) == sorted(
        [("checksum", "wal", small.key), ("checksum", "wal", large.key)])
    assert f"2 problem(s) in 1 shard(s): {mine}" in out.stderr
    client.close()


def test_a_large_part_swapped_for_one_with_the_same_footer_is_an_error(
        loc: Location) -> None:
    """A part larger than a whole fetch is read in row groups, its footer and pages
    checked, never its whole CRC-32. Another shard's part over the same keys, times and
    sizes of values (fixed-width values, other counts) had a byte-identical footer, and
    its pages carry their own valid CRC-32s: put under this part's key (a bad restore,
    a copy by hand), its rows were read as this shard's, silently, by snapshots and a
    plan's table. Each part's footer names its key, so no two parts' footers are alike
    and the footer check finds the swap in every read through it."""
    from persist_pipeline.spark_source import _read_partition, make_read_plan

    client = loc.client(policy=InlinePolicy(0, 0))
    mine, other = ShardId.new(), ShardId.new()
    table = _large_table()
    for shard, diff in ((mine, 1), (other, 2)):
        with client.open_writer(shard) as w:
            w.compare_and_append(_with_diff(table, diff), 0, 1)
    [part], [theirs] = _hollow(client, mine), _hollow(client, other)
    assert part.encoded_size == theirs.encoded_size > WHOLE_FETCH_MAX_BYTES
    for p in (part, theirs):
        named = pq.read_metadata(pa.BufferReader(_stored(client, p))).metadata
        assert named[PART_KEY_METADATA] == p.key.encode()
    client.blobs.store(part.store).set(part.key, _stored(client, theirs))
    client.close()

    fresh = loc.client()
    reader = fresh.open_reader(mine)
    footer_changed = re.escape(f"the footer of part {part.key!r}")
    with pytest.raises(PartChecksumMismatch, match=footer_changed):
        reader.snapshot(0)
    with pytest.raises(PartChecksumMismatch, match=footer_changed):
        list(reader.snapshot_batches(0))
    with reader.snapshot_plan(0) as plan, \
            pytest.raises(PartChecksumMismatch, match=footer_changed):
        plan.to_table()
    state = fresh._machine(str(mine)).fetch_latest()
    with pytest.raises(PartChecksumMismatch, match=footer_changed):
        current_rows(fresh.blobs, state, [b"k0000005"])
    opts = {"consensus": loc.consensus_uri, "blob": loc.blob_uri, "shard": str(mine),
            "as_of": "0"}
    if loc.wal_blob_uri:
        opts["wal_blob"] = loc.wal_blob_uri
    location, as_of, [partition], lease, _, reader_id, _ = make_read_plan(opts)
    with pytest.raises(PartChecksumMismatch, match=footer_changed):
        list(_read_partition(location, as_of, partition, lease, reader_id=reader_id))
    [problem] = fresh.verify(mine, deep=True).problems
    assert (problem.kind, problem.key) == ("checksum", part.key)
    reader.expire()
    fresh.close()


def test_the_merge_benchmarks_runs_record_their_checksums(tmp_path: Path) -> None:
    """The synthetic runs that ``make bench`` and the merge memory tests merge are read
    back from a manifest: it dropped each part's CRC-32s, so those merges measured the
    unchecked path (no footer checks, no whole check of a small part streamed), not the
    one compaction runs. Each part is loaded as written, both CRC-32s included."""
    import zlib

    from persist_pipeline.examples.merge_data import load_request, merge, write_runs
    from persist_pipeline.internal.blobs import footer_bytes

    write_runs(tmp_path, 20_000, 3)
    req = load_request(tmp_path)
    parts = [p for b in req.inputs for p in b.hollow_parts()]
    assert parts
    for part in parts:
        data = (tmp_path / "blobs" / part.key).read_bytes()
        footer = footer_bytes(data)
        assert footer is not None
        assert (part.crc32, part.footer_crc32) == (zlib.crc32(data), zlib.crc32(footer))
    # Checked: a part whose bytes changed fails the benchmark's merge.
    (tmp_path / "blobs" / parts[0].key).write_bytes(b"\0" * parts[0].encoded_size)
    with pytest.raises(PartChecksumMismatch):
        merge(tmp_path, 16 << 20)
