"""A real Spark standalone cluster on loopback for the benchmarks: one master and
``workers`` workers of ``cores`` cores each, started with ``spark-class`` from the
virtualenv's pyspark (the commands of the Spark documentation), on free ports.

The processes log to a folder of their own and are stopped (by their process ids,
master last) when the context exits. Workers run this interpreter's Python
(``PYSPARK_PYTHON``) and bind to 127.0.0.1 (``SPARK_LOCAL_IP``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

import pyspark

#: JVM options of the master and worker daemons (``SPARK_DAEMON_JAVA_OPTS``, unless the
#: environment sets its own).
DAEMON_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class StandaloneCluster:
    """``with StandaloneCluster(folder) as cluster: cluster.master_url``."""

    def __init__(self, folder: str, workers: int = 2, cores: int = 1,
                 memory: str = "2g") -> None:
        self.folder = Path(folder)
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.port = _free_port()
        self.ui_port = _free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self._procs: list[subprocess.Popen[bytes]] = []
        self.started_s = 0.0

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
                   PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOG_DIR=str(self.folder),
                   SPARK_WORKER_DIR=str(self.folder / "work"))
        # The master and worker daemons only schedule (the measured work runs in the
        # executors, which take the application's JVM options). With C1 only they start
        # on 12 instead of 20 CPU-s here (7 instead of 11 s), CPU the benchmark's own
        # processes would otherwise compete with on a 2-core machine.
        env.setdefault("SPARK_DAEMON_JAVA_OPTS", DAEMON_JAVA_OPTIONS)
        return env

    def _start(self, name: str, *args: str) -> None:
        spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
        log = open(self.folder / f"{name}.log", "wb")  # noqa: SIM115 - the process owns it
        self._procs.append(subprocess.Popen([str(spark_class), *args], env=self._env(),
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))

    def alive_workers(self) -> int:
        """Workers the master lists as ALIVE (from its web UI's JSON)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/",
                                        timeout=2) as r:
                data = json.loads(r.read())
        except OSError:
            return 0
        return sum(1 for w in data.get("workers", []) if w.get("state") == "ALIVE")

    def __enter__(self) -> StandaloneCluster:
        started = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.ui_port))
        for n in range(self.workers):
            self._start(f"worker{n}", "org.apache.spark.deploy.worker.Worker",
                        "--cores", str(self.cores), "--memory", self.memory,
                        "--webui-port", str(_free_port()), self.master_url)
        deadline = time.monotonic() + 120
        while self.alive_workers() < self.workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                self.__exit__(None, None, None)
                raise RuntimeError(f"the standalone cluster did not start (logs in "
                                   f"{self.folder})")
            time.sleep(0.5)
        self.started_s = time.monotonic() - started
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        for proc in reversed(self._procs):  # workers first, then the master
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
