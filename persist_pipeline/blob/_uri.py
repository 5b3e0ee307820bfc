"""URI parsing helpers shared by the blob backends (private)."""

from __future__ import annotations

import re
from urllib.parse import SplitResult, unquote, urlsplit

from persist_pipeline.exceptions import InvalidUri

#: Query parameters whose values may be quoted in messages; every other value (secrets,
#: and unknown parameters, which may be misspelt secrets) is shown as ``***``.
PUBLIC_PARAMS = frozenset(
    {
        "endpoint_url",
        "region",
        "addressing_style",
        "connect_timeout",
        "read_timeout",
        "max_attempts",
        "access_key_id",
    }
)

_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def redact_userinfo(uri: str) -> str:
    """``scheme://***@host...``: everything up to the LAST ``@`` before the query or
    fragment is hidden, so a password holding an unescaped ``/``, ``@`` or ``:`` (which
    a strict parser would split elsewhere) never shows, not even in part."""
    scheme = _SCHEME_RE.match(uri)
    if scheme is None:
        return uri
    end = len(uri)
    for sep in ("?", "#"):
        found = uri.find(sep, scheme.end())
        if found >= 0:
            end = min(end, found)
    at = uri.rfind("@", scheme.end(), end)
    return uri if at < 0 else uri[:scheme.end()] + "***" + uri[at:]


def redact_uri(uri: str) -> str:
    """``uri`` with non-public query values and any ``user:password@`` shown as ``***``.

    Works on malformed URIs too (a query piece that is not ``name=value`` is hidden
    whole, a fragment too), so error messages can quote what the user passed.
    """
    uri = redact_userinfo(uri)
    base, sep, rest = uri.partition("?")
    if not sep:
        base, hash_sep, _ = base.partition("#")
        return base + ("#***" if hash_sep else "")
    query, hash_sep, _ = rest.partition("#")
    pieces = []
    for piece in re.split(r"[&;]", query):
        name, eq, value = piece.partition("=")
        if eq and name in PUBLIC_PARAMS:
            pieces.append(f"{name}={value}")
        elif eq:
            pieces.append(f"{name}=***")
        else:
            pieces.append("***" if piece else "")
    return base + "?" + "&".join(pieces) + ("#***" if hash_sep else "")


def split_uri(uri: object, scheme: str) -> SplitResult:
    """Split ``uri`` and check it has ``scheme``, no fragment and no user info.

    Raises:
        InvalidUri: if ``uri`` is not a string or does not fit.
    """
    if not isinstance(uri, str):
        raise InvalidUri(f"blob URI must be a str, got {type(uri).__name__}")
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        raise InvalidUri(f"malformed blob URI {redact_uri(uri)!r}: {exc}") from None
    if parts.scheme != scheme:
        raise InvalidUri(f"expected a {scheme}:// URI, got {redact_uri(uri)!r}")
    if parts.fragment:
        raise InvalidUri(f"blob URI must not have a #fragment: {redact_uri(uri)!r}")
    if "@" in parts.netloc:
        raise InvalidUri(
            f"blob URI must not carry user info (user:password@): {redact_uri(uri)!r}; "
            "pass credentials as query parameters"
        )
    return parts


def parse_query(parts: SplitResult, allowed: frozenset[str], uri: str) -> dict[str, str]:
    """The query parameters of a split URI as a dict, checked against ``allowed``.

    Values are percent-decoded, but ``+`` is kept as is (not read as a space).
    Unknown and repeated parameters are errors naming the parameters, never their values.

    Raises:
        InvalidUri: on an unknown, repeated or malformed parameter.
    """
    if not parts.query:
        return {}
    pairs = []
    for piece in parts.query.split("&"):
        name, eq, value = piece.partition("=")
        if not eq or not name:
            raise InvalidUri(
                f"malformed query string in blob URI {redact_uri(uri)!r}: "
                "expected name=value pairs separated by '&'"
            )
        # Percent-decoding only: '+' stays '+', because AWS secret keys contain it and
        # are often pasted into URIs unescaped.
        pairs.append((unquote(name), unquote(value)))
    params: dict[str, str] = {}
    repeated: set[str] = set()
    for name, value in pairs:
        if name in params:
            repeated.add(name)
        params[name] = value
    unknown = sorted(set(params) - allowed)
    if unknown:
        supported = ", ".join(sorted(allowed)) or "none"
        raise InvalidUri(
            f"unknown query parameter(s) {', '.join(unknown)} in blob URI "
            f"{redact_uri(uri)!r}; supported: {supported}"
        )
    if repeated:
        raise InvalidUri(f"repeated query parameter(s) {', '.join(sorted(repeated))}")
    return params
