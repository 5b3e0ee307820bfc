"""Every blob key the library writes, in one place.

Keys are unique per write (a fresh random component), never derived from a seqno or a
token alone: a retried or slow writer must never re-create a key that GC may already
have listed, judged unreferenced and be about to delete.

Layout under a shard's prefix ``<shard_id>/``:

- ``p/<batch_id>/<nonce>-<n>.parquet``: the parts of one batch (writes and compaction);
- ``rollup/<seqno>-<nonce>.pb``: a full copy of the state at ``seqno``;
- ``clock/<nonce>``: an empty probe GC writes to read the store's clock
  (:meth:`~persist_pipeline.blob.base.Blob.clock_now`), deleted at once, or swept as
  an orphan if its writer died first.
"""

from __future__ import annotations

from persist_pipeline.ids import random_uuid


def shard_prefix(shard_id: str) -> str:
    """The prefix under which every blob of a shard lives (GC's orphan sweep lists it)."""
    return f"{shard_id}/"


def part_key(shard_id: str, batch_id: str, nonce: str, index: int) -> str:
    """The key of part ``index`` of one write of ``batch_id``."""
    return f"{shard_id}/p/{batch_id}/{nonce}-{index:04d}.parquet"


def rollup_key(shard_id: str, seqno: int) -> str:
    """A fresh key for a rollup of the state at ``seqno``."""
    return f"{shard_id}/rollup/{seqno:020d}-{new_nonce()}.pb"


def clock_probe_key(shard_id: str) -> str:
    """A fresh key for a probe of the store's clock under the shard's prefix."""
    return f"{shard_id}/clock/{new_nonce()}"


def is_rollup_key(key: str) -> bool:
    """Whether ``key`` names a rollup (rather than a part)."""
    return "/rollup/" in key


def new_nonce() -> str:
    """A random component that makes a key unique."""
    return random_uuid().hex[:16]
