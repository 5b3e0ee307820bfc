"""A blob store in an S3 (or S3-compatible) bucket, via boto3.

URI form::

    s3://BUCKET[/PREFIX][?PARAM=VALUE&...]

Parameters (all optional):

``endpoint_url``
    e.g. ``http://127.0.0.1:9000`` for MinIO or moto; default: AWS.
``region``
    signing region; default: the AWS configuration's, else ``us-east-1``.
``access_key_id``, ``secret_access_key``, ``session_token``
    static credentials (the first two together). Without them the default AWS
    credential chain is used (environment, shared files, instance roles, ...).
``addressing_style``
    ``path``, ``virtual`` or ``auto``; default ``path`` when ``endpoint_url`` is
    given, else ``auto``.
``connect_timeout``, ``read_timeout``
    seconds, default 5 and 30.
``max_attempts``
    total attempts per request, botocore "standard" retry mode; default 3.
``max_pool_connections``
    HTTP connections kept per store; default 32.

Values are percent-decoded; ``+`` is *not* read as a space, so secret keys containing
``+`` or ``/`` may be pasted as they are (``&``, ``#`` and ``%`` must be escaped).
Keys are stored under ``PREFIX/``; listings return keys relative to it.

Secrets: the secret key and session token never appear in :meth:`S3Blob.describe`,
``repr``, error messages or this package's logs; they are also scrubbed from botocore's
own log records once an :class:`S3Blob` has held them in this process. They are kept (privately)
because a blob must be reconstructible elsewhere, e.g. in a Spark executor: pickling an
``S3Blob`` carries its full URI, secrets included, so treat a pickled S3Blob as a secret.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, cast
from urllib.parse import quote, unquote, urlencode, urlsplit

import boto3
import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ChecksumError,
    ClientError,
    ConnectionError,
    CredentialRetrievalError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)

from persist_pipeline.blob._uri import parse_query, redact_uri, split_uri
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
    InvalidUri,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

_PARAMS = frozenset(
    {
        "endpoint_url",
        "region",
        "access_key_id",
        "secret_access_key",
        "session_token",
        "addressing_style",
        "connect_timeout",
        "read_timeout",
        "max_attempts",
        "max_pool_connections",
    }
)
_AddressingStyle = Literal["path", "virtual", "auto"]
_ADDRESSING_STYLES = ("path", "virtual", "auto")
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")

_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "InvalidSecurity",
        "TokenRefreshRequired",
        "AccountProblem",
        "UnauthorizedAccess",
        "401",
        "403",
    }
)
_UNAVAILABLE_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "OperationAborted",
        "503",
        "500",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})

# botocore loggers that may quote request headers (X-Amz-Security-Token) or params.
_BOTOCORE_LOGGERS = (
    "botocore",
    "botocore.auth",
    "botocore.awsrequest",
    "botocore.client",
    "botocore.credentials",
    "botocore.endpoint",
    "botocore.hooks",
    "botocore.httpsession",
    "botocore.parsers",
    "botocore.regions",
    "botocore.retries.standard",
    "botocore.retryhandler",
    "botocore.utils",
    "urllib3.connectionpool",
)


class _SecretScrubber(logging.Filter):
    """Rewrites log records so that no registered secret appears in them."""

    def __init__(self) -> None:
        super().__init__()
        self._secrets: set[str] = set()
        self._lock = threading.Lock()
        self._installed = False

    def add(self, secret: str) -> None:
        if len(secret) < 4:  # too short to scrub without mangling every record
            return
        with self._lock:
            self._secrets.add(secret)
            if not self._installed:
                for name in _BOTOCORE_LOGGERS:
                    logging.getLogger(name).addFilter(self)
                self._installed = True

    def scrub(self, text: str) -> str:
        for secret in self._secrets.copy():
            text = text.replace(secret, "***")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own handling
            return True
        scrubbed = self.scrub(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        return True


_SCRUBBER = _SecretScrubber()


class _Secret:
    """A string that shows as ``***`` in repr/str, so it cannot leak by accident."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__


def _positive_float(name: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise InvalidUri(f"s3 URI parameter {name} must be a number, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise InvalidUri(f"s3 URI parameter {name} must be positive and finite, got {value!r}")
    return number


def _positive_int(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise InvalidUri(f"s3 URI parameter {name} must be an integer, got {value!r}") from None
    if number < 1:
        raise InvalidUri(f"s3 URI parameter {name} must be at least 1, got {value!r}")
    return number


#: The signing region when neither the URI nor the AWS configuration names one.
DEFAULT_REGION = "us-east-1"

#: botocore data loaders by search path, shared by every client this process creates.
_LOADERS: dict[tuple[str, ...], Any] = {}
_LOADERS_LOCK = threading.Lock()


def _share_loader(core: botocore.session.Session) -> None:
    """Give ``core`` the process's data loader for its search path.

    A botocore loader parses the service's JSON model files (S3's, the endpoint
    rules, the partitions) once and keeps them, but each new session has a loader of its
    own: every client paid the parsing again, about 80 of the 90 ms a client took.
    Loaders with the same search path load the same files, and what they hand out is
    read-only (the clients of one session share it), so sessions with the same path
    share the first loader set up for it (boto3 appends its data folder to a session's
    loader when the session is made, so that loader is compared, then replaced).
    """
    loader = core.get_component("data_loader")
    key = tuple(loader.search_paths)
    with _LOADERS_LOCK:
        shared = _LOADERS.setdefault(key, loader)
    if shared is not loader:
        core.register_component("data_loader", shared)


class S3Blob(Blob):
    """A blob store in an S3 bucket under an optional key prefix.

    Thread-safe: one boto3 client, created on first use, is shared by all threads.

    Args:
        bucket: the bucket name.
        prefix: the key prefix (without leading or trailing ``/``); keys are stored as
            ``prefix/key``.
        endpoint_url: an S3-compatible endpoint such as ``http://127.0.0.1:9000``.
        region: the signing region.
        access_key_id: static credentials, with ``secret_access_key``; None for the
            default credential chain.
        secret_access_key: see ``access_key_id``.
        session_token: an optional session token for temporary credentials.
        addressing_style: ``path``, ``virtual`` or ``auto`` (None: ``path`` with an
            endpoint, else ``auto``).
        connect_timeout: seconds to wait for a connection.
        read_timeout: seconds to wait for data on a connection.
        max_attempts: total attempts per request (botocore standard retries).
        max_pool_connections: HTTP connections kept open.

    Raises:
        InvalidUri: if an argument is malformed.
    """

    kind = "s3"
    stamp_resolution_s = 1.0

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        addressing_style: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_attempts: int = 3,
        max_pool_connections: int = 32,
    ) -> None:
        if not isinstance(bucket, str) or not _BUCKET_RE.match(bucket):
            raise InvalidUri(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            try:
                validate_key(prefix)
            except ValueError as exc:
                raise InvalidUri(f"invalid S3 key prefix {prefix!r}: {exc}") from None
        if endpoint_url is not None:
            _check_endpoint(endpoint_url)
        if addressing_style is None:
            addressing_style = "path" if endpoint_url else "auto"
        if addressing_style not in _ADDRESSING_STYLES:
            raise InvalidUri(
                f"S3 addressing_style must be one of {', '.join(_ADDRESSING_STYLES)}, "
                f"got {addressing_style!r}"
            )
        if (access_key_id is None) != (secret_access_key is None):
            raise InvalidUri("S3 access_key_id and secret_access_key must be given together")
        if session_token is not None and access_key_id is None:
            raise InvalidUri("S3 session_token needs access_key_id and secret_access_key")
        if access_key_id is not None and not access_key_id:
            raise InvalidUri("S3 access_key_id must not be empty")
        _positive_float("connect_timeout", str(connect_timeout))
        _positive_float("read_timeout", str(read_timeout))
        _positive_int("max_attempts", str(max_attempts))
        _positive_int("max_pool_connections", str(max_pool_connections))

        self._bucket = bucket
        self._prefix = prefix
        self._base = f"{prefix}/" if prefix else ""
        self._endpoint_url = endpoint_url
        self._region = region
        self._access_key_id = access_key_id
        self._secret_access_key = _Secret(secret_access_key or "")
        self._session_token = _Secret(session_token or "")
        self._addressing_style = addressing_style
        self._connect_timeout = float(connect_timeout)
        self._read_timeout = float(read_timeout)
        self._max_attempts = int(max_attempts)
        self._max_pool_connections = int(max_pool_connections)
        for secret in (secret_access_key, session_token):
            if secret:
                _SCRUBBER.add(secret)
        self._uri = _Secret(self._canonical_uri())
        self._lock = threading.Lock()
        self._client_obj: S3Client | None = None

    @classmethod
    def from_uri(cls, uri: str) -> S3Blob:
        """Open an ``s3://`` URI (see the module docstring for its parameters).

        Raises:
            InvalidUri: if the URI is malformed; the message never quotes secrets.
        """
        parts = split_uri(uri, "s3")
        params = parse_query(parts, _PARAMS, uri)
        if not parts.netloc:
            raise InvalidUri(f"s3 URI must name a bucket (s3://BUCKET/...): {redact_uri(uri)!r}")
        if ":" in parts.netloc:
            raise InvalidUri(f"s3 URI bucket must not have a port: {redact_uri(uri)!r}")
        empty = sorted(name for name, value in params.items() if value == "")
        if empty:
            raise InvalidUri(f"s3 URI parameter(s) {', '.join(empty)} must not be empty")
        kwargs: dict[str, Any] = {
            name: params[name]
            for name in (
                "endpoint_url",
                "region",
                "access_key_id",
                "secret_access_key",
                "session_token",
                "addressing_style",
            )
            if name in params
        }
        for name in ("connect_timeout", "read_timeout"):
            if name in params:
                kwargs[name] = _positive_float(name, params[name])
        for name in ("max_attempts", "max_pool_connections"):
            if name in params:
                kwargs[name] = _positive_int(name, params[name])
        return cls(unquote(parts.netloc), unquote(parts.path), **kwargs)

    def _canonical_uri(self) -> str:
        """The URI this blob can be rebuilt from, secrets included (keep it private)."""
        params: dict[str, str] = {}
        if self._endpoint_url is not None:
            params["endpoint_url"] = self._endpoint_url
        if self._region is not None:
            params["region"] = self._region
        if self._access_key_id is not None:
            params["access_key_id"] = self._access_key_id
            params["secret_access_key"] = self._secret_access_key.reveal()
        if self._session_token.reveal():
            params["session_token"] = self._session_token.reveal()
        params["addressing_style"] = self._addressing_style
        params["connect_timeout"] = repr(self._connect_timeout)
        params["read_timeout"] = repr(self._read_timeout)
        params["max_attempts"] = str(self._max_attempts)
        params["max_pool_connections"] = str(self._max_pool_connections)
        path = "/" + quote(self._prefix) if self._prefix else ""
        return f"s3://{self._bucket}{path}?{urlencode(params, quote_via=quote, safe='')}"

    def uri_with_credentials(self) -> str:
        """The full URI including any secrets, to rebuild this blob in another process.

        Never log or display it; :meth:`describe` is the printable form.
        """
        return self._uri.reveal()

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # boto3 clients do not pickle: ship the URI and rebuild (e.g. in Spark executors).
        return (S3Blob.from_uri, (self._uri.reveal(),))

    @property
    def bucket(self) -> str:
        """The bucket name."""
        return self._bucket

    @property
    def prefix(self) -> str:
        """The key prefix ("" for the bucket's root)."""
        return self._prefix

    # --- client ----------------------------------------------------------------------------

    def _client(self) -> S3Client:
        client = self._client_obj
        if client is None:
            with self._lock:
                if self._client_obj is None:
                    self._client_obj = self._make_client()
                client = self._client_obj
        return client

    def _session(self) -> boto3.session.Session:
        core = botocore.session.Session()
        session = boto3.session.Session(
            aws_access_key_id=self._access_key_id,
            aws_secret_access_key=self._secret_access_key.reveal() or None,
            aws_session_token=self._session_token.reveal() or None,
            botocore_session=core,
        )
        _share_loader(core)
        return session

    @property
    def signing_region(self) -> str:
        """The region requests are signed for, by one rule for every client of this store
        (boto3 here, pyarrow's filesystem in read plans): the URI's ``region``, else the
        AWS configuration's (environment, shared files), else ``us-east-1``."""
        return str(self._region or self._session().region_name or DEFAULT_REGION)

    def _make_client(self) -> S3Client:
        session = self._session()
        region = self._region or session.region_name or DEFAULT_REGION
        config = Config(
            region_name=region,
            connect_timeout=self._connect_timeout,
            read_timeout=self._read_timeout,
            retries={"mode": "standard", "max_attempts": self._max_attempts},
            max_pool_connections=self._max_pool_connections,
            s3={"addressing_style": cast(_AddressingStyle, self._addressing_style)},
        )
        try:
            return session.client("s3", endpoint_url=self._endpoint_url, config=config)
        except (BotoCoreError, ValueError) as exc:
            raise BlobError(f"cannot create an S3 client for {self.describe()}: {exc}") from None

    def close(self) -> None:
        """Close the HTTP connections; a later call opens a new client. Idempotent."""
        with self._lock:
            client, self._client_obj = self._client_obj, None
        if client is not None:
            client.close()

    # --- errors ----------------------------------------------------------------------------

    def _error(self, exc: Exception, op: str, key: str) -> BlobError:
        """Map a boto3/botocore exception to a BlobError whose text holds no secret."""
        where = f"S3 {op} {key!r} in {self.describe()}"
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            message = _SCRUBBER.scrub(str(error.get("Message", "")))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            detail = f"{where}: {code or status}" + (f" ({message})" if message else "")
            if code == "NoSuchBucket":
                return BlobLocationNotFound(f"{where}: bucket {self._bucket!r} does not exist")
            if code in _AUTH_CODES or status in (401, 403):
                return BlobAuthError(f"{detail}; check the credentials and bucket policy")
            if code in _UNAVAILABLE_CODES or (isinstance(status, int) and status >= 500):
                return BlobUnavailable(detail)
            return BlobError(detail)
        if isinstance(exc, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
            return BlobAuthError(f"{where}: no usable AWS credentials ({type(exc).__name__})")
        # A body whose checksum does not match was damaged on the way (the stored value
        # is checked when S3 accepts it): transient like a dropped connection, so a
        # retry reads it again instead of failing the read or commit for good.
        if isinstance(exc, ConnectionError | HTTPClientError | IncompleteReadError
                      | FlexibleChecksumError | ChecksumError):
            return BlobUnavailable(f"{where}: {type(exc).__name__}: {_SCRUBBER.scrub(str(exc))}")
        return BlobError(f"{where}: {type(exc).__name__}: {_SCRUBBER.scrub(str(exc))}")

    # --- operations ------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or None if there is none."""
        validate_key(key)
        client = self._client()
        try:
            response = client.get_object(Bucket=self._bucket, Key=self._base + key)
            body = response["Body"]
            try:
                return body.read()
            finally:
                body.close()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _NOT_FOUND_CODES:
                return None
            raise self._error(exc, "get", key) from exc
        except BotoCoreError as exc:
            raise self._error(exc, "get", key) from exc

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        """``length`` bytes at ``start`` of the value at ``key`` (one ranged GET)."""
        validate_key(key)
        validate_range(start, length)
        if length == 0:
            return b"" if self.get_range(key, 0, 1) is not None else None
        client = self._client()
        try:
            response = client.get_object(Bucket=self._bucket, Key=self._base + key,
                                         Range=f"bytes={start}-{start + length - 1}")
            body = response["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in _NOT_FOUND_CODES:
                return None
            if code == "InvalidRange":  # start at or past the end of a value
                return b""
            raise self._error(exc, "get", key) from exc
        except BotoCoreError as exc:
            raise self._error(exc, "get", key) from exc

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key`` with one PUT (atomic in S3)."""
        validate_key(key)
        data = validate_value(value)
        client = self._client()
        try:
            client.put_object(Bucket=self._bucket, Key=self._base + key, Body=data)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, "set", key) from exc

    def delete(self, key: str) -> int | None:
        """Delete ``key``: a HEAD for its size (None if missing), then a DELETE."""
        validate_key(key)
        client = self._client()
        full_key = self._base + key
        size: int | None = None
        try:
            try:
                size = client.head_object(Bucket=self._bucket, Key=full_key)["ContentLength"]
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in _NOT_FOUND_CODES:
                    raise
            # DELETE even when HEAD saw nothing: it reports a missing bucket, and is
            # idempotent otherwise.
            client.delete_object(Bucket=self._bucket, Key=full_key)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, "delete", key) from exc
        return size

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """Every object whose key starts with ``prefix``, in key order.

        Pages are fetched lazily while iterating, so errors surface during iteration.
        """
        validate_prefix(prefix)
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[BlobMeta]:
        paginator = self._client().get_paginator("list_objects_v2")
        strip = len(self._base)
        try:
            for page in paginator.paginate(Bucket=self._bucket, Prefix=self._base + prefix):
                for obj in page.get("Contents", []):
                    yield BlobMeta(
                        obj["Key"][strip:], int(obj["Size"]), obj["LastModified"].timestamp(),
                        str(obj.get("ETag", "")).strip('"'),
                    )
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, "list", prefix) from exc

    def location(self) -> tuple[str, str]:
        return f"s3 {self._endpoint_url or ''} {self._bucket}", self._prefix

    def describe(self) -> str:
        """``s3://bucket/prefix``, plus ``(endpoint URL)`` when one is set; no secrets."""
        where = f"s3://{self._bucket}" + (f"/{self._prefix}" if self._prefix else "")
        if self._endpoint_url:
            where += f" (endpoint {self._endpoint_url})"
        return where

    def __repr__(self) -> str:
        return f"S3Blob({self.describe()!r})"


def _check_endpoint(endpoint_url: str) -> None:
    try:
        parts = urlsplit(endpoint_url)
    except ValueError:
        raise InvalidUri(f"malformed S3 endpoint_url {redact_uri(endpoint_url)!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidUri(
            f"S3 endpoint_url must be http(s)://host[:port], got {redact_uri(endpoint_url)!r}"
        )
    if parts.username or parts.password or parts.query or parts.fragment:
        raise InvalidUri("S3 endpoint_url must not carry user info, a query or a fragment")
    try:
        _ = parts.port
    except ValueError:
        raise InvalidUri(
            f"S3 endpoint_url has an invalid port: {redact_uri(endpoint_url)!r}"
        ) from None
