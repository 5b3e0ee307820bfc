from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Frontier(_message.Message):
    __slots__ = ("time",)
    TIME_FIELD_NUMBER: _ClassVar[int]
    time: int
    def __init__(self, time: _Optional[int] = ...) -> None: ...

class Description(_message.Message):
    __slots__ = ("lower", "upper", "since")
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    lower: Frontier
    upper: Frontier
    since: Frontier
    def __init__(self, lower: _Optional[_Union[Frontier, _Mapping]] = ..., upper: _Optional[_Union[Frontier, _Mapping]] = ..., since: _Optional[_Union[Frontier, _Mapping]] = ...) -> None: ...

class InlineUpdates(_message.Message):
    __slots__ = ("keys", "vals", "times", "diffs")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    DIFFS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    vals: _containers.RepeatedScalarFieldContainer[bytes]
    times: _containers.RepeatedScalarFieldContainer[int]
    diffs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., vals: _Optional[_Iterable[bytes]] = ..., times: _Optional[_Iterable[int]] = ..., diffs: _Optional[_Iterable[int]] = ...) -> None: ...

class HollowPart(_message.Message):
    __slots__ = ("key", "store", "encoded_size", "num_updates", "min_time", "max_time", "min_key", "max_key", "crc32", "footer_crc32")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    ENCODED_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_UPDATES_FIELD_NUMBER: _ClassVar[int]
    MIN_TIME_FIELD_NUMBER: _ClassVar[int]
    MAX_TIME_FIELD_NUMBER: _ClassVar[int]
    MIN_KEY_FIELD_NUMBER: _ClassVar[int]
    MAX_KEY_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    FOOTER_CRC32_FIELD_NUMBER: _ClassVar[int]
    key: str
    store: str
    encoded_size: int
    num_updates: int
    min_time: int
    max_time: int
    min_key: bytes
    max_key: bytes
    crc32: int
    footer_crc32: int
    def __init__(self, key: _Optional[str] = ..., store: _Optional[str] = ..., encoded_size: _Optional[int] = ..., num_updates: _Optional[int] = ..., min_time: _Optional[int] = ..., max_time: _Optional[int] = ..., min_key: _Optional[bytes] = ..., max_key: _Optional[bytes] = ..., crc32: _Optional[int] = ..., footer_crc32: _Optional[int] = ...) -> None: ...

class InlinePart(_message.Message):
    __slots__ = ("part_id", "updates", "num_updates")
    PART_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    NUM_UPDATES_FIELD_NUMBER: _ClassVar[int]
    part_id: str
    updates: bytes
    num_updates: int
    def __init__(self, part_id: _Optional[str] = ..., updates: _Optional[bytes] = ..., num_updates: _Optional[int] = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("hollow", "inline")
    HOLLOW_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    hollow: HollowPart
    inline: InlinePart
    def __init__(self, hollow: _Optional[_Union[HollowPart, _Mapping]] = ..., inline: _Optional[_Union[InlinePart, _Mapping]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "desc", "parts", "num_updates")
    ID_FIELD_NUMBER: _ClassVar[int]
    DESC_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NUM_UPDATES_FIELD_NUMBER: _ClassVar[int]
    id: str
    desc: Description
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    num_updates: int
    def __init__(self, id: _Optional[str] = ..., desc: _Optional[_Union[Description, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ..., num_updates: _Optional[int] = ...) -> None: ...

class SpineEntry(_message.Message):
    __slots__ = ("lower", "upper", "level", "num_batches", "num_inline_parts", "num_wal_parts")
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_INLINE_PARTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAL_PARTS_FIELD_NUMBER: _ClassVar[int]
    lower: int
    upper: Frontier
    level: int
    num_batches: int
    num_inline_parts: int
    num_wal_parts: int
    def __init__(self, lower: _Optional[int] = ..., upper: _Optional[_Union[Frontier, _Mapping]] = ..., level: _Optional[int] = ..., num_batches: _Optional[int] = ..., num_inline_parts: _Optional[int] = ..., num_wal_parts: _Optional[int] = ...) -> None: ...

class LeasedReader(_message.Message):
    __slots__ = ("id", "since", "seqno", "last_heartbeat_ms", "lease_duration_ms", "debug")
    ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    SEQNO_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    DEBUG_FIELD_NUMBER: _ClassVar[int]
    id: str
    since: Frontier
    seqno: int
    last_heartbeat_ms: int
    lease_duration_ms: int
    debug: str
    def __init__(self, id: _Optional[str] = ..., since: _Optional[_Union[Frontier, _Mapping]] = ..., seqno: _Optional[int] = ..., last_heartbeat_ms: _Optional[int] = ..., lease_duration_ms: _Optional[int] = ..., debug: _Optional[str] = ...) -> None: ...

class CriticalReader(_message.Message):
    __slots__ = ("id", "since", "opaque", "debug")
    ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_FIELD_NUMBER: _ClassVar[int]
    DEBUG_FIELD_NUMBER: _ClassVar[int]
    id: str
    since: Frontier
    opaque: bytes
    debug: str
    def __init__(self, id: _Optional[str] = ..., since: _Optional[_Union[Frontier, _Mapping]] = ..., opaque: _Optional[bytes] = ..., debug: _Optional[str] = ...) -> None: ...

class Writer(_message.Message):
    __slots__ = ("id", "last_heartbeat_ms", "lease_duration_ms", "most_recent_write_token", "most_recent_write_upper", "debug", "most_recent_write_lower")
    ID_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    MOST_RECENT_WRITE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MOST_RECENT_WRITE_UPPER_FIELD_NUMBER: _ClassVar[int]
    DEBUG_FIELD_NUMBER: _ClassVar[int]
    MOST_RECENT_WRITE_LOWER_FIELD_NUMBER: _ClassVar[int]
    id: str
    last_heartbeat_ms: int
    lease_duration_ms: int
    most_recent_write_token: str
    most_recent_write_upper: Frontier
    debug: str
    most_recent_write_lower: int
    def __init__(self, id: _Optional[str] = ..., last_heartbeat_ms: _Optional[int] = ..., lease_duration_ms: _Optional[int] = ..., most_recent_write_token: _Optional[str] = ..., most_recent_write_upper: _Optional[_Union[Frontier, _Mapping]] = ..., debug: _Optional[str] = ..., most_recent_write_lower: _Optional[int] = ...) -> None: ...

class Rollup(_message.Message):
    __slots__ = ("seqno", "key", "encoded_size", "crc32")
    SEQNO_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ENCODED_SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    seqno: int
    key: str
    encoded_size: int
    crc32: int
    def __init__(self, seqno: _Optional[int] = ..., key: _Optional[str] = ..., encoded_size: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class Scalars(_message.Message):
    __slots__ = ("walltime_ms", "upper", "since", "inline_bytes", "created_ms", "inline_fallbacks", "orphan_sweep_ms", "orphan_min_age_ms", "inline_max_bytes")
    WALLTIME_MS_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    INLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    INLINE_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    ORPHAN_SWEEP_MS_FIELD_NUMBER: _ClassVar[int]
    ORPHAN_MIN_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    walltime_ms: int
    upper: Frontier
    since: Frontier
    inline_bytes: int
    created_ms: int
    inline_fallbacks: int
    orphan_sweep_ms: int
    orphan_min_age_ms: int
    inline_max_bytes: int
    def __init__(self, walltime_ms: _Optional[int] = ..., upper: _Optional[_Union[Frontier, _Mapping]] = ..., since: _Optional[_Union[Frontier, _Mapping]] = ..., inline_bytes: _Optional[int] = ..., created_ms: _Optional[int] = ..., inline_fallbacks: _Optional[int] = ..., orphan_sweep_ms: _Optional[int] = ..., orphan_min_age_ms: _Optional[int] = ..., inline_max_bytes: _Optional[int] = ...) -> None: ...

class State(_message.Message):
    __slots__ = ("format_version", "shard_id", "seqno", "scalars", "batches", "spine", "leased_readers", "critical_readers", "writers", "rollups", "schema")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    SEQNO_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SPINE_FIELD_NUMBER: _ClassVar[int]
    LEASED_READERS_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_READERS_FIELD_NUMBER: _ClassVar[int]
    WRITERS_FIELD_NUMBER: _ClassVar[int]
    ROLLUPS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    shard_id: str
    seqno: int
    scalars: Scalars
    batches: _containers.RepeatedCompositeFieldContainer[Batch]
    spine: _containers.RepeatedCompositeFieldContainer[SpineEntry]
    leased_readers: _containers.RepeatedCompositeFieldContainer[LeasedReader]
    critical_readers: _containers.RepeatedCompositeFieldContainer[CriticalReader]
    writers: _containers.RepeatedCompositeFieldContainer[Writer]
    rollups: _containers.RepeatedCompositeFieldContainer[Rollup]
    schema: bytes
    def __init__(self, format_version: _Optional[int] = ..., shard_id: _Optional[str] = ..., seqno: _Optional[int] = ..., scalars: _Optional[_Union[Scalars, _Mapping]] = ..., batches: _Optional[_Iterable[_Union[Batch, _Mapping]]] = ..., spine: _Optional[_Iterable[_Union[SpineEntry, _Mapping]]] = ..., leased_readers: _Optional[_Iterable[_Union[LeasedReader, _Mapping]]] = ..., critical_readers: _Optional[_Iterable[_Union[CriticalReader, _Mapping]]] = ..., writers: _Optional[_Iterable[_Union[Writer, _Mapping]]] = ..., rollups: _Optional[_Iterable[_Union[Rollup, _Mapping]]] = ..., schema: _Optional[bytes] = ...) -> None: ...

class StateDiff(_message.Message):
    __slots__ = ("format_version", "shard_id", "seqno", "scalars", "batch_upserts", "batch_deletes", "spine_upserts", "spine_deletes", "reader_upserts", "reader_deletes", "critical_upserts", "critical_deletes", "writer_upserts", "writer_deletes", "rollup_upserts", "rollup_deletes", "schema")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    SEQNO_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    BATCH_UPSERTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_DELETES_FIELD_NUMBER: _ClassVar[int]
    SPINE_UPSERTS_FIELD_NUMBER: _ClassVar[int]
    SPINE_DELETES_FIELD_NUMBER: _ClassVar[int]
    READER_UPSERTS_FIELD_NUMBER: _ClassVar[int]
    READER_DELETES_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_UPSERTS_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_DELETES_FIELD_NUMBER: _ClassVar[int]
    WRITER_UPSERTS_FIELD_NUMBER: _ClassVar[int]
    WRITER_DELETES_FIELD_NUMBER: _ClassVar[int]
    ROLLUP_UPSERTS_FIELD_NUMBER: _ClassVar[int]
    ROLLUP_DELETES_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    shard_id: str
    seqno: int
    scalars: Scalars
    batch_upserts: _containers.RepeatedCompositeFieldContainer[Batch]
    batch_deletes: _containers.RepeatedScalarFieldContainer[str]
    spine_upserts: _containers.RepeatedCompositeFieldContainer[SpineEntry]
    spine_deletes: _containers.RepeatedScalarFieldContainer[int]
    reader_upserts: _containers.RepeatedCompositeFieldContainer[LeasedReader]
    reader_deletes: _containers.RepeatedScalarFieldContainer[str]
    critical_upserts: _containers.RepeatedCompositeFieldContainer[CriticalReader]
    critical_deletes: _containers.RepeatedScalarFieldContainer[str]
    writer_upserts: _containers.RepeatedCompositeFieldContainer[Writer]
    writer_deletes: _containers.RepeatedScalarFieldContainer[str]
    rollup_upserts: _containers.RepeatedCompositeFieldContainer[Rollup]
    rollup_deletes: _containers.RepeatedScalarFieldContainer[int]
    schema: bytes
    def __init__(self, format_version: _Optional[int] = ..., shard_id: _Optional[str] = ..., seqno: _Optional[int] = ..., scalars: _Optional[_Union[Scalars, _Mapping]] = ..., batch_upserts: _Optional[_Iterable[_Union[Batch, _Mapping]]] = ..., batch_deletes: _Optional[_Iterable[str]] = ..., spine_upserts: _Optional[_Iterable[_Union[SpineEntry, _Mapping]]] = ..., spine_deletes: _Optional[_Iterable[int]] = ..., reader_upserts: _Optional[_Iterable[_Union[LeasedReader, _Mapping]]] = ..., reader_deletes: _Optional[_Iterable[str]] = ..., critical_upserts: _Optional[_Iterable[_Union[CriticalReader, _Mapping]]] = ..., critical_deletes: _Optional[_Iterable[str]] = ..., writer_upserts: _Optional[_Iterable[_Union[Writer, _Mapping]]] = ..., writer_deletes: _Optional[_Iterable[str]] = ..., rollup_upserts: _Optional[_Iterable[_Union[Rollup, _Mapping]]] = ..., rollup_deletes: _Optional[_Iterable[int]] = ..., schema: _Optional[bytes] = ...) -> None: ...

class ShardSummary(_message.Message):
    __slots__ = ("upper", "since", "inline_bytes", "num_batches", "num_inline_parts", "pending_merges", "walltime_ms", "latest_rollup_seqno", "inline_fallbacks", "latest_rollup_key", "inline_max_bytes", "latest_rollup_crc32")
    UPPER_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    INLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_INLINE_PARTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_MERGES_FIELD_NUMBER: _ClassVar[int]
    WALLTIME_MS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ROLLUP_SEQNO_FIELD_NUMBER: _ClassVar[int]
    INLINE_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ROLLUP_KEY_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    LATEST_ROLLUP_CRC32_FIELD_NUMBER: _ClassVar[int]
    upper: Frontier
    since: Frontier
    inline_bytes: int
    num_batches: int
    num_inline_parts: int
    pending_merges: int
    walltime_ms: int
    latest_rollup_seqno: int
    inline_fallbacks: int
    latest_rollup_key: str
    inline_max_bytes: int
    latest_rollup_crc32: int
    def __init__(self, upper: _Optional[_Union[Frontier, _Mapping]] = ..., since: _Optional[_Union[Frontier, _Mapping]] = ..., inline_bytes: _Optional[int] = ..., num_batches: _Optional[int] = ..., num_inline_parts: _Optional[int] = ..., pending_merges: _Optional[int] = ..., walltime_ms: _Optional[int] = ..., latest_rollup_seqno: _Optional[int] = ..., inline_fallbacks: _Optional[int] = ..., latest_rollup_key: _Optional[str] = ..., inline_max_bytes: _Optional[int] = ..., latest_rollup_crc32: _Optional[int] = ...) -> None: ...
