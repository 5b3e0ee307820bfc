"""Read plans: a snapshot's live Parquet files plus its inline rows, for other engines.

:meth:`ReadHandle.snapshot_plan <persist_pipeline.read.ReadHandle.snapshot_plan>` returns
a :class:`SnapshotPlan`: the URIs of the Parquet parts a snapshot at ``as_of`` reads, the
updates still inlined in consensus as a pyarrow table, a ``pyarrow.fs.FileSystem`` that
reaches the files (endpoint and credentials of the blob location) and a
``pyarrow.dataset.Dataset`` over every row. DuckDB, polars, pandas and Spark read that
dataset (or the files) directly, without copying through persist:

.. code-block:: python

    with reader.snapshot_plan(as_of) as plan:
        ds = plan.to_dataset()
        duckdb.sql(f"SELECT k, v, sum(d) AS d FROM ds WHERE t <= {plan.as_of} "
                   "GROUP BY k, v HAVING sum(d) <> 0")

**What the rows mean.** The plan holds every update of the batches the snapshot reads,
times kept. Keeping the rows with ``t <= as_of``, grouping them by ``(k, v)``, summing
``d`` and dropping zero sums gives exactly ``snapshot(as_of)`` (:meth:`SnapshotPlan.to_table`
does it with pyarrow). Rows with ``t > as_of`` may be present: they belong to later times.

**How long the files stay.** A plan keeps the state version it was made from held by its
reader (the reader's seqno hold): GC never deletes a file of that version while the plan
is open *and* its reader's lease is alive *and* the reader is not closed (``expire()``
releases every hold of the reader, an open plan's too: close plans before their
reader). Close the plan (``close()`` or a ``with`` block) when the engine has finished
reading; the hold is then released with the reader's next heartbeat, and the plan's
``to_table`` and ``to_dataset`` raise ``LeaseExpired``, as they do once the reader is
known to be expired (``expire()``, or a heartbeat that found its lease gone). If
the reader stops heartbeating (its process died, paused, or was closed) for longer than
its lease, GC expires it and may delete the plan's files: a read still in progress then
fails on a missing file, it never returns wrong data.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlsplit

import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.blob.base import Blob
from persist_pipeline.blob.local import LocalBlob
from persist_pipeline.exceptions import (
    BlobUnavailable,
    CorruptPart,
    InvalidConfig,
    LeaseExpired,
    NotYetAvailable,
    PartMissing,
    PersistError,
)
from persist_pipeline.frontier import MAX_TIME, Frontier
from persist_pipeline.internal.blobs import (
    WHOLE_FETCH_MAX_BYTES,
    ShardBlobs,
    read_checked,
    read_footer,
)
from persist_pipeline.internal.state import HollowPart, Store
from persist_pipeline.updates import SCHEMA, consolidate, naming_shard

if TYPE_CHECKING:
    import pyarrow.dataset as pads
    import pyarrow.fs as pafs

    from persist_pipeline.schema import ShardSchema

__all__ = [
    "LATEST",
    "PlanFile",
    "SnapshotPlan",
    "base_blob",
    "blob_filesystem",
    "file_uri",
    "latest_complete_time",
    "text_or_hex",
]


@dataclass(frozen=True, slots=True)
class PlanFile:
    """One live Parquet part of a plan.

    Attributes:
        uri: ``file:///abs/path`` or ``s3://bucket/key`` (no credentials).
        store: ``"main"`` or ``"wal"``: the blob store that holds it.
        key: its blob key, relative to that store's root or prefix.
        path: the path :meth:`SnapshotPlan.filesystem` of ``store`` opens it by.
        size: encoded bytes.
        num_updates: rows in the file.
        min_time / max_time: the range of its ``t`` column.
        batch_id: the batch it belongs to.
        index: its position among that batch's parts (a batch's parts are consecutive,
            ascending ranges of one sorted run of keys).
        min_key / max_key: bounds of its keys (inclusive), None if not recorded.
        crc32: the CRC-32 of its bytes as written (None if not recorded); readers of
            the whole file through this library check it.
        footer_crc32: the CRC-32 of its Parquet footer as written (None if not
            recorded); readers of its footer through this library (the Spark source's
            split points and partitions, :meth:`SnapshotPlan.to_table`) check it.
    """

    uri: str
    store: Store
    key: str
    path: str
    size: int
    num_updates: int
    min_time: int
    max_time: int
    batch_id: str = ""
    index: int = 0
    min_key: bytes | None = None
    max_key: bytes | None = None
    crc32: int | None = None
    footer_crc32: int | None = None

    def hollow_part(self) -> HollowPart:
        """The state's description of this part (what the streaming reader takes)."""
        return HollowPart(self.key, self.store, self.size, self.num_updates, self.min_time,
                          self.max_time, self.min_key, self.max_key, self.crc32,
                          self.footer_crc32)


#: The ``as_of`` of every read that means the latest complete time (``upper - 1``).
LATEST = "latest"


def latest_complete_time(shard_id: str, upper: Frontier) -> int:
    """The latest time whose collection is complete: ``upper - 1`` (the largest time for
    a closed shard).

    Raises:
        NotYetAvailable: the upper is 0, so no time is complete yet.
    """
    if upper == 0:
        raise NotYetAvailable(f"shard {shard_id} has no complete time yet (its upper is 0)")
    return MAX_TIME if upper is None else upper - 1


def base_blob(blob: Blob) -> Blob:
    """The backend under the retry, cache and fault wrappers of ``blob``."""
    seen = 0
    while hasattr(blob, "inner") and seen < 16:
        blob = blob.inner
        seen += 1
    return blob


def file_uri(blob: Blob, key: str) -> tuple[str, str]:
    """``(uri, filesystem path)`` of ``key`` in ``blob`` (a local folder or S3).

    Raises:
        InvalidConfig: the store is in memory, which no other engine or process can reach.
    """
    base = base_blob(blob)
    if isinstance(base, LocalBlob):
        path = str(base.root.joinpath(*key.split("/")))
        return "file://" + quote(path), path
    from persist_pipeline.blob.s3 import S3Blob

    if isinstance(base, S3Blob):
        full = f"{base.prefix}/{key}" if base.prefix else key
        return f"s3://{base.bucket}/{quote(full)}", f"{base.bucket}/{full}"
    raise InvalidConfig(f"blob store {base.describe()} is in this process's memory: other "
                        "engines cannot read its files; use file:///dir or s3://bucket/prefix")


def blob_filesystem(blob: Blob) -> pafs.FileSystem:
    """A ``pyarrow.fs.FileSystem`` reaching the files of ``blob``.

    For S3 it carries the location's endpoint, region, addressing style and credentials:
    the URI's, else those boto3's default chain finds now (environment, shared files,
    instance role; temporary ones are not refreshed). Keep it private: it holds the
    secret key.

    Raises:
        InvalidConfig: the store is in memory.
    """
    import pyarrow.fs as pafs

    base = base_blob(blob)
    if isinstance(base, LocalBlob):
        return pafs.LocalFileSystem()
    from persist_pipeline.blob.s3 import S3Blob

    if not isinstance(base, S3Blob):
        file_uri(base, "x")  # raises the in-memory error
        raise AssertionError("unreachable")
    params = dict(parse_qsl(urlsplit(base.uri_with_credentials()).query,
                            keep_blank_values=True))
    kwargs: dict[str, Any] = {"region": base.signing_region,
                              "connect_timeout": float(params.get("connect_timeout", 5)),
                              "request_timeout": float(params.get("read_timeout", 30))}
    endpoint = params.get("endpoint_url")
    if endpoint:
        parts = urlsplit(endpoint)
        kwargs["endpoint_override"] = parts.netloc
        kwargs["scheme"] = parts.scheme or "https"
    if params.get("addressing_style") == "virtual":
        kwargs["force_virtual_addressing"] = True
    if params.get("access_key_id"):
        kwargs["access_key"] = params["access_key_id"]
        kwargs["secret_key"] = params.get("secret_access_key", "")
        if params.get("session_token"):
            kwargs["session_token"] = params["session_token"]
    else:
        # The same default chain as the blob store's boto3 client (environment, shared
        # files, instance role), resolved now: pyarrow's own chain differs in details.
        import boto3

        found = boto3.session.Session().get_credentials()
        if found is not None:
            creds = found.get_frozen_credentials()
            kwargs["access_key"] = creds.access_key
            kwargs["secret_key"] = creds.secret_key
            if creds.token:
                kwargs["session_token"] = creds.token
    return pafs.S3FileSystem(**kwargs)


class SnapshotPlan:
    """The live files and inline rows of a snapshot at ``as_of``, held while open.

    Made by :meth:`ReadHandle.snapshot_plan`; see the module docstring for what its rows
    mean and how long its files stay. Thread-safe to read; ``close()`` is idempotent.

    Attributes:
        shard_id: the shard.
        as_of: the snapshot's time.
        since: the shard's since when the plan was made (``as_of >= since``).
        upper: the shard's upper when the plan was made (``as_of < upper``).
        seqno: the state version the plan was made from (held while the plan is open).
        files: URIs of the live Parquet parts (``file:///...`` or ``s3://bucket/key``).
        file_details: the same files with their store, key, size, rows and time range.
        inline: the inline rows as a k/v/t/d ``pyarrow.Table`` (times kept); a typed
            shard's also have its key and value columns, as its Parquet files do.
        schema: a typed shard's :class:`~persist_pipeline.schema.ShardSchema`, else None.
    """

    def __init__(self, *, shard_id: str, as_of: int, since: Frontier, upper: Frontier,
                 seqno: int, files: tuple[PlanFile, ...], inline: pa.Table,
                 stores: Mapping[str, Blob], release: Callable[[], None],
                 schema: ShardSchema | None = None,
                 expired: Callable[[], bool] = lambda: False) -> None:
        self.shard_id = shard_id
        self.schema = schema
        if schema is not None:
            inline = pa.Table.from_arrays(
                [*inline.columns,
                 *schema.decode(inline, f"shard {shard_id} inline").columns[
                     :len(schema.columns)]],
                schema=_file_schema(schema))
        self.as_of = as_of
        self.since = since
        self.upper = upper
        self.seqno = seqno
        self.file_details = files
        self.files = [f.uri for f in files]
        self.inline = inline
        self._stores = dict(stores)
        self._release: Callable[[], None] | None = release
        self._expired = expired

    @property
    def closed(self) -> bool:
        return self._release is None

    def close(self) -> None:
        """Release the plan's hold on its state version (GC may then delete its files
        once they are no longer live). Idempotent."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def _check_open(self) -> None:
        # A closed plan's hold is released: GC may delete its files at any moment, so a
        # read that happened to succeed now could fail half-way later.
        if self._release is None:
            raise LeaseExpired(f"shard {self.shard_id}: the plan was closed; make a new one "
                               f"(its files are no longer held against GC)")
        # Expiring the reader released the plan's hold as closing it does (expire(), or
        # a heartbeat that found the lease gone): the same refusal, not a read racing GC.
        if self._expired():
            raise LeaseExpired(f"shard {self.shard_id}: the reader holding this plan was "
                               f"expired; make a new plan with a live reader (its files "
                               f"are no longer held against GC)")

    def __enter__(self) -> SnapshotPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stores(self) -> list[Store]:
        """The blob stores the plan's files live in (``main``, and ``wal`` if used)."""
        return sorted({f.store for f in self.file_details})

    def filesystem(self, store: Store = "main") -> pafs.FileSystem:
        """A ``pyarrow.fs.FileSystem`` for the files of ``store`` (open them by
        :attr:`PlanFile.path`). Carries the location's credentials: do not log it.

        Raises:
            InvalidConfig: the store is in memory, or the location has no WAL store.
        """
        blob = self._stores.get(store)
        if blob is None:
            raise InvalidConfig(f"this location has no {store} blob store")
        return blob_filesystem(blob)

    def to_dataset(self) -> pads.Dataset:
        """A ``pyarrow.dataset.Dataset`` over every row: the files and the inline rows.

        Nothing is read until the dataset is scanned; DuckDB (``duckdb.sql("... FROM
        ds")``), polars (``pl.scan_pyarrow_dataset(ds)``) and pyarrow scan it lazily,
        with projection and ``t`` filters pushed down to the Parquet files.

        Raises:
            LeaseExpired: the plan was closed (its files are no longer held).
            PartMissing: a file of the plan is gone (its reader's lease ran out); local
                files are looked up here, S3 ones when the dataset is scanned.
        """
        self._check_open()
        import pyarrow.dataset as pads

        pieces: list[pads.Dataset] = []
        for store in self.stores():
            paths = [f.path for f in self.file_details if f.store == store]
            try:
                # A typed shard's older files may lack value columns added since: null.
                pieces.append(pads.dataset(paths, schema=self.dataset_schema,
                                           format=_parquet_format(),
                                           filesystem=self.filesystem(store)))
            except (OSError, pa.ArrowException) as e:
                raise self._read_error(e) from e
        if self.inline.num_rows or not pieces:
            pieces.append(pads.dataset(self.inline.cast(self.dataset_schema)))
        return pieces[0] if len(pieces) == 1 else pads.dataset(pieces)

    def to_table(self) -> pa.Table:
        """The consolidated collection at ``as_of``, read through :meth:`to_dataset`
        (equal to ``snapshot(as_of)``; typed for a typed shard).

        The files are checked as :meth:`ReadHandle.snapshot
        <persist_pipeline.read.ReadHandle.snapshot>` checks them, before the scan (which
        prunes row groups by their ``t`` statistics and reads at the offsets the footer
        states): each up to the size a snapshot fetches whole against the CRC-32 recorded
        when it was written, the footer of each larger one against its own, and every
        page of every file against its own.

        Raises:
            LeaseExpired: the plan was closed (its files are no longer held).
            PartMissing: a file of the plan is gone (its reader's lease ran out).
            PartChecksumMismatch / CorruptPart: a file's bytes changed since it was
                written.
        """
        self._check_open()
        import pyarrow.dataset as pads

        self._check_files()
        try:
            table = self.to_dataset().to_table(
                columns=SCHEMA.names, filter=pads.field("t") <= pa.scalar(self.as_of))
        except (OSError, pa.ArrowException) as e:
            raise self._read_error(e, scanned=True) from e
        with naming_shard(self.shard_id):
            table = consolidate(table, as_of=self.as_of)
        if self.schema is not None:
            return self.schema.decode(table, f"shard {self.shard_id}")
        return table

    def _check_files(self) -> None:
        """Check every file that records its CRC-32s, 8 at a time (as Spark's split
        points read footers): one a snapshot would fetch whole against its CRC-32 (a
        dataset scan checks only the pages, which another valid part under the key
        passes), a larger one's footer against its own (the scan trusts its statistics
        and offsets). A mismatch is read again once before the bytes are judged changed."""
        from concurrent.futures import ThreadPoolExecutor

        where = f"shard {self.shard_id}, snapshot plan"

        def whole(f: PlanFile) -> bool:
            return f.crc32 is not None and f.size <= WHOLE_FETCH_MAX_BYTES

        checked = [f for f in self.file_details if whole(f) or f.footer_crc32 is not None]
        if not checked:
            return

        def check(f: PlanFile) -> None:
            blob = self._stores.get(f.store)
            if blob is None:
                raise InvalidConfig(f"this location has no {f.store} blob store")
            if not whole(f):
                read_footer(blob, blob, f.hollow_part(), where)
                return
            # A PartMissing is named as a gone file of the plan below.
            read_checked(blob, blob, f.hollow_part(), where, ShardBlobs.get_part)

        try:
            with ThreadPoolExecutor(max_workers=min(8, len(checked)),
                                    thread_name_prefix="persist-plan-checks") as pool:
                list(pool.map(check, checked))
        except PartMissing as e:
            raise self._read_error(e) from e

    def _read_error(self, error: Exception, scanned: bool = False) -> Exception:
        """What :meth:`to_table` raises for ``error``: :class:`PartMissing` naming a file
        of the plan that is gone (GC deleted it: the plan was closed, or its reader's
        lease ran out), :class:`CorruptPart` for a page whose CRC-32 failed (retrying
        reads the same bytes) or, when a scan (``scanned``) failed, for a file this
        library's own reader cannot decode either, else :class:`BlobUnavailable`."""
        import pyarrow.fs as pafs

        for f in self.file_details:
            try:
                info = self.filesystem(f.store).get_file_info(f.path)
            except (OSError, pa.ArrowException):
                continue  # the store is away too: not evidence that the file is gone
            if info.type == pafs.FileType.NotFound:
                return PartMissing(
                    f"shard {self.shard_id}: file {f.uri} of this snapshot plan is gone: GC "
                    f"deletes a plan's files once the plan is closed or its reader's lease "
                    f"ran out; make a new plan (or give the reader a longer lease)")
        if _PAGE_CHECKSUM_FAILED in str(error):
            return CorruptPart(f"shard {self.shard_id}: a file of this snapshot plan holds "
                               f"bytes that changed since it was written: {error}")
        if scanned:
            # Arrow's scan says alike (an OSError) that a store is away and that a page
            # header it read does not decode (headers are not covered by the pages'
            # CRC-32s). Called unavailable, the damage would be retried for ever: read
            # the files as snapshot() does, which tells the two apart, naming the part.
            corrupt = self._undecodable()
            if corrupt is not None:
                return corrupt
        return BlobUnavailable(f"shard {self.shard_id}: reading this snapshot plan's files "
                               f"failed: {error}")

    def _undecodable(self) -> CorruptPart | None:
        """The error of the first file of the plan that this library's own streaming
        reader cannot decode (as a snapshot reads it: checked, then row group by row
        group), None when each decodes or one cannot be read now (a store away: then
        so is the scan's failure, most likely). The stores are asked once, without the
        retries of a read, so that an outage is reported as soon as the scan found it."""
        main = base_blob(self._stores["main"])
        wal = self._stores.get("wal")
        wal = None if wal is None else base_blob(wal)
        blobs = ShardBlobs(main, wal, main, wal)
        where = f"shard {self.shard_id}, snapshot plan"
        for f in self.file_details:
            try:
                for _ in blobs.stream_part(f.hollow_part(), where, _DECODE_BATCH_BYTES):
                    pass
            except CorruptPart as e:
                return e
            except PersistError:
                return None
        return None

    @property
    def dataset_schema(self) -> pa.Schema:
        """The columns of :meth:`to_dataset`: k, v, t, d, then a typed shard's key and
        value columns."""
        return SCHEMA if self.schema is None else _file_schema(self.schema)

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description: times, files (no credentials) and inline rows.

        A typed shard's inline rows are shown with its columns (values as JSON can hold
        them: dates and times as ISO text, decimals as text, NaN and infinities as
        ``"NaN"``, ``"Infinity"``, ``"-Infinity"``). Binary values, an untyped shard's
        keys and values included, are shown as UTF-8 text when every one of their column
        is valid UTF-8, else all as hex (never a mix: two values never show alike);
        ``"inline_encoding"`` says which, per column that holds any.
        """
        out: dict[str, Any] = {
            "shard_id": self.shard_id,
            "as_of": self.as_of,
            "since": self.since,
            "upper": self.upper,
            "seqno": self.seqno,
            "files": [{"uri": f.uri, "store": f.store, "bytes": f.size,
                       "updates": f.num_updates, "min_time": f.min_time,
                       "max_time": f.max_time, "crc32": f.crc32,
                       "footer_crc32": f.footer_crc32} for f in self.file_details],
        }
        if self.schema is not None:
            rows = self.schema.decode(self.inline, f"shard {self.shard_id}").to_pylist()
            encodings = {}
            for name in self.schema.columns:
                found = [b for row in rows for b in _bytes_in(row[name])]
                if found:
                    encodings[name] = "utf-8" if all(map(_is_utf8, found)) else "hex"
            out["schema"] = repr(self.schema)
            out["inline"] = [{k: _jsonable(v, encodings.get(k) == "hex")
                              for k, v in row.items()} for row in rows]
            if encodings:
                out["inline_encoding"] = encodings
            return out
        k_enc, ks = text_or_hex(self.inline.column("k"))
        v_enc, vs = text_or_hex(self.inline.column("v"))
        out["inline_encoding"] = {"k": k_enc, "v": v_enc}
        out["inline"] = [{"k": k, "v": v, "t": t, "d": d} for k, v, t, d in zip(
            ks, vs, self.inline.column("t").to_pylist(),
            self.inline.column("d").to_pylist(), strict=True)]
        return out

    def to_json(self) -> str:
        return json.dumps(self.describe(), indent=2, sort_keys=True)

    def __repr__(self) -> str:
        return (f"SnapshotPlan(shard={self.shard_id}, as_of={self.as_of}, "
                f"files={len(self.files)}, inline_rows={self.inline.num_rows}, "
                f"{'closed' if self.closed else 'open'})")


#: Bytes of updates a failed scan's files are decoded in, to tell damage from an outage.
_DECODE_BATCH_BYTES = 1 << 20

#: What Arrow's Parquet reader says of a page whose CRC-32 does not match.
_PAGE_CHECKSUM_FAILED = "CRC checksum verification failed"


def _parquet_format() -> pads.ParquetFileFormat:
    """Parquet as a plan's dataset scans it: checking every page's CRC-32 (our parts
    carry them), so that DuckDB, polars or pyarrow scanning the dataset get an error
    for a rotted page, never its garbage."""
    import pyarrow.dataset as pads

    return pads.ParquetFileFormat(default_fragment_scan_options=pads.ParquetFragmentScanOptions(
        page_checksum_verification=True))


def _file_schema(schema: ShardSchema) -> pa.Schema:
    return pa.schema([*SCHEMA, *schema.key, *schema.value])


def _jsonable(value: Any, hex_bytes: bool) -> Any:
    """A decoded typed value as JSON can hold it; its bytes as hex if ``hex_bytes``,
    else as text (its column's are all UTF-8)."""
    if isinstance(value, dict):
        return {k: _jsonable(v, hex_bytes) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v, hex_bytes) for v in value]
    if isinstance(value, bytes):
        return value.hex() if hex_bytes else value.decode("utf-8")
    if isinstance(value, float) and not math.isfinite(value):
        # Strict JSON has no NaN or infinities (json.dumps would write bare NaN).
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _bytes_in(value: Any) -> Iterator[bytes]:
    """Every bytes value inside a decoded typed value (lists, structs, maps)."""
    if isinstance(value, bytes):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _bytes_in(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _bytes_in(v)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def text_or_hex(column: pa.ChunkedArray | pa.Array) -> tuple[str, list[str | None]]:
    """A binary column as text: ``("utf-8", values)`` when every value is valid UTF-8,
    else ``("hex", values)`` with every value hex-encoded (never a mix of both)."""
    try:
        return "utf-8", pc.cast(column, pa.string()).to_pylist()
    except pa.ArrowInvalid:
        return "hex", [None if b is None else b.hex() for b in column.to_pylist()]
