"""Case 7: object-store cost of small appends: S3 requests and objects created.

Every system makes ``scale.cost_appends`` small appends (10 rows, about 1 KiB) against
the S3 server, whose requests are counted by kind (PUT, GET, LIST, ...), then runs its
compaction / maintenance, and the requests and live objects are counted again. Numbers
are scaled to 1,000 appends.

- ours inline (PostgreSQL consensus, default inline policy): the state rollup every 128
  seqnos is a PUT; writes past the 1 MiB inline budget fall through to blob parts.
  Maintenance: ``client.compact`` then ``client.gc``.
- ours with inlining off (one Parquet part per append). Same maintenance.
- deltalake (table kept open, conditional-PUT commits): a data file and a commit file per
  append, checkpoints. Maintenance: ``optimize.compact()``, a checkpoint, and
  ``vacuum(retention_hours=0)``.
- PyIceberg (SQL catalog on PostgreSQL, warehouse on the S3 server): data file, manifest,
  manifest list and metadata file per append. PyIceberg has no data-file compaction: the
  maintenance here is an ``overwrite`` of the table with its own content (one new data
  file) and ``expire_snapshots``; it has no orphan-file removal, so replaced files stay.
- DuckLake (PostgreSQL catalog, data inlining on, local data path since its S3 access
  needs the httpfs extension): files created instead of PUTs; maintenance:
  ``ducklake_flush_inlined_data``.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import peers
from bench.common import CaseResult, Scale, Table
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient, ShardId
from persist_pipeline.updates import SCHEMA

TITLE = "Object-store cost of small appends (S3 requests and objects)"

_KINDS = ("PUT", "PART", "POST", "GET", "HEAD", "LIST", "DELETE")


class Meter:
    """Requests seen by the main S3 endpoint between two points, and live objects."""

    def __init__(self, svc: Services, bucket: str) -> None:
        self.svc = svc
        self.bucket = bucket
        self._start = svc.s3.counts(["main"])

    def take(self) -> tuple[Counter[str], int]:
        """Requests since the last ``take`` (or creation), and live objects now."""
        now = self.svc.s3.counts(["main"])
        delta = Counter({k: now[k] - self._start[k] for k in now})
        objects = len(self.svc.s3.objects(self.bucket))
        # Listing the objects is itself a request: do not count it next time.
        self._start = self.svc.s3.counts(["main"])
        return delta, objects


def _ours(svc: Services, url: str, n: int, policy: InlinePolicy) -> list[tuple[str, Any]]:
    bucket = svc.s3.bucket("c7-ours")
    meter = Meter(svc, bucket)
    client = PersistClient.open(url, svc.s3.uri(bucket), inline_policy=policy)
    try:
        shard = ShardId.new()
        writer = client.open_writer(shard)
        places: Counter[str] = Counter()
        for i in range(n):
            places[writer.compare_and_append(peers.small_batch(i, seed=i), i, i + 1)
                   .placement] += 1
        writer.expire()
        appended = meter.take()
        client.compact(shard)
        client.gc(shard)
        maintained = meter.take()
    finally:
        client.close()
    where = ", ".join(f"{v} {k}" for k, v in sorted(places.items()))
    return [(f"appends ({where})", appended), ("compact + gc", maintained)]


def _delta(svc: Services, n: int) -> list[tuple[str, Any]]:
    bucket = svc.s3.bucket("c7-delta")
    uri = f"s3://{bucket}/delta"
    meter = Meter(svc, bucket)
    table = peers.delta_open(uri, peers.as_table(peers.small_batch(0)), svc.s3.delta_options())
    for i in range(1, n):
        peers.delta_append(table, peers.as_table(peers.small_batch(i, seed=i)))
    appended = meter.take()
    table.optimize.compact()
    table.create_checkpoint()
    table.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
    maintained = meter.take()
    return [("appends", appended), ("optimize + checkpoint + vacuum", maintained)]


def _iceberg(svc: Services, url: str, n: int) -> list[tuple[str, Any]]:
    bucket = svc.s3.bucket("c7-iceberg")
    meter = Meter(svc, bucket)
    table = peers.iceberg_table(url, f"s3://{bucket}/warehouse", SCHEMA,
                                svc.s3.iceberg_properties())
    meter.take()  # table creation is not an append
    for i in range(n):
        table.append(peers.as_table(peers.small_batch(i, seed=i)))
    appended = meter.take()
    table.overwrite(table.scan().to_arrow())
    table.maintenance.expire_snapshots().older_than(
        datetime.datetime.now(datetime.UTC)).commit()
    maintained = meter.take()
    return [("appends", appended), ("overwrite + expire_snapshots", maintained)]


def _ducklake(svc: Services, url: str, n: int) -> tuple[list[tuple[str, Any]], str]:
    data = svc.folder("c7-ducklake")
    con = peers.ducklake_connect(peers.ducklake_pg_catalog(url), data, inline_rows=1000)

    def files() -> int:
        return sum(1 for p in Path(data).rglob("*") if p.is_file())

    try:
        con.execute("CREATE TABLE lake.t (k VARCHAR, v VARCHAR, t BIGINT, d BIGINT)")
        for i in range(n):
            con.execute(peers.ducklake_insert_sql(peers.small_batch(i, seed=i)))
        appended = files()
        note = ""
        try:
            con.execute("CALL ducklake_flush_inlined_data('lake')")
        except Exception as exc:  # an older DuckLake without the flush
            note = f"ducklake_flush_inlined_data failed: {type(exc).__name__}: {exc}"
        flushed = files()
    finally:
        con.close()
    return ([("appends", (Counter({"PUT": appended}), appended)),
             ("flush inlined data", (Counter({"PUT": flushed - appended}), flushed))], note)


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 7 (see the module docstring)."""
    n = scale.cost_appends
    per = 1000 / n
    result = CaseResult("case7", TITLE)
    table = Table(f"Case 7: {TITLE} ({n} appends, scaled to 1,000)",
                  ["system", "phase", "PUT+POST / 1k appends", "LIST / 1k", "GET+HEAD / 1k",
                   "DELETE / 1k", "PUT-class / append", "live objects after"])
    data: dict[str, list[dict[str, Any]]] = {}
    with svc.pg.database("c7") as url:
        systems: list[tuple[str, list[tuple[str, Any]]]] = []
        log("  ours inline")
        systems.append(("ours, inline (PostgreSQL + S3)", _ours(svc, url, n, InlinePolicy())))
        log("  ours blob path")
        systems.append(("ours, inline off (PostgreSQL + S3)",
                        _ours(svc, url, n, InlinePolicy(0, 0))))
        log("  deltalake")
        systems.append(("deltalake (S3)", _delta(svc, n)))
        log("  PyIceberg")
        systems.append(("PyIceberg (SQL catalog on PostgreSQL, S3 warehouse)",
                        _iceberg(svc, url, n)))
        log("  DuckLake")
        with svc.pg.database("c7dl") as dl_url:
            ducklake_rows, note = _ducklake(svc, dl_url, n)
        systems.append(("DuckLake (PostgreSQL catalog, local data path: files, not PUTs)",
                        ducklake_rows))
    for name, phases in systems:
        data[name] = []
        for i, (phase, (counts, objects)) in enumerate(phases):
            puts = (counts["PUT"] + counts["PART"] + counts["POST"]) * per
            gets = (counts["GET"] + counts["HEAD"]) * per
            lists = counts["LIST"] * per
            table.add(name if i == 0 else "", phase, f"{puts:.0f}", f"{lists:.0f}",
                      f"{gets:.0f}", f"{counts['DELETE'] * per:.0f}",
                      f"{(puts + lists) / 1000:.2f}" if i == 0 else "", objects)
            data[name].append({"phase": phase, "puts_per_1k": puts, "gets_per_1k": gets,
                               "objects": objects, "counts": dict(counts)})
    table.notes += [
        "PUT+POST includes multipart uploads (PyIceberg's pyarrow file system uploads "
        "each file as create + part + complete) and multi-object deletes. PUT-class = "
        "PUT, POST and LIST, the requests S3 bills at the higher rate. Live objects are "
        "counted after each phase (not scaled).",
        "Ours: GC deletes replaced parts once a state rollup newer than the compaction "
        "exists (every 128 seqnos), so right after compact + gc they may still be live.",
        "Ours inline: the PUTs while appending are state rollups (every 128 seqnos) and "
        "writes that fell through to blob once the shard held 1 MiB inline; a pipeline "
        "compacts at the sensor's high-water mark (75%) before that.",
    ]
    if note:
        table.notes.append(note)
    result.tables.append(table)
    result.data = data
    return result
