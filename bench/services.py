"""What the benchmarks run against: PostgreSQL, a loopback S3 server, temporary folders.

* PostgreSQL: the logic of ``tests/fixtures/postgres.py`` (reused, not copied): the
  machine's cluster on 127.0.0.1:5432 if it answers, else started with
  ``pg_ctlcluster``, else a throwaway cluster (``initdb``) on a free port. Every case
  gets fresh databases, dropped ``WITH (FORCE)`` afterwards. The server's settings are
  left as they are (``synchronous_commit=on``: commits are durable).
* S3: moto's server on loopback, started like ``ThreadedMotoServer`` (same WSGI app and
  request handler) with the fake credentials of ``tests/fixtures/s3.py``, behind a small
  WSGI middleware that counts requests by kind (PUT, GET, LIST, ...) and can add a
  *simulated* per-request latency. Several endpoints can share one moto backend, e.g.
  a "Standard" and an "Express" endpoint with different simulated latencies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg2
from psycopg2 import sql

from tests.fixtures.postgres import (
    DEFAULT_PORT,
    HOST,
    PgServer,
    ThrowawayCluster,
    _reachable,
    _start_machine_cluster,
    _wait_reachable,
)

REGION = "us-east-1"

#: The fake credentials of ``tests/fixtures/s3.py``, for this process and its children.
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
_AWS_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
              "AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN")


# --- PostgreSQL ------------------------------------------------------------------------------


class Postgres:
    """A reachable PostgreSQL server and throwaway databases on it."""

    def __init__(self) -> None:
        """Finds or starts a server (see the module docstring).

        Raises:
            RuntimeError: no server could be reached or started.
        """
        self._cluster: ThrowawayCluster | None = None
        server = PgServer(HOST, DEFAULT_PORT)
        why = _reachable(server)
        if why is not None:
            notes = [f"{HOST}:{DEFAULT_PORT} not reachable: {why}", *_start_machine_cluster()]
            why = _wait_reachable(server, 15)
            if why is not None:
                notes.append(f"still not reachable after pg_ctlcluster: {why}")
                try:
                    self._cluster = ThrowawayCluster()
                except Exception as exc:
                    notes.append(f"throwaway cluster failed: {exc}")
                    raise RuntimeError("no PostgreSQL server for the benchmarks:\n"
                                       + "\n".join(notes)) from exc
                server = self._cluster.server
                why = _wait_reachable(server, 15)
                if why is not None:
                    raise RuntimeError(f"throwaway PostgreSQL cluster not reachable: {why}")
        self.server = server
        self.where = ("throwaway cluster (initdb, fsync=off)" if self._cluster
                      else f"the machine's cluster on {HOST}:{server.port}")

    def settings(self) -> dict[str, str]:
        """The server version and the settings that decide what a commit costs."""
        conn = self.server.connect()
        try:
            with conn.cursor() as cur:
                out = {}
                cur.execute("SHOW server_version")
                out["server_version"] = str(cur.fetchone()[0])
                for name in ("synchronous_commit", "fsync", "wal_sync_method",
                             "default_transaction_isolation", "shared_buffers"):
                    cur.execute(sql.SQL("SHOW {}").format(sql.Identifier(name)))
                    out[name] = str(cur.fetchone()[0])
                return out
        finally:
            conn.close()

    @contextlib.contextmanager
    def database(self, label: str = "bench") -> Iterator[str]:
        """A fresh database as a ``postgresql://`` URL; dropped afterwards."""
        name = f"ppbench_{label}_{uuid.uuid4().hex[:10]}"
        self._admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield self.server.url(name)
        finally:
            self._admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))

    def connect(self, url: str) -> psycopg2.extensions.connection:
        """A psycopg2 autocommit connection to the database of ``url``."""
        conn = self.server.connect(url.rsplit("/", 1)[1])
        return conn

    def _admin(self, statement: sql.Composable) -> None:
        conn = self.server.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(statement)
        finally:
            conn.close()

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.stop()
            self._cluster = None


# --- S3 --------------------------------------------------------------------------------------


@dataclass
class Latency:
    """A *simulated* per-request latency, in seconds, by request kind."""

    label: str = "none"
    put: float = 0.0
    other: float = 0.0

    def of(self, kind: str) -> float:
        return self.put if kind in ("PUT", "PART", "POST") else self.other


def request_kind(method: str, path: str, query: str) -> str:
    """Classify an S3 request: PUT, PART, POST, GET, LIST, HEAD or DELETE."""
    method = method.upper()
    if method == "PUT":
        return "PART" if "partNumber=" in query else "PUT"
    if method == "GET":
        bucket_level = path.strip("/").count("/") == 0
        return "LIST" if bucket_level or "list-type" in query else "GET"
    return method


@dataclass
class Counts:
    """Requests seen by an endpoint, by kind (thread-safe)."""

    by_kind: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str) -> None:
        with self.lock:
            self.by_kind[kind] += 1

    def snapshot(self) -> Counter[str]:
        with self.lock:
            return Counter(self.by_kind)


class _Middleware:
    """Counts requests and sleeps the simulated latency before answering."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.counts = Counts()
        self.latency = Latency()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        kind = request_kind(environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", ""),
                            environ.get("QUERY_STRING", ""))
        self.counts.add(kind)
        delay = self.latency.of(kind)
        if delay:
            time.sleep(delay)
        return self.app(environ, start_response)


class S3Endpoint:
    """One loopback HTTP endpoint of the moto S3 backend (like ``ThreadedMotoServer``)."""

    def __init__(self, name: str) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        self.name = name
        self.middleware = _Middleware(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, self.middleware, threaded=True,
                                   request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name=f"moto-{name}", daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.url = f"http://{host}:{port}"

    @property
    def counts(self) -> Counts:
        return self.middleware.counts

    def set_latency(self, latency: Latency) -> None:
        self.middleware.latency = latency

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)


class S3:
    """The moto S3 backend with named endpoints; fake credentials in the environment."""

    def __init__(self) -> None:
        self._saved = {k: os.environ.get(k) for k in (*FAKE_AWS_ENV, *_AWS_UNSET)}
        os.environ.update(FAKE_AWS_ENV)
        for name in _AWS_UNSET:
            os.environ.pop(name, None)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self.endpoints: dict[str, S3Endpoint] = {}
        self.main = self.endpoint("main")
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.main.url, region_name=REGION)

    def endpoint(self, name: str) -> S3Endpoint:
        """The endpoint ``name`` (started on first use)."""
        if name not in self.endpoints:
            self.endpoints[name] = S3Endpoint(name)
        return self.endpoints[name]

    def bucket(self, label: str) -> str:
        """A new bucket's name."""
        name = f"{label}-{uuid.uuid4().hex[:12]}".lower()
        self.client.create_bucket(Bucket=name)
        return name

    def uri(self, bucket: str, prefix: str = "p", endpoint: S3Endpoint | None = None) -> str:
        """Our ``s3://`` blob URI for ``bucket`` through ``endpoint`` (default: main)."""
        ep = endpoint or self.main
        return f"s3://{bucket}/{prefix}?endpoint_url={ep.url}&region={REGION}"

    def delta_options(self, endpoint: S3Endpoint | None = None) -> dict[str, str]:
        """deltalake ``storage_options`` for ``endpoint`` (conditional PUT commits)."""
        ep = endpoint or self.main
        return {"AWS_ENDPOINT_URL": ep.url, "AWS_ALLOW_HTTP": "true", "AWS_REGION": REGION,
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_S3_ADDRESSING_STYLE": "path", "conditional_put": "etag"}

    def iceberg_properties(self, endpoint: S3Endpoint | None = None) -> dict[str, str]:
        """PyIceberg FileIO properties for ``endpoint``."""
        ep = endpoint or self.main
        return {"s3.endpoint": ep.url, "s3.access-key-id": "testing",
                "s3.secret-access-key": "testing", "s3.region": REGION,
                "s3.force-virtual-addressing": "false"}

    def objects(self, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
        """Every live object under ``prefix`` of ``bucket``."""
        out: list[dict[str, Any]] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                          Prefix=prefix):
            out.extend(page.get("Contents", []))
        return out

    def counts(self, names: Iterable[str] | None = None) -> Counter[str]:
        """Requests seen so far by the named endpoints (default: all), by kind."""
        total: Counter[str] = Counter()
        for name in (names or list(self.endpoints)):
            total.update(self.endpoints[name].counts.snapshot())
        return total

    def close(self) -> None:
        for ep in self.endpoints.values():
            ep.stop()
        self.endpoints.clear()
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- everything together ----------------------------------------------------------------------


class Services:
    """PostgreSQL, S3 and a scratch folder for one benchmark run."""

    def __init__(self, workdir: str | None = None) -> None:
        self.pg = Postgres()
        self.s3 = S3()
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="pp-bench-")
        os.makedirs(self.workdir, exist_ok=True)

    def folder(self, label: str) -> str:
        """A new empty folder under the scratch folder."""
        path = os.path.join(self.workdir, f"{label}-{uuid.uuid4().hex[:8]}")
        os.makedirs(path)
        return path

    def close(self) -> None:
        self.s3.close()
        self.pg.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
