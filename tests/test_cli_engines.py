"""The command line for other engines and new users: ``snapshot --as-of latest``, text
output, ``plan``, shard names in ``shards``; and location checks when a client opens
(an unreachable blob store, a password with unescaped characters)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from persist_pipeline import PersistClient
from persist_pipeline.blob import redact_uri
from persist_pipeline.exceptions import BlobLocationNotFound, BlobUnavailable, InvalidUri
from tests.test_cli import cli, env

#: The full tier only (``make test``): processes, servers or Dagster runs.
pytestmark = pytest.mark.slow

__all__ = ["env"]  # a fixture, imported for pytest


def _append(env: dict[str, str], shard: str, tmp_path: Path, text: str, lo: int, hi: int
            ) -> None:
    csv = tmp_path / f"u{lo}.csv"
    csv.write_text(text)
    out = cli(env, "append", shard, str(csv), "--expected-upper", str(lo), "--new-upper",
              str(hi))
    assert out.returncode == 0, out.stderr


def test_snapshot_latest_prints_text_and_plan_prints_json(env: dict[str, str],
                                                          tmp_path: Path) -> None:
    shard = cli(env, "new-shard").stdout.strip()
    _append(env, shard, tmp_path, "k,v,t,d\nalice,signup,0,1\nbob,signup,1,1\n", 0, 2)
    _append(env, shard, tmp_path, "k,v,t,d\nalice,signup,2,-1\ncarol,login,3,1\n", 2, 5)
    out = cli(env, "snapshot", shard, "--as-of", "latest")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ['"k","v","t","d"', '"bob","signup",4,1',
                                       '"carol","login",4,1']
    assert out.stderr == ""
    # Compacted to a Parquet part, the plan lists the file; inline rows are shown as text.
    assert cli(env, "compact", shard).returncode == 0
    _append(env, shard, tmp_path, "k,v,t,d\ndave,signup,5,1\n", 5, 6)
    out = cli(env, "plan", shard, "--as-of", "5")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["as_of"] == 5 and plan["upper"] == 6
    [file] = plan["files"]
    assert file["uri"].startswith("file:///") and file["store"] == "main"
    assert plan["inline"] == [{"k": "dave", "v": "signup", "t": 5, "d": 1}]
    # The file is plain Parquet any engine reads; with the inline rows it is the snapshot.
    on_disk = pq.read_table(file["uri"].removeprefix("file://")).to_pylist()
    assert sorted(r["k"] for r in on_disk) == [b"alice", b"alice", b"bob", b"carol"]
    assert json.loads(cli(env, "plan", shard).stdout)["as_of"] == 5  # latest by default


def test_snapshot_shows_hex_only_where_not_utf8_and_says_so(env: dict[str, str],
                                                             tmp_path: Path) -> None:
    shard = cli(env, "new-shard").stdout.strip()
    parquet = tmp_path / "u.parquet"
    import pyarrow as pa

    pq.write_table(pa.table({"k": [b"user-1", b"user-2"], "v": [b"\xff\x00", b"ok"],
                             "t": [0, 0], "d": [1, 1]}), parquet)
    out = cli(env, "append", shard, str(parquet), "--expected-upper", "0", "--new-upper", "1")
    assert out.returncode == 0, out.stderr
    out = cli(env, "snapshot", shard, "--as-of", "0")
    assert out.stdout.splitlines()[1:] == ['"user-1","ff00",0,1', '"user-2","6f6b",0,1']
    assert "column v is not valid UTF-8 throughout: written as hex" in out.stderr
    assert "column k" not in out.stderr


def test_shards_shows_pipeline_names(env: dict[str, str], tmp_path: Path) -> None:
    from assets.pipeline_config import DEFAULT_CONFIG, load_pipeline_config

    config = tmp_path / "pipeline.yaml"
    config.write_text(DEFAULT_CONFIG.read_text())

    ids = {s.name: s.shard_id for s in load_pipeline_config(config).shards}
    assert cli(env, "new-shard", "--id", ids["clicks"]).returncode == 0
    other = cli(env, "new-shard").stdout.strip()
    out = cli(env, "shards", "--config", str(config))
    assert out.returncode == 0, out.stderr
    shards = json.loads(out.stdout)
    assert shards[ids["clicks"]]["name"] == "clicks"
    assert shards[other]["name"] is None
    bad = cli(env, "shards", "--config", str(tmp_path / "missing.yaml"))
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_blob_store_is_reported_when_the_client_opens(
        tmp_path: Path, s3_uri: str) -> None:
    consensus = f"sqlite:///{tmp_path / 'c.db'}"
    dead = (f"s3://bucket/p?endpoint_url=http://127.0.0.1:{_free_port()}&connect_timeout=1"
            f"&max_attempts=1")
    with pytest.raises(BlobUnavailable, match="checked when the client opened"):
        PersistClient.open(consensus, dead)
    bucket = s3_uri.split("/")[2]
    missing = s3_uri.replace(f"s3://{bucket}/", "s3://no-such-bucket-here/")
    with pytest.raises(BlobLocationNotFound, match="does not exist"):
        PersistClient.open(consensus, missing)
    with pytest.raises(BlobUnavailable):
        PersistClient.open(consensus, f"file://{tmp_path / 'ok'}", wal_blob_uri=dead)
    PersistClient.open(consensus, s3_uri).close()  # a reachable store opens as before
    PersistClient.open(consensus, dead, probe=False).close()  # unless asked not to probe
    # The CLI reports it in one line.
    out = subprocess.run([sys.executable, "-m", "persist_pipeline", "--consensus", consensus,
                          "--blob", dead, "shards"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 1 and "BlobUnavailable" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("password", ["Zq9/Xw7", "Zq9@Xw7", "Zq9:Xw7", "Zq9/Xw7@Vb5:Nm3"])
def test_a_password_with_unescaped_characters_is_refused_without_echo(password: str) -> None:
    uri = f"postgresql://persist:{password}@127.0.0.1:5432/persist"
    with pytest.raises(InvalidUri, match="percent-encode") as caught:
        PersistClient.open(uri, "mem://")
    message = str(caught.value)
    # Redacted for display (logs, Dagster metadata), the URI shows none of it either.
    shown = redact_uri(uri) + " " + redact_uri(uri + "?sslmode=require")
    assert shown.startswith("postgresql://***@127.0.0.1:5432/persist")
    for piece in {password, *password.replace("/", " ").replace("@", " ").replace(
            ":", " ").split()}:
        assert piece not in message
        assert piece not in shown
    from urllib.parse import quote

    # Percent-encoded, the same password gets past the check (to the server, which
    # refuses it: no such user here).
    escaped = f"postgresql://persist:{quote(password, safe='')}@127.0.0.1:1/persist"
    with pytest.raises(Exception) as other:
        PersistClient.open(escaped + "?connect_timeout=1", "mem://")
    assert not isinstance(other.value, InvalidUri)
