"""Where the Dagster resources' stores live on this machine.

Both of the code location's resources that write (the ``persist`` resource, ingestion's,
and :class:`~persist_pipeline.dagster_io.PersistIOManager`) are configured with the same
URIs and create what a fresh location needs the same way, so the first run to write
(an ingestion or an asset materialization) works whichever it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


def make_local_dirs(uri: str | None) -> None:
    """Create the local folder a ``sqlite:///`` or ``file:///`` URI names. A URI with a
    host (``file://data/blobs``, a relative path written with two slashes) names no local
    folder: nothing is made, and opening the client refuses it with a clear error."""
    if not uri:
        return
    parts: Any = urlsplit(uri)
    if parts.netloc:
        return
    scheme = parts.scheme.lower()
    if scheme == "sqlite" and parts.path not in ("", "/", "/:memory:"):
        path = unquote(parts.path)[1:]  # sqlite:///rel/or//abs: drop the separator slash
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    elif scheme == "file" and parts.path.startswith("/"):
        Path(unquote(parts.path)).mkdir(parents=True, exist_ok=True)
