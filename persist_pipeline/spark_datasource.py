"""The PySpark classes of the ``persist`` data source (the Python Data Source API).

This module imports PySpark (the ``spark`` extra); only
:func:`persist_pipeline.spark_source.register` imports it. What the classes run (planning
a read, reading a partition, uploading a task's parts, committing or aborting a write)
lives in :mod:`persist_pipeline.spark_source`, which imports PySpark only inside the
functions that build Spark types, so the deterministic simulation runs those functions
without PySpark installed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from persist_pipeline.internal.extras import missing_extra

try:
    import pyspark  # noqa: F401
except ModuleNotFoundError as e:
    raise missing_extra("the persist Spark data source needs PySpark 4", "spark",
                        "pyspark>=4", e) from e

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from persist_pipeline.internal.compat import check_same_code, code_fingerprint
from persist_pipeline.internal.state import HollowPart
from persist_pipeline.spark_source import (
    FORMAT,
    SPARK_SCHEMA,
    _abort,
    _commit,
    _Location,
    _read_partition,
    _ReadPartition,
    _shard_schema,
    _write_job,
    _write_task,
    _WriteJob,
    make_read_plan,
    spark_struct,
)

__all__ = ["PersistCommitMessage", "PersistDataSource", "PersistReader", "PersistWriter"]



class PersistInputPartition(InputPartition):
    """One key range of a read (see :func:`plan_partitions`)."""

    def __init__(self, partition: _ReadPartition) -> None:
        super().__init__(partition.index)
        self.partition = partition


class PersistReader(DataSourceReader):
    """Planned in a Python worker of the driver, pickled to the executors."""

    def __init__(self, options: Mapping[str, str], declared: StructType | None = None
                 ) -> None:
        (self.location, self.as_of, self._partitions, self.lease_s,
         self.schema, self.reader_id, self.columns) = make_read_plan(options, declared)
        self.fingerprint = code_fingerprint()

    def partitions(self) -> Sequence[InputPartition]:
        return [PersistInputPartition(p) for p in self._partitions]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, PersistInputPartition)
        # Unset in a reader planned by a version without the field: getattr's default.
        check_same_code(getattr(self, "fingerprint", None), "planner", "executor")
        return _read_partition(self.location, self.as_of, partition.partition, self.lease_s,
                               self.schema, self.columns, self.reader_id)


@dataclass
class PersistCommitMessage(WriterCommitMessage):
    """What one write task uploaded."""

    parts: tuple[HollowPart, ...]
    num_updates: int
    #: The largest ``|d|`` of the task's rows (see :func:`_write_task`).
    diff_bound: int
    #: The persist-pipeline of the executor that made it (the message is made there):
    #: the driver refuses to commit another's parts.
    fingerprint: str = field(default_factory=code_fingerprint)


class PersistWriter(DataSourceArrowWriter):
    """Tasks upload parts; the driver commits them all with one compare_and_append."""

    def __init__(self, job: _WriteJob) -> None:
        self.job = job

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return PersistCommitMessage(*_write_task(self.job, iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _commit(self.job, [m for m in messages if isinstance(m, PersistCommitMessage)])

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        _abort(self.job, [m for m in messages if isinstance(m, PersistCommitMessage)])


class PersistDataSource(DataSource):
    """``format("persist")``: a shard's consolidated collection at ``as_of``; appends."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str | StructType:
        writing = any(k.lower() in ("expected_upper", "new_upper") for k in self.options)
        typed = _shard_schema(_Location.from_options(self.options, writing=writing),
                              writing=writing)
        return SPARK_SCHEMA if typed is None else spark_struct(typed)

    def reader(self, schema: StructType) -> DataSourceReader:
        return PersistReader(self.options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return PersistWriter(_write_job(self.options, overwrite, _arrow_columns(schema)))


def _arrow_columns(schema: StructType) -> pa.Schema | None:
    """A DataFrame's columns as Arrow types (None: a type Arrow has not, left to the
    tasks to refuse)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    try:
        return to_arrow_schema(schema, timezone="UTC")
    except (TypeError, ValueError):
        return None
