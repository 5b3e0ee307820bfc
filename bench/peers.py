"""The data every case writes, and the peers' set-ups: deltalake, PyIceberg, DuckLake.

Versions and connection details are collected here so the report can list them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa

from persist_pipeline.updates import SCHEMA

#: Rows of one small append (case 1, 2, 3, 7) and the size of each value.
SMALL_ROWS = 10
VALUE_BYTES = 90


#: Distinct small batches cycled through by :func:`small_batch`.
_TEMPLATES = 256


@functools.lru_cache(maxsize=1)
def _templates() -> tuple[tuple[tuple[bytes, bytes], ...], ...]:
    rnd = random.Random(42)  # noqa: S311 - benchmark data, not secrets
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return tuple(
        tuple((b"key-%06d" % rnd.randrange(1_000_000),
               "".join(rnd.choice(alphabet) for _ in range(VALUE_BYTES)).encode())
              for _ in range(SMALL_ROWS))
        for _ in range(_TEMPLATES))


def small_batch(ts: int, seed: int = 0) -> list[tuple[bytes, bytes, int, int]]:
    """One small append at time ``ts``: 10 updates of about 100 bytes each (about 1 KiB
    encoded); ``seed`` picks one of 256 pre-generated key/value sets, so building a batch
    costs next to nothing inside a timed loop."""
    return [(k, v, ts, 1) for k, v in _templates()[seed % _TEMPLATES]]


def as_table(updates: Sequence[tuple[bytes, bytes, int, int]]) -> pa.Table:
    """Updates as a pyarrow Table with the k, v, t, d schema."""
    k, v, t, d = zip(*updates, strict=True) if updates else ((), (), (), ())
    return pa.table([pa.array(k, pa.binary()), pa.array(v, pa.binary()),
                     pa.array(t, pa.int64()), pa.array(d, pa.int64())], schema=SCHEMA)


def versions() -> dict[str, str]:
    """Installed versions of the libraries the benchmarks exercise."""
    out = {}
    for dist in ("persist-pipeline", "pyarrow", "sqlalchemy", "psycopg2-binary", "boto3",
                 "moto", "deltalake", "pyiceberg", "duckdb", "duckdb-ext-ducklake",
                 "duckdb-ext-postgres", "duckdb-ext-sqlite", "pyspark", "dagster",
                 "matplotlib", "numpy", "pyinstrument"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


# --- deltalake ----------------------------------------------------------------------------------


def delta_open(uri: str, first: pa.Table, storage_options: dict[str, str] | None = None) -> Any:
    """Create a Delta table at ``uri`` with ``first`` and return it, kept open."""
    from deltalake import DeltaTable, write_deltalake

    write_deltalake(uri, first, mode="append", storage_options=storage_options)
    return DeltaTable(uri, storage_options=storage_options)


def delta_append(table: Any, data: pa.Table) -> None:
    """``write_deltalake`` append to an open table."""
    from deltalake import write_deltalake

    write_deltalake(table, data, mode="append")


# --- PyIceberg --------------------------------------------------------------------------------


def iceberg_table(pg_url: str, warehouse: str, schema: pa.Schema,
                  properties: dict[str, str] | None = None) -> Any:
    """A new Iceberg table in a PyIceberg SQL catalog on ``pg_url`` (PostgreSQL)."""
    from pyiceberg.catalog.sql import SqlCatalog

    uri = pg_url.replace("postgresql://", "postgresql+psycopg2://", 1)
    catalog = SqlCatalog("bench", uri=uri, warehouse=warehouse, **(properties or {}))
    catalog.create_namespace_if_not_exists("bench")
    name = f"bench.t{random.randrange(1 << 30)}"  # noqa: S311
    return catalog.create_table(name, schema=schema)


# --- DuckLake -----------------------------------------------------------------------------------


def duckdb_extension_directory() -> Path:
    """The folder where the ``duckdb-ext-*`` wheels put the extension binaries."""
    import duckdb_ext  # a namespace package shipped by the duckdb-ext-* wheels

    return Path(next(iter(duckdb_ext.__path__))) / "extensions"


def ducklake_connect(catalog: str, data_path: str, inline_rows: int = 1000) -> Any:
    """A duckdb connection with a DuckLake attached as ``lake``, data inlining on.

    Loads the extensions offline from the PyPI wheels (``INSTALL`` needs the network).

    Args:
        catalog: ``postgres:dbname=... host=... user=...`` or ``sqlite:/path/to/file``.
        data_path: the folder for data files.
        inline_rows: ``data_inlining_row_limit``.
    """
    import duckdb

    con = duckdb.connect(config={
        "extension_directory": str(duckdb_extension_directory()),
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
    })
    con.execute("LOAD ducklake")
    con.execute("LOAD postgres" if catalog.startswith("postgres:") else "LOAD sqlite")
    os.makedirs(data_path, exist_ok=True)
    con.execute(f"ATTACH 'ducklake:{catalog}' AS lake (DATA_PATH '{data_path}/')")
    con.execute(f"CALL lake.set_option('data_inlining_row_limit', {int(inline_rows)})")
    return con


def ducklake_pg_catalog(pg_url: str) -> str:
    """The DuckLake catalog string of a ``postgresql://user@host:port/db`` URL."""
    parts = urlsplit(pg_url)
    return (f"postgres:dbname={parts.path.lstrip('/')} host={parts.hostname} "
            f"port={parts.port or 5432} user={parts.username}")


def ducklake_insert_sql(updates: Sequence[tuple[bytes, bytes, int, int]]) -> str:
    """One INSERT of ``updates`` as SQL literals (keys and values as VARCHAR).

    VARCHAR because BLOB keys did not inline on a PostgreSQL catalog in this version, and
    literals because parameterized inserts are slow in this duckdb client (see
    ENVIRONMENT.md); the values are plain ASCII of the same byte length.
    """
    rows = ", ".join(f"('{k.decode()}', '{v.decode()}', {t}, {d})" for k, v, t, d in updates)
    return f"INSERT INTO lake.t VALUES {rows}"
