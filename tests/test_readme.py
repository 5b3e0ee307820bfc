"""The README's Python samples run as printed (the core library's: the first four), and
the first one prints what its comments say; its links work as a package index shows it
(setup.py's long description)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _samples() -> dict[str, str]:
    """Each ```python block of the README under the heading it follows."""
    text = README.read_text()
    out: dict[str, str] = {}
    heading = ""
    for match in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```", text, re.M | re.S):
        if match.group(1):
            heading = match.group(1).strip()
        elif heading not in out:
            out[heading] = match.group(2)
    return out


def test_the_core_samples_run_and_print_what_they_say(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    samples = _samples()
    wanted = ["Ten lines of Python",
              "Typed shards: columns instead of bytes, upsert and delete by key",
              "Named shards", "Reading a shard from DuckDB, polars, pandas and Spark"]
    assert set(wanted) <= set(samples), sorted(samples)
    monkeypatch.chdir(tmp_path)
    first = samples[wanted[0]].replace("file:///tmp/persist-blobs",
                                       f"file://{tmp_path / 'blobs'}")
    namespace: dict[str, object] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(first, "README: ten lines", "exec"), namespace)
    expected = [line.split("# ", 1)[1].strip()
                for line in first.splitlines() if line.startswith("print(")]
    got = printed.getvalue().splitlines()
    assert len(got) == len(expected) == 3
    assert got[0] == expected[0]                          # placement and encoded bytes
    assert got[1] == expected[1]                          # the snapshot's rows
    assert got[2] == expected[2].split(":")[0]            # inline bytes after compaction
    for name in wanted[1:]:
        exec(compile(samples[name], f"README: {name}", "exec"), namespace)
    assert os.path.exists(tmp_path / "persist.db")
    namespace["client"].close()  # type: ignore[attr-defined]


# --- The README as a package index shows it (setup.py's long description) ------------------

_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")


def _setup_module() -> Any:
    spec = importlib.util.spec_from_file_location("persist_setup", README.parent / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: setup() does not run
    return module


def _outside_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def test_every_relative_link_of_the_readme_names_a_file_of_the_repository() -> None:
    # What the long description rewrites must exist, on a git host and in a clone.
    root = README.parent
    for target in _LINK.findall(_outside_fences(README.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target, re.I):
            continue
        assert (root / target.split("#")[0]).exists(), target


def test_the_long_description_has_no_relative_link() -> None:
    setup = _setup_module()
    readme = README.read_text()
    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text())
    # The project names no repository URL yet: links become text, under a note.
    assert setup.repository_url(pyproject) is None
    plain = setup.long_description(readme, None)
    assert _LINK.findall(_outside_fences(plain)) == [], _LINK.findall(plain)
    assert setup.NO_REPOSITORY_NOTE in plain
    assert "How it works and what it guarantees: `docs/design.md`." in plain
    assert "[metadata plots](results/ui/asset-clicks-plots.png)" not in plain
    assert "metadata plots (`results/ui/asset-clicks-plots.png`)" in plain
    # Fenced code is left alone.
    fences = re.findall(r"^```.*?^```", readme, re.M | re.S)
    assert fences and fences == re.findall(r"^```.*?^```", plain, re.M | re.S)
    # With one, every link is absolute: files (blob), images (raw), headings (#anchor).
    url = "https://git.example/team/persist-pipeline"
    assert setup.repository_url({"project": {"urls": {"Repository": url + "/"}}}) == url
    linked = setup.long_description(readme + "\n![plot](results/ui/runs.png)\n", url)
    targets = _LINK.findall(_outside_fences(linked))
    assert targets and all(t.startswith(url) for t in targets), targets
    assert f"{url}/blob/main/docs/design.md" in targets
    assert f"{url}/raw/main/results/ui/runs.png" in targets
    assert f"{url}#install" in targets
    assert setup.NO_REPOSITORY_NOTE not in linked
