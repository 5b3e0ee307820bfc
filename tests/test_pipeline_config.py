"""``pipeline.yaml`` parsing (:mod:`assets.pipeline_config`): pure logic, no Dagster run.

Covers: every default comes from the models (written once) and a default's ``${VAR}`` is
expanded like a written value; loading opens no database unless a shard id is a
registered name; errors name the file and the key as the user wrote it; secrets'
templates are kept until run time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from assets.pipeline_config import (
    AlertsConfig,
    ChecksConfig,
    CompactionConfig,
    FileSource,
    GcConfig,
    IngestionConfig,
    InlinePolicyConfig,
    LocationConfig,
    PipelineFile,
    ShardSpec,
    SparkConfig,
    SyntheticSource,
    is_landed,
    load_pipeline_config,
    shard_id_for,
)
from persist_pipeline.exceptions import InvalidConfig, PersistError
from resources.env import expand_env

MINIMAL = "shards:\n  a:\n    source: {kind: synthetic}\n"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


def _error(tmp_path: Path, text: str) -> str:
    path = _write(tmp_path, text)
    with pytest.raises(InvalidConfig) as info:
        load_pipeline_config(path, env={})
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message[len(f"{path}: "):]


def test_a_minimal_file_gets_the_models_defaults(tmp_path: Path) -> None:
    config = load_pipeline_config(_write(tmp_path, MINIMAL), env={})
    assert config.compaction == CompactionConfig()
    assert config.alerts == AlertsConfig()
    policy = InlinePolicyConfig()
    assert (config.threshold_bytes, config.max_bytes) == (
        policy.persist_inline_update_threshold_bytes, policy.persist_inline_update_max_bytes)
    assert (config.gc_schedule, config.checks_schedule) == ("30 3 * * *", "*/15 * * * *")
    assert config.automation_running and config.timezone == "UTC"
    assert config.ingestion == IngestionConfig(retries=3, retry_delay_s=5.0,
                                               retry_backoff="exponential",
                                               retry_jitter="plus_minus")
    data_dir = tmp_path / ".persist" / "pipeline"
    assert config.data_dir == data_dir
    # Defaults are validated like written values: {data_dir} and ${VAR:-...} expanded
    # (the location's when a run opens it: its templates are kept until then).
    assert expand_env(config.location.consensus_uri, {}) == \
        f"sqlite:///{data_dir}/consensus.db"
    assert expand_env(config.location.blob_uri, {}) == f"file://{data_dir}/blobs"
    assert expand_env(config.location.wal_blob_uri, {}) == ""
    assert expand_env(config.alerts.webhook_url, {}) == ""
    assert config.spark.master == "local[*]"
    shard = config.shard("a")
    assert shard.source == SyntheticSource()
    assert shard.shard_id == shard_id_for("a") and shard.freshness_max_age_s == 3600


def test_a_file_without_location_reads_the_documented_variables(tmp_path: Path) -> None:
    """The PERSIST_* variables docs/pipeline.md gives as defaults are the models' own
    defaults, not only the shipped file's templates: a file that leaves the keys out
    reads them (the location's and the webhook's when a run expands them)."""
    env = {"PERSIST_PIPELINE_DATA_DIR": str(tmp_path / "elsewhere"),
           "PERSIST_CONSENSUS_URI": "postgresql://app@db/persist",
           "PERSIST_BLOB_URI": "s3://bucket/blobs",
           "PERSIST_WAL_BLOB_URI": "file:///fast/wal",
           "PERSIST_ALERT_WEBHOOK_URL": "https://hooks.example/T0"}
    config = load_pipeline_config(_write(tmp_path, MINIMAL), env=env)
    assert config.data_dir == tmp_path / "elsewhere"
    location = config.location
    assert [expand_env(u, env) for u in (location.consensus_uri, location.blob_uri,
                                         location.wal_blob_uri)] == [
        "postgresql://app@db/persist", "s3://bucket/blobs", "file:///fast/wal"]
    assert expand_env(config.alerts.webhook_url, env) == "https://hooks.example/T0"
    assert "hooks.example" not in config.alerts.webhook_url  # a template until run time
    unset = load_pipeline_config(_write(tmp_path, MINIMAL), env={})
    assert expand_env(unset.location.consensus_uri, {}) == \
        f"sqlite:///{tmp_path / '.persist' / 'pipeline'}/consensus.db"


def test_a_defaults_template_reads_the_environment(tmp_path: Path) -> None:
    path = _write(tmp_path, "spark:\ngc:\n" + MINIMAL)  # empty sections: their defaults
    config = load_pipeline_config(path, env={"SPARK_MASTER": "spark://10.0.0.1:7077"})
    assert config.spark.master == "spark://10.0.0.1:7077"
    assert config.gc_schedule == "30 3 * * *"


def test_values_written_as_templates_are_expanded_and_checked(tmp_path: Path) -> None:
    path = _write(tmp_path, "inline_policy:\n"
                            "  persist_inline_update_threshold_bytes: ${T:-100}\n"
                            "automation: {default_status: STOPPED}\n"
                            "timezone: ${TZ_NAME}\n" + MINIMAL)
    config = load_pipeline_config(path, env={"TZ_NAME": "Europe/Paris"})
    assert config.threshold_bytes == 100
    assert not config.automation_running
    assert config.timezone == "Europe/Paris"
    with pytest.raises(InvalidConfig, match="timezone: environment variable TZ_NAME is "
                                            "not set"):
        load_pipeline_config(path, env={})


def test_secrets_templates_are_kept_until_run_time(tmp_path: Path) -> None:
    path = _write(tmp_path, "location:\n"
                            "  consensus_uri: postgresql://app:${DB_PASSWORD}@db/persist\n"
                            "alerts: {webhook_url: '${HOOK}'}\n"
                            "shards:\n  a:\n    source:\n      kind: files\n"
                            "      uri: s3://bucket/landing?secret_access_key=${KEY}\n")
    config = load_pipeline_config(path, env={})  # unset: only needed at run time
    assert config.location.consensus_uri == "postgresql://app:${DB_PASSWORD}@db/persist"
    assert config.alerts.webhook_url == "${HOOK}"
    source = config.shard("a").source
    assert isinstance(source, FileSource)
    assert source.uri == "s3://bucket/landing?secret_access_key=${KEY}"


def test_a_relative_landing_folder_is_relative_to_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "shards:\n  a:\n    source: {kind: files, uri: land/a}\n")
    source = load_pipeline_config(path, env={}).shard("a").source
    assert isinstance(source, FileSource)
    assert source.uri == str(tmp_path / "land" / "a")
    assert source.location() == str(tmp_path / "land" / "a")
    assert source.formats == ("csv", "jsonl", "parquet") and source.times == "ingest"


def test_loading_opens_no_database(tmp_path: Path) -> None:
    """Nothing listens on port 9: only a registered name as a shard id reads the store."""
    unreachable = "location: {consensus_uri: 'postgresql://u@127.0.0.1:9/none'}\n"
    config = load_pipeline_config(_write(tmp_path, unreachable + MINIMAL), env={})
    assert config.shard("a").shard_id == shard_id_for("a")
    named = unreachable + "shards:\n  a:\n    shard_id: clicks-prod\n" \
                          "    source: {kind: synthetic}\n"
    with pytest.raises(PersistError, match=r"shards\.a\.shard_id: reading the registered "
                                           r"shard names"):
        load_pipeline_config(_write(tmp_path, named), env={})


@pytest.mark.parametrize(("text", "expected"), [
    ("shards: [", "not valid YAML"),
    ("- 1\n", "top level: must be a mapping"),
    ("version: 1\n", "shards: must map at least one shard name to its settings"),
    ("version: 2\n" + MINIMAL, "version: Input should be 1, got 2"),
    ("bogus: 1\n" + MINIMAL, "top level: unknown key(s) bogus; allowed: alerts, "),
    ("gc: 5\n" + MINIMAL, "gc: must be a mapping"),
    ("shards:\n  Orders:\n    source: {kind: synthetic}\n",
     "shards.Orders: a shard name must be lowercase letters, digits and _"),
    ("shards:\n  a: 3\n", "shards.a: must be a mapping"),
    ("shards:\n  a:\n    sink: 1\n    source: {kind: synthetic}\n",
     "shards.a: unknown key(s) sink; allowed: description, freshness_max_age_s, shard_id, "
     "source"),
    ("shards:\n  a:\n    source: {kind: kafka}\n",
     "shards.a.source.kind: must be files, synthetic or routed, got 'kafka'"),
    ("shards:\n  a:\n    source: {keys: 3}\n",
     "shards.a.source.kind: must be files, synthetic or routed, got None"),
    ("shards:\n  a:\n    source: {kind: synthetic, keys: 0}\n",
     "shards.a.source.keys: Input should be greater than or equal to 1, got 0"),
    ("shards:\n  a:\n    source: {kind: synthetic, keys: true}\n",
     "shards.a.source.keys: Input should be a valid integer, got True"),
    ("shards:\n  a:\n    source: {kind: files}\n",
     "shards.a.source.uri: is required (a folder or s3://bucket/prefix)"),
    ("shards:\n  a:\n    source: {kind: files, uri: x, formats: [xml]}\n",
     "shards.a.source.formats: must be a list of csv, jsonl, parquet, got ['xml']"),
    ("shards:\n  a:\n    source: {kind: files, uri: x, base_dir: /}\n",
     "shards.a.source: unknown key base_dir"),
    ("shards:\n  a:\n    shard_id: 'Not A Name!'\n    source: {kind: synthetic}\n",
     "shards.a.shard_id: malformed shard id"),
    ("inline_policy: {persist_inline_update_max_bytes: -1}\n" + MINIMAL,
     "inline_policy.persist_inline_update_max_bytes: Input should be greater than or "
     "equal to 0, got -1"),
    ("inline_policy: {persist_inline_update_threshold_bytes: abc}\n" + MINIMAL,
     "inline_policy.persist_inline_update_threshold_bytes: must be an integer, got 'abc'"),
    ("compaction: {high_water_fraction: 2}\n" + MINIMAL,
     "compaction.high_water_fraction: Input should be less than or equal to 1, got 2"),
    ("compaction: {schedule: '* *'}\n" + MINIMAL,
     "compaction.schedule: must be a 5-field cron expression, got '* *'"),
    ("automation: {default_status: maybe}\n" + MINIMAL,
     "automation.default_status: Input should be 'running' or 'stopped', got 'maybe'"),
    ("spark: {master: '${NOPE_UNSET}'}\n" + MINIMAL,
     "spark.master: environment variable NOPE_UNSET is not set"),
    ("spark: {conf: {a: [1]}}\n" + MINIMAL, "spark.conf.a: must be a string, got list"),
    ("data_dir: ${NOPE}\n" + MINIMAL, "data_dir: environment variable NOPE is not set"),
    ("ingestion: {retries: -1}\n" + MINIMAL,
     "ingestion.retries: Input should be greater than or equal to 0, got -1"),
    ("ingestion: {retry_delay_s: soon}\n" + MINIMAL,
     "ingestion.retry_delay_s: must be a number of seconds, got 'soon'"),
    ("ingestion: {retry_delay_s: -1}\n" + MINIMAL,
     "ingestion.retry_delay_s: Input should be greater than or equal to 0, got -1"),
    ("ingestion: {retry_backoff: quadratic}\n" + MINIMAL,
     "ingestion.retry_backoff: Input should be 'exponential', 'linear' or 'constant'"),
    ("ingestion: {retry_jitter: some}\n" + MINIMAL,
     "ingestion.retry_jitter: Input should be 'plus_minus', 'full' or 'none'"),
    ("ingestion: {max_retries: 3}\n" + MINIMAL,
     "ingestion: unknown key(s) max_retries; allowed: retries, retry_backoff"),
    ("shards:\n  a:\n    source: {kind: synthetic}\n  b:\n    shard_id: " + shard_id_for("a")
     + "\n    source: {kind: synthetic}\n", "shards: two shards have the same shard_id"),
])
def test_errors_name_the_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in _error(tmp_path, text)


def _documented_defaults() -> dict[str, str]:
    """``{key: row}`` of the key table in docs/pipeline.md."""
    rows = {}
    text = (Path(__file__).resolve().parent.parent / "docs" / "pipeline.md").read_text()
    for line in text.splitlines():
        if line.startswith("| `"):
            key, _, rest = line[3:].partition("`")
            rows[key] = rest
    return rows


def test_the_documented_defaults_are_the_models() -> None:
    """docs/pipeline.md states each default; the models are where it is written."""
    rows = _documented_defaults()
    compaction, alerts, policy = CompactionConfig(), AlertsConfig(), InlinePolicyConfig()
    expected = {
        "inline_policy.persist_inline_update_threshold_bytes":
            str(policy.persist_inline_update_threshold_bytes),
        "compaction.high_water_fraction": str(compaction.high_water_fraction),
        "compaction.sensor_interval_s": str(compaction.sensor_interval_s),
        "compaction.schedule": compaction.schedule,
        "gc.schedule": "30 3 * * *",
        "checks.schedule": "*/15 * * * *",
        "alerts.over_limit_for_s": str(alerts.over_limit_for_s),
        "alerts.backlog_threshold": str(alerts.backlog_threshold),
        "alerts.sensor_interval_s": str(alerts.sensor_interval_s),
        "timezone": "UTC",
        "ingestion.retries": str(IngestionConfig().retries),
        "ingestion.retry_delay_s": str(IngestionConfig().retry_delay_s),
        "ingestion.retry_backoff": IngestionConfig().retry_backoff,
        "ingestion.retry_jitter": IngestionConfig().retry_jitter,
        "shards.NAME.freshness_max_age_s": str(ShardSpec.model_fields[
            "freshness_max_age_s"].default),
    }
    for key, default in expected.items():
        assert key in rows, f"docs/pipeline.md documents no {key}"
        assert f"({default}" in rows[key] or f"(`{default}`" in rows[key], (key, rows[key])
    assert GcConfig().schedule == expected["gc.schedule"]
    assert ChecksConfig().schedule == expected["checks.schedule"]
    assert PipelineFile.model_fields["timezone"].default == expected["timezone"]
    # A key documented as "(`VAR`, else X)" defaults to the template ${VAR:-X} (X
    # "none": empty), so a file that leaves the key out reads VAR as the docs say.
    data_dir = PipelineFile.model_fields["data_dir"].default
    location = LocationConfig.model_fields
    from_env = {
        "data_dir": ("PERSIST_PIPELINE_DATA_DIR", ".persist/pipeline", data_dir),
        "location.consensus_uri": ("PERSIST_CONSENSUS_URI", "sqlite:///{data_dir}/consensus.db",
                                   location["consensus_uri"].default),
        "location.blob_uri": ("PERSIST_BLOB_URI", "file://{data_dir}/blobs",
                              location["blob_uri"].default),
        "location.wal_blob_uri": ("PERSIST_WAL_BLOB_URI", "", location["wal_blob_uri"].default),
        "alerts.webhook_url": ("PERSIST_ALERT_WEBHOOK_URL", "",
                               AlertsConfig.model_fields["webhook_url"].default),
        "spark.master": ("SPARK_MASTER", "local[*]", SparkConfig.model_fields["master"].default),
    }
    for key, (var, fallback, model_default) in from_env.items():
        assert model_default == f"${{{var}:-{fallback}}}", key
        documented = f"(`{var}`, else `{fallback}`)" if fallback else f"(`{var}`, else none)"
        assert documented in rows[key], (key, rows[key])


ROUTES = ("routes:\n  commerce:\n    column: table\n"
          "    source: {kind: files, uri: land/commerce}\n")
ROUTED = ("shards:\n  orders:\n    source: {kind: routed, route: commerce, value: order}\n"
          "  refunds:\n    source: {kind: routed, route: commerce}\n")


def test_a_route_feeds_the_shards_routed_from_it(tmp_path: Path) -> None:
    config = load_pipeline_config(_write(tmp_path, ROUTES + ROUTED), env={})
    route = config.route("commerce")
    assert route.column == "table"
    assert dict(route.targets) == {"order": "orders", "refunds": "refunds"}
    assert route.source.uri == str(tmp_path / "land" / "commerce")
    assert is_landed(config.shard("orders")) and is_landed(config.shard("refunds"))
    assert config.routes == (route,)
    # No routes: an empty tuple, and a plain config is unchanged.
    assert load_pipeline_config(_write(tmp_path, MINIMAL), env={}).routes == ()


@pytest.mark.parametrize(("text", "expected"), [
    (ROUTED, "shards.orders.source.route: no route named 'commerce' (routes: none)"),
    (ROUTES + MINIMAL, "routes.commerce: no shard is routed from it"),
    (ROUTES + ROUTED + "  commerce:\n    source: {kind: synthetic}\n",
     "routes.commerce: a route and a shard cannot share a name"),
    (ROUTES + ROUTED + "  more:\n    source: {kind: routed, route: commerce, value: order}\n",
     "shards.more.source.value: shard orders already takes the rows whose table is 'order'"),
    (ROUTES.replace("column: table", "column: k") + ROUTED,
     "routes.commerce.column: must name a column besides k, v, t and d, got 'k'"),
    (ROUTES.replace("    column: table\n", "") + ROUTED.replace("route: commerce}", "}"),
     "shards.refunds.source.route: is required"),
    (ROUTES.replace("kind: files", "kind: synthetic") + ROUTED,
     "routes.commerce.source.kind: Input should be 'files', got 'synthetic'"),
])
def test_route_errors_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in _error(tmp_path, text)


def test_a_two_slash_file_uri_is_refused_before_any_folder_is_made(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    # file://data/blobs (a relative path with two slashes) has the host "data": it names
    # no local folder, so none is made (it was /blobs, at the root), and the client
    # refuses the URI with the library's clear error.
    import uuid

    from persist_pipeline.exceptions import InvalidUri
    from resources.persist import PersistResource

    made: list[str] = []
    real_mkdir = Path.mkdir

    def recording_mkdir(self: Path, *args: object, **kwargs: object) -> None:
        made.append(str(self))
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", recording_mkdir)
    name = f"blobs-{uuid.uuid4().hex[:8]}"
    resource = PersistResource(consensus_uri=f"sqlite:///{tmp_path}/c.db",
                               blob_uri=f"file://data/{name}")
    try:
        with pytest.raises(InvalidUri, match="file:///absolute/path"):
            resource.client()
    finally:
        resource.close()
    assert not any(name in m for m in made), made
    assert not Path("/" + name).exists()


@pytest.mark.parametrize(("text", "expected"), [
    ("gc: {schedule: '99 99 * * *'}\n" + MINIMAL,
     "gc.schedule: not a cron expression Dagster can run, got '99 99 * * *'"),
    ("checks: {schedule: '0 0 31 2 *'}\n" + MINIMAL,
     "checks.schedule: not a cron expression Dagster can run, got '0 0 31 2 *'"),
    ("compaction: {schedule: '0 25 * * *'}\n" + MINIMAL,
     "compaction.schedule: not a cron expression Dagster can run, got '0 25 * * *'"),
    ("timezone: Mars/Olympus\n" + MINIMAL,
     "timezone: not a time zone (an IANA name such as Europe/Paris or UTC), got "
     "'Mars/Olympus'"),
    ("timezone: ../../etc/passwd\n" + MINIMAL, "timezone: not a time zone"),
    ("location: {consensus_uri: 'sqllite:///x.db'}\n" + MINIMAL,
     "location.consensus_uri: unsupported consensus URI scheme 'sqllite'"),
    ("location: {consensus_uri: 'postgresql://u@h/db?connect_timeout=abc'}\n" + MINIMAL,
     "location.consensus_uri: postgresql consensus URI: parameter 'connect_timeout' must "
     "be an integer"),
    ("location: {blob_uri: blobs}\n" + MINIMAL,
     "location.blob_uri: unsupported blob URI 'blobs'"),
    ("location: {wal_blob_uri: 'ftp://x'}\n" + MINIMAL,
     "location.wal_blob_uri: unsupported blob URI"),
])
def test_schedules_time_zones_and_literal_uris_are_checked_at_load(
        tmp_path: Path, text: str, expected: str) -> None:
    """What Dagster or the client would refuse only later is refused when the file loads,
    naming the file and the key."""
    assert expected in _error(tmp_path, text)


def test_valid_schedules_time_zones_and_uris_load(tmp_path: Path) -> None:
    text = ("gc: {schedule: '0 0 * * MON-FRI'}\ntimezone: America/New_York\n"
            "location:\n  consensus_uri: postgresql://u:${PW}@h/db?connect_timeout=5\n"
            "  blob_uri: s3://bucket/prefix\n  wal_blob_uri: 'file:///tmp/wal'\n" + MINIMAL)
    config = load_pipeline_config(_write(tmp_path, text), env={})
    assert (config.gc_schedule, config.timezone) == ("0 0 * * MON-FRI", "America/New_York")


def test_a_shard_id_that_is_no_id_nor_registered_name_says_so(tmp_path: Path) -> None:
    # The location's SQLite store does not exist yet: no name is registered, which is
    # said plainly (with why the text is not an id), and no database is created.
    message = _error(tmp_path, "shards:\n  a:\n    shard_id: s123\n"
                               "    source: {kind: synthetic}\n")
    assert message.startswith("shards.a.shard_id: 's123' is not a shard id, and no shard "
                              "is registered under that name"), message
    assert "as an id: malformed shard id 's123'" in message
    assert not (tmp_path / ".persist").exists()


def test_ingestion_retries_are_dagster_retry_policies(tmp_path: Path) -> None:
    import dagster as dg

    from assets.retries import retry_policy

    shipped = load_pipeline_config(Path(__file__).resolve().parent.parent / "pipeline.yaml",
                                   env={})
    assert shipped.ingestion == IngestionConfig()  # the file shows the defaults
    assert retry_policy(IngestionConfig()) == dg.RetryPolicy(
        max_retries=3, delay=5.0, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS)
    path = _write(tmp_path, "ingestion:\n  retries: ${R:-2}\n  retry_delay_s: '${D:-0.5}'\n"
                            "  retry_backoff: Constant\n  retry_jitter: none\n" + MINIMAL)
    config = load_pipeline_config(path, env={"D": "0.25"}).ingestion
    assert retry_policy(config) == dg.RetryPolicy(max_retries=2, delay=0.25)
    assert retry_policy(IngestionConfig(retries=0)) is None  # one attempt


def test_only_transient_failures_are_retried() -> None:
    import dagster as dg

    from assets.retries import is_transient
    from persist_pipeline.exceptions import (
        BlobAuthError,
        BlobUnavailable,
        CommitDeadlineExceeded,
        ConsensusUnavailable,
        CorruptPart,
        Indeterminate,
        InvalidUpdates,
        LeaseExpired,
        SchemaMismatch,
        ShardNotFound,
        UnsettledCommit,
    )

    for error in (ConsensusUnavailable("db away"), BlobUnavailable("S3 503"),
                  Indeterminate("reply lost"), CommitDeadlineExceeded("too old"),
                  LeaseExpired("paused"), TimeoutError("timed out"),
                  ConnectionResetError("reset"), dg.Failure("the upper kept moving")):
        assert is_transient(error), error
    for error in (InvalidUpdates("line 3"), SchemaMismatch("typed"), CorruptPart("bad"),
                  BlobAuthError("denied"), ShardNotFound("gone"),
                  UnsettledCommit("GC truncated what would tell"),
                  dg.Failure("bad file", allow_retries=False), KeyError("a bug"),
                  ValueError("a bug")):
        assert not is_transient(error), error
