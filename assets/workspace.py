"""Load the code location's ``Definitions`` the way ``workspace.yaml`` names them.

Used by ``make run`` and the tests, so both exercise exactly what the Dagster webserver
and daemon load. The module is imported afresh on every call, so the pipeline config
file and the environment are read again.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import dagster as dg
import yaml

from assets.pipeline_config import REPO_ROOT
from persist_pipeline.exceptions import InvalidConfig

DEFAULT_WORKSPACE = REPO_ROOT / "workspace.yaml"


def workspace_target(workspace: Path | str = DEFAULT_WORKSPACE) -> tuple[str, str, Path]:
    """The ``(module, attribute, working_directory)`` of the workspace's one code location."""
    path = Path(workspace).resolve()
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    entries = raw.get("load_from") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict) \
            or "python_module" not in entries[0]:
        raise InvalidConfig(f"{path}: expected load_from with one python_module entry")
    spec = entries[0]["python_module"]
    if isinstance(spec, str):
        return spec, "defs", path.parent
    module = spec.get("module_name")
    if not module:
        raise InvalidConfig(f"{path}: python_module needs a module_name")
    workdir = (path.parent / spec.get("working_directory", ".")).resolve()
    return module, spec.get("attribute", "defs"), workdir


def load_workspace_definitions(workspace: Path | str = DEFAULT_WORKSPACE) -> dg.Definitions:
    """Import the workspace's module afresh and return its ``Definitions``."""
    module_name, attribute, workdir = workspace_target(workspace)
    if str(workdir) not in sys.path:
        sys.path.insert(0, str(workdir))
    sys.modules.pop(module_name, None)
    module = importlib.import_module(module_name)
    defs = getattr(module, attribute, None)
    if not isinstance(defs, dg.Definitions):
        raise InvalidConfig(f"{module_name}.{attribute} is not a dagster Definitions object")
    return defs
