"""The package a user installs: built as a wheel from this checkout and installed into a
fresh virtualenv, where the library imports and the command runs. The venv reaches this
environment's packages for the dependencies (nothing is downloaded); the project itself
comes only from the wheel."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_the_wheel_installs_into_a_fresh_venv_and_runs(tmp_path: Path) -> None:
    # Built as pip builds it for a user: in an isolated environment with the build
    # requirements pyproject.toml names.
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", str(ROOT), "--no-deps",
                            "-w", str(tmp_path / "dist")],
                           capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-2000:]
    # The build backend's warnings (shown with -v), e.g. a deprecated license table.
    assert "Warning" not in built.stdout + built.stderr, built.stdout[-2000:]
    [wheel] = (tmp_path / "dist").glob("persist_pipeline-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True
                          ).stdout.strip()
    # The dependencies: this environment's site-packages, appended to the new venv's
    # path (a path a .pth file adds has its own .pth files ignored, so this checkout's
    # editable install does not come along).
    deps = sysconfig.get_paths()["purelib"]
    Path(site, "dependencies.pth").write_text(deps + "\n")
    # Install with this interpreter's pip into the new venv's site-packages.
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                                "--target", site, str(wheel)],
                               capture_output=True, text=True, timeout=300, check=False)
    assert installed.returncode == 0, installed.stderr[-2000:]
    # Run outside the checkout, so only the installed copy can be imported.
    probe = ("import persist_pipeline, pathlib; "
             "print(pathlib.Path(persist_pipeline.__file__).parent); "
             "from persist_pipeline import PersistClient, ShardId; "
             "c = PersistClient.open('mem://', 'mem://'); w = c.open_writer(ShardId.new()); "
             "print(w.compare_and_append([(b'k', b'v', 0, 1)], 0, 1).placement)")
    out = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    location, placement = out.stdout.split()
    assert location.startswith(site) and placement == "inline"
    # Only the library is installed: the code location's folders are not packages there.
    assert not (Path(site) / "assets").exists() and not (Path(site) / "resources").exists()
    cli = subprocess.run([str(python), "-m", "persist_pipeline", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 0 and "new-shard" in cli.stdout
    # `shards --config` names a pipeline's shards without the code location installed.
    env = {**os.environ, "PERSIST_CONSENSUS_URI": f"sqlite:///{tmp_path / 'c.db'}",
           "PERSIST_BLOB_URI": f"file://{tmp_path / 'b'}"}
    made = subprocess.run([str(python), "-c",
                           "from persist_pipeline import PersistClient, ShardId; "
                           "c = PersistClient.open(); "
                           "c.create_shard(ShardId.for_pipeline_name('clicks'))"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert made.returncode == 0, made.stderr[-2000:]
    (tmp_path / "cfg.yaml").write_text("shards:\n  clicks:\n    source: {kind: synthetic}\n")
    listed = subprocess.run([str(python), "-m", "persist_pipeline", "shards", "--config",
                             "cfg.yaml"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert listed.returncode == 0, listed.stderr[-2000:]
    [(shard, summary)] = json.loads(listed.stdout).items()
    assert summary["name"] == "clicks" and shard.startswith("s")


def test_the_sdist_and_wheel_hold_the_package_and_nothing_else(tmp_path: Path) -> None:
    # Built from the files of a clean clone (tracked, or new and not ignored), with this
    # environment's setuptools (pyproject.toml's build backend), without build isolation.
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    out = tmp_path / "dist"
    build = ("import sys; from setuptools import build_meta as b; d = sys.argv[1]; "
             "print(b.build_sdist(d)); print(b.build_wheel(d))")
    built = subprocess.run([sys.executable, "-c", build, str(out)], cwd=src,
                           capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-2000:]
    [sdist] = out.glob("*.tar.gz")
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, (built.stdout[-3000:], sorted(out.iterdir()))
    [wheel] = wheels
    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    # What the package loads or ships beside its modules.
    for data in ("persist_pipeline/py.typed", "persist_pipeline/proto/persist.proto",
                 "persist_pipeline/proto/persist_pb2.py",
                 "persist_pipeline/proto/persist_pb2.pyi"):
        assert data in in_wheel and data in in_sdist, data
    modules = {n for n in tracked if n.startswith("persist_pipeline/") and n.endswith(".py")}
    assert modules <= in_wheel and modules <= in_sdist, sorted(modules - in_wheel)
    # Only the library: no tests, results, benchmarks, code location, virtualenv.
    for names in (in_sdist, in_wheel):
        stray = sorted(n for n in names if n.split("/")[0] in
                       {"tests", "results", "bench", ".venv", "assets", "resources", "docker"})
        assert stray == [], stray
    assert all(n.split("/")[0] in {"persist_pipeline", "persist_pipeline-0.1.0.dist-info"}
               for n in in_wheel), sorted(in_wheel)
    # The sdist carries the docs the README links to (and setup.py, which writes the long
    # description); the wheel, only the package.
    for doc in ("docs/design.md", "docs/pipeline.md", "README.md", "setup.py"):
        assert doc in in_sdist, doc
    assert not any(n.startswith("docs/") for n in in_wheel)
    # The long description (what a package index renders) has no relative link: the
    # README's links to files and headings resolve to nothing on an index page.
    metadata = zipfile.ZipFile(wheel).read("persist_pipeline-0.1.0.dist-info/METADATA")
    headers, _, description = metadata.decode().partition("\n\n")
    assert "Content-Type: text/markdown" in headers
    assert "How it works and what it guarantees: `docs/design.md`." in description
    relative = [t for t in re.findall(r"\]\(([^)\s]+)\)", description)
                if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]
    assert relative == [], relative
    # The license text pyproject.toml's license names travels with both.
    assert "LICENSE" in in_sdist
    assert "persist_pipeline-0.1.0.dist-info/licenses/LICENSE" in in_wheel, sorted(in_wheel)
