"""The pipeline config file (``pipeline.yaml``): shards, their sources, and the knobs.

The file is found at ``$PERSIST_PIPELINE_CONFIG``, else ``pipeline.yaml`` at the repository
root. Relative paths in it are relative to the file. Strings may use ``${VAR}`` and
``${VAR:-default}`` (environment) and ``{data_dir}``. The persist location, the alert
webhook and S3 landing URIs keep their ``${...}`` templates until run time (they may hold
secrets, see :mod:`resources.env`); everything else is expanded when the file is loaded.

The file's shape is a set of pydantic models (:class:`PipelineFile` and its sections):
each key, its type, bounds and default are written once, there. Loading validates the
file against them without opening any database; the only store ever read is the name
registry, and only when a ``shard_id`` is a registered name (below).

A shard's ``shard_id`` may be a shard id or a name registered in the location's name
registry (``PersistClient.resolve``): names are looked up when the file is loaded (one
consensus query, only if the file uses any), so the name must be registered by then.
When the pipeline writes to a shard it registers the shard's config name for its id
(:func:`register_shard_name`), failing if the name belongs to another shard.

Every error names the file and the offending key.
"""

from __future__ import annotations

import os
import re
import zoneinfo
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from persist_pipeline import PersistClient, ShardId
from persist_pipeline.blob import check_blob_uri
from persist_pipeline.config import (
    INLINE_UPDATE_MAX_BYTES,
    INLINE_UPDATE_THRESHOLD_BYTES,
)
from persist_pipeline.consensus import check_consensus_uri
from persist_pipeline.exceptions import (
    InvalidConfig,
    InvalidShardId,
    InvalidShardName,
    InvalidUri,
    PersistError,
)
from persist_pipeline.ingest import FORMATS
from persist_pipeline.names import check_name
from resources.env import expand_env

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "pipeline.yaml"
CONFIG_ENV = "PERSIST_PIPELINE_CONFIG"

#: libyaml's safe loader when present (10x faster on a 1,000-shard file), else PyYAML's.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
TimesMode = Literal["ingest", "source"]
FileFormat = Literal["csv", "jsonl", "parquet"]
assert set(FORMATS.values()) == set(FileFormat.__args__)  # type: ignore[attr-defined]

#: Reads the registered shard names of a location: ``{name: shard id}``.
NameSource = Callable[[], Mapping[str, ShardId | str]]


# --- value types: how a key's text is expanded before it is validated -------------------


class _LoadContext:
    """What validators need besides the value: the environment, the data folder and the
    file (relative paths are relative to it)."""

    def __init__(self, env: Mapping[str, str], data_dir: Path, file: Path) -> None:
        self.env = env
        self.data_dir = data_dir
        self.file = file


def _context(info: ValidationInfo) -> _LoadContext | None:
    ctx = info.context
    return ctx if isinstance(ctx, _LoadContext) else None


def _text(value: Any) -> str:
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    return str(value)


def _optional_text(value: Any) -> str:
    return "" if value is None else _text(value)


def _expanded(value: Any, info: ValidationInfo) -> str:
    """``{data_dir}`` and ``${...}`` expanded now (models built in code take values as-is)."""
    ctx = _context(info)
    text = _text(value)
    if ctx is None:
        return text
    text = text.replace("{data_dir}", str(ctx.data_dir))
    try:
        return expand_env(text, ctx.env)
    except InvalidConfig as e:
        raise ValueError(str(e).split(": ", 1)[-1]) from None


def _kept_for_run_time(value: Any, info: ValidationInfo) -> str:
    """``{data_dir}`` expanded, ``${...}`` kept: the value may hold a secret, so the
    definitions (and the UI) show the template and it is expanded when used."""
    ctx = _context(info)
    text = _text(value)
    return text if ctx is None else text.replace("{data_dir}", str(ctx.data_dir))


def _integer(value: Any, info: ValidationInfo) -> Any:
    if isinstance(value, str):
        text = _expanded(value, info)
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"must be an integer, got {text!r}") from None
    return value


def _cron(value: str) -> str:
    if len(value.split()) != 5:
        raise ValueError(f"must be a 5-field cron expression, got {value!r}")
    # Dagster's own check, so a schedule it would refuse when building the definitions
    # (a minute 99, February 30) is refused here, naming the key.
    from dagster._utils.schedules import is_valid_cron_string

    if not is_valid_cron_string(value):
        raise ValueError(f"not a cron expression Dagster can run, got {value!r}")
    return value


def _timezone(value: str) -> str:
    """An IANA time zone name, loaded as Dagster loads a schedule's (``zoneinfo``)."""
    if value in ("UTC", "utc"):
        return value
    try:
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(f"not a time zone (an IANA name such as Europe/Paris or UTC), "
                         f"got {value[:80]!r}") from None
    return value


def _literal_uri(check: Callable[[str], None]) -> Callable[[str], str]:
    """A location URI written without ``${...}`` is checked when the file loads (as the
    client would check it when a run opens it); a template is checked when expanded, at
    run time (it may hold a secret). Empty means the client's PERSIST_* variable."""

    def validate(value: str) -> str:
        if value.strip() and "${" not in value and "{data_dir}" not in value:
            try:
                check(value.strip())
            except InvalidUri as e:
                raise ValueError(str(e)) from None
        return value

    return validate


Expanded = Annotated[str, BeforeValidator(_expanded)]
RunTime = Annotated[str, BeforeValidator(_kept_for_run_time)]
Cron = Annotated[str, BeforeValidator(_expanded), AfterValidator(_cron)]
Count = Annotated[StrictInt, BeforeValidator(_integer), Field(ge=0)]
Positive = Annotated[StrictInt, BeforeValidator(_integer), Field(ge=1)]


class _Section(BaseModel):
    """A mapping of the file: unknown keys are errors; values never change after load.

    Defaults are validated too, so a default's ``${VAR:-...}`` is expanded like a value's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    #: Fields set by the loader, not keys a user writes.
    _internal: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, raw: Any) -> Any:
        if isinstance(raw, Mapping):
            unknown = sorted(str(k) for k in raw if k not in cls.model_fields)
            if unknown:
                allowed = sorted(set(cls.model_fields) - cls._internal)
                raise ValueError(f"unknown key(s) {', '.join(unknown)}; allowed: "
                                 f"{', '.join(allowed)}")
        return raw


def _formats(value: Any) -> Any:
    known = sorted(set(FORMATS.values()))
    if not isinstance(value, list | tuple) or not value or any(f not in known for f in value):
        raise ValueError(f"must be a list of {', '.join(known)}, got {value!r}")
    return tuple(value)


def _required_uri(value: str) -> str:
    if not value.strip():
        raise ValueError("is required (a folder or s3://bucket/prefix)")
    return value


def _route_column(value: str) -> str:
    if value in ("k", "v", "t", "d") or not value:
        raise ValueError(f"must name a column besides k, v, t and d, got {value!r}")
    return value


def _shard_entries(value: Any) -> Any:
    if not isinstance(value, Mapping) or not value:
        raise ValueError("must map at least one shard name to its settings")
    return value


# --- the sections ------------------------------------------------------------------------


class FileSource(_Section):
    """Files landing in a local folder or under an S3 prefix.

    Attributes:
        uri: a folder, or ``s3://bucket/prefix?...``; may be a ``${VAR}`` template,
            expanded when used (a relative folder is relative to ``base_dir``).
        formats: the file formats accepted (extensions of :data:`FORMATS`).
        times: ``ingest``: every row of a file is written at one new time (the shard's
            upper); ``source``: the file's ``t`` values are kept (all must be at or
            beyond the shard's upper) and the upper advances past the largest.
        sensor_interval_s: how often the landing sensor lists the location.
        base_dir: the folder a relative ``uri`` is relative to (the config file's; not a
            key of the file).
    """

    kind: Literal["files"] = "files"
    uri: Annotated[str, AfterValidator(_required_uri)] = ""
    formats: Annotated[tuple[FileFormat, ...], BeforeValidator(_formats)] = (
        "csv", "jsonl", "parquet")
    times: TimesMode = "ingest"
    sensor_interval_s: Positive = 30
    base_dir: str = "."

    _internal: ClassVar[frozenset[str]] = frozenset({"base_dir"})

    @model_validator(mode="before")
    @classmethod
    def _from_file(cls, raw: Any, info: ValidationInfo) -> Any:
        ctx = _context(info)
        if ctx is None or not isinstance(raw, Mapping):
            return raw
        if "base_dir" in raw:
            raise ValueError("unknown key base_dir (a relative uri is relative to the "
                             "config file)")
        out = {**raw, "base_dir": str(ctx.file.parent)}
        if "uri" in raw:
            text = _kept_for_run_time(raw["uri"], info)
            if not (text.lower().startswith("s3://") or "${" in text):
                # A folder: resolved now, so the definitions show where files land.
                path = Path(_expanded(text, info)).expanduser()
                text = str(path if path.is_absolute() else (ctx.file.parent / path).resolve())
            out["uri"] = text
        return out

    def location(self) -> str:
        """The expanded location: an S3 URI (may hold secrets) or an absolute folder."""
        uri = expand_env(self.uri, what="landing uri").strip()
        if uri.lower().startswith("s3://"):
            return uri
        path = Path(uri).expanduser()
        return str(path if path.is_absolute() else (Path(self.base_dir) / path).resolve())

    @property
    def is_s3(self) -> bool:
        return self.location().lower().startswith("s3://")


class SyntheticSource(_Section):
    """The built-in change stream (inserts, updates and deletes as +1/-1 diffs).

    Attributes:
        keys: size of the key space.
        events_per_write: changes per write (one write per materialization).
        seed: makes the stream reproducible.
        value_bytes: approximate size of a value.
    """

    kind: Literal["synthetic"] = "synthetic"
    keys: Positive = 200
    events_per_write: Positive = 25
    seed: Count = 0
    value_bytes: Annotated[StrictInt, BeforeValidator(_integer), Field(ge=8)] = 24


class RoutedSource(_Section):
    """Rows of a route's landed files: those whose route column holds ``value``.

    Attributes:
        route: the route's name (a key of ``routes:``).
        value: the route column's value that selects this shard's rows; empty: the
            shard's name.
    """

    kind: Literal["routed"] = "routed"
    route: str
    value: Annotated[str, BeforeValidator(_optional_text)] = ""


Source = Annotated[FileSource | SyntheticSource | RoutedSource, Field(discriminator="kind")]
_SOURCE_KINDS = ("files", "synthetic", "routed")


class ShardSpec(_Section):
    """One shard's entry under ``shards:`` (its name is the entry's key).

    Attributes:
        shard_id: a shard id, or a name registered in the location's name registry;
            empty: an id derived from the shard's name (:func:`shard_id_for`).
    """

    shard_id: Annotated[str, BeforeValidator(_optional_text)] = ""
    source: Source
    description: Annotated[str, BeforeValidator(_text)] = ""
    freshness_max_age_s: Positive = 3600


class ShardConfig(ShardSpec):
    """One shard, resolved: its name (asset keys use it), id and source.

    Attributes:
        shard_id: the shard's id.
        registered_name: the registered shard name the file gave as ``shard_id`` (which
            holds the id it was resolved to); empty when the file gave an id or none.
    """

    name: str
    registered_name: str = ""

    _internal: ClassVar[frozenset[str]] = frozenset({"name", "registered_name"})


class RouteSpec(_Section):
    """One entry under ``routes:``: a landing location whose files hold rows of several
    shards, each landed file committed to all of them in one transaction.

    Attributes:
        source: where the files land (as a ``files`` shard's source).
        column: the column naming each row's shard (its ``routed`` source's ``value``).
    """

    source: FileSource
    column: Annotated[str, AfterValidator(_route_column)] = "shard"
    description: Annotated[str, BeforeValidator(_text)] = ""


class RouteConfig(RouteSpec):
    """A route, resolved: its name and which shard each route-column value feeds.

    Attributes:
        targets: ``{value: shard name}``, in the order of ``shards:``.
    """

    name: str
    targets: Mapping[str, str]

    _internal: ClassVar[frozenset[str]] = frozenset({"name", "targets"})


class LocationConfig(_Section):
    """The persist location; each URI keeps its ``${...}`` until run time. The defaults
    read the PERSIST_* variables the client reads, also in a file without ``location:``.
    """

    consensus_uri: Annotated[RunTime, AfterValidator(_literal_uri(check_consensus_uri))] = \
        "${PERSIST_CONSENSUS_URI:-sqlite:///{data_dir}/consensus.db}"
    blob_uri: Annotated[RunTime, AfterValidator(_literal_uri(check_blob_uri))] = \
        "${PERSIST_BLOB_URI:-file://{data_dir}/blobs}"
    wal_blob_uri: Annotated[RunTime, BeforeValidator(_optional_text),
                            AfterValidator(_literal_uri(check_blob_uri))] = \
        "${PERSIST_WAL_BLOB_URI:-}"


class InlinePolicyConfig(_Section):
    """The inline-vs-blob decision (the ``inline_policy`` resource)."""

    persist_inline_update_threshold_bytes: Count = INLINE_UPDATE_THRESHOLD_BYTES
    persist_inline_update_max_bytes: Count = INLINE_UPDATE_MAX_BYTES


class SparkConfig(_Section):
    master: Expanded = "${SPARK_MASTER:-local[*]}"
    conf: Mapping[str, Expanded] = Field(default_factory=dict)


def _fraction(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a number in (0, 1], got {value!r}")
    return float(value)


class CompactionConfig(_Section):
    high_water_fraction: Annotated[StrictFloat, BeforeValidator(_fraction),
                                   Field(gt=0, le=1)] = 0.75
    sensor_interval_s: Positive = 30
    schedule: Cron = "0 * * * *"


class ScheduleConfig(_Section):
    schedule: Cron


class GcConfig(ScheduleConfig):
    schedule: Cron = "30 3 * * *"


class ChecksConfig(ScheduleConfig):
    schedule: Cron = "*/15 * * * *"


class AlertsConfig(_Section):
    webhook_url: Annotated[RunTime, BeforeValidator(_optional_text)] = \
        "${PERSIST_ALERT_WEBHOOK_URL:-}"
    sensor_interval_s: Positive = 60
    over_limit_for_s: Count = 900
    backlog_threshold: Count = 16


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _seconds(value: Any, info: ValidationInfo) -> Any:
    if isinstance(value, str):
        value = _expanded(value, info)
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a number of seconds, got {value!r}")
    return float(value)


class IngestionConfig(_Section):
    """Step retries of a landed file's run (:mod:`assets.retries`): a transient failure
    (a backend away for longer than the library's own retries, a commit whose outcome
    could not be confirmed, the upper kept moving) is retried; a bad file is not."""

    retries: Count = 3
    # The first retry waits retry_delay_s; exponential backoff makes it 1x, 3x, 7x...
    retry_delay_s: Annotated[StrictFloat, BeforeValidator(_seconds),
                             Field(ge=0, le=3600)] = 5.0
    retry_backoff: Annotated[Literal["exponential", "linear", "constant"],
                             BeforeValidator(_lower)] = "exponential"
    retry_jitter: Annotated[Literal["plus_minus", "full", "none"],
                            BeforeValidator(_lower)] = "plus_minus"


class AutomationConfig(_Section):
    default_status: Annotated[Literal["running", "stopped"], BeforeValidator(_lower)] = \
        "running"


def _shard_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError("a shard name must be lowercase letters, digits and _ (starting "
                         "with a letter)")
    return name


class PipelineFile(_Section):
    """The whole file, as written (before shard names are resolved)."""

    version: Literal[1] = 1
    # Read first by _data_dir: the others use it.
    data_dir: str = "${PERSIST_PIPELINE_DATA_DIR:-.persist/pipeline}"
    location: LocationConfig = LocationConfig()
    inline_policy: InlinePolicyConfig = InlinePolicyConfig()
    spark: SparkConfig = SparkConfig()
    compaction: CompactionConfig = CompactionConfig()
    gc: GcConfig = GcConfig()
    checks: ChecksConfig = ChecksConfig()
    alerts: AlertsConfig = AlertsConfig()
    ingestion: IngestionConfig = IngestionConfig()
    automation: AutomationConfig = AutomationConfig()
    timezone: Annotated[Expanded, AfterValidator(_timezone)] = "UTC"
    shards: Annotated[dict[Annotated[str, AfterValidator(_shard_name)], ShardSpec],
                      BeforeValidator(_shard_entries)]
    routes: dict[Annotated[str, AfterValidator(_shard_name)], RouteSpec] = Field(
        default_factory=dict)


class PipelineConfig(BaseModel):
    """The whole file, validated, with every shard's id resolved."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    path: Path
    data_dir: Path
    location: LocationConfig
    threshold_bytes: int
    max_bytes: int
    spark: SparkConfig
    compaction: CompactionConfig
    gc_schedule: str
    checks_schedule: str
    alerts: AlertsConfig
    ingestion: IngestionConfig = IngestionConfig()
    automation_running: bool
    shards: tuple[ShardConfig, ...]
    routes: tuple[RouteConfig, ...]
    timezone: str

    def shard(self, name: str) -> ShardConfig:
        for s in self.shards:
            if s.name == name:
                return s
        raise KeyError(name)

    def route(self, name: str) -> RouteConfig:
        for r in self.routes:
            if r.name == name:
                return r
        raise KeyError(name)


def is_landed(shard: ShardConfig) -> bool:
    """Whether ``shard`` is written from landed files (its own, or a route's): its
    ingestion asset is partitioned by landed file."""
    return isinstance(shard.source, FileSource | RoutedSource)


def shard_id_for(name: str) -> str:
    """The shard id a shard gets when the config names none: stable per name."""
    return str(ShardId.for_pipeline_name(name))


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(CONFIG_ENV) or DEFAULT_CONFIG).resolve()


def load_pipeline_config(path: Path | str | None = None,
                         env: Mapping[str, str] | None = None,
                         names: NameSource | None = None) -> PipelineConfig:
    """Read and validate the config file (default: :func:`config_path`).

    Args:
        path: the file.
        env: the environment for ``${VAR}`` (default ``os.environ``).
        names: reads the registered shard names, used only if a ``shard_id`` is a name
            (default: read them from the file's own consensus location).

    Raises:
        InvalidConfig: the file cannot be read or is not valid; the message names the
            file and the key.
    """
    env = os.environ if env is None else env
    file = Path(path).resolve() if path is not None else config_path(env)
    try:
        raw = yaml.load(file.read_text(encoding="utf-8"), Loader=_LOADER)  # noqa: S506
    except OSError as e:
        raise InvalidConfig(f"{file}: cannot read the pipeline config: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise InvalidConfig(f"{file}: not valid YAML: {e}") from None
    return parse_pipeline_config(raw, file, env, names)


def parse_pipeline_config(raw: Any, file: Path, env: Mapping[str, str],
                          names: NameSource | None = None) -> PipelineConfig:
    """Validate the parsed YAML ``raw`` of ``file`` (see :func:`load_pipeline_config`)."""
    if not isinstance(raw, Mapping):
        raise InvalidConfig(f"{file}: top level: must be a mapping")
    data_dir = _data_dir(raw, file, env)
    # A missing or empty section (`gc:` with nothing under it) means its defaults, which
    # are validated (and their templates expanded) like a value written in the file.
    raw = {**{k: {} for k in _SECTIONS}, **raw}
    raw = {k: ({} if v is None and k in _SECTIONS else v) for k, v in raw.items()}
    try:
        spec = PipelineFile.model_validate(raw, context=_LoadContext(env, data_dir, file))
    except ValidationError as e:
        raise InvalidConfig(f"{file}: {_describe(e)}") from None
    shards = tuple(_shard(file, name, s) for name, s in spec.shards.items())
    shards = _resolve_names(file, shards, spec.location, env, names)
    ids = [s.shard_id for s in shards]
    if len(set(ids)) != len(ids):
        raise InvalidConfig(f"{file}: shards: two shards have the same shard_id")
    routes = _routes(file, spec, shards)
    return PipelineConfig(
        path=file, data_dir=data_dir, location=spec.location,
        threshold_bytes=spec.inline_policy.persist_inline_update_threshold_bytes,
        max_bytes=spec.inline_policy.persist_inline_update_max_bytes,
        spark=spec.spark, compaction=spec.compaction, gc_schedule=spec.gc.schedule,
        checks_schedule=spec.checks.schedule, alerts=spec.alerts, ingestion=spec.ingestion,
        automation_running=spec.automation.default_status == "running", shards=shards,
        routes=routes, timezone=spec.timezone)


def register_shard_name(client: PersistClient, shard: ShardConfig) -> None:
    """Registers ``shard``'s config name for its id in the location's name registry.

    Idempotent (and cached per client: names never change).

    Raises:
        InvalidConfig: the name is registered for another shard.
    """
    recorded = client.register_name(shard.name, shard.shard_id)
    if str(recorded) != shard.shard_id:
        raise InvalidConfig(
            f"shards.{shard.name}: the shard name {shard.name!r} is registered for shard "
            f"{recorded}, but the pipeline config's shard_id is {shard.shard_id}; registered "
            "names never change, so give this shard that id or another name")


def _missing_sqlite_file(uri: str) -> bool:
    """Whether ``uri`` is a SQLite consensus URI whose database file does not exist."""
    if not uri.lower().startswith("sqlite://"):
        return False
    from persist_pipeline.consensus.sql import parse_uri

    _, url = parse_uri(uri)
    return url.database is not None and not Path(url.database).exists()


# --- loading -------------------------------------------------------------------------------

_SECTIONS = frozenset(name for name, f in PipelineFile.model_fields.items()
                      if isinstance(f.annotation, type) and issubclass(f.annotation, _Section))


def _data_dir(raw: Mapping[str, Any], file: Path, env: Mapping[str, str]) -> Path:
    """The ``data_dir`` (needed to expand ``{data_dir}`` everywhere else)."""
    value = raw.get("data_dir", PipelineFile.model_fields["data_dir"].default)
    try:
        text = _text(value)
        text = expand_env(text, env, what="data_dir")
    except (ValueError, InvalidConfig) as e:
        raise InvalidConfig(f"{file}: data_dir: {str(e).split(': ', 1)[-1]}") from None
    path = Path(text).expanduser()
    return (path if path.is_absolute() else file.parent / path).resolve()


def _describe(error: ValidationError) -> str:
    """The first error of ``error`` as ``key.path: message``."""
    first = error.errors(include_url=False)[0]
    # A source's errors are located under its kind's tag (`source.files.uri`): the file
    # has no such key, so the tag is dropped.
    parts = [str(p) for p in first["loc"] if p != "[key]"]
    loc = [p for i, p in enumerate(parts)
           if not (i and parts[i - 1] == "source" and p in _SOURCE_KINDS)]
    kind = first["type"]
    message = first["msg"]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        loc.append("kind")
        kinds = f"{', '.join(_SOURCE_KINDS[:-1])} or {_SOURCE_KINDS[-1]}"
        message = (f"must be {kinds}, got {first['input'].get('kind')!r}"
                   if isinstance(first["input"], Mapping) else "must be a mapping with a kind")
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        message = "must be a mapping"
    elif kind == "missing":
        message = ("must map at least one shard name to its settings" if loc == ["shards"]
                   else "is required")
    elif kind.startswith(("value_error", "assertion_error")):
        message = message.split(", ", 1)[-1]
    else:
        message = f"{message}, got {first['input']!r}"
    return f"{'.'.join(loc) or 'top level'}: {message}"


def _shard(file: Path, name: str, spec: ShardSpec) -> ShardConfig:
    """``spec`` with its id: given, derived from the name, or (if it is a registered
    name) left for :func:`_resolve_names`."""
    shard_id, registered_name = spec.shard_id or shard_id_for(name), ""
    try:
        shard_id = str(ShardId.parse(shard_id))
    except InvalidShardId as e:
        try:
            registered_name = check_name(shard_id)
        except InvalidShardName:
            raise InvalidConfig(f"{file}: shards.{name}.shard_id: {e} (nor is it a valid "
                                "shard name)") from None
        shard_id = ""
    return ShardConfig(name=name, shard_id=shard_id, source=spec.source,
                       description=spec.description,
                       freshness_max_age_s=spec.freshness_max_age_s,
                       registered_name=registered_name)


def _routes(file: Path, spec: PipelineFile, shards: tuple[ShardConfig, ...]
            ) -> tuple[RouteConfig, ...]:
    """Each route with the shards routed from it; every routed shard's route exists and
    every route feeds a shard (a landed file's partition key starts with its owner's
    name, so route and shard names must differ)."""
    targets: dict[str, dict[str, str]] = {name: {} for name in spec.routes}
    for shard in shards:
        source = shard.source
        if not isinstance(source, RoutedSource):
            continue
        where = f"{file}: shards.{shard.name}.source"
        if source.route not in targets:
            known = ", ".join(sorted(targets)) or "none"
            raise InvalidConfig(f"{where}.route: no route named {source.route!r} (routes: "
                                f"{known})")
        value = source.value or shard.name
        other = targets[source.route].get(value)
        if other is not None:
            raise InvalidConfig(f"{where}.value: shard {other} already takes the rows whose "
                                f"{spec.routes[source.route].column} is {value!r}")
        targets[source.route][value] = shard.name
    names = {s.name for s in shards}
    out = []
    for name, route in spec.routes.items():
        if name in names:
            raise InvalidConfig(f"{file}: routes.{name}: a route and a shard cannot share a "
                                "name (both name landed-file partitions)")
        if not targets[name]:
            raise InvalidConfig(f"{file}: routes.{name}: no shard is routed from it (give "
                                f"one `source: {{kind: routed, route: {name}}}`)")
        out.append(RouteConfig(name=name, targets=targets[name], source=route.source,
                               column=route.column, description=route.description))
    return tuple(out)


def _resolve_names(file: Path, shards: tuple[ShardConfig, ...], location: LocationConfig,
                   env: Mapping[str, str], names: NameSource | None
                   ) -> tuple[ShardConfig, ...]:
    """``shards`` with each ``shard_id`` given as a registered name resolved to its id
    (one registry read, only if any is)."""
    named = [s for s in shards if s.registered_name]
    if not named:
        return shards
    read = names or _location_names(location, env)
    where = f"shards.{named[0].name}.shard_id"
    try:
        registry = {name: str(ShardId.parse(i)) for name, i in read().items()}
    except PersistError as e:
        raise type(e)(f"{file}: {where}: reading the registered shard names: {e}") from None
    out = []
    for s in shards:
        if s.registered_name:
            found = registry.get(s.registered_name)
            if found is None:
                raise InvalidConfig(
                    f"{file}: shards.{s.name}.shard_id: {s.registered_name!r} is not a shard "
                    "id, and no shard is registered under that name (as an id: "
                    f"{_not_an_id(s.registered_name)}; as a name, register one with "
                    f"`persist-pipeline new-shard --name {s.registered_name}`)")
            s = s.model_copy(update={"shard_id": found})
        out.append(s)
    return tuple(out)


def _not_an_id(text: str) -> str:
    """Why ``text`` does not parse as a shard id."""
    try:
        ShardId.parse(text)
    except InvalidShardId as e:
        return str(e)
    return "it is one"


def _location_names(location: LocationConfig, env: Mapping[str, str]) -> NameSource:
    """Reads the registered names from ``location``'s consensus store."""

    def read() -> Mapping[str, ShardId]:
        uri = expand_env(location.consensus_uri, env, what="location.consensus_uri").strip()
        if _missing_sqlite_file(uri):
            # No store yet, so no name is registered; loading creates no database.
            return {}
        # Only the name registry is read: no blob store is needed, so none is probed.
        with PersistClient.open(uri, "mem://", env={}, probe=False) as client:
            return client.shard_names()

    return read
