"""The ``persist-pipeline`` command on the embedded default.

Commands run in this process through ``persist_pipeline.cli.main`` with the environment,
stdout (text and binary) and stderr of a real invocation (a subprocess costs a second of
imports per command); ``test_the_installed_entry_point_runs`` runs the real executable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from persist_pipeline import PersistClient, ShardId
from tests.helpers import run_cli


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PERSIST_CONSENSUS_URI": f"sqlite:///{tmp_path / 'c.db'}",
            "PERSIST_BLOB_URI": f"file://{tmp_path / 'blobs'}"}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``persist-pipeline ARGS`` with environment ``env``, run in this process."""
    return run_cli(env, *args)


def test_the_installed_entry_point_runs(env: dict[str, str]) -> None:
    """The real executable: a command's output on stdout, an error as one line on
    stderr with exit code 2."""
    bin_dir = Path(sys.executable).parent
    exe = bin_dir / "persist-pipeline"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "persist_pipeline"]
    out = subprocess.run([*command, "new-shard"], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip().startswith("s"), out.stderr
    bad = subprocess.run([*command, "inspect", "not-a-shard!"], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_append_inspect_snapshot_compact_gc(env, tmp_path):
    shard = cli(env, "new-shard").stdout.strip()
    csv = tmp_path / "u.csv"
    csv.write_text("k,v,t,d\nalice,signup,0,1\nbob,signup,1,1\nalice,signup,2,-1\n")
    jsonl = tmp_path / "u.jsonl"
    jsonl.write_text('{"k": "carol", "v": "signup", "t": 3}\n')
    out = cli(env, "append", shard, str(csv), "--expected-upper", "0", "--new-upper", "3")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["placement"] == "inline"
    out = cli(env, "append", shard, str(jsonl), "--expected-upper", "3", "--new-upper", "4")
    assert out.returncode == 0, out.stderr
    info = json.loads(cli(env, "inspect", shard).stdout)
    assert info["upper"] == 4 and info["parts"]["inline"] == 2
    assert json.loads(cli(env, "compact", shard).stdout)["inline_bytes_after"] == 0
    snap_file = tmp_path / "snap.parquet"
    out = cli(env, "snapshot", shard, "--as-of", "3", "--out", str(snap_file))
    assert out.returncode == 0, out.stderr
    snap = pq.read_table(snap_file).to_pylist()
    assert sorted((r["k"], r["d"]) for r in snap) == [(b"bob", 1), (b"carol", 1)]
    stdout = cli(env, "snapshot", shard, "--as-of", "1").stdout
    assert stdout.splitlines()[0] == '"k","v","t","d"'
    assert len(stdout.splitlines()) == 3  # header + alice + bob, as hex
    assert cli(env, "gc", shard).returncode == 0
    shards = json.loads(cli(env, "shards").stdout)
    assert shards[shard]["upper"] == 4


def test_set_inline_max_records_the_shards_bound(env, tmp_path):
    shard = cli(env, "new-shard").stdout.strip()
    recorded = json.loads(cli(env, "inspect", shard).stdout)["inline_max_bytes_recorded"]
    out = cli(env, "set-inline-max", shard, "0")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"shard_id": shard, "inline_max_bytes": 0,
                                      "previous": recorded}
    csv = tmp_path / "u.csv"
    csv.write_text("k,v,t,d\nalice,signup,0,1\n")
    out = cli(env, "append", shard, str(csv))
    assert json.loads(out.stdout)["placement"] == "blob"  # the shard inlines nothing now
    info = json.loads(cli(env, "inspect", shard).stdout)
    assert (info["inline_max_bytes_recorded"], info["inline_max_bytes_effective"]) == (0, 0)
    for bad in ("-1", "ten", "1.5"):
        out = cli(env, "set-inline-max", shard, bad)
        assert out.returncode == 2 and "max_bytes" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    after = json.loads(cli(env, "inspect", shard).stdout)
    assert (after["seqno"], after["inline_max_bytes_recorded"]) == (info["seqno"], 0)


def test_errors_are_one_line_without_traceback(env, tmp_path):
    shard = cli(env, "new-shard").stdout.strip()
    bad = tmp_path / "bad.csv"
    bad.write_text("k,v,t,d\nalice,signup,0,1\nbob,signup,notanumber,1\n")
    out = cli(env, "append", shard, str(bad), "--expected-upper", "0", "--new-upper", "3")
    assert out.returncode == 2
    assert "bad.csv: line 3" in out.stderr and "Traceback" not in out.stderr
    assert json.loads(cli(env, "inspect", shard).stdout)["upper"] == 0  # nothing written
    # Neither an id nor a registered name: not found (exit 1), saying why it is no id.
    out = cli(env, "inspect", "s-nope")
    assert out.returncode == 1 and "malformed shard id" in out.stderr
    out = cli(env, "inspect", "s00000000-0000-4000-8000-000000000000")
    assert out.returncode == 1 and "ShardNotFound" in out.stderr
    out = cli({**env, "PERSIST_BLOB_URI": "ftp://x"}, "inspect", shard)
    assert out.returncode == 2 and "ftp" in out.stderr and "Traceback" not in out.stderr
    out = cli(env, "snapshot", shard, "--as-of", "-3")
    assert out.returncode == 2 and "non-negative" in out.stderr
    out = cli(env, "append", shard, str(tmp_path / "missing.csv"), "--expected-upper", "0",
              "--new-upper", "1")
    assert out.returncode == 2 and "no such file" in out.stderr


def test_help_lists_the_commands(env):
    out = cli(env, "--help")
    for command in ("inspect", "append", "snapshot", "compact", "gc"):
        assert command in out.stdout


@pytest.mark.parametrize("args", [["--writers", "0"], ["--seconds", "-1"],
                                  ["--fault-rate", "0.9"], ["--writers", "x"]])
def test_nemesis_rejects_bad_options_before_starting_anything(env, tmp_path, args):
    out = cli(env, "nemesis", "--workdir", str(tmp_path / "w"), *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert not (tmp_path / "w").exists()  # nothing was started or written


def test_nemesis_needs_a_location(tmp_path):
    bare = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    out = cli(bare, "nemesis", "--seconds", "1")
    assert out.returncode == 2 and "--consensus" in out.stderr


def test_typed_shard_append_snapshot_and_inspect(env, tmp_path):
    import pyarrow as pa

    from persist_pipeline import PersistClient, ShardId, ShardSchema

    shard = str(ShardId.new())
    schema = ShardSchema([("id", pa.int64())], [("name", pa.string()),
                                                ("tags", pa.list_(pa.string()))])
    with PersistClient.open(env["PERSIST_CONSENSUS_URI"], env["PERSIST_BLOB_URI"]) as client:
        client.open_writer(shard, schema=schema).expire()
    csv = tmp_path / "typed.csv"
    csv.write_text("id,name,t\n1,alice,0\n2,,0\n")
    out = cli(env, "append", shard, str(csv), "--expected-upper", "0", "--new-upper", "1")
    assert out.returncode == 0, out.stderr
    jsonl = tmp_path / "typed.jsonl"
    jsonl.write_text('{"id": 3, "name": "carol", "tags": ["x", "y"], "t": 1}\n')
    out = cli(env, "append", shard, str(jsonl), "--expected-upper", "1", "--new-upper", "2")
    assert out.returncode == 0, out.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("id,name,t\nnot-a-number,x,2\n")
    out = cli(env, "append", shard, str(bad), "--expected-upper", "2", "--new-upper", "3")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    info = json.loads(cli(env, "inspect", shard).stdout)
    assert info["upper"] == 2 and "id: int64" in info["schema"]
    lines = cli(env, "snapshot", shard, "--as-of", "1").stdout.splitlines()
    assert lines[0] == '"id","name","tags","t","d"'
    assert lines[1:] == ['1,"alice",,1,1', '2,,,1,1', '3,"carol","[""x"", ""y""]",1,1']
    out_file = tmp_path / "typed.parquet"
    out = cli(env, "snapshot", shard, "--as-of", "1", "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    table = pq.read_table(out_file)
    assert table.schema.field("tags").type == pa.list_(pa.string())
    assert sorted(table.column("id").to_pylist()) == [1, 2, 3]


def test_unix_pipes_and_missing_folders_read_as_a_user_expects(env, tmp_path):
    """`| head` ends the command quietly; a missing output folder names the folder; an
    unknown name suggests the CLI's own --create."""
    shard = cli(env, "new-shard").stdout.strip()
    csv = tmp_path / "u.csv"
    csv.write_text("k,v,t,d\n" + "".join(f"k{i},v,0,1\n" for i in range(5000)))
    assert cli(env, "append", shard, str(csv), "--expected-upper", "0",
               "--new-upper", "1").returncode == 0
    exe = Path(sys.executable).parent / "persist-pipeline"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "persist_pipeline"]
    piped = subprocess.run(" ".join([*command, "snapshot", shard, "--as-of", "0"]) +
                           " | head -n 2", shell=True, env=env, capture_output=True,
                           text=True, timeout=120, check=False)
    assert len(piped.stdout.splitlines()) == 2 and piped.stderr == ""
    missing = cli(env, "snapshot", shard, "--as-of", "0", "--out",
                  str(tmp_path / "no-such-dir" / "out.csv"))
    assert missing.returncode != 0 and "None" not in missing.stderr
    assert "no-such-dir" in missing.stderr or "No such file" in missing.stderr
    unknown = cli(env, "resolve", "nothing-here")
    assert unknown.returncode != 0 and "resolve --create nothing-here" in unknown.stderr


def test_every_command_shows_examples_that_parse() -> None:
    """``COMMAND --help`` ends with examples, each of which the parser accepts, and no
    help text carries reStructuredText markup."""
    import shlex

    from persist_pipeline.cli import EXAMPLES, build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(EXAMPLES) == set(commands)
    assert "``" not in parser.format_help()
    for name, sub in commands.items():
        text = sub.format_help()
        assert "examples:" in text and "``" not in text, name
        for example in EXAMPLES[name]:
            args = parser.parse_args(shlex.split(example))
            assert args.command == name, example


def test_json_output_is_for_people(env):
    """Epoch times as ISO 8601, floats rounded, no empty 'skipped' reason."""
    shard = cli(env, "new-shard").stdout.strip()
    info = json.loads(cli(env, "inspect", shard).stdout)
    assert "walltime_ms" not in info and info["walltime"].endswith("Z")
    assert info["walltime"][:4].isdigit() and "T" in info["walltime"]
    gc = json.loads(cli(env, "gc", shard).stdout)
    assert "skipped" not in gc
    assert len(str(gc["duration_s"]).split(".")[-1]) <= 3


def test_create_with_a_name_registers_the_name_and_creates_the_shard(env, tmp_path):
    """`append NAME FILE --create` (the help's own example) and `resolve NAME --create`
    both leave a named shard that exists, as `new-shard --name` does: inspect and shards
    see it."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"k": "a", "v": "x", "t": 0}\n')
    out = cli(env, "append", "new/shard", str(rows), "--create")
    assert out.returncode == 0, out.stderr
    names = json.loads(cli(env, "names").stdout)
    assert set(names) == {"new/shard"}
    assert json.loads(cli(env, "inspect", "new/shard").stdout)["upper"] == 1
    later = tmp_path / "later.jsonl"
    later.write_text('{"k": "b", "v": "y", "t": 1}\n')
    again = cli(env, "append", "new/shard", str(later), "--create")
    assert again.returncode == 0, again.stderr  # the same shard, not a second one
    assert json.loads(cli(env, "names").stdout) == names
    assert json.loads(cli(env, "inspect", "new/shard").stdout)["upper"] == 2
    missing = cli(env, "append", "other/shard", str(rows))
    assert missing.returncode == 1 and "other/shard" in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"k": "a", "v": "x"}\n')
    refused = cli(env, "append", "other/shard", str(bad), "--create")
    assert refused.returncode == 2 and "bad.jsonl: line 1" in refused.stderr
    assert "other/shard" not in json.loads(cli(env, "names").stdout)  # nothing written
    # Bounds the append would refuse are refused before the name or the shard is made.
    for bounds, error in ((["--expected-upper", "3", "--new-upper", "2"], "must be beyond"),
                          (["--expected-upper", "3"], "times must lie in [3, 4)"),
                          (["--new-upper", "0"], "must be beyond")):
        refused = cli(env, "append", "other/shard", str(rows), "--create", *bounds)
        assert refused.returncode == 2 and error in refused.stderr, refused.stderr
    assert "other/shard" not in json.loads(cli(env, "names").stdout)
    assert len(json.loads(cli(env, "shards").stdout)) == 1

    resolved = cli(env, "resolve", "made/by-resolve", "--create")
    assert resolved.returncode == 0, resolved.stderr
    shard = resolved.stdout.strip()
    info = cli(env, "inspect", "made/by-resolve")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["upper"] == 0
    assert shard in json.loads(cli(env, "shards").stdout)
    assert cli(env, "resolve", "made/by-resolve", "--create").stdout.strip() == shard


@pytest.mark.parametrize("target", ["no-such-dir/snap.csv", "no-such-dir/snap.parquet",
                                    "a-dir.parquet", "a-dir.csv", "a-file.csv/snap.csv"])
def test_snapshot_out_that_cannot_be_written_is_bad_input_naming_it(env, tmp_path, target):
    """--out in a missing folder, or naming a folder, is refused before reading: exit 2,
    one line naming the path, nothing written (no .partial file either)."""
    shard = cli(env, "new-shard").stdout.strip()
    (tmp_path / "a-dir.parquet").mkdir()
    (tmp_path / "a-dir.csv").mkdir()
    (tmp_path / "a-file.csv").write_text("")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    out = cli(env, "snapshot", shard, "--as-of", "latest", "--out", str(tmp_path / target))
    assert out.returncode == 2, out.stderr
    assert "invalid input" in out.stderr and str(tmp_path / target) in out.stderr
    assert ".partial" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_append_takes_an_excel_csv_and_refuses_extra_columns(env, tmp_path):
    shard = cli(env, "new-shard").stdout.strip()
    excel = tmp_path / "excel.csv"
    excel.write_bytes("k,v,t\r\nalice,signup,0\r\n".encode("utf-8-sig"))
    out = cli(env, "append", shard, str(excel))
    assert out.returncode == 0, out.stderr
    extra = tmp_path / "extra.csv"
    extra.write_text("k,v,t,amount\nbob,signup,1,3\n")
    out = cli(env, "append", shard, str(extra))
    assert out.returncode == 2 and "amount" in out.stderr
    assert json.loads(cli(env, "inspect", shard).stdout)["upper"] == 1  # nothing written


#: A file of updates outside the test's folder (which must stay empty).
_ROWS = Path(__file__).parent / "fixtures" / "cli_rows.jsonl"

#: Commands that only read, or need an existing shard (append without --create).
READ_ONLY = [["shards"], ["names"], ["resolve", "orders"], ["inspect", "orders"],
             ["snapshot", "orders", "--as-of", "0"], ["plan", "orders"],
             ["compact", "orders"], ["gc", "orders"], ["append", "orders", str(_ROWS)],
             ["set-inline-max", "orders", "100"]]


@pytest.mark.parametrize("command", READ_ONLY, ids=lambda c: c[0])
def test_a_read_only_command_at_a_missing_location_creates_nothing(
        tmp_path: Path, command: list[str]) -> None:
    """A mistyped location is reported, not made into an empty store: a command that
    only reads, or needs a shard that exists, opens the consensus database and blob
    folder without creating either."""
    typo = {**os.environ, "PERSIST_CONSENSUS_URI": f"sqlite:///{tmp_path / 'typo.db'}",
            "PERSIST_BLOB_URI": f"file://{tmp_path / 'typo-blobs'}"}
    out = cli(typo, *command)
    assert out.returncode == 1, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "ConsensusLocationNotFound: no store at" in line and "typo.db" in line, line
    assert list(tmp_path.iterdir()) == []

    # The consensus exists, its blob folder does not (mistyped): reported, not made.
    env = {**typo, "PERSIST_BLOB_URI": f"file://{tmp_path / 'blobs'}"}
    assert cli(env, "new-shard", "--name", "orders").returncode == 0
    made = sorted(p.name for p in tmp_path.iterdir())
    out = cli(typo, *command)
    assert out.returncode == 1, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "BlobLocationNotFound" in line and "typo-blobs" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == made


def test_commands_that_create_shards_create_the_location(tmp_path: Path) -> None:
    env = {**os.environ, "PERSIST_CONSENSUS_URI": f"sqlite:///{tmp_path / 'new.db'}",
           "PERSIST_BLOB_URI": f"file://{tmp_path / 'new-blobs'}"}
    out = cli(env, "resolve", "--create", "orders")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "new.db").is_file() and (tmp_path / "new-blobs").is_dir()
    assert json.loads(cli(env, "names").stdout) == {"orders": out.stdout.strip()}


@pytest.mark.parametrize("command", [["names"], ["new-shard"]], ids=lambda c: c[0])
def test_a_postgres_uri_without_a_database_is_bad_input(tmp_path: Path,
                                                       command: list[str]) -> None:
    env = {**os.environ, "PERSIST_CONSENSUS_URI": "postgresql://app:hunter2secret@127.0.0.1:1",
           "PERSIST_BLOB_URI": f"file://{tmp_path / 'blobs'}"}
    out = cli(env, *command)
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "names no database" in line and "hunter2secret" not in out.stderr + out.stdout
    assert list(tmp_path.iterdir()) == []


def test_append_create_at_an_upper_a_new_shard_has_not_creates_nothing(env, tmp_path):
    """A new shard's upper is 0: `append --create` at another expected upper (times
    inside its bounds) is refused with UpperMismatch before the name is registered or
    the shard created, as bounds and times it would refuse already were; it registered
    the name and created an empty shard, then was refused at the commit."""
    rows = tmp_path / "rows.csv"
    rows.write_text("k,v,t\na,x,5\n")
    refused = cli(env, "append", "late/shard", str(rows), "--create",
                  "--expected-upper", "3", "--new-upper", "9")
    assert refused.returncode == 1 and "UpperMismatch" in refused.stderr, refused.stderr
    assert "expected 3, shard upper is 0" in refused.stderr
    assert json.loads(cli(env, "names").stdout) == {}
    assert json.loads(cli(env, "shards").stdout) == {}
    # A registered name whose shard is not created yet: nothing created either.
    registered = ShardId.new()
    with PersistClient.open(env["PERSIST_CONSENSUS_URI"], env["PERSIST_BLOB_URI"]) as client:
        client.register_name("named/later", registered)
    refused = cli(env, "append", "named/later", str(rows), "--create",
                  "--expected-upper", "3", "--new-upper", "9")
    assert refused.returncode == 1 and "UpperMismatch" in refused.stderr, refused.stderr
    assert json.loads(cli(env, "shards").stdout) == {}
    done = cli(env, "append", "late/shard", str(rows), "--create",
               "--expected-upper", "0", "--new-upper", "9")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["upper"] == 9


def test_a_file_name_that_is_not_utf8_is_bad_input_or_read(env, tmp_path):
    """A name that is not UTF-8 (its bytes as Python passes them, surrogate-escaped):
    files Arrow would open (Parquet, typed files, ``--out``, ``--schema`` of Parquet) are
    refused as bad input naming the file, one line, exit 2, nothing written; an untyped
    CSV, which Python opens, is appended as under any other name."""
    import pyarrow as pa

    shard = cli(env, "new-shard").stdout.strip()
    odd = os.fsdecode(b"caf\xe9")  # Latin-1 bytes: not UTF-8
    csv = tmp_path / f"{odd}.csv"
    csv.write_text("k,v,t,d\na,1,0,1\n")
    assert cli(env, "append", shard, str(csv), "--expected-upper", "0",
               "--new-upper", "1").returncode == 0
    parquet = tmp_path / f"{odd}.parquet"
    with parquet.open("wb") as f:
        pq.write_table(pa.table({"k": [b"b"], "v": [b"1"], "t": [1], "d": [1]}), f)
    refused = [
        cli(env, "append", shard, str(parquet), "--expected-upper", "1", "--new-upper", "2"),
        cli(env, "snapshot", shard, "--as-of", "0", "--out", str(tmp_path / f"{odd}-out.csv")),
        cli(env, "new-shard", "--schema", str(parquet)),
    ]
    for result in refused:
        assert result.returncode == 2, result.stderr
        assert "not valid UTF-8" in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*-out.csv"))
    shown = json.loads(cli(env, "inspect", shard).stdout)
    assert shown["upper"] == 1
    assert len(json.loads(cli(env, "shards").stdout)) == 1
