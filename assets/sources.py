"""Landing locations: files arriving in a local folder or under an S3 prefix.

:func:`list_landed` lists the files a landing sensor should consider, each with an
identity (name, size and modification time) that becomes the run key, so a file is
ingested exactly once and a changed file (same name, new content) again.
:func:`read_landed` reads one into a k/v/t/d table with the library's reader; errors
name the file (the S3 URI for S3, with credentials redacted) and the line.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pyarrow as pa

from assets.pipeline_config import FileSource
from persist_pipeline.blob import open_blob, redact_uri
from persist_pipeline.exceptions import InvalidUpdates
from persist_pipeline.ingest import FORMATS, read_updates_file
from resources.env import expand_env


@dataclass(frozen=True)
class LandedFile:
    """A file in a landing location.

    Attributes:
        name: its path relative to the landing folder / prefix (``/``-separated).
        size: bytes.
        modified: modification time (nanoseconds since the epoch for folders, seconds
            with fractions for S3).
    """

    name: str
    size: int
    modified: float

    @property
    def identity(self) -> str:
        """Name, size and modification time: a new identity means new content."""
        return f"{self.name}@{self.size}:{self.modified:.0f}"


def _accepted(name: str, source: FileSource) -> bool:
    base = PurePosixPath(name).name
    if base.startswith((".", "_")) or base.endswith((".tmp", ".part")):
        return False  # hidden, or still being written
    fmt = FORMATS.get(PurePosixPath(name).suffix.lower())
    return fmt is not None and fmt in source.formats


def s3_uri(source: FileSource) -> str:
    """The expanded S3 URI of an S3 landing location (may contain secrets)."""
    return expand_env(source.uri, what="landing uri").strip()


def describe(source: FileSource) -> str:
    """The landing location with credentials removed."""
    return redact_uri(s3_uri(source)) if source.is_s3 else source.uri


def list_landed(source: FileSource) -> list[LandedFile]:
    """Every accepted file now in the landing location, oldest first."""
    files: list[LandedFile] = []
    if source.is_s3:
        blob = open_blob(s3_uri(source))
        try:
            for meta in blob.list_keys(""):
                if _accepted(meta.key, source):
                    files.append(LandedFile(meta.key, meta.size, meta.last_modified))
        finally:
            blob.close()
    else:
        root = Path(source.uri)
        if root.is_dir():
            for path in root.rglob("*"):
                rel = path.relative_to(root).as_posix()
                if path.is_file() and _accepted(rel, source):
                    st = path.stat()
                    files.append(LandedFile(rel, st.st_size, float(st.st_mtime_ns)))
    return sorted(files, key=lambda f: (f.modified, f.name))


def display_name(source: FileSource, name: str) -> str:
    """How messages name a landed file: its path, or its redacted S3 URI."""
    if source.is_s3:
        base = redact_uri(s3_uri(source))
        location, sep, query = base.partition("?")
        return f"{location.rstrip('/')}/{name}" + (f"?{query}" if sep else "")
    return str(Path(source.uri) / name)


def read_landed(source: FileSource, name: str) -> pa.Table:
    """Read the landed file ``name`` into a k/v/t/d table.

    Raises:
        InvalidUpdates: the file is missing, outside the landing location, of a format
            the source does not accept, or has a bad row (the message names the file and
            the line).
    """
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts:
        raise InvalidUpdates(f"{name!r}: a landed file is named relative to its landing "
                             f"location {describe(source)}")
    shown = display_name(source, name)
    if not _accepted(name, source):
        raise InvalidUpdates(f"{shown}: not an accepted file (formats: "
                             f"{', '.join(source.formats)})")
    if not source.is_s3:
        return read_updates_file(Path(source.uri) / rel)
    blob = open_blob(s3_uri(source))
    try:
        data = blob.get(name)
    finally:
        blob.close()
    if data is None:
        raise InvalidUpdates(f"{shown}: no such object")
    with tempfile.TemporaryDirectory(prefix="persist-landing-") as tmp:
        local = Path(tmp) / rel.name
        local.write_bytes(data)
        try:
            return read_updates_file(local)
        except InvalidUpdates as e:
            raise InvalidUpdates(str(e).replace(str(local), shown)) from None
