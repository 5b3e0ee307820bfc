"""Consensus backends: the versioned, compare-and-set metadata store of every shard.

Open one from a URI with :func:`open_consensus`.
"""

from __future__ import annotations

from typing import Any

from persist_pipeline.consensus.base import CasWrite, Consensus, VersionedData
from persist_pipeline.consensus.memory import MemoryConsensus
from persist_pipeline.consensus.schemes import SCHEMES as _SQL_SCHEMES
from persist_pipeline.exceptions import InvalidUri

__all__ = [
    "SUPPORTED_SCHEMES",
    "CasWrite",
    "Consensus",
    "MemoryConsensus",
    "SqlConsensus",
    "VersionedData",
    "check_consensus_uri",
    "open_consensus",
]

#: Every URI scheme :func:`open_consensus` accepts.
SUPPORTED_SCHEMES: tuple[str, ...] = ("mem", *_SQL_SCHEMES)

_EXAMPLES = (
    "mem:// (private), mem://NAME (shared in this process), sqlite:///PATH, "
    "postgresql://USER[:PASSWORD]@HOST[:PORT]/DB (also postgres://, "
    "postgresql+psycopg2://), cockroachdb://USER@HOST:PORT/DB"
)


def open_consensus(uri: str, *, create: bool = True) -> Consensus:
    """Opens the consensus store named by ``uri``.

    Args:
        uri: ``mem://`` for a fresh private in-memory store, ``mem://NAME`` for the
            in-memory store NAME shared by every opener in this process,
            ``sqlite:///path/to/file.db``, ``postgresql://...`` (also ``postgres://``,
            ``postgresql+psycopg2://``) or ``cockroachdb://...``.
        create: create a missing SQLite file and missing tables. False: open an
            existing store only and create nothing, so a mistyped location is
            reported instead of becoming an empty store (in-memory stores live in the
            process and are opened as with True).

    Returns:
        The store; close it (or use it as a context manager) when done.

    Raises:
        InvalidUri: ``uri`` is not a string, is malformed, has an unsupported scheme or
            a query parameter the backend does not take (named in the message).
        ConsensusLocationNotFound: ``create=False`` and there is no store at ``uri``.
        ConsensusAuthError: the database rejected the credentials.
        ConsensusUnavailable: the database could not be reached.
        ConsensusError: the database could not be opened for another reason.
    """
    scheme, rest = _checked(uri)
    if scheme == "mem":
        return MemoryConsensus(rest or None)
    from persist_pipeline.consensus.sql import SqlConsensus

    return SqlConsensus(uri.strip(), create=create)


def check_consensus_uri(uri: str) -> None:
    """Raise what :func:`open_consensus` would for a malformed ``uri`` (:class:`InvalidUri`),
    opening and creating nothing (no database file, no connection)."""
    scheme, _ = _checked(uri)
    if scheme != "mem":
        from persist_pipeline.consensus.sql import parse_uri

        parse_uri(uri.strip())


def _checked(uri: str) -> tuple[str, str]:
    """``(scheme, rest)`` of a consensus URI whose scheme is supported; the checks that
    need no SQL driver."""
    if not isinstance(uri, str):
        raise InvalidUri(
            f"consensus URI must be a str, got {type(uri).__name__}; supported: {_EXAMPLES}"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in uri):
        raise InvalidUri("consensus URI contains control characters (NUL, newline, ...); "
                         f"supported: {_EXAMPLES}")
    scheme, sep, rest = uri.strip().partition("://")
    if not sep or not scheme:
        raise InvalidUri(f"malformed consensus URI {_quote(uri)}; supported: {_EXAMPLES}")
    scheme = scheme.lower()
    if scheme == "mem":
        if "?" in rest:
            # As for mem:// blob URIs: a parameter would be silently part of the name.
            raise InvalidUri("a mem:// consensus URI takes no query parameters")
        return scheme, rest
    if scheme not in _SQL_SCHEMES:
        raise InvalidUri(f"unsupported consensus URI scheme {scheme!r}; supported: {_EXAMPLES}")
    if _SQL_SCHEMES[scheme] != "sqlite":
        check_userinfo(scheme, rest)
    return scheme, rest


def check_userinfo(scheme: str, rest: str) -> None:
    """Refuse a ``USER:PASSWORD@`` whose password holds an unescaped ``/``, ``@`` or ``:``.

    Such a URI parses as a different host, port or database (and the driver's errors
    would then quote pieces of the password). The message shows no part of the user
    info, not even which character was found.

    Args:
        scheme: the URI's scheme, for the message.
        rest: the URI after ``scheme://``.

    Raises:
        InvalidUri: with a hint to percent-encode the password.
    """
    head = rest.split("?", 1)[0]
    at = head.rfind("@")
    if at < 0:
        return
    userinfo = head[:at]
    _, colon, password = userinfo.partition(":")
    if "@" in userinfo or "/" in userinfo or (colon and ":" in password):
        host = head[at + 1:].split("/", 1)[0]
        raise InvalidUri(
            f"the user info of consensus URI {scheme}://***@{host}/... holds an unescaped "
            f"'/', '@' or ':' (in the password?): percent-encode the password, e.g. "
            f"urllib.parse.quote(password, safe='') turns '/' into %2F, '@' into %40 and "
            f"':' into %3A")


def _quote(uri: str) -> str:
    """``uri`` for an error message: short, and without anything after a ``:`` in the
    authority that could be a password."""
    shown = uri if len(uri) <= 80 else uri[:77] + "..."
    return repr(shown.split("@", 1)[-1]) if "@" in shown else repr(shown)


def __getattr__(name: str) -> Any:
    # SqlConsensus is imported on first use: SQLAlchemy is slow to import.
    if name == "SqlConsensus":
        from persist_pipeline.consensus.sql import SqlConsensus

        return SqlConsensus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
