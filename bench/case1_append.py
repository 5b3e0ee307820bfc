"""Case 1: small append latency (10 rows, about 1 KiB), p50/p90/p99, ours and the peers.

Rows, all in one process and one run:

- the physical limit: a bare psycopg2 compare-and-set INSERT of the same bytes as our
  consensus record (the same single statement shape as ours: insert if the head seqno is
  the expected one), durable commit, in autocommit; two variants, plain SQL at the
  server's default isolation and SERIALIZABLE with a server-side prepared statement (what
  the library sends), timed in 10 alternating blocks with our inline append (so a change
  of the machine's load hits all three alike); the faster of the two is the physical
  limit the ratios use. A non-durable commit
  (``synchronous_commit=off``) and an 8 KiB write + ``fdatasync`` show what the commit's
  flush costs on this disk;
- ours: inline on PostgreSQL (main blob on the S3 server) and on SQLite (a local
  folder), the blob path with inlining off (S3 server), and the WAL store (a local
  folder standing in for a low-latency store; main blob on the S3 server);
- deltalake append (table kept open) to a local folder and to the S3 server;
- PyIceberg append, SQL catalog on the same PostgreSQL, local warehouse;
- DuckLake with data inlining, catalog on the same PostgreSQL and on SQLite.

Our shards are rotated every ``scale.shard_rotate`` appends (untimed), so the inline
path is measured with a shard between empty and about 25% full; case 2 covers fuller.

A note gives the calling thread's CPU per call (an untimed pass after the timings) for
the SERIALIZABLE bare CaS, our inline PostgreSQL append and the same appends on
in-memory consensus: both PostgreSQL rows send one statement per call, so the gap
between their latencies is what our thread computes, and the in-memory row shows what
that computation costs when it is not interrupted by a wait for the database.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import peers
from bench.common import CaseResult, Scale, Table, Target, Timing, measure, ms, ratio
from bench.services import Services
from persist_pipeline import InlinePolicy, PersistClient, ShardId

TITLE = "Small append latency (10 rows, about 1 KiB)"

_CAS = ("INSERT INTO bare_cas (shard, seqno, data, summary) SELECT %s, %s, %s, %s "
        "WHERE (SELECT max(h.seqno) FROM bare_cas h WHERE h.shard = %s) = %s "
        "ON CONFLICT DO NOTHING")
_CAS_PREPARE = ("PREPARE bare_cas_stmt (text, bigint, bytea, bytea, bigint) AS "
                "INSERT INTO bare_cas (shard, seqno, data, summary) SELECT $1, $2, $3, $4 "
                "WHERE (SELECT max(h.seqno) FROM bare_cas h WHERE h.shard = $1) = $5 "
                "ON CONFLICT DO NOTHING")


class OurAppender:
    """Appends small batches to a shard, moving to a fresh shard every ``rotate``.

    Each batch is built before its timed call, as the bare CaS's bytes and the peers'
    tables are: the rows only, not the caller's making of them, are what is timed."""

    def __init__(self, client: PersistClient, rotate: int) -> None:
        self.client = client
        self.rotate = rotate
        self.writer: Any = None
        self.upper = 0
        self.count = 0
        self.last: Any = None
        self.batch: Any = None

    def before(self, i: int) -> None:
        """Untimed: open a writer on a fresh shard when the current one is used up, and
        build the batch of call ``i``."""
        if self.writer is None or self.count % self.rotate == 0:
            if self.writer is not None:
                self.writer.expire()
            self.writer = self.client.open_writer(ShardId.new())
            self.upper = 0
        self.batch = peers.small_batch(self.upper, seed=i)

    def __call__(self, _i: int) -> None:
        self.last = self.writer.compare_and_append(self.batch, self.upper, self.upper + 1)
        self.upper += 1
        self.count += 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.expire()


def record_size(url: str, blob_uri: str) -> tuple[int, int, int]:
    """(inline encoded bytes, consensus data bytes, summary bytes) of one small append."""
    client = PersistClient.open(url, blob_uri)
    try:
        shard = ShardId.new()
        writer = client.open_writer(shard)
        res = writer.compare_and_append(peers.small_batch(0), 0, 1)
        [rec] = client.consensus.scan(str(shard), res.seqno, 1)
        writer.expire()
        return res.encoded_bytes, len(rec.data), len(rec.summary)
    finally:
        client.close()


class BareCas:
    """Bare psycopg2 compare-and-set INSERTs of ``data``/``summary`` (see the module doc).

    Variants: ``plain`` (the server's defaults), ``serializable`` (SERIALIZABLE session
    and a server-side prepared statement, like the library), ``async``
    (``synchronous_commit=off``: not durable, a reference only). Call it to make one CaS.
    """

    def __init__(self, svc: Services, url: str, data: bytes, summary: bytes,
                 variant: str = "plain") -> None:
        self.conn = svc.pg.connect(url)
        self.cur = self.conn.cursor()
        self.data, self.summary, self.variant = data, summary, variant
        self.cur.execute("CREATE TABLE IF NOT EXISTS bare_cas (shard text, seqno bigint, "
                         "data bytea, summary bytea, PRIMARY KEY (shard, seqno))")
        self.shard = f"bare-{variant}-{time.monotonic_ns()}"
        self.cur.execute("INSERT INTO bare_cas VALUES (%s, 0, %s, %s)",
                         (self.shard, data, summary))
        if variant == "serializable":
            self.cur.execute("SET default_transaction_isolation = serializable")
            self.cur.execute(_CAS_PREPARE)
        elif variant == "async":
            self.cur.execute("SET synchronous_commit = off")
        self.seqno = 0

    def __call__(self, _i: int) -> None:
        n = self.seqno
        if self.variant == "serializable":
            self.cur.execute("EXECUTE bare_cas_stmt (%s, %s, %s, %s, %s)",
                             (self.shard, n + 1, self.data, self.summary, n))
        else:
            self.cur.execute(_CAS, (self.shard, n + 1, self.data, self.summary, self.shard, n))
        if self.cur.rowcount != 1:
            raise AssertionError("bare CaS lost: nobody else writes this shard")
        self.seqno = n + 1

    def close(self) -> None:
        self.conn.close()


def interleaved(steppers: dict[str, tuple[Callable[[int], object],
                                          Callable[[int], object] | None]],
                *, warmup: int, iters: int, blocks: int) -> dict[str, list[float]]:
    """Time several steppers in alternating blocks, so that a change of the machine's
    load during the run hits all of them alike; returns each one's samples."""
    samples: dict[str, list[float]] = {k: [] for k in steppers}
    counters = dict.fromkeys(steppers, 0)
    for key, (fn, before) in steppers.items():
        measure(fn, warmup=warmup, iters=0, before=before)
        counters[key] = warmup
    per_block = max(1, iters // blocks)
    for _ in range(blocks):
        for key, (fn, before) in steppers.items():
            offset = counters[key]

            def shifted(i: int, fn: Callable[[int], object] = fn, offset: int = offset) -> object:
                return fn(offset + i)

            def shifted_before(i: int, before: Callable[[int], object] | None = before,
                               offset: int = offset) -> object:
                return before(offset + i) if before is not None else None

            samples[key] += measure(shifted, warmup=0, iters=per_block,
                                    before=shifted_before)
            counters[key] += per_block
    return samples


def fsync_probe(folder: str, *, warmup: int, iters: int) -> list[float]:
    """An 8 KiB write plus ``fdatasync`` in ``folder`` (what a durable commit pays)."""
    fd, path = tempfile.mkstemp(dir=folder)
    block = os.urandom(8192)
    try:
        def step(i: int) -> None:
            os.pwrite(fd, block, (i % 64) * 8192)
            os.fdatasync(fd)

        return measure(step, warmup=warmup, iters=iters)
    finally:
        os.close(fd)
        os.unlink(path)


def thread_cpu(fn: Callable[[int], object], before: Callable[[int], object] | None, *,
               start: int, iters: int) -> list[float]:
    """The calling thread's CPU time of each of ``iters`` calls (an untimed pass, after
    the latency samples: reading the thread's clock is a system call of its own)."""
    samples = []
    for i in range(start, start + iters):
        if before is not None:
            before(i)
        started = time.thread_time()
        fn(i)
        samples.append(time.thread_time() - started)
    return samples


def ours(url: str, blob_uri: str, *, policy: InlinePolicy | None, rotate: int, warmup: int,
         iters: int, wal_uri: str | None = None) -> tuple[list[float], str]:
    """Our compare_and_append latencies; returns samples and the last placement."""
    client = PersistClient.open(url, blob_uri, wal_uri, inline_policy=policy or InlinePolicy())
    appender = OurAppender(client, rotate)
    try:
        samples = measure(appender, warmup=warmup, iters=iters, before=appender.before)
        return samples, appender.last.placement
    finally:
        appender.close()
        client.close()


def delta(uri: str, storage_options: dict[str, str] | None, *, warmup: int,
          iters: int) -> list[float]:
    """deltalake appends of the small batch to a table kept open."""
    table = peers.delta_open(uri, peers.as_table(peers.small_batch(0)), storage_options)
    data = [peers.as_table(peers.small_batch(i, i)) for i in range(warmup + iters)]
    return measure(lambda i: peers.delta_append(table, data[i]), warmup=warmup, iters=iters)


def iceberg(url: str, warehouse: str, *, warmup: int, iters: int) -> list[float]:
    """PyIceberg appends of the small batch (SQL catalog on PostgreSQL)."""
    from persist_pipeline.updates import SCHEMA

    table = peers.iceberg_table(url, warehouse, SCHEMA)
    data = [peers.as_table(peers.small_batch(i, i)) for i in range(warmup + iters)]
    return measure(lambda i: table.append(data[i]), warmup=warmup, iters=iters)


def ducklake(catalog: str, data_path: str, *, warmup: int, iters: int) -> tuple[list[float], int]:
    """DuckLake inlined inserts of the small batch; returns samples and data files made."""
    con = peers.ducklake_connect(catalog, data_path, inline_rows=1000)
    try:
        con.execute("CREATE TABLE lake.t (k VARCHAR, v VARCHAR, t BIGINT, d BIGINT)")
        statements = [peers.ducklake_insert_sql(peers.small_batch(i, i))
                      for i in range(warmup + iters)]
        samples = measure(lambda i: con.execute(statements[i]), warmup=warmup, iters=iters)
        files = sum(1 for p in Path(data_path).rglob("*") if p.is_file())
        return samples, files
    finally:
        con.close()


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 1 (see the module docstring)."""
    result = CaseResult("case1", TITLE)
    rows: dict[str, tuple[str, list[float]]] = {}
    notes: list[str] = []
    w, n = scale.append_warmup, scale.append_iters
    half = max(1, n // 2)
    with svc.pg.database("c1") as url:
        bucket = svc.s3.bucket("c1")
        s3_uri = svc.s3.uri(bucket, "ours")
        inline_bytes, data_bytes, summary_bytes = record_size(url, s3_uri)
        data, summary = os.urandom(data_bytes), os.urandom(summary_bytes)
        notes.append(f"Our 10-row append encodes to {inline_bytes} bytes inline; its consensus "
                     f"record is {data_bytes} bytes of state diff + {summary_bytes} bytes of "
                     "summary. The bare CaS inserts random bytes of exactly those sizes.")

        log("  fsync probe")
        rows["fsync"] = ("8 KiB write + fdatasync on this disk (reference)",
                         fsync_probe(svc.workdir, warmup=w, iters=half))
        # The durable bare variants and our inline append run in alternating blocks.
        log("  bare CaS and ours inline PostgreSQL, interleaved")
        plain = BareCas(svc, url, data, summary)
        serializable = BareCas(svc, url, data, summary, "serializable")
        client = PersistClient.open(url, s3_uri, inline_policy=InlinePolicy())
        appender = OurAppender(client, scale.shard_rotate)
        try:
            timed = interleaved({"bare": (plain, None), "bare_ser": (serializable, None),
                                 "ours_pg": (appender, appender.before)},
                                warmup=w, iters=n, blocks=10)
            cpu = {"bare_ser": thread_cpu(serializable, None, start=w + n, iters=half),
                   "ours_pg": thread_cpu(appender, appender.before, start=w + n, iters=half)}
        finally:
            appender.close()
            client.close()
            plain.close()
            serializable.close()
        rows["bare"] = ("bare psycopg2 CaS INSERT, plain SQL, default isolation",
                        timed["bare"])
        rows["bare_ser"] = ("bare CaS, SERIALIZABLE + prepared (the SQL the library sends)",
                            timed["bare_ser"])
        rows["ours_pg"] = ("ours, inline, PostgreSQL consensus (blob: S3 server)",
                           timed["ours_pg"])
        # The same appends on in-memory consensus: our Python alone, never waiting.
        mem_client = PersistClient.open("mem://", f"file://{svc.folder('c1-mem')}",
                                        inline_policy=InlinePolicy())
        mem_appender = OurAppender(mem_client, scale.shard_rotate)
        try:
            measure(mem_appender, warmup=w, iters=0, before=mem_appender.before)
            cpu["ours_mem"] = thread_cpu(mem_appender, mem_appender.before, start=w,
                                         iters=half)
        finally:
            mem_appender.close()
            mem_client.close()
        cpu_p50 = {key: Timing.of(samples).p50 for key, samples in cpu.items()}
        notes.append(
            f"The calling thread's CPU per call (p50 of {half}, an untimed pass): bare "
            f"SERIALIZABLE CaS {cpu_p50['bare_ser'] * 1e6:.0f} us, ours on PostgreSQL "
            f"{cpu_p50['ours_pg'] * 1e6:.0f} us, the same appends on in-memory consensus "
            f"{cpu_p50['ours_mem'] * 1e6:.0f} us. Ours sends one statement per append, "
            "as the bare CaS does: the gap between them is this thread's CPU, its Python "
            "running slower after each wait for the database than it does back to back.")
        async_cas = BareCas(svc, url, data, summary, "async")
        try:
            rows["bare_async"] = ("bare CaS, synchronous_commit=off (NOT durable; reference)",
                                  measure(async_cas, warmup=w, iters=half))
        finally:
            async_cas.close()
        log("  ours inline SQLite")
        sqlite_dir = svc.folder("c1-sqlite")
        rows["ours_sqlite"] = ("ours, inline, SQLite consensus (blob: local folder)",
                               ours(f"sqlite:///{sqlite_dir}/consensus.db",
                                    f"file://{sqlite_dir}/blobs", policy=None,
                                    rotate=scale.shard_rotate, warmup=w, iters=n)[0])
        s3n = scale.s3_iters
        log("  ours blob path (S3)")
        samples, placement = ours(url, svc.s3.uri(bucket, "blobpath"),
                                  policy=InlinePolicy(0, 0), rotate=scale.shard_rotate,
                                  warmup=max(2, w // 10), iters=s3n)
        assert placement == "blob", placement
        rows["ours_blob"] = ("ours, inline off: blob part on the S3 server", samples)
        log("  ours WAL store")
        samples, placement = ours(url, svc.s3.uri(bucket, "walmain"), policy=InlinePolicy(0, 0),
                                  rotate=scale.shard_rotate, warmup=max(2, w // 10),
                                  iters=s3n, wal_uri=f"file://{svc.folder('c1-wal')}")
        assert placement == "wal", placement
        rows["ours_wal"] = ("ours, inline off: WAL store (local folder; main: S3 server)",
                            samples)
        log("  deltalake local")
        rows["delta_local"] = ("deltalake append, local folder (table kept open)",
                               delta(svc.folder("c1-delta"), None, warmup=max(2, w // 10),
                                     iters=scale.delta_local_iters))
        log("  deltalake S3")
        rows["delta_s3"] = ("deltalake append, S3 server (table kept open)",
                            delta(f"s3://{bucket}/delta", svc.s3.delta_options(),
                                  warmup=max(2, w // 20), iters=s3n))
        log("  PyIceberg")
        rows["iceberg"] = ("PyIceberg append, SQL catalog on PostgreSQL, local warehouse",
                           iceberg(url, f"file://{svc.folder('c1-iceberg')}",
                                   warmup=max(2, w // 20), iters=scale.iceberg_iters))
        log("  DuckLake")
        with svc.pg.database("c1dl") as dl_url:
            samples, files = ducklake(peers.ducklake_pg_catalog(dl_url),
                                      svc.folder("c1-ducklake-pg"), warmup=max(2, w // 10),
                                      iters=scale.ducklake_iters)
        rows["ducklake_pg"] = ("DuckLake, data inlining, PostgreSQL catalog", samples)
        dl_dir = svc.folder("c1-ducklake-sqlite")
        samples, files2 = ducklake(f"sqlite:{dl_dir}/catalog.sqlite", f"{dl_dir}/data",
                                   warmup=max(2, w // 10), iters=scale.ducklake_iters)
        rows["ducklake_sqlite"] = ("DuckLake, data inlining, SQLite catalog", samples)
        notes.append(f"DuckLake loaded offline from the duckdb-ext-* wheels; its inlined "
                     f"inserts created {files + files2} data files. Keys and values are "
                     "VARCHAR literals (BLOB keys did not inline on a PostgreSQL catalog).")

    timings = {key: Timing.of(s) for key, (_, s) in rows.items()}
    # The physical limit: the faster of the two durable bare CaS variants.
    limit = min(("bare", "bare_ser"), key=lambda k: timings[k].p50)
    rows[limit] = (rows[limit][0] + " = the physical limit", rows[limit][1])
    base = timings[limit].p50
    us = timings["ours_pg"].p50
    table = Table(f"Case 1: {TITLE}",
                  ["system", "n", "p50 ms", "p90 ms", "p99 ms", "p50 / physical limit",
                   "p50 / ours (PG)"])
    order = ["fsync", "bare", "bare_ser", "bare_async", "ours_pg", "ours_sqlite", "ours_blob",
             "ours_wal", "delta_local", "delta_s3", "iceberg", "ducklake_pg",
             "ducklake_sqlite"]
    for key in order:
        t = timings[key]
        table.add(rows[key][0], t.n, ms(t.p50), ms(t.p90), ms(t.p99), ratio(t.p50, base),
                  ratio(t.p50, us))
    table.notes = [
        *notes,
        "PostgreSQL commits durably (synchronous_commit as configured, see the machine "
        "section); the S3 server is moto on loopback (about 2 ms per request whatever the "
        "size): a functional S3, not a model of S3 latency (case 8 simulates that).",
        f"Our shards are rotated every {scale.shard_rotate} appends (0-25% of the inline "
        "budget; the state rollup every 128 seqnos is a blob PUT and shows in p99).",
    ]
    result.tables.append(table)
    result.data = {key: {"label": rows[key][0], "samples": rows[key][1]} for key in order}
    over = us / base
    result.targets.append(Target(
        "1", "inline append p50 <= 2x the bare CaS INSERT (the faster durable variant)",
        "<= 2.00x", f"{over:.2f}x",
        over <= 2.0,
        "met" if over <= 2.0 else f"missed by {over / 2.0:.2f}x "
        f"({ms(us)} ms vs {ms(base * 2)} ms allowed)"))
    ser = timings["bare_ser"].p50
    over_ser = us / ser
    result.targets.append(Target(
        "1", "10-row append p50 <= 1.2x the bare SERIALIZABLE CaS the library sends (Python "
             "beyond the CaS < 0.2x of it)", "<= 1.20x",
        f"{over_ser:.2f}x ({ms(us)} vs {ms(ser)} ms)", over_ser <= 1.2,
        "met" if over_ser <= 1.2 else f"missed by {over_ser / 1.2:.2f}x (Python beyond the "
        f"CaS: {(us - ser) * 1e6:.0f} us = {us / ser - 1:.2f}x of it)"))
    speedup = timings["delta_local"].p50 / us
    result.targets.append(Target(
        "1", "inline append p50 >= 50x lower than deltalake's local append", ">= 50x",
        f"{speedup:.1f}x", speedup >= 50,
        "met" if speedup >= 50 else f"missed by {50 / speedup:.2f}x (deltalake local p50 "
        f"{ms(timings['delta_local'].p50)} ms; 50x would need ours at "
        f"{ms(timings['delta_local'].p50 / 50)} ms)"))
    return result
