"""Every way to configure a client gives the same effective config; contradictions are
refused with InvalidConfig rather than one side silently winning."""

from __future__ import annotations

from pathlib import Path

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.exceptions import InvalidConfig

OFF = InlinePolicy(0, 0)
ENV_POLICY = {"PERSIST_INLINE_UPDATE_THRESHOLD_BYTES": "100",
              "PERSIST_INLINE_UPDATE_MAX_BYTES": "200"}


def _open(tmp_path: Path, **kwargs: object) -> PersistClient:
    return PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                              **kwargs)  # type: ignore[arg-type]


def test_config_with_inlining_off_writes_to_blob(tmp_path: Path):
    """A user who turns inlining off in the config gets no inline write."""
    with _open(tmp_path, config=PersistConfig(inline_policy=OFF), env={}) as client:
        assert client.inline_policy == OFF
        writer = client.open_writer(ShardId.new())
        assert writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 1).placement == "blob"


def test_config_policy_wins_over_the_environment(tmp_path: Path):
    cfg = PersistConfig(inline_policy=OFF)
    with _open(tmp_path, config=cfg, env=ENV_POLICY) as client:
        assert client.config == cfg


def test_environment_policy_applies_without_config_or_keyword(tmp_path: Path):
    with _open(tmp_path, env=ENV_POLICY) as client:
        assert client.inline_policy == InlinePolicy(100, 200)


def test_keyword_policy_applies_when_it_agrees_with_config(tmp_path: Path):
    cfg = PersistConfig(inline_policy=OFF, rollup_threshold=7)
    with _open(tmp_path, config=cfg, inline_policy=OFF, env=ENV_POLICY) as client:
        assert client.config == cfg


def test_keyword_policy_with_a_config_that_gives_none(tmp_path: Path):
    cfg = PersistConfig(rollup_threshold=7)
    with _open(tmp_path, config=cfg, inline_policy=OFF, env=ENV_POLICY) as client:
        assert client.config == PersistConfig(inline_policy=OFF, rollup_threshold=7)


def test_environment_policy_with_a_config_that_gives_none(tmp_path: Path):
    with _open(tmp_path, config=PersistConfig(rollup_threshold=7), env=ENV_POLICY) as client:
        assert client.config == PersistConfig(inline_policy=InlinePolicy(100, 200),
                                              rollup_threshold=7)


def test_an_explicit_default_policy_in_config_is_a_policy_given(tmp_path: Path):
    with pytest.raises(InvalidConfig):
        _open(tmp_path, config=PersistConfig(inline_policy=InlinePolicy()),
              inline_policy=OFF, env={})


def test_keyword_policy_without_config_keeps_other_defaults(tmp_path: Path):
    with _open(tmp_path, inline_policy=OFF, env=ENV_POLICY) as client:
        assert client.config == PersistConfig(inline_policy=OFF)


def test_keyword_that_contradicts_config_is_refused(tmp_path: Path):
    with pytest.raises(InvalidConfig, match=r"contradicts config\.inline_policy"):
        _open(tmp_path, config=PersistConfig(inline_policy=OFF),
              inline_policy=InlinePolicy(4096, 1 << 20), env={})
    assert not (tmp_path / "b").exists()  # refused before anything was opened


@pytest.mark.parametrize("bad", [{"config": "fast"}, {"inline_policy": 4096}])
def test_wrong_types_are_refused(tmp_path: Path, bad: dict[str, object]):
    with pytest.raises(InvalidConfig):
        _open(tmp_path, env={}, **bad)


@pytest.mark.parametrize(("field", "value"), [
    ("gc_orphan_min_age_s", float("nan")), ("gc_orphan_min_age_s", float("inf")),
    ("reader_lease_duration_s", float("nan")), ("reader_lease_duration_s", float("inf")),
    ("retry_deadline_s", float("nan")), ("heartbeat_interval_s", float("inf")),
    ("listen_poll_interval_s", float("nan")), ("group_commit_window_s", float("nan")),
    ("reader_lease_duration_s", 1e12)])
def test_durations_that_are_not_finite_or_too_long_are_refused(field: str, value: float):
    # NaN passes every comparison, and an infinite duration overflows the clocks it
    # becomes: a client built with either failed later with bare Python errors.
    with pytest.raises(InvalidConfig, match=field):
        PersistConfig(**{field: value})


@pytest.mark.parametrize(("main", "wal"), [
    ("file://{d}/blobs", "file://{d}/blobs"),
    ("file://{d}/blobs", "file://{d}/blobs/wal"),
    ("file://{d}/blobs/main", "file://{d}/blobs"),
    ("mem://shared", "mem://shared"),
])
def test_a_wal_store_sharing_keys_with_the_main_store_is_refused(tmp_path: Path, main: str,
                                                                 wal: str):
    # One key in both would be each store's to GC: the orphan sweep deleted live parts
    # through the store that did not reference them.
    with pytest.raises(InvalidConfig, match="shares keys"):
        PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", main.format(d=tmp_path),
                           wal.format(d=tmp_path), env={})
    ok = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path}/main",
                            f"file://{tmp_path}/main-wal", env={})
    ok.close()


def test_s3_stores_share_keys_when_one_prefix_holds_the_other() -> None:
    from persist_pipeline.blob import open_blob
    from persist_pipeline.blob.base import stores_overlap

    def s3(rest: str) -> object:
        return open_blob(f"s3://{rest}")

    assert stores_overlap(s3("bkt/data"), s3("bkt/data/wal"))  # type: ignore[arg-type]
    assert stores_overlap(s3("bkt"), s3("bkt/wal"))  # type: ignore[arg-type]
    assert not stores_overlap(s3("bkt/data"), s3("bkt/database"))  # type: ignore[arg-type]
    assert not stores_overlap(s3("bkt/data"), s3("other/data"))  # type: ignore[arg-type]
    assert not stores_overlap(s3("bkt/data?endpoint_url=http://127.0.0.1:9"),  # type: ignore[arg-type]
                              s3("bkt/data"))


@pytest.mark.parametrize(("blob", "wal"), [
    ("bogus://x", None),
    ("file://{d}/b?x=1", None),
    ("file://{d}/b", "bogus://x"),
    ("file://{d}/b", "file://"),
    ("file://{d}/b", "s3://"),
])
def test_a_malformed_uri_creates_nothing(tmp_path: Path, blob: str, wal: str | None):
    from persist_pipeline.exceptions import InvalidUri

    d = tmp_path / "loc"
    d.mkdir()
    with pytest.raises(InvalidUri):
        PersistClient.open(f"sqlite:///{d / 'c.db'}", blob.format(d=d),
                           wal.format(d=d) if wal else None, env={})
    assert sorted(p.name for p in d.iterdir()) == []  # no database file, no folder


def test_open_without_create_needs_an_existing_location(tmp_path: Path) -> None:
    """``create=False`` opens an existing location and creates nothing anywhere: a
    missing consensus file or blob folder is a LocationNotFound naming it."""
    from persist_pipeline import BlobLocationNotFound, ConsensusLocationNotFound
    from persist_pipeline.exceptions import InvalidInput, LocationNotFound

    db, blobs = tmp_path / "c.db", tmp_path / "blobs"
    with pytest.raises(ConsensusLocationNotFound, match=str(db)) as info:
        PersistClient.open(f"sqlite:///{db}", f"file://{blobs}", create=False)
    assert isinstance(info.value, LocationNotFound)
    with pytest.raises(InvalidInput, match="create must be True or False"):
        PersistClient.open(f"sqlite:///{db}", f"file://{blobs}", create="no")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    with PersistClient.open(f"sqlite:///{db}", f"file://{blobs}") as client:
        client.open_writer(ShardId.new()).expire()
    wal = tmp_path / "wal"
    with pytest.raises(BlobLocationNotFound, match=str(wal)):
        PersistClient.open(f"sqlite:///{db}", f"file://{blobs}", f"file://{wal}",
                           create=False)
    assert not wal.exists()
    with PersistClient.open(f"sqlite:///{db}", f"file://{blobs}", create=False) as client:
        assert len(client.list_shards()) == 1
