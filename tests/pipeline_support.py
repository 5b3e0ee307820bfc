"""Shared pieces of the Dagster pipeline tests (``tests/test_pipeline_*.py``).

Every test builds its own pipeline config file, points ``$PERSIST_PIPELINE_CONFIG`` at it
and loads the definitions through the repository's ``workspace.yaml``, on a real Dagster
instance (``instance_for_test``: SQLite run and event storage in a temp dir, as the
daemon's sensors need an instance they can reopen by reference; the IO manager tests'
:func:`dagster_instance` keeps it in memory). Nothing is mocked: consensus, blobs, Spark
and HTTP are real.

Fixtures (import them into a test module): ``make_pipeline``, ``spark_session``,
``webhook``.
"""

from __future__ import annotations

import http.server
import json
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

from assets.asset_keys import INGESTION_JOB, shard_key
from assets.pipeline_config import CONFIG_ENV, PipelineConfig, load_pipeline_config
from assets.runner import SensorTicker, launch, launch_sensor_requests
from assets.workspace import DEFAULT_WORKSPACE, load_workspace_definitions
from persist_pipeline import PersistClient
from resources.persist import make_local_dirs

#: Environment the pipeline reads; cleared so the machine's settings cannot leak in.
PIPELINE_ENV = ("PERSIST_CONSENSUS_URI", "PERSIST_BLOB_URI", "PERSIST_WAL_BLOB_URI",
                "PERSIST_INLINE_UPDATE_THRESHOLD_BYTES", "PERSIST_INLINE_UPDATE_MAX_BYTES",
                "PERSIST_PIPELINE_DATA_DIR", "PERSIST_ALERT_WEBHOOK_URL", "SPARK_MASTER")

SYNTHETIC = {"kind": "synthetic", "keys": 100, "events_per_write": 30, "seed": 3}


def base_config(data_dir: Path, shards: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """A pipeline config for tests: small inline budget, local[2] Spark, stopped sensors."""
    config: dict[str, Any] = {
        "version": 1,
        "data_dir": str(data_dir),
        "location": {
            "consensus_uri": "${PERSIST_CONSENSUS_URI:-sqlite:///{data_dir}/consensus.db}",
            "blob_uri": "${PERSIST_BLOB_URI:-file://{data_dir}/blobs}",
            "wal_blob_uri": "${PERSIST_WAL_BLOB_URI:-}",
        },
        "inline_policy": {"persist_inline_update_threshold_bytes": 4096,
                          "persist_inline_update_max_bytes": 8192},
        "spark": {"master": "local[2]", "conf": {"spark.sql.shuffle.partitions": "2"}},
        "compaction": {"high_water_fraction": 0.5},
        "alerts": {"webhook_url": "${PERSIST_ALERT_WEBHOOK_URL:-}", "over_limit_for_s": 0,
                   "backlog_threshold": 8},
        "automation": {"default_status": "stopped"},
        "shards": shards,
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(name), dict):
            config[name] = {**config[name], **value}
        else:
            config[name] = value
    return config


@dataclass
class Pipeline:
    """A loaded code location on a real instance, with helpers to drive it."""

    defs: dg.Definitions
    config: PipelineConfig
    instance: dg.DagsterInstance
    data_dir: Path
    tickers: dict[str, SensorTicker] = field(default_factory=dict)
    _client: PersistClient | None = None

    def client(self) -> PersistClient:
        """A client of the test's own on the pipeline's location (closed by the fixture)."""
        if self._client is None:
            persist: Any = self.defs.resources["persist"]
            uris = persist.uris()
            for uri in uris:
                make_local_dirs(uri)
            self._client = PersistClient.open(*uris)
        return self._client

    def shard_id(self, name: str) -> str:
        return self.config.shard(name).shard_id

    def ingest(self, *names: str, events: int = 0) -> dg.ExecuteInProcessResult:
        """One ingestion run writing once into each synthetic shard of ``names``."""
        run_config = {"ops": {"synthetic_ingestion": {"config": {"events": events}}}}
        job = self.defs.resolve_job_def(INGESTION_JOB)
        return job.execute_in_process(instance=self.instance, raise_on_error=False,
                                      asset_selection=[shard_key(n) for n in names],
                                      run_config=run_config)

    def ticker(self, sensor: str) -> SensorTicker:
        """The sensor's ticker (one per sensor, so its cursor carries over)."""
        if sensor not in self.tickers:
            self.tickers[sensor] = SensorTicker(self.defs, self.instance, sensor)
        return self.tickers[sensor]

    def launch_all(self, sensor: str, tick: Any) -> list[dg.ExecuteInProcessResult]:
        return launch_sensor_requests(self.ticker(sensor), tick)

    def evaluate_schedule(self, name: str) -> Any:
        schedule = self.defs.resolve_schedule_def(name)
        with dg.build_schedule_context(instance=self.instance,
                                       resources=self.defs.resources) as context:
            return schedule.evaluate_tick(context)

    def launch_schedule_request(self, name: str, request: dg.RunRequest
                                ) -> dg.ExecuteInProcessResult | None:
        schedule = self.defs.resolve_schedule_def(name)
        return launch(self.defs, self.instance, request, job_name=schedule.job_name,
                      schedule_name=name)


def materializations(result: dg.ExecuteInProcessResult) -> dict[str, dict[str, Any]]:
    """``{"kind/name": metadata values}`` of a run's materializations."""
    out = {}
    for event in result.get_asset_materialization_events():
        meta = event.step_materialization_data.materialization.metadata
        out["/".join(event.asset_key.path)] = {k: getattr(v, "value", v)
                                               for k, v in meta.items()}
    return out


def check_results(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    """``{"kind/name:check": evaluation}`` of a run's asset check evaluations."""
    out = {}
    for event in result.all_events:
        if event.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION:
            data: Any = event.event_specific_data
            out[f"{'/'.join(data.asset_key.path)}:{data.check_name}"] = data
    return out


def failure_messages(result: dg.ExecuteInProcessResult) -> list[str]:
    """The messages of a run's step failures (a ``dg.Failure``'s description)."""
    messages = []
    for event in result.all_events:
        if event.event_type == dg.DagsterEventType.STEP_FAILURE:
            data: Any = event.event_specific_data
            user = data.user_failure_data
            messages.append(user.description if user and user.description
                            else data.error.message)
    return messages


def evaluate_failure_sensor(pipeline: Pipeline, result: dg.ExecuteInProcessResult) -> Any:
    """Evaluate compaction_failure_alert_sensor on a failed run, as the daemon would."""
    run = result.dagster_run
    [record] = pipeline.instance.get_records_for_run(
        run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE).records
    sensor = pipeline.defs.resolve_sensor_def("compaction_failure_alert_sensor")
    failure = dg.build_run_status_sensor_context(
        sensor_name=sensor.name, dagster_event=record.event_log_entry.dagster_event,
        dagster_instance=pipeline.instance, dagster_run=run,
        resources=pipeline.defs.resources).for_run_failure()
    with failure as context:  # resources live for the evaluation, as in the daemon
        return sensor(context)


def one_event_log_file(folder: Path) -> dict[str, Any]:
    """Instance overrides: the event log in one SQLite file, as Dagster's consolidated
    storage keeps it, instead of one file per run created with its schema (a run's
    storage then costs no file creation: 0.10 against 0.17 CPU-s a materialization)."""
    return {"event_log_storage": {
        "module": "dagster._core.storage.event_log",
        "class": "ConsolidatedSqliteEventLogStorage",
        "config": {"base_dir": str(folder)}}}


@contextmanager
def dagster_instance() -> Iterator[dg.DagsterInstance]:
    """A real Dagster instance for one test, its run, event-log and schedule storage in
    memory (Dagster's in-memory storages are its SQL storages on SQLite ``:memory:``).

    ``instance_for_test`` puts them in SQLite files, one more file per run, each created
    with its schema: 0.3 CPU-s to create the instance and 0.4 CPU-s a materialization
    against 0.04 CPU-s each here. Every run these tests launch executes in this process,
    so nothing needs the storage on disk.
    """
    with (tempfile.TemporaryDirectory() as artifacts,
          dg.DagsterInstance.ephemeral(tempdir=artifacts) as instance):
        yield instance


@pytest.fixture
def make_pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> Iterator[Callable[..., Pipeline]]:
    """``make_pipeline(shards, **sections)``: write a config, load it through
    ``workspace.yaml`` on a fresh test instance. Env overrides go through
    ``monkeypatch`` before calling it (location URIs are read at run time anyway)."""
    for name in PIPELINE_ENV:
        monkeypatch.delenv(name, raising=False)
    opened: list[Pipeline] = []
    stack: list[Any] = []

    def make(shards: dict[str, Any], **sections: Any) -> Pipeline:
        data_dir = tmp_path / "data"
        path = tmp_path / "pipeline.yaml"
        path.write_text(yaml.safe_dump(base_config(data_dir, shards, **sections)))
        monkeypatch.setenv(CONFIG_ENV, str(path))
        defs = load_workspace_definitions(DEFAULT_WORKSPACE)
        manager = dg.instance_for_test(overrides=one_event_log_file(tmp_path / "events"))
        instance = manager.__enter__()
        stack.append(manager)
        pipeline = Pipeline(defs, load_pipeline_config(path), instance, data_dir)
        opened.append(pipeline)
        return pipeline

    yield make
    for pipeline in opened:
        if pipeline._client is not None:
            pipeline._client.close()
    for manager in reversed(stack):
        manager.__exit__(None, None, None)


@pytest.fixture(scope="session")
def spark_session() -> Iterator[Any]:
    """One local SparkSession for the whole test session (compaction runs reuse it).

    Its JVMs compile with C1 only (``-XX:TieredStopAtLevel=1``, beside
    :data:`~persist_pipeline.spark.JIT_OPTIONS`): the suite's jobs are many and tiny, and
    C2 spent CPU on code it then ran a few times (a session's start and five small
    queries: 16 instead of 21 CPU-s on two cores shared with the other test worker).
    JIT settings change speed, never results.
    """
    from persist_pipeline.spark import JIT_OPTIONS, local_spark_session

    jvm = f"{JIT_OPTIONS} -XX:TieredStopAtLevel=1"
    session = local_spark_session("local[2]", app_name="persist-pipeline-tests",
                                  extra={"spark.sql.shuffle.partitions": "2",
                                         "spark.driver.extraJavaOptions": jvm,
                                         "spark.executor.extraJavaOptions": jvm})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@dataclass
class Webhook:
    """A loopback HTTP server recording the JSON bodies POSTed to it."""

    url: str
    bodies: list[dict[str, Any]]
    paths: list[str]


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    """A real HTTP server on 127.0.0.1 (a free port) standing in for Slack."""
    bodies: list[dict[str, Any]] = []
    paths: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
            paths.append(self.path)
            bodies.append(json.loads(raw))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        yield Webhook(f"http://{host}:{port}/services/T0001/B0002/s3cr3tT0ken", bodies, paths)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(params=["sqlite+files", pytest.param("postgres+s3", marks=[
    pytest.mark.postgres, pytest.mark.s3])])
def table_location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """``(consensus URI, blob URI)`` of a location for IO-managed assets: the embedded
    default and PostgreSQL + S3."""
    if request.param == "sqlite+files":
        return f"sqlite:///{tmp_path}/consensus.db", f"file://{tmp_path}/blobs"
    return request.getfixturevalue("pg_url"), request.getfixturevalue("s3_uri")
