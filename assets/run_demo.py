"""The main job, headless: ``make run`` (``python -m assets.run_demo``).

Runs the whole Dagster pipeline on the embedded default (SQLite consensus, local-folder
blobs, Spark ``local[*]``) against a real Dagster instance in ``.dagster_home``:

1. files land in the ``orders`` landing folder (one of them malformed); the landing
   sensor turns each into one ingestion run (the bad one fails, naming file and line,
   and writes nothing);
2. round after round, an ingestion run writes a small batch into each synthetic shard,
   and ``inline_pressure_sensor`` is evaluated on the instance; when a shard's inline
   bytes cross the high-water mark it requests a compaction run, which runs on Spark;
3. declarative automation (``persist_automation_sensor``) is evaluated as a day later:
   hourly compaction of the shards with pending work, daily GC;
4. ``report/shard_health``, a table asset, is stored through ``PersistIOManager``;
5. a summary table is printed.

``make ui`` then shows every run, the plotted metadata, sensors and schedules. The
definitions are loaded through ``workspace.yaml``, exactly as the UI loads them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from assets.pipeline_config import REPO_ROOT, FileSource, PipelineConfig, load_pipeline_config

DEFAULT_DAGSTER_HOME = REPO_ROOT / ".dagster_home"
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


@dataclass
class ShardTally:
    """What happened to one shard during the demo."""

    writes: int = 0
    placements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    blob_puts: int = 0
    failed_runs: int = 0
    compactions: int = 0
    inline_peak: int = 0
    inline_after: int = 0
    rows_per_s: list[float] = field(default_factory=list)
    inline_now: int = 0


def _prepare_home(keep: bool) -> Path:
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(DEFAULT_DAGSTER_HOME))).resolve()
    if not keep and home == DEFAULT_DAGSTER_HOME.resolve() and home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text("telemetry:\n  enabled: false\n")
    return home


#: The demo's malformed landed file: its run fails, as it should.
BAD_FILE = "orders-0003-malformed-on-purpose.csv"


def _land_files(source: FileSource, batch: int) -> list[str]:
    """Write demo files into the landing folder; batch 0 includes a malformed one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(source.uri)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    if batch == 0:
        rows = "\n".join(f"order-{i},{{\"qty\": {i % 7 + 1}}},0" for i in range(40))
        (folder / "orders-0001.csv").write_text(f"k,v,t\n{rows}\n")
        lines = [json.dumps({"k": f"order-{i}", "v": f"{{\"qty\": {i % 5}}}", "t": 0})
                 for i in range(40, 70)]
        (folder / "orders-0002.jsonl").write_text("\n".join(lines) + "\n")
        # Malformed on purpose, and named so: its failed run (red in the UI) is the
        # demo showing that a bad file fails alone, naming the line, and writes nothing.
        (folder / BAD_FILE).write_text(
            "k,v,t\norder-90,{\"qty\": 1},0\norder-91,{\"qty\": 2},not-a-time\n")
        names += ["orders-0001.csv", "orders-0002.jsonl", f"{BAD_FILE} (malformed on purpose)"]
    else:
        n = 4000  # a large file: above the inline threshold, so it goes to blob storage
        table = pa.table({"k": [f"order-{i}".encode() for i in range(1000, 1000 + n)],
                          "v": [f"{{\"qty\": {i % 9}}}".encode() for i in range(n)],
                          "t": pa.array([0] * n, pa.int64())})
        pq.write_table(table, folder / f"orders-{batch + 3:04d}.parquet")
        names.append(f"orders-{batch + 3:04d}.parquet")
    return names


def failure_message(event: Any) -> str:
    """The user-facing message of a STEP_FAILURE event (a ``dg.Failure``'s description)."""
    data = event.event_specific_data
    user = getattr(data, "user_failure_data", None)
    if user is not None and user.description:
        return str(user.description).strip()
    error = data.error
    if error.cls_name == "DagsterExecutionStepExecutionError" and error.cause is not None:
        error = error.cause  # the exception the step raised
    return str(error.message).strip()


def _meta(event: Any) -> dict[str, Any]:
    metadata = event.step_materialization_data.materialization.metadata
    return {k: getattr(v, "value", v) for k, v in metadata.items()}


def _record(results: list[Any], config: PipelineConfig, tally: dict[str, ShardTally],
            out: list[str]) -> None:
    import dagster as dg

    from assets.ingestion import BLOB_PUTS, INLINE_BYTES, PLACEMENT

    for result in results:
        for event in result.get_asset_materialization_events():
            kind, name = event.asset_key.path[0], event.asset_key.path[-1]
            m = _meta(event)
            t = tally[name]
            if kind == "ingest":
                t.writes += 1
                t.placements[str(m[PLACEMENT])] += 1
                t.blob_puts += int(m[BLOB_PUTS])
                t.inline_now = int(m[INLINE_BYTES])
            elif kind == "compact" and int(m["requests"]):
                t.compactions += 1
                t.inline_peak = max(t.inline_peak, int(m["inline_bytes_before"]))
                t.inline_after = t.inline_now = int(m["inline_bytes_after"])
                t.rows_per_s.append(float(m["rows_per_s"]))
                out.append(f"    compacted {name}: {m['requests']} merge(s), {m['parts_in']} "
                           f"parts -> {m['parts_out']}, inline bytes {m['inline_bytes_before']}"
                           f" -> {m['inline_bytes_after']}, {float(m['rows_per_s']):,.0f} rows/s")
        if not result.success:
            failures = [e for e in result.all_events
                        if e.event_type == dg.DagsterEventType.STEP_FAILURE]
            for e in failures:
                message = failure_message(e)
                shard = result.dagster_run.tags.get("persist/shards", "?")
                if shard in tally:
                    tally[shard].failed_runs += 1
                expected = (" (expected: the demo's file malformed on purpose)"
                            if BAD_FILE in message else "")
                out.append(f"    run {result.run_id[:8]} FAILED{expected}: "
                           f"{message.splitlines()[0]}")


def _print_summary(config: PipelineConfig, tally: dict[str, ShardTally]) -> None:
    head = (f"{'shard':<10} {'writes':>6} {'inline':>6} {'wal':>4} {'blob':>4} "
            f"{'S3 PUTs avoided':>15} {'failed':>6} {'compactions':>11} "
            f"{'inline B peak':>13} {'after':>6} {'now':>6} {'compaction rows/s':>17}")
    print("\n" + head)
    print("-" * len(head))
    for shard in config.shards:
        t = tally[shard.name]
        rate = f"{sum(t.rows_per_s) / len(t.rows_per_s):,.0f}" if t.rows_per_s else "-"
        print(f"{shard.name:<10} {t.writes:>6} {t.placements['inline']:>6} "
              f"{t.placements['wal']:>4} {t.placements['blob']:>4} "
              f"{t.placements['inline']:>15} {t.failed_runs:>6} {t.compactions:>11} "
              f"{t.inline_peak:>13} {t.inline_after:>6} {t.inline_now:>6} {rate:>17}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=24, help="ingestion rounds (default 24)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the data and Dagster history of earlier runs")
    args = parser.parse_args(argv)

    home = _prepare_home(args.keep)
    config = load_pipeline_config()
    if not args.keep and config.data_dir.exists() and REPO_ROOT in config.data_dir.parents:
        shutil.rmtree(config.data_dir)

    import logging

    import dagster as dg

    from assets.asset_keys import (
        COMPACTION_GROUP,
        COMPACTION_JOB,
        GC_JOB,
        INGESTION_JOB,
        MAINTENANCE_GROUP,
        TAG_SHARDS,
        TAG_TRIGGER,
        shard_key,
    )
    from assets.reports import REPORT_KEY
    from assets.runner import SensorTicker, launch, launch_sensor_requests
    from assets.workspace import load_workspace_definitions

    started = time.monotonic()
    logging.getLogger("dagster").setLevel(logging.WARNING)  # this script prints its own
    defs = load_workspace_definitions()
    instance = dg.DagsterInstance.get()
    persist = defs.resources["persist"]
    print(f"persist-pipeline demo: {config.path.name}, {persist.describe()}")  # type: ignore[attr-defined]
    print(f"Dagster instance: {home} (make ui shows it)\n")

    tally: dict[str, ShardTally] = defaultdict(ShardTally)
    file_shards = [s for s in config.shards if isinstance(s.source, FileSource)]
    synthetic = [s for s in config.shards if not isinstance(s.source, FileSource)]
    landing = {s.name: SensorTicker(defs, instance, f"{s.name}_landing_sensor")
               for s in file_shards}
    pressure = SensorTicker(defs, instance, "inline_pressure_sensor")
    alerts = [SensorTicker(defs, instance, n) for n in (
        "inline_fallthrough_alert_sensor", "compaction_backlog_alert_sensor",
        "inline_over_limit_alert_sensor")]
    for ticker in alerts:  # the first tick sets each alert sensor's baseline
        ticker.tick()
    automation_start = datetime.now(UTC)  # declarative automation's first evaluation
    automation_cursor = dg.evaluate_automation_conditions(
        defs=defs, instance=instance, evaluation_time=automation_start,
        asset_selection=dg.AssetSelection.groups(COMPACTION_GROUP, MAINTENANCE_GROUP)).cursor
    ingestion_job = defs.resolve_job_def(INGESTION_JOB)
    synthetic_keys = [shard_key(s.name) for s in synthetic]

    for round_no in range(args.rounds):
        out: list[str] = []
        if round_no in (0, args.rounds // 2):
            for shard in file_shards:
                assert isinstance(shard.source, FileSource)
                names = _land_files(shard.source, 0 if round_no == 0 else 1)
                out.append(f"    landed in {shard.name}: {', '.join(names)}")
        for shard in file_shards:
            tick = landing[shard.name].tick()
            if tick.run_requests:
                out.append(f"    {landing[shard.name].name}: {len(tick.run_requests)} new "
                           f"file(s) -> {len(tick.run_requests)} ingestion run(s)")
            _record(launch_sensor_requests(landing[shard.name], tick, run_config=QUIET),
                    config, tally, out)
        if synthetic_keys:
            result = ingestion_job.execute_in_process(
                instance=instance, asset_selection=synthetic_keys, raise_on_error=False,
                run_config=QUIET, tags={TAG_SHARDS: ",".join(s.name for s in synthetic)})
            _record([result], config, tally, out)
        inline = ", ".join(f"{s.name} {tally[s.name].inline_now:>5}" for s in config.shards)
        tick = pressure.tick()
        if tick.run_requests:
            request = tick.run_requests[0]
            out.append(f"    inline_pressure_sensor fired: run key {request.run_key}")
            _record(launch_sensor_requests(pressure, tick, run_config=QUIET), config, tally,
                    out)
        for ticker in alerts:
            ticker.tick()
        print(f"round {round_no + 1:>2}: inline bytes after the writes: {inline}")
        for line in out:
            print(line)

    # Declarative automation, evaluated on the instance as persist_automation_sensor
    # would a day later: compaction of the shards with pending work (hourly ticks) and
    # GC of every shard (the daily tick).
    later = automation_start + timedelta(days=1, hours=1)
    evaluated = dg.evaluate_automation_conditions(
        defs=defs, instance=instance, evaluation_time=later, cursor=automation_cursor,
        asset_selection=dg.AssetSelection.groups(COMPACTION_GROUP, MAINTENANCE_GROUP))
    requested = sorted((k for k in defs.resolve_asset_graph().get_all_asset_keys()
                        if evaluated.get_requested_partitions(k)), key=str)
    print("persist_automation_sensor: " + (", ".join(k.to_user_string() for k in requested)
                                           or "nothing requested"))
    out = []
    for job_name, group in ((COMPACTION_JOB, "compact"), (GC_JOB, "gc")):
        keys = [k for k in requested if k.path[0] == group]
        if keys:
            request = dg.RunRequest(asset_selection=keys, tags={
                "dagster/sensor_name": "persist_automation_sensor",
                TAG_TRIGGER: "automation", TAG_SHARDS: ",".join(k.path[-1] for k in keys)})
            result = launch(defs, instance, request, job_name=job_name, run_config=QUIET)
            if result is not None:
                _record([result], config, tally, out)
    for line in out:
        print(line)

    # A table asset stored through PersistIOManager (report/shard_health).
    report = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        instance=instance, asset_selection=[REPORT_KEY], run_config=QUIET,
        raise_on_error=False)
    if report.success:
        health = report.output_for_node("report__shard_health")
        print(f"report/shard_health: {health.num_rows} rows stored by PersistIOManager")
    else:
        print("report/shard_health FAILED")

    _print_summary(config, tally)
    runs = instance.get_runs_count()
    print(f"\n{runs} Dagster runs in {time.monotonic() - started:.0f} s. "
          "See them, their metadata plots, sensors and schedules with: make ui")
    return 0


if __name__ == "__main__":
    sys.exit(main())
