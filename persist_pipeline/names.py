"""Named shards: a registry of immutable ``name -> shard id`` records in consensus.

Each name is one consensus record under the key ``n:<name>`` (never a shard id: those
start with ``s``), at seqno 1 only, whose ``data`` and ``summary`` both hold the shard id,
so ``list_heads`` returns the whole registry in one query. A name is registered by a
compare-and-set expecting no record: of concurrent creators exactly one wins, and every
caller returns the id that was *recorded*, never one it merely proposed. Names are never
changed or deleted, so a looked-up id may be cached for good.

A lost compare-and-set reply (:class:`~persist_pipeline.exceptions.ConsensusUnavailable`:
the record may or may not have been written) is settled by reading the record: if one
exists its id is the answer (ours or a concurrent creator's, both correct); if none does,
the attempt did not land and the compare-and-set is tried again until the retry deadline.
"""

from __future__ import annotations

import re
import threading

from persist_pipeline.consensus.base import Consensus, VersionedData
from persist_pipeline.exceptions import (
    CorruptState,
    InvalidShardId,
    InvalidShardName,
    ShardNameNotFound,
    Unavailable,
)
from persist_pipeline.ids import ShardId
from persist_pipeline.internal.clock import SYSTEM_CLOCK, Clock
from persist_pipeline.retry import Backoff

#: Consensus keys of name records start with this (shard ids start with ``s``).
KEY_PREFIX = "n:"

#: The longest name accepted.
MAX_NAME_LENGTH = 200

_NAME = re.compile(r"[A-Za-z0-9._/-]+")
#: Anything shaped like a shard id, in any case (``S<UUID>`` would confuse a reader).
_ID_LIKE = re.compile(r"[sS][0-9A-Fa-f-]{36}")


def check_name(name: object) -> str:
    """Returns ``name`` if it is a valid shard name.

    A name is 1 to 200 characters of ``A-Z a-z 0-9 . _ / -`` (so no whitespace) and is not
    shaped like a shard id (``s`` followed by 36 hex digits and dashes, in any case).

    Raises:
        InvalidShardName: otherwise.
    """
    if not isinstance(name, str):
        raise InvalidShardName(f"a shard name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidShardName("a shard name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidShardName(f"a shard name is at most {MAX_NAME_LENGTH} characters, got "
                               f"{len(name)}: {name[:40]!r}...")
    if not _NAME.fullmatch(name):
        raise InvalidShardName(f"invalid shard name {name[:80]!r}: use letters, digits and "
                               "the characters . _ / - only (no spaces)")
    if _ID_LIKE.fullmatch(name):
        raise InvalidShardName(f"invalid shard name {name!r}: it looks like a shard id; "
                               "a name must not")
    return name


#: A last segment ``_v<N>`` (``N`` > 1, written without leading zeros) names generation
#: ``N`` of the table stored under the rest of the name (its schema after a change).
_GENERATION = re.compile(r"(.+)/_v([1-9][0-9]*)")


#: The last segment of a partitioned table's folder of partitions
#: (``sales/orders/_partitions/<key>``, :func:`persist_pipeline.tables.asset_shard_name`).
PARTITIONS_FOLDER = "_partitions"


def is_partitions_folder(base: str) -> bool:
    """Whether ``base`` is a folder of partitions: each ``base/<key>`` is a partition's
    table, so ``base/_v<N>`` is the partition ``_v<N>``, not a generation of a table at
    ``base`` (none is stored there: :func:`persist_pipeline.tables.check_table_name`).
    ``sales/_partitions/_partitions`` is no folder but the partition ``_partitions``."""
    segments = base.split("/")
    return segments[-1] == PARTITIONS_FOLDER and segments[-2:-1] != [PARTITIONS_FOLDER]


def generation_of(name: str) -> tuple[str, int] | None:
    """``(base, N)`` when ``name`` is generation ``N`` > 1 of table ``base``, else None."""
    match = _GENERATION.fullmatch(name)
    if match is None or int(match.group(2)) < 2 or is_partitions_folder(match.group(1)):
        return None
    return match.group(1), int(match.group(2))


def refuse_new_generation_name(registry: NameRegistry, name: str) -> None:
    """Refuse to register ``name`` anew outside a table store if it is shaped like a
    table's generation (``base/_v<N>``, N >= 1 without leading zeros): a load of the table
    would read whatever it names as one of its versions. A generation name already
    registered (by a table store) passes; other names cost no lookup.

    Raises:
        InvalidShardName: ``name`` is a generation name not registered yet (nothing is
            written).
    """
    # _v1 too: table loads read ``base/_v1`` as the first generation (``base`` itself).
    match = _GENERATION.fullmatch(name) if isinstance(name, str) else None
    if match is None or registry.lookup(name) is not None:
        return
    base, n = match.group(1), match.group(2)
    raise InvalidShardName(
        f"{name!r}: a last segment _v{n} names generation {n} of the table {base!r}, "
        "which only that table's stores create (PersistIOManager, store_table); once "
        "one has, its name reads and writes the generation")


def registry_key(name: str) -> str:
    """The consensus key of ``name``'s record (``name`` must be valid)."""
    return KEY_PREFIX + name


def is_registry_key(key: str) -> bool:
    """True if ``key`` (from ``list_shards`` / ``list_heads``) is a name record."""
    return key.startswith(KEY_PREFIX)


def _decode(key: str, payload: bytes) -> ShardId:
    try:
        return ShardId.parse(payload.decode("ascii"))
    except (UnicodeDecodeError, InvalidShardId):
        raise CorruptState(f"name record {key!r} does not hold a shard id: "
                           f"{payload[:60]!r}") from None


def name_record(name: str, shard: ShardId) -> tuple[str, VersionedData]:
    """The consensus key of ``name`` and the one record registering it for ``shard``
    (its first and only record: names never change). What every registration writes,
    alone (:meth:`NameRegistry.register`) or in a transaction's commit."""
    payload = str(shard).encode("ascii")
    return registry_key(name), VersionedData(1, payload, payload)


class NameRegistry:
    """The name registry of one consensus store. Thread-safe.

    Args:
        consensus: the store (reads should retry transient errors themselves, as a
            :class:`~persist_pipeline.consensus.retry.RetryingConsensus` does).
        deadline_s: how long a lost or failed registration is retried.
        clock: the clock the retries sleep on.
    """

    def __init__(self, consensus: Consensus, deadline_s: float,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.consensus = consensus
        self.deadline_s = deadline_s
        self.clock = clock
        self._known: dict[str, ShardId] = {}  # names never change: a safe cache
        self._lock = threading.Lock()

    def lookup(self, name: str) -> ShardId | None:
        """The id registered under ``name``, or None.

        Raises:
            InvalidShardName: ``name`` is malformed.
        """
        check_name(name)
        with self._lock:
            known = self._known.get(name)
        if known is not None:
            return known
        key = registry_key(name)
        record = self.consensus.head(key)
        return None if record is None else self._remember(name, _decode(key, record.data))

    def resolve(self, name: str, create: bool = False) -> ShardId:
        """The id registered under ``name``, registering a fresh one if ``create``.

        Raises:
            InvalidShardName: ``name`` is malformed (nothing is written).
            ShardNameNotFound: no such name and ``create`` is False.
            Indeterminate: consensus stayed unavailable past the retry deadline.
        """
        found = self.lookup(name)
        if found is not None:
            return found
        if not create:
            raise ShardNameNotFound(f"no shard named {name!r}; create it with "
                                    f"resolve({name!r}, create=True)")
        return self.register(name, ShardId.new())

    def register(self, name: str, shard: ShardId | str) -> ShardId:
        """Registers ``name`` for ``shard`` unless the name exists; returns the id
        recorded under ``name``, which differs from ``shard`` if someone registered the
        name first. Idempotent.

        Raises:
            InvalidShardName / InvalidShardId: bad arguments (nothing is written).
            Indeterminate: consensus stayed unavailable past the retry deadline.
        """
        check_name(name)
        proposed = ShardId.parse(shard)
        key, record = name_record(name, proposed)
        backoff = Backoff(self.deadline_s, f"registering shard name {name!r}", self.clock)
        while True:
            try:
                existing = self.lookup(name)
                if existing is not None:
                    return existing
                if self.consensus.compare_and_set(key, None, record):
                    return self._remember(name, proposed)
                # Refused: someone registered the name first. Records of names are never
                # deleted, so it is there to read.
                existing = self.lookup(name)
                if existing is not None:
                    return existing
                error: Exception = CorruptState(
                    f"name record {key!r} refused a first record but none is there")
            except Unavailable as e:
                # A failed read, or a lost compare-and-set reply: the record may have been
                # written (by us or by a concurrent creator). The next lookup decides; if
                # nothing is there, the attempt did not land and is tried again.
                error = e
            backoff.wait(error)

    def names(self) -> dict[str, ShardId]:
        """Every registered name and its id, in one consensus query, sorted by name."""
        out: dict[str, ShardId] = {}
        for key, head in sorted(self.consensus.list_heads().items()):
            if is_registry_key(key):
                out[key[len(KEY_PREFIX):]] = self._remember(key[len(KEY_PREFIX):],
                                                            _decode(key, head.summary))
        return out

    def _remember(self, name: str, shard: ShardId) -> ShardId:
        with self._lock:
            return self._known.setdefault(name, shard)
