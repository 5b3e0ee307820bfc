"""Every error persist-pipeline raises on purpose derives from :class:`PersistError`.

The hierarchy is flat on purpose: catch ``PersistError`` for everything, one of the
middle classes (``InvalidInput``, ``BackendError``, ``CorruptData``) for a family, or a
leaf for one condition. Input errors are raised before anything is written, so a caller
that gets one knows the shard is unchanged.
"""

from __future__ import annotations

from typing import Any


class PersistError(Exception):
    """Base class of every error raised by persist-pipeline."""


# --- bad input: raised before any side effect ---------------------------------------------


class InvalidInput(PersistError, ValueError):
    """The caller passed something malformed; nothing was changed."""


class InvalidUpdates(InvalidInput):
    """An update is malformed: non-bytes key/value, a bad time or diff, a bad table schema."""


class SchemaMismatch(InvalidInput):
    """A schema or a typed table does not fit the shard's recorded schema (or the shard
    holds untyped data); nothing was changed."""


class UntypedUpdates(SchemaMismatch, InvalidUpdates):
    """Untyped ``(key, val, ts, diff)`` tuples were written to a typed shard. A
    :class:`SchemaMismatch` (an untyped write never enters a typed shard) and an
    :class:`InvalidUpdates` (the updates are malformed for this shard), so either
    catches it; nothing was changed."""


class NotATable(InvalidInput):
    """A shard loaded as a table does not hold one: it is untyped or was not written by
    a table store, or other writers' updates left it holding what no table is (a key
    twice in a keyed table, a row counted below once). Nothing was changed; a store of
    the table replaces its contents."""


class TokenReused(InvalidInput):
    """An idempotency token that already named a write appended at another
    ``expected_upper`` was given to this one. A token names one write and is reused
    only to retry that write (same shard and bounds): this is a new write, and nothing
    was written (its parts, perhaps the other write's, are left to GC)."""


class InvalidFrontier(InvalidInput):
    """A frontier argument is malformed or does not advance as required."""


class InvalidShardId(InvalidInput):
    """A shard id is not of the form ``s<uuid>``."""


class InvalidShardName(InvalidInput):
    """A shard name is malformed (see :func:`persist_pipeline.names.check_name`)."""


class InvalidUri(InvalidInput):
    """A consensus or blob URI is malformed or names an unsupported scheme."""


class InvalidConfig(InvalidInput):
    """A setting has an out-of-range or unparsable value."""


class VersionMismatch(InvalidConfig):
    """Processes that must run one version of persist-pipeline (a Spark driver and its
    executors) run different ones; nothing was written."""


# --- expected races and usage conditions --------------------------------------------------


class UpperMismatch(PersistError):
    """compare_and_append found the shard's upper different from ``expected_upper``.

    Attributes:
        expected: the upper the caller expected.
        current: the shard's upper when the append was attempted (``None`` when closed).
        shard: the shard's id, when known (in a transaction: the shard that mismatched).
    """

    def __init__(self, expected: int | None, current: int | None,
                 shard: str | None = None) -> None:
        where = f"shard {shard}: " if shard else ""
        super().__init__(f"{where}upper mismatch: expected {expected}, shard upper is {current}")
        self.expected = expected
        self.current = current
        self.shard = shard

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields, not from args (one message): the funnel gives each
        # waiting append its own copy, and errors cross process boundaries pickled.
        return (type(self), (self.expected, self.current, self.shard), self.__dict__)


class Contended(PersistError):
    """Concurrent writers kept changing what an operation builds on (a table's newest
    generation, its schema) and it gave up after a bounded number of attempts. Transient:
    retry it later. What it wrote before giving up went where no load reads (an older
    generation), so loads return what they did before."""


class ShardNotFound(PersistError, LookupError):
    """No shard with this id exists in the consensus store."""


class ShardNameNotFound(ShardNotFound):
    """No shard is registered under this name (see ``PersistClient.resolve``)."""


class SinceViolation(PersistError):
    """A read asked for a time below the shard's (or the reader's) since."""


class NotYetAvailable(PersistError):
    """A read asked for a time the shard's upper has not passed yet."""


class LeaseExpired(PersistError):
    """A reader or writer handle was expired (by itself or for missing heartbeats), or a
    snapshot plan was closed: the hold it had is gone, so it reads no more."""


class ClientClosed(PersistError):
    """The :class:`~persist_pipeline.PersistClient` was closed: its methods and every
    handle opened from it stop working (a usage error, not a backend failure; nothing
    was changed). Open a new client."""


class FencedOut(PersistError):
    """A critical reader's fencing token did not match; another controller owns it."""

    def __init__(self, expected: bytes, current: bytes) -> None:
        super().__init__("critical reader fencing token mismatch")
        self.expected = expected
        self.current = current

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields (see UpperMismatch.__reduce__).
        return (type(self), (self.expected, self.current), self.__dict__)


# --- stored data that cannot be decoded ---------------------------------------------------


class CorruptData(PersistError):
    """Stored bytes could not be decoded; the message names where they came from."""


class CorruptState(CorruptData):
    """A consensus record or state rollup is corrupt."""


class CorruptPart(CorruptData):
    """A blob part (Parquet or inline protobuf) is corrupt or missing."""


class PartMissing(CorruptPart):
    """A part the state references is gone from its blob store: GC collected it after a
    compaction replaced it (a reader past its lease, or a stale state), or it was lost."""


class ChecksumMismatch(CorruptData):
    """Bytes read from a blob store are not the bytes written there: their CRC-32
    differs from the one the state recorded (rot, a truncated, replaced or swapped
    object). Raised instead of decoding them, so they never become wrong rows."""


class PartChecksumMismatch(ChecksumMismatch, CorruptPart):
    """A Parquet part's bytes do not match its recorded CRC-32."""


class RollupChecksumMismatch(ChecksumMismatch, CorruptState):
    """A state rollup's bytes do not match its recorded CRC-32."""


# --- backends -----------------------------------------------------------------------------


class BackendError(PersistError):
    """A consensus or blob backend failed."""


class ConsensusError(BackendError):
    """The consensus (SQL) backend failed."""


class LocationNotFound(BackendError):
    """A URI names a place that holds no persist store (a mistyped path, bucket or
    database), and the store was opened without creating one: nothing was created."""


class ConsensusLocationNotFound(ConsensusError, LocationNotFound):
    """The consensus URI names no persist store: a SQLite file that does not exist, or a
    database without persist's tables (opened with ``create=False``)."""


class BlobError(BackendError):
    """The blob (object store) backend failed."""


class Unavailable(BackendError):
    """The backend could not be reached or timed out: transient, safe to retry.

    When raised by a write, the write is *indeterminate*: it may or may not have been
    applied. Persist's own retry loops resolve this with idempotency tokens.
    """


class ConsensusUnavailable(ConsensusError, Unavailable):
    """The database could not be reached or the statement failed transiently."""


class BlobUnavailable(BlobError, Unavailable):
    """The object store could not be reached or the request failed transiently."""


class AuthError(BackendError):
    """Credentials were rejected (wrong password, unknown access key, access denied)."""


class ConsensusAuthError(ConsensusError, AuthError):
    """The database rejected the credentials."""


class BlobAuthError(BlobError, AuthError):
    """The object store rejected the credentials or denied access."""


class ClockProbeLost(BlobError):
    """A probe written to read the blob store's clock was gone before it could be read:
    this process paused longer than the orphan age and a GC swept it. Probe again."""


class BlobLocationNotFound(BlobError, LocationNotFound):
    """The bucket or directory of a blob URI does not exist."""


class Indeterminate(BackendError):
    """An operation could not be confirmed as applied or not after retries ran out."""


class DiffOverflow(PersistError, ArithmeticError):
    """Diffs of equal ``(k, v, t)`` sum beyond a signed 64-bit count.

    Diffs never wrap: a write whose own sums leave 64 bits is refused (as
    :class:`InvalidUpdates`); a read, listen or merge that meets such a sum, from
    individually valid writes, raises this instead of returning a wrong count. Writing
    a compensating update at a later time makes reads at and after it exact again, and
    lets compaction proceed once since passes it.

    Attributes:
        key, val, time: the update whose sum overflowed.
        total: its exact sum.
    """

    def __init__(self, key: bytes, val: bytes, time: int, total: int,
                 shard: str | None = None) -> None:
        self.key, self.val, self.time, self.total, self.shard = key, val, time, total, shard
        where = f"shard {shard}: " if shard else ""
        super().__init__(f"{where}{self.what}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields (see UpperMismatch.__reduce__).
        return (type(self), (self.key, self.val, self.time, self.total, self.shard),
                self.__dict__)

    @property
    def what(self) -> str:
        return (f"diffs of key {self.key[:32]!r} value {self.val[:32]!r} at time "
                f"{self.time} sum to {self.total}, beyond 64 bits (a diff is a signed 64-bit "
                f"count)")

    def in_shard(self, shard: str) -> DiffOverflow:
        """The same error, naming the shard it was met in."""
        return DiffOverflow(self.key, self.val, self.time, self.total, shard)


class UnsettledCommit(Indeterminate):
    """A commit whose reply was lost could not be settled: the record that would tell
    was truncated by GC, and no state or kept history names what it wrote.

    Attributes:
        batch_id: the batch a write tried to commit (None for other commits).
    """

    batch_id: str | None = None


class ResourceExhausted(PersistError, MemoryError):
    """The process ran out of memory (or another local resource) handling data that is
    itself fine: not corruption. Lower the batch or part size, or give it more memory."""


class CommitDeadlineExceeded(PersistError):
    """A write's blob parts are too old to commit safely (GC may already consider them
    orphans); nothing was committed and the caller may retry the write."""
