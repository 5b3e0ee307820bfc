"""Print the requirements pyproject.toml declares, one per line, for ``pip install -r``.

Used by ``Dockerfile.user-code`` so the image installs exactly the project's runtime
dependencies plus the extras named (``--extra pipeline``), before the project's code is
copied (a cached layer). Standard library only: it runs in a bare ``python`` image.

    python pyproject_requirements.py pyproject.toml --extra pipeline > requirements.txt
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """``[project] dependencies`` plus each extra's entries (self-references expanded)."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    name = re.sub(r"[-_.]+", "-", project["name"]).lower()
    out: list[str] = list(project.get("dependencies", []))
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise SystemExit(f"{pyproject}: no optional-dependencies extra {extra!r}")
        for req in optional[extra]:
            match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*\[([^\]]*)\]\s*", req)
            if match and re.sub(r"[-_.]+", "-", match.group(1)).lower() == name:
                pending += [e.strip() for e in match.group(2).split(",") if e.strip()]
            else:
                out.append(req)
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    """Command line: print the requirements of ``pyproject`` and ``--extra`` extras."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--extra", action="append", default=[],
                        help="an optional-dependencies extra to include (repeatable)")
    args = parser.parse_args(argv)
    sys.stdout.write("".join(f"{r}\n" for r in requirements(args.pyproject, args.extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
