"""A blob store in a local directory: one file per key, written atomically.

URIs are ``file:///absolute/dir`` (or ``file://localhost/absolute/dir``); percent-escapes
in the path are decoded. Relative paths are not accepted in URIs (``file://./x`` would
make ``.`` a host name, and a URI meaning different things from different working
directories is a trap for multi-process pipelines): pass a relative ``Path`` to
:class:`LocalBlob` directly, which resolves it once against the current directory.

Layout and guarantees:

* key ``a/b/c`` is the file ``<root>/a/b/c``; directories are created as needed and
  removed again when a delete leaves them empty;
* :meth:`LocalBlob.set` writes a temporary file ``.tmp-<32 hex>`` in the target's
  directory, fsyncs it, renames it over the target with :func:`os.replace` and fsyncs
  the directory, so a reader (or a crash) sees the old value, the whole new value, or
  nothing, never a partial file. Key segments of that temp-file form are rejected, and
  listings skip leftover temp files of crashed writers (GC's orphan sweep deletes them
  once older than the orphan age: :meth:`LocalBlob.sweep_partial_writes`);
* no key can reach outside the root: besides the key rules of
  :func:`~persist_pipeline.blob.base.validate_key`, every path is resolved (following
  symlinks) and must stay under the resolved root;
* listings contain regular files only (symlinks are not followed);
* a key cannot name both an object and a "directory" of other keys (``a`` and ``a/b``):
  unlike S3, a file system cannot hold both, so the second write raises BlobError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

from persist_pipeline.blob._uri import parse_query, split_uri
from persist_pipeline.blob.base import (
    Blob,
    BlobMeta,
    validate_key,
    validate_prefix,
    validate_range,
    validate_value,
)
from persist_pipeline.exceptions import (
    BlobAuthError,
    BlobError,
    BlobLocationNotFound,
    BlobUnavailable,
    InvalidInput,
    InvalidUri,
)

_TEMP_PREFIX = ".tmp-"
_TEMP_RE = re.compile(r"^\.tmp-[0-9a-f]{32}$")
# Retries when a concurrent delete removes a directory a set has just created.
_SET_ATTEMPTS = 5


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBlob(Blob):
    """A blob store in a directory of the local file system.

    Args:
        root: the directory (created with its parents if missing). A relative path is
            resolved against the current directory once, here.
        create: create ``root`` if missing; if False a missing root raises
            BlobLocationNotFound.

    Raises:
        BlobLocationNotFound: if the root does not exist and cannot or may not be made.
        BlobAuthError: if permission to create or use the root is denied.
    """

    kind = "file"

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        path = Path(root).expanduser().absolute()
        try:
            if create:
                path.mkdir(parents=True, exist_ok=True)
            if not path.is_dir():
                raise BlobLocationNotFound(f"no store at {str(path)!r}: the blob directory "
                                           f"does not exist")
        except PermissionError as exc:
            raise BlobAuthError(f"permission denied creating blob directory {str(path)!r}") from exc
        except (FileExistsError, NotADirectoryError) as exc:
            raise BlobLocationNotFound(
                f"blob directory {str(path)!r} cannot be created: a file is in the way"
            ) from exc
        except OSError as exc:
            raise BlobError(f"cannot create blob directory {str(path)!r}: {exc}") from exc
        self._root = path
        self._real_root = path.resolve()

    @classmethod
    def from_uri(cls, uri: str, *, create: bool = True) -> LocalBlob:
        """Open ``file:///absolute/dir`` (``create``: as for the constructor).

        Raises:
            InvalidUri: on a relative path, a host other than ``localhost`` or any query.
            BlobLocationNotFound: ``create=False`` and the directory does not exist.
        """
        return cls(cls.parse_uri(uri), create=create)

    @staticmethod
    def parse_uri(uri: str) -> str:
        """The directory ``file:///absolute/dir`` names, checked, without touching it.

        Raises:
            InvalidUri: as :meth:`from_uri`.
        """
        parts = split_uri(uri, "file")
        parse_query(parts, frozenset(), uri)
        if parts.netloc not in ("", "localhost"):
            raise InvalidUri(
                f"file URI must be file:///absolute/path, got {uri!r} (host "
                f"{parts.netloc!r}); relative paths are not supported in URIs"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise InvalidUri(f"file URI must name an absolute path: {uri!r}")
        if "\x00" in path:
            raise InvalidUri(f"file URI must not contain NUL: {uri!r}")
        if path.rstrip("/") == "":
            raise InvalidUri(f"file URI must not name the file system root: {uri!r}")
        return path

    @property
    def root(self) -> Path:
        """The root directory (absolute)."""
        return self._root

    # --- paths ---------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        """The checked path of ``key``: never outside the root, even through symlinks."""
        validate_key(key)
        segments = key.split("/")
        if any(_TEMP_RE.match(segment) for segment in segments):
            raise InvalidInput(f"blob key segment of the form '.tmp-<hex>' is reserved: {key!r}")
        path = self._root.joinpath(*segments)
        self._check_inside(path, key)
        return path

    def _check_inside(self, path: Path, key: str) -> None:
        try:
            real = path.resolve()
        except (OSError, RuntimeError) as exc:  # symlink loops
            raise InvalidInput(f"blob key {key!r} cannot be resolved: {exc}") from None
        if real != self._real_root and not real.is_relative_to(self._real_root):
            raise InvalidInput(f"blob key {key!r} resolves outside the blob directory")

    def _missing_root(self) -> bool:
        return not self._root.is_dir()

    def _fail(self, op: str, key: str, exc: OSError) -> BlobError:
        where = f"{op} {key!r} in {self.describe()}"
        if isinstance(exc, PermissionError):
            return BlobAuthError(f"{where}: permission denied")
        if self._missing_root():
            return BlobLocationNotFound(f"{where}: the blob directory no longer exists")
        if exc.errno in (errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EAGAIN, errno.EINTR):
            return BlobUnavailable(f"{where}: {exc.strerror}")
        return BlobError(f"{where}: {exc.strerror or exc}")

    # --- operations ----------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or None if there is none."""
        return self._read(key, 0, -1)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """``length`` bytes at ``start`` of the value at ``key`` (one seek and read)."""
        validate_range(start, length)
        return self._read(key, start, length)

    def _read(self, key: str, start: int, length: int) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if start:
                    f.seek(start)
                return f.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            if self._missing_root():
                raise self._fail("get", key, exc) from exc
            return None
        except OSError as exc:
            raise self._fail("get", key, exc) from exc

    def local_file(self, key: str) -> str | None:
        """The file holding ``key``'s value (it may be missing: opening it then fails)."""
        return str(self._path(key))

    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` at ``key`` atomically and durably (see the module docstring)."""
        path = self._path(key)
        data = validate_value(value)
        if self._missing_root():
            raise BlobLocationNotFound(f"set {key!r}: {self.describe()} no longer exists")
        for attempt in range(_SET_ATTEMPTS):
            try:
                self._make_parents(path, key)
                self._write_atomically(path, data)
                return
            except FileNotFoundError as exc:
                # A concurrent delete pruned a directory we had just made: make it again.
                if attempt + 1 == _SET_ATTEMPTS or self._missing_root():
                    raise self._fail("set", key, exc) from exc
            except (IsADirectoryError, NotADirectoryError) as exc:
                raise BlobError(
                    f"set {key!r} in {self.describe()}: the key conflicts with an existing "
                    "key or key prefix (a file system cannot hold both 'a' and 'a/b')"
                ) from exc
            except OSError as exc:
                raise self._fail("set", key, exc) from exc

    def _make_parents(self, path: Path, key: str) -> None:
        """Create the missing directories between the root and ``path``, durably."""
        missing: list[Path] = []
        parent = path.parent
        while parent != self._root and not parent.is_dir():
            missing.append(parent)
            parent = parent.parent
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                directory.mkdir()
            _fsync_dir(directory.parent)
        if missing:
            # Re-check now that the directories exist (a symlink raced into place?).
            self._check_inside(path.parent, key)

    def _write_atomically(self, path: Path, data: bytes) -> None:
        tmp = path.parent / f"{_TEMP_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)

    def delete(self, key: str) -> int | None:
        """Delete ``key``; returns its size, or None if it did not exist."""
        path = self._path(key)
        try:
            size = path.lstat().st_size
            if path.is_dir():
                return None
            path.unlink()
        except (FileNotFoundError, NotADirectoryError) as exc:
            if self._missing_root():
                raise self._fail("delete", key, exc) from exc
            return None
        except OSError as exc:
            raise self._fail("delete", key, exc) from exc
        with contextlib.suppress(OSError):
            _fsync_dir(path.parent)
        self._prune(path.parent)
        return size

    def _prune(self, directory: Path) -> None:
        """Remove now-empty directories from ``directory`` up to (not including) root."""
        while directory != self._root and directory.is_relative_to(self._root):
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """Every object whose key starts with ``prefix``, in key order.

        Leftover temp files and anything but regular files (symlinks, sockets) are
        skipped. The listing is collected before it is returned.
        """
        validate_prefix(prefix)
        complete = prefix.split("/")[:-1]
        start = self._root.joinpath(*complete)
        found: list[BlobMeta] = []
        if self._missing_root():
            raise BlobLocationNotFound(f"list {self.describe()}: the directory no longer exists")
        try:
            self._check_inside(start, prefix)
        except InvalidInput:
            return iter(found)
        base = "/".join(complete) + "/" if complete else ""
        try:
            self._walk(start, base, prefix, found)
        except OSError as exc:
            raise self._fail("list", prefix, exc) from exc
        found.sort(key=lambda meta: meta.key)
        return iter(found)

    def _walk(self, directory: Path, base: str, prefix: str, out: list[BlobMeta]) -> None:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            key = base + entry.name
            if _TEMP_RE.match(entry.name):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    if key.startswith(prefix) or prefix.startswith(key + "/"):
                        self._walk(Path(entry.path), key + "/", prefix, out)
                elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                    stat = entry.stat(follow_symlinks=False)
                    out.append(BlobMeta(key, stat.st_size, stat.st_mtime))
            except FileNotFoundError:  # deleted while we were listing
                continue

    def sweep_partial_writes(self, prefix: str, stamped_before: float) -> int:
        """Delete the temporary files of writers that died before their rename (the
        listing skips them, so GC would never see them) under ``prefix``, modified
        before ``stamped_before``. A writer still writing one, paused that long, finds
        it gone at its rename and writes the value again (:meth:`set` retries), so a
        value is never lost; it only costs that writer one more write."""
        validate_prefix(prefix)
        complete = prefix.split("/")[:-1]
        start = self._root.joinpath(*complete)
        if self._missing_root():
            raise BlobLocationNotFound(f"sweep {self.describe()}: the directory no longer "
                                       f"exists")
        try:
            self._check_inside(start, prefix)
        except InvalidInput:
            return 0
        base = "/".join(complete) + "/" if complete else ""
        deleted = 0
        try:
            for directory, name in self._temporaries(start, base, prefix):
                path = directory / name
                try:
                    if path.lstat().st_mtime >= stamped_before:
                        continue
                    path.unlink()
                except FileNotFoundError:  # renamed or deleted meanwhile
                    continue
                deleted += 1
                self._prune(directory)
        except OSError as exc:
            raise self._fail("sweep", prefix, exc) from exc
        return deleted

    def _temporaries(self, directory: Path, base: str, prefix: str
                     ) -> list[tuple[Path, str]]:
        """The temporary files in the folders of keys under ``prefix``."""
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        found: list[tuple[Path, str]] = []
        for entry in entries:
            key = base + entry.name
            try:
                if _TEMP_RE.match(entry.name):
                    # A temporary file belongs to the key being written in its folder:
                    # under the prefix when the folder is.
                    if base.startswith(prefix) and entry.is_file(follow_symlinks=False):
                        found.append((directory, entry.name))
                elif entry.is_dir(follow_symlinks=False) and (
                        key.startswith(prefix) or prefix.startswith(key + "/")):
                    found += self._temporaries(Path(entry.path), key + "/", prefix)
            except FileNotFoundError:
                continue
        return found

    def describe(self) -> str:
        """``file://<root>``."""
        return f"file://{self._root}"

    def location(self) -> tuple[str, str]:
        return "file", str(Path(self._root).resolve())

    def __repr__(self) -> str:
        return f"LocalBlob({str(self._root)!r})"
