"""``${VAR}`` / ``${VAR:-default}`` templates in Dagster resource fields.

Fields that may hold secrets (database URIs with passwords, S3 URIs with keys, webhook
URLs) keep their template in the definitions, so the Dagster UI shows the template and
never the secret; the value is expanded only when it is used.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from persist_pipeline.exceptions import InvalidConfig

_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


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
