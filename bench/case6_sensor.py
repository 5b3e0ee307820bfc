"""Case 6: the cost of a sensor tick at 100, 1,000 and 10,000 shards.

Shards are created for real (``open_writer`` + one small inline append each) in one
PostgreSQL database, and two things are timed at each count:

- ``client.shard_summaries()`` on a warm client: the one consensus query every
  shard-level sensor makes (``list_heads``: one LATERAL probe per registered shard);
- the Dagster ``inline_pressure_sensor`` of ``assets/compaction_sensors.py`` evaluated the way the
  daemon does it: a fresh sensor context per tick, so the ``persist`` resource opens a new
  :class:`PersistClient` (engine, connection, dialect set-up, CREATE TABLE IF NOT EXISTS)
  before its one summary query; every shard is configured in the sensor.

SQL statements are counted on the client side: a SQLAlchemy pool ``connect`` listener
gives every new psycopg2 connection a cursor class that counts ``execute`` calls (the
library executes on raw DBAPI cursors, which SQLAlchemy's ``before_cursor_execute`` event
does not see).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg2.extensions
from sqlalchemy import event
from sqlalchemy.pool import Pool

from bench import peers
from bench.common import CaseResult, Scale, Table, Target, Timing, measure, ms, ratio
from bench.services import Services
from persist_pipeline import PersistClient, ShardId

TITLE = "Sensor tick cost (shard summaries) by number of shards"


class StatementCounter:
    """Counts statements executed on psycopg2 connections opened while installed."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        counter = self

        class CountingCursor(psycopg2.extensions.cursor):
            def execute(self, query: Any, vars: Any = None) -> Any:
                with counter._lock:
                    counter.count += 1
                return super().execute(query, vars)

        self._cursor = CountingCursor

    def _on_connect(self, dbapi_connection: Any, _record: Any) -> None:
        if isinstance(dbapi_connection, psycopg2.extensions.connection):
            dbapi_connection.cursor_factory = self._cursor

    def install(self) -> None:
        event.listen(Pool, "connect", self._on_connect)

    def remove(self) -> None:
        event.remove(Pool, "connect", self._on_connect)


def _create_shards(client: PersistClient, n: int) -> list[str]:
    out = []
    for _ in range(n):
        shard = ShardId.new()
        writer = client.open_writer(shard)
        writer.compare_and_append(peers.small_batch(0), 0, 1)
        writer.expire()
        out.append(str(shard))
    return out


def _sensor(shard_ids: list[str]) -> Any:
    import dagster as dg

    from assets.compaction_sensors import build_inline_pressure_sensor
    from assets.pipeline_config import ShardConfig, SyntheticSource

    shards = [ShardConfig(name=f"shard_{i}", shard_id=s, source=SyntheticSource())
              for i, s in enumerate(shard_ids)]
    job = dg.define_asset_job("compaction_bench", selection=dg.AssetSelection.all())
    return build_inline_pressure_sensor(shards, high_water_fraction=0.75, interval_s=30,
                                        job=job, running=False)


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 6 (see the module docstring)."""
    import dagster as dg

    from resources.inline_policy import InlinePolicyResource
    from resources.persist import PersistResource

    result = CaseResult("case6", TITLE)
    table = Table(f"Case 6: {TITLE}",
                  ["shards", "what", "n", "p50 ms", "p90 ms", "p99 ms", "p50 / 100 shards",
                   "SQL statements / tick"])
    counter = StatementCounter()
    counter.install()
    data: list[dict[str, Any]] = []
    instance = dg.DagsterInstance.ephemeral()
    try:
        with svc.pg.database("c6") as url:
            blob = svc.s3.uri(svc.s3.bucket("c6"))
            maker = PersistClient.open(url, blob)
            client = PersistClient.open(url, blob)
            shard_ids: list[str] = []
            base: dict[str, float] = {}
            try:
                for n in scale.sensor_shards:
                    log(f"  creating shards up to {n}")
                    shard_ids += _create_shards(maker, n - len(shard_ids))
                    maker._machines.clear()  # keep the maker's memory flat
                    seen: dict[str, int] = {}
                    stmts: list[int] = []

                    def tick(_i: int, stmts: list[int] = stmts, seen: dict[str, int] = seen
                             ) -> None:
                        before = counter.count
                        summaries = client.shard_summaries()
                        stmts.append(counter.count - before)
                        seen["n"] = len(summaries)

                    samples = measure(tick, warmup=2, iters=scale.sensor_iters)
                    if seen["n"] != n:
                        raise AssertionError(f"{seen['n']} summaries for {n} shards")
                    timed = stmts[2:]
                    t = Timing.of(samples)
                    base.setdefault("summaries", t.p50)
                    table.add(n, "client.shard_summaries() (warm client)", t.n, ms(t.p50),
                              ms(t.p90), ms(t.p99), ratio(t.p50, base["summaries"]),
                              _stmts(timed))
                    data.append({"shards": n, "what": "summaries", "p50": t.p50,
                                 "p99": t.p99, "statements": timed})

                    sensor = _sensor(shard_ids)
                    persist = PersistResource(consensus_uri=url, blob_uri=blob)
                    policy = InlinePolicyResource()
                    sensor_stmts: list[int] = []
                    outcome: dict[str, Any] = {}

                    def sensor_tick(_i: int, sensor: Any = sensor, persist: Any = persist,
                                    policy: Any = policy, sensor_stmts: list[int] = sensor_stmts,
                                    outcome: dict[str, Any] = outcome) -> None:
                        before = counter.count
                        with dg.build_sensor_context(
                                instance=instance,
                                resources={"persist": persist, "inline_policy": policy}) as ctx:
                            outcome["result"] = sensor(ctx)
                        sensor_stmts.append(counter.count - before)

                    samples = measure(sensor_tick, warmup=1, iters=scale.sensor_iters)
                    res = outcome["result"]
                    if getattr(res, "run_requests", None):
                        raise AssertionError("no shard should be under inline pressure")
                    t = Timing.of(samples)
                    base.setdefault("sensor", t.p50)
                    table.add("", "Dagster inline_pressure_sensor tick (fresh context: new "
                                  "client + 1 summary query)", t.n, ms(t.p50), ms(t.p90),
                              ms(t.p99), ratio(t.p50, base["sensor"]),
                              _stmts(sensor_stmts[1:]))
                    data.append({"shards": n, "what": "sensor", "p50": t.p50, "p99": t.p99,
                                 "statements": sensor_stmts[1:]})
            finally:
                maker.close()
                client.close()
    finally:
        counter.remove()
        instance.dispose()
    table.notes += [
        "SQL statements / tick: psycopg2 execute calls, counted client-side (mean, and the "
        "range when it varies). A fresh client also runs SQLAlchemy's dialect set-up "
        "queries on its first connection, CREATE TABLE IF NOT EXISTS for each table, and "
        "one multi-statement DEALLOCATE/PREPARE on the connection its summary query uses.",
        "Shards created for real: open_writer, one 10-row inline append, expire.",
    ]
    result.tables.append(table)
    result.data = {"rows": data}
    largest = max(scale.sensor_shards)
    summaries = {d["shards"]: d for d in data if d["what"] == "summaries"}
    sensors = {d["shards"]: d for d in data if d["what"] == "sensor"}
    worst = max(sensors[largest]["p99"], summaries[largest]["p99"])
    result.targets.append(Target(
        "6", f"sensor tick under 1 s at {largest:,} shards", "< 1 s",
        f"p50 {ms(sensors[largest]['p50'])} ms, p99 {ms(worst)} ms", worst < 1.0,
        "met" if worst < 1.0 else f"missed by {worst:.2f}x"))
    counts = {tuple(sorted(set(d["statements"]))) for d in summaries.values()}
    constant = len(counts) == 1
    result.targets.append(Target(
        "6", "a constant number of SQL queries per tick", "constant",
        ", ".join(f"{n:,}: {_stmts(summaries[n]['statements'])}" for n in sorted(summaries)),
        constant, "met" if constant else "the count changes with the number of shards"))
    return result


def _stmts(counts: list[int]) -> str:
    if not counts:
        return "-"
    lo, hi = min(counts), max(counts)
    mean = sum(counts) / len(counts)
    return f"{mean:g}" if lo == hi else f"{mean:.1f} ({lo}-{hi})"
