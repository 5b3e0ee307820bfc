"""The pipeline config file (``pipeline.yaml``): shards, their sources, and the knobs.

The file is found at ``$PERSIST_PIPELINE_CONFIG``, else ``pipeline.yaml`` at the repository
root. Relative paths in it are relative to the file. Strings may use ``${VAR}`` and
``${VAR:-default}`` (environment) and ``{data_dir}``. The persist location, the alert
webhook and S3 landing URIs keep their ``${...}`` templates until run time (they may hold
secrets, see :mod:`resources.env`); everything else is expanded when the file is loaded.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from persist_pipeline import PersistClient, ShardId
from persist_pipeline.config import (
    INLINE_UPDATE_MAX_BYTES,
    INLINE_UPDATE_THRESHOLD_BYTES,
)
from persist_pipeline.exceptions import (
    InvalidConfig,
    InvalidShardId,
    InvalidShardName,
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

#: Reads the registered shard names of a location: ``{name: shard id}``.
NameSource = Callable[[], Mapping[str, ShardId | str]]


@dataclass(frozen=True)
class FileSource:
    """Files landing in a local folder or under an S3 prefix.

    Attributes:
        uri: a folder, or ``s3://bucket/prefix?...``; may be a ``${VAR}`` template,
            expanded when used (a relative folder is relative to ``base_dir``).
        formats: the file formats accepted (extensions of :data:`FORMATS`).
        times: ``ingest``: every row of a file is written at one new time (the shard's
            upper); ``source``: the file's ``t`` values are kept (all must be at or
            beyond the shard's upper) and the upper advances past the largest.
        sensor_interval_s: how often the landing sensor lists the location.
    """

    uri: str
    formats: tuple[str, ...] = ("csv", "jsonl", "parquet")
    times: TimesMode = "ingest"
    sensor_interval_s: int = 30
    base_dir: str = "."
    kind: Literal["files"] = "files"

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


@dataclass(frozen=True)
class SyntheticSource:
    """The built-in change stream (inserts, updates and deletes as +1/-1 diffs).

    Attributes:
        keys: size of the key space.
        events_per_write: changes per write (one write per materialization).
        seed: makes the stream reproducible.
        value_bytes: approximate size of a value.
    """

    keys: int = 200
    events_per_write: int = 25
    seed: int = 0
    value_bytes: int = 24
    kind: Literal["synthetic"] = "synthetic"


Source = FileSource | SyntheticSource


@dataclass(frozen=True)
class ShardConfig:
    """One shard: its name (asset keys use it), id and source.

    Attributes:
        registered_name: the registered shard name the file gave as ``shard_id`` (which
            holds the id it was resolved to); empty when the file gave an id or none.
    """

    name: str
    shard_id: str
    source: Source
    description: str = ""
    freshness_max_age_s: int = 3600
    registered_name: str = ""


@dataclass(frozen=True)
class LocationConfig:
    consensus_uri: str
    blob_uri: str
    wal_blob_uri: str = ""


@dataclass(frozen=True)
class SparkConfig:
    master: str = "local[*]"
    conf: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CompactionConfig:
    high_water_fraction: float = 0.75
    sensor_interval_s: int = 30
    schedule: str = "0 * * * *"


@dataclass(frozen=True)
class AlertsConfig:
    webhook_url: str = ""
    sensor_interval_s: int = 60
    over_limit_for_s: int = 900
    backlog_threshold: int = 16


@dataclass(frozen=True)
class PipelineConfig:
    """The whole file, validated."""

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
    automation_running: bool
    shards: tuple[ShardConfig, ...]
    timezone: str = "UTC"

    def shard(self, name: str) -> ShardConfig:
        for s in self.shards:
            if s.name == name:
                return s
        raise KeyError(name)


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
    """
    env = os.environ if env is None else env
    file = Path(path).resolve() if path is not None else config_path(env)
    try:
        raw = yaml.load(file.read_text(encoding="utf-8"), Loader=_LOADER)  # noqa: S506
    except OSError as e:
        raise InvalidConfig(f"{file}: cannot read the pipeline config: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise InvalidConfig(f"{file}: not valid YAML: {e}") from None
    return _Parser(file, env, names).parse(raw)


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


def _location_names(location: LocationConfig, env: Mapping[str, str]) -> NameSource:
    """Reads the registered names from ``location``'s consensus store."""

    def read() -> Mapping[str, ShardId]:
        uri = expand_env(location.consensus_uri, env, what="location.consensus_uri").strip()
        # Only the name registry is read: no blob store is needed, so none is probed.
        with PersistClient.open(uri, "mem://", env={}, probe=False) as client:
            return client.shard_names()

    return read


class _Parser:
    def __init__(self, file: Path, env: Mapping[str, str], names: NameSource | None) -> None:
        self.file = file
        self.env = env
        self.names = names
        self.data_dir = file.parent

    # --- helpers -----------------------------------------------------------------------

    def error(self, where: str, message: str) -> InvalidConfig:
        return InvalidConfig(f"{self.file}: {where}: {message}")

    def section(self, raw: Mapping[str, Any], key: str, where: str = "") -> dict[str, Any]:
        value = raw.get(key) or {}
        if not isinstance(value, Mapping):
            raise self.error(where + key, "must be a mapping")
        return dict(value)

    def check_keys(self, raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise self.error(where, f"unknown key(s) {', '.join(unknown)}; allowed: "
                                    f"{', '.join(sorted(allowed))}")

    def expand(self, value: Any, where: str, *, runtime: bool = False) -> str:
        """Expand ``{data_dir}``, and ``${...}`` unless ``runtime`` (kept for run time)."""
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise self.error(where, f"must be a string, got {type(value).__name__}")
        text = str(value).replace("{data_dir}", str(self.data_dir))
        if runtime:
            return text
        try:
            return expand_env(text, self.env, what=where)
        except InvalidConfig as e:
            raise self.error(where, str(e).split(": ", 1)[-1]) from None

    def integer(self, raw: Mapping[str, Any], key: str, default: int, where: str,
                minimum: int = 0) -> int:
        value = raw.get(key, default)
        if isinstance(value, str):
            value = self.expand(value, where + key)
            try:
                value = int(value)
            except ValueError:
                raise self.error(where + key, f"must be an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(where + key, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def path(self, value: Any, where: str) -> Path:
        p = Path(self.expand(value, where)).expanduser()
        return (p if p.is_absolute() else self.file.parent / p).resolve()

    # --- sections ----------------------------------------------------------------------

    def parse(self, raw: Any) -> PipelineConfig:
        if not isinstance(raw, Mapping):
            raise self.error("top level", "must be a mapping")
        self.check_keys(raw, {"version", "data_dir", "location", "inline_policy", "spark",
                              "compaction", "gc", "checks", "alerts", "automation",
                              "shards", "timezone"}, "top level")
        if raw.get("version", 1) != 1:
            raise self.error("version", f"unsupported version {raw.get('version')!r}")
        self.data_dir = self.path(raw.get("data_dir", ".persist/pipeline"), "data_dir")

        loc = self.section(raw, "location")
        self.check_keys(loc, {"consensus_uri", "blob_uri", "wal_blob_uri"}, "location")
        location = LocationConfig(
            consensus_uri=self.expand(
                loc.get("consensus_uri", "sqlite:///{data_dir}/consensus.db"),
                "location.consensus_uri", runtime=True),
            blob_uri=self.expand(loc.get("blob_uri", "file://{data_dir}/blobs"),
                                 "location.blob_uri", runtime=True),
            wal_blob_uri=self.expand(loc.get("wal_blob_uri") or "", "location.wal_blob_uri",
                                     runtime=True))

        pol = self.section(raw, "inline_policy")
        self.check_keys(pol, {"persist_inline_update_threshold_bytes",
                              "persist_inline_update_max_bytes"}, "inline_policy")
        threshold = self.integer(pol, "persist_inline_update_threshold_bytes",
                                 INLINE_UPDATE_THRESHOLD_BYTES, "inline_policy.")
        max_bytes = self.integer(pol, "persist_inline_update_max_bytes",
                                 INLINE_UPDATE_MAX_BYTES, "inline_policy.")

        sp = self.section(raw, "spark")
        self.check_keys(sp, {"master", "conf"}, "spark")
        conf = self.section(sp, "conf", "spark.")
        spark = SparkConfig(
            master=self.expand(sp.get("master", "${SPARK_MASTER:-local[*]}"), "spark.master"),
            conf={str(k): self.expand(v, f"spark.conf.{k}") for k, v in conf.items()})

        comp = self.section(raw, "compaction")
        self.check_keys(comp, {"high_water_fraction", "sensor_interval_s", "schedule"},
                        "compaction")
        fraction = comp.get("high_water_fraction", 0.75)
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) \
                or not 0 < fraction <= 1:
            raise self.error("compaction.high_water_fraction",
                             f"must be a number in (0, 1], got {fraction!r}")
        compaction = CompactionConfig(
            high_water_fraction=float(fraction),
            sensor_interval_s=self.integer(comp, "sensor_interval_s", 30, "compaction.", 1),
            schedule=self.cron(comp.get("schedule", "0 * * * *"), "compaction.schedule"))

        gc = self.section(raw, "gc")
        self.check_keys(gc, {"schedule"}, "gc")
        checks = self.section(raw, "checks")
        self.check_keys(checks, {"schedule"}, "checks")

        al = self.section(raw, "alerts")
        self.check_keys(al, {"webhook_url", "sensor_interval_s", "over_limit_for_s",
                             "backlog_threshold"}, "alerts")
        alerts = AlertsConfig(
            webhook_url=self.expand(al.get("webhook_url") or "", "alerts.webhook_url",
                                    runtime=True),
            sensor_interval_s=self.integer(al, "sensor_interval_s", 60, "alerts.", 1),
            over_limit_for_s=self.integer(al, "over_limit_for_s", 900, "alerts."),
            backlog_threshold=self.integer(al, "backlog_threshold", 16, "alerts."))

        auto = self.section(raw, "automation")
        self.check_keys(auto, {"default_status"}, "automation")
        status = str(auto.get("default_status", "running")).lower()
        if status not in ("running", "stopped"):
            raise self.error("automation.default_status",
                             f"must be running or stopped, got {status!r}")

        shards_raw = raw.get("shards")
        if not isinstance(shards_raw, Mapping) or not shards_raw:
            raise self.error("shards", "must map at least one shard name to its settings")
        shards = tuple(self.shard(str(name), spec) for name, spec in shards_raw.items())
        shards = self.resolve_names(shards, location)
        ids = [s.shard_id for s in shards]
        if len(set(ids)) != len(ids):
            raise self.error("shards", "two shards have the same shard_id")

        return PipelineConfig(
            path=self.file, data_dir=self.data_dir, location=location,
            threshold_bytes=threshold, max_bytes=max_bytes, spark=spark,
            compaction=compaction,
            gc_schedule=self.cron(gc.get("schedule", "30 3 * * *"), "gc.schedule"),
            checks_schedule=self.cron(checks.get("schedule", "*/15 * * * *"),
                                      "checks.schedule"),
            alerts=alerts, automation_running=status == "running", shards=shards,
            timezone=self.expand(raw.get("timezone", "UTC"), "timezone"))

    def resolve_names(self, shards: tuple[ShardConfig, ...],
                      location: LocationConfig) -> tuple[ShardConfig, ...]:
        """``shards`` with each ``shard_id`` given as a registered name resolved to its id
        (one registry read, only if any is)."""
        named = [s for s in shards if s.registered_name]
        if not named:
            return shards
        read = self.names or _location_names(location, self.env)
        where = f"shards.{named[0].name}.shard_id"
        try:
            registry = {name: str(ShardId.parse(i)) for name, i in read().items()}
        except PersistError as e:
            raise type(e)(f"{self.file}: {where}: reading the registered shard names: "
                          f"{e}") from None
        out = []
        for s in shards:
            if s.registered_name:
                found = registry.get(s.registered_name)
                if found is None:
                    raise self.error(
                        f"shards.{s.name}.shard_id",
                        f"{s.registered_name!r} is not a shard id, and no shard is "
                        "registered under that name (register one with `persist-pipeline "
                        f"new-shard --name {s.registered_name}`)")
                s = replace(s, shard_id=found)
            out.append(s)
        return tuple(out)

    def cron(self, value: Any, where: str) -> str:
        text = self.expand(value, where)
        if len(text.split()) != 5:
            raise self.error(where, f"must be a 5-field cron expression, got {text!r}")
        return text

    def shard(self, name: str, spec: Any) -> ShardConfig:
        where = f"shards.{name}"
        if not _NAME.match(name):
            raise self.error(where, "a shard name must be lowercase letters, digits and _ "
                                    "(starting with a letter)")
        if not isinstance(spec, Mapping):
            raise self.error(where, "must be a mapping with a source")
        self.check_keys(spec, {"shard_id", "source", "description", "freshness_max_age_s"},
                        where)
        shard_id = spec.get("shard_id") or shard_id_for(name)
        registered_name = ""
        try:
            shard_id = str(ShardId.parse(str(shard_id)))
        except InvalidShardId as e:
            try:
                registered_name = check_name(str(shard_id))  # resolved by resolve_names
            except InvalidShardName:
                raise self.error(where + ".shard_id", f"{e} (nor is it a valid shard "
                                                      "name)") from None
            shard_id = ""
        src = spec.get("source")
        if not isinstance(src, Mapping):
            raise self.error(where + ".source", "must be a mapping with a kind")
        kind = src.get("kind")
        source: Source
        sw = where + ".source."
        if kind == "files":
            self.check_keys(src, {"kind", "uri", "formats", "times", "sensor_interval_s"},
                            where + ".source")
            if "uri" not in src:
                raise self.error(sw + "uri", "is required (a folder or s3://bucket/prefix)")
            raw_uri = str(src["uri"])
            uri = (self.expand(raw_uri, sw + "uri", runtime=True)
                   if raw_uri.lower().startswith("s3://") or "${" in raw_uri
                   else str(self.path(raw_uri, sw + "uri")))
            formats = src.get("formats", ["csv", "jsonl", "parquet"])
            known = sorted(set(FORMATS.values()))
            if not isinstance(formats, list) or not formats or any(
                    f not in known for f in formats):
                raise self.error(sw + "formats", f"must be a list of {', '.join(known)}")
            times = src.get("times", "ingest")
            if times not in ("ingest", "source"):
                raise self.error(sw + "times", f"must be ingest or source, got {times!r}")
            source = FileSource(uri=uri, formats=tuple(formats), times=times,
                                base_dir=str(self.file.parent),
                                sensor_interval_s=self.integer(src, "sensor_interval_s", 30,
                                                               sw, 1))
        elif kind == "synthetic":
            self.check_keys(src, {"kind", "keys", "events_per_write", "seed", "value_bytes"},
                            where + ".source")
            source = SyntheticSource(
                keys=self.integer(src, "keys", 200, sw, 1),
                events_per_write=self.integer(src, "events_per_write", 25, sw, 1),
                seed=self.integer(src, "seed", 0, sw),
                value_bytes=self.integer(src, "value_bytes", 24, sw, 8))
        else:
            raise self.error(sw + "kind", f"must be files or synthetic, got {kind!r}")
        return ShardConfig(
            name=name, shard_id=shard_id, source=source,
            description=str(spec.get("description", "")),
            freshness_max_age_s=self.integer(spec, "freshness_max_age_s", 3600, where + ".", 1),
            registered_name=registered_name)
