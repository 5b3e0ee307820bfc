"""End-to-end example on the embedded default: SQLite consensus + local-folder blobs.

Writes small and large batches into a shard, shows where each went (inline in
consensus, or a Parquet part), fills the inline budget so a write falls through to
blob, compacts (flushing inline data out), snapshots, collects garbage and prints a
summary; then a named, typed shard with an upsert and a delete. Run with ``make quickstart``
or ``python -m persist_pipeline.examples.quickstart``.
"""

from __future__ import annotations

import argparse
import shutil
import time
from decimal import Decimal
from pathlib import Path

import pyarrow as pa

from persist_pipeline import InlinePolicy, PersistClient, ShardId, ShardSchema


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path(".persist/quickstart"),
                        help="where the SQLite file and blob folder go")
    parser.add_argument("--keep", action="store_true", help="keep data from earlier runs")
    args = parser.parse_args(argv)
    root: Path = args.dir.resolve()
    if root.exists() and not args.keep:
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    # A small inline budget (about eight of the small writes) so the example shows the
    # fall-through to blob once the shard holds all the inline bytes it may.
    policy = InlinePolicy(threshold_bytes=4096, max_bytes=4096)
    client = PersistClient.open(f"sqlite:///{root / 'consensus.db'}",
                                f"file://{root / 'blobs'}", inline_policy=policy)
    shard = ShardId.new()
    writer = client.open_writer(shard, debug="quickstart")
    reader = client.open_reader(shard, debug="quickstart")
    print(f"shard {shard} on {root}")
    print(f"{'write':>6} {'rows':>6} {'bytes':>8} {'placement':>9} {'ms':>7} {'inline total':>12}")
    upper = 0
    counts: dict[str, int] = {}
    for i in range(12):
        rows = 5000 if i == 6 else 20
        updates = [(f"user-{(i * 31 + j) % 200}".encode(), f"event-{i}-{j}".encode(),
                    upper, 1) for j in range(rows)]
        started = time.perf_counter()
        res = writer.compare_and_append(updates, expected_upper=upper, new_upper=upper + 1)
        ms = (time.perf_counter() - started) * 1000
        upper += 1
        counts[res.placement] = counts.get(res.placement, 0) + 1
        note = " (budget full: fell through)" if res.fell_back else ""
        print(f"{i:>6} {rows:>6} {res.encoded_bytes:>8} {res.placement:>9} {ms:>7.2f} "
              f"{client.inspect(shard)['inline_bytes']:>12}{note}")
    before = reader.snapshot(as_of=upper - 1)
    info = client.inspect(shard)
    print(f"\nbefore compaction: {info['parts']}, inline bytes {info['inline_bytes']}, "
          f"{info['pending_merge_requests']} pending merge requests")
    metrics = client.compact(shard)
    after = reader.snapshot(as_of=upper - 1)
    info = client.inspect(shard)
    print(f"compaction: {metrics['requests']} requests, {metrics['parts_in']} parts in -> "
          f"{metrics['parts_out']} out, inline bytes {metrics['inline_bytes_before']} -> "
          f"{metrics['inline_bytes_after']}, {metrics['rows_per_s']:.0f} rows/s")
    print(f"after compaction: {info['parts']}")
    assert before.equals(after), "compaction changed the snapshot"
    # The reader's seqno hold keeps the versions that reference the replaced parts live:
    # released, GC may delete those parts and truncate the versions.
    reader.expire()
    gc = client.gc(shard, sweep_orphans=False)
    print(f"gc: {gc['blobs_deleted']} blobs deleted, {gc['seqnos_truncated']} seqnos truncated")
    total = sum(d for d in after.column("d").to_pylist())
    print(f"\nsnapshot at {upper - 1}: {after.num_rows} distinct rows, {total} records; "
          f"identical before and after compaction")
    print(f"placements: {counts}; S3 PUTs avoided by inlining: {counts.get('inline', 0)}")
    writer.expire()
    _typed(client)
    client.close()
    return 0


def _typed(client: PersistClient) -> None:
    """A named, typed shard: columns instead of bytes, upsert and delete by key."""
    schema = ShardSchema(key=[("id", pa.int64())],
                         value=[("name", pa.string()), ("balance", pa.decimal128(12, 2))])
    customers = client.resolve("quickstart/customers", create=True)
    writer = client.open_writer(customers, schema=schema, debug="quickstart")
    writer.compare_and_append(
        pa.table({"id": [1, 2, 3], "name": ["ada", "bob", "cy"],
                  "balance": [Decimal("10.00"), Decimal("0.50"), Decimal("7.25")],
                  "t": [0, 0, 0]}), expected_upper=0, new_upper=1)
    writer.upsert(pa.table({"id": [2], "name": ["bob"], "balance": [Decimal("99.99")]}))
    result = writer.delete(pa.table({"id": [3]}))
    assert result.upper is not None
    snapshot = client.open_reader(customers).snapshot(as_of=result.upper - 1)
    print(f"\ntyped shard 'quickstart/customers' ({customers}) after an upsert and a delete:")
    for row in sorted(snapshot.to_pylist(), key=lambda r: r["id"]):
        print(f"  id={row['id']} name={row['name']} balance={row['balance']} d={row['d']}")
    writer.expire()


if __name__ == "__main__":
    raise SystemExit(main())
