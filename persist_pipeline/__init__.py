"""persist-pipeline: durable shards of timestamped updates on SQL consensus and blobs.

Public API (everything else is internal)::

    from persist_pipeline import PersistClient, ShardId, InlinePolicy, UpperMismatch, PersistError

Module map:

- ``client``: :class:`PersistClient`, the entry point; opens handles, inspect/compact/gc.
- ``write`` / ``read``: write handles (compare_and_append, append) and read handles
  (snapshot, streaming snapshot_batches, listen, snapshot_plan, since holds; critical
  readers).
- ``fingerprint``: a digest of a streamed snapshot (the Dagster compaction check).
- ``plan``: :class:`SnapshotPlan`, a snapshot's live Parquet files and inline rows for
  other engines (a pyarrow filesystem and dataset; DuckDB, polars), held against GC.
- ``schema``: :class:`ShardSchema`, typed shards (key and value columns encoded into
  k/v by ``internal/rowcodec``; decoded on reads, written beside k/v in Parquet parts).
- ``config``: :class:`InlinePolicy` (inline vs blob) and every tunable with its default.
- ``names``: named shards, a registry of immutable ``name -> shard id`` records in
  consensus (``PersistClient.resolve``, ``shard_names``).
- ``updates``: validation, consolidation (sort, then vectorized sums of equal rows) and
  the part encodings (Parquet k/v/t/d; inline protobuf).
- ``compaction`` / ``gc``: maintenance, each returning a metrics dict; ``run_merge``
  streams a merge request (or one key range of it) in bounded memory.
- ``verify``: :class:`VerifyReport`, a check that every blob and inline part a shard's
  state references is stored intact (``PersistClient.verify``, ``persist-pipeline
  verify``).
- ``consensus/`` and ``blob/``: backends behind small ABCs, opened by URI scheme.
- ``internal/``: the state model, pure transitions, the Spine, codecs, the k-way merge
  of sorted runs (``merge``), streaming part reads and writes (``blobs``), the typed
  row codec (``rowcodec``), key lookups for upserts (``lookup``), the CaS loop
  (``machine``: lost replies settled, negative answers confirmed), routine maintenance
  (``maintenance``: rollups), every blob key (``paths``), the injected clock and locks.
- ``ingest``: reading updates from Parquet, CSV and JSON Lines files.
- ``faults``: seeded fault injection (wrappers in ``blob.faults``, ``consensus.faults``).
- ``nemesis/``: killed processes, faults and a checker of every guarantee.
- ``sim/``: the deterministic simulation (``persist-pipeline simulate``).
- ``spark``: the Spark compaction executor: key-range split merges, failures isolated per
  merge (imports pyspark lazily); ``register`` adds the data source.
- ``spark_source``: the ``persist`` PySpark data source (reads and atomic writes);
  its PySpark classes are in ``spark_datasource``, imported by ``register``.
- ``dagster_io/``: ``PersistIOManager``, Dagster assets stored in shards, and the row
  encoding it uses (imports dagster; never imported by this package itself).
- ``proto/``: the protobuf wire formats; ``cli``: the ``persist-pipeline`` command.
- ``exceptions``: every error, rooted at :class:`PersistError`; each is also exported
  here (``from persist_pipeline import ShardNameNotFound``).
"""

from __future__ import annotations

from persist_pipeline.client import PersistClient, ShardSummary
from persist_pipeline.config import InlinePolicy, PersistConfig
from persist_pipeline.exceptions import (
    AuthError,
    BackendError,
    BlobAuthError,
    BlobError,
    BlobLocationNotFound,
    BlobUnavailable,
    ChecksumMismatch,
    ClientClosed,
    ClockProbeLost,
    CommitDeadlineExceeded,
    ConsensusAuthError,
    ConsensusError,
    ConsensusLocationNotFound,
    ConsensusUnavailable,
    Contended,
    CorruptData,
    CorruptPart,
    CorruptState,
    DiffOverflow,
    FencedOut,
    Indeterminate,
    InvalidConfig,
    InvalidFrontier,
    InvalidInput,
    InvalidShardId,
    InvalidShardName,
    InvalidUpdates,
    InvalidUri,
    LeaseExpired,
    LocationNotFound,
    NotATable,
    NotYetAvailable,
    PartChecksumMismatch,
    PartMissing,
    PersistError,
    ResourceExhausted,
    RollupChecksumMismatch,
    SchemaMismatch,
    ShardNameNotFound,
    ShardNotFound,
    SinceViolation,
    TokenReused,
    Unavailable,
    UnsettledCommit,
    UntypedUpdates,
    UpperMismatch,
    VersionMismatch,
)
from persist_pipeline.frontier import CLOSED, Frontier
from persist_pipeline.ids import ShardId
from persist_pipeline.plan import SnapshotPlan
from persist_pipeline.read import CriticalReaderHandle, Listen, ListenEvent, ReadHandle
from persist_pipeline.schema import ShardSchema
from persist_pipeline.transaction import Transaction
from persist_pipeline.verify import IntegrityProblem, VerifyReport
from persist_pipeline.write import WriteHandle, WriteResult

__version__ = "0.1.0"

__all__ = [
    "CLOSED",
    "AuthError",
    "BackendError",
    "BlobAuthError",
    "BlobError",
    "BlobLocationNotFound",
    "BlobUnavailable",
    "ChecksumMismatch",
    "ClientClosed",
    "ClockProbeLost",
    "CommitDeadlineExceeded",
    "ConsensusAuthError",
    "ConsensusError",
    "ConsensusLocationNotFound",
    "ConsensusUnavailable",
    "Contended",
    "CorruptData",
    "CorruptPart",
    "CorruptState",
    "CriticalReaderHandle",
    "DiffOverflow",
    "FencedOut",
    "Frontier",
    "Indeterminate",
    "InlinePolicy",
    "IntegrityProblem",
    "InvalidConfig",
    "InvalidFrontier",
    "InvalidInput",
    "InvalidShardId",
    "InvalidShardName",
    "InvalidUpdates",
    "InvalidUri",
    "LeaseExpired",
    "Listen",
    "ListenEvent",
    "LocationNotFound",
    "NotATable",
    "NotYetAvailable",
    "PartChecksumMismatch",
    "PartMissing",
    "PersistClient",
    "PersistConfig",
    "PersistError",
    "ReadHandle",
    "ResourceExhausted",
    "RollupChecksumMismatch",
    "SchemaMismatch",
    "ShardId",
    "ShardNameNotFound",
    "ShardNotFound",
    "ShardSchema",
    "ShardSummary",
    "SinceViolation",
    "SnapshotPlan",
    "TokenReused",
    "Transaction",
    "Unavailable",
    "UnsettledCommit",
    "UntypedUpdates",
    "UpperMismatch",
    "VerifyReport",
    "VersionMismatch",
    "WriteHandle",
    "WriteResult",
    "__version__",
]
