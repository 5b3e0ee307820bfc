"""Landing locations: files arriving in a local folder or under an S3 prefix.

:func:`scan_landing` lists the files a landing sensor should consider, each with an
identity (name, size and modification time), and the files it ignores (not an accepted
format); a missing or unreadable location raises :class:`LandingLocationError`.
:func:`stat_landed` gives one file's identity when its ingestion runs, so a file is
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
from persist_pipeline.exceptions import InvalidConfig, InvalidUpdates, PersistError
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


class LandingLocationError(InvalidConfig):
    """A landing location that does not exist or cannot be listed."""


@dataclass(frozen=True)
class Landing:
    """What a landing location holds now.

    Attributes:
        files: the accepted files, oldest first.
        ignored: names of files skipped because their format is not accepted (hidden
            files and files still being written are not listed at all).
    """

    files: list[LandedFile]
    ignored: list[str]


def _hidden(name: str) -> bool:
    base = PurePosixPath(name).name
    return base.startswith((".", "_")) or base.endswith((".tmp", ".part"))


def _accepted(name: str, source: FileSource) -> bool:
    if _hidden(name):
        return False  # hidden, or still being written
    fmt = FORMATS.get(PurePosixPath(name).suffix.lower())
    return fmt is not None and fmt in source.formats


def describe(source: FileSource) -> str:
    """The landing location with credentials removed."""
    return redact_uri(source.location())


def scan_landing(source: FileSource) -> Landing:
    """Every accepted file now in the landing location, and the ignored ones.

    Raises:
        LandingLocationError: the folder does not exist (or is not a folder), or the S3
            prefix cannot be listed (no such bucket, access denied, unreachable).
    """
    files: list[LandedFile] = []
    ignored: list[str] = []

    def consider(name: str, size: int, modified: float) -> None:
        if _accepted(name, source):
            files.append(LandedFile(name, size, modified))
        elif not _hidden(name):
            ignored.append(name)

    location = source.location()
    if location.lower().startswith("s3://"):
        try:
            blob = open_blob(location)
            try:
                for meta in blob.list_keys(""):
                    consider(meta.key, meta.size, meta.last_modified)
            finally:
                blob.close()
        except PersistError as e:
            raise LandingLocationError(
                f"cannot list the landing location {describe(source)}: {e}") from None
    else:
        root = Path(location)
        if not root.is_dir():
            what = "is not a folder" if root.exists() else "does not exist"
            raise LandingLocationError(
                f"the landing folder {root} {what}: create it, or fix the shard's source.uri "
                "in the pipeline config")
        try:
            for path in root.rglob("*"):
                if path.is_file():
                    st = path.stat()
                    consider(path.relative_to(root).as_posix(), st.st_size,
                             float(st.st_mtime_ns))
        except OSError as e:
            raise LandingLocationError(
                f"cannot list the landing folder {root}: {e.strerror or e}") from None
    return Landing(sorted(files, key=lambda f: (f.modified, f.name)), sorted(ignored))


def list_landed(source: FileSource) -> list[LandedFile]:
    """Every accepted file now in the landing location, oldest first."""
    return scan_landing(source).files


def stat_landed(source: FileSource, name: str) -> LandedFile:
    """The landed file ``name`` as it is now (its identity), without reading it.

    Raises:
        InvalidUpdates: no such file, or a name outside the landing location.
    """
    rel = _relative(source, name)
    location = source.location()
    shown = display_name(source, name)
    if location.lower().startswith("s3://"):
        blob = open_blob(location)
        try:
            for meta in blob.list_keys(rel.as_posix()):
                if meta.key == rel.as_posix():
                    return LandedFile(meta.key, meta.size, meta.last_modified)
        finally:
            blob.close()
        raise InvalidUpdates(f"{shown}: no such object (was it moved or archived?)")
    path = Path(location) / rel
    try:
        st = path.stat()
    except OSError:
        raise InvalidUpdates(f"{shown}: no such file (was it moved or archived?)") from None
    return LandedFile(rel.as_posix(), st.st_size, float(st.st_mtime_ns))


def _relative(source: FileSource, name: str) -> PurePosixPath:
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts:
        raise InvalidUpdates(f"{name!r}: a landed file is named relative to its landing "
                             f"location {describe(source)}")
    return rel


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
    rel = _relative(source, name)
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
