"""The docker/ stack, checked without a Docker engine (none runs on CI's machines).

What a ``docker compose up`` would reject or trip over is checked here:

* ``docker-compose.yml`` validates against the Compose Specification's JSON schema (the
  ``compose-spec.json`` that check-jsonschema, a dev dependency, vendors; its sha256 is
  checked against the one the package ships), as written and after interpolation with
  ``.env.example`` (Compose's ``${VAR:-default}`` / ``${VAR:?error}`` rules), with a
  negative control so the validation cannot pass vacuously;
* ``.env.example`` defines every variable the compose file needs, holds only placeholder
  secrets, and the real ``.env`` is git-ignored; published ports bind to 127.0.0.1;
* every file the compose file references exists: build contexts, Dockerfiles, bind-mount
  sources, and every ``COPY`` source of the Dockerfiles (not excluded by their
  ``.dockerignore``); start order and health checks form an acyclic graph;
* the images' Python dependencies match ``pyproject.toml``: they install its runtime
  dependencies and ``pipeline`` extra (plus dagster-postgres, declared in ``dev``), pinned
  in ``constraints.txt`` to versions ``pyproject.toml`` accepts, one Dagster release;
* ``postgres/init-databases.sh`` creates both databases on a real PostgreSQL, and the code
  location loads with the user-code service's own environment and command, with local
  stand-ins for the hosts (the machine's PostgreSQL for ``postgres``, the loopback moto
  server for ``minio``, temp dirs for the containers' paths): in process, where an
  ingestion run executes on the instance of ``docker/dagster.yaml``, and through the
  webserver, which loads it over gRPC from ``docker/workspace.yaml``.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.resources
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml
from jsonschema import Draft202012Validator
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from psycopg2 import sql

from assets.asset_keys import TAG_SHARDS
from assets.pipeline_config import CONFIG_ENV, REPO_ROOT
from assets.workspace import load_workspace_definitions, workspace_target
from persist_pipeline import PersistClient
from tests.fixtures.postgres import PgServer
from tests.pipeline_support import PIPELINE_ENV

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow

DOCKER = REPO_ROOT / "docker"
COMPOSE_FILE = DOCKER / "docker-compose.yml"
ENV_EXAMPLE = DOCKER / ".env.example"
CONSTRAINTS = DOCKER / "constraints.txt"
PYPROJECT = REPO_ROOT / "pyproject.toml"
BIN = Path(sys.executable).parent

#: Services that run until stopped: each needs a health check (minio-setup is one-shot).
LONG_RUNNING = {"postgres", "minio", "spark-master", "spark-worker", "user-code",
                "webserver", "daemon"}
#: Packages the images install beyond pyproject's runtime dependencies and `pipeline` extra.
DOCKER_ONLY = {"dagster-postgres"}


# --- Compose interpolation (the Compose Specification's rules) ----------------------------


class InterpolationError(ValueError):
    """A ``${VAR:?message}`` whose variable is missing, or a malformed expression."""


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a .env file (comments, blank lines and quotes handled)."""
    env: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and _NAME.fullmatch(key.strip()), f"{path}:{number}: not KEY=VALUE"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def interpolate(text: str, env: Mapping[str, str], used: set[str] | None = None) -> str:
    """``text`` with ``$$``, ``$VAR`` and ``${VAR[:-|-|:?|?|:+|+]word}`` substituted.

    ``word`` may itself hold expressions; it is evaluated only when used, as Compose does.
    ``used`` collects the names of variables read without a default.
    """
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$":
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1:i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            depth, j = 1, i + 2
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise InterpolationError(f"unclosed ${{ in {text!r}")
            out.append(_expression(text[i + 2:j - 1], env, used))
            i = j
        elif (match := _NAME.match(text, i + 1)) is not None:
            if used is not None:
                used.add(match.group(0))
            out.append(env.get(match.group(0), ""))
            i = match.end()
        else:
            raise InterpolationError(f"invalid $ in {text!r}")
    return "".join(out)


def _expression(expr: str, env: Mapping[str, str], used: set[str] | None) -> str:
    match = _NAME.match(expr)
    if match is None:
        raise InterpolationError(f"invalid expression ${{{expr}}}")
    name, rest = match.group(0), expr[match.end():]
    value = env.get(name)
    for op in (":-", ":?", ":+", "-", "?", "+"):
        if rest.startswith(op):
            word = rest[len(op):]
            break
    else:
        if rest:
            raise InterpolationError(f"invalid expression ${{{expr}}}")
        if used is not None:
            used.add(name)
        return value or ""
    missing = value is None or (op.startswith(":") and value == "")
    if op in (":-", "-"):
        return interpolate(word, env, used) if missing else str(value)
    if op in (":?", "?"):
        if missing:
            raise InterpolationError(f"{name}: {interpolate(word, env, used)}")
        return str(value)
    return "" if missing else interpolate(word, env, used)


def interpolate_tree(node: Any, env: Mapping[str, str], used: set[str] | None = None) -> Any:
    """A parsed compose document with every string value interpolated (keys are not)."""
    if isinstance(node, str):
        return interpolate(node, env, used)
    if isinstance(node, list):
        return [interpolate_tree(v, env, used) for v in node]
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env, used) for k, v in node.items()}
    return node


def raw_compose() -> dict[str, Any]:
    """docker-compose.yml as written (YAML anchors and merge keys resolved)."""
    doc = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml interpolated with ``env`` (default: .env.example)."""
    result: dict[str, Any] = interpolate_tree(
        raw_compose(), read_env_file(ENV_EXAMPLE) if env is None else env)
    return result


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (mapping or list form) as a dict of strings."""
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return {str(k): "" if v is None else str(v) for k, v in environment.items()}


# --- The Compose Specification schema -----------------------------------------------------


def compose_schema() -> dict[str, Any]:
    """The Compose Specification JSON schema vendored by check-jsonschema, sha256-checked."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    data = (vendor / "compose-spec.json").read_bytes()
    expected = (vendor / "sha256" / "compose-spec.sha256").read_text().split()[0]
    assert hashlib.sha256(data).hexdigest() == expected, "vendored compose-spec.json changed"
    schema: dict[str, Any] = json.loads(data)
    assert schema.get("title") == "Compose Specification"
    return schema


def schema_errors(doc: Any) -> list[str]:
    """Every violation of the Compose schema in ``doc``, as ``path: message`` lines."""
    validator = Draft202012Validator(compose_schema())
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(doc))


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    Draft202012Validator.check_schema(compose_schema())
    assert schema_errors(raw_compose()) == []
    interpolated = compose()
    assert schema_errors(interpolated) == []
    assert set(interpolated["services"]) == LONG_RUNNING | {"minio-setup"}

    # Negative controls: the validator does reject what Compose would reject.
    bad = copy.deepcopy(interpolated)
    bad["services"]["webserver"]["helthcheck"] = bad["services"]["webserver"]["healthcheck"]
    bad["services"]["daemon"]["depends_on"]["user-code"]["condition"] = "service_ready"
    bad["services"]["postgres"]["ports"] = "5432"
    errors = "\n".join(schema_errors(bad))
    assert "helthcheck" in errors and "service_ready" in errors, errors
    assert "services/postgres/ports" in errors, errors


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("a$$b ${SET} $SET ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d}", env) \
        == "a$b x x d d "
    assert interpolate("${UNSET:-${SET:+y}-z} ${SET:+${UNSET-w}}", env) == "y-z w"
    with pytest.raises(InterpolationError, match="UNSET: set it"):
        interpolate("${UNSET:?set it}", env)
    with pytest.raises(InterpolationError, match="EMPTY"):
        interpolate("${EMPTY:?}", env)
    assert interpolate("${EMPTY?}", env) == ""


# --- .env.example, secrets and published ports --------------------------------------------


def test_env_example_is_complete_and_holds_no_secret() -> None:
    example = read_env_file(ENV_EXAMPLE)
    used: set[str] = set()
    compose_vars = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", json.dumps(raw_compose())))
    interpolate_tree(raw_compose(), example, used)
    assert used <= set(example), f"used without a default, missing from .env.example: " \
                                 f"{sorted(used - set(example))}"
    documented = set(example) | {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                 "AWS_EC2_METADATA_DISABLED", "COMPOSE_NETWORK_NAME"}
    assert compose_vars <= documented, sorted(compose_vars - documented)
    assert set(example) <= compose_vars, f"unused in the compose file: " \
                                         f"{sorted(set(example) - compose_vars)}"
    assert "AWS_ACCESS_KEY_ID" in ENV_EXAMPLE.read_text(encoding="utf-8")  # documented

    secrets = {k: v for k, v in example.items()
               if re.search(r"PASSWORD|SECRET|TOKEN", k)}
    assert secrets and all(v.startswith("change-me") for v in secrets.values()), secrets
    assert example["PERSIST_ALERT_WEBHOOK_URL"] == ""

    # Without a .env, Compose refuses to start: every password is required.
    for name in secrets:
        env = {k: v for k, v in example.items() if k != name}
        with pytest.raises(InterpolationError, match=name):
            compose(env)
    # The real .env is never committed.
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=REPO_ROOT,
                             check=False)
    assert ignored.returncode == 0, "docker/.env is not git-ignored"


def test_published_ports_bind_to_loopback_unless_told_otherwise() -> None:
    services = compose()["services"]
    published = {name: s.get("ports", []) for name, s in services.items() if s.get("ports")}
    assert set(published) == {"webserver", "minio", "spark-master"}
    for name, ports in published.items():
        for port in ports:
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), (name, port)
    assert "127.0.0.1:3000:3000" in published["webserver"]
    # Inside its container the webserver listens on every interface (the mapping limits it).
    assert services["webserver"]["command"][:5] == ["dagster-webserver", "-h", "0.0.0.0",
                                                    "-p", "3000"]
    opened = read_env_file(ENV_EXAMPLE) | {"PUBLISH_ADDRESS": "0.0.0.0",
                                           "DAGSTER_UI_PORT": "8000"}
    assert "0.0.0.0:8000:3000" in compose(opened)["services"]["webserver"]["ports"]


# --- Files the compose file references ----------------------------------------------------


@dataclass
class Instruction:
    """One Dockerfile instruction (continuation lines joined)."""

    keyword: str
    args: str
    line: int


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile (comments dropped, ``\\`` continuations joined)."""
    out: list[Instruction] = []
    pending, start = "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        start = start or number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        keyword, _, args = text.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        pending, start = "", 0
    assert not pending, f"{path}: dangling continuation"
    return out


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, ignore_file: Path) -> bool:
    """Whether ``path`` (relative to the build context) is excluded by ``ignore_file``.

    Docker's rules: patterns in order, ``!`` re-includes, the last match wins, and a
    pattern that matches a parent directory matches everything under it.
    """
    if not ignore_file.exists():
        return False
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in ignore_file.read_text(encoding="utf-8").splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        regex = _ignore_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def build_specs() -> dict[str, tuple[Path, Path]]:
    """``{service: (context dir, Dockerfile)}`` of every service that builds an image."""
    specs = {}
    for name, service in compose()["services"].items():
        build = service.get("build")
        if build is None:
            continue
        if isinstance(build, str):
            build = {"context": build}
        context = (DOCKER / build.get("context", ".")).resolve()
        specs[name] = (context, context / build.get("dockerfile", "Dockerfile"))
    return specs


def test_every_file_the_compose_file_references_exists() -> None:
    services = compose()["services"]
    specs = build_specs()
    assert set(specs) == {"spark-master", "spark-worker", "user-code", "webserver", "daemon"}
    for name, (context, dockerfile) in specs.items():
        assert context.is_dir(), f"{name}: build context {context} missing"
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        if not ignore.exists():
            ignore = context / ".dockerignore"
        for ins in dockerfile_instructions(dockerfile):
            if ins.keyword not in ("COPY", "ADD"):
                continue
            args = [a for a in shlex.split(ins.args) if not a.startswith("--")]
            assert "--from" not in ins.args, f"{dockerfile}:{ins.line}: unexpected stage copy"
            for source in args[:-1]:
                assert (context / source).exists(), \
                    f"{name}: {dockerfile.name}:{ins.line}: COPY source {source} missing"
                assert not dockerignored(source, ignore), \
                    f"{name}: {dockerfile.name}:{ins.line}: {source} excluded by {ignore.name}"

    for name, service in services.items():
        for env_file in service.get("env_file", []) or []:
            path = env_file if isinstance(env_file, str) else env_file["path"]
            assert (DOCKER / path).is_file(), f"{name}: env_file {path} missing"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source")
            if source and source.startswith((".", "/")):
                path = (DOCKER / source).resolve()
                assert path.exists(), f"{name}: bind-mount source {source} missing"
                if path.suffix == ".sh":
                    assert path.read_text(encoding="utf-8").startswith("#!"), path
            elif source:
                assert source in (compose()["volumes"] or {}), f"{name}: volume {source}"

    # What the commands name exists in the images: the dagster image's workspace.yaml is
    # copied into its working directory, the user-code command serves the module the
    # repository's workspace.yaml names, and the Dockerfile's CMD is the same command.
    dagster_file = specs["webserver"][1]
    copies = [i.args for i in dockerfile_instructions(dagster_file) if i.keyword == "COPY"]
    assert any("workspace.yaml" in c and "${DAGSTER_HOME}" in c for c in copies), copies
    assert "WORKDIR ${DAGSTER_HOME}" in dagster_file.read_text(encoding="utf-8")
    command = services["user-code"]["command"]
    module, attribute, _ = workspace_target()
    assert command[command.index("-m") + 1] == module
    assert command[command.index("-a") + 1] == attribute
    user_code_file = specs["user-code"][1]
    cmd = [i.args for i in dockerfile_instructions(user_code_file) if i.keyword == "CMD"]
    assert json.loads(cmd[-1]) == command
    for script in (DOCKER / "postgres" / "init-databases.sh",
                   DOCKER / "minio" / "create-bucket.sh"):
        shebang = script.read_text(encoding="utf-8").splitlines()[0]
        subprocess.run([shebang.split("/")[-1].split()[-1], "-n", str(script)], check=True)


def test_the_user_code_image_installs_the_project_from_what_it_copies(tmp_path: Path) -> None:
    """The image's ``pip install -e .`` sees only the files its COPY lines bring into the
    working directory: those alone must build the package (its metadata included)."""
    context, dockerfile = build_specs()["user-code"]
    workdir = tmp_path / "image"
    workdir.mkdir()
    for ins in dockerfile_instructions(dockerfile):
        args = [a for a in shlex.split(ins.args) if not a.startswith("--")]
        if ins.keyword != "COPY" or not args[-1].startswith("."):
            continue  # only what lands in the working directory
        sources, dest = args[:-1], workdir / args[-1]
        for source in sources:
            path = context / source
            target = dest / path.name if args[-1].endswith("/") else dest
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, target)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(workdir)],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_start_order_and_health_checks() -> None:
    services = compose()["services"]
    for name in LONG_RUNNING:
        assert "healthcheck" in services[name], f"{name} has no healthcheck"
        assert services[name].get("restart") == "unless-stopped", name
    graph = {name: dict(s.get("depends_on") or {}) for name, s in services.items()}
    expected = {
        "minio-setup": {"minio": "service_healthy"},
        "spark-worker": {"spark-master": "service_healthy"},
        "user-code": {"postgres": "service_healthy",
                      "minio-setup": "service_completed_successfully",
                      "spark-master": "service_healthy"},
        "webserver": {"postgres": "service_healthy", "user-code": "service_healthy"},
        "daemon": {"postgres": "service_healthy", "user-code": "service_healthy"},
    }
    for name, deps in expected.items():
        assert {k: v["condition"] for k, v in graph[name].items()} == deps, name
    # Acyclic: a topological order exists.
    order: list[str] = []
    remaining = dict(graph)
    while remaining:
        ready = [n for n, deps in remaining.items() if set(deps) <= set(order)]
        assert ready, f"dependency cycle among {sorted(remaining)}"
        order += sorted(ready)
        for n in ready:
            del remaining[n]
    assert order.index("postgres") < order.index("user-code") < order.index("webserver")

    config = yaml.safe_load((DOCKER / "dagster.yaml").read_text(encoding="utf-8"))
    assert config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert config["run_launcher"]["class"] == "DefaultRunLauncher"
    assert services["daemon"]["command"][:2] == ["dagster-daemon", "run"]


# --- The images' Python dependencies ------------------------------------------------------


def _requirements_file(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def pyproject_groups() -> dict[str, list[Requirement]]:
    """``{"runtime": [...], extra: [...]}`` of pyproject.toml, an extra's references to
    other extras of the project (``persist-pipeline[dagster,spark]``) expanded in place."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    optional = project["optional-dependencies"]

    def expand(extra: str, seen: frozenset[str] = frozenset()) -> list[Requirement]:
        out: list[Requirement] = []
        for req in map(Requirement, optional[extra]):
            if canonicalize_name(req.name) != "persist-pipeline":
                out.append(req)
            elif extra not in seen:
                for inner in sorted(req.extras, key=list(optional).index):
                    out += expand(inner, seen | {extra})
        return out

    groups = {"runtime": [Requirement(r) for r in project["dependencies"]]}
    for extra in optional:
        groups[extra] = list(dict.fromkeys(expand(extra)))
    return groups


def _pip_installs(dockerfile: Path) -> list[list[str]]:
    runs = [i.args for i in dockerfile_instructions(dockerfile) if i.keyword == "RUN"]
    commands = [c.strip() for run in runs for c in re.split(r"&&|;", run)]
    return [shlex.split(c)[2:] for c in commands if c.startswith("pip install")]


def test_image_python_dependencies_match_pyproject() -> None:
    groups = pyproject_groups()
    declared: dict[str, list[Requirement]] = {}
    for reqs in groups.values():
        for req in reqs:
            if canonicalize_name(req.name) != "persist-pipeline":
                declared.setdefault(canonicalize_name(req.name), []).append(req)
    pins = {canonicalize_name(r.name): r for r in _requirements_file(CONSTRAINTS)}
    versions = {}
    for name, pin in pins.items():
        specs = list(pin.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{name}: pin with =="
        versions[name] = Version(specs[0].version)
        for req in declared.get(name, []):
            assert req.specifier.contains(versions[name]), \
                f"constraints.txt pins {name}=={versions[name]}, pyproject.toml wants {req}"

    # One Dagster release: dagster 1.X.Y with its libraries at 0.(X+16).Y.
    core = versions["dagster"]
    for name, version in versions.items():
        if name.startswith("dagster"):
            expected = core if version.major == 1 else Version(
                f"0.{core.minor + 16}.{core.micro}")
            assert version == expected, f"{name}=={version} is not the release of {core}"

    # The images install exactly what pyproject.toml declares, all of it pinned.
    pipeline = {canonicalize_name(r.name) for r in groups["runtime"] + groups["pipeline"]}
    user_code = {canonicalize_name(r.name)
                 for r in _requirements_file(DOCKER / "requirements-user-code.txt")}
    dagster_image = {canonicalize_name(r.name)
                     for r in _requirements_file(DOCKER / "requirements-dagster.txt")}
    assert user_code == DOCKER_ONLY and set(declared) >= DOCKER_ONLY
    assert dagster_image <= pipeline | DOCKER_ONLY, dagster_image - pipeline
    for name in (pipeline | user_code | dagster_image):
        if name.startswith("dagster") or name == "pyspark":
            assert name in pins, f"{name} is installed by an image but not pinned"

    output = subprocess.run(
        [sys.executable, str(DOCKER / "pyproject_requirements.py"), str(PYPROJECT),
         "--extra", "pipeline"], capture_output=True, text=True, check=True).stdout
    # The same requirements (the script lists an extra's own before those it includes).
    assert sorted(str(Requirement(r)) for r in output.split()) == sorted(
        dict.fromkeys(str(r) for r in groups["runtime"] + groups["pipeline"]))

    specs = build_specs()
    user_installs = _pip_installs(specs["user-code"][1])
    assert ["-c", "/opt/docker/constraints.txt", "-r", "/opt/docker/requirements-pyproject.txt",
            "-r", "/opt/docker/requirements-user-code.txt"] in user_installs, user_installs
    assert ["--no-deps", "-e", "."] in user_installs
    assert re.search(r"pyproject_requirements\.py pyproject\.toml --extra pipeline",
                     specs["user-code"][1].read_text(encoding="utf-8"))
    assert _pip_installs(specs["webserver"][1]) == [
        ["-c", "/opt/docker/constraints.txt", "-r", "/opt/docker/requirements-dagster.txt"]]
    for args in user_installs + _pip_installs(specs["webserver"][1]):
        bare = [a for i, a in enumerate(args) if not a.startswith("-")
                and args[i - 1] not in ("-c", "-r", "-e")]
        assert bare == [], f"unpinned, undeclared pip install arguments: {bare}"

    # Both images on one Python that pyproject.toml accepts.
    requires = tomllib.loads(PYPROJECT.read_text())["project"]["requires-python"]
    pythons = set()
    for _, dockerfile in specs.values():
        args = [i.args for i in dockerfile_instructions(dockerfile) if i.keyword == "ARG"]
        pythons |= {a.split("=", 1)[1] for a in args if a.startswith("PYTHON_VERSION=")}
        assert "FROM python:${PYTHON_VERSION}-slim-bookworm" in dockerfile.read_text()
    assert len(pythons) == 1
    assert Requirement(f"python{requires}").specifier.contains(f"{pythons.pop()}.0")
    assert "openjdk-17-jre-headless" in specs["user-code"][1].read_text()


# --- The docker configuration on local stand-ins ------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class StandIns:
    """The docker configuration's environment, with local stand-ins for the hosts."""

    env: dict[str, str]            # .env for the stack (unique database names)
    home: Path                     # stand-in DAGSTER_HOME with docker/dagster.yaml
    replacements: dict[str, str]   # container host/path -> local stand-in
    pg: PgServer
    s3_endpoint: str
    data_dir: Path                 # stand-in for the persist-data volume (/data)

    def apply(self, value: str) -> str:
        """``value`` with every container host and path replaced by its stand-in."""
        for old, new in self.replacements.items():
            value = value.replace(old, new)
        return value

    def service_env(self, name: str) -> dict[str, str]:
        """A service's environment from docker-compose.yml, hosts replaced by stand-ins."""
        raw = service_env(compose(self.env)["services"][name])
        out = {k: self.apply(v) for k, v in raw.items()}
        if out.get("DAGSTER_POSTGRES_HOST") == "postgres":
            out["DAGSTER_POSTGRES_HOST"] = self.pg.host
            out["DAGSTER_POSTGRES_PORT"] = str(self.pg.port)
        if "SPARK_LOCAL_HOSTNAME" in out:
            out["SPARK_LOCAL_HOSTNAME"] = "127.0.0.1"
        if "PERSIST_PIPELINE_DATA_DIR" in out:
            out["PERSIST_PIPELINE_DATA_DIR"] = str(self.data_dir)
        return out


@pytest.fixture
def stand_ins(pg_server: PgServer, s3_server: str, s3_client: Any,
              tmp_path: Path) -> Iterator[StandIns]:
    """Databases made by postgres/init-databases.sh, a moto bucket, a DAGSTER_HOME."""
    suffix = uuid.uuid4().hex[:10]
    env = read_env_file(ENV_EXAMPLE) | {
        "DAGSTER_POSTGRES_DB": f"dagster_{suffix}", "DAGSTER_POSTGRES_USER": f"dagster_{suffix}",
        "PERSIST_DB": f"persist_{suffix}", "PERSIST_DB_USER": f"persist_{suffix}",
        "PERSIST_BUCKET": f"persist-{suffix}",
        "POSTGRES_USER": pg_server.user,
    }
    home = tmp_path / "opt-dagster" / "dagster_home"
    home.mkdir(parents=True)
    replacements = {
        "@postgres:5432/": f"@{pg_server.host}:{pg_server.port}/",
        "http://minio:9000": s3_server,
        "spark://spark-master:7077": "spark://127.0.0.1:7077",  # nothing listens: not needed
        "/opt/dagster/": f"{tmp_path / 'opt-dagster'}/",
        "/opt/persist": str(REPO_ROOT),
    }
    ins = StandIns(env, home, replacements, pg_server, s3_server, tmp_path / "data")
    for name in ("dagster.yaml", "workspace.yaml"):  # as the Dockerfiles copy them
        (home / name).write_text(ins.apply((DOCKER / name).read_text(encoding="utf-8")))

    script_env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    script_env |= service_env(compose(env)["services"]["postgres"])
    script_env |= {"PGHOST": pg_server.host, "PGPORT": str(pg_server.port)}
    subprocess.run(["bash", str(DOCKER / "postgres" / "init-databases.sh")], env=script_env,
                   check=True, capture_output=True, timeout=60)
    s3_client.create_bucket(Bucket=env["PERSIST_BUCKET"])
    try:
        yield ins
    finally:
        conn = pg_server.connect()
        try:
            with conn.cursor() as cur:
                for key in ("DAGSTER_POSTGRES", "PERSIST"):
                    db = env[f"{key}_DB"]
                    user = env[f"{key}_USER" if key == "DAGSTER_POSTGRES" else "PERSIST_DB_USER"]
                    cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(db)))
                    cur.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(user)))
        finally:
            conn.close()


def test_init_script_creates_both_databases_with_their_owners(stand_ins: StandIns) -> None:
    conn = stand_ins.pg.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT datname, pg_get_userbyid(datdba) FROM pg_database "
                        "WHERE datname IN (%s, %s)",
                        (stand_ins.env["DAGSTER_POSTGRES_DB"], stand_ins.env["PERSIST_DB"]))
            owners = dict(cur.fetchall())
    finally:
        conn.close()
    assert owners == {stand_ins.env["DAGSTER_POSTGRES_DB"]: stand_ins.env["DAGSTER_POSTGRES_USER"],
                      stand_ins.env["PERSIST_DB"]: stand_ins.env["PERSIST_DB_USER"]}


def test_code_location_loads_and_runs_with_the_docker_environment(
        stand_ins: StandIns, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: the user-code service's environment loads the definitions, and an
    ingestion run executes on docker/dagster.yaml's instance (PostgreSQL storage), writing
    to the stack's consensus database and bucket."""
    env = stand_ins.service_env("user-code")
    leftovers = [f"{k}={v}" for k, v in env.items()
                 if re.search(r"\b(postgres|minio|spark-master|user-code)[:/]", v)]
    assert leftovers == [], f"hosts without a stand-in: {leftovers}"
    for name in (*PIPELINE_ENV, CONFIG_ENV, "DAGSTER_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Path(env["DAGSTER_HOME"]) == stand_ins.home

    defs = load_workspace_definitions()
    persist = defs.resources["persist"]
    consensus, blob, wal = persist.uris()
    pg = stand_ins.pg
    assert consensus.startswith(f"postgresql://{stand_ins.env['PERSIST_DB_USER']}:")
    assert consensus.endswith(f"@{pg.host}:{pg.port}/{stand_ins.env['PERSIST_DB']}")
    assert blob == (f"s3://{stand_ins.env['PERSIST_BUCKET']}/blobs?endpoint_url="
                    f"{stand_ins.s3_endpoint}&region=us-east-1")
    assert wal is None
    assert defs.resources["pyspark"].master == "spark://127.0.0.1:7077"
    assert defs.resources["inline_policy"].policy().max_bytes == 1 << 20

    instance = dg.DagsterInstance.from_config(str(stand_ins.home))
    try:
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        assert type(instance.run_launcher).__name__ == "DefaultRunLauncher"
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        keys = [dg.AssetKey(["ingest", "clicks"]), dg.AssetKey(["ingest", "inventory"])]
        result = defs.resolve_job_def("ingestion_job").execute_in_process(
            instance=instance, asset_selection=keys, tags={TAG_SHARDS: "clicks,inventory"},
            run_config={"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}})
        assert result.success
        placements = {e.asset_key.path[-1]:
                      e.step_materialization_data.materialization.metadata["Placement"].value
                      for e in result.get_asset_materialization_events()}
        assert placements == {"clicks": "inline", "inventory": "inline"}
        assert instance.get_runs_count() == 1  # in the stack's Dagster database
    finally:
        instance.dispose()

    client = PersistClient.open(consensus, blob)
    try:
        summaries = client.shard_summaries()
    finally:
        client.close()
    assert len(summaries) == 2
    assert all(s.upper == 1 and s.inline_bytes > 0 for s in summaries.values()), summaries


def _default_signals() -> None:
    """In a child process: SIGINT and SIGTERM back to their defaults. A shell that runs
    pytest in the background makes children ignore SIGINT, and Dagster's processes handle
    SIGTERM as they handle SIGINT, so they would ignore both."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _start(cmd: list[str], env: Mapping[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=dict(env), cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_default_signals)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc`` and its children (its own process group): TERM, then KILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        proc.wait(timeout=10)


def _local(command: list[str]) -> list[str]:
    """A container command for this machine: its executables from the venv."""
    exe = BIN / command[0]
    return [str(exe) if exe.exists() else command[0], *command[1:]]


def _graphql(port: int, query: str) -> Any:
    """POST ``query`` to the webserver on ``port``; raises OSError while it is not up."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


LOCATION_QUERY = (
    "{ workspaceOrError { __typename ... on Workspace { locationEntries { name "
    "locationOrLoadError { __typename ... on RepositoryLocation { repositories { "
    "sensors { name sensorState { status } } schedules { name scheduleState { status } } } } "
    "... on PythonError { message } } } } } }")
INSTANCE_QUERY = (
    "{ instance { runQueuingSupported runLauncher { name } daemonHealth { "
    "allDaemonStatuses { daemonType required healthy } } } }")


def test_webserver_and_daemon_load_the_code_location_over_grpc(stand_ins: StandIns,
                                                               tmp_path: Path) -> None:
    """The user-code, webserver and daemon services' own commands and environments
    (stand-ins for hosts, loopback ports): the webserver and the daemon read
    docker/workspace.yaml and load the code location from the gRPC server; every sensor
    and schedule is running, the daemon's queue, scheduler and sensor daemons are healthy."""
    services = compose(stand_ins.env)["services"]
    grpc_port, ui_port = _free_port(), _free_port()
    base = {k: v for k, v in os.environ.items()
            if k not in (*PIPELINE_ENV, CONFIG_ENV) and not k.startswith(("DAGSTER_", "AWS_"))}
    grpc_cmd = [stand_ins.apply(a) for a in services["user-code"]["command"]]
    grpc_cmd[grpc_cmd.index("-h") + 1] = "127.0.0.1"
    grpc_cmd[grpc_cmd.index("-p") + 1] = str(grpc_port)
    ui_cmd = list(services["webserver"]["command"])
    ui_cmd[ui_cmd.index("-h") + 1] = "127.0.0.1"
    ui_cmd[ui_cmd.index("-p") + 1] = str(ui_port)
    for name in ("webserver", "daemon"):
        env = stand_ins.service_env(name)
        assert (env["DAGSTER_GRPC_HOST"], env["DAGSTER_GRPC_PORT"]) == ("user-code", "4000")
    grpc_stand_in = {"DAGSTER_GRPC_HOST": "127.0.0.1", "DAGSTER_GRPC_PORT": str(grpc_port),
                     "DAGSTER_HOME": str(stand_ins.home)}

    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_start(_local(grpc_cmd), base | stand_ins.service_env("user-code"),
                            tmp_path, tmp_path / "user-code.log"))
        deadline = time.monotonic() + 90
        while subprocess.run(
                _local(["dagster", "api", "grpc-health-check", "-p", str(grpc_port)]),
                capture_output=True, check=False).returncode != 0:
            assert procs[0].poll() is None, (tmp_path / "user-code.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "gRPC server not healthy in 90 s"
            time.sleep(1)
        # The dagster image's working directory is DAGSTER_HOME, holding workspace.yaml.
        for name, cmd in (("webserver", ui_cmd), ("daemon", services["daemon"]["command"])):
            procs.append(_start(_local(cmd), base | stand_ins.service_env(name) | grpc_stand_in,
                                stand_ins.home, tmp_path / f"{name}.log"))

        def logs() -> str:
            return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                             for p in sorted(tmp_path.glob("*.log")))

        deadline = time.monotonic() + 90
        location: dict[str, Any] | None = None
        daemons: dict[str, bool] = {}
        wanted = {"SCHEDULER", "SENSOR", "QUEUED_RUN_COORDINATOR"}
        while location is None or not all(daemons.get(d) for d in wanted):
            assert all(p.poll() is None for p in procs), logs()
            assert time.monotonic() < deadline, f"not ready in 90 s: {daemons}\n{logs()}"
            time.sleep(1)
            try:
                entries = _graphql(ui_port, LOCATION_QUERY)["data"]["workspaceOrError"][
                    "locationEntries"]
                instance = _graphql(ui_port, INSTANCE_QUERY)["data"]["instance"]
            except OSError:
                continue
            assert [e["name"] for e in entries] == ["persist_pipeline"], entries
            location = entries[0]["locationOrLoadError"]
            daemons = {d["daemonType"]: bool(d["healthy"])
                       for d in instance["daemonHealth"]["allDaemonStatuses"]}
    finally:
        for proc in reversed(procs):
            _stop(proc)

    assert location["__typename"] == "RepositoryLocation", location
    repo = location["repositories"][0]
    sensors = {s["name"]: s["sensorState"]["status"] for s in repo["sensors"]}
    schedules = {s["name"]: s["scheduleState"]["status"] for s in repo["schedules"]}
    assert {"inline_pressure_sensor", "orders_landing_sensor",
            "persist_automation_sensor"} <= set(sensors)
    assert set(schedules) == {"shard_checks_schedule"}
    assert set(sensors.values()) == set(schedules.values()) == {"RUNNING"}
    assert instance["runQueuingSupported"] is True  # QueuedRunCoordinator
    assert instance["runLauncher"]["name"] == "DefaultRunLauncher"
