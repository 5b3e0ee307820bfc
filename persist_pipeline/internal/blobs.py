"""One shard location's blob stores: main, optional WAL, and the LRU part cache."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.blob.base import Blob
from persist_pipeline.exceptions import CorruptPart
from persist_pipeline.internal import paths
from persist_pipeline.internal.state import HollowPart, InlinePart, Part, Store
from persist_pipeline.updates import decode_inline, decode_parquet, encode_parquet, split_by_size


def write_parts(table: pa.Table, shard_id: str, batch_id: str, blob: Blob, store: Store,
                target_size_bytes: int) -> tuple[HollowPart, ...]:
    """Write a consolidated table as Parquet parts of about ``target_size_bytes`` each.

    Every call writes fresh keys, even for a batch id written before (a retried write).
    """
    parts = []
    nonce = paths.new_nonce()
    for i, piece in enumerate(split_by_size(table, target_size_bytes)):
        data = encode_parquet(piece)
        key = paths.part_key(shard_id, batch_id, nonce, i)
        blob.set(key, data)
        times = pc.min_max(piece.column("t")).as_py()
        parts.append(HollowPart(key, store, len(data), piece.num_rows, int(times["min"]),
                                int(times["max"])))
    return tuple(parts)


@dataclass
class ShardBlobs:
    """The blob stores of a persist location.

    Attributes:
        main: where compaction output, large writes and rollups go.
        wal: the optional low-latency store for fresh write parts (seed 004).
        cached_main / cached_wal: the same stores behind the LRU cache, for reads.
    """

    main: Blob
    wal: Blob | None
    cached_main: Blob
    cached_wal: Blob | None

    def store(self, store: Store, cached: bool = False) -> Blob:
        if store == "wal":
            blob = self.cached_wal if cached else self.wal
            if blob is None:
                raise CorruptPart("a part lives in the WAL blob store, but none is configured "
                                  "(pass wal_blob_uri / PERSIST_WAL_BLOB_URI)")
            return blob
        return self.cached_main if cached else self.main

    def fetch_part(self, part: Part, where: str) -> pa.Table:
        """Decode a part to a k/v/t/d table; raises :class:`CorruptPart` if unreadable."""
        if isinstance(part, InlinePart):
            return decode_inline(part.updates, f"{part.part_id} ({where})")
        assert isinstance(part, HollowPart)
        data = self.store(part.store, cached=True).get(part.key)
        if data is None:
            raise CorruptPart(f"part {part.key!r} ({where}) is missing from the "
                              f"{part.store} blob store")
        return decode_parquet(data, f"{part.key!r} in the {part.store} blob store")
