"""Consensus backends: one conformance suite for mem, SQLite and PostgreSQL, then
backend-specific behaviour (processes sharing a SQLite file, PostgreSQL's resolution of
concurrent inserts, credentials, unreachable servers, malformed URIs).

Everything runs against the real thing: SQLite files in ``tmp_path`` and a fresh database
on a real PostgreSQL server per test.
"""

from __future__ import annotations

import multiprocessing
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import psycopg2
import pytest

from persist_pipeline.consensus import (
    CasWrite,
    Consensus,
    MemoryConsensus,
    SqlConsensus,
    VersionedData,
    open_consensus,
)
from persist_pipeline.consensus.sql import _CockroachDialect
from persist_pipeline.exceptions import (
    ConsensusAuthError,
    ConsensusError,
    ConsensusLocationNotFound,
    ConsensusUnavailable,
    InvalidInput,
    InvalidUri,
    LocationNotFound,
)
from tests.fixtures.postgres import PgServer
from tests.helpers import process_context

MAX_SEQNO = 2**63 - 1


def vd(seqno: int, tag: str = "") -> VersionedData:
    """A record whose data and summary name its seqno (and ``tag``)."""
    return VersionedData(seqno, f"data-{seqno}{tag}".encode(), f"sum-{seqno}{tag}".encode())


def fill(store: Consensus, shard: str, n: int, tag: str = "") -> list[VersionedData]:
    """Appends records 1..n to an empty ``shard``; returns them."""
    records = [vd(i, tag) for i in range(1, n + 1)]
    for record in records:
        expected = None if record.seqno == 1 else record.seqno - 1
        assert store.compare_and_set(shard, expected, record) is True
    return records


@pytest.fixture
def store(consensus_uri: str) -> Iterator[Consensus]:
    """A fresh store of each backend."""
    with open_consensus(consensus_uri) as opened:
        yield opened


def is_mem(uri: str) -> bool:
    return uri.startswith("mem://")


# --- conformance: basic semantics ---------------------------------------------------------


def test_empty_store(store: Consensus) -> None:
    assert store.head("s") is None
    assert store.scan("s", 0) == []
    assert store.list_shards() == []
    assert dict(store.list_heads()) == {}


def test_compare_and_set_appends_only_on_the_expected_head(store: Consensus) -> None:
    assert store.compare_and_set("s", 3, vd(4)) is False  # no shard yet
    assert store.head("s") is None
    assert store.list_shards() == []

    assert store.compare_and_set("s", None, vd(1)) is True
    assert store.head("s") == vd(1)
    assert store.compare_and_set("s", None, vd(1, "again")) is False
    assert store.compare_and_set("s", 1, vd(2)) is True
    assert store.compare_and_set("s", 1, vd(2, "stale")) is False
    assert store.compare_and_set("s", 5, vd(6)) is False  # ahead of the head
    assert store.compare_and_set("s", 2, vd(3)) is True

    assert store.head("s") == vd(3)
    assert store.scan("s", 0) == [vd(1), vd(2), vd(3)]
    assert store.list_shards() == ["s"]


def test_records_round_trip_exact_bytes(store: Consensus) -> None:
    binary = bytes(range(256)) * 4
    big = b"\x00\xff" * (512 * 1024)  # 1 MiB
    records = [
        VersionedData(1, b""),
        VersionedData(2, binary, b"\x00"),
        VersionedData(3, big, binary),
    ]
    for record in records:
        expected = None if record.seqno == 1 else record.seqno - 1
        assert store.compare_and_set("bytes", expected, record) is True
    assert store.scan("bytes", 0) == records
    assert records[0].summary == b""
    head = store.head("bytes")
    assert head == records[2]
    assert head is not None and type(head.data) is bytes and type(head.summary) is bytes


def test_scan_ranges_and_limits(store: Consensus) -> None:
    records = fill(store, "s", 5)
    assert store.scan("s", 0) == records
    assert store.scan("s", 1) == records
    assert store.scan("s", 3) == records[2:]
    assert store.scan("s", 5) == records[4:]
    assert store.scan("s", 6) == []
    assert store.scan("s", 2, limit=2) == records[1:3]
    assert store.scan("s", 4, limit=10) == records[3:]
    assert store.scan("s", 0, limit=0) == []
    assert store.scan("other", 0) == []


def test_truncate_deletes_below_and_never_the_head(store: Consensus) -> None:
    records = fill(store, "s", 5)
    assert store.truncate("s", 3) == 2
    assert store.scan("s", 0) == records[2:]
    assert store.truncate("s", 3) == 0
    assert store.truncate("s", 2) == 0
    assert store.truncate("s", 5) == 2
    assert store.scan("s", 0) == [records[4]]
    assert store.head("s") == records[4]

    with pytest.raises(InvalidInput) as info:
        store.truncate("s", 6)
    assert type(info.value) is InvalidInput
    with pytest.raises(InvalidInput):
        store.truncate("missing", 1)
    assert store.scan("s", 0) == [records[4]]

    # A creator that still believes the shard is empty must not succeed after records
    # 1..4 were truncated away.
    assert store.compare_and_set("s", None, vd(1, "stale")) is False
    assert store.compare_and_set("s", 5, vd(6)) is True
    assert store.scan("s", 0) == [records[4], vd(6)]
    assert store.list_shards() == ["s"]
    assert dict(store.list_heads()) == {"s": VersionedData(6, b"", vd(6).summary)}


def test_shards_are_independent(store: Consensus) -> None:
    a = fill(store, "a", 3, "A")
    b = fill(store, "b", 2, "B")
    assert store.truncate("a", 3) == 2
    assert store.scan("b", 0) == b
    assert store.compare_and_set("b", 2, vd(3, "B")) is True
    assert store.scan("a", 0) == a[2:]
    assert store.head("a") == a[2]


def test_list_shards_and_heads_across_many_shards(store: Consensus) -> None:
    expected: dict[str, VersionedData] = {}
    for i in range(60):
        shard = f"shard-{i:03d}"
        records = fill(store, shard, i % 5 + 1, f"/{i}")
        if i % 3 == 0 and len(records) > 1:
            store.truncate(shard, records[-1].seqno)
        expected[shard] = VersionedData(records[-1].seqno, b"", records[-1].summary)
    assert store.list_shards() == sorted(expected)
    heads = store.list_heads()
    assert dict(heads) == expected
    assert list(heads) == sorted(expected)
    assert all(head.data == b"" for head in heads.values())


def test_a_second_handle_sees_the_same_store(consensus_uri: str, store: Consensus) -> None:
    fill(store, "s", 2)
    with open_consensus(consensus_uri) as other:
        assert other.head("s") == vd(2)
        assert other.compare_and_set("s", 2, vd(3)) is True
        assert store.compare_and_set("s", 2, vd(3, "late")) is False
        assert store.head("s") == vd(3)
        assert other.list_shards() == ["s"]


def test_closed_store_raises_and_close_is_idempotent(consensus_uri: str) -> None:
    opened = open_consensus(consensus_uri)
    assert opened.compare_and_set("s", None, vd(1)) is True
    opened.close()
    opened.close()
    for call in (
        lambda: opened.head("s"),
        lambda: opened.compare_and_set("s", 1, vd(2)),
        lambda: opened.scan("s", 0),
        lambda: opened.list_heads(),
    ):
        with pytest.raises(ConsensusError) as info:
            call()
        assert type(info.value) is ConsensusError
        assert "closed" in str(info.value)
    with open_consensus(consensus_uri) as reopened:
        assert reopened.head("s") == vd(1)


INVALID_CALLS: list[tuple[str, Callable[[Consensus], object]]] = [
    ("empty shard", lambda c: c.head("")),
    ("int shard", lambda c: c.head(7)),  # type: ignore[arg-type]
    ("None shard", lambda c: c.scan(None, 0)),  # type: ignore[arg-type]
    ("NUL in shard", lambda c: c.compare_and_set("a\x00b", None, vd(1))),
    ("expected 0", lambda c: c.compare_and_set("s", 0, vd(1))),
    ("expected negative", lambda c: c.compare_and_set("s", -1, vd(0))),
    ("expected bool", lambda c: c.compare_and_set("s", True, vd(2))),  # type: ignore[arg-type]
    ("expected str", lambda c: c.compare_and_set("s", "2", vd(3))),  # type: ignore[arg-type]
    ("new not VersionedData", lambda c: c.compare_and_set("s", 2, (3, b"", b""))),  # type: ignore[arg-type]
    ("creation with seqno 2", lambda c: c.compare_and_set("x", None, vd(2))),
    ("seqno skips ahead", lambda c: c.compare_and_set("s", 2, vd(4))),
    ("seqno repeats", lambda c: c.compare_and_set("s", 2, vd(2))),
    ("seqno beyond 64 bits", lambda c: c.compare_and_set("s", MAX_SEQNO, vd(MAX_SEQNO + 1))),
    ("str data", lambda c: c.compare_and_set("s", 2, VersionedData(3, "x"))),  # type: ignore[arg-type]
    ("bytearray data", lambda c: c.compare_and_set("s", 2, VersionedData(3, bytearray(b"x")))),  # type: ignore[arg-type]
    ("None summary", lambda c: c.compare_and_set("s", 2, VersionedData(3, b"", None))),  # type: ignore[arg-type]
    ("negative from_seqno", lambda c: c.scan("s", -1)),
    ("str from_seqno", lambda c: c.scan("s", "0")),  # type: ignore[arg-type]
    ("negative limit", lambda c: c.scan("s", 0, -1)),
    ("float limit", lambda c: c.scan("s", 0, 1.5)),  # type: ignore[arg-type]
    ("truncate 0", lambda c: c.truncate("s", 0)),
    ("truncate bool", lambda c: c.truncate("s", True)),  # type: ignore[arg-type]
    ("truncate above head", lambda c: c.truncate("s", 3)),
    ("truncate beyond 64 bits", lambda c: c.truncate("s", MAX_SEQNO + 1)),
]


@pytest.mark.parametrize("call", [c for _, c in INVALID_CALLS], ids=[n for n, _ in INVALID_CALLS])
def test_invalid_arguments_raise_invalid_input_and_change_nothing(
    store: Consensus, call: Callable[[Consensus], object]
) -> None:
    records = fill(store, "s", 2)
    with pytest.raises(InvalidInput) as info:
        call(store)
    assert type(info.value) is InvalidInput
    assert store.scan("s", 0) == records
    assert store.list_shards() == ["s"]
    assert dict(store.list_heads()) == {"s": VersionedData(2, b"", records[1].summary)}


# --- conformance: concurrency -------------------------------------------------------------


def race(store: Consensus, shard: str, worker: str, target: int) -> list[tuple[int, bytes]]:
    """Appends to ``shard`` by CaS until its head reaches ``target``; returns the wins."""
    wins: list[tuple[int, bytes]] = []
    while True:
        head = store.head(shard)
        current = None if head is None else head.seqno
        if current is not None and current >= target:
            return wins
        seqno = 1 if current is None else current + 1
        data = f"{worker}/{seqno}".encode()
        if store.compare_and_set(shard, current, VersionedData(seqno, data, worker.encode())):
            wins.append((seqno, data))


def race_in_process(
    uri: str, shard: str, worker: str, target: int, start: Any, results: Any
) -> None:
    """A spawned process: opens its own store after ``start`` and races on ``shard``."""
    try:
        start.wait(timeout=60)
        with open_consensus(uri) as store:
            results.put((worker, race(store, shard, worker, target), None))
    except BaseException as exc:
        results.put((worker, [], f"{type(exc).__name__}: {exc}"))


def check_race(store: Consensus, shard: str, target: int, wins: dict[str, list[Any]]) -> None:
    """Every seqno 1..target has exactly one winner, and the records are its writes."""
    seqnos = sorted(seqno for won in wins.values() for seqno, _ in won)
    assert seqnos == list(range(1, target + 1))
    expected = sorted(
        (
            VersionedData(seqno, data, worker.encode())
            for worker, won in wins.items()
            for seqno, data in won
        ),
        key=lambda r: r.seqno,
    )
    assert store.scan(shard, 0) == expected
    assert store.head(shard) == expected[-1]
    assert dict(store.list_heads())[shard] == VersionedData(target, b"", expected[-1].summary)


RACE_TARGET = {"mem": 2000, "sqlite": 150, "postgres": 300}


@pytest.mark.timeout(120)
def test_racing_threads_and_processes_have_one_winner_per_seqno(consensus_uri: str) -> None:
    """8 threads (one shared handle) and, for databases, 4 processes (own handles, opened
    concurrently on the fresh store) CaS one shard in a loop."""
    kind = "mem" if is_mem(consensus_uri) else consensus_uri.split(":", 1)[0]
    target = RACE_TARGET["postgres" if kind == "postgresql" else kind]
    shard = "raced"
    n_threads, n_procs = 8, 0 if is_mem(consensus_uri) else 4
    ctx = process_context()
    start = ctx.Barrier(n_procs + 1)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=race_in_process,
            args=(consensus_uri, shard, f"proc-{i}", target, start, results),
        )
        for i in range(n_procs)
    ]
    for proc in procs:
        proc.start()
    try:
        start.wait(timeout=60)  # every process is up; they and we open the store now
        with open_consensus(consensus_uri) as store:
            go = threading.Barrier(n_threads)

            def thread_worker(i: int) -> list[tuple[int, bytes]]:
                go.wait(timeout=30)
                return race(store, shard, f"thread-{i}", target)

            with ThreadPoolExecutor(n_threads) as pool:
                thread_wins = list(pool.map(thread_worker, range(n_threads)))
            wins: dict[str, list[Any]] = {f"thread-{i}": w for i, w in enumerate(thread_wins)}
            for _ in procs:
                worker, won, error = results.get(timeout=60)
                assert error is None, f"{worker} failed: {error}"
                wins[worker] = won
            check_race(store, shard, target, wins)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * n_procs


def test_concurrent_creators_have_one_winner(store: Consensus) -> None:
    n = 8
    for round_ in range(10):
        shard = f"created-{round_}"
        go = threading.Barrier(n)

        def create(worker: int, shard: str = shard, go: threading.Barrier = go) -> bool:
            go.wait(timeout=30)
            return store.compare_and_set(shard, None, VersionedData(1, f"w{worker}".encode()))

        with ThreadPoolExecutor(n) as pool:
            outcomes = list(pool.map(create, range(n)))
        assert outcomes.count(True) == 1
        winner = outcomes.index(True)
        assert store.scan(shard, 0) == [VersionedData(1, f"w{winner}".encode())]
    assert store.list_shards() == [f"created-{i}" for i in range(10)]


@pytest.mark.timeout(120)
def test_truncate_racing_writers_never_removes_the_head(store: Consensus) -> None:
    target, shard = 120, "t"
    assert store.compare_and_set(shard, None, vd(1)) is True
    done = threading.Event()
    truncated: list[int] = []
    observed: list[int] = []

    def truncator() -> None:
        while not done.is_set():
            head = store.head(shard)
            assert head is not None
            truncated.append(store.truncate(shard, head.seqno))

    def reader() -> None:
        while not done.is_set():
            head = store.head(shard)
            assert head is not None
            observed.append(head.seqno)
            records = store.scan(shard, 0)
            assert records, "scan found no records although a head exists"
            assert [r.seqno for r in records] == list(
                range(records[0].seqno, records[0].seqno + len(records))
            )

    with ThreadPoolExecutor(6) as pool:
        side = [pool.submit(truncator), pool.submit(reader)]
        writers = [pool.submit(race, store, shard, f"w{i}", target) for i in range(4)]
        try:
            for writer in writers:
                writer.result(timeout=100)
        finally:
            done.set()
        for future in side:
            future.result(timeout=30)

    head = store.head(shard)
    assert head is not None and head.seqno == target
    remaining = store.scan(shard, 0)
    assert remaining[-1] == head
    assert [r.seqno for r in remaining] == list(range(remaining[0].seqno, target + 1))
    # Every record below the first remaining one was deleted exactly once.
    assert sum(truncated) == remaining[0].seqno - 1
    assert observed == sorted(observed)
    assert store.truncate(shard, target) == target - remaining[0].seqno
    assert store.scan(shard, 0) == [head]


# --- URIs ---------------------------------------------------------------------------------

BAD_URIS: list[Any] = [
    None,
    123,
    b"mem://",
    "",
    "   ",
    "mem",
    "mem:/x",
    "://x",
    "sqlite://",
    "sqlite:///:memory:",
    "mysql://u@h/db",
    "postgresql+asyncpg://u@h/db",
    "s3://bucket/prefix",
    "file:///tmp/x",
    "http://example.com",
]


@pytest.mark.parametrize("uri", BAD_URIS, ids=[repr(u) for u in BAD_URIS])
def test_malformed_or_unsupported_uris_raise_invalid_uri(uri: Any) -> None:
    with pytest.raises(InvalidUri) as info:
        open_consensus(uri)
    message = str(info.value)
    if uri in ("mysql://u@h/db", "postgresql+asyncpg://u@h/db", "s3://bucket/prefix", None):
        for scheme in (
            "mem://",
            "sqlite:///",
            "postgresql://",
            "postgres://",
            "postgresql+psycopg2://",
            "cockroachdb://",
        ):
            assert scheme in message


@pytest.mark.parametrize(
    "uri",
    [
        "postgresql://u:hunter2secret@h:notaport/db",
        "sqlite:///x.db?timeout=soon",
        "sqlite:///x.db?timeout=-1",
    ],
)
def test_malformed_uri_messages_never_show_the_password(uri: str) -> None:
    with pytest.raises(InvalidUri) as info:
        open_consensus(uri)
    assert "hunter2secret" not in all_text(info.value)



@pytest.mark.parametrize(
    ("query", "unknown"),
    [
        ("mode=ro", "mode"),
        ("uri=true&mode=ro", "mode"),
        ("timeout=5&journal=off", "journal"),
        ("check_same_thread=false", "check_same_thread"),
    ],
)
def test_sqlite_uri_refuses_a_parameter_it_would_ignore(tmp_path: Path, query: str,
                                                        unknown: str) -> None:
    # A parameter SQLite would not honour (read-only mode, ...) is named and refused
    # before the database file is created, never dropped with a warning.
    with pytest.raises(InvalidUri, match=f"'{unknown}'") as info:
        open_consensus(f"sqlite:///{tmp_path / 'c.db'}?{query}")
    assert "timeout" in str(info.value), "the message names the parameter it does take"
    assert list(tmp_path.iterdir()) == []


def test_postgres_uri_refuses_an_unknown_parameter_before_connecting() -> None:
    # Nothing listens on port 1: an unknown parameter is refused by name before any
    # connection is tried, as for SQLite; the value (a secret, perhaps) is not shown.
    with pytest.raises(InvalidUri, match="'mode'") as info:
        open_consensus("postgresql://u:hunter2secret@127.0.0.1:1/db?mode=hunter3secret"
                       "&sslmode=disable")
    assert "hunter2secret" not in all_text(info.value)
    assert "hunter3secret" not in all_text(info.value)


@pytest.mark.parametrize(
    ("scheme", "query", "name"),
    [
        ("postgresql", "connect_timeout=hunter3secret", "connect_timeout"),
        ("postgresql", "connect_timeout=1.5", "connect_timeout"),
        ("postgresql", "keepalives=yes", "keepalives"),
        ("postgresql", "keepalives_idle=9999999999", "keepalives_idle"),
        ("postgresql", "keepalives_interval=x", "keepalives_interval"),
        ("postgresql", "keepalives_count=x", "keepalives_count"),
        ("postgresql", "tcp_user_timeout=x", "tcp_user_timeout"),
        ("postgresql", "port=x", "port"),
        ("postgresql", "host=a,b&port=5432,70000", "port"),
        ("postgresql", "sslmode=hunter3secret", "sslmode"),
        ("postgresql", "connect_timeout=5&connect_timeout=6", "connect_timeout"),
        ("cockroachdb", "connect_timeout=abc", "connect_timeout"),
    ],
)
def test_postgres_uri_refuses_a_malformed_parameter_before_connecting(
        scheme: str, query: str, name: str) -> None:
    # libpq would refuse these only when connecting, which reads as an unreachable
    # database (transient, "safe to retry"); they are bad input, named without the
    # value (a secret, perhaps).
    with pytest.raises(InvalidUri, match=f"'{name}'") as info:
        open_consensus(f"{scheme}://u:hunter2secret@127.0.0.1:1/db?{query}")
    assert not isinstance(info.value, ConsensusUnavailable)
    assert "hunter2secret" not in all_text(info.value)
    assert "hunter3secret" not in all_text(info.value)


def test_postgres_uri_with_well_formed_parameters_goes_on_to_connect() -> None:
    # Nothing listens on port 1: getting that far means the parameters were accepted.
    with pytest.raises(ConsensusUnavailable):
        open_consensus("postgresql://u@127.0.0.1:1/db?connect_timeout=%202%20&keepalives=1"
                       "&keepalives_idle=-1&sslmode=disable&tcp_user_timeout=+0")


def test_postgres_uri_port_out_of_range_is_refused_before_connecting() -> None:
    with pytest.raises(InvalidUri, match="port"):
        open_consensus("postgresql://u:hunter2secret@127.0.0.1:70000/db")


def test_check_consensus_uri_refuses_what_open_would_and_opens_nothing(tmp_path: Path
                                                                       ) -> None:
    from persist_pipeline.consensus import check_consensus_uri

    check_consensus_uri(f"sqlite:///{tmp_path / 'c.db'}")
    check_consensus_uri("postgresql://u:pw@127.0.0.1:1/db?connect_timeout=5")  # no connect
    check_consensus_uri("mem://x")
    assert list(tmp_path.iterdir()) == []
    for bad in ("sqllite:///x.db", "sqlite://", f"sqlite:///{tmp_path / 'c.db'}?mode=ro",
                "postgresql://u@h/db?connect_timeout=abc", "mem://x?a=1", "nope"):
        with pytest.raises(InvalidUri):
            check_consensus_uri(bad)


def test_mem_uri_refuses_query_parameters() -> None:
    with pytest.raises(InvalidUri, match="query"):
        open_consensus("mem://shared?mode=ro")

def test_mem_uris() -> None:
    name = f"mem://shared-{uuid.uuid4().hex}"
    with open_consensus(name) as first, open_consensus(name) as second:
        assert first.compare_and_set("s", None, vd(1)) is True
        assert second.head("s") == vd(1)
    with open_consensus(name) as third:
        assert third.head("s") == vd(1)  # named stores live for the process
    with open_consensus("mem://") as a, open_consensus("mem://") as b:
        assert a.compare_and_set("s", None, vd(1)) is True
        assert b.head("s") is None
    assert isinstance(open_consensus("MEM://x"), MemoryConsensus)
    with pytest.raises(InvalidInput):
        MemoryConsensus("")


# --- SQLite -------------------------------------------------------------------------------


def sqlite_worker(uri: str, worker: str, start: Any, results: Any) -> None:
    """A spawned process: fills its own shard, then races on the shared one."""
    try:
        start.wait(timeout=60)
        with open_consensus(uri) as store:
            fill(store, f"own-{worker}", 40, worker)
            results.put((worker, race(store, "shared", worker, 80), None))
    except BaseException as exc:
        results.put((worker, [], f"{type(exc).__name__}: {exc}"))


@pytest.mark.timeout(120)
def test_sqlite_file_shared_by_two_processes(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    uri = f"sqlite:///{path}"
    ctx = process_context()
    start = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=sqlite_worker, args=(uri, w, start, results)) for w in "ab"]
    for proc in procs:
        proc.start()
    try:
        wins: dict[str, list[Any]] = {}
        for _ in procs:
            worker, won, error = results.get(timeout=90)
            assert error is None, f"process {worker} failed: {error}"
            wins[worker] = won
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    with open_consensus(uri) as store:
        for worker in "ab":
            assert store.scan(f"own-{worker}", 0) == [vd(i, worker) for i in range(1, 41)]
        check_race(store, "shared", 80, wins)
        assert store.list_shards() == ["own-a", "own-b", "shared"]
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_sqlite_locked_database_is_unavailable_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    with open_consensus(f"sqlite:///{path}?timeout=0.2") as store:
        assert store.compare_and_set("s", None, vd(1)) is True
        raw = sqlite3.connect(path, isolation_level=None)
        try:
            raw.execute("BEGIN IMMEDIATE")  # holds the write lock
            began = time.monotonic()
            with pytest.raises(ConsensusUnavailable) as info:
                store.compare_and_set("s", 1, vd(2))
            waited = time.monotonic() - began
            assert "database is locked" in str(info.value)
            assert 0.15 <= waited < 5
            assert store.head("s") == vd(1)  # WAL: readers are not blocked by the writer
            raw.execute("ROLLBACK")
        finally:
            raw.close()
        assert store.compare_and_set("s", 1, vd(2)) is True
        assert store.scan("s", 0) == [vd(1), vd(2)]


def test_sqlite_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "no" / "such" / "dir" / "c.db"
    with pytest.raises(ConsensusError) as info:
        open_consensus(f"sqlite:///{path}")
    assert type(info.value) is ConsensusError
    assert str(path) in str(info.value)
    assert "unable to open database file" in str(info.value)
    assert "directory exist" in str(info.value)


def test_sqlite_file_that_is_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"definitely not sqlite" * 500)
    with pytest.raises(ConsensusError) as info:
        open_consensus(f"sqlite:///{path}")
    assert type(info.value) is ConsensusError
    assert "not a database" in str(info.value)


# --- PostgreSQL ---------------------------------------------------------------------------


def all_text(exc: BaseException) -> str:
    """str and repr of ``exc`` and of every exception it was raised from or during."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts += [str(current), repr(current), *map(str, current.args)]
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


def db_name(url: str) -> str:
    return url.rsplit("/", 1)[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_lock_waiters(server: PgServer, dbname: str, count: int) -> None:
    admin = server.connect()
    try:
        deadline = time.monotonic() + 10
        while True:
            with admin.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = %s AND wait_event_type = 'Lock'",
                    (dbname,),
                )
                row = cur.fetchone()
            if row is not None and row[0] == count:
                return
            assert time.monotonic() < deadline, "the CaS never blocked on the competitor"
            time.sleep(0.01)
    finally:
        admin.close()


@pytest.mark.postgres
@pytest.mark.parametrize("competitor_commits", [True, False], ids=["commits", "rolls-back"])
@pytest.mark.parametrize("expected", [None, 1], ids=["create", "append"])
def test_pg_concurrent_insert_of_one_seqno_is_resolved_by_the_primary_key(
    pg_url: str, pg_server: PgServer, expected: int | None, competitor_commits: bool
) -> None:
    """Our CaS passes its head check while a competitor's insert of the same seqno is
    uncommitted (READ COMMITTED cannot see it); the primary key makes it wait, then
    insert nothing if the competitor commits, or insert if it rolls back."""
    with open_consensus(pg_url) as store:
        if expected is not None:
            assert store.compare_and_set("s", None, vd(1)) is True
        seqno = 1 if expected is None else expected + 1
        competitor = pg_server.connect(db_name(pg_url))
        competitor.autocommit = False
        try:
            with competitor.cursor() as cur:
                cur.execute(
                    "INSERT INTO consensus (shard, seqno, data, summary) VALUES (%s, %s, %s, %s)",
                    ("s", seqno, b"theirs", b""),
                )
            with ThreadPoolExecutor(1) as pool:
                ours = pool.submit(
                    store.compare_and_set, "s", expected, VersionedData(seqno, b"ours")
                )
                wait_for_lock_waiters(pg_server, db_name(pg_url), 1)
                assert not ours.done()
                if competitor_commits:
                    competitor.commit()
                else:
                    competitor.rollback()
                assert ours.result(timeout=10) is (not competitor_commits)
        finally:
            competitor.close()
        winner = b"theirs" if competitor_commits else b"ours"
        assert store.head("s") == VersionedData(seqno, winner)
        assert [r.seqno for r in store.scan("s", 0)] == list(range(1, seqno + 1))


@pytest.mark.postgres
def test_pg_stale_cas_cannot_reinsert_a_truncated_seqno(pg_url: str, pg_server: PgServer) -> None:
    """The race READ COMMITTED gets wrong. Our CaS(1 -> 2) passes its head check while
    a competitor (serializable, like every SqlConsensus session) appends 2 and 3 and
    truncates below 3 in one uncommitted transaction, so our insert of 2 waits on it. On
    commit row 2 is gone: under READ COMMITTED our insert then succeeded, reporting a win
    for a seqno someone else had won and leaving a ghost record below the head."""
    with open_consensus(pg_url) as store:
        assert store.compare_and_set("s", None, vd(1)) is True
        competitor = pg_server.connect(db_name(pg_url))
        competitor.autocommit = False
        competitor.set_session(isolation_level="SERIALIZABLE")
        try:
            with competitor.cursor() as cur:
                cur.execute(
                    "INSERT INTO consensus (shard, seqno, data, summary) "
                    "VALUES ('s', 2, 'theirs-2', ''), ('s', 3, 'theirs-3', '')"
                )
                cur.execute("DELETE FROM consensus WHERE shard = 's' AND seqno < 3")
            with ThreadPoolExecutor(1) as pool:
                ours = pool.submit(store.compare_and_set, "s", 1, VersionedData(2, b"ours"))
                wait_for_lock_waiters(pg_server, db_name(pg_url), 1)
                competitor.commit()
                assert ours.result(timeout=10) is False
        finally:
            competitor.close()
        assert store.scan("s", 0) == [VersionedData(3, b"theirs-3")]
        assert store.head("s") == VersionedData(3, b"theirs-3")


@pytest.mark.postgres
def test_pg_survives_the_server_closing_its_connections(pg_url: str, pg_server: PgServer) -> None:
    with open_consensus(pg_url) as store:
        fill(store, "s", 2)
        admin = pg_server.connect()
        try:
            with admin.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) "
                    "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                    (db_name(pg_url),),
                )
                row = cur.fetchone()
        finally:
            admin.close()
        assert row is not None and row[0] >= 1
        # Dead connections are noticed before use: no call fails.
        assert store.compare_and_set("s", 2, vd(3)) is True
        assert store.head("s") == vd(3)
        assert store.list_shards() == ["s"]


@pytest.mark.postgres
def test_pg_prepares_again_when_its_session_lost_the_statements(pg_url: str) -> None:
    """A session whose prepared statements are gone (``DISCARD ALL``, as a connection
    pooler may run between clients) still serves every call: nothing ran, so the call
    prepares them again and runs once, on the same kept connection."""
    with open_consensus(pg_url) as store:
        records = fill(store, "s", 2)
        # The only way to reach the session the store keeps is through the store: its
        # reused connections (what a pooler would have reset underneath it).
        sessions = cast(Any, store)._conns._idle
        assert sessions
        for session in sessions:
            session.dbapi.cursor().execute("DISCARD ALL")
        assert store.compare_and_set("s", 2, vd(3)) is True
        assert store.compare_and_set("s", 2, vd(3, "stale")) is False
        assert store.scan("s", 0) == [*records, vd(3)]
        assert store.head("s") == vd(3)


@pytest.mark.postgres
@pytest.mark.parametrize("scheme", ["postgres", "postgresql+psycopg2", "cockroachdb"])
def test_pg_scheme_aliases_work_end_to_end(pg_url: str, scheme: str) -> None:
    """``cockroachdb://`` runs the plain (unprepared) statements CockroachDB gets; here
    against PostgreSQL, which speaks the same SQL."""
    uri = pg_url.replace("postgresql://", f"{scheme}://", 1)
    with open_consensus(uri) as store:
        assert isinstance(store, SqlConsensus)
        records = fill(store, "s", 4)
        assert store.compare_and_set("s", 3, vd(4, "stale")) is False
        assert store.compare_and_set("s", None, vd(1, "stale")) is False
        assert store.scan("s", 2, limit=2) == records[1:3]
        assert store.truncate("s", 3) == 2
        assert store.list_shards() == ["s"]
        assert dict(store.list_heads()) == {"s": VersionedData(4, b"", records[3].summary)}
        assert store.head("s") == records[3]


def test_cockroachdb_version_string_is_accepted() -> None:
    class FakeConnection:
        def __init__(self, version: str) -> None:
            self.version = version

        def exec_driver_sql(self, _sql: str) -> Any:
            version = self.version

            class Result:
                def scalar(self) -> str:
                    return version

            return Result()

    dialect = _CockroachDialect()
    crdb = "CockroachDB CCL v23.2.4 (x86_64-pc-linux-gnu, built 2024/04/03 16:54:07, go1.21.5)"
    assert dialect._get_server_version_info(FakeConnection(crdb)) == (13, 0)
    pg = "PostgreSQL 15.20 (Debian 15.20-0+deb12u1) on x86_64-pc-linux-gnu"
    assert dialect._get_server_version_info(FakeConnection(pg)) == (15, 20)


@pytest.mark.postgres
def test_pg_wrong_password_is_an_auth_error_that_never_shows_a_password(
    pg_password_server: PgServer,
) -> None:
    server = pg_password_server
    assert server.password is not None
    with open_consensus(server.url("postgres")) as store:  # the right password works
        assert store.compare_and_set("s", None, vd(1)) is True
        assert server.password not in repr(store) and server.password not in store.url
    wrong = f"wrong-{uuid.uuid4().hex[:8]}"
    for uri in (
        server.url("postgres", password=wrong),
        f"postgresql://postgres@{server.host}:{server.port}/postgres?password={wrong}",
    ):
        with pytest.raises(ConsensusAuthError) as info:
            open_consensus(uri)
        text = all_text(info.value)
        assert wrong not in text and server.password not in text
        assert "password authentication failed" in str(info.value)
        assert "***" in str(info.value)
        assert f"{server.host}:{server.port}/postgres" in str(info.value)


@pytest.mark.postgres
def test_pg_password_is_redacted_from_repr_and_url(pg_url: str) -> None:
    """The session server trusts local TCP, so a password is accepted and ignored."""
    secret = f"s3cret-{uuid.uuid4().hex[:8]}"
    uri = pg_url.replace("postgresql://postgres@", f"postgresql://postgres:{secret}@", 1)
    with open_consensus(uri) as store:
        assert secret not in repr(store) and secret not in store.url
        assert "postgres:***@" in store.url


@pytest.mark.postgres
def test_pg_unknown_role_is_an_auth_error(pg_server: PgServer) -> None:
    role = f"nobody_{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConsensusAuthError) as info:
        open_consensus(pg_server.url("postgres", user=role, password="pw-never-shown"))
    assert f'role "{role}" does not exist' in str(info.value)
    assert "pw-never-shown" not in all_text(info.value)


@pytest.mark.postgres
def test_pg_missing_database_is_a_clear_error(pg_server: PgServer) -> None:
    name = f"missing_{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConsensusError) as info:
        open_consensus(pg_server.url(name))
    assert type(info.value) is ConsensusError
    assert f'database "{name}" does not exist' in str(info.value)
    assert "create the database" in str(info.value)


@pytest.mark.postgres
def test_pg_unreachable_port_is_unavailable() -> None:
    port = free_port()
    began = time.monotonic()
    with pytest.raises(ConsensusUnavailable) as info:
        open_consensus(f"postgresql://postgres:pw-never-shown@127.0.0.1:{port}/db")
    assert time.monotonic() - began < 5
    assert f"127.0.0.1:{port}" in str(info.value)
    assert "pw-never-shown" not in all_text(info.value)


@pytest.mark.postgres
def test_pg_concurrent_opens_of_a_fresh_database_all_succeed(pg_url: str) -> None:
    """CREATE TABLE IF NOT EXISTS races (PostgreSQL can fail one on pg_type) are absorbed."""
    go = threading.Barrier(8)

    def open_one(i: int) -> bool:
        go.wait(timeout=30)
        with open_consensus(pg_url) as store:
            return store.compare_and_set(f"s{i}", None, vd(1))

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(open_one, range(8))) == [True] * 8
    admin = psycopg2.connect(pg_url)
    try:
        with admin.cursor() as cur:
            cur.execute("SELECT count(*) FROM shards")
            assert cur.fetchone() == (8,)
    finally:
        admin.close()


# --- compare_and_set_many: all or nothing over several shards ----------------------------


def test_compare_and_set_many_writes_every_record_or_none(store: Consensus) -> None:
    for shard in ("a", "b", "c"):
        fill(store, shard, 2, shard)
    writes = [CasWrite("a", 2, vd(3, "a")), CasWrite("b", 2, vd(3, "b"))]
    assert store.compare_and_set_many(writes) is True
    assert store.head("a") == vd(3, "a") and store.head("b") == vd(3, "b")
    # One stale head refuses the whole commit: the matching shard is not changed either.
    stale = [CasWrite("a", 3, vd(4, "a")), CasWrite("c", 1, vd(2, "x"))]
    assert store.compare_and_set_many(stale) is False
    assert store.head("a") == vd(3, "a") and store.head("c") == vd(2, "c")
    # A competitor that took one shard's next seqno makes it lose too (no partial insert).
    assert store.compare_and_set("c", 2, vd(3, "won"))
    assert store.compare_and_set_many([CasWrite("a", 3, vd(4, "a")),
                                       CasWrite("c", 2, vd(3, "lost"))]) is False
    assert store.head("a") == vd(3, "a") and store.head("c") == vd(3, "won")
    assert [h.seqno for h in store.list_heads().values()] == [3, 3, 3]


@pytest.mark.parametrize("width", [1, 2, 8, 9, 40])
def test_compare_and_set_many_at_every_width(store: Consensus, width: int) -> None:
    """Every width commits all or nothing, whatever statement the backend picks for it
    (PostgreSQL: a prepared statement per width up to 8, the array form beyond)."""
    shards = [f"w{i:02d}" for i in range(width)]
    for shard in shards:
        fill(store, shard, 1, shard)
    assert store.compare_and_set_many([CasWrite(s_, 1, vd(2, s_)) for s_ in shards]) is True
    assert all(store.head(s_) == vd(2, s_) for s_ in shards)
    # The last shard's head is stale: nothing changes, in any shard.
    stale = [CasWrite(s_, 2, vd(3, "x")) for s_ in shards[:-1]] + [
        CasWrite(shards[-1], 1, vd(2, "x"))]
    assert store.compare_and_set_many(stale) is False
    assert all(store.head(s_) == vd(2, s_) for s_ in shards)
    # A competitor took the last shard's next seqno: the insert loses as a whole.
    assert store.compare_and_set(shards[-1], 2, vd(3, "won"))
    assert store.compare_and_set_many([CasWrite(s_, 2, vd(3, "lost")) for s_ in shards]) is False
    assert store.head(shards[-1]) == vd(3, "won")
    assert all(store.head(s_) == vd(2, s_) for s_ in shards[:-1])


@pytest.mark.parametrize("width", [2, 9])
def test_compare_and_set_many_creates_a_shard_with_the_others_or_not_at_all(
        store: Consensus, width: int) -> None:
    """A write expecting no record (None) creates its shard in the same all-or-nothing
    commit (a transaction registering a name with its appends): it loses, with every
    other write, when the shard has a record already, and a lost commit lists nothing.
    Both PostgreSQL statement forms (fixed width up to 8, arrays beyond) are covered."""
    shards = [f"w{i:02d}" for i in range(width - 1)]
    for shard in shards:
        fill(store, shard, 1, shard)
    # A stale head elsewhere: nothing is written, the new shard is neither created nor
    # listed.
    stale = [CasWrite(s_, 2, vd(3, "x")) for s_ in shards] + [CasWrite("new", None, vd(1, "n"))]
    assert store.compare_and_set_many(stale) is False
    assert store.head("new") is None and "new" not in store.list_shards()
    assert "new" not in store.list_heads()
    writes = [CasWrite(s_, 1, vd(2, s_)) for s_ in shards] + [CasWrite("new", None, vd(1, "n"))]
    assert store.compare_and_set_many(writes) is True
    assert store.head("new") == vd(1, "n") and all(store.head(s_) == vd(2, s_) for s_ in shards)
    assert "new" in store.list_shards() and store.list_heads()["new"].seqno == 1
    # Created already (by that commit, or a competitor's): a second creation loses as a
    # whole, so the other shards do not move either.
    again = [CasWrite(s_, 2, vd(3, "y")) for s_ in shards] + [CasWrite("new", None, vd(1, "m"))]
    assert store.compare_and_set_many(again) is False
    assert store.head("new") == vd(1, "n") and all(store.head(s_) == vd(2, s_) for s_ in shards)
    # A shard truncated down to its head still has a record: never created again.
    assert store.compare_and_set("new", 1, vd(2, "n2"))
    store.truncate("new", 2)
    assert store.compare_and_set_many([CasWrite("new", None, vd(1, "z"))]) is False
    assert store.scan("new", 0) == [vd(2, "n2")]


MANY_INVALID: list[tuple[str, Callable[[Consensus], object]]] = [
    ("empty", lambda s: s.compare_and_set_many([])),
    ("not-a-sequence", lambda s: s.compare_and_set_many(cast(Any, {"a": 1}))),
    ("not-a-caswrite", lambda s: s.compare_and_set_many(cast(Any, [("a", 1, vd(2))]))),
    ("same-shard-twice", lambda s: s.compare_and_set_many([CasWrite("a", 1, vd(2)),
                                                           CasWrite("a", 1, vd(2, "x"))])),
    ("creation-not-at-1", lambda s: s.compare_and_set_many([CasWrite("new", None, vd(2)),
                                                            CasWrite("a", 1, vd(2))])),
    ("wrong-seqno", lambda s: s.compare_and_set_many([CasWrite("a", 1, vd(3))])),
]


@pytest.mark.parametrize("call", [c for _, c in MANY_INVALID], ids=[n for n, _ in MANY_INVALID])
def test_compare_and_set_many_bad_input_raises_and_changes_nothing(
    store: Consensus, call: Callable[[Consensus], object]
) -> None:
    fill(store, "a", 1)
    with pytest.raises(InvalidInput):
        call(store)
    assert store.scan("a", 0) == [vd(1)] and store.list_shards() == ["a"]


def _pair_racer(uri: str, worker: str, rounds: int, start: Any, results: Any) -> None:
    """A spawned process: multi-shard commits on shards x and y, single ones on x."""
    try:
        start.wait(timeout=60)
        wins = 0
        with open_consensus(uri) as store:
            for i in range(rounds):
                hx, hy = store.head("x"), store.head("y")
                assert hx is not None and hy is not None
                tag = f"{worker}/{i}".encode()
                if i % 3 == 2:  # a lone writer of x, racing the pairs
                    store.compare_and_set("x", hx.seqno, VersionedData(hx.seqno + 1, b"solo"))
                    continue
                if store.compare_and_set_many([
                        CasWrite("x", hx.seqno, VersionedData(hx.seqno + 1, tag)),
                        CasWrite("y", hy.seqno, VersionedData(hy.seqno + 1, tag))]):
                    wins += 1
        results.put((worker, wins, None))
    except BaseException as exc:
        results.put((worker, 0, f"{type(exc).__name__}: {exc}"))


@pytest.mark.timeout(180)
def test_compare_and_set_many_is_atomic_under_racing_threads_and_processes(
    consensus_uri: str,
) -> None:
    """Every pair commit lands in both shards or neither, with processes and threads
    racing pair commits against single-shard writers of one of the shards."""
    with open_consensus(consensus_uri) as store:
        fill(store, "x", 1)
        fill(store, "y", 1)
    rounds = 60 if is_mem(consensus_uri) else 30
    ctx = process_context() if not is_mem(consensus_uri) else multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    if is_mem(consensus_uri):  # one process: threads share the named store
        workers: list[Any] = [threading.Thread(target=_pair_racer,
                                               args=(consensus_uri, f"t{i}", rounds, start,
                                                     results)) for i in range(4)]
    else:
        workers = [ctx.Process(target=_pair_racer,
                               args=(consensus_uri, f"p{i}", rounds, start, results))
                   for i in range(3)]
        workers.append(threading.Thread(target=_pair_racer,
                                        args=(consensus_uri, "t0", rounds, start, results)))
    for w in workers:
        w.start()
    start.set()
    outcomes = [results.get(timeout=150) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    assert [err for _, _, err in outcomes if err] == []
    with open_consensus(consensus_uri) as store:
        xs = [r.data for r in store.scan("x", 0) if r.data not in (b"solo",)][1:]
        ys = [r.data for r in store.scan("y", 0)][1:]
    # The pairs appear in the same order in both shards, each exactly once.
    assert xs == ys
    assert len(ys) == sum(wins for _, wins, _ in outcomes) > 0


def test_sqlite_opened_without_create_needs_an_existing_store(tmp_path: Path) -> None:
    """``create=False`` (what read-only commands use) opens an existing store and
    creates nothing: no database file, no tables in a database that has none."""
    path = tmp_path / "typo.db"
    with pytest.raises(ConsensusLocationNotFound, match="no store at") as info:
        open_consensus(f"sqlite:///{path}", create=False)
    assert isinstance(info.value, LocationNotFound) and str(path) in str(info.value)
    assert list(tmp_path.iterdir()) == []

    other = tmp_path / "other.db"  # a SQLite database, but not a persist store
    sqlite3.connect(other).close()
    with pytest.raises(ConsensusLocationNotFound, match="no persist tables"):
        open_consensus(f"sqlite:///{other}", create=False)
    with sqlite3.connect(other) as conn:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []

    with open_consensus(f"sqlite:///{path}") as store:  # created, as by a writer
        assert store.compare_and_set("s", None, vd(1)) is True
    with open_consensus(f"sqlite:///{path}", create=False) as store:
        assert store.head("s") == vd(1)


@pytest.mark.postgres
def test_pg_opened_without_create_creates_no_tables(pg_server: PgServer, pg_url: str) -> None:
    with pytest.raises(ConsensusLocationNotFound, match="no persist tables"):
        open_consensus(pg_url, create=False)
    with psycopg2.connect(pg_url) as conn, conn.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
        assert cursor.fetchone() == (0,)
    conn.close()
    with open_consensus(pg_url) as store:
        assert store.compare_and_set("s", None, vd(1)) is True
    with open_consensus(pg_url, create=False) as store:
        assert store.head("s") == vd(1)
    # A missing database stays what it was: a ConsensusError naming it.
    with pytest.raises(ConsensusError, match="does not exist"):
        open_consensus(pg_server.url(f"missing_{uuid.uuid4().hex[:8]}"), create=False)


@pytest.mark.parametrize("uri", [
    "postgresql://u:hunter2secret@127.0.0.1:1",
    "postgresql://u:hunter2secret@127.0.0.1:1/",
    "postgres://u:hunter2secret@127.0.0.1:1/?sslmode=disable",
    "postgresql+psycopg2://u:hunter2secret@127.0.0.1:1",
    "postgresql:///?host=/tmp&password=hunter2secret",
    "cockroachdb://u:hunter2secret@127.0.0.1:1",
    "cockroachdb://u:hunter2secret@127.0.0.1:1/?sslmode=disable",
])
def test_a_server_uri_without_a_database_is_refused_before_connecting(uri: str) -> None:
    """Without a database name libpq connects to the user's default database (CockroachDB
    to defaultdb): a store there is not the one meant, so the URI is refused, naming
    what is missing, before any connection (nothing listens on port 1) and without
    the password."""
    from persist_pipeline.consensus import check_consensus_uri

    for opener in (open_consensus, check_consensus_uri):
        with pytest.raises(InvalidUri, match="names no database") as info:
            opener(uri)
        assert "hunter2secret" not in all_text(info.value)
        assert uri.split("://")[0] in str(info.value)


def test_a_database_given_as_dbname_parameter_is_accepted() -> None:
    # libpq's own spelling of the database: getting to connect means it was accepted.
    with pytest.raises(ConsensusUnavailable):
        open_consensus("postgresql://u@127.0.0.1:1/?dbname=persist&connect_timeout=2")


def test_opening_a_foreign_sqlite_database_without_create_changes_nothing(
        tmp_path: Path) -> None:
    """create=False "creates nothing": a SQLite file that holds no persist store is
    refused, and left as it was (not switched to WAL journaling, nor written)."""
    import sqlite3

    from persist_pipeline.consensus import open_consensus
    from persist_pipeline.exceptions import ConsensusLocationNotFound

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE mine (x INTEGER)")
        conn.execute("INSERT INTO mine VALUES (1)")
    conn.close()
    before = path.read_bytes()
    with pytest.raises(ConsensusLocationNotFound):
        open_consensus(f"sqlite:///{path}", create=False)
    with sqlite3.connect(path) as conn:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    conn.close()
    assert mode == "delete"
    assert path.read_bytes() == before
    # An empty file (touched, not a database yet) stays empty.
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(ConsensusLocationNotFound):
        open_consensus(f"sqlite:///{empty}", create=False)
    assert empty.stat().st_size == 0


def test_opening_without_create_names_the_file_create_makes(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    """A relative path with ``~`` names one file whether the store is opened with
    create or without: SQLite takes ``~`` literally, so no home-directory lookup."""
    from persist_pipeline.consensus import open_consensus

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "~").mkdir()
    open_consensus("sqlite:///~/c.db").close()
    assert (tmp_path / "~" / "c.db").is_file()
    open_consensus("sqlite:///~/c.db", create=False).close()  # the same file, found
