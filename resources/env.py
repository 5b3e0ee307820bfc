"""Values from the environment: ``${VAR}`` templates, and keeping secrets out of text.

Resource fields that may hold secrets (database URIs with passwords, S3 URIs with keys,
webhook URLs) accept ``${VAR}`` and ``${VAR:-default}`` templates that are expanded only
when the value is used, so the Dagster UI shows the template, never the secret, and a
changed environment takes effect without reloading the code location.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from persist_pipeline.blob import redact_uri
from persist_pipeline.exceptions import InvalidConfig

_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_URI = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def expand_env(text: str, env: Mapping[str, str] | None = None, *, what: str = "value") -> str:
    """Replace ``${VAR}`` and ``${VAR:-default}`` in ``text`` from ``env``.

    ``${VAR:-default}`` uses ``default`` when VAR is unset or empty.

    Raises:
        InvalidConfig: ``${VAR}`` names an unset variable (the message names the variable
            and ``what``, never a value).
    """
    env = os.environ if env is None else env

    def sub(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = env.get(name, "")
        if value:
            return value
        if default is not None:
            return default
        raise InvalidConfig(f"{what}: environment variable {name} is not set")

    return _TEMPLATE.sub(sub, text)


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
