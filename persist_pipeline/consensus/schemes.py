"""The SQL consensus URI schemes, apart from :mod:`.sql` so that parsing a URI does not
import SQLAlchemy (a quarter of a second at every start of the CLI)."""

from __future__ import annotations

from collections.abc import Mapping

#: URI scheme -> SQL dialect of :class:`~persist_pipeline.consensus.sql.SqlConsensus`.
SCHEMES: Mapping[str, str] = {
    "postgresql": "postgresql",
    "postgres": "postgresql",
    "postgresql+psycopg2": "postgresql",
    "cockroachdb": "cockroachdb",
    "sqlite": "sqlite",
}
