"""Consensus in a SQL database: PostgreSQL, CockroachDB (via psycopg2) or SQLite.

Every method is one autocommit statement (a new shard's first record adds one registry
insert before it; ``truncate`` reads the head first), executed on a raw DBAPI cursor with
SQL rendered once per engine from SQLAlchemy Core constructs (see
:mod:`._sql_statements`). On PostgreSQL the statements are server-side prepared once per
connection, so a compare-and-set is not parsed and planned on every call.

PostgreSQL sessions run SERIALIZABLE: under READ COMMITTED a compare-and-set blocked on a
competitor's uncommitted insert of the same seqno inserts anyway when a truncation deletes
that row before the competitor commits, so it reports a win for a seqno someone else won
and leaves a record below the head. A statement aborted by a serialization failure (or a
deadlock) has no effect and is run again, so a losing writer may take more than one
round trip. SQLite serializes writers with its write lock; CockroachDB is serializable.

Connections come from a SQLAlchemy pool with ``pool_pre_ping``. A few are then kept for
reuse without a new ping while used in the last ``_MAX_REUSE_IDLE_S`` seconds, so a busy
writer pays one round trip per call, not two; before reuse a local poll of the socket
catches connections the server has closed. A connection lost silently (no FIN from the
peer) fails one call with :class:`ConsensusUnavailable` and is discarded.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import select
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from sqlalchemy import create_engine, event, inspect
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.schema import CreateTable

from persist_pipeline.consensus._checks import (
    check_cas,
    check_cas_many,
    check_int,
    check_limit,
    check_shard,
)
from persist_pipeline.consensus._sql_errors import map_error, redact_url
from persist_pipeline.consensus._sql_statements import (
    Rendered,
    compile_all,
    compile_multi_cas,
    metadata,
)
from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.consensus.schemes import SCHEMES
from persist_pipeline.exceptions import (
    ConsensusError,
    ConsensusLocationNotFound,
    InvalidInput,
    InvalidUri,
)

T = TypeVar("T")


_DRIVERS = {
    "postgresql": "postgresql+psycopg2",
    "cockroachdb": "pp_cockroachdb",
    "sqlite": "sqlite",
}
_SQLITE_BUSY_TIMEOUT_S = 30
_CONNECT_TIMEOUT_S = 10
_MAX_REUSE_IDLE_S = 5.0
_KEEP_CONNECTIONS = 4  # below the pool's default size of 5
_MAX_ATTEMPTS = 30  # of a statement aborted by a serialization failure or deadlock
_SERIALIZABLE = "-c default_transaction_isolation=serializable"
_PREPARED = "persist_pipeline.prepared"


class _CockroachDialect(PGDialect_psycopg2):
    """The psycopg2 PostgreSQL dialect, accepting CockroachDB's version string."""

    supports_statement_cache = True

    def _get_server_version_info(self, connection: Any) -> tuple[int, ...]:
        version = str(connection.exec_driver_sql("select pg_catalog.version()").scalar())
        if "cockroachdb" in version.lower():
            return (13, 0)  # CockroachDB speaks the PostgreSQL 13 wire protocol and SQL.
        result: tuple[int, ...] = super()._get_server_version_info(  # type: ignore[no-untyped-call]
            connection
        )
        return result


registry.register("pp_cockroachdb", __name__, "_CockroachDialect")


def parse_uri(uri: str) -> tuple[str, URL]:
    """The backend kind (``postgresql``, ``cockroachdb``, ``sqlite``) and parsed URL.

    Raises:
        InvalidUri: ``uri`` is malformed, has an unsupported scheme, is a SQLite URI
            without a file path, or a PostgreSQL / CockroachDB URI without a database.
    """
    if not isinstance(uri, str) or "://" not in uri:
        raise InvalidUri(f"not a SQL consensus URI (scheme://...): {type(uri).__name__}")
    scheme = uri.split("://", 1)[0].lower()
    kind = SCHEMES.get(scheme)
    if kind is None:
        raise InvalidUri(
            f"unsupported SQL consensus scheme {scheme!r}; supported: {', '.join(SCHEMES)}"
        )
    try:
        url = make_url(uri)
    except (sa_exc.ArgumentError, ValueError) as exc:
        # The driver's message would echo the URI, password included.
        raise InvalidUri(f"malformed {scheme} consensus URI: {type(exc).__name__}") from None
    if kind == "sqlite" and (not url.database or url.database == ":memory:"):
        raise InvalidUri(
            "a sqlite consensus URI needs a file path, e.g. sqlite:///path/to/consensus.db "
            "(use mem:// for an in-memory store)"
        )
    _check_params(kind, scheme, url)
    if kind != "sqlite":
        _check_database(scheme, url)
    return kind, url


def _check_database(scheme: str, url: URL) -> None:
    """Refuse a server URI that names no database: libpq would connect to the database
    named after the user (CockroachDB to ``defaultdb``), and a store created there is
    not the one meant. A ``dbname`` parameter names it too, and a ``service`` defines it
    in the service file."""
    if url.database or "dbname" in url.query or "service" in url.query:
        return
    raise InvalidUri(
        f"{scheme} consensus URI {redact_url(url)} names no database: add it after the "
        f"host, e.g. {scheme}://USER@HOST:PORT/DBNAME (without one the server would pick "
        f"the user's default database)")


#: The query parameters of a sqlite consensus URI.
_SQLITE_PARAMS = frozenset({"timeout"})


def _check_params(kind: str, scheme: str, url: URL) -> None:
    """Refuse query parameters the backend would not honour, by name (never by value: a
    value may be a password), before anything is opened.

    SQLite takes ``timeout`` only (the driver would drop anything else with a warning,
    so ``?mode=ro`` would open the file read-write). PostgreSQL and CockroachDB take
    libpq's connection parameters (``sslmode``, ``connect_timeout``, ...), which libpq
    itself validates: the same check is run here, so an unknown one is refused as a bad
    URI rather than as a failed connection.
    """
    if kind == "sqlite":
        unknown = sorted(set(url.query) - _SQLITE_PARAMS)
        supported = ", ".join(sorted(_SQLITE_PARAMS))
    else:
        unknown = sorted(name for name in url.query if not _libpq_parameter(name))
        supported = "libpq connection parameters such as sslmode, connect_timeout"
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise InvalidUri(f"{scheme} consensus URI: unknown parameter(s) {names} (supported: "
                         f"{supported})")
    if kind != "sqlite":
        _check_libpq_values(scheme, url)


#: libpq parameters whose value libpq parses as a C int (``parse_int_param``: optional
#: blanks and sign, decimal digits, within 32 bits), refusing anything else when it
#: connects.
_LIBPQ_INTEGERS = frozenset({"connect_timeout", "keepalives", "keepalives_idle",
                             "keepalives_interval", "keepalives_count",
                             "tcp_user_timeout"})
_LIBPQ_INTEGER = re.compile(r"[ \t\n\r\f\v]*[+-]?[0-9]+[ \t\n\r\f\v]*")
#: libpq's sslmode values (unchanged since PostgreSQL 9.1).
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def _check_libpq_values(scheme: str, url: URL) -> None:
    """Refuse a value libpq would refuse, naming the parameter only (a value may be a
    password), before connecting: libpq refuses it only at connect time, where it would
    read as an unreachable database (transient, "safe to retry") instead of a bad URI."""

    def bad(name: str, what: str) -> InvalidUri:
        return InvalidUri(f"{scheme} consensus URI: parameter {name!r} {what}")

    if url.port is not None and not 1 <= url.port <= 65535:
        raise bad("port", "must be a port number in [1, 65535]")
    for name, value in url.query.items():
        checked = name in _LIBPQ_INTEGERS or name in ("port", "sslmode")
        if checked and not isinstance(value, str):
            raise bad(name, "is given more than once")
        if name in _LIBPQ_INTEGERS and not _is_c_int(value):
            raise bad(name, "must be an integer")
        if name == "port" and not all(
                _port(piece) for piece in str(value).split(",")):
            raise bad(name, "must be a port number in [1, 65535] (one per host, "
                            "comma-separated)")
        if name == "sslmode" and value not in _SSLMODES:
            raise bad(name, f"must be one of {', '.join(_SSLMODES)}")


def _is_c_int(value: object) -> bool:
    return (isinstance(value, str) and _LIBPQ_INTEGER.fullmatch(value) is not None
            and -(1 << 31) <= int(value) < (1 << 31))


def _port(piece: str) -> bool:
    """One host's port: empty (the default), else an integer in [1, 65535]."""
    return piece == "" or (_is_c_int(piece) and 1 <= int(piece) <= 65535)


def _libpq_parameter(name: str) -> bool:
    """Whether libpq knows the connection parameter ``name``."""
    try:
        psycopg2.extensions.parse_dsn(psycopg2.extensions.make_dsn(**{name: "x"}))
    except psycopg2.ProgrammingError:
        return False
    return True


def _sqlite_timeout(url: URL) -> float:
    """The busy timeout in seconds: the URI's ``?timeout=`` or 30."""
    raw = url.query.get("timeout", str(_SQLITE_BUSY_TIMEOUT_S))
    try:
        timeout = float(raw)  # type: ignore[arg-type]  # a tuple if repeated: TypeError
    except (TypeError, ValueError):
        raise InvalidUri(f"sqlite consensus URI: timeout must be seconds, got {raw!r}") from None
    if not 0 <= timeout <= 3600:
        raise InvalidUri(f"sqlite consensus URI: timeout must be in [0, 3600], got {timeout}")
    return timeout


def _sqlite_path(url: URL) -> Path:
    """The database file a sqlite URL names, as SQLite resolves it (relative paths
    against the current directory)."""
    # No ``~`` expansion: SQLite itself takes ``~`` literally when it creates the file,
    # and opening with or without create must name the same file.
    return Path(str(url.database)).absolute()


def _create_engine(kind: str, url: URL, create: bool = True, setup: bool = True) -> Engine:
    """The engine of ``url``; ``setup`` False: a SQLite connection is left as it opens
    (no WAL switch, which writes the file), to look at a file that may be no store."""
    engine_url = url.set(drivername=_DRIVERS[kind])
    common: dict[str, Any] = {"pool_pre_ping": True, "isolation_level": "AUTOCOMMIT"}
    if kind == "sqlite":
        timeout = _sqlite_timeout(url)
        if not create:
            # SQLite creates a missing file on connect; its URI filename with mode=rw
            # does not, so a store opened without create never makes one, even if the
            # file is removed between the existence check and a (re)connect.
            filename = "file:" + urllib.parse.quote(str(_sqlite_path(url)))
            engine_url = engine_url.set(database=filename,
                                        query={**url.query, "mode": "rw", "uri": "true"})
        engine = create_engine(engine_url, connect_args={"timeout": timeout}, **common)
        if setup:
            event.listen(engine, "connect", functools.partial(_on_sqlite_connect, timeout))
        return engine
    connect_args: dict[str, Any] = {}
    if kind == "postgresql":
        # READ COMMITTED is not enough: a CaS blocked on a competitor's insert of the same
        # seqno inserts anyway if a truncation deletes that row meanwhile, reporting
        # success for a seqno someone else won. SERIALIZABLE aborts it (and we retry).
        # CockroachDB is serializable by default.
        user_options = url.query.get("options", "")
        if not isinstance(user_options, str):
            user_options = " ".join(user_options)
        connect_args["options"] = f"{user_options} {_SERIALIZABLE}".strip()
    if "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = _CONNECT_TIMEOUT_S
    if "application_name" not in url.query:
        connect_args["application_name"] = "persist-pipeline"
    extra = {"use_native_hstore": False} if kind == "cockroachdb" else {}
    return create_engine(engine_url, connect_args=connect_args, **common, **extra)


def _on_sqlite_connect(timeout: float, dbapi_connection: Any, _record: Any) -> None:
    """WAL (readers never block the writer) and a busy timeout, so processes can share
    the file; FULL sync so an acknowledged write survives a power loss."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        _enable_wal(cursor, timeout)
        cursor.execute("PRAGMA synchronous = FULL")
    finally:
        cursor.close()


def _enable_wal(cursor: Any, timeout: float) -> None:
    """Switches the file to WAL, retrying within ``timeout``: two connections switching a
    new file at once get "database is locked" at once, without the busy handler."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc).lower() or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


class _Slot:
    """A pool connection kept checked out, with what every call on it needs looked up
    once: the driver connection (fixed while the pool connection stays checked out:
    only invalidation replaces it, and an invalidated connection is never kept), its
    kept cursor, its socket's poller and whether our statements are prepared on it.
    A call on a busy writer's connection then touches these few attributes instead of
    the pool's proxies and their info dictionaries."""

    __slots__ = ("conn", "cursor", "dbapi", "poll", "prepared", "used")

    def __init__(self, conn: PoolProxiedConnection) -> None:
        self.conn = conn
        self.dbapi: Any = conn.dbapi_connection
        #: The cursor for statements that return no rows, made on first use.
        self.cursor: Any = None
        # Kept in the pool connection's info (cleared when its driver connection is
        # replaced), so that a connection returned to the pool and checked out again
        # does not prepare its statements twice.
        self.prepared = bool(conn.info.get(_PREPARED))
        self.used = 0.0
        self.poll: Callable[[int], list[Any]] | None = None
        fileno = getattr(self.dbapi, "fileno", None)
        if fileno is None:  # sqlite3: nothing to lose
            return
        try:
            fd = fileno()
        except (OSError, ValueError, psycopg2.Error):
            fd = None
        if fd is None:
            self.poll = _closed_poll
        elif hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
            self.poll = poller.poll
        else:
            self.poll = functools.partial(_select_poll, fd)

    def quiet(self) -> bool:
        """False if an idle connection has input waiting: a server closing it
        (termination, restart, idle timeout) sends an error and EOF, seen here without a
        round trip."""
        poll = self.poll
        if poll is None:
            return True
        try:
            return not self.dbapi.closed and not poll(0)
        except (OSError, ValueError, psycopg2.Error):
            return False

    def kept_cursor(self) -> Any:
        """The cursor kept for statements that return no rows."""
        cursor = self.cursor
        if cursor is None or cursor.closed:
            cursor = self.cursor = self.dbapi.cursor()
        return cursor

    def mark_prepared(self, prepared: bool) -> None:
        self.prepared = prepared
        if prepared:
            self.conn.info[_PREPARED] = True
        else:
            self.conn.info.pop(_PREPARED, None)


def _closed_poll(_timeout: int) -> list[Any]:
    """The poll of a connection whose socket could not be found: never quiet."""
    return [None]


def _select_poll(fd: int, timeout: int) -> list[Any]:
    readable, _, _ = select.select([fd], [], [], timeout)
    return readable


class _Connections:
    """Pool connections kept checked out for reuse without a pre-ping while fresh."""

    def __init__(self, engine: Engine, keep: int) -> None:
        self._engine = engine
        self._keep = keep
        self._idle: list[_Slot] = []  # oldest first
        self._lock = threading.Lock()

    def acquire(self) -> _Slot:
        """A recently used, live connection, else one from the (pinging) pool."""
        while True:
            stale: list[_Slot] = []
            with self._lock:
                if not self._idle:
                    break
                slot = self._idle.pop()
                if time.monotonic() - slot.used > _MAX_REUSE_IDLE_S:
                    # Everything below is older still: let the pool ping them.
                    stale = [slot, *self._idle]
                    self._idle.clear()
            if stale:
                for old in stale:
                    old.conn.close()
                break
            if slot.quiet():
                return slot
            slot.conn.invalidate()
        return _Slot(self._engine.raw_connection())

    def release(self, slot: _Slot) -> None:
        with self._lock:
            if len(self._idle) < self._keep:
                slot.used = time.monotonic()
                self._idle.append(slot)
                return
        slot.conn.close()

    def discard(self, slot: _Slot, error: BaseException) -> None:
        """Returns ``slot`` after ``error``: reused if the driver reported a statement
        error on a healthy connection, otherwise invalidated."""
        dbapi = self._engine.dialect.loaded_dbapi
        if isinstance(error, dbapi.Error) and not self._engine.dialect.is_disconnect(
            error, slot.dbapi, None
        ):
            self.release(slot)
        else:
            slot.conn.invalidate(error if isinstance(error, Exception) else None)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for slot in idle:
            slot.conn.close()


def _rowcount(cursor: Any) -> int:
    return int(cursor.rowcount)


def _fetchall(cursor: Any) -> list[tuple[Any, ...]]:
    return list(cursor.fetchall())


class _LostRace(Exception):
    """A multi-shard compare-and-set hit a seqno a competitor had inserted."""


class SqlConsensus(Consensus):
    """Consensus in a SQL database (see the module docstring).

    Tables ``consensus(shard, seqno, data, summary)`` and ``shards(shard)`` are created if
    missing when the store is opened (unless ``create=False``), which also connects once,
    so a bad host, database or password is reported here and not at the first call.
    """

    def __init__(self, uri: str, *, create: bool = True) -> None:
        """Opens the database at ``uri``.

        Args:
            uri: ``postgresql://user[:password]@host[:port]/db`` (also ``postgres://``,
                ``postgresql+psycopg2://``), ``cockroachdb://...`` or
                ``sqlite:///path/to/file.db``.
            create: create the SQLite file and the tables if missing. False: open an
                existing store only, creating nothing (for callers that only read).

        Raises:
            InvalidUri: the URI is malformed or unsupported.
            ConsensusLocationNotFound: ``create=False`` and the SQLite file does not
                exist, or the database has no persist tables.
            ConsensusAuthError: the database rejected the credentials.
            ConsensusUnavailable: the database could not be reached.
            ConsensusError: anything else (e.g. the database does not exist).
        """
        self._kind, self._url = parse_uri(uri)
        self._display = redact_url(self._url)
        if not create and self._kind == "sqlite" and not _sqlite_path(self._url).exists():
            raise ConsensusLocationNotFound(
                f"no store at {self._display}: {_sqlite_path(self._url)} does not exist")
        self._engine = _create_engine(self._kind, self._url, create)
        self._statements = compile_all(self._kind, self._engine.dialect)
        self._multi_cas: dict[int, Rendered] = {}
        self._conns = _Connections(self._engine, keep=_KEEP_CONNECTIONS)
        self._closed = False
        try:
            if create:
                self._create_tables()
            else:
                self._check_tables()
        except BaseException:
            self._engine.dispose()
            raise

    def __repr__(self) -> str:
        return f"SqlConsensus({self._display!r})"

    @property
    def url(self) -> str:
        """The database URL with its password masked."""
        return self._display

    def _create_tables(self) -> None:
        for attempt in range(3):
            try:
                with self._engine.connect() as conn:
                    for table in metadata.sorted_tables:
                        conn.execute(CreateTable(table, if_not_exists=True))
                return
            except sa_exc.DBAPIError as exc:
                # A concurrent creator can make PostgreSQL's CREATE TABLE IF NOT EXISTS
                # fail (unique violation on pg_type); then the tables exist.
                raced = isinstance(exc, sa_exc.IntegrityError | sa_exc.ProgrammingError)
                if raced and self._tables_exist():
                    return
                if not raced or attempt == 2:
                    raise map_error(exc, self._url, "opening") from exc

    def _check_tables(self) -> None:
        """Connect once (as :meth:`_create_tables` does, so a bad host, database or
        password is reported here) and refuse a database without persist's tables."""
        # A SQLite file is looked at without the connection setup, which switches it to
        # WAL: a file that holds no store (another program's, an empty one) is left as
        # it was.
        engine = (_create_engine(self._kind, self._url, create=False, setup=False)
                  if self._kind == "sqlite" else self._engine)
        try:
            with engine.connect() as conn:
                inspector = inspect(conn)
                missing = [t.name for t in metadata.sorted_tables
                           if not inspector.has_table(t.name)]
        except sa_exc.DBAPIError as exc:
            raise map_error(exc, self._url, "opening") from exc
        finally:
            if engine is not self._engine:
                engine.dispose()
        if missing:
            raise ConsensusLocationNotFound(
                f"no store at {self._display}: the database has no persist tables "
                f"({', '.join(missing)} missing)")

    def _tables_exist(self) -> bool:
        with contextlib.suppress(sa_exc.DBAPIError), self._engine.connect() as conn:
            inspector = inspect(conn)
            return all(inspector.has_table(t.name) for t in metadata.sorted_tables)
        return False

    def _run(
        self, action: str, name: str | Rendered, params: Mapping[str, Any],
        consume: Callable[[Any], T],
    ) -> T:
        # Statements that return no rows (every write, the compare-and-set first) run on
        # a cursor kept with the connection, as a plain psycopg2 client would; reads get
        # a cursor of their own, closed at once, so no result stays referenced.
        keep_cursor = consume is _rowcount and self._kind != "sqlite"
        if self._closed:
            raise ConsensusError(f"{self!r} is closed")
        statement = self._statements[name] if isinstance(name, str) else name
        try:
            slot = self._conns.acquire()
        except (sa_exc.SQLAlchemyError, self._engine.dialect.loaded_dbapi.Error) as exc:
            # The pool raises the driver's own error when it cannot connect.
            raise map_error(exc, self._url, action) from exc
        try:
            result = self._execute(slot, statement, params, consume, keep_cursor)
        except _LostRace:
            self._conns.release(slot)  # the statement failed; the connection is healthy
            raise
        except BaseException as exc:
            self._conns.discard(slot, exc)
            if isinstance(exc, self._engine.dialect.loaded_dbapi.Error):
                raise map_error(exc, self._url, action) from exc
            raise
        self._conns.release(slot)
        return result

    def _execute(
        self,
        slot: _Slot,
        statement: Rendered,
        params: Mapping[str, Any],
        consume: Callable[[Any], T],
        keep_cursor: bool = False,
    ) -> T:
        cursor = slot.kept_cursor() if keep_cursor else slot.dbapi.cursor()
        try:
            args = statement.args(params)
            for attempt in range(_MAX_ATTEMPTS):
                try:
                    if statement.prepare is not None and not slot.prepared:
                        self._prepare(slot, cursor)
                    cursor.execute(statement.sql, args)
                    return consume(cursor)
                except psycopg2.errors.InvalidSqlStatementName:
                    # Someone deallocated our prepared statements; nothing ran.
                    if statement.prepare is None or attempt > 0:
                        raise
                    slot.mark_prepared(False)
                except (psycopg2.errors.UniqueViolation, sqlite3.IntegrityError):
                    # Only the multi-shard CaS inserts without ON CONFLICT: a competitor
                    # won one of its seqnos, and the statement inserted nothing.
                    raise _LostRace from None
                except (psycopg2.errors.SerializationFailure, psycopg2.errors.DeadlockDetected):
                    # The statement's transaction was rolled back, so nothing happened and
                    # running it again on a fresh snapshot is safe.
                    if attempt == _MAX_ATTEMPTS - 1:
                        raise
                    time.sleep(random.uniform(0, min(0.02, 0.0002 * 2**attempt)))  # noqa: S311
            raise AssertionError("unreachable")
        finally:
            if not keep_cursor:
                with contextlib.suppress(Exception):
                    cursor.close()

    def _prepare(self, slot: _Slot, cursor: Any) -> None:
        prepares = [s.prepare for s in self._statements.values() if s.prepare is not None]
        cursor.execute("; ".join(["DEALLOCATE ALL", *prepares]))
        slot.mark_prepared(True)

    def head(self, shard: str) -> VersionedData | None:
        check_shard(shard)
        rows = self._run("head", "head", {"shard": shard}, _fetchall)
        if not rows:
            return None
        seqno, data, summary = rows[0]
        return VersionedData(int(seqno), bytes(data), bytes(summary))

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        check_shard(shard)
        check_cas(expected, new)
        params = {
            "shard": shard,
            "seqno": new.seqno,
            "data": new.data,
            "summary": new.summary,
            "expected": expected,
        }
        if expected is None:
            self._run("compare_and_set", "register", params, _rowcount)
            return self._run("compare_and_set", "create", params, _rowcount) == 1
        return self._run("compare_and_set", "cas", params, _rowcount) == 1

    def compare_and_set_many(self, writes: Sequence[CasWrite]) -> bool:
        ordered = check_cas_many(writes)
        n = len(ordered)
        # PostgreSQL: a prepared statement of this width if there is one, else one
        # prepared statement taking the rows as arrays; other engines: a plain statement
        # of this width, rendered once.
        statement: Rendered | None = self._statements.get(f"cas_many_{n}")
        params: dict[str, Any] = {}
        if statement is None and "cas_many" in self._statements:
            statement = self._statements["cas_many"]
            params = {"shards": [w.shard for w in ordered],
                      "seqnos": [w.new.seqno for w in ordered],
                      "datas": [w.new.data for w in ordered],
                      "summaries": [w.new.summary for w in ordered],
                      "expecteds": [w.expected for w in ordered]}
        else:
            if statement is None:
                statement = self._multi_cas.get(n)
                if statement is None:
                    statement = compile_multi_cas(self._kind, self._engine.dialect, n)
                    self._multi_cas[n] = statement
            for i, write in enumerate(ordered):
                params.update({f"shard_{i}": write.shard, f"seqno_{i}": write.new.seqno,
                               f"data_{i}": write.new.data, f"summary_{i}": write.new.summary,
                               f"expected_{i}": write.expected})
        for write in ordered:
            if write.expected is None:
                # Listed before its first record, as compare_and_set registers a created
                # shard: harmless if the statement then inserts nothing (listings show
                # only shards with records), and it needs no second round trip otherwise.
                self._run("compare_and_set_many", "register", {"shard": write.shard},
                          _rowcount)
        try:
            inserted = self._run("compare_and_set_many", statement, params, _rowcount)
        except _LostRace:
            return False
        if inserted not in (0, n):  # one statement: the database applies all rows or none
            raise ConsensusError(f"compare_and_set_many inserted {inserted} of {n} records")
        return inserted == n

    def scan(self, shard: str, from_seqno: int, limit: int | None = None) -> list[VersionedData]:
        check_shard(shard)
        check_int(from_seqno, "from_seqno", 0)
        limit = check_limit(limit)
        params = {"shard": shard, "from_seqno": from_seqno, "limit": limit}
        rows = self._run("scan", "scan_all" if limit is None else "scan", params, _fetchall)
        return [VersionedData(int(s), bytes(d), bytes(m)) for s, d, m in rows]

    def truncate(self, shard: str, seqno: int) -> int:
        check_shard(shard)
        check_int(seqno, "seqno", 1)
        rows = self._run("truncate", "head_seqno", {"shard": shard}, _fetchall)
        head = rows[0][0] if rows else None
        if head is None or seqno > head:
            raise InvalidInput(
                f"cannot truncate shard {shard!r} below seqno {seqno}: its head is {head}"
            )
        # The head only grows and is never below ``seqno`` now, so this never deletes it.
        return self._run("truncate", "truncate", {"shard": shard, "below": seqno}, _rowcount)

    def list_shards(self) -> list[str]:
        rows = self._run("list_shards", "list_shards", {}, _fetchall)
        return [str(shard) for (shard,) in rows]

    def list_heads(self) -> Mapping[str, VersionedData]:
        rows = self._run("list_heads", "list_heads", {}, _fetchall)
        return {str(s): VersionedData(int(n), b"", bytes(m)) for s, n, m in rows}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._conns.close()
        self._engine.dispose()
