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


def describe(source: FileSource) -> str:
    """The landing location with credentials removed."""
    return redact_uri(source.location())


def list_landed(source: FileSource) -> list[LandedFile]:
    """Every accepted file now in the landing location, oldest first."""
    files: list[LandedFile] = []
    location = source.location()
    if location.lower().startswith("s3://"):
        blob = open_blob(location)
        try:
            for meta in blob.list_keys(""):
                if _accepted(meta.key, source):
                    files.append(LandedFile(meta.key, meta.size, meta.last_modified))
        finally:
            blob.close()
    else:
        root = Path(location)
        if root.is_dir():
            for path in root.rglob("*"):
                rel = path.relative_to(root).as_posix()
                if path.is_file() and _accepted(rel, source):
                    st = path.stat()
                    files.append(LandedFile(rel, st.st_size, float(st.st_mtime_ns)))
    return sorted(files, key=lambda f: (f.modified, f.name))


def display_name(source: FileSource, name: str) -> str:
    """How messages name a landed file: its path, or its redacted S3 URI."""
    location = source.location()
    if location.lower().startswith("s3://"):
        base = redact_uri(location).partition("?")[0]  # the query names no file
        return f"{base.rstrip('/')}/{name}"
    return str(Path(location) / name)


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
    location = source.location()
    if not location.lower().startswith("s3://"):
        return read_updates_file(Path(location) / rel)
    blob = open_blob(location)
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
