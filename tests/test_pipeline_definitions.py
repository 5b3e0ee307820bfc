"""The code location loads through ``workspace.yaml``, from the repo's ``pipeline.yaml``.

Covers: the shipped config and workspace load (in process, and with Dagster's own
loader via the ``dagster`` CLI); what they define; resources keep secrets out of the
UI; the synthetic change stream is consistent (config parsing: test_pipeline_config).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from assets.change_stream import ChangeStream
from assets.pipeline_config import CONFIG_ENV, REPO_ROOT, load_pipeline_config
from assets.workspace import DEFAULT_WORKSPACE, load_workspace_definitions, workspace_target
from persist_pipeline.exceptions import InvalidConfig
from persist_pipeline.updates import consolidate
from resources.alerts import AlertsResource
from resources.env import expand_env, redact_text
from resources.inline_policy import InlinePolicyResource
from resources.io_manager import PersistIOManager
from resources.persist import PersistResource
from resources.spark import PersistPySparkResource
from tests.pipeline_support import PIPELINE_ENV

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow


@pytest.fixture
def shipped_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The repo's own pipeline.yaml, with its data directory in tmp_path."""
    for name in (*PIPELINE_ENV, CONFIG_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PERSIST_PIPELINE_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def test_workspace_loads_the_shipped_pipeline(shipped_env: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    module, attribute, workdir = workspace_target(DEFAULT_WORKSPACE)
    assert (module, attribute, workdir) == ("assets.definitions", "defs", REPO_ROOT)
    defs = load_workspace_definitions()
    dg.Definitions.validate_loadable(defs)
    config = load_pipeline_config()
    names = [s.name for s in config.shards]
    assert names == ["orders", "clicks", "inventory"]

    graph = defs.resolve_asset_graph()
    keys = graph.get_all_asset_keys()
    for name in names:
        for kind, group in (("ingest", "ingestion"), ("compact", "compaction"),
                            ("gc", "maintenance")):
            key = dg.AssetKey([kind, name])
            assert key in keys
            assert graph.get(key).group_name == group
    # A landed file is a partition of ingest/orders; the data's columns are declared.
    orders = graph.get(dg.AssetKey(["ingest", "orders"]))
    assert isinstance(orders.partitions_def, dg.DynamicPartitionsDefinition)
    assert orders.partitions_def.name == "landed_files"
    schema = orders.metadata["dagster/column_schema"]
    assert [c.name for c in schema.columns] == ["k", "v", "t", "d"]
    # Compaction and GC are declaratively automated.
    assert graph.get(dg.AssetKey(["compact", "clicks"])).automation_condition is not None
    assert graph.get(dg.AssetKey(["gc", "clicks"])).automation_condition is not None
    checks = {str(k.name) for c in defs.asset_checks or [] for k in c.check_keys}
    assert checks == {"inline_bytes_within_max", "upper_advanced_recently"}
    sensors = {s.name: s for s in defs.sensors or []}
    assert set(sensors) == {
        "orders_landing_sensor", "inline_pressure_sensor", "inline_over_limit_alert_sensor",
        "compaction_backlog_alert_sensor", "inline_fallthrough_alert_sensor",
        "compaction_failure_alert_sensor", "persist_automation_sensor"}
    # Every sensor that launches runs launches a named job (no __anonymous_asset_job).
    assert sensors["orders_landing_sensor"].job_name == "ingest_files_job"
    assert sensors["inline_pressure_sensor"].job_name == "compaction_job"
    assert {s.name for s in defs.schedules or []} == {"shard_checks_schedule"}
    assert defs.resolve_schedule_def("shard_checks_schedule").cron_schedule == "*/15 * * * *"
    for job in ("ingestion_job", "compaction_job", "gc_job", "shard_checks_job",
                "ingest_files_job"):
        defs.resolve_job_def(job)

    resources = defs.resources
    assert isinstance(resources["persist"], PersistResource)
    assert isinstance(resources["inline_policy"], InlinePolicyResource)
    assert isinstance(resources["pyspark"], PersistPySparkResource)
    assert isinstance(resources["alerts"], AlertsResource)
    assert isinstance(resources["io_manager"], PersistIOManager)
    assert resources["io_manager"].consensus_uri == resources["persist"].consensus_uri
    pyspark = resources["pyspark"]
    assert pyspark.spark_config["spark.master"] == "local[*]"
    assert pyspark.spark_config["spark.driver.bindAddress"] == "127.0.0.1"
    assert pyspark.spark_config["spark.pyspark.python"] == sys.executable
    policy = resources["inline_policy"].policy()
    assert (policy.threshold_bytes, policy.max_bytes) == (4096, 16384)

    # The location is a template in the definitions (what the UI shows), expanded at run
    # time; described without the password.
    persist = resources["persist"]
    assert persist.consensus_uri.startswith("${PERSIST_CONSENSUS_URI:-sqlite:///")
    assert persist.uris()[0] == f"sqlite:///{shipped_env}/consensus.db"
    monkeypatch.setenv("PERSIST_CONSENSUS_URI", "postgresql://app:hunter22@db:5432/persist")
    assert persist.uris()[0] == "postgresql://app:hunter22@db:5432/persist"
    assert "hunter22" not in persist.describe()
    assert "hunter22" not in persist.consensus_uri


def test_dagster_loads_the_workspace(shipped_env: Path) -> None:
    """Dagster's own loader (a code server process) accepts workspace.yaml."""
    env = {**os.environ, "DAGSTER_HOME": str(shipped_env.parent / "dagster_home")}
    Path(env["DAGSTER_HOME"]).mkdir()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate",
         "-w", str(DEFAULT_WORKSPACE)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "persist_pipeline" in done.stdout + done.stderr


def test_dagster_loads_the_project_without_a_workspace_file(shipped_env: Path) -> None:
    """`dagster dev` / `dagster definitions validate` run in the project folder without -w
    find the code location through [tool.dagster] in pyproject.toml."""
    env = {**os.environ, "DAGSTER_HOME": str(shipped_env.parent / "dagster_home")}
    Path(env["DAGSTER_HOME"]).mkdir()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "persist_pipeline" in done.stdout + done.stderr



def test_dg_launch_materializes_from_the_project_folder(shipped_env: Path) -> None:
    """`dg launch --assets ...`, the command the docs give (Dagster 1.13 supersedes
    `dagster asset materialize` with it), finds the code location through [tool.dg] and
    runs the selection without a SupersessionWarning; `make ui` is `dg dev`."""
    env = {**os.environ, "DAGSTER_HOME": str(shipped_env.parent / "dagster_home")}
    Path(env["DAGSTER_HOME"]).mkdir()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dg"), "launch", "--assets", "ingest/clicks"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "RUN_SUCCESS" in out and "SupersessionWarning" not in out, out[-3000:]
    assert (shipped_env / "consensus.db").exists()  # written where pipeline.yaml says
    makefile = (REPO_ROOT / "Makefile").read_text().replace("\\\n", " ")
    ui = [line for line in makefile.splitlines() if "-w workspace.yaml" in line]
    assert ui and all("/bin/dg dev" in line for line in ui), ui

def test_env_templates_and_redaction() -> None:
    env = {"A": "x", "EMPTY": ""}
    assert expand_env("${A}/${B:-d}/${EMPTY:-e}", env) == "x/d/e"
    with pytest.raises(InvalidConfig, match="B is not set"):
        expand_env("${B}", env)
    text = redact_text("db postgresql://u:pw123@h/db and s3://b/p?endpoint_url=http://h:9"
                       "&secret_access_key=KEY987 hook https://hooks.slack.com/services/T/B/XYZ")
    for secret in ("pw123", "KEY987", "XYZ", "/services/"):
        assert secret not in text
    assert "hooks.slack.com" in text and "endpoint_url=http://h:9" in text


def test_change_stream_snapshots_match_its_model() -> None:
    stream = ChangeStream(keys=7, events_per_write=5, seed=11, value_bytes=16)
    import pyarrow as pa

    tables = []
    kinds = {"insert": 0, "update": 0, "delete": 0}
    for step in range(30):
        changes = stream.changes(step)
        kinds["insert"] += changes.inserts
        kinds["update"] += changes.updates
        kinds["delete"] += changes.deletes
        tables.append(changes.table)
        snapshot = consolidate(pa.concat_tables(tables), as_of=step)
        got = dict(zip(snapshot.column("k").to_pylist(), snapshot.column("v").to_pylist(),
                       strict=True))
        assert set(snapshot.column("d").to_pylist()) <= {1}
        assert got == stream.collection(step + 1)
    assert all(kinds.values()), kinds  # inserts, updates and deletes all happen


def test_the_wheel_installs_the_library_only(tmp_path: Path) -> None:
    """Installing persist-pipeline puts `persist_pipeline` in site-packages and no
    top-level `assets` or `resources` package that would clash with a user's project."""
    import shutil

    # A copy of the project (with assets/ and resources/), so no build/ folder is left in
    # the repository and none from an earlier build is packaged.
    src = tmp_path / "src"
    src.mkdir()
    # setup.py computes the long description (the readme pyproject.toml declares dynamic).
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(REPO_ROOT / name, src / name)
    for name in ("persist_pipeline", "assets", "resources"):
        shutil.copytree(REPO_ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = (tmp_path / "dist").glob("persist_pipeline-*.whl")
    import zipfile

    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    packages = {t for t in top if not t.endswith((".dist-info", ".data"))}
    assert packages == {"persist_pipeline"}, packages
    names = zipfile.ZipFile(wheel).namelist()
    assert "persist_pipeline/dagster_io/io_manager.py" in names


def test_dg_loads_the_project(shipped_env: Path) -> None:
    """`dg` (Dagster's project CLI) finds the project through [tool.dg] in pyproject.toml
    and loads the same definitions as workspace.yaml."""
    env = {**os.environ, "DAGSTER_HOME": str(shipped_env.parent / "dagster_home")}
    Path(env["DAGSTER_HOME"]).mkdir()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dg"), "list", "defs", "--json"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ingest/clicks" in done.stdout and "persist_automation_sensor" in done.stdout
