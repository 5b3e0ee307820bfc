"""The README's Python samples run as printed (the core library's: the first four), and
the first one prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

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
