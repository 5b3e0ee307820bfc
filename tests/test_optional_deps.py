"""The core install (no extras) imports and runs without the optional dependencies.

Installing the library without extras brings only the core dependencies of pyproject.toml;
Dagster, PySpark, PyYAML, pandas, polars, DuckDB and the benchmark peers come with the
``dagster`` / ``spark`` / ``pipeline`` / ``bench`` extras or the user's own project. Each
check runs in a fresh interpreter where importing any of them raises ModuleNotFoundError
(a finder first on ``sys.meta_path``), as it does in a venv that has only the core: a
module of the library that imports one of them at import time fails here, although this
environment has them all installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Not core dependencies (pyproject.toml's extras, and what users bring themselves).
OPTIONAL = ("dagster", "dagster_pyspark", "dagster_webserver", "dagster_postgres", "pyspark",
            "yaml", "pandas", "polars", "duckdb", "deltalake", "pyiceberg", "matplotlib",
            "pyinstrument", "moto", "hypothesis", "grpc_tools")

#: The modules that are integrations with an optional dependency (and say so).
NEEDS_AN_EXTRA = ("persist_pipeline.dagster_io", "persist_pipeline.spark_datasource")

BLOCK = f"""import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Absent())
"""


def _run(code: str, cwd: Path = ROOT, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH: the checkout, also when run from elsewhere.
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_every_core_module_imports_without_the_optional_dependencies() -> None:
    probe = """
import importlib, json, pkgutil
import persist_pipeline
failed = {}
for info in pkgutil.walk_packages(persist_pipeline.__path__, "persist_pipeline."):
    if info.name == "persist_pipeline.__main__":
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as e:
        failed[info.name] = str(e)
print(json.dumps(failed))
"""
    out = _run(probe)
    assert out.returncode == 0, out.stderr[-2000:]
    failed = json.loads(out.stdout)
    core = {m: e for m, e in failed.items() if not m.startswith(NEEDS_AN_EXTRA)}
    assert core == {}, core
    # The integrations themselves do need their extra (the probe really blocked them), and
    # say which: not only "No module named 'dagster'".
    assert "No module named 'pyspark'" in failed["persist_pipeline.spark_datasource"]
    assert "No module named 'dagster'" in failed["persist_pipeline.dagster_io"]
    # Each names its own lean extra (not `pipeline`, which also brings PySpark and the
    # webserver), and that extra exists in pyproject.toml and brings the missing package.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for module, extra, package in (("persist_pipeline.spark_datasource", "spark", "pyspark"),
                                   ("persist_pipeline.dagster_io", "dagster", "dagster")):
        assert f"[{extra}]" in failed[module] and "[pipeline]" not in failed[module], \
            failed[module]
        assert [r for r in extras[extra] if re.match(rf"{package}\b", r)], extras[extra]


def test_the_dagster_extra_is_what_dagster_io_imports_and_pipeline_includes_it() -> None:
    # `dagster` is lean: everything persist_pipeline.dagster_io imports at import time
    # beyond the core, and nothing of the code location's (PySpark, the webserver).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in extras["dagster"]}
    assert names == {"dagster"}, extras["dagster"]
    # What dagster_io imports beyond Dagster itself (and what Dagster imports: pydantic,
    # PyYAML) is core: no optional package that the dagster extra does not bring.
    probe = f"""
import importlib, json, pkgutil, sys
import dagster
before = {{name.split(".")[0] for name in sys.modules}}
import persist_pipeline.dagster_io as io
for info in pkgutil.walk_packages(io.__path__, "persist_pipeline.dagster_io."):
    importlib.import_module(info.name)
new = {{name.split(".")[0] for name in sys.modules}} - before
print(json.dumps(sorted(new & set({OPTIONAL!r}))))
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [], out.stdout
    # `pipeline` (this repository's code location) stays a superset of both lean extras.
    assert "persist-pipeline[dagster,spark]" in extras["pipeline"], extras["pipeline"]


def test_the_simulation_runs_without_pyspark() -> None:
    # greenlet is a core dependency for `persist-pipeline simulate`; its Spark data-source
    # writers run the data source's write path, which needs no PySpark.
    out = _run("from persist_pipeline.cli import main\n"
               "sys.exit(main(['simulate', '--seeds', '2', '--steps', '300', '--seed', '3', "
               "'--profile', 'seams']))")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "violations=0" in out.stdout


def test_shards_config_without_pyyaml_says_what_to_install(tmp_path: Path) -> None:
    (tmp_path / "cfg.yaml").write_text("shards:\n  clicks:\n    source: {kind: synthetic}\n")
    env = {"PERSIST_CONSENSUS_URI": f"sqlite:///{tmp_path / 'c.db'}",
           "PERSIST_BLOB_URI": f"file://{tmp_path / 'b'}"}
    # `shards` only reads: the location must hold a store first.
    made = _run("from persist_pipeline.cli import main\n"
                "sys.exit(main(['new-shard', '--name', 'clicks']))", cwd=tmp_path, env=env)
    assert made.returncode == 0, made.stderr[-2000:]
    out = _run("from persist_pipeline.cli import main\n"
               "sys.exit(main(['shards', '--config', 'cfg.yaml']))", cwd=tmp_path, env=env)
    # The package is not on a package index: the hint names what to install, not a
    # `pip install persist-pipeline[...]` that would look the name up there.
    assert out.returncode == 2, out.stderr[-2000:]
    assert "pip install pyyaml" in out.stderr and "persist-pipeline[" not in out.stderr
