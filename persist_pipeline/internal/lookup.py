"""Point lookups by key: the current rows of some keys, for upserts and deletes.

Only parts whose recorded key bounds can hold one of the keys are read: small ones whole,
large ones only in the row groups whose key statistics span one of the keys; both are
kept decoded in the client's bounded LRU (:class:`~persist_pipeline.internal.blobs.
DecodedParts`), so repeated upserts do not decode the same Parquet again.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.frontier import MAX_TIME
from persist_pipeline.internal.blobs import WHOLE_FETCH_MAX_BYTES, ShardBlobs
from persist_pipeline.internal.state import HollowPart, InlinePart, State
from persist_pipeline.updates import SCHEMA, consolidate, empty_table, naming_shard


def _may_hold_one_of(part: HollowPart, keys: Sequence[bytes]) -> bool:
    """Whether one of ``keys`` (sorted) lies within the part's recorded key bounds."""
    lo = 0 if part.min_key is None else bisect.bisect_left(keys, part.min_key)
    hi = len(keys) if part.max_key is None else bisect.bisect_right(keys, part.max_key)
    return lo < hi


def _part_rows(blobs: ShardBlobs, part: HollowPart, keys: Sequence[bytes],
               key_set: pa.Array, where: str) -> list[pa.Table]:
    if not _may_hold_one_of(part, keys):
        return []
    if part.encoded_size <= WHOLE_FETCH_MAX_BYTES:
        tables: Iterable[pa.Table] = [blobs.decoded.get(blobs, part, where)]
    else:
        tables = blobs.decoded.row_groups(blobs, part, where, keys)
    out = []
    for table in tables:
        found = table.filter(pc.is_in(table.column("k"), value_set=key_set))
        if found.num_rows:
            out.append(found)
    return out


def current_rows(blobs: ShardBlobs, state: State, keys: Sequence[bytes]) -> pa.Table:
    """Every ``(k, v)`` of ``keys`` with its accumulated diff over all of ``state``'s
    updates (every time below its upper), zero sums dropped: the keys' rows as of
    ``upper - 1``. ``keys`` must be sorted and distinct.

    Raises:
        CorruptPart: a part is unreadable or missing (e.g. collected after compaction
            replaced it: the caller re-reads a newer state).
    """
    if not keys:
        return empty_table()
    key_set = pa.array(keys, pa.binary())
    where = f"shard {state.shard_id} key lookup"
    pieces: list[pa.Table] = []
    inline: list[pa.Table] = []
    for batch in state.ordered_batches:
        for part in batch.parts:
            if isinstance(part, InlinePart):
                inline.append(blobs.decoded.inline(part, where))
            else:
                pieces.extend(_part_rows(blobs, part, keys, key_set, where))
    if inline:  # many small tables: one filter over all of them
        table = pa.concat_tables(inline)
        pieces.append(table.filter(pc.is_in(table.column("k"), value_set=key_set)))
    if not pieces:
        return empty_table()
    # All times advanced to one: the sums are the multiplicities at upper - 1.
    with naming_shard(state.shard_id):
        return consolidate(pa.concat_tables(pieces).cast(SCHEMA), since=MAX_TIME)
