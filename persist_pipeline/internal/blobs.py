"""One shard location's blob stores (main, optional WAL, the LRU part cache), and the
streaming reader and writer of Parquet parts.

Parts are read whole when small (through the cache) and, when large, row group by row
group, each column through a bounded read buffer (natively for a local file, else with
ranged gets), so a merge or a snapshot holds a buffer and a page per column of each
input run, not a part or a row group. :class:`PartWriter` writes a stream of sorted,
consolidated tables as parts of about a target size, recording each part's time and key
bounds.
"""

from __future__ import annotations

import bisect
import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist_pipeline.blob.base import Blob
from persist_pipeline.blob.cache import CachingBlob

if TYPE_CHECKING:
    from persist_pipeline.schema import ShardSchema
from persist_pipeline.exceptions import (
    CorruptPart,
    InvalidConfig,
    PartChecksumMismatch,
    PartMissing,
    PersistError,
    ResourceExhausted,
)
from persist_pipeline.internal import checksum, paths, state_codec
from persist_pipeline.internal.state import (
    HollowPart,
    InlinePart,
    Part,
    State,
    Store,
    key_bounds,
)
from persist_pipeline.internal.sync import SharedPool
from persist_pipeline.updates import (
    PARQUET_ROW_GROUP_BYTES as _ROW_GROUP_BYTES,
)
from persist_pipeline.updates import (
    SCHEMA,
    advance_times,
    decode_inline,
    decode_parquet,
    parquet_write_options,
)

#: Parts up to this size are fetched whole (and cached); larger ones are streamed.
WHOLE_FETCH_MAX_BYTES = 4 << 20


#: Decoded small parts kept for lookups (bytes of Arrow data): parts are immutable, so
#: a cached part is never stale, and repeated upserts skip decoding the same Parquet.
LOOKUP_CACHE_BYTES = 64 << 20


class DecodedParts:
    """An LRU of decoded parts and row groups (and parts' footers) by blob key, bounded
    by Arrow bytes; thread-safe. Parts never change, so nothing cached goes stale; only
    what was read is cached (a missing part is never remembered)."""

    def __init__(self, max_bytes: int = LOOKUP_CACHE_BYTES) -> None:
        self._max = max_bytes
        self._tables: OrderedDict[tuple[str, str, int], pa.Table] = OrderedDict()
        self._footers: OrderedDict[tuple[str, str], pq.FileMetaData] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _cached(self, key: tuple[str, str, int]) -> pa.Table | None:
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
            return table

    def _keep(self, key: tuple[str, str, int], table: pa.Table) -> None:
        if table.nbytes > self._max // 4:
            return
        with self._lock:
            if key not in self._tables:
                self._tables[key] = table
                self._bytes += table.nbytes
            while self._bytes > self._max:
                _, old = self._tables.popitem(last=False)
                self._bytes -= old.nbytes

    def get(self, blobs: ShardBlobs, part: HollowPart, where: str) -> pa.Table:
        """The part decoded (:meth:`ShardBlobs.fetch_part`), from the LRU if there."""
        key = (part.store, part.key, -1)
        table = self._cached(key)
        if table is None:
            table = blobs.fetch_part(part, where)
            self._keep(key, table)
        return table

    def inline(self, part: InlinePart, where: str) -> pa.Table:
        """An inline part decoded, from the LRU if there."""
        key = ("inline", part.part_id, hash(part.updates))
        table = self._cached(key)
        if table is None:
            table = decode_inline(part.updates, f"{part.part_id} ({where})")
            self._keep(key, table)
        return table

    def row_groups(self, blobs: ShardBlobs, part: HollowPart, where: str,
                   keys: Sequence[bytes]) -> Iterator[pa.Table]:
        """The row groups of a large part whose key statistics span one of ``keys``
        (sorted), decoded (k/v/t/d), each from the LRU if there."""
        described = f"{part.key!r} in the {part.store} blob store"
        try:
            with self._lock:
                meta = self._footers.get((part.store, part.key))
            if meta is None:
                meta = blobs.footer(part, where)  # checked: only what matched is kept
                with self._lock:
                    self._footers[(part.store, part.key)] = meta
                    while len(self._footers) > _FOOTERS_CACHED:
                        self._footers.popitem(last=False)
            source = None
            for group in _row_groups_from(meta, None, None, keys):
                key = (part.store, part.key, group)
                table = self._cached(key)
                if table is None:
                    if source is None:
                        # After the footer's check (which drops a bad cached copy), as
                        # a stream opens a part: a cached copy checked whole, else the
                        # store's bytes.
                        source = blobs._open(part, where)
                    reader = pq.ParquetFile(source, metadata=meta,
                                            page_checksum_verification=True)
                    table = reader.read_row_group(group, columns=SCHEMA.names,
                                                  use_threads=False).cast(SCHEMA)
                    self._keep(key, table)
                yield table
        except Exception as e:
            raise _part_error(e, described) from None


def _part_error(error: Exception, described: str) -> Exception:
    """What reading a Parquet part raises for ``error``: our own errors as they are, a
    memory error as :class:`ResourceExhausted`, a decoding error as :class:`CorruptPart`
    (anything else, unchanged)."""
    if isinstance(error, PersistError):
        return error
    if isinstance(error, pa.ArrowMemoryError | MemoryError):
        return ResourceExhausted(f"out of memory reading Parquet part {described}: {error}")
    if isinstance(error, pa.ArrowException | KeyError | ValueError | OSError):
        return CorruptPart(f"corrupt Parquet part {described}: {error}")
    return error


#: Parts' footers kept by :class:`DecodedParts`.
_FOOTERS_CACHED = 1024


@dataclass
class ShardBlobs:
    """The blob stores of a persist location.

    Attributes:
        main: where compaction output, large writes and rollups go.
        wal: the optional low-latency store for fresh write parts (as SlateDB's separate WAL store).
        cached_main / cached_wal: the same stores behind the LRU cache, for reads.
        decoded: decoded small parts, for key lookups (upserts and deletes).
    """

    main: Blob
    wal: Blob | None
    cached_main: Blob
    cached_wal: Blob | None
    decoded: DecodedParts = field(default_factory=lambda: DecodedParts())

    def store(self, store: Store, cached: bool = False) -> Blob:
        if store == "wal":
            blob = self.cached_wal if cached else self.wal
            if blob is None:
                # The part is fine; this client was opened without the store that holds
                # it: a configuration error, not corruption (nothing was read or changed).
                raise InvalidConfig("a part lives in the WAL blob store, but this client has "
                                    "none configured: open it with the location's WAL blob "
                                    "URI (wal_blob_uri / --wal-blob / PERSIST_WAL_BLOB_URI)")
            return blob
        return self.cached_main if cached else self.main

    def fetch_part(self, part: Part, where: str, cached: bool = True) -> pa.Table:
        """Decode a part to a k/v/t/d table; raises :class:`CorruptPart` if unreadable
        (:class:`PartMissing` if gone). ``cached=False`` reads the store itself, never a
        cached copy (a check of what is stored)."""
        if isinstance(part, InlinePart):
            return decode_inline(part.updates, f"{part.part_id} ({where})")
        assert isinstance(part, HollowPart)
        data = read_checked(self.store(part.store, cached=cached), self.store(part.store),
                            part, where, self.get_part)
        return decode_parquet(data, f"{part.key!r} in the {part.store} blob store")

    def fetch_rollup(self, key: str, crc32: int | None, where: str) -> State | None:
        """The state stored as a rollup at ``key`` in the main store (None if it is
        gone), after checking its bytes against ``crc32`` (as :meth:`fetch_part` checks
        a part's, read again once before they are judged changed); raises
        :class:`RollupChecksumMismatch` or :class:`CorruptState` naming ``where``."""
        data = self.main.get(key)
        if data is not None and not checksum.matches(data, crc32):
            data = self.main.get(key)
            if data is not None:
                return state_codec.decode_rollup(data, crc32, where)  # checks it again
        if data is None:
            return None
        return state_codec.decode_state(data, where)

    @staticmethod
    def get_part(store: Blob, part: HollowPart, where: str) -> bytes:
        """``part``'s stored bytes, read whole from ``store``; :class:`PartMissing` when
        it is gone."""
        data = store.get(part.key)
        if data is None:
            raise PartMissing(f"part {part.key!r} ({where}) is missing from the "
                              f"{part.store} blob store")
        return data

    def stream_part(self, part: Part, where: str, batch_bytes: int,
                    key_lower: bytes | None = None, key_upper: bytes | None = None,
                    read_bytes: int = WHOLE_FETCH_MAX_BYTES,
                    decode_threads: bool = False) -> Iterator[pa.Table]:
        """A part's updates in order, as tables of about ``batch_bytes`` of updates.

        A part up to ``read_bytes`` (and :data:`WHOLE_FETCH_MAX_BYTES`) is fetched
        whole. A larger one is read row group by row group, each column through a read
        buffer of ``read_bytes``, or whole when its column chunks are no larger (so a
        reader holds its buffers and the pages being decoded, not a row group),
        natively when the store keeps it as a local file, else with ranged gets; row
        groups whose keys all lie outside ``[key_lower, key_upper)`` are skipped (their
        statistics say so). Rows outside the range may still be returned.

        ``decode_threads`` (a read of few runs, which waits on decoding): a large part
        kept as a local file has its row groups decoded two at a time when each is one
        batch (the second on a pool thread), else its columns in parallel on Arrow's CPU
        pool; within the read of a batch either way, so nothing runs ahead of the
        caller, and a pair holds one batch more.
        """
        if isinstance(part, InlinePart) or \
                part.encoded_size <= min(read_bytes, WHOLE_FETCH_MAX_BYTES):
            table = self.fetch_part(part, where)
            rows = _batch_rows(batch_bytes, table.nbytes, table.num_rows)
            for start in range(0, table.num_rows, rows):
                yield table.slice(start, rows)
            return
        described = f"{part.key!r} in the {part.store} blob store"
        checked = None
        if part.encoded_size <= WHOLE_FETCH_MAX_BYTES:
            # Small enough that a whole fetch would check it (footer and all) against its
            # CRC-32, streamed only because this read's buffer is smaller: checked the
            # same before anything of it is decoded, its footer taken from those bytes.
            checked = self._check_whole(part, where)
        try:
            meta = self.footer(part, where) if checked is None else checked
            groups = _row_groups_from(meta, key_lower, key_upper)
            # A column chunk no larger than the read buffer is read whole, with one read
            # (buffer size 0): it holds no more than the buffer would, and its pages are
            # checked and decoded in place, not copied out of a buffer first.
            whole_chunks = _largest_column_chunk(meta, groups) <= read_bytes
            source = self._open(part, where)
            # Other threads decode only from a native file: over ranged gets or a cached
            # copy they would call into Python or hold its buffers (as pq.read_table's
            # tasks did: see decode_parquet), for no gain (the ranged gets take turns).
            threads = decode_threads and isinstance(source, pa.OSFile)
            buffer_size = 0 if whole_chunks else max(1, read_bytes)
            reader = pq.ParquetFile(source, metadata=meta, buffer_size=buffer_size,
                                    pre_buffer=False, page_checksum_verification=True)
            # Batches of the storage types need no cast (a cast per batch costs more
            # than decoding a small one).
            stored = reader.schema_arrow
            exact = [stored.field(name).type for name in SCHEMA.names] == SCHEMA.types

            def batch_rows(group: int) -> int:
                info = meta.row_group(group)
                return _batch_rows(batch_bytes, info.total_byte_size, info.num_rows)

            def one_batch(group: int) -> bool:
                return batch_rows(group) >= int(meta.row_group(group).num_rows)

            other: pq.ParquetFile | None = None  # a second reader, for pairs of row groups
            i = 0
            while i < len(groups):
                group = groups[i]
                if threads and i + 1 < len(groups) and one_batch(group) and \
                        one_batch(groups[i + 1]):
                    if other is None:
                        second = self._open(part, where)
                        if not isinstance(second, pa.OSFile):
                            threads = False
                            continue
                        other = pq.ParquetFile(second, metadata=meta,
                                               buffer_size=buffer_size, pre_buffer=False,
                                               page_checksum_verification=True)
                    # Two row groups of one batch each, decoded at once (the second on a
                    # pool thread, each from its own file, its pages checked the same):
                    # both are done before the first is yielded, so nothing runs while
                    # the caller holds this generator, which holds one batch more.
                    yield from _decode_two(reader, group, other, groups[i + 1], exact)
                    i += 2
                    continue
                # One row group at a time: asked for several, pyarrow pre-buffers them all.
                for batch in reader.iter_batches(batch_size=batch_rows(group),
                                                 row_groups=[group], columns=SCHEMA.names,
                                                 use_threads=threads):
                    yield _storage_table(batch, exact)
                i += 1
        except Exception as e:
            raise _part_error(e, f"{described} ({part.encoded_size} bytes)") from None

    def footer(self, part: HollowPart, where: str) -> pq.FileMetaData:
        """A part's Parquet file metadata, its footer checked (:func:`read_footer`, the
        part cache first, the store itself to read again)."""
        return read_footer(self.store(part.store, cached=True), self.store(part.store),
                           part, where)

    def _check_whole(self, part: HollowPart, where: str) -> pq.FileMetaData | None:
        """Check a part of up to :data:`WHOLE_FETCH_MAX_BYTES` against its CRC-32 (as
        :meth:`fetch_part` checks a whole read: a mismatch is read again once, from the
        store itself, before the bytes are judged changed) and return its file metadata,
        parsed from the footer of the bytes checked (None: the part records no CRC-32).

        One ranged read of the whole part (from the part cache when it holds it; not
        admitted to it), released before the part is decoded a buffer at a time: a
        stream holds one part of at most that size beyond its read buffers while it
        checks it. Reading it in buffer-sized pieces instead cost a merge of 64 runs of
        2.6 MiB parts on a store without local files 1.8x the ranged reads."""
        if part.crc32 is None:
            return None
        data = read_checked(self.store(part.store, cached=True), self.store(part.store),
                            part, where, _read_whole)
        footer = footer_bytes(data)
        if footer is None:
            raise CorruptPart(f"corrupt Parquet part {part.key!r} in the {part.store} blob "
                              f"store ({where}): its last bytes are no Parquet footer")
        return pq.read_metadata(pa.BufferReader(footer))

    def _open(self, part: HollowPart, where: str) -> pa.NativeFile | _BlobFile:
        """A seekable file over a part: the part cache's copy when it holds one, else
        the local file itself, natively, when the store keeps one (no Python on the read
        path), else ranged gets.

        The cache's copy first: the part's check (:meth:`footer`, :meth:`_check_whole`)
        read that copy when the cache held it, so its pages must be read from it too. A
        store's file beside it is other bytes when the stored object changed after the
        copy was cached (a bad restore): another valid part there passes the checked
        footer's offsets and its own pages' CRC-32s, and its rows would be read as this
        part's. The copy is checked whole first (it is in memory: a few ms a part, once per
        cached copy), since a footer check passes a copy that went bad in a page: such a
        copy is dropped for the store's bytes, as a whole read drops it, not failing every
        read of an intact part while it stays cached."""
        blob = self.store(part.store, cached=True)
        if isinstance(blob, CachingBlob):
            held = blob.held_matching(part.key, part.crc32)
            if held is not None:
                return pa.BufferReader(held)
        path = blob.local_file(part.key)
        if path is not None:
            try:
                return pa.OSFile(path)
            except FileNotFoundError:
                raise PartMissing(f"part {part.key!r} ({where}) is missing from the "
                                  f"{part.store} blob store") from None
        return _BlobFile(blob, part, where)

    def stream_run(self, run: Sequence[Part], where: str, batch_bytes: int,
                   read_bytes: int = WHOLE_FETCH_MAX_BYTES, *,
                   key_lower: bytes | None = None, key_upper: bytes | None = None,
                   since: int | None = None, as_of: int | None = None,
                   decode_threads: bool = False) -> Iterator[pa.Table]:
        """A sorted run's updates in order (:meth:`stream_part` part after part) with
        times advanced to ``since`` or ``as_of`` (:func:`advance_times`), without the
        rows outside ``[key_lower, key_upper)`` and without parts whose updates are all
        later than ``as_of``."""
        for part in run:
            if as_of is not None and isinstance(part, HollowPart) and part.min_time > as_of:
                continue
            for chunk in self.stream_part(part, where, batch_bytes, key_lower, key_upper,
                                          read_bytes, decode_threads):
                if key_upper is not None and chunk.num_rows and \
                        chunk.column("k")[0].as_py() >= key_upper:
                    return  # a run is in key order: nothing further is in range
                yield advance_times(in_key_range(chunk, key_lower, key_upper),
                                    since=since, as_of=as_of)


def read_checked(blob: Blob, store: Blob, part: HollowPart, where: str,
                 read: Callable[[Blob, HollowPart, str], bytes]) -> bytes:
    """``part``'s bytes read from ``blob`` by ``read``, checked against its CRC-32.

    One read that went wrong (or a copy of one, cached) must not fail a read, or every
    later one, of a part that is intact: bytes that do not match are read again once
    from ``store`` (the store itself; a copy in ``blob``, a cache, is dropped) before
    they are judged changed (:class:`PartChecksumMismatch`)."""
    data = read(blob, part, where)
    if not checksum.matches(data, part.crc32):
        if isinstance(blob, CachingBlob):
            blob.forget(part.key)
        data = read(store, part, where)
        checksum.check(data, part.crc32, f"part {part.key!r} in the {part.store} blob "
                       f"store ({where})", PartChecksumMismatch)
    return data


def _read_whole(blob: Blob, part: HollowPart, where: str) -> bytes:
    """The part's stored bytes with one ranged read of one byte more than its recorded
    size (so a longer object is found too)."""
    data = blob.get_range(part.key, 0, part.encoded_size + 1)
    if data is None:
        raise PartMissing(f"part {part.key!r} ({where}) is missing from the "
                          f"{part.store} blob store")
    return data


#: The fewest rows decoded from a part at a time.
MIN_BATCH_ROWS = 1024


def _batch_rows(batch_bytes: int, nbytes: int, num_rows: int) -> int:
    """Rows of about ``batch_bytes`` when ``num_rows`` take ``nbytes`` (at least
    :data:`MIN_BATCH_ROWS`)."""
    return max(1, MIN_BATCH_ROWS, batch_bytes // max(1, nbytes // max(1, num_rows)))


def in_key_range(table: pa.Table, lower: bytes | None, upper: bytes | None) -> pa.Table:
    """The rows of ``table`` (sorted by key) whose key ``k`` has ``lower <= k < upper``
    (None: unbounded on that side)."""
    if not table.num_rows or (lower is None and upper is None):
        return table
    keys = table.column("k")
    first, last = keys[0].as_py(), keys[-1].as_py()
    if (lower is None or first >= lower) and (upper is None or last < upper):
        return table
    mask = None
    if lower is not None:
        mask = pc.greater_equal(keys, pa.scalar(lower, pa.binary()))
    if upper is not None:
        below = pc.less(keys, pa.scalar(upper, pa.binary()))
        mask = below if mask is None else pc.and_(mask, below)
    return table.filter(mask)


def key_starts(blobs: ShardBlobs, part: HollowPart, where: str,
               small_part_samples: int = 0) -> list[tuple[bytes, int]]:
    """``(lowest key, bytes)`` of each row group of a part, from its Parquet footer (one
    or two ranged reads); the part's own lowest key and size when its row groups carry
    no key statistics, or when it is small (whole-fetched), unless
    ``small_part_samples``: then every ``1/small_part_samples`` of its keys (its few row
    groups would cut it too coarsely; it is small to read)."""
    whole = [(part.min_key or b"", part.encoded_size)]
    if part.encoded_size <= WHOLE_FETCH_MAX_BYTES:
        if not small_part_samples:
            return whole
        keys = blobs.fetch_part(part, where).column("k")
        step = max(1, len(keys) // small_part_samples)
        samples = [keys[i].as_py() for i in range(0, len(keys), step)]
        return [(key, part.encoded_size // max(1, len(samples))) for key in samples]
    meta = blobs.footer(part, where)
    if "k" not in meta.schema.names:
        return whole
    k = meta.schema.names.index("k")
    starts = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        stats = group.column(k).statistics
        if stats is None or not stats.has_min_max:
            return whole
        starts.append((bytes(stats.min), group.total_byte_size))
    return starts


def split_keys(starts: list[tuple[bytes, int]], ranges: int) -> list[bytes]:
    """Up to ``ranges - 1`` keys among ``starts`` (``(key, bytes)`` where a piece of data
    starts) that cut the data into key ranges of about equal bytes; increasing, and
    never the lowest key (a range may not be empty by construction). The one choice of
    split points, for Spark compaction's key-range tasks and Spark reads' partitions."""
    if ranges < 2 or not starts:
        return []
    ordered = sorted(starts)
    total = sum(size for _, size in ordered)
    points: list[bytes] = []
    seen = 0
    for key, size in ordered:
        if len(points) == ranges - 1:
            break
        if seen >= total * (len(points) + 1) / ranges and (not points or key > points[-1]) \
                and key > ordered[0][0]:
            points.append(key)
        seen += size
    return points


def _storage_table(batch: pa.RecordBatch, exact: bool) -> pa.Table:
    """A batch of a part's k/v/t/d columns as a table of :data:`SCHEMA` (cast only
    when stored as other types)."""
    return pa.Table.from_arrays(batch.columns, schema=SCHEMA) if exact \
        else pa.Table.from_batches([batch]).cast(SCHEMA)


def _decode_group(reader: pq.ParquetFile, group: int, exact: bool) -> pa.Table:
    """Row group ``group`` of ``reader`` decoded as one table (on this thread)."""
    rows = reader.metadata.row_group(group).num_rows
    batches = reader.iter_batches(batch_size=max(1, rows), row_groups=[group],
                                  columns=SCHEMA.names, use_threads=False)
    tables = [_storage_table(batch, exact) for batch in batches]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


#: Threads that decode the second row group of a pair (:meth:`ShardBlobs.stream_part`).
_DECODE_POOL = SharedPool(4, "persist-decode")


def _decode_two(first: pq.ParquetFile, group: int, second: pq.ParquetFile, next_group: int,
                exact: bool) -> list[pa.Table]:
    """Row groups ``group`` of ``first`` and ``next_group`` of ``second`` decoded at
    once, the second on :data:`_DECODE_POOL`; it has finished (or failed) when this
    returns or raises."""
    pending = _DECODE_POOL.get().submit(_decode_group, second, next_group, exact)
    try:
        mine = _decode_group(first, group, exact)
    finally:
        futures.wait([pending])
    return [mine, pending.result()]


def _largest_column_chunk(meta: pq.FileMetaData, groups: Sequence[int]) -> int:
    """The most bytes a column of ``SCHEMA`` takes in one of row groups ``groups``."""
    names = meta.schema.names
    columns = [names.index(name) for name in SCHEMA.names if name in names]
    return max((meta.row_group(g).column(c).total_compressed_size
                for g in groups for c in columns), default=0)


def _row_groups_from(meta: pq.FileMetaData, key_lower: bytes | None,
                     key_upper: bytes | None,
                     keys: Sequence[bytes] | None = None) -> list[int]:
    """The row groups that may hold a key in ``[key_lower, key_upper)`` (and, if
    ``keys`` is given, sorted, one of them)."""
    groups = list(range(meta.num_row_groups))
    if (key_lower is None and key_upper is None and keys is None) or \
            "k" not in meta.schema.names:
        return groups
    k = meta.schema.names.index("k")
    keep = []
    for g in groups:
        stats = meta.row_group(g).column(k).statistics
        if stats is not None and stats.has_min_max:
            if key_lower is not None and stats.max < key_lower:
                continue
            if key_upper is not None and stats.min >= key_upper:
                break  # the row groups of a part are in key order
            if keys is not None:
                i = bisect.bisect_left(keys, stats.min)
                if i == len(keys) or keys[i] > stats.max:
                    continue
        keep.append(g)
    return keep


#: Bytes read from a part's end for its footer: the whole footer in one ranged read
#: unless its file metadata is larger (as Parquet's own readers read 64 KiB first).
FOOTER_READ_BYTES = 64 << 10

#: The magic that ends (and starts) a Parquet file, after its metadata's length.
_PARQUET_MAGIC = b"PAR1"


def _footer_length(tail: bytes | memoryview) -> int | None:
    """The length of the Parquet footer that ``tail`` (a file's last bytes) ends in:
    its file metadata, the metadata's 4-byte little-endian length and the magic; None
    when ``tail`` does not end in the magic."""
    if len(tail) < 8 or bytes(tail[-4:]) != _PARQUET_MAGIC:
        return None
    return int.from_bytes(tail[-8:-4], "little") + 8


def footer_bytes(data: bytes) -> memoryview | None:
    """The footer of a Parquet file ``data``: its last bytes from its file metadata
    through the metadata's length and the closing ``PAR1``, the exact range a part's
    ``footer_crc32`` covers (what :meth:`ShardBlobs.footer` reads); None when ``data``
    does not end in a footer."""
    return _footer_in(data, len(data))


def _footer_in(tail: bytes, size: int) -> memoryview | None:
    """The footer that ``tail``, the last bytes of a file of ``size`` bytes, ends in;
    None when it ends in none, or in one longer than itself or than the file allows."""
    length = _footer_length(tail)
    if length is None or length > len(tail) or length + len(_PARQUET_MAGIC) > size:
        return None
    return memoryview(tail)[len(tail) - length:]


def read_footer(blob: Blob, store: Blob, part: HollowPart, where: str) -> pq.FileMetaData:
    """A part's Parquet file metadata (schema, row groups' offsets and key statistics),
    read from ``blob`` with one ranged read from its end (two when its footer is larger
    than :data:`FOOTER_READ_BYTES`) and checked against the part's recorded
    ``footer_crc32``: the one read of a footer for every read that does not read the
    whole part, so never checks its whole CRC-32 (streaming in row groups, key lookups,
    split points, a read plan's table).

    Footer bytes that do not match are read again once, from ``store`` (the store
    itself; a copy of the part in ``blob``, a cache, is dropped), before they are judged
    changed, as :meth:`ShardBlobs.fetch_part` does. Raises :class:`PartChecksumMismatch`
    naming the part when they still do not match, :class:`CorruptPart` when a part that
    records no footer CRC-32 (written before it was) has no readable footer, and
    :class:`PartMissing` when it is gone.
    """
    described = f"{part.key!r} in the {part.store} blob store"
    try:
        found = _read_footer(blob, part, where)
        if part.footer_crc32 is not None and \
                (found is None or not checksum.matches(found, part.footer_crc32)):
            if isinstance(blob, CachingBlob):
                blob.forget(part.key)
            found = _read_footer(store, part, where)
            what = f"the footer of part {described} ({where})"
            if found is None:
                raise PartChecksumMismatch(
                    f"{what}: its last bytes are no Parquet footer (a 4-byte length and "
                    f"{_PARQUET_MAGIC!r}), CRC-32 {part.footer_crc32:08x} recorded when "
                    "it was written; the stored object changed after the write (rot, "
                    "truncation, or another object put under its key)")
            checksum.check(found, part.footer_crc32, what, PartChecksumMismatch)
        if found is None:
            raise CorruptPart(f"corrupt Parquet part {described}: its last bytes are no "
                              f"Parquet footer (a 4-byte length and {_PARQUET_MAGIC!r})")
        return pq.read_metadata(pa.BufferReader(found))
    except Exception as e:
        raise _part_error(e, f"{described} ({part.encoded_size} bytes)") from None


def _read_footer(blob: Blob, part: HollowPart, where: str) -> memoryview | None:
    """A part's :func:`footer_bytes` read from ``blob`` with ranged reads (None when
    its last bytes are no footer)."""
    size = part.encoded_size
    first = min(size, FOOTER_READ_BYTES)
    tail = blob.get_range(part.key, size - first, first)
    length = None if tail is None else _footer_length(tail)
    if tail is not None and length is not None and \
            len(tail) < length <= size - len(_PARQUET_MAGIC):
        more = blob.get_range(part.key, size - length, length - len(tail))
        tail = None if more is None else more + tail
    if tail is None:
        raise PartMissing(f"part {part.key!r} ({where}) is missing from the "
                          f"{part.store} blob store")
    return _footer_in(tail, size)


class _BlobFile(io.RawIOBase):
    """A read-only, seekable file over one part, read with ranged gets."""

    def __init__(self, blob: Blob, part: HollowPart, where: str) -> None:
        super().__init__()
        self._blob = blob
        self._part = part
        self._where = where
        self._size = part.encoded_size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = min(len(buffer), self._size - self._pos)
        if want <= 0:
            return 0
        data = self._blob.get_range(self._part.key, self._pos, want)
        if data is None:
            raise PartMissing(f"part {self._part.key!r} ({self._where}) is missing from the "
                              f"{self._part.store} blob store")
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)


#: The Parquet footer's key-value metadata that names the part's blob key.
PART_KEY_METADATA = b"persist_pipeline.part_key"


class PartWriter:
    """Writes a stream of sorted, consolidated k/v/t/d tables as Parquet parts.

    Each part holds about ``target_size_bytes`` of encoded data (the last one less);
    tables must arrive in ``(k, v, t)`` order, so the parts form one sorted run. Every
    writer writes fresh keys, even for a batch id written before (a retried write).
    """

    def __init__(self, shard_id: str, batch_id: str, blob: Blob, store: Store,
                 target_size_bytes: int, schema: ShardSchema | None = None) -> None:
        self._shard_id = shard_id
        self._schema = schema
        self._file_schema = SCHEMA if schema is None else pa.schema(
            [*SCHEMA, *schema.key, *schema.value], metadata=SCHEMA.metadata)
        self._batch_id = batch_id
        self._blob = blob
        self._store: Store = store
        self._target = max(1, target_size_bytes)
        self._nonce = paths.new_nonce()
        self._parts: list[HollowPart] = []
        self._pending: list[pa.Table] = []
        self._pending_bytes = 0
        self._sink: io.BytesIO | None = None
        self._writer: pq.ParquetWriter | None = None
        self._rows = 0
        self._min_time = 0
        self._max_time = 0
        self._first_key = b""
        self._last_key = b""

    @property
    def parts(self) -> tuple[HollowPart, ...]:
        """The parts written so far."""
        return tuple(self._parts)

    def write(self, table: pa.Table) -> None:
        """Append ``table`` (which sorts after everything written before)."""
        if table.num_rows == 0:
            return
        self._pending.append(table)
        self._pending_bytes += table.nbytes
        if self._pending_bytes >= min(self._target, _ROW_GROUP_BYTES):
            self._encode_pending()

    def finish(self) -> tuple[HollowPart, ...]:
        """Write what is buffered; return every part, in key order."""
        self._encode_pending()
        self._flush_part()
        return tuple(self._parts)

    def _encode_pending(self) -> None:
        if not self._pending:
            return
        table = pa.concat_tables(self._pending).cast(SCHEMA)
        self._pending, self._pending_bytes = [], 0
        per_row = max(1, table.nbytes // table.num_rows)
        step = max(1, min(self._target, _ROW_GROUP_BYTES) // per_row)
        for start in range(0, table.num_rows, step):
            piece = table.slice(start, step)
            if self._writer is None:
                self._sink = io.BytesIO()
                options = parquet_write_options(piece)
                del options["row_group_size"]
                # The footer names the part's key, so that no two parts' footers are
                # alike: reads in row groups check the footer, not the whole part, and
                # another part over the same keys, times and value sizes had the same
                # footer byte for byte (pages with their own valid CRC-32s): put under
                # this key, it passed as this part.
                schema = self._file_schema.with_metadata(
                    {**(self._file_schema.metadata or {}),
                     PART_KEY_METADATA: self._part_key().encode()})
                self._writer = pq.ParquetWriter(self._sink, schema, **options)
            assert self._sink is not None
            self._writer.write_table(self._with_typed_columns(piece), row_group_size=step)
            self._track(piece)
            if self._sink.tell() >= self._target:
                self._flush_part()

    def _with_typed_columns(self, piece: pa.Table) -> pa.Table:
        """A typed shard's parts carry its key and value columns beside k/v (decoded
        from them), so that other engines read real types."""
        if self._schema is None:
            return piece
        typed = self._schema.decode(piece, f"a part of shard {self._shard_id}")
        columns = [*piece.columns, *typed.columns[:len(self._schema.columns)]]
        return pa.Table.from_arrays(columns, schema=self._file_schema)

    def _track(self, piece: pa.Table) -> None:
        times = pc.min_max(piece.column("t")).as_py()
        keys = piece.column("k")
        if self._rows == 0:
            self._min_time, self._max_time = int(times["min"]), int(times["max"])
            self._first_key = keys[0].as_py()
        else:
            self._min_time = min(self._min_time, int(times["min"]))
            self._max_time = max(self._max_time, int(times["max"]))
        self._last_key = keys[-1].as_py()
        self._rows += piece.num_rows

    def _part_key(self) -> str:
        """The blob key of the part being written."""
        return paths.part_key(self._shard_id, self._batch_id, self._nonce, len(self._parts))

    def _flush_part(self) -> None:
        if self._writer is None:
            return
        assert self._sink is not None
        self._writer.close()
        data = self._sink.getvalue()
        self._writer, self._sink = None, None
        key = self._part_key()
        self._blob.set(key, data)
        min_key, max_key = key_bounds(self._first_key, self._last_key)
        footer = footer_bytes(data)
        assert footer is not None  # Parquet's writer closed the file with one
        self._parts.append(HollowPart(key, self._store, len(data), self._rows,
                                      self._min_time, self._max_time, min_key, max_key,
                                      checksum.crc32(data), checksum.crc32(footer)))
        self._rows = 0


def write_parts(table: pa.Table, shard_id: str, batch_id: str, blob: Blob, store: Store,
                target_size_bytes: int, schema: ShardSchema | None = None
                ) -> tuple[HollowPart, ...]:
    """Write a consolidated table as Parquet parts of about ``target_size_bytes`` each
    (with a typed shard's columns beside k/v when ``schema`` is given)."""
    writer = PartWriter(shard_id, batch_id, blob, store, target_size_bytes, schema)
    writer.write(table)
    return writer.finish()
