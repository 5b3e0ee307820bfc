"""Case 11: the Dagster code location at 1,000 configured shards.

A pipeline config with N shards (one in ten fed by files landing in a folder, the rest
by the synthetic change stream) on PostgreSQL consensus and S3 blobs; every shard is
created for real with one small write. Timed:

- **definitions load**: a fresh Python process imports the code location the way the
  code server does (``workspace.yaml``: ``assets.definitions``) and resolves it (asset
  graph, jobs, sensors); reported with and without the import of Dagster itself;
- **sensor ticks**, each evaluated the way the daemon does (a fresh context, so the
  ``persist`` resource opens a new client): ``inline_pressure_sensor`` over every shard,
  one ``NAME_landing_sensor`` (a folder of landed files, all already seen), and
  ``persist_automation_sensor``'s evaluation of the automation conditions of the 2 x N
  compaction and GC assets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.common import CaseResult, Scale, Table, Target, Timing, measure, ms
from bench.services import Services
from persist_pipeline import PersistClient

TITLE = "Dagster code location at scale: definitions load and sensor ticks"
_ROOT = Path(__file__).resolve().parent.parent
FILES_PER_LANDING = 50

#: Run in a fresh interpreter: import, build and resolve the definitions; print timings.
_LOAD = """
import json, sys, time
t0 = time.perf_counter()
import dagster as dg
t1 = time.perf_counter()
from assets.workspace import load_workspace_definitions
defs = load_workspace_definitions()
repo = defs.get_repository_def()
repo.get_all_jobs()
n_assets = len(defs.resolve_asset_graph().get_all_asset_keys())
n_sensors = len(repo.sensor_defs)
t2 = time.perf_counter()
print(json.dumps({"import_dagster": t1 - t0, "load": t2 - t1, "total": t2 - t0,
                  "assets": n_assets, "sensors": n_sensors}))
"""


def _config(path: Path, n: int, consensus: str, blob: str) -> list[str]:
    """Write a pipeline config of ``n`` shards at ``path``; returns the file shards."""
    shards: dict[str, Any] = {}
    files = []
    for i in range(n):
        name = f"shard_{i:05d}"
        if i % 10 == 0:
            files.append(name)
            shards[name] = {"source": {"kind": "files", "uri": f"{{data_dir}}/landing/{name}"}}
        else:
            shards[name] = {"source": {"kind": "synthetic", "seed": i}}
    path.write_text(yaml.safe_dump({
        "version": 1, "data_dir": str(path.parent / "data"),
        "location": {"consensus_uri": consensus, "blob_uri": blob},
        "automation": {"default_status": "stopped"}, "shards": shards}))
    return files


def run(svc: Services, scale: Scale, log: Callable[[str], None] = print) -> CaseResult:
    """Run case 11 (see the module docstring)."""
    import dagster as dg

    n = 20 if scale.name == "smoke" else 1_000
    loads = 1 if scale.name == "smoke" else 3
    iters = 2 if scale.name == "smoke" else 10
    result = CaseResult("case11", TITLE)
    table = Table(f"Case 11: {TITLE} ({n:,} shards)",
                  ["what", "n", "p50 ms", "p90 ms", "max ms"])
    workdir = Path(svc.folder("case11"))
    config = workdir / "pipeline.yaml"
    data: dict[str, Any] = {"shards": n}
    with svc.pg.database("c9") as url:
        blob = svc.s3.uri(svc.s3.bucket("c9"))
        files = _config(config, n, url, blob)
        landing = workdir / "data" / "landing" / files[0]
        landing.mkdir(parents=True)
        for i in range(FILES_PER_LANDING):
            (landing / f"part-{i:04d}.csv").write_text(f"k,v,t\nk{i},v{i},0\n")
        env = {**os.environ, "PERSIST_PIPELINE_CONFIG": str(config),
               "DAGSTER_HOME": str(workdir / "dagster_home")}
        Path(env["DAGSTER_HOME"]).mkdir()

        log(f"  loading the definitions of {n:,} shards in a fresh process x{loads}")
        runs = []
        for _ in range(loads):
            done = subprocess.run([sys.executable, "-c", _LOAD], cwd=_ROOT, env=env,
                                  capture_output=True, text=True, timeout=600, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        for key, label in (("load", "definitions load: build + resolve (Dagster imported)"),
                           ("total", "definitions load incl. `import dagster` (cold process)")):
            t = Timing.of([r[key] for r in runs])
            table.add(label, t.n, ms(t.p50), ms(t.p90), ms(t.max))
            data[key] = t.p50
        data["assets"], data["sensors"] = runs[0]["assets"], runs[0]["sensors"]

        log(f"  creating {n:,} shards")
        maker = PersistClient.open(url, blob)
        try:
            ids = _shard_ids(config)
            _create_named_shards(maker, ids)
        finally:
            maker.close()

        old = os.environ.get("PERSIST_PIPELINE_CONFIG")
        os.environ["PERSIST_PIPELINE_CONFIG"] = str(config)
        try:
            from assets.runner import SensorTicker
            from assets.workspace import load_workspace_definitions

            defs = load_workspace_definitions()
            with dg.instance_for_test() as instance:
                ticks = {}
                for sensor in ("inline_pressure_sensor", f"{files[0]}_landing_sensor"):
                    ticker = SensorTicker(defs, instance, sensor)
                    first = ticker.tick()  # the landing sensor's first tick sees every file
                    if sensor.endswith("landing_sensor"):
                        assert len(first.run_requests) == FILES_PER_LANDING, first
                    samples = measure(lambda _i, t=ticker: t.tick(), warmup=1, iters=iters)
                    ticks[sensor] = Timing.of(samples)
                selection = dg.AssetSelection.groups("compaction", "maintenance")
                cursor = dg.evaluate_automation_conditions(
                    defs=defs, instance=instance, asset_selection=selection).cursor
                state = {"cursor": cursor}

                def automation(_i: int) -> None:
                    state["cursor"] = dg.evaluate_automation_conditions(
                        defs=defs, instance=instance, asset_selection=selection,
                        cursor=state["cursor"]).cursor

                ticks["persist_automation_sensor"] = Timing.of(
                    measure(automation, warmup=1, iters=max(2, iters // 3)))
        finally:
            if old is None:
                os.environ.pop("PERSIST_PIPELINE_CONFIG", None)
            else:
                os.environ["PERSIST_PIPELINE_CONFIG"] = old
    labels = {"inline_pressure_sensor": f"inline_pressure_sensor tick ({n:,} shards)",
              f"{files[0]}_landing_sensor": f"landing sensor tick ({FILES_PER_LANDING} files "
                                            "landed, all seen)",
              "persist_automation_sensor": f"automation condition evaluation ({2 * n:,} "
                                           "compaction + GC assets)"}
    for key, t in ticks.items():
        table.add(labels[key], t.n, ms(t.p50), ms(t.p90), ms(t.max))
        data[key] = {"p50": t.p50, "max": t.max}
    table.notes += [
        f"Load average when the case ended: {os.getloadavg()[0]:.1f} (2 cores here).",
        f"{data['assets']:,} assets and {data['sensors']} sensors defined. PostgreSQL "
        "consensus and S3 (moto) blobs; every shard written once.",
        "Sensor ticks are evaluated in this process with a fresh context each (as the "
        "daemon does); the automation evaluation uses dagster's "
        "evaluate_automation_conditions with its cursor carried over.",
    ]
    result.tables.append(table)
    result.data = data
    load_ok = data["load"] < 10.0
    result.targets.append(Target(
        "11", f"definitions with {n:,} shards load in under 10 s", "< 10 s",
        f"p50 {data['load']:.2f} s (cold process incl. import {data['total']:.2f} s)",
        load_ok, "met" if load_ok else f"missed by {data['load'] / 10:.2f}x"))
    worst = max(t.max for t in ticks.values())  # the automation sensor's tick included
    tick_ok = worst < 1.0
    result.targets.append(Target(
        "11", f"a sensor tick under 1 s at {n:,} shards", "< 1 s",
        ", ".join(f"{k} max {ms(t.max)} ms" for k, t in ticks.items()), tick_ok,
        "met" if tick_ok else f"missed ({worst:.2f} s)"))
    return result


def _shard_ids(config: Path) -> list[str]:
    from assets.pipeline_config import load_pipeline_config

    return [s.shard_id for s in load_pipeline_config(config).shards]


def _create_named_shards(client: PersistClient, ids: list[str]) -> None:
    from bench import peers

    for shard in ids:
        writer = client.open_writer(shard)
        writer.compare_and_append(peers.small_batch(0), 0, 1)
        writer.expire()
    client._machines.clear()

