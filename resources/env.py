"""Values from the environment: ``${VAR}`` templates, and keeping secrets out of text.

Resource fields that may hold secrets (database URIs with passwords, S3 URIs with keys,
webhook URLs) accept ``${VAR}`` and ``${VAR:-default}`` templates that are expanded only
when the value is used, so the Dagster UI shows the template, never the secret, and a
changed environment takes effect without reloading the code location.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from persist_pipeline.blob import redact_uri
from persist_pipeline.dagster_io.templates import expand_env

_URI = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


__all__ = ["describe_url", "expand_env", "redact_text"]


def redact_text(text: str) -> str:
    """``text`` with every URI in it redacted (passwords, keys, webhook paths hidden).

    URIs keep their scheme, host and path except for ``http(s)`` URLs, whose path and
    query are hidden too (a webhook URL's path is its secret).
    """

    def sub(match: re.Match[str]) -> str:
        uri = match.group(0)
        if uri.lower().startswith(("http://", "https://")):
            return describe_url(uri)
        return redact_uri(uri)

    return _URI.sub(sub, text)


def describe_url(url: str) -> str:
    """An HTTP(S) URL as ``scheme://host[:port]/***``: safe to log for a webhook."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<malformed url>"
    tail = "/***" if (parts.path.strip("/") or parts.query) else ""
    return f"{parts.scheme}://{host}{port}{tail}"
