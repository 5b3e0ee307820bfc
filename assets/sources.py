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

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

import pyarrow as pa

from assets.pipeline_config import FileSource
from persist_pipeline.blob import redact_uri
from persist_pipeline.exceptions import InvalidConfig, InvalidUpdates, PersistError
from persist_pipeline.ingest import FORMATS
from persist_pipeline.landing import LandedObject, LandingLocation


@dataclass(frozen=True)
class LandedFile(LandedObject):
    """A file in a landing location (see :class:`LandedObject`), with its identity."""

    @property
    def identity(self) -> str:
        """Name, size and modification time, and the content tag where the store keeps
        one (S3, whose times are whole seconds): a new identity means new content."""
        base = f"{self.name}@{self.size}:{self.modified:.0f}"
        return f"{base}{_TAG}{self.tag}" if self.tag else base


#: Where an identity's content tag starts, and what a tag is.
_TAG = ":etag="
_ETAG = re.compile(r"[0-9a-f]+(-[0-9]+)?")


def same_file_version(recorded: object, identity: str) -> bool:
    """Whether an identity recorded by a run names the file version ``identity`` does.
    One recorded before identities carried the content tag (name, size and time only)
    still names it: a file ingested then is not ingested again."""
    if recorded == identity:
        return True
    base, tagged, tag = identity.rpartition(_TAG)
    # Only a real tag (hex, and a part count for a multipart upload) is cut off: a name
    # that itself holds ":etag=" names another file.
    return bool(tagged) and _ETAG.fullmatch(tag) is not None and recorded == base


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
    landing = LandingLocation(source.location())
    try:
        objects = landing.list()
    except PersistError as e:
        raise LandingLocationError(
            f"cannot list the landing location {describe(source)}: {e}") from None
    except (FileNotFoundError, NotADirectoryError) as e:
        what = "does not exist" if isinstance(e, FileNotFoundError) else "is not a folder"
        raise LandingLocationError(
            f"the landing folder {landing.location} {what}: create it, or fix the shard's "
            "source.uri in the pipeline config") from None
    except OSError as e:
        raise LandingLocationError(
            f"cannot list the landing folder {landing.location}: {e.strerror or e}") from None
    files = [LandedFile(o.name, o.size, o.modified, o.tag) for o in objects
             if _accepted(o.name, source)]
    ignored = [o.name for o in objects if not _accepted(o.name, source) and not _hidden(o.name)]
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
    landing = LandingLocation(source.location())
    found = landing.stat(rel.as_posix())
    if found is None:
        what = "no such object" if landing.is_s3 else "no such file"
        raise InvalidUpdates(f"{display_name(source, name)}: {what} (was it moved or "
                             "archived?)")
    return LandedFile(found.name, found.size, found.modified, found.tag)


def _relative(source: FileSource, name: str) -> PurePosixPath:
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts:
        raise InvalidUpdates(f"{name!r}: a landed file is named relative to its landing "
                             f"location {describe(source)}")
    return rel


def display_name(source: FileSource, name: str) -> str:
    """How messages name a landed file: its path, or its redacted S3 URI."""
    return LandingLocation(source.location()).describe(name)


def read_landed(source: FileSource, name: str, *, route: str | None = None) -> pa.Table:
    """Read the landed file ``name`` into a k/v/t/d table (and the route column
    ``route``, each row's shard, if given).

    Raises:
        InvalidUpdates: the file is missing, outside the landing location, of a format
            the source does not accept, or has a bad row (the message names the file and
            the line).
    """
    rel = _relative(source, name)
    if not _accepted(name, source):
        raise InvalidUpdates(f"{display_name(source, name)}: not an accepted file (formats: "
                             f"{', '.join(source.formats)})")
    return LandingLocation(source.location()).read_updates(rel.as_posix(), route=route)
