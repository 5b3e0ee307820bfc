"""A Spark driver and executors that run different persist-pipelines (a cluster whose
workers were not upgraded with the driver) are refused with :class:`VersionMismatch`,
naming both, before anything is written or committed: tasks carry the driver's
fingerprint (version, state format and sources), results and commit messages the executor's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_pipeline import InlinePolicy, PersistClient, ShardId, VersionMismatch
from persist_pipeline.internal.compat import check_same_code, code_fingerprint, source_digest
from persist_pipeline.spark import (
    SparkCompactionFailed,
    _run_task,
    _Task,
    _TaskResult,
    compact_shards,
    drive_compaction,
)
from tests.pipeline_support import spark_session

__all__ = ["spark_session"]  # a fixture, imported for pytest

#: What an executor or driver of another version sends.
OTHER = "0.0.9+0123456789ab"


def _location(tmp_path: Path) -> tuple[PersistClient, str]:
    blob = f"file://{tmp_path}/blob"
    (tmp_path / "blob").mkdir()
    client = PersistClient.open(f"sqlite:///{tmp_path}/c.db", blob,
                                inline_policy=InlinePolicy(4096, 1 << 20))
    return client, blob


def _shard_with_work(client: PersistClient) -> ShardId:
    """A shard with a pending merge: inline writes and one Parquet part."""
    shard = ShardId.new()
    with client.open_writer(shard) as w:
        for t in range(6):
            rows = 2000 if t == 2 else 5
            w.compare_and_append([(b"k%05d" % (j * 7 % 997), b"v%d" % t, t, 1)
                                  for j in range(rows)], t, t + 1)
    return shard


def _parquet_files(tmp_path: Path) -> set[Path]:
    return set((tmp_path / "blob").rglob("*.parquet"))


def test_the_fingerprint_names_the_version_and_the_state_format() -> None:
    from persist_pipeline import __version__

    mine = code_fingerprint()
    assert mine.startswith(f"{__version__}+") and len(mine.split("+")[1]) == 12
    check_same_code(mine, "driver", "executor")  # the same code: no error
    for theirs in (OTHER, None, ""):
        with pytest.raises(VersionMismatch, match="must run the same version") as raised:
            check_same_code(theirs, "driver", "executor")
        assert mine in str(raised.value)
    assert isinstance(VersionMismatch("x"), ValueError)  # an InvalidConfig


def test_the_fingerprint_changes_with_any_source_file_within_one_version(
        tmp_path: Path) -> None:
    """Pickled dataclasses can change without a new version number or state format (a
    field added to a task): a copy of the package with one changed source file has
    another digest; an identical copy (another install of the same release), as a
    folder or zipped as Spark's ``--py-files`` ships it, the same."""
    import importlib.resources
    import shutil
    import zipfile

    package = importlib.resources.files("persist_pipeline")
    mine = source_digest(package)
    assert code_fingerprint().split("+")[1] != mine[:12]  # the state format is in too
    copy = tmp_path / "persist_pipeline"
    shutil.copytree(str(package), copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == mine
    zipped = tmp_path / "deps.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        for path in sorted(copy.rglob("*")):
            z.write(path, path.relative_to(tmp_path).as_posix())
    assert source_digest(zipfile.Path(zipped, "persist_pipeline/")) == mine
    spark = copy / "spark.py"
    spark.write_text(spark.read_text() + "# one line more\n")
    assert source_digest(copy) != mine


def _in_process(change: Any) -> Any:
    """A task runner that runs the tasks here, then passes each result through
    ``change`` (the results an executor of another version would return)."""
    def run(tasks: list[_Task]) -> tuple[list[_TaskResult], str]:
        return [change(_run_task(t)) for t in tasks], "in-process"
    return run


def _without_fingerprint(result: _TaskResult) -> _TaskResult:
    """A result as a version without the field sends it: the slot unset once decoded."""
    object.__delattr__(result, "fingerprint")
    return result


@pytest.mark.parametrize("change", [
    lambda r: dataclasses.replace(r, fingerprint=OTHER),
    _without_fingerprint,
], ids=["another-version", "a-version-without-fingerprints"])
def test_the_driver_commits_no_result_of_an_executor_of_another_version(
        tmp_path: Path, change: Any) -> None:
    client, blob = _location(tmp_path)
    shard = _shard_with_work(client)
    before, files = client.inspect(shard), _parquet_files(tmp_path)
    with pytest.raises(SparkCompactionFailed) as raised:
        drive_compaction(_in_process(change), client, [shard], blob_uri=blob)
    assert list(raised.value.failures) == [str(shard)]
    assert "VersionMismatch" in str(raised.value) and code_fingerprint() in str(raised.value)
    # Nothing committed, and the parts the tasks wrote were deleted.
    assert client.inspect(shard)["seqno"] == before["seqno"]
    assert _parquet_files(tmp_path) == files
    # The same work from executors of this version commits.
    drive_compaction(_in_process(lambda r: r), client, [shard], blob_uri=blob)
    assert client.inspect(shard)["parts"]["inline"] == 0
    client.close()


def test_an_executor_refuses_a_task_of_a_driver_of_another_version(tmp_path: Path) -> None:
    client, blob = _location(tmp_path)
    shard = _shard_with_work(client)
    files = _parquet_files(tmp_path)
    tasks: list[_Task] = []

    def capture(planned: list[_Task]) -> tuple[list[_TaskResult], str]:
        tasks.extend(planned)
        return [], "captured"

    with pytest.raises(SparkCompactionFailed):
        drive_compaction(capture, client, [shard], blob_uri=blob)
    assert tasks and {t.fingerprint for t in tasks} == {code_fingerprint()}
    task = tasks[0]
    result = _run_task(dataclasses.replace(task, fingerprint=OTHER))
    assert result.res is None and result.error is not None
    assert result.error.startswith("VersionMismatch") and OTHER in result.error
    assert result.fingerprint == code_fingerprint()
    assert _parquet_files(tmp_path) == files  # it wrote nothing
    client.close()


@pytest.mark.spark
@pytest.mark.slow
def test_compaction_on_spark_refuses_executors_of_another_version(
        tmp_path: Path, spark_session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver here says it runs another version; its executors (Spark's Python
    workers, processes of their own) run this one: every task is refused, nothing is
    written or committed, and the error names both versions."""
    client, blob = _location(tmp_path)
    shard = _shard_with_work(client)
    before, files = client.inspect(shard), _parquet_files(tmp_path)
    monkeypatch.setattr("persist_pipeline.spark.code_fingerprint", lambda: OTHER)
    with pytest.raises(SparkCompactionFailed) as raised:
        compact_shards(spark_session, client, [shard], blob_uri=blob)
    message = str(raised.value)
    assert "VersionMismatch" in message and OTHER in message
    assert code_fingerprint() in message
    assert client.inspect(shard)["seqno"] == before["seqno"]
    assert _parquet_files(tmp_path) == files
    monkeypatch.undo()
    compact_shards(spark_session, client, [shard], blob_uri=blob)
    assert client.inspect(shard)["parts"]["inline"] == 0
    client.close()


def test_a_data_source_write_across_versions_writes_and_commits_nothing(
        tmp_path: Path) -> None:
    """A task planned by a driver of another version uploads nothing; a commit message
    from an executor of another version (or one that sends none) is refused before the
    commit, and the abort that follows deletes the write's parts."""
    from persist_pipeline.spark_datasource import PersistCommitMessage
    from persist_pipeline.spark_source import _abort, _commit, _write_job, _write_task

    client, blob = _location(tmp_path)
    shard = ShardId.new()
    opts = {"consensus": f"sqlite:///{tmp_path}/c.db", "blob": blob,
            "shard": str(shard), "expected_upper": "0", "new_upper": "1"}
    job = _write_job(opts, overwrite=False)
    assert job.fingerprint == code_fingerprint()
    batch = pa.RecordBatch.from_pylist([{"k": b"a", "v": b"b", "t": 0, "d": 1}])
    files = _parquet_files(tmp_path)
    with pytest.raises(VersionMismatch, match=re.escape(OTHER)):
        _write_task(dataclasses.replace(job, fingerprint=OTHER), iter([batch]))
    assert _parquet_files(tmp_path) == files

    message = PersistCommitMessage(*_write_task(job, iter([batch])))
    assert message.fingerprint == code_fingerprint()
    seqno = client.inspect(shard)["seqno"]
    old = PersistCommitMessage(message.parts, message.num_updates, message.diff_bound)
    del old.fingerprint  # as a version without the field sends it
    for foreign in (dataclasses.replace(message, fingerprint=OTHER), old):
        with pytest.raises(VersionMismatch):
            _commit(job, [foreign])
        assert client.inspect(shard)["seqno"] == seqno
    _abort(job, [message])
    assert _parquet_files(tmp_path) == files
    client.close()


@pytest.mark.parametrize("error", ["PartMissing", "PartChecksumMismatch", "CorruptPart"])
def test_a_task_that_could_not_read_inputs_replaced_meanwhile_is_obsolete_not_failed(
        tmp_path: Path, error: str) -> None:
    """Every kind of unreadable input (a CorruptPart, of whichever subclass) makes a
    request whose inputs a newer state no longer holds obsolete, as in process; one
    whose inputs are still there fails."""
    client, blob = _location(tmp_path)
    shard = _shard_with_work(client)

    def unreadable(tasks: list[_Task]) -> tuple[list[_TaskResult], str]:
        return [_TaskResult(t.index, t.shard_id, None, f"{error}: part gone or changed",
                            0.0, 0.0, code_fingerprint()) for t in tasks], "unreadable"

    with pytest.raises(SparkCompactionFailed, match=error):
        drive_compaction(unreadable, client, [shard], blob_uri=blob)

    def replaced_meanwhile(tasks: list[_Task]) -> tuple[list[_TaskResult], str]:
        client.compact(shard)  # another compactor replaces the inputs first
        return unreadable(tasks)

    metrics = drive_compaction(replaced_meanwhile, client, [shard], blob_uri=blob)
    assert metrics[str(shard)]["obsolete"] >= 1 and metrics[str(shard)]["failed_tasks"] == 0
    client.close()
