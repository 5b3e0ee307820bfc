"""Orchestrates a nemesis run: processes, kills, a PostgreSQL restart, the final check."""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from persist_pipeline.config import InlinePolicy, PersistConfig
from persist_pipeline.ids import ShardId
from persist_pipeline.internal.processes import preloaded_context
from persist_pipeline.nemesis import checker, workload
from persist_pipeline.nemesis.workload import NemesisSetup

#: The inline budget of nemesis shards: small, so writers keep crossing it.
NEMESIS_POLICY = InlinePolicy(threshold_bytes=4096, max_bytes=64 * 1024)
NEMESIS_CONFIG = PersistConfig(rollup_threshold=16, reader_lease_duration_s=60,
                               heartbeat_interval_s=2, gc_orphan_min_age_s=6,
                               retry_deadline_s=30, blob_cache_bytes=8 << 20)


@dataclass
class NemesisOptions:
    """A run's settings (the ``nemesis`` subcommand's options)."""

    consensus_uri: str
    blob_uri: str
    wal_blob_uri: str | None = None
    seconds: float = 60.0
    writers: int = 3
    readers: int = 2
    seed: int | None = None
    fault_rate: float = 0.02
    pg_restart: str = "auto"
    workdir: str | None = None


@dataclass
class _Proc:
    name: str
    target: Callable[..., None]
    args: tuple[Any, ...]
    process: Any = None


@dataclass
class NemesisReport:
    seed: int
    ops: int = 0
    kills: int = 0
    faults: int = 0
    pg_restarts: int = 0
    check: checker.CheckResult = field(default_factory=checker.CheckResult)
    midrun_checks: int = 0

    def line(self) -> str:
        c = self.check
        return (f"ops={self.ops} acked={c.acked} kills={self.kills} faults={self.faults} "
                f"pg_restarts={self.pg_restarts} versions={c.versions} lost={c.lost} "
                f"duplicated={c.duplicated} phantom={c.phantom} "
                f"leaked_blobs={c.leaked_blobs} violations={len(c.violations)} "
                f"seed={self.seed}")


def _pg_restart_command(opts: NemesisOptions) -> list[str] | None:
    if opts.pg_restart == "never":
        return None
    if opts.pg_restart != "auto":
        return shlex.split(opts.pg_restart)
    parts = urlsplit(opts.consensus_uri)
    if not parts.scheme.startswith("postgres") or parts.hostname not in ("127.0.0.1",
                                                                          "localhost"):
        return None
    if shutil.which("pg_ctlcluster") is None or not Path("/etc/postgresql").is_dir():
        return None
    versions = sorted(os.listdir("/etc/postgresql"))
    if not versions:
        return None
    return ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "restart"]


def run(opts: NemesisOptions, out: Callable[[str], None] = print) -> NemesisReport:
    """Run the nemesis; returns the report (its ``check.violations`` say what broke)."""
    seed = opts.seed if opts.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    report = NemesisReport(seed=seed)
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="persist-nemesis-"))
    workdir.mkdir(parents=True, exist_ok=True)
    shard = str(ShardId.new())
    setup = NemesisSetup(opts.consensus_uri, opts.blob_uri, opts.wal_blob_uri, shard,
                         str(workdir), seed, opts.fault_rate, NEMESIS_POLICY, NEMESIS_CONFIG)
    clean = setup.client("driver", faults=False)
    clean.open_writer(shard, debug="nemesis-setup").expire()
    out(f"nemesis: shard {shard}, seed {seed}, {opts.writers} writers, {opts.readers} readers, "
        f"{opts.seconds:.0f}s, fault rate {opts.fault_rate}, workdir {workdir}")
    # Killed processes are started again every second or two: forked from a server that
    # imported the workload once, they write at once instead of importing for a second.
    ctx = preloaded_context(["persist_pipeline.nemesis.workload"])
    procs: dict[str, _Proc] = {}
    incarnations: dict[str, int] = {}

    def start(key: str, target: Callable[..., None], *args: Any) -> None:
        proc = _Proc(key, target, args)
        proc.process = ctx.Process(target=target, args=(setup, *args), daemon=True)
        proc.process.start()
        procs[key] = proc

    def start_writer(slot: str) -> None:
        incarnations[slot] = incarnations.get(slot, -1) + 1
        start(slot, workload.writer, f"{slot}.{incarnations[slot]}")

    for i in range(opts.writers):
        start_writer(f"w{i}")
    for i in range(opts.readers):
        start(f"r{i}", workload.reader, f"r{i}")
    start("listener", workload.listener, "listener")
    start("compactor", workload.compactor)
    start("gc", workload.collector)

    restart_cmd = _pg_restart_command(opts)
    deadline = time.monotonic() + opts.seconds
    restart_at = time.monotonic() + opts.seconds * rng.uniform(0.3, 0.7)
    check_at = time.monotonic() + opts.seconds * rng.uniform(0.2, 0.8)
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.5, 2.0))
        action = rng.choice(["writer", "writer", "writer", "compactor", "gc", "none"])
        if action in ("compactor", "gc"):
            victim = action
        elif action == "writer":
            victim = rng.choice([k for k in procs if k.startswith("w")])
            acks = workdir / f"{victim}.{incarnations[victim]}.acks"
            if not acks.exists() or acks.stat().st_size == 0:
                # Killed only once it acknowledged a write: on a loaded machine a
                # writer's start-up (imports, opening) can outlast the interval between
                # kills, and a run whose writers never write checks nothing.
                victim = None
        else:
            victim = None
        if victim is not None:
            p = procs[victim]
            if p.process.is_alive():
                os.kill(p.process.pid, signal.SIGKILL)
                report.kills += 1
            p.process.join()
            if victim.startswith("w"):
                start_writer(victim)
            else:
                start(victim, p.target, *p.args)
        if restart_cmd is not None and report.pg_restarts == 0 and time.monotonic() > restart_at:
            # Output goes to a file: a restarted server may keep inherited pipes open.
            log_path = workdir / "pg-restart.log"
            with log_path.open("w") as log_file:
                done = subprocess.run(restart_cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, check=False, timeout=180)
            if done.returncode == 0:
                report.pg_restarts += 1
                out("nemesis: restarted PostgreSQL")
            else:
                out(f"nemesis: PostgreSQL restart failed ({done.returncode}): "
                    f"{log_path.read_text()[-300:]}")
                restart_cmd = None
        if report.midrun_checks == 0 and time.monotonic() > check_at:
            mid = checker.check_history(clean, shard, NEMESIS_POLICY.max_bytes,
                                        concurrent=True)
            report.midrun_checks += 1
            report.check.violations += [f"mid-run: {v}" for v in mid.violations]
    # Stop: writers and maintenance die as they lived; readers finish their reports.
    for key, p in procs.items():
        if key.startswith(("w", "compactor", "gc")) and p.process.is_alive():
            os.kill(p.process.pid, signal.SIGKILL)
            p.process.join()
    (workdir / "stop").touch()
    for key, p in procs.items():
        p.process.join(timeout=120)
        if p.process.is_alive():
            p.process.kill()
            report.check.violations.append(f"{key} did not stop")
    acked: set[bytes] = set()
    attempted: set[bytes] = set()
    for path in workdir.glob("*.acks"):
        acked |= _keys(path)
    for path in workdir.glob("*.attempts"):
        attempted |= _keys(path)
        report.ops += sum(1 for _ in path.open())
    for path in workdir.glob("r*.json"):
        data = json.loads(path.read_text())
        report.ops += data.get("snapshots", 0)
        report.check.violations += [f"reader: {v}" for v in data.get("violations", [])]
    listener_report = workdir / "listener.json"
    if listener_report.exists():
        data = json.loads(listener_report.read_text())
        if data["mismatch_count"]:
            report.check.violations.append(
                f"listen differs from a fresh snapshot at {data['frontier']} in "
                f"{data['mismatch_count']} keys, e.g. {data['mismatches'][:3]}")
    else:
        report.check.violations.append("the listener wrote no report")
    for path in workdir.glob("*.faults"):
        report.faults += int(path.read_text() or 0)
    # Let uncommitted parts of killed writers age past GC's orphan threshold.
    time.sleep(NEMESIS_CONFIG.gc_orphan_min_age_s + 1)
    final = checker.check_shard(clean, shard, acked=acked, attempted=attempted,
                                inline_max_bytes=NEMESIS_POLICY.max_bytes, final_gc=True)
    final.violations = report.check.violations + final.violations
    report.check = final
    clean.close()
    out(report.line())
    for v in final.violations[:20]:
        out(f"violation: {v}")
    if final.violations:
        out(f"reproduce with: persist-pipeline nemesis --seed {seed} --seconds "
            f"{opts.seconds:.0f} --writers {opts.writers}")
    return report


def _keys(path: Path) -> set[bytes]:
    keys: set[bytes] = set()
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                keys.update(k.encode() for k in json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by SIGKILL was never acknowledged
    return keys
