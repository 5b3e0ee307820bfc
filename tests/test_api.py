"""The public API against every backend combination and the three inline settings.

Each test runs on the ``open_client`` matrix: every inline setting (on, off,
backpressure) on the in-memory backend, and a covering set of them on SQLite + files,
PostgreSQL + S3 and PostgreSQL + S3 with a WAL store.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from persist_pipeline import (
    InlinePolicy,
    NotYetAvailable,
    PersistConfig,
    ShardId,
    ShardNotFound,
    SinceViolation,
    UpperMismatch,
)
from persist_pipeline.exceptions import (
    BackendError,
    ClientClosed,
    FencedOut,
    InvalidFrontier,
    InvalidInput,
    InvalidShardId,
    InvalidUpdates,
    LeaseExpired,
    TokenReused,
)
from tests.fixtures.location import location_kinds, make_location
from tests.helpers import expected_snapshot, rows, state_history


def small_batch(rng: random.Random, lo: int, hi: int, n: int = 5) -> list:
    return [(f"k{rng.randrange(20)}".encode(), f"v{rng.randrange(3)}".encode(),
             rng.randrange(lo, hi), rng.choice([1, 1, 2, -1])) for _ in range(n)]


def expected_placement(policy: InlinePolicy, wal: bool) -> str:
    if policy.max_bytes > 0 and policy.threshold_bytes > 0:
        return "inline"
    return "wal" if wal else "blob"


def test_append_and_snapshot_match_a_model(open_client):
    inline, location = open_client.inline, open_client.location
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    reader = client.open_reader(shard)
    rng = random.Random(1)
    written = []
    upper = 0
    for _ in range(30):
        batch = small_batch(rng, upper, upper + 3)
        res = writer.compare_and_append(batch, expected_upper=upper, new_upper=upper + 3)
        assert res.placement == expected_placement(inline, location.wal_blob_uri is not None)
        assert res.fell_back == (inline.threshold_bytes > 0 and inline.max_bytes == 0)
        assert res.upper == upper + 3 == writer.upper
        written += batch
        upper += 3
    for as_of in (0, 1, 17, 45, upper - 1):
        assert rows(reader.snapshot(as_of), as_of) == expected_snapshot(written, as_of)
    assert client.inspect(shard)["inline_bytes"] <= inline.max_bytes


def test_large_write_goes_to_blob_in_parts(open_client):
    location = open_client.location
    client = open_client(PersistConfig(blob_target_size_bytes=64 * 1024))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    # Incompressible values: about 1 MB encoded, so several parts of 64 KiB.
    rng = random.Random(5)
    big = [(f"key-{i:06d}".encode(), rng.randbytes(50), i % 7, 1) for i in range(20_000)]
    res = writer.compare_and_append(big, 0, 7)
    assert res.placement == ("wal" if location.wal_blob_uri else "blob")
    assert res.num_parts > 1
    info = client.inspect(shard)
    assert info["parts"]["inline"] == 0
    # A part is about the target size, encoded (the last one smaller).
    parts = [p for b in client._machine(str(shard)).fetch_latest().batches.values()
             for p in b.parts]
    assert len(parts) == res.num_parts
    assert all(p.encoded_size < 2 * 64 * 1024 for p in parts)
    snap = client.open_reader(shard).snapshot(6)
    assert snap.num_rows == 20_000
    assert sorted(rows(snap, 6)) == sorted((k, v, 1) for k, v, _, _ in big)


def test_pyarrow_table_input(open_client):
    client = open_client()
    shard = ShardId.new()
    table = pa.table({"k": [b"a", b"b", b"a"], "v": [b"1", b"2", b"1"], "t": [0, 1, 1],
                      "d": [1, 1, 1]})
    client.open_writer(shard).compare_and_append(table, 0, 2)
    assert rows(client.open_reader(shard).snapshot(1), 1) == [(b"a", b"1", 2), (b"b", b"2", 1)]


def test_upper_mismatch_changes_nothing(open_client):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"k", b"v", 0, 1)], 0, 5)
    before = client.inspect(shard)
    with pytest.raises(UpperMismatch) as err:
        writer.compare_and_append([(b"k", b"v", 3, 1)], 3, 9)
    assert (err.value.expected, err.value.current) == (3, 5)
    assert client.inspect(shard)["seqno"] == before["seqno"]
    assert client.inspect(shard)["upper"] == 5


@pytest.mark.parametrize(
    ("updates", "expected", "new", "error"),
    [
        ([(b"k", b"v", 12, 1)], 0, 10, InvalidUpdates),          # time beyond new_upper
        ([(b"k", b"v", 10, 1)], 0, 10, InvalidUpdates),          # time == new_upper
        ([(b"k", b"v", 0, 1)], 0, 0, InvalidFrontier),           # non-advancing upper
        ([(b"k", b"v", 0, 1)], 3, 2, InvalidFrontier),           # regressing upper
        ([("k", b"v", 0, 1)], 0, 10, InvalidUpdates),            # str key
        ([(b"k", 7, 0, 1)], 0, 10, InvalidUpdates),              # int value
        ([(b"k", b"v", -1, 1)], 0, 10, InvalidUpdates),          # negative time
        ([(b"k", b"v", True, 1)], 0, 10, InvalidUpdates),        # bool time
        ([(b"k", b"v", 0, 1.5)], 0, 10, InvalidUpdates),         # float diff
        ([(b"k", b"v", 0)], 0, 10, InvalidUpdates),              # 3-tuple
        ("not updates", 0, 10, InvalidUpdates),
        (pa.table({"k": [1], "v": [b"v"], "t": [0], "d": [1]}), 0, 10, InvalidUpdates),
        (pa.table({"k": [b"k"], "v": [b"v"], "t": [0]}), 0, 10, InvalidUpdates),
    ],
)
def test_bad_input_is_a_typed_error_and_changes_nothing(open_client, updates, expected, new,
                                                         error):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    seqno = client.inspect(shard)["seqno"]
    with pytest.raises(error):
        writer.compare_and_append(updates, expected, new)
    after = client.inspect(shard)
    assert (after["seqno"], after["upper"], after["batches"]) == (seqno, 0, 0)


def test_compaction_flushes_inline_and_preserves_every_read(open_client):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    reader = client.open_reader(shard)
    rng = random.Random(7)
    written = []
    for i in range(40):
        batch = small_batch(rng, i, i + 1)
        writer.compare_and_append(batch, i, i + 1)
        written += batch
    big = [(f"big{i}".encode(), b"v", 40, 1) for i in range(3000)]
    writer.compare_and_append(big, 40, 41)
    written += big
    before = {t: reader.snapshot(t) for t in range(0, 41, 5)}
    info = client.inspect(shard)
    assert info["pending_merge_requests"] >= 1
    metrics = client.compact(shard)
    assert metrics["applied"] == metrics["requests"] >= 1
    assert metrics["inline_bytes_after"] == 0
    after = client.inspect(shard)
    assert after["inline_bytes"] == 0 and after["parts"]["inline"] == 0
    assert after["parts"]["hollow_wal"] == 0, "compaction output goes to the main store"
    assert after["pending_merge_requests"] == 0
    for t, table in before.items():
        assert reader.snapshot(t).equals(table)
        assert rows(table, t) == expected_snapshot(written, t)


@pytest.mark.parametrize("kind", location_kinds("embedded-wal", "pg-s3-wal"))
def test_compaction_moves_every_wal_part_to_the_main_store(kind, request, tmp_path):
    """The WAL store holds fresh write parts only: compaction moves them to the main
    store even when the Spine has nothing to merge (a lone batch in its entry), as it
    flushes inline parts. Before, a WAL batch the Spine never fused stayed in the WAL
    store for good, and the shard reported no pending work."""
    location = make_location(kind, request, tmp_path)
    client = location.client(InlinePolicy(0, 0))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    reader = client.open_reader(shard)
    big = [(f"big{i}".encode(), b"v", 0, 1) for i in range(3000)]
    small = [(f"s{i}".encode(), b"w", 1, 1) for i in range(40)]
    writer.compare_and_append(big, 0, 1)
    writer.compare_and_append(small, 1, 2)  # a lower level than big's: no fusion
    before = {t: reader.snapshot(t) for t in (0, 1)}
    info = client.inspect(shard)
    assert info["parts"]["hollow_wal"] == 2 and info["parts"]["hollow_main"] == 0
    assert info["pending_merge_requests"] == 2, "WAL parts are work for compaction"
    assert client.shard_summaries()[str(shard)].pending_merges == 2
    metrics = client.compact(shard)
    assert metrics["applied"] == metrics["requests"] == 2
    after = client.inspect(shard)
    assert after["parts"]["hollow_wal"] == 0, "compaction leaves nothing in the WAL store"
    assert after["pending_merge_requests"] == 0
    for t, table in before.items():
        assert reader.snapshot(t).equals(table)
        assert rows(table, t) == expected_snapshot(big + small, t)
    assert client.compact(shard)["requests"] == 0, "nothing left to do"
    client.close()


def test_compaction_after_since_advances_keeps_reads_at_or_after_since(open_client):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    reader = client.open_reader(shard)
    written = []
    for t in range(20):
        batch = [(b"k%d" % (t % 4), b"v", t, 1), (b"k%d" % ((t + 1) % 4), b"v", t, -1)]
        writer.compare_and_append(batch, t, t + 1)
        written += batch
    reader.downgrade_since(10)
    snaps = {t: reader.snapshot(t) for t in range(10, 20)}
    client.compact(shard)
    for t, table in snaps.items():
        assert reader.snapshot(t).equals(table)
    with pytest.raises(SinceViolation):
        reader.snapshot(9)


def test_read_frontier_errors(open_client):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    reader = client.open_reader(shard)
    writer.compare_and_append([(b"a", b"b", 0, 1)], 0, 3)
    with pytest.raises(NotYetAvailable):
        reader.snapshot(3)
    reader.downgrade_since(2)
    with pytest.raises(SinceViolation):
        reader.snapshot(1)
    with pytest.raises(InvalidFrontier):
        reader.downgrade_since(1)
    assert rows(reader.snapshot(2), 2) == [(b"a", b"b", 1)]


@pytest.mark.parametrize(("as_of", "hint"), [
    ("LATEST", "spelled exactly 'latest', lower case"),
    ("3", "a str: pass the int 3"),
    ("lastest", "'lastest'"),
    (2.0, "float 2.0"),
    (None, "None"),
    (True, "bool True"),
])
def test_a_bad_as_of_names_what_reads_accept(open_client, as_of, hint):
    """Reads take an int time or exactly ``"latest"``; the message says so (never offering
    None, which reads refuse), for every read that takes ``as_of``."""
    client = open_client()
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"a", b"b", 0, 1)], 0, 3)
    reader = client.open_reader(shard)
    for read in (reader.snapshot, lambda t: list(reader.snapshot_batches(t)),
                 reader.snapshot_fingerprint, reader.listen, reader.snapshot_plan):
        with pytest.raises(InvalidFrontier) as err:
            read(as_of)
        message = str(err.value)
        assert message.startswith("as_of must be an int time or 'latest', got "), message
        assert hint in message and "closed" not in message, message
    assert rows(reader.snapshot("latest"), 2) == [(b"a", b"b", 1)]


def test_listen_after_snapshot_reproduces_the_collection(open_client):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    reader = client.open_reader(shard)
    rng = random.Random(3)
    written = []
    for i in range(10):
        batch = small_batch(rng, i, i + 1)
        writer.compare_and_append(batch, i, i + 1)
        written += batch
    listen = reader.listen(as_of=4)
    seen = [(k, v, 4, d) for k, v, d in rows(reader.snapshot(4), 4)]
    for i in range(10, 20):
        batch = small_batch(rng, i, i + 1)
        writer.compare_and_append(batch, i, i + 1)
        written += batch
        if i == 14:
            client.compact(shard)  # compaction in the middle must not disturb the listen
    frontier = 5
    while frontier < 20:
        for event in listen.poll(timeout_s=5):
            if event.kind == "updates":
                for r in event.updates.to_pylist():
                    assert frontier <= r["t"]
                    seen.append((r["k"], r["v"], r["t"], r["d"]))
            else:
                assert event.upper > frontier
                frontier = event.upper
    assert frontier == 20
    for as_of in range(4, 20):
        assert expected_snapshot(seen, as_of) == expected_snapshot(written, as_of)


def test_a_latest_listen_tells_the_time_its_snapshot_is_read_at(open_client):
    # "latest" is resolved by each call: a write between a snapshot("latest") and a
    # listen("latest") would be in neither. The listen's as_of is the one time to read.
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    reader = client.open_reader(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2)
    listen = reader.listen("latest")
    assert listen.as_of == 1
    writer.compare_and_append([(b"c", b"1", 2, 1)], 2, 3)  # lands before the snapshot
    seen = [(k, v) for k, v, _ in rows(reader.snapshot(listen.as_of), listen.as_of)]
    while listen.frontier < 3:
        for event in listen.poll(timeout_s=5):
            if event.kind == "updates":
                seen += [(r["k"], r["v"]) for r in event.updates.to_pylist()]
    assert sorted(seen) == [(b"a", b"1"), (b"b", b"1"), (b"c", b"1")]
    assert rows(reader.snapshot("latest"), 2) != rows(reader.snapshot(listen.as_of), 1)


def test_closing_a_shard_ends_listens_and_refuses_writes(open_client):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    reader = client.open_reader(shard)
    listen = reader.listen(as_of=0)
    writer.compare_and_append([(b"a", b"b", 2, 1)], 0, None)
    events = list(listen)
    assert events[-1].kind == "progress" and events[-1].upper is None
    assert [r["k"] for e in events if e.kind == "updates" for r in e.updates.to_pylist()] \
        == [b"a"]
    with pytest.raises(InvalidFrontier):
        writer.compare_and_append([], None, None)
    with pytest.raises(UpperMismatch):
        writer.compare_and_append([], 5, 6)
    assert rows(reader.snapshot(10**12), 10**12) == [(b"a", b"b", 1)]


def test_append_semantics_for_definite_writers(open_client):
    client = open_client()
    shard = ShardId.new()
    w1, w2 = client.open_writer(shard), client.open_writer(shard)
    data = [(b"a", b"1", 0, 1), (b"b", b"1", 3, 1), (b"c", b"1", 6, 1)]
    assert w1.append(data[:2], 0, 5).placement != "none"
    # w2 writes the same definite data over [0, 10): the part below 5 is cut away.
    res = w2.append(data, 0, 10)
    assert res.upper == 10 and res.num_updates == 1
    # Already written entirely: a no-op.
    assert w1.append(data, 0, 10).placement == "none"
    # A gap would open: a mismatch.
    with pytest.raises(UpperMismatch):
        w1.append([(b"z", b"1", 12, 1)], 12, 14)
    assert rows(client.open_reader(shard).snapshot(9), 9) == [
        (b"a", b"1", 1), (b"b", b"1", 1), (b"c", b"1", 1)]


def test_retry_with_the_same_idempotency_token_applies_once(open_client):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    first = writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1, idempotency_token="tok-1")
    again = writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1, idempotency_token="tok-1")
    assert not first.already_committed and again.already_committed
    assert rows(client.open_reader(shard).snapshot(0), 0) == [(b"a", b"1", 1)]


def test_a_new_write_reusing_a_token_to_the_same_upper_is_refused_not_dropped(open_client):
    """The same handle's new write at another expected_upper, reusing the token of its
    last write and reaching the same upper, is not a retry of that write: reported
    already committed, its rows were dropped. TokenReused, nothing written."""
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 2, idempotency_token="tok-1")
    with pytest.raises(TokenReused, match=r"already named a write appended at \[0, 2\)"):
        writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2, idempotency_token="tok-1")
    assert rows(client.open_reader(shard).snapshot(1), 1) == [(b"a", b"1", 1)]
    # Its real retry is still reported committed.
    assert writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 2,
                                     idempotency_token="tok-1").already_committed


def test_a_token_reused_to_the_same_upper_after_compaction_is_refused_not_dropped(open_client):
    """Once compaction merged the earlier write's batch away, only the writer's record
    of its last write (token and bounds) is left to tell a retry from a new write
    reusing the token: the new write at another expected_upper reaching the same upper
    was reported already committed and its rows dropped. TokenReused, nothing written;
    the real retry is still reported committed."""
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2, idempotency_token="tok-1")
    assert client.compact(shard)["applied"] >= 1
    assert client.inspect(shard)["batches"] == 1, "the tokened batch was merged away"
    seqno = client.inspect(shard)["seqno"]
    with pytest.raises(TokenReused, match=r"already named a write appended at \[1, 2\)"):
        writer.compare_and_append([(b"c", b"1", 0, 1)], 0, 2, idempotency_token="tok-1")
    assert client.inspect(shard)["seqno"] == seqno
    assert rows(client.open_reader(shard).snapshot(1), 1) == [(b"a", b"1", 1), (b"b", b"1", 1)]
    assert writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2,
                                     idempotency_token="tok-1").already_committed


@pytest.mark.parametrize("token", [
    b"\xbc\x01" * 8,        # uuid4().bytes: not text
    "",                     # not "no token": a retry would silently lose its protection
    "t" * 129,              # longer than a blob key segment may be
    "../../escape",         # a path out of the shard's folder
    "a/b",                  # nested blob folders
    "tok en",
    "tök",
    7,
], ids=["bytes", "empty", "too-long", "dotdot", "slash", "space", "non-ascii", "int"])
def test_a_malformed_idempotency_token_is_refused_and_changes_nothing(open_client, token):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    before = client.inspect(shard)
    with pytest.raises(InvalidInput, match="idempotency_token must be"):
        writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1, idempotency_token=token)
    with pytest.raises(InvalidInput, match="idempotency_token must be"):
        writer.committed(token, 0)
    txn = client.transaction()
    with pytest.raises(InvalidInput, match="idempotency_token must be"):
        txn.compare_and_append(writer, [(b"a", b"1", 0, 1)], 0, 1, idempotency_token=token)
    with pytest.raises(InvalidInput, match="empty transaction"):
        txn.commit()  # the refused append was not added
    after = client.inspect(shard)
    assert (after["seqno"], after["upper"], after["batches"]) == (before["seqno"], 0, 0)
    # The longest token of every allowed character is accepted.
    token = ("AZaz09_-" * 16)[:128]
    assert not writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1,
                                         idempotency_token=token).already_committed
    assert writer.committed(token, 0) is True


def test_unknown_and_malformed_shards(open_client):
    client = open_client()
    with pytest.raises(ShardNotFound):
        client.open_reader(ShardId.new())
    with pytest.raises(ShardNotFound):
        client.inspect(ShardId.new())
    with pytest.raises(InvalidShardId):
        client.open_writer("not-a-shard")
    with pytest.raises(InvalidShardId):
        ShardId.parse("s" + "0" * 36)
    shard = ShardId.new()
    assert ShardId.parse(str(shard)) == shard


def test_expired_reader_cannot_read_and_releases_its_hold(open_client):
    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    r1, r2 = client.open_reader(shard), client.open_reader(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 10)
    r1.downgrade_since(5)
    assert client.inspect(shard)["since"] == 0  # r2 still holds 0
    r2.expire()
    assert client.inspect(shard)["since"] == 5
    with pytest.raises(LeaseExpired):
        r2.snapshot(5)


def test_critical_reader_is_fenced(open_client):
    client = open_client()
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"a", b"1", 0, 1)], 0, 10)
    c1 = client.open_critical_reader(shard, "c-controller", opaque=b"epoch-1")
    c2 = client.open_critical_reader(shard, "c-controller", opaque=b"ignored")
    assert c2.opaque == b"epoch-1"
    assert c1.compare_and_downgrade_since(b"epoch-1", b"epoch-2", 4) == 4
    with pytest.raises(FencedOut) as err:
        c2.compare_and_downgrade_since(b"epoch-1", b"epoch-1", 6)
    assert err.value.current == b"epoch-2"
    assert client.inspect(shard)["since"] == 4


def test_handle_arguments_of_the_wrong_type_are_refused_and_change_nothing(open_client):
    """Arguments that would reach the state codec or protobuf encoder with the wrong
    type are refused up front, naming the argument, and register nothing."""
    client = open_client()
    shard = ShardId.new()
    client.open_writer(shard).compare_and_append([(b"a", b"1", 0, 1)], 0, 10)
    critical = client.open_critical_reader(shard, "c-controller", opaque=b"epoch-1")
    before = client.inspect(shard)
    refused = [
        (lambda: client.open_critical_reader(shard, 5, b"a"), "reader_id must be"),
        (lambda: client.open_critical_reader(shard, "", b"a"), "reader_id must be"),
        (lambda: client.open_critical_reader(shard, "c-other", "str"), "opaque must be bytes"),
        (lambda: client.open_critical_reader(shard, "c-other", b"", debug=5), "debug must be"),
        (lambda: client.open_writer(shard, debug=5), "debug must be"),
        (lambda: client.open_reader(shard, debug=b"x"), "debug must be"),
        (lambda: client.open_reader(shard, create="no"), "create must be"),
        (lambda: client.resolve("orders", create="no"), "create must be"),
        (lambda: client.gc(shard, sweep_orphans="no"), "sweep_orphans must be"),
        (lambda: critical.compare_and_downgrade_since("epoch-1", b"epoch-2", 4),
         "expected_opaque must be bytes"),
        (lambda: critical.compare_and_downgrade_since(b"epoch-1", "epoch-2", 4),
         "new_opaque must be bytes"),
    ]
    for call, message in refused:
        with pytest.raises(InvalidInput, match=message):
            call()
    after = client.inspect(shard)
    for field in ("seqno", "since", "readers", "critical_readers", "writers"):
        assert after[field] == before[field], field
    assert client.shard_names() == {}
    assert critical.compare_and_downgrade_since(b"epoch-1", b"epoch-2", 4) == 4


def test_a_closed_client_and_its_handles_raise_client_closed(open_client):
    """Using a client after ``close()`` is a usage error, not a backend failure: every
    call raises ``ClientClosed`` (never a ``BackendError``) and changes nothing."""
    client = open_client()
    shard = ShardId.new()
    writer, reader = client.open_writer(shard), client.open_reader(shard)
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1)
    client.close()
    client.close()  # idempotent
    calls = [
        lambda: client.open_writer(shard),
        lambda: client.open_reader(shard),
        lambda: client.inspect(shard),
        lambda: client.list_shards(),
        lambda: writer.compare_and_append([(b"b", b"1", 1, 1)], 1, 2),
        lambda: writer.fetch_recent_upper(),
        lambda: reader.snapshot(0),
    ]
    for call in calls:
        with pytest.raises(ClientClosed, match="was closed: open a new client") as err:
            call()
        assert not isinstance(err.value, BackendError)
    txn = client.transaction()
    txn.compare_and_append(writer, [(b"c", b"1", 1, 1)], 1, 2)
    with pytest.raises(ClientClosed):
        txn.commit()
    fresh = open_client()
    assert fresh.inspect(shard)["upper"] == 1
    assert rows(fresh.open_reader(shard).snapshot(0), 0) == [(b"a", b"1", 1)]


def test_fresh_client_rebuilds_state_from_rollups(open_client):
    # Rollups in the writer's own call, so their seqnos are deterministic here.
    cfg = PersistConfig(rollup_threshold=8, background_maintenance=False)
    client = open_client(cfg)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    written = []
    for t in range(50):
        batch = [(b"k%d" % (t % 7), b"v", t, 1)]
        writer.compare_and_append(batch, t, t + 1)
        written += batch
    info = client.inspect(shard)
    assert len(info["rollups"]) >= 5
    fresh = open_client(cfg)
    machine = fresh._machine(shard)
    state = machine.fetch_latest()
    assert state.seqno == info["seqno"]
    # Rebuilt from the latest rollup: only the records after it are scanned.
    assert fresh.metrics.records_scanned <= cfg.rollup_threshold + 1
    assert rows(fresh.open_reader(shard).snapshot(49), 49) == expected_snapshot(written, 49)


def test_background_rollup_is_recorded_by_the_next_commit(open_client):
    cfg = PersistConfig(rollup_threshold=8)  # background maintenance is the default
    client = open_client(cfg)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    machine = client._machine(shard)
    t = 0
    while machine.maintenance._pending is None:  # appends until a rollup is due
        writer.compare_and_append([(b"k%d" % t, b"v", t, 1)], t, t + 1)
        t += 1
    machine.maintenance._pending.result(timeout=60)  # stored in blob, not yet in the state
    assert machine.fetch_latest().rollups == {}
    assert client.metrics.rollups_written == 1
    writer.compare_and_append([(b"k%d" % t, b"v", t, 1)], t, t + 1)  # records it
    (rollup_seqno,) = machine.fetch_latest().rollups
    head = machine.fetch_latest().seqno
    fresh = open_client(cfg)
    fresh._machine(shard).fetch_latest()
    assert fresh.metrics.records_scanned == head - rollup_seqno
    assert rows(fresh.open_reader(shard).snapshot(t), t) == \
        sorted((b"k%d" % i, b"v", 1) for i in range(t + 1))


def test_gc_deletes_replaced_parts_and_truncates_consensus(open_client):
    inline = open_client.inline
    cfg = PersistConfig(rollup_threshold=4)
    client = open_client(cfg)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    written = []
    for t in range(30):
        batch = [(b"k%d" % (t % 5), b"v%d" % t, t, 1)]
        writer.compare_and_append(batch, t, t + 1)
        written += batch
    client.compact(shard)
    writer.compare_and_append([], 30, 31)  # a rollup after compaction
    for t in range(31, 40):
        writer.compare_and_append([], t, t + 1)
    metrics = client.gc(shard)
    assert metrics["seqnos_truncated"] > 0
    if inline.max_bytes == 0:
        assert metrics["blobs_deleted"] > 0  # the pre-compaction parts
    assert client.consensus.scan(str(shard), 0)[0].seqno == metrics["earliest_seqno"]
    # Every blob left is referenced by a live state, and every reference resolves.
    live = set()
    for state in state_history(client, str(shard)):
        live |= {(p.store, p.key) for b in state.batches.values() for p in b.hollow_parts()}
    live |= {("main", r.key) for r in state.rollups.values()}  # the latest state's rollups
    stores = {"main": client.blobs.main, "wal": client.blobs.wal}
    present = {(name, m.key) for name, blob in stores.items() if blob is not None
               for m in blob.list_keys(f"{shard}/")}
    assert present == live
    fresh = open_client(cfg)
    assert rows(fresh.open_reader(shard).snapshot(39), 39) == expected_snapshot(written, 39)


def test_small_append_record_does_not_grow_with_the_state(location):
    client = location.client(InlinePolicy())
    shard = ShardId.new()
    writer = client.open_writer(shard)
    sizes = []
    payload = b"x" * 900
    for t in range(1000):
        writer.compare_and_append([(b"key%05d" % t, payload, t, 1)], t, t + 1)
        sizes.append(len(client.consensus.head(str(shard)).data))
    assert client.inspect(shard)["inline_bytes"] > 900_000
    early = sorted(sizes[10:60])[25]
    late = sorted(sizes[-50:])[25]
    assert late <= early * 1.1 + 64, (early, late)
    client.close()


def test_every_state_version_respects_the_inline_bound(location):
    policy = InlinePolicy(threshold_bytes=4096, max_bytes=3000)
    client = location.client(policy)
    shard = ShardId.new()
    writer = client.open_writer(shard)
    placements = [writer.compare_and_append([(b"k", b"x" * 300, t, 1)], t, t + 1).placement
                  for t in range(30)]
    assert placements.count("inline") == 9  # 9 x 312 bytes fit in 3000
    versions = list(state_history(client, str(shard)))
    assert len(versions) >= 30
    assert max(s.inline_bytes for s in versions) <= policy.max_bytes
    assert all(s.inline_bytes == sum(b.inline_bytes for b in s.batches.values())
               for s in versions)
    client.close()


def test_committed_tells_whether_a_tokened_write_landed(open_client):
    """A process records (token, expected upper) before a write and dies before it learns
    the outcome: ``committed`` settles it afterwards, through compaction and for writes
    in a transaction, and never claims a write that did not land."""
    from persist_pipeline.ids import new_token

    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    landed, refused, in_txn = new_token(), new_token(), new_token()
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1, idempotency_token=landed)
    with pytest.raises(UpperMismatch):  # a stale attempt: nothing written
        writer.compare_and_append([(b"b", b"1", 0, 1)], 0, 1, idempotency_token=refused)
    with client.transaction() as txn:
        txn.compare_and_append(writer, [(b"c", b"1", 1, 1)], 1, 2, idempotency_token=in_txn)
    assert writer.committed(landed, 0) is True
    assert writer.committed(in_txn, 1) is True
    assert writer.committed(refused, 0) is False
    assert writer.committed(new_token(), 2) is False  # never attempted
    # Compaction merges the batches away; the kept history still tells.
    client.compact(shard)
    assert writer.committed(landed, 0) is True and writer.committed(refused, 0) is False
    with pytest.raises(InvalidFrontier):
        writer.committed(landed, None)
    writer.expire()
    with pytest.raises(LeaseExpired):
        writer.committed(landed, 0)


def test_committed_tells_that_a_write_of_no_rows_landed(open_client):
    """A write of no rows leaves no batch, only its writer's record of the token: it
    committed (its retry is reported already committed), so ``committed`` must not
    answer False ("certainly not") for it, also from another process's handle, once
    the writer expired, and after GC truncated the records; a write never made stays
    False and the token of one made at another ``expected_upper`` is refused."""
    from persist_pipeline.ids import new_token

    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    empty = new_token()
    writer.compare_and_append([], 0, 1, idempotency_token=empty)
    assert writer.compare_and_append([], 0, 1, idempotency_token=empty).already_committed
    other = open_client().open_writer(shard)  # another process settling it
    assert other.committed(empty, 0) is True
    assert other.committed(new_token(), 0) is False
    with pytest.raises(TokenReused):
        other.committed(empty, 1)
    writer.expire()  # its record leaves the state; the kept records still tell
    assert other.committed(empty, 0) is True
    for t in range(1, 6):
        other.compare_and_append([(b"k", b"v", t, 1)], t, t + 1)
    client.gc(shard)
    assert other.committed(empty, 0) in (True, None)  # never "certainly not"
    other.expire()


def test_committed_is_never_false_for_a_landed_write_whose_history_gc_truncated(open_client):
    """Guarantee 21's third answer: once compaction merged a landed write's batch away,
    its writer expired and GC truncated every record that named it, ``committed`` says
    None (cannot tell) or True, never False ("certainly not")."""
    from persist_pipeline.ids import new_token

    client = open_client(PersistConfig(rollup_threshold=2))
    shard = ShardId.new()
    writer = client.open_writer(shard)
    landed = new_token()
    writer.compare_and_append([(b"a", b"1", 0, 1)], 0, 1, idempotency_token=landed)
    writer.expire()  # its record of the token leaves the state
    other = client.open_writer(shard)
    for t in range(1, 9):
        other.compare_and_append([(b"b%d" % t, b"1", t, 1)], t, t + 1)
    client.compact(shard)
    for t in range(9, 17):
        other.compare_and_append([], t, t + 1)
    client.gc(shard)
    client.gc(shard)
    first = client.consensus.scan(str(shard), 0, limit=1)[0].seqno
    assert first > 3, "GC truncated the records of the write and of its merge"
    assert other.committed(landed, 0) in (True, None)
    other.expire()


def test_a_retry_of_a_landed_write_of_no_rows_is_reported_committed(open_client):
    """A write of no rows whose outcome its caller never learnt, retried with its token
    after other writes moved the upper: it committed, so the retry reports it already
    committed (as a write with rows is), not UpperMismatch ("certainly not")."""
    from persist_pipeline.ids import new_token

    client = open_client()
    shard = ShardId.new()
    writer = client.open_writer(shard)
    empty = new_token()
    writer.compare_and_append([], 0, 1, idempotency_token=empty)  # its reply "lost"
    writer.compare_and_append([(b"a", b"1", 1, 1)], 1, 2)  # the writer's record moves on
    retry = writer.compare_and_append([], 0, 1, idempotency_token=empty)
    assert retry.already_committed
    assert writer.fetch_recent_upper() == 2
    writer.expire()


def test_append_bounds_fast_path_decides_as_the_full_checks() -> None:
    """The bounds check's fast path (plain ints) accepts and refuses exactly what the full
    checks do, on the edges: bools, int subclasses, closed uppers, the largest time."""
    import enum
    import itertools

    from persist_pipeline.exceptions import InvalidFrontier as Invalid
    from persist_pipeline.frontier import MAX_TIME, check_frontier, less_than
    from persist_pipeline.write import check_append_bounds

    class Seven(enum.IntEnum):
        SEVEN = 7

    def reference(lower: object, upper: object) -> object:
        expected = check_frontier(lower, "expected_upper")
        if expected is None:
            raise Invalid("closed")
        new = check_frontier(upper, "new_upper")
        if not less_than(expected, new):
            raise Invalid("not beyond")
        return expected, new

    values = [-1, 0, 1, 6, Seven.SEVEN, 8, MAX_TIME - 1, MAX_TIME, MAX_TIME + 1, True, False,
              None, 2.0, "3"]
    for lower, upper in itertools.product(values, repeat=2):
        try:
            want: object = reference(lower, upper)
        except Invalid:
            want = Invalid
        try:
            got: object = check_append_bounds(lower, upper)
        except Invalid:
            got = Invalid
        assert got == want, (lower, upper)
        if want is not Invalid:
            assert [type(x) for x in got] == [type(x) for x in want], (lower, upper)  # type: ignore[union-attr]
