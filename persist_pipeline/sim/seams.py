"""Simulated clients of the features that meet at seams: typed writers with schema
evolution (some opened before an evolution), upserts and deletes, Spark data-source
writes (the driver's and the executors' functions, with a retried task and a schema
recorded mid-job), name registration, huge diffs, and a listen after the largest time.

Each runs the library's real code on shards of its own beside the main one, and checks
what it is told against :class:`TypedModel` or its own exact bookkeeping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist_pipeline import spark_source
from persist_pipeline.exceptions import (
    BackendError,
    CommitDeadlineExceeded,
    CorruptData,
    DiffOverflow,
    Indeterminate,
    InvalidFrontier,
    InvalidUpdates,
    LeaseExpired,
    NotYetAvailable,
    PersistError,
    SchemaMismatch,
    ShardNotFound,
    SinceViolation,
    UnsettledCommit,
    UpperMismatch,
)
from persist_pipeline.frontier import MAX_TIME
from persist_pipeline.ids import ShardId
from persist_pipeline.internal.compat import code_fingerprint
from persist_pipeline.schema import ShardSchema
from persist_pipeline.sim.scheduler import Process

if TYPE_CHECKING:
    from persist_pipeline.client import PersistClient
    from persist_pipeline.sim.runner import SimRun

#: The typed shard's schema as it evolves: nullable value columns appended.
VERSIONS = (
    ShardSchema({"id": pa.int64()}, {"a": pa.string()}),
    ShardSchema({"id": pa.int64()}, {"a": pa.string(), "b": pa.int64()}),
    ShardSchema({"id": pa.int64()}, {"a": pa.string(), "b": pa.int64(), "c": pa.string()}),
)
#: The name every typed client resolves (racing to create it).
TYPED_NAME = "sim/typed"
#: Keys that upserts and deletes fight over; Spark appends use ids from APPEND_BASE up.
UPSERT_KEYS = 10
APPEND_BASE = 1000
Value = tuple[Any, ...]  # (a, b, c): None where a column is null or absent
MAX_DIFF = (1 << 63) - 1
MIN_DIFF = -(1 << 63)


@dataclass
class KeyOp:
    """One upsert or delete as it touched one key."""

    time: int
    value: Value | None  # None: deleted
    status: str = "pending"  # pending | acked | failed | unknown


@dataclass
class Append:
    """One typed Spark write: rows of fresh ids at one time, all or nothing."""

    time: int
    rows: dict[int, Value]
    status: str = "pending"


@dataclass
class Recommit:
    """A Spark write to commit again: its job, its tasks' messages and tables, its first
    outcome, and the typed model's entry of it (None for an untyped write)."""

    job: Any
    messages: list[Any]
    tables: list[pa.Table]
    status: str
    append: Append | None = None


@dataclass
class TypedModel:
    """What typed clients were told, and the check of each typed snapshot."""

    violations: list[str]
    ops: dict[int, list[KeyOp]] = field(default_factory=dict)
    appends: dict[int, Append] = field(default_factory=dict)

    def allowed(self, key: int, as_of: int) -> list[Value | None]:
        """The values ``key`` may have at ``as_of``: the latest op that certainly
        committed decides, and any op after it whose outcome is unknown may."""
        out: list[Value | None] = []
        for op in sorted((o for o in self.ops.get(key, []) if o.time <= as_of),
                         key=lambda o: o.time, reverse=True):
            if op.status == "acked":
                out.append(op.value)
                return out
            if op.status in ("unknown", "pending"):
                out.append(op.value)
        out.append(None)
        return out

    def check(self, as_of: int, table: pa.Table, where: str) -> None:
        seen: dict[int, Value] = {}
        for row in table.to_pylist():
            key = row["id"]
            if row["d"] != 1 or row["t"] != as_of or key in seen:
                self.violations.append(f"{where}: key {key} has diff {row['d']} at "
                                       f"{row['t']} (DUPLICATED or wrong time)")
            seen[key] = (row.get("a"), row.get("b"), row.get("c"))
        for key in range(UPSERT_KEYS):
            got = seen.get(key)
            if got not in self.allowed(key, as_of):
                self.violations.append(f"{where}: key {key} reads {got}, the model allows "
                                       f"{self.allowed(key, as_of)} at {as_of}")
        for n, append in self.appends.items():
            present = [seen.get(i) == v for i, v in append.rows.items()]
            if append.time > as_of:
                present = [seen.get(i) is not None for i in append.rows]
                if any(present):
                    self.violations.append(f"{where}: PHANTOM Spark write {n} before its time")
                continue
            if all(present):
                if append.status == "failed":
                    self.violations.append(f"{where}: Spark write {n} was refused but is "
                                           f"visible")
            elif any(present) or any(seen.get(i) is not None for i in append.rows):
                self.violations.append(f"{where}: Spark write {n} is partly visible")
            elif append.status == "acked":
                self.violations.append(f"{where}: LOST acknowledged Spark write {n}")
        known = {i for a in self.appends.values() for i in a.rows}
        for key in seen:
            if key >= UPSERT_KEYS and key not in known:
                self.violations.append(f"{where}: PHANTOM row id {key}")


@dataclass
class StoredTable:
    """A table a table writer stored: its canonical rows and the logical times its store
    started and returned (``ended`` None: still running, or its outcome unknown)."""

    rows: list[str]
    started: int
    ended: int | None = None


def fresh_tables(stored: list[StoredTable], load_started: int, load_ended: int
                 ) -> list[list[str]]:
    """The tables a load over ``[load_started, load_ended]`` may return, as a register
    does: any store that started before the load returned, except one that a later
    store wholly followed (started after it returned, and returned before the load
    started)."""
    latest_start = max((t.started for t in stored
                        if t.ended is not None and t.ended < load_started), default=0)
    return [t.rows for t in stored if t.started < load_ended
            and (t.ended is None or t.ended >= latest_start)]


@dataclass
class SeamState:
    """What the seam actors of one seed share."""

    typed_shard: str = ""
    names: dict[str, str] = field(default_factory=dict)
    model: TypedModel | None = None
    versions_recorded: int = 0
    appends: int = 0
    #: Every table a table writer tried to store, with when its store ran.
    tables: list[StoredTable] = field(default_factory=list)
    #: A logical clock of the table writers' calls (the scheduler runs one at a time).
    table_events: int = 0
    #: Each committed store's generation name, the upper it reported and its rows: a
    #: load pinned to that upper must return exactly those rows and columns.
    pinned: list[tuple[str, int, list[str]]] = field(default_factory=list)
    #: Spark writes to commit again later (see _commit_again).
    recommits: list[Recommit] = field(default_factory=list)
    #: State of actors defined in other modules (by their own key).
    extra: dict[str, Any] = field(default_factory=dict)

    def table_event(self) -> int:
        self.table_events += 1
        return self.table_events


def _model(run: SimRun) -> TypedModel:
    if run.seams.model is None:
        run.seams.model = TypedModel(run.violations)
    return run.seams.model


def resolve(run: SimRun, client: PersistClient, name: str) -> str | None:
    """Resolve ``name`` (creating it), checking every resolver of a name gets one id."""
    while not run.stopping:
        try:
            shard = str(client.resolve(name, create=True))
        except Indeterminate:
            run.think()
            continue
        except PersistError as e:
            run.violation(f"resolve {name!r}: unexpected {type(e).__name__}: {e}")
            return None
        first = run.seams.names.setdefault(name, shard)
        if first != shard:
            run.violation(f"name {name!r} resolved to {shard}, earlier to {first}")
        return shard
    return None


def _typed_shard(run: SimRun, client: PersistClient) -> str | None:
    shard = resolve(run, client, TYPED_NAME)
    if shard is not None:
        run.seams.typed_shard = shard
    return shard


def _attempt(run: SimRun, what: str, op: Callable[..., object],
             *args: object) -> tuple[str, object]:
    """Run ``op(*args)``; its outcome as ``acked`` / ``failed`` / ``unknown``, and the
    result."""
    try:
        return "acked", op(*args)
    except (UpperMismatch, CommitDeadlineExceeded):
        return "failed", None
    except UnsettledCommit as e:
        return "unknown", e
    except Indeterminate:
        return "unknown", None
    except PersistError as e:
        run.violation(f"{what}: unexpected {type(e).__name__}: {e}")
        return "unknown", None


# --- typed writers ------------------------------------------------------------------------


def _value(run: SimRun, version: int) -> Value:
    rng = run.rng
    a = rng.choice(["x", "yy", "", None, "zzz"])
    b = rng.choice([None, 0, 7, -(1 << 62)]) if version >= 1 else None
    c = rng.choice([None, "c", "cc"]) if version >= 2 else None
    return (a, b, c)


def typed_writer(run: SimRun, proc: Process) -> None:
    """Upserts and deletes by key at explicit times, with a schema version drawn at open:
    a writer opened with an older one keeps writing after the shard evolves."""
    client = run.client(proc)
    shard = _typed_shard(run, client)
    version = run.rng.randrange(len(VERSIONS))
    if shard is None:
        return
    handle = run.retry_open(lambda: client.open_writer(shard, schema=VERSIONS[version]))
    if handle is None:
        return
    model = _model(run)
    while not run.stopping:
        run.think()
        upper = run.monitors.get(shard).upper
        if upper is None:
            return
        ts = upper + run.rng.randint(0, 1)
        keys = run.rng.sample(range(UPSERT_KEYS), run.rng.randint(1, 3))
        delete = run.rng.random() < 0.3
        values: dict[int, Value | None] = {
            k: None if delete else _value(run, version) for k in keys}
        ops = {k: KeyOp(ts, v) for k, v in values.items()}
        for k, op in ops.items():
            model.ops.setdefault(k, []).append(op)
        schema = VERSIONS[version]
        if delete:
            table = pa.table({"id": pa.array(keys, pa.int64())})
            status, _ = _attempt(run, "typed delete", handle.delete, table, ts)
        else:
            columns: dict[str, list[Any]] = {"id": keys}
            for i, name in enumerate(schema.value.names):
                columns[name] = [values[k][i] for k in keys]  # type: ignore[index]
            table = pa.Table.from_pydict(columns, schema=pa.schema([*schema.key,
                                                                     *schema.value]))
            status, _ = _attempt(run, "typed upsert", handle.upsert, table, ts)
        for op in ops.values():
            op.status = status
        run.ops += 1


def evolver(run: SimRun, proc: Process) -> None:
    """Appends nullable value columns to the typed shard's schema, one version at a
    time, while writers opened with older versions go on."""
    client = run.client(proc)
    shard = _typed_shard(run, client)
    if shard is None:
        return
    for version in range(1, len(VERSIONS)):
        run.think(scale=40.0)
        if run.stopping:
            return
        handle = run.retry_open(lambda v=version: client.open_writer(shard,  # type: ignore[misc]
                                                                     schema=VERSIONS[v]))
        if handle is None:
            return
        run.seams.versions_recorded = max(run.seams.versions_recorded, version)
        handle.stop_heartbeats()
        run.ops += 1


def typed_reader(run: SimRun, proc: Process) -> None:
    """Typed snapshots at random times, each checked against the typed model."""
    client = run.client(proc)
    shard = _typed_shard(run, client)
    if shard is None:
        return
    reader = None
    while not run.stopping:
        run.think()
        upper = run.monitors.get(shard).upper
        if not upper:
            continue
        try:
            if reader is None:
                reader = client.open_reader(shard)
            since = int(reader.since or 0)
            if since > upper - 1:
                continue
            as_of = run.rng.randint(since, upper - 1)
            if run.rng.random() < 0.2:
                reader.downgrade_since(as_of)
                continue
            _model(run).check(as_of, reader.snapshot(as_of), f"typed snapshot at {as_of}")
        except LeaseExpired:
            reader = None
        except (Indeterminate, SinceViolation, InvalidFrontier):
            pass
        except PersistError as e:
            run.violation(f"typed snapshot: unexpected {type(e).__name__}: {e}")
        run.ops += 1


# --- Spark data-source writes -------------------------------------------------------------


@dataclass(frozen=True)
class _TaskMessage:
    """What one write task hands the driver: the fields of the data source's
    ``PersistCommitMessage``, without its PySpark base class (the simulation runs
    without PySpark)."""

    parts: tuple[Any, ...]
    num_updates: int
    diff_bound: int
    fingerprint: str = field(default_factory=code_fingerprint)


def _spark_location(run: SimRun, shard: str) -> Any:
    return spark_source._Location("sim://consensus", run.spark_blob_uri, run.spark_wal_uri,
                                  shard)


def _run_tasks(run: SimRun, job: Any, tables: list[pa.Table], messages: list[Any]) -> None:
    """The executors: one task per table, each adding its message to ``messages``; a
    task may be retried (its first attempt's parts are then never committed, and left
    to GC's orphan sweep)."""
    for table in tables:
        if run.rng.random() < 0.2:
            spark_source._write_task(job, iter(table.to_batches()))  # a lost attempt
            run.scheduler.count("spark_task_retries")
        messages.append(_TaskMessage(*spark_source._write_task(job, iter(table.to_batches()))))


def _drive(run: SimRun, client: PersistClient, job: Any, tables: list[pa.Table],
           proc: Process | None = None, append: Append | None = None) -> str:
    """Tasks, then the driver's commit (or abort): the outcome ("aborted": a task
    failed, so nothing was committed and no commit was attempted). With ``proc`` (the
    driver's process) and ``append`` (its model), a second commit of the same parts may
    race the driver's (see :func:`_race_commit`)."""
    messages: list[Any] = []
    try:
        _run_tasks(run, job, tables, messages)
    except BackendError:
        # A task failed for good: Spark aborts the job; nothing was committed.
        spark_source._abort(job, messages, client)
        return "aborted"
    except PersistError as e:
        run.violation(f"Spark write task: unexpected {type(e).__name__}: {e}")
        return "failed"
    racing = (proc is not None and append is not None and run.profile.recommits
              and run.rng.random() < 0.5)
    if racing:
        assert proc is not None and append is not None
        _race_commit(run, proc, job, messages, append)
    elif run.profile.aborts_before_commit and run.rng.random() < 0.3:
        # Spark aborts the job before the Python worker that commits it has started:
        # the abort may delete the parts, so the late commit must refuse.
        run.scheduler.count("spark_aborts_before_commit")
        with contextlib.suppress(PersistError):
            spark_source._abort(job, messages, client)
    status = _commit_job(run, client, job, messages)
    if racing and status == "failed":
        # The racing commit of the same parts may land after this refusal: it decides.
        status = "unknown"
    if status != "failed":
        # Committed again later with the same token and parts, as by a driver that
        # never learnt the outcome (see _commit_again).
        run.seams.recommits.append(Recommit(job, messages, tables, status, append))
    if status != "acked":
        with contextlib.suppress(PersistError):  # its parts are then left to GC
            spark_source._abort(job, messages, client)
    elif run.rng.random() < 0.3:
        # The commit landed, but Spark never learnt it (the Python worker that ran it
        # died before replying): Spark aborts the write all the same, and its parts are
        # the shard's rows.
        run.scheduler.count("spark_aborts_after_commit")
        with contextlib.suppress(PersistError):
            spark_source._abort(job, messages, client)
    return status


def _commit_job(run: SimRun, client: PersistClient, job: Any, messages: list[Any]) -> str:
    """The driver's commit of ``job``: acked, failed (certainly not committed), or
    unknown."""
    try:
        spark_source._commit(job, messages, client)
        return "acked"
    except (UpperMismatch, CommitDeadlineExceeded, SchemaMismatch):
        return "failed"
    except Indeterminate:
        return "unknown"
    except PersistError as e:
        run.violation(f"Spark write commit: unexpected {type(e).__name__}: {e}")
        return "unknown"


def _race_commit(run: SimRun, proc: Process, job: Any, messages: list[Any],
                 append: Append) -> None:
    """Another thread of the driver's process commits the job's parts with its token
    through a writer it opened before the driver's commit, while the driver commits
    (a commit retried while the first attempt is still on its way): neither commit may
    delete parts the other then references."""
    client = run.client(proc)
    shard = job.location.shard_id
    opened = run.retry_open(lambda: client.open_writer(shard, debug="racing commit"))
    if opened is None:
        return
    writer = opened
    parts = tuple(p for m in messages for p in m.parts)
    updates = sum(m.num_updates for m in messages)
    schema = ShardSchema.from_bytes(job.schema) if job.schema else None

    def commit() -> None:
        # Just past the write's commit deadline, where a refusal is likeliest while
        # the driver's commit, computed in time, may be paused on its way.
        deadline_s = job.planned_s + run.config.gc_orphan_min_age_s / 2
        client.clock.sleep(max(0.0, deadline_s - client.clock.monotonic())
                           + run.rng.uniform(0.0, 1.0))
        try:
            writer.compare_and_append_parts(
                parts, updates, job.expected_upper, job.new_upper,
                idempotency_token=job.token, upload_started_s=job.planned_s, schema=schema)
            append.status = "acked"
        except (UpperMismatch, CommitDeadlineExceeded, SchemaMismatch, Indeterminate):
            pass
        except PersistError as e:
            run.violation(f"racing Spark commit: unexpected {type(e).__name__}: {e}")
        with contextlib.suppress(PersistError):
            writer.expire()

    run.spawn(f"{proc.name}/racing-commit", proc, commit)


def _commit_again(run: SimRun, client: PersistClient) -> None:
    """Commit an earlier Spark write again, with its token, some writes later
    (compaction may have merged its batch away since): one that committed is reported
    committed again, never refused, and keeps its parts (a read finds them). Either
    its driver commits the same parts again, or the user runs the save again with
    option ``idempotency_token`` (a new plan and new tasks over the same rows): never
    written twice (the typed model reads each row once)."""
    earlier = run.seams.recommits.pop(0)
    job = earlier.job
    if run.rng.random() < 0.5:
        again = _commit_job(run, client, job, earlier.messages)
    else:
        try:
            rerun = spark_source.plan_write(job.location, client, job.expected_upper,
                                            job.new_upper, token=job.token)
        except Indeterminate:
            return
        if rerun.schema != job.schema:
            return  # evolved since: its rows would be written in another shape
        again = _drive(run, client, rerun, earlier.tables, append=earlier.append)
    if earlier.status == "acked" and again == "failed":
        run.violation("a committed Spark write, committed again with its token, was "
                      "refused as never written")
    if earlier.append is not None and again == "acked" and earlier.append.status != "acked":
        earlier.append.status = "acked"  # now it must be visible, exactly once


def spark_writer(run: SimRun, proc: Process) -> None:
    """Spark data-source writes: typed appends of fresh ids to the typed shard, and
    untyped writes planned on a fresh shard that another process types mid-job."""
    client = run.client(proc)
    while not run.stopping:
        run.think(scale=3.0)
        roll = run.rng.random()
        if run.profile.recommits and roll < 0.2 and run.seams.recommits:
            _commit_again(run, client)
        elif roll < 0.5:
            _typed_append(run, client, proc)
        else:
            _untyped_write_typed_mid_job(run, client)
        run.ops += 1


def _typed_append(run: SimRun, client: PersistClient, proc: Process) -> None:
    shard = run.seams.typed_shard
    if not shard:
        return
    upper = run.monitors.get(shard).upper
    if upper is None:
        return
    try:
        job = spark_source.plan_write(_spark_location(run, shard), client, upper, upper + 1)
    except Indeterminate:
        return
    if not job.schema:
        return  # not typed yet: typed appends only (an untyped one would stay forever)
    schema = ShardSchema.from_bytes(job.schema)
    version = len(schema.value) - 1
    run.seams.appends += 1
    n = run.seams.appends
    ids = [APPEND_BASE + 100 * n + i for i in range(run.rng.randint(1, 4))]
    rows = {i: _value(run, version) for i in ids}
    append = Append(upper, rows)
    _model(run).appends[n] = append
    columns: dict[str, list[Any]] = {"id": ids}
    for j, name in enumerate(schema.value.names):
        columns[name] = [rows[i][j] for i in ids]
    columns["t"] = [upper] * len(ids)
    table = pa.table(columns)
    cut = run.rng.randint(1, len(ids))
    status = _drive(run, client, job, [table.slice(0, cut), table.slice(cut)], proc, append)
    if append.status != "acked":  # the racing commit may have acked it already
        append.status = "failed" if status == "aborted" else status


def _untyped_write_typed_mid_job(run: SimRun, client: PersistClient) -> None:
    shard = str(ShardId.new())
    try:
        job = spark_source.plan_write(_spark_location(run, shard), client, 0, 1)
    except Indeterminate:
        return
    typer = run.new_process(f"typer-of-{shard[:9]}")
    typed: list[bool] = []

    def type_it() -> None:
        run.think(scale=0.3)
        other = run.client(typer)
        try:
            other.open_writer(shard, schema=VERSIONS[0]).stop_heartbeats()
            typed.append(True)
        except SchemaMismatch:
            typed.append(False)  # the Spark write committed first: the shard is untyped
        except Indeterminate:
            typed.append(False)
        except PersistError as e:
            run.violation(f"typing a fresh shard: unexpected {type(e).__name__}: {e}")

    run.spawn(typer.name, typer, type_it)
    raw = pa.table({"k": [b"raw-0", b"raw-1"], "v": [b"v", b"v"], "t": [0, 0], "d": [1, 1]})
    status = _drive(run, client, job, [raw])
    status = "failed" if status == "aborted" else status
    while not typed and not run.stopping:
        run.think()
    _check_scratch(run, client, shard, status, raw)


def _check_scratch(run: SimRun, client: PersistClient, shard: str, status: str,
                   raw: pa.Table) -> None:
    """Whoever won, the shard reads: typed and empty, or untyped with the raw rows."""
    try:
        state = client.inspect(shard)
        if not state["upper"]:
            return
        schema = client.schema(shard)
        reader = client.open_reader(shard)
        try:
            got = reader.snapshot(0)
        finally:
            reader.expire()
    except (Indeterminate, LeaseExpired, SinceViolation, ShardNotFound):
        return
    except CorruptData as e:
        run.violation(f"shard {shard} (typed mid-job) does not read: {e}")
        return
    except PersistError as e:
        run.violation(f"reading shard {shard}: unexpected {type(e).__name__}: {e}")
        return
    if schema is not None and got.num_rows:
        run.violation(f"typed shard {shard} holds rows of an untyped Spark write")
    if schema is None and status == "failed" and got.num_rows:
        run.violation(f"refused Spark write is visible in {shard}")


# --- names, diffs, listens after the largest time -----------------------------------------


def namer(run: SimRun, proc: Process) -> None:
    """Races to create names (the typed shard's among them): all resolvers agree."""
    client = run.client(proc)
    while not run.stopping:
        run.think(scale=2.0)
        name = run.rng.choice([TYPED_NAME, "sim/a", "sim/b", "sim/c"])
        resolve(run, client, name)
        run.ops += 1


def spark_naming_writer(run: SimRun, proc: Process) -> None:
    """Spark writes to names no shard has (some tasks failing, so the job aborts): each
    name is registered exactly when its write's rows landed, never by a write that was
    refused or aborted."""
    client = run.client(proc)
    while not run.stopping:
        run.think(scale=3.0)
        name = f"spark-named/{run.rng.getrandbits(48):012x}"
        location = spark_source._Location("sim://consensus", run.spark_blob_uri,
                                          run.spark_wal_uri, str(ShardId.new()), name)
        try:
            job = spark_source.plan_write(location, client, 0, 1)
        except Indeterminate:
            continue
        rows = pa.table({"k": [b"n-0", b"n-1"], "v": [b"v", b"v"], "t": [0, 0], "d": [1, 1]})
        status = _drive(run, client, job, [rows])
        _check_spark_name(run, client, name, location.shard_id, status)
        run.ops += 1


def _check_spark_name(run: SimRun, client: PersistClient, name: str, shard: str,
                      status: str) -> None:
    try:
        registered = client.name_registry.lookup(name)
        upper = client.inspect(shard)["upper"]
    except (Indeterminate, ShardNotFound):
        return
    except PersistError as e:
        run.violation(f"checking Spark write to {name!r}: unexpected {type(e).__name__}: {e}")
        return
    landed = bool(upper)  # its one write moves the new shard's upper from 0
    if registered is not None and str(registered) != shard:
        run.violation(f"Spark write's new name {name!r} names another shard")
    elif status == "acked" and not (registered and landed):
        run.violation(f"acknowledged Spark write to {name!r} LOST (name registered: "
                      f"{registered is not None}, rows landed: {landed})")
    elif status in ("failed", "aborted") and (registered or landed):
        run.violation(f"refused Spark write to {name!r} was written (name registered: "
                      f"{registered is not None}, rows landed: {landed})")
    elif (registered is not None) != landed:
        run.violation(f"Spark write to {name!r} landed in part (name registered: "
                      f"{registered is not None}, rows landed: {landed})")


@dataclass
class _DiffWrite:
    time: int
    diffs: dict[bytes, int]
    status: str = "pending"


@dataclass
class _DiffLedger:
    """Exact totals per key by write time, of writes whose outcome is known."""

    writes: list[_DiffWrite] = field(default_factory=list)

    def total(self, key: bytes, as_of: int) -> int | None:
        """The exact total at ``as_of``, or None when an unknown write makes it unsure."""
        total = 0
        for w in self.writes:
            if w.time > as_of or key not in w.diffs or w.status == "failed":
                continue
            if w.status != "acked":
                return None
            total += w.diffs[key]
        return total


def _updates(rows: list[tuple[bytes, bytes, int, int]]) -> pa.Table:
    return pa.table({"k": pa.array([r[0] for r in rows], pa.binary()),
                     "v": pa.array([r[1] for r in rows], pa.binary()),
                     "t": pa.array([r[2] for r in rows], pa.int64()),
                     "d": pa.array([r[3] for r in rows], pa.int64())})


def overflow_writer(run: SimRun, proc: Process) -> None:
    """Diffs near 64 bits on a shard of its own: a write whose own sums leave 64 bits
    must be refused; reads must be exact or raise DiffOverflow; merges must not fail."""
    client = run.client(proc)
    shard = str(ShardId.new())
    writer = run.retry_open(lambda: client.open_writer(shard))
    reader = run.retry_open(lambda: client.open_reader(shard, create=True))
    if writer is None or reader is None:
        return
    ledger = _DiffLedger()
    keys = [b"h0", b"h1"]
    while not run.stopping:
        run.think()
        upper = run.monitors.get(shard).upper
        if upper is None:
            return
        roll = run.rng.random()
        try:
            if roll < 0.25:
                _refused_wrapping_write(run, writer, upper)
            elif roll < 0.6:
                diffs = {k: run.rng.choice([MAX_DIFF, MIN_DIFF, 1, -1, 1 << 62])
                         for k in run.rng.sample(keys, run.rng.randint(1, 2))}
                # Over 256 rows: the vectorized path, where sums once wrapped.
                table = _updates([(k, b"", upper, d) for k, d in diffs.items()]
                                 + [(b"f%d-%d" % (upper, i), b"", upper, 1)
                                    for i in range(300)])
                entry = _DiffWrite(upper, diffs)
                ledger.writes.append(entry)
                entry.status, _ = _attempt(run, "diff write", writer.compare_and_append,
                                           table, upper, upper + 1)
            elif roll < 0.8 and upper:
                _check_diff_read(run, reader, ledger, keys, upper - 1)
            elif upper:
                reader.downgrade_since(upper - 1)
                client.compact(shard)
        except (Indeterminate, LeaseExpired, SinceViolation, InvalidFrontier):
            pass
        except PersistError as e:
            run.violation(f"diff writer: unexpected {type(e).__name__}: {e}")
        run.ops += 1


def _refused_wrapping_write(run: SimRun, writer: Any, upper: int) -> None:
    table = _updates([(b"wrap", b"", upper, 1 << 62)] * 4
                     + [(b"w%d" % i, b"", upper, 1) for i in range(300)])
    try:
        writer.compare_and_append(table, upper, upper + 1)
    except InvalidUpdates:
        return
    except (UpperMismatch, Indeterminate):
        run.violation("a write whose diffs sum to 2**64 got past validation")
        return
    run.violation("a write whose diffs sum to 2**64 was accepted (wrapped to 0)")


def _check_diff_read(run: SimRun, reader: Any, ledger: _DiffLedger, keys: list[bytes],
                     as_of: int) -> None:
    expect = {k: ledger.total(k, as_of) for k in keys}
    if any(v is None for v in expect.values()) or as_of < int(reader.since or 0):
        return
    beyond = [k for k, v in expect.items() if v is not None and not MIN_DIFF <= v <= MAX_DIFF]
    try:
        got = {r["k"]: r["d"] for r in reader.snapshot(as_of).to_pylist() if r["k"] in keys}
    except DiffOverflow as e:
        if e.key not in beyond:
            run.violation(f"DiffOverflow for key {e.key!r} whose total at {as_of} is "
                          f"{expect.get(e.key)}")
        return
    if beyond:
        run.violation(f"a read at {as_of} returned {got} where totals leave 64 bits: "
                      f"{expect}")
        return
    want = {k: v for k, v in expect.items() if v}
    if got != want:
        run.violation(f"diff totals at {as_of} read {got}, exactly {want}")


def closer(run: SimRun, proc: Process) -> None:
    """A listen after the largest time reports the shard's close, like any listen."""
    client = run.client(proc)
    while not run.stopping:
        run.think(scale=10.0)
        shard = str(ShardId.new())
        try:
            writer = client.open_writer(shard)
            listen = client.open_reader(shard).listen(MAX_TIME)
            writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 2)
            if listen.poll():
                run.violation("a listen after the largest time reported progress while "
                              "the shard was open")
            writer.compare_and_append([], 2, None)
            events = listen.poll(timeout_s=5.0)
            if [(e.kind, e.upper) for e in events] != [("progress", None)]:
                run.violation(f"a listen after the largest time on a closed shard "
                              f"reported {events}, not the close")
        except (Indeterminate, LeaseExpired, UpperMismatch, CommitDeadlineExceeded):
            pass
        except PersistError as e:
            run.violation(f"closer: unexpected {type(e).__name__}: {e}")
        run.ops += 1


#: The table name the table writers (the IO manager's code path) store under.
TABLE_NAME = "sim/table"


def _table_version(run: SimRun, n: int) -> tuple[pa.Table, list[str] | None]:
    """The n-th table a writer stores: keyed or not, now and then with a nullable column
    added (evolving its generation's schema in place), and now and then another schema
    (which starts a new generation)."""
    rng = run.rng
    rows = rng.randint(0, 6)
    ids = rng.sample(range(12), rows)
    kind = rng.random()
    if kind < 0.15:  # a schema change: a string id
        return pa.table({"id": pa.array([str(i) for i in ids], pa.string()),
                         "v": [f"s{n}"] * rows}), None
    table = pa.table({"id": pa.array(ids, pa.int64()),
                      "v": [rng.choice(["a", "b", None]) for _ in ids]})
    if kind < 0.5:  # a collection: duplicates keep their multiplicity
        return pa.concat_tables([table, table.slice(0, rows // 2)]), None
    if kind >= 0.85:  # a nullable column added: the keyed generation's schema evolves
        return table.append_column("tier", pa.array([i % 3 or None for i in ids],
                                                    pa.int64())), ["id"]
    return table, ["id"]


def _canonical(table: pa.Table) -> list[str]:
    return sorted(repr(sorted(row.items())) for row in table.to_pylist())


def table_writer(run: SimRun, proc: Process) -> None:
    """Stores whole tables under one name, as the Dagster IO manager does
    (:func:`persist_pipeline.tables.store_table`), racing other table writers and schema
    changes; loads (:func:`~persist_pipeline.tables.load_table`) must return exactly one
    table some writer stored, never a mix, and never one that a later store wholly
    replaced before the load began (loads read the newest materialization's table)."""
    from persist_pipeline import tables

    client = run.client(proc)
    seams = run.seams
    n = 0
    while not run.stopping:
        run.think(scale=2.0)
        n += 1
        roll = run.rng.random()
        if roll < 0.6:
            if roll < 0.15:
                # Then store and load at once: the store must find the rows compaction
                # advanced to the upper, or the load sees them twice.
                _release_and_compact_table(run, client)
            table, keys = _table_version(run, n)
            entry = StoredTable(_canonical(table), seams.table_event())
            seams.tables.append(entry)
            try:
                stored = tables.store_table(client, TABLE_NAME, table, keys,
                                            debug=proc.name)
            except (UpperMismatch, Indeterminate, CommitDeadlineExceeded):
                pass  # its outcome stays unknown: it may be read, it replaces nothing
            except PersistError as e:
                run.violation(f"store_table: unexpected {type(e).__name__}: {e}")
            else:
                entry.ended = seams.table_event()
                if stored.result.upper is not None:
                    # By the generation's own name (the first one's is base/_v1): the
                    # base name is ambiguous once two generations reached an upper.
                    own = stored.name if stored.name != TABLE_NAME else TABLE_NAME + "/_v1"
                    seams.pinned.append((own, stored.result.upper, entry.rows))
                if roll < 0.15:
                    _load_and_check_table(run, client)
        elif roll < 0.7 and seams.pinned:
            _load_and_check_pinned(run, client, run.rng.choice(seams.pinned))
        else:
            _load_and_check_table(run, client)
        run.ops += 1


def _load_and_check_pinned(run: SimRun, client: PersistClient,
                           pinned: tuple[str, int, list[str]]) -> None:
    """A load pinned to the upper a store reported (as a Dagster input with
    ``{"upper": N}``): exactly that store's table, columns included, however the
    generation's schema evolved since; or refused, once compaction merged it away."""
    from persist_pipeline import tables

    name, upper, rows = pinned
    try:
        got = tables.load_table(client, name, upper)
    except (SinceViolation, Indeterminate, LeaseExpired, NotYetAvailable):
        return
    except PersistError as e:
        run.violation(f"pinned load_table: unexpected {type(e).__name__}: {e}")
        return
    if _canonical(got) != rows:
        run.violation(f"a load of {name} pinned to upper {upper} is not the table stored "
                      f"there: {got.to_pylist()[:4]}")


def _load_and_check_table(run: SimRun, client: PersistClient) -> None:
    """A table load: one table some writer stored, and none a later store wholly
    replaced before the load began."""
    from persist_pipeline import tables

    seams = run.seams
    started = seams.table_event()
    try:
        got = tables.load_table(client, TABLE_NAME)
    except (ShardNotFound, Indeterminate, LeaseExpired, NotYetAvailable):
        return
    except PersistError as e:
        run.violation(f"load_table: unexpected {type(e).__name__}: {e}")
        return
    rows = _canonical(got)
    if rows not in [t.rows for t in seams.tables]:
        run.violation(f"a loaded table is none of the tables stored: {got.to_pylist()[:4]}")
    elif rows not in fresh_tables(seams.tables, started, seams.table_event()):
        run.violation(f"a load returned a table a later store had replaced before the "
                      f"load began: {got.to_pylist()[:4]}")


def _release_and_compact_table(run: SimRun, client: Any, name: str = TABLE_NAME) -> None:
    """A reader of the table's newest generation that has read everything releases every
    time below the upper (since == upper, as the API allows), and compaction runs: the
    merge advances the rows' times to the upper, where the next store must still find
    them (a store that missed them would leave each row twice)."""
    from persist_pipeline import tables

    found = tables.generations(name, client.shard_names())
    if not found:
        return
    try:
        shard = client.resolve(tables.generation_name(name, found[-1]))
        reader = client.open_reader(shard, debug="table release")
        try:
            upper = client.inspect(shard)["upper"]
            if upper:
                reader.downgrade_since(upper)
                client.compact(shard)
        finally:
            with contextlib.suppress(PersistError):
                reader.expire()
    except (ShardNotFound, Indeterminate, LeaseExpired, InvalidFrontier,
            CommitDeadlineExceeded, UpperMismatch):
        pass
    except PersistError as e:
        run.violation(f"table release and compaction: unexpected {type(e).__name__}: {e}")


#: The environment of a process that asks for inlining, while its config turns it off.
_INLINING_ENV = {"PERSIST_INLINE_UPDATE_THRESHOLD_BYTES": "4096",
                 "PERSIST_INLINE_UPDATE_MAX_BYTES": str(1 << 20)}


def configured_writer(run: SimRun, proc: Process) -> None:
    """A client configured with inlining off (in its config, beside an environment that
    asks for it) never inlines: every way of configuring a client is one config."""
    from persist_pipeline import client as client_module
    from persist_pipeline.client import PersistClient
    from persist_pipeline.config import InlinePolicy
    from persist_pipeline.sim.scheduler import SimClock

    config = client_module.effective_config(
        replace(run.config, inline_policy=InlinePolicy(0, 0)), None, _INLINING_ENV)
    client = PersistClient(run.consensus, run.main, run.wal, config,
                           SimClock(run.scheduler, proc))
    shard = str(ShardId.new())
    writer = run.retry_open(lambda: client.open_writer(shard))
    if writer is None:
        return
    while not run.stopping:
        run.think(scale=5.0)
        upper = writer.upper
        if upper is None:
            return
        status, result = _attempt(run, "configured write", writer.compare_and_append,
                                  [(b"k%d" % upper, b"v", upper, 1)], upper, upper + 1)
        if status == "acked" and getattr(result, "placement", None) == "inline":
            run.violation("a client whose config turned inlining off inlined a write")
        if status != "acked":
            with contextlib.suppress(PersistError):
                writer.fetch_recent_upper()
        run.ops += 1


ROLES: dict[str, Callable[[SimRun, Process], None]] = {
    "typed_writer": typed_writer,
    "evolver": evolver,
    "typed_reader": typed_reader,
    "spark_writer": spark_writer,
    "namer": namer,
    "spark_naming_writer": spark_naming_writer,
    "overflow_writer": overflow_writer,
    "closer": closer,
    "configured_writer": configured_writer,
    "table_writer": table_writer,
}


def final_check(run: SimRun, client: PersistClient) -> None:
    """The typed shard's last complete time against the model."""
    shard = run.seams.typed_shard
    if not shard or run.seams.model is None:
        return
    upper = client.inspect(shard)["upper"]
    if not upper:
        return
    reader = client.open_reader(shard)
    try:
        run.seams.model.check(upper - 1, reader.snapshot(upper - 1), "final typed snapshot")
    finally:
        reader.expire()
