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
