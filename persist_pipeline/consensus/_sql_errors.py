"""Maps SQL driver errors to :mod:`persist_pipeline.exceptions` without leaking secrets.

Every message names the database by its redacted URL (password shown as ``***``), and
passwords in a driver message are masked by structure (see :func:`mask_secrets`).
"""

from __future__ import annotations

import re
import sqlite3

import psycopg2
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL

from persist_pipeline.blob._uri import redact_userinfo
from persist_pipeline.exceptions import (
    ConsensusAuthError,
    ConsensusError,
    ConsensusUnavailable,
)

_MASK = "***"

_PG_AUTH_MARKERS = (
    "password authentication failed",
    "authentication failed",
    "no password supplied",
    "fe_sendauth",
    "no pg_hba.conf entry",
    "pg_hba.conf rejects",
)
_PG_TRANSIENT_MARKERS = (
    "connection refused",
    "could not connect",
    "timeout expired",
    "timed out",
    "could not translate host name",
    "server closed the connection",
    "terminating connection",
    "connection already closed",
    "ssl syscall error",
    "the database system is",
    "no route to host",
    "network is unreachable",
    "too many connections",
    "remaining connection slots",
)
# SQLSTATE classes/codes that mean "try again": connection exceptions, operator
# intervention (shutdown, cannot connect now), serialization failures and deadlocks,
# insufficient resources, lock timeouts and statement timeouts.
_PG_TRANSIENT_CODES = ("08", "57P", "40001", "40P01", "53", "55P03", "57014")


def redact_url(url: URL) -> str:
    """``url`` as a string with its password (also a ``password`` query key) masked."""
    if "password" not in url.query:
        return url.render_as_string(hide_password=True)
    url = url.update_query_dict({"password": "REDACTED"})
    return url.render_as_string(hide_password=True).replace("password=REDACTED", "password=***")


#: Passwords at least this long are also masked wherever they occur in a driver message.
#: A shorter one is masked only where it stands as a password (a URI's user info, a
#: ``password=`` value): masking a short string everywhere mangles the message and shows
#: where the string occurs ("Connection refused" with the password "on").
_MASK_ANYWHERE_MIN = 8
_URI_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_PASSWORD_VALUE = re.compile(r"(?i)(\bpassword\s*=\s*)('[^']*'|\"[^\"]*\"|[^\s&;,]+)")


def mask_secrets(message: str, secrets: list[str]) -> str:
    """``message`` with passwords masked by structure: the user info of every URI in it
    and every ``password=`` value; then each secret of at least ``_MASK_ANYWHERE_MIN``
    characters wherever it still occurs. The rest of the message is left as it was."""
    message = _URI_IN_TEXT.sub(lambda m: redact_userinfo(m.group(0)), message)
    message = _PASSWORD_VALUE.sub(lambda m: m.group(1) + _MASK, message)
    for secret in secrets:
        if len(secret) >= _MASK_ANYWHERE_MIN:
            message = message.replace(secret, _MASK)
    return message


def _secrets(url: URL) -> list[str]:
    found = [url.password] if url.password else []
    query_password = url.query.get("password")
    if isinstance(query_password, str) and query_password:
        found.append(query_password)
    return [str(s) for s in found]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


def _classify_pg(orig: psycopg2.Error, message: str) -> type[ConsensusError]:
    lowered = message.lower()
    code = orig.pgcode or ""
    if code.startswith("28") or any(m in lowered for m in _PG_AUTH_MARKERS):
        return ConsensusAuthError
    if "role" in lowered and "does not exist" in lowered and "database" not in lowered:
        return ConsensusAuthError
    if code.startswith(_PG_TRANSIENT_CODES) or any(m in lowered for m in _PG_TRANSIENT_MARKERS):
        return ConsensusUnavailable
    if "does not exist" in lowered and "database" in lowered:
        return ConsensusError
    if isinstance(orig, psycopg2.OperationalError | psycopg2.InterfaceError) and not code:
        return ConsensusUnavailable
    return ConsensusError


def _classify_sqlite(orig: sqlite3.Error, message: str) -> type[ConsensusError]:
    lowered = message.lower()
    if "locked" in lowered or "busy" in lowered:
        return ConsensusUnavailable
    return ConsensusError


def _hint(cls: type[ConsensusError], message: str) -> str:
    lowered = message.lower()
    if cls is ConsensusAuthError:
        return " (check the user name and password)"
    if "does not exist" in lowered and "database" in lowered:
        return " (create the database first, e.g. with createdb)"
    if "unable to open database file" in lowered:
        return " (does the file's directory exist and is it writable?)"
    if "file is not a database" in lowered:
        return " (the file is not a SQLite database)"
    return ""


def map_error(exc: BaseException, url: URL, action: str) -> ConsensusError:
    """The :class:`ConsensusError` subclass instance to raise for ``exc``.

    Args:
        exc: a driver error (psycopg2, sqlite3) or a SQLAlchemy error wrapping one.
        url: the database URL; only its redacted form appears in the message.
        action: what was being done, e.g. ``"compare_and_set"``.
    """
    orig: BaseException = exc
    if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None:
        orig = exc.orig
    message = mask_secrets(_first_line(orig), _secrets(url))
    cls: type[ConsensusError]
    if isinstance(orig, psycopg2.Error):
        cls = _classify_pg(orig, message)
    elif isinstance(orig, sqlite3.Error):
        cls = _classify_sqlite(orig, message)
    elif isinstance(orig, sa_exc.TimeoutError | TimeoutError | ConnectionError):
        cls = ConsensusUnavailable
    else:
        cls = ConsensusError
    return cls(f"{action} on {redact_url(url)} failed: {message}{_hint(cls, message)}")
