"""The ``persist`` resource: the persist location (consensus URI, blob URI, WAL blob URI).

Each field takes a literal URI, a ``${VAR}`` / ``${VAR:-default}`` template expanded when
a client is opened (see :mod:`resources.env`), or a ``dg.EnvVar``. One
:class:`~persist_pipeline.PersistClient` is opened per run (per inline policy) on first
use and closed when the run ends.
"""

from __future__ import annotations

import dagster as dg
from pydantic import Field, PrivateAttr

from persist_pipeline import InlinePolicy, PersistClient
from persist_pipeline.blob import redact_uri
from persist_pipeline.dagster_io.locations import make_local_dirs
from resources.env import expand_env

__all__ = ["PersistResource", "make_local_dirs"]


class PersistResource(dg.ConfigurableResource):
    """Where shards live: a consensus store and a main (plus optional WAL) blob store.

    Examples: ``sqlite:///abs/path.db`` + ``file:///abs/dir`` (the embedded default),
    ``postgresql://user@host/db`` + ``s3://bucket/prefix?endpoint_url=...``.
    """

    consensus_uri: str = Field(
        description="Consensus URI: postgresql://, cockroachdb://, sqlite:///PATH or mem://. "
                    "${VAR} / ${VAR:-default} are expanded at run time.")
    blob_uri: str = Field(
        description="Main blob store URI: s3://bucket/prefix?endpoint_url=..., "
                    "file:///abs/dir or mem://NAME. Templates are expanded at run time.")
    wal_blob_uri: str = Field(
        default="",
        description="Optional low-latency blob store for fresh write parts; "
                    "empty for none.")

    _clients: dict[InlinePolicy | None, PersistClient] = PrivateAttr(default_factory=dict)

    def uris(self) -> tuple[str, str, str | None]:
        """The expanded (consensus, blob, WAL blob or None) URIs. May contain secrets."""
        consensus = expand_env(self.consensus_uri, what="persist.consensus_uri").strip()
        blob = expand_env(self.blob_uri, what="persist.blob_uri").strip()
        wal = expand_env(self.wal_blob_uri, what="persist.wal_blob_uri").strip()
        return consensus, blob, wal or None

    def describe(self) -> str:
        """The location with credentials removed: safe for logs, metadata and alerts."""
        consensus, blob, wal = self.uris()
        text = f"consensus {redact_uri(consensus)}, blob {redact_uri(blob)}"
        return text + (f", wal {redact_uri(wal)}" if wal else "")

    def client(self, inline_policy: InlinePolicy | None = None) -> PersistClient:
        """This run's client for ``inline_policy`` (opened on first use).

        Local directories named by ``sqlite:///`` and ``file://`` URIs are created.
        """
        client = self._clients.get(inline_policy)
        if client is None:
            consensus, blob, wal = self.uris()
            for uri in (consensus, blob, wal):
                make_local_dirs(uri)
            client = PersistClient.open(consensus, blob, wal, inline_policy=inline_policy)
            self._clients[inline_policy] = client
        return client

    def close(self) -> None:
        """Close every client this resource opened."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._clients = {}  # this run's own clients, never a copy's

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        self.close()
