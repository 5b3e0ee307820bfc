"""The package's long description: README.md, with links that work on a package index.

Everything else about the package is in pyproject.toml; this file only computes the
``readme`` field that pyproject.toml declares ``dynamic``. README.md links to files of
the repository by relative path (``docs/design.md``, ``results/ui/...png``) and to its own
headings (``#install``): right on a git host and in a clone, but a package index renders
the long description on a page of its own, where such links resolve to nothing. So the
long description rewrites them:

- with a ``Repository`` (or ``Source``) URL in ``[project.urls]``, to absolute links into
  the repository (``<url>/blob/main/<path>`` for files, ``<url>/raw/main/<path>`` for
  images, ``<url>#<anchor>`` for headings);
- without one (the project has no public home yet), to plain text naming the path, under
  a note that paths are the source repository's (``docs/`` also ships in the sdist), so
  the index page shows no broken links.

Absolute URLs (``https://...``, ``mailto:``) and fenced code are left as they are.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent

#: An inline Markdown link or image: ``[text](target)`` / ``![alt](target)``.
_LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")
_ABSOLUTE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)

#: Opens the long description when relative links became plain text.
NO_REPOSITORY_NOTE = (
    "> Paths such as `docs/design.md` name files of the source repository (`docs/` also "
    "ships in the source distribution).\n\n")


def repository_url(pyproject: dict[str, object]) -> str | None:
    """``[project.urls]``'s repository URL (``Repository`` or ``Source``), if any."""
    project = pyproject.get("project", {})
    urls = project.get("urls", {}) if isinstance(project, dict) else {}
    for key, url in (urls.items() if isinstance(urls, dict) else ()):
        if key.lower().replace(" ", "") in {"repository", "source", "sourcecode"}:
            return str(url).rstrip("/")
    return None


def _rewrite_links(text: str, repository: str | None) -> str:
    def one(match: re.Match[str]) -> str:
        bang, label, target = match.groups()
        if _ABSOLUTE.match(target):
            return match.group(0)
        if repository is not None:
            if target.startswith("#"):
                return f"{bang}[{label}]({repository}{target})"
            kind = "raw" if bang else "blob"
            return f"{bang}[{label}]({repository}/{kind}/main/{target.removeprefix('./')})"
        if target.startswith("#"):
            return f"*{label}*"  # a heading of this text, in italics
        path = target.split("#", 1)[0]
        if label.strip("`") == path:
            return f"`{path}`"
        return f"{label} (`{path}`)"

    return _LINK.sub(one, text)


def long_description(readme: str, repository: str | None) -> str:
    """``readme`` with its relative links made absolute (or plain text), outside code."""
    out, end = [], 0
    for fence in _FENCE.finditer(readme):
        out += [_rewrite_links(readme[end:fence.start()], repository), fence.group(0)]
        end = fence.end()
    out.append(_rewrite_links(readme[end:], repository))
    text = "".join(out)
    if repository is None and text != readme:
        title, sep, rest = text.partition("\n\n")
        text = title + sep + NO_REPOSITORY_NOTE + rest if sep else NO_REPOSITORY_NOTE + text
    return text


if __name__ == "__main__":
    from setuptools import setup

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    setup(long_description=long_description((ROOT / "README.md").read_text(encoding="utf-8"),
                                            repository_url(pyproject)),
          long_description_content_type="text/markdown")
