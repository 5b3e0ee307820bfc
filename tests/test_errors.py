"""Bad input and bad stored data: clear, typed errors, and nothing changes."""

from __future__ import annotations

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId
from persist_pipeline.consensus.base import VersionedData
from persist_pipeline.exceptions import (
    AuthError,
    CorruptPart,
    CorruptState,
    InvalidConfig,
    InvalidUri,
    Unavailable,
)
from tests.fixtures.location import Location


def test_corrupt_consensus_record_names_the_seqno(durable_location: Location):
    client = durable_location.client()
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"a", b"b", 0, 1)], 0, 1)
    head = client.consensus.head(str(shard))
    assert client.consensus.compare_and_set(
        str(shard), head.seqno, VersionedData(head.seqno + 1, b"\xff\xfe garbage", head.summary))
    fresh = durable_location.client()
    with pytest.raises(CorruptState, match=f"seqno {head.seqno + 1}"):
        fresh.open_reader(shard)
    client.close()
    fresh.close()


def test_corrupt_blob_part_names_the_key_and_compaction_commits_nothing(
        durable_location: Location):
    client = durable_location.client(InlinePolicy(0, 0))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"b", 0, 1)], 0, 1)
    writer.compare_and_append([(b"c", b"d", 1, 1)], 1, 2)
    key = next(m.key for m in client.blobs.main.list_keys(f"{shard}/p/"))
    client.blobs.main.set(key, b"not parquet")
    fresh = durable_location.client(InlinePolicy(0, 0))
    with pytest.raises(CorruptPart, match=key.split("/")[-1]):
        fresh.open_reader(shard).snapshot(1)
    before = fresh.inspect(shard)["seqno"]
    with pytest.raises(CorruptPart):
        fresh.compact(shard)
    assert fresh.inspect(shard)["seqno"] == before
    client.close()
    fresh.close()


@pytest.mark.parametrize("uri", ["", "ftp://host/x", "sqlite://", "s3://", "postgresql//x",
                                 "mem:/x"])
def test_malformed_uris(uri, tmp_path):
    with pytest.raises(InvalidUri):
        PersistClient.open(uri or "nope", f"file://{tmp_path}")
    with pytest.raises(InvalidUri):
        PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", uri or "nope")


def test_unreachable_database_is_unavailable(tmp_path):
    with pytest.raises(Unavailable):
        PersistClient.open("postgresql://postgres@127.0.0.1:1/db?connect_timeout=2",
                           f"file://{tmp_path}")


def test_wrong_password_is_an_auth_error_without_the_password(pg_password_server, tmp_path):
    server = pg_password_server
    wrong = "wrong-pw-s3cr3t"
    with pytest.raises(AuthError) as err:
        PersistClient.open(server.url("postgres", password=wrong), f"file://{tmp_path}")
    assert wrong not in str(err.value) and server.password not in str(err.value)
    ok = PersistClient.open(server.url("postgres"), f"file://{tmp_path}")
    shard = ShardId.new()
    ok.open_writer(shard).compare_and_append([(b"a", b"b", 0, 1)], 0, 1)
    assert server.password not in str(ok.inspect(shard))
    ok.close()


def test_settings_from_the_environment(tmp_path):
    env = {"PERSIST_CONSENSUS_URI": f"sqlite:///{tmp_path / 'c.db'}",
           "PERSIST_BLOB_URI": f"file://{tmp_path / 'b'}",
           "PERSIST_INLINE_UPDATE_THRESHOLD_BYTES": "100",
           "PERSIST_INLINE_UPDATE_MAX_BYTES": "1000"}
    client = PersistClient.open(env=env)
    assert client.inline_policy == InlinePolicy(100, 1000)
    client.close()
    with pytest.raises(InvalidConfig, match="PERSIST_INLINE_UPDATE_MAX_BYTES"):
        PersistClient.open(env={**env, "PERSIST_INLINE_UPDATE_MAX_BYTES": "lots"})
    with pytest.raises(InvalidConfig, match="PERSIST_CONSENSUS_URI"):
        PersistClient.open(env={})


@pytest.mark.parametrize("kwargs", [{"read_fetch_threads": 0}, {"read_fetch_threads": 1.5},
                                    {"rollup_threshold": 0}, {"rollup_threshold": 2.5},
                                    {"gc_orphan_min_age_s": 0.5}])
def test_bad_persist_config_is_refused(kwargs):
    with pytest.raises(InvalidConfig, match=next(iter(kwargs))):
        PersistConfig(**kwargs)


def test_every_error_class_is_exported_from_the_package():
    """The errors the README and docs name are caught as ``from persist_pipeline import
    X``: every class of ``exceptions`` is re-exported, and listed in ``__all__``."""
    import persist_pipeline
    from persist_pipeline import exceptions

    defined = {name for name, obj in vars(exceptions).items()
               if isinstance(obj, type) and issubclass(obj, exceptions.PersistError)}
    assert {"ShardNameNotFound", "InvalidShardName", "InvalidUpdates", "InvalidFrontier",
            "LeaseExpired", "DiffOverflow"} <= defined
    assert defined - set(persist_pipeline.__all__) == set()
    for name in defined:
        assert getattr(persist_pipeline, name) is getattr(exceptions, name), name
