"""`make quickstart` shows what its docstring promises a newcomer: small writes inlined,
the inline budget filling so later small writes fall through to blob, compaction
flushing the inline bytes without changing the snapshot, and GC collecting the parts
compaction replaced."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from persist_pipeline.examples import quickstart


def test_the_quickstart_fills_the_budget_compacts_and_collects(tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert quickstart.main(["--dir", str(tmp_path / "qs")]) == 0
    text = out.getvalue()
    rows = [line.split() for line in text.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert len(rows) == 12
    placements = [row[3] for row in rows]
    # The large write goes to blob on its size; small ones once the budget is full.
    assert placements[6] == "blob"
    fell = [line for line in text.splitlines() if line.endswith("(budget full: fell through)")]
    assert fell, text
    assert re.search(r"inline bytes \d+ -> 0,", text), text
    gc = re.search(r"^gc: (\d+) blobs deleted, (\d+) seqnos truncated$", text, re.M)
    assert gc is not None, text
    assert int(gc.group(1)) > 0 and int(gc.group(2)) > 0, gc.group(0)
    assert "identical before and after compaction" in text
    assert "id=2 name=bob balance=99.99 d=1" in text
    assert "id=3" not in text
