"""Landing locations: where files of updates arrive before ingestion.

A landing location is a local folder or an S3 prefix (``s3://bucket/prefix?...``, with
the blob store's URI options and credential chain). :class:`LandingLocation` lists its
objects, gives one object's identity, and reads one into a k/v/t/d table with the
library's file readers, refusing extra columns as the CLI's ``append`` does; errors
name the object by its path or redacted URI. The
Dagster code location reaches landing files only through it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pyarrow as pa

from persist_pipeline.blob import open_blob, redact_uri
from persist_pipeline.exceptions import InvalidInput, InvalidUpdates
from persist_pipeline.ingest import read_updates_file


@dataclass(frozen=True)
class LandedObject:
    """An object in a landing location.

    Attributes:
        name: its path relative to the folder / prefix (``/``-separated).
        size: bytes.
        modified: modification time (nanoseconds since the epoch for folders, seconds
            with fractions for S3).
        tag: a tag of its content where the store keeps one (S3's ETag), else "": S3
            stamps modification times in whole seconds, so an overwrite of the same
            size within one second changes only this.
    """

    name: str
    size: int
    modified: float
    tag: str = ""


class LandingLocation:
    """A local folder or an S3 prefix holding landed files (see the module docstring)."""

    def __init__(self, location: str) -> None:
        self.location = location
        self.is_s3 = location.lower().startswith("s3://")

    def describe(self, name: str | None = None) -> str:
        """The location (or one object in it) as messages show it: credentials removed."""
        if not self.is_s3:
            return str(Path(self.location) / name) if name else self.location
        base = redact_uri(self.location).partition("?")[0]  # the query names no object
        return f"{base.rstrip('/')}/{name}" if name else redact_uri(self.location)

    def list(self) -> list[LandedObject]:
        """Every object under the location.

        Raises:
            FileNotFoundError / NotADirectoryError / OSError: a folder that is missing,
                not a folder, or unreadable.
            PersistError: an S3 prefix that cannot be listed (a ``BlobError``).
        """
        if self.is_s3:
            blob = open_blob(self.location)
            try:
                return [LandedObject(m.key, m.size, m.last_modified, m.etag)
                        for m in blob.list_keys("")]
            finally:
                blob.close()
        root = Path(self.location)
        if not root.is_dir():
            if root.exists():
                raise NotADirectoryError(str(root))
            raise FileNotFoundError(str(root))
        out = []
        for path in root.rglob("*"):
            if path.is_file():
                st = path.stat()
                out.append(LandedObject(path.relative_to(root).as_posix(), st.st_size,
                                        float(st.st_mtime_ns)))
        return out

    def stat(self, name: str) -> LandedObject | None:
        """The object ``name`` as it is now, or None if there is none.

        Raises:
            InvalidInput: ``name`` is not a path inside the location.
        """
        rel = self._relative(name)
        if self.is_s3:
            blob = open_blob(self.location)
            try:
                for meta in blob.list_keys(rel):
                    if meta.key == rel:
                        return LandedObject(meta.key, meta.size, meta.last_modified,
                                            meta.etag)
            finally:
                blob.close()
            return None
        try:
            st = (Path(self.location) / rel).stat()
        except OSError:
            return None
        return LandedObject(rel, st.st_size, float(st.st_mtime_ns))

    def read_updates(self, name: str, *, route: str | None = None) -> pa.Table:
        """The object ``name`` read as updates (CSV, JSON lines or Parquet by suffix),
        with the route column ``route`` if given (see :func:`read_updates_file`).

        A column besides k, v, t, d and ``route`` is refused by name, as the CLI's
        ``append`` refuses it: a shard has no place for it, and dropping it would lose
        data its sender meant to store.

        Raises:
            InvalidUpdates: no such object, a bad row (the message names the object
                as :meth:`describe` shows it, and the line), or an extra column.
            InvalidInput: ``name`` is not a path inside the location.
        """
        rel = self._relative(name)
        if not self.is_s3:
            return read_updates_file(Path(self.location) / rel, route=route,
                                     extra_columns=False)
        shown = self.describe(rel)
        blob = open_blob(self.location)
        try:
            data = blob.get(rel)
        finally:
            blob.close()
        if data is None:
            raise InvalidUpdates(f"{shown}: no such object")
        with tempfile.TemporaryDirectory(prefix="persist-landing-") as tmp:
            local = Path(tmp) / PurePosixPath(rel).name
            local.write_bytes(data)
            try:
                return read_updates_file(local, route=route, extra_columns=False)
            except InvalidUpdates as e:
                raise InvalidUpdates(str(e).replace(str(local), shown)) from None

    def _relative(self, name: str) -> str:
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts:
            raise InvalidInput(f"{name!r}: a landed file is named relative to its landing "
                               f"location {self.describe()}")
        return rel.as_posix()
