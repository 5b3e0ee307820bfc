"""Blob stores: one conformance suite for mem, file and s3, then backend specifics."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import botocore.exceptions
import pytest
from botocore.exceptions import ClientError

from persist_pipeline.blob import (
    Blob,
    BlobMeta,
    CachingBlob,
    FaultConfig,
    FaultyBlob,
    LocalBlob,
    MemoryBlob,
    S3Blob,
    open_blob,
    validate_key,
)
from persist_pipeline.blob.memory import forget_shared
from persist_pipeline.exceptions import (
    AuthError,
    BlobAuthError,
    BlobError,
    BlobLocationNotFound,
    BlobUnavailable,
    InvalidConfig,
    InvalidInput,
    InvalidUri,
    Unavailable,
)
from tests.helpers import process_context

MiB = 1024 * 1024

BAD_KEYS = [
    "",
    "../x",
    "a/../../x",
    "..",
    ".",
    "/abs",
    "/",
    "a//b",
    "a/./b",
    "a/",
    "./a",
    "nul\x00byte",
    "back\\slash",
    "a/..",
]

ODD_GOOD_KEYS = [
    "a b",
    "ünïcödé/ключ/鍵",
    ".hidden",
    "a..b",
    "...",
    "x-y_z~",
    "pct%20+plus?q=1&r#frag",
    "semi;colon:col,comma'quote\"",
    "deep/" * 20 + "leaf",
]


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(
    params=["mem", "file", pytest.param("s3", marks=pytest.mark.s3)],
)
def any_blob_uri(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URI of a fresh, empty store of each kind."""
    if request.param == "mem":
        name = f"test-{uuid.uuid4().hex}"
        yield f"mem://{name}"
        forget_shared(name)
    elif request.param == "file":
        yield f"file://{tmp_path}/blobs"
    else:
        yield request.getfixturevalue("s3_uri")


@pytest.fixture
def blob(any_blob_uri: str) -> Iterator[Blob]:
    """The store ``any_blob_uri`` names."""
    store = open_blob(any_blob_uri)
    yield store
    store.close()


def keys_of(store: Blob, prefix: str = "") -> list[str]:
    return [meta.key for meta in store.list_keys(prefix)]


# --- conformance: every backend -----------------------------------------------------------


def test_get_set_delete(blob: Blob) -> None:
    assert blob.get("missing") is None
    assert blob.delete("missing") is None
    blob.set("a/b/c", b"value")
    assert blob.get("a/b/c") == b"value"
    assert blob.get("a/b") is None  # a "directory" is not an object
    assert blob.get("a/b/c/d") is None
    assert blob.delete("a/b/c") == 5
    assert blob.get("a/b/c") is None
    assert blob.delete("a/b/c") is None
    assert keys_of(blob) == []


def test_overwrite(blob: Blob) -> None:
    blob.set("k", b"first value")
    blob.set("k", b"second")
    assert blob.get("k") == b"second"
    assert [(m.key, m.size) for m in blob.list_keys()] == [("k", 6)]


def test_binary_and_empty_values(blob: Blob) -> None:
    binary = bytes(range(256)) * 17 + b"\r\n\x00\xff"
    blob.set("bin", binary)
    blob.set("empty", b"")
    blob.set("ba", bytearray(b"from a bytearray"))
    blob.set("mv", memoryview(b"from a memoryview"))
    assert blob.get("bin") == binary
    assert blob.get("empty") == b""  # empty, not missing
    assert blob.get("ba") == b"from a bytearray"
    assert blob.get("mv") == b"from a memoryview"
    assert blob.delete("empty") == 0


def test_non_bytes_value_rejected(blob: Blob) -> None:
    with pytest.raises(InvalidInput):
        blob.set("k", "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        blob.set("k", None)  # type: ignore[arg-type]
    assert keys_of(blob) == []


def test_large_value(blob: Blob) -> None:
    value = os.urandom(8 * MiB)
    blob.set("big/value", value)
    assert blob.get("big/value") == value
    assert [(m.key, m.size) for m in blob.list_keys()] == [("big/value", 8 * MiB)]
    assert blob.delete("big/value") == 8 * MiB


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_rejected_and_nothing_written(blob: Blob, key: str) -> None:
    with pytest.raises(InvalidInput):
        blob.set(key, b"x")
    with pytest.raises(InvalidInput):
        blob.get(key)
    with pytest.raises(InvalidInput):
        blob.delete(key)
    assert keys_of(blob) == []


def test_non_string_keys_rejected(blob: Blob) -> None:
    for key in (None, b"bytes", 5):
        with pytest.raises(InvalidInput):
            blob.set(key, b"x")  # type: ignore[arg-type]
        with pytest.raises(InvalidInput):
            blob.get(key)  # type: ignore[arg-type]
    assert keys_of(blob) == []


def test_odd_but_valid_keys_round_trip(blob: Blob) -> None:
    for i, key in enumerate(ODD_GOOD_KEYS):
        blob.set(key, f"value {i}".encode())
    for i, key in enumerate(ODD_GOOD_KEYS):
        assert blob.get(key) == f"value {i}".encode(), key
    assert keys_of(blob) == sorted(ODD_GOOD_KEYS)


def test_list_with_prefixes_and_sizes(blob: Blob) -> None:
    before = time.time()
    contents = {"a/1": b"x", "a/2": b"yy", "a/sub/3": b"zzz", "ab/4": b"4444", "b/5": b"55555"}
    for key, value in contents.items():
        blob.set(key, value)
    after = time.time()
    listing = list(blob.list_keys())
    assert all(isinstance(meta, BlobMeta) for meta in listing)
    assert [(m.key, m.size) for m in listing] == sorted((k, len(v)) for k, v in contents.items())
    for meta in listing:  # S3 stores whole seconds
        assert before - 2 <= meta.last_modified <= after + 2
    assert keys_of(blob, "a/") == ["a/1", "a/2", "a/sub/3"]
    assert keys_of(blob, "a") == ["a/1", "a/2", "a/sub/3", "ab/4"]
    assert keys_of(blob, "a/s") == ["a/sub/3"]
    assert keys_of(blob, "a/sub/") == ["a/sub/3"]
    assert keys_of(blob, "b/5") == ["b/5"]
    assert keys_of(blob, "c") == []
    assert keys_of(blob, "zz/top/") == []


@pytest.mark.parametrize("prefix", ["/a", "a//b", "../", "a/../", "./", "a\\b", "a\x00"])
def test_bad_prefixes_rejected(blob: Blob, prefix: str) -> None:
    with pytest.raises(InvalidInput):
        list(blob.list_keys(prefix))


def test_concurrent_sets_from_threads(blob: Blob) -> None:
    threads, per_thread = 8, 12
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def writer(t: int) -> None:
        try:
            start.wait()
            for i in range(per_thread):
                blob.set(f"t{t}/k{i}", f"{t}:{i}".encode() * 100)
                blob.set("shared/key", f"thread {t} wrote this".encode() * 1000)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    pool = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert errors == []
    for t in range(threads):
        for i in range(per_thread):
            assert blob.get(f"t{t}/k{i}") == f"{t}:{i}".encode() * 100
    shared = blob.get("shared/key")
    assert shared in {f"thread {t} wrote this".encode() * 1000 for t in range(threads)}
    assert len(keys_of(blob)) == threads * per_thread + 1


def test_second_handle_sees_the_data(any_blob_uri: str, blob: Blob) -> None:
    blob.set("persisted", b"yes")
    other = open_blob(any_blob_uri)
    try:
        assert other.get("persisted") == b"yes"
        other.delete("persisted")
        assert blob.get("persisted") is None
    finally:
        other.close()


def test_describe_close_and_cache_wrapper(any_blob_uri: str) -> None:
    store = open_blob(any_blob_uri, cache_bytes=1 * MiB)
    assert isinstance(store, CachingBlob)
    assert store.kind in ("mem", "file", "s3")
    assert isinstance(store.describe(), str) and "cache" in store.describe()
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.get("k") == b"v"
    assert store.hits == 2 and store.misses == 0  # the set populated the cache
    store.close()
    store.close()  # idempotent


# --- open_blob ----------------------------------------------------------------------------


@pytest.mark.parametrize("uri", [None, 5, b"mem://x", ["mem://"]])
def test_open_blob_rejects_non_strings(uri: Any) -> None:
    with pytest.raises(InvalidUri):
        open_blob(uri)


@pytest.mark.parametrize(
    "uri", ["", "   ", "nonsense", "http://example.com/x", "gs://bucket", "mem:", "/abs/path"]
)
def test_open_blob_rejects_unsupported(uri: str) -> None:
    with pytest.raises(InvalidUri) as info:
        open_blob(uri)
    message = str(info.value)
    for scheme in ("mem://", "file://", "s3://"):
        assert scheme in message


@pytest.mark.parametrize(
    "uri",
    [
        "mem://x?y=1",
        "mem://bad name",
        "mem://x#frag",
        "file://./relative",
        "file://host/abs",
        "file:///",
        "file:///tmp/x?mode=1",
        "file://user:pw@localhost/tmp/x",
        "s3://",
        "s3:///prefix-without-bucket",
        "s3://b",  # too short for a bucket name
        "s3://bucket:9000/x",
        "s3://bucket/a/../b",
        "s3://bucket?addressing_style=sideways",
        "s3://bucket?connect_timeout=soon",
        "s3://bucket?connect_timeout=-1",
        "s3://bucket?max_attempts=0",
        "s3://bucket?endpoint_url=ftp://x",
        "s3://bucket?endpoint_url=http://u:p@host:1",
        "s3://bucket?region=",
        "s3://bucket?region=a&region=b",
        "s3://bucket?access_key_id=AKID",  # no secret
        "s3://bucket?session_token=tok",  # no keys
    ],
)
def test_open_blob_rejects_malformed(uri: str) -> None:
    with pytest.raises(InvalidUri):
        open_blob(uri)


def test_open_blob_cache_bytes_checked() -> None:
    with pytest.raises(InvalidConfig):
        open_blob("mem://", cache_bytes=-1)
    assert isinstance(open_blob("mem://", cache_bytes=0), MemoryBlob)


def test_unknown_s3_params_named_without_values() -> None:
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
    uri = f"s3://bucket/p?aws_secret_access_key={secret}&secret_access_key={secret}&colour=red"
    with pytest.raises(InvalidUri) as info:
        open_blob(uri)
    message = str(info.value)
    assert "aws_secret_access_key" in message and "colour" in message
    assert secret not in message and "red" not in message
    assert secret not in "".join(traceback.format_exception(info.value))


def test_validate_key_returns_key() -> None:
    assert validate_key("a/b.c") == "a/b.c"


# --- memory -------------------------------------------------------------------------------


def test_memory_named_stores_are_shared_and_private_ones_are_not() -> None:
    name = f"shared-{uuid.uuid4().hex}"
    one, two = open_blob(f"mem://{name}"), open_blob(f"mem://{name}")
    one.set("k", b"v")
    assert two.get("k") == b"v"
    assert open_blob("mem://").get("k") is None
    private = open_blob("mem://")
    private.set("k", b"p")
    assert open_blob("mem://").get("k") is None
    assert one.describe() == f"mem://{name}"
    forget_shared(name)
    assert open_blob(f"mem://{name}").get("k") is None
    assert two.get("k") == b"v"  # open handles keep their objects


def test_memory_value_is_a_copy() -> None:
    store = MemoryBlob()
    buffer = bytearray(b"abc")
    store.set("k", buffer)
    buffer[0] = ord("z")
    assert store.get("k") == b"abc"


# --- local files --------------------------------------------------------------------------


def _kill_me_writer(root: str, size: int, ready: Any) -> None:
    """Child process: overwrite one key with alternating complete values forever."""
    store = LocalBlob(root)
    values = [bytes([65 + i]) * size for i in range(2)]
    store.set("victim", values[0])
    ready.set()
    i = 1
    while True:
        store.set("victim", values[i % 2])
        i += 1


def test_local_writer_killed_mid_write_leaves_old_or_new(tmp_path: Path) -> None:
    """SIGKILL a process overwriting a 16 MiB value: readers, before and after, see a
    complete value, and the dead writer's temp file is never listed.

    Kills land mid-write most of the time (the writer spends nearly all its time
    writing); we retry a few times until one has provably done so (a temp file is left).
    """
    size = 16 * MiB
    complete = {bytes([65 + i]) * size for i in range(2)}
    ctx = process_context()
    killed_mid_write = False
    for attempt in range(5):
        root = tmp_path / f"blobs{attempt}"
        store = LocalBlob(root)
        ready = ctx.Event()
        child = ctx.Process(target=_kill_me_writer, args=(str(root), size, ready), daemon=True)
        child.start()
        try:
            assert ready.wait(30), "writer did not start"
            deadline = time.monotonic() + 0.3 + 0.1 * attempt
            reads = 0
            while time.monotonic() < deadline:  # a reader never sees a partial value
                assert store.get("victim") in complete
                reads += 1
            assert reads > 0
        finally:
            assert child.pid is not None
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
        assert child.exitcode == -signal.SIGKILL
        assert store.get("victim") in complete
        assert keys_of(store) == ["victim"]
        leftovers = [p.name for p in root.iterdir() if p.name != "victim"]
        assert all(name.startswith(".tmp-") for name in leftovers)
        if leftovers:
            killed_mid_write = True
            break
    assert killed_mid_write, "no kill landed mid-write in 5 attempts"


def test_local_temp_files_are_not_listed_or_addressable(tmp_path: Path) -> None:
    store = LocalBlob(tmp_path)
    store.set("dir/real", b"r")
    leftover = ".tmp-" + "0" * 32
    (tmp_path / leftover).write_bytes(b"partial")
    (tmp_path / "dir" / leftover).write_bytes(b"partial")
    assert keys_of(store) == ["dir/real"]
    with pytest.raises(InvalidInput):
        store.get(leftover)
    with pytest.raises(InvalidInput):
        store.set(f"dir/{leftover}", b"x")
    store.set(".tmp-not-hex", b"ok")  # only the exact temp form is reserved
    assert store.get(".tmp-not-hex") == b"ok"


def test_local_symlink_escapes_rejected(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"do not read")
    store = LocalBlob(root)
    (root / "dirlink").symlink_to(outside, target_is_directory=True)
    (root / "filelink").symlink_to(outside / "secret")
    with pytest.raises(InvalidInput):
        store.get("dirlink/secret")
    with pytest.raises(InvalidInput):
        store.set("dirlink/planted", b"x")
    with pytest.raises(InvalidInput):
        store.delete("dirlink/secret")
    with pytest.raises(InvalidInput):
        store.get("filelink")
    with pytest.raises(InvalidInput):
        store.set("filelink", b"x")
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_bytes() == b"do not read"
    assert keys_of(store) == []  # symlinks are not listed
    assert keys_of(store, "dirlink/") == []


def test_local_root_created_and_layout(tmp_path: Path) -> None:
    root = tmp_path / "new" / "deep" / "root"
    store = open_blob(f"file://{root}")
    assert root.is_dir()
    assert store.describe() == f"file://{root}"
    store.set("a/b/c", b"abc")
    path = root / "a" / "b" / "c"
    assert path.read_bytes() == b"abc"
    (meta,) = store.list_keys()
    assert meta.last_modified == path.stat().st_mtime
    store.delete("a/b/c")
    assert list(root.iterdir()) == []  # emptied directories are pruned


def test_local_file_uri_percent_decoded(tmp_path: Path) -> None:
    store = open_blob(f"file://{tmp_path}/with%20space")
    assert isinstance(store, LocalBlob)
    assert store.root == tmp_path / "with space"


def test_local_root_problems(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    with pytest.raises(BlobLocationNotFound):
        LocalBlob(a_file)
    with pytest.raises(BlobLocationNotFound):
        LocalBlob(tmp_path / "absent", create=False)
    store = LocalBlob(tmp_path / "gone")
    store.set("k", b"v")
    for child in (tmp_path / "gone").iterdir():
        child.unlink()
    (tmp_path / "gone").rmdir()
    with pytest.raises(BlobLocationNotFound):
        store.set("k", b"v")
    with pytest.raises(BlobLocationNotFound):
        store.get("k")
    with pytest.raises(BlobLocationNotFound):
        list(store.list_keys())


def test_local_key_that_is_also_a_prefix_conflicts(tmp_path: Path) -> None:
    store = LocalBlob(tmp_path)
    store.set("a/b", b"1")
    with pytest.raises(BlobError):
        store.set("a", b"2")
    assert store.get("a") is None
    store.set("x", b"1")
    with pytest.raises(BlobError):
        store.set("x/y", b"2")
    assert keys_of(store) == ["a/b", "x"]


# --- S3 -----------------------------------------------------------------------------------


@pytest.fixture
def s3_blob(s3_uri: str) -> Iterator[S3Blob]:
    store = S3Blob.from_uri(s3_uri)
    yield store
    store.close()


@pytest.mark.s3
def test_s3_keys_live_under_the_prefix(s3_blob: S3Blob, s3_client: Any) -> None:
    s3_blob.set("k/1", b"v")
    s3_client.put_object(Bucket=s3_blob.bucket, Key="elsewhere/k", Body=b"x")
    s3_client.put_object(Bucket=s3_blob.bucket, Key="some/prefixed-sibling", Body=b"x")
    head = s3_client.head_object(Bucket=s3_blob.bucket, Key="some/prefix/k/1")
    assert head["ContentLength"] == 1
    assert keys_of(s3_blob) == ["k/1"]


def test_s3_clients_share_one_data_loader_whose_search_path_stays_put() -> None:
    """Every S3 client of the process reads botocore's service models through one
    loader (parsed once), and boto3 does not append its data folder to it again."""
    def loader() -> Any:
        blob = S3Blob("bucket", endpoint_url="http://127.0.0.1:9", region="us-east-1")
        return blob._session()._session.get_component("data_loader")

    first = loader()
    paths = list(first.search_paths)
    assert all(loader() is first for _ in range(3))
    assert first.search_paths == paths


@pytest.mark.s3
def test_s3_missing_bucket(s3_server: str) -> None:
    store = open_blob(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}?endpoint_url={s3_server}")
    with pytest.raises(BlobLocationNotFound):
        store.get("k")
    with pytest.raises(BlobLocationNotFound):
        store.set("k", b"v")
    with pytest.raises(BlobLocationNotFound):
        store.delete("k")
    with pytest.raises(BlobLocationNotFound):
        list(store.list_keys())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.s3
def test_s3_unreachable_endpoint_is_unavailable_quickly() -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = open_blob(
        f"s3://bucket/p?endpoint_url={endpoint}&connect_timeout=1&read_timeout=1&max_attempts=2"
        "&access_key_id=AKID&secret_access_key=sekrit-value-123"
    )
    started = time.monotonic()
    for call in (
        lambda: store.get("k"),
        lambda: store.set("k", b"v"),
        lambda: store.delete("k"),
        lambda: list(store.list_keys()),
    ):
        with pytest.raises(BlobUnavailable) as info:
            call()
        assert isinstance(info.value, Unavailable)
        assert "sekrit-value-123" not in "".join(traceback.format_exception(info.value))
    assert time.monotonic() - started < 10


def _assert_no_secrets(texts: list[str], *secrets: str) -> None:
    for text in texts:
        for secret in secrets:
            assert secret not in text, f"secret leaked in: {text[:200]}"


@pytest.mark.s3
def test_s3_auth_errors(
    s3_server: str,
    s3_bucket: str,
    s3_auth_enforced: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    creds = s3_auth_enforced
    base = f"s3://{s3_bucket}/p?endpoint_url={s3_server}&max_attempts=1"
    # The real credentials work with auth enforced; moto's secrets contain '+' and '/',
    # which may be pasted as they are or percent-escaped.
    for secret in (creds.allowed_secret, quote(creds.allowed_secret, safe="")):
        good = open_blob(f"{base}&access_key_id={creds.allowed_key_id}&secret_access_key={secret}")
        good.set("k", b"v")
        assert good.get("k") == b"v"

    wrong_secret = "WrongSecretKeyValue0123456789abcdefghijk"
    token = "FakeSessionTokenValue-abcdefghijklmnopqrstuvwxyz"
    cases = {
        "unknown key": (f"&access_key_id=AKIAUNKNOWN0000000000&secret_access_key={wrong_secret}"),
        "wrong secret": (
            f"&access_key_id={creds.allowed_key_id}&secret_access_key={wrong_secret}"
        ),
        "denied user": (
            f"&access_key_id={creds.denied_key_id}&secret_access_key={creds.denied_secret}"
        ),
        "session token": (
            f"&access_key_id=ASIAUNKNOWN000000000&secret_access_key={wrong_secret}"
            f"&session_token={token}"
        ),
        "default chain (fake env keys)": "",
    }
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG):
        for name, params in cases.items():
            store = open_blob(base + params)
            texts += [store.describe(), repr(store), str(store)]
            for call, args in (
                (store.get, ("k",)),
                (store.set, ("k2", b"v")),
                (lambda prefix: list(store.list_keys(prefix)), ("",)),  # noqa: B023
            ):
                with pytest.raises(BlobAuthError) as info:
                    call(*args)
                assert isinstance(info.value, AuthError), name
                texts += [str(info.value), repr(info.value)]
                texts.append("".join(traceback.format_exception(info.value)))
    # The client side's log records (botocore's included); the in-process moto server
    # logs the requests it receives, which a real server would do elsewhere.
    client_records = [
        record for record in caplog.records if not record.name.startswith(("moto", "werkzeug"))
    ]
    texts += [record.getMessage() for record in client_records]
    texts += [caplog.handler.format(record) for record in client_records]
    assert any(record.name.startswith("botocore.endpoint") for record in client_records)
    _assert_no_secrets(texts, wrong_secret, token, creds.denied_secret, creds.allowed_secret)


@pytest.mark.s3
def test_s3_secrets_hidden_but_uri_rebuildable(s3_server: str, s3_bucket: str) -> None:
    secret, token = "TopSecretKey-0123456789-abcdefghij", "SessionTok-9876543210-zyxwv"
    uri = (
        f"s3://{s3_bucket}/pre/fix?endpoint_url={s3_server}&region=us-east-1"
        f"&access_key_id=AKIDEXAMPLE&secret_access_key={secret}&session_token={token}"
    )
    store = S3Blob.from_uri(uri)
    assert store.describe() == f"s3://{s3_bucket}/pre/fix (endpoint {s3_server})"
    shown = [store.describe(), repr(store), str(store), repr(vars(store))]
    _assert_no_secrets(shown, secret, token)
    rebuilt = pickle.loads(pickle.dumps(store))
    assert isinstance(rebuilt, S3Blob) and rebuilt.describe() == store.describe()
    again = S3Blob.from_uri(store.uri_with_credentials())
    assert again.uri_with_credentials() == store.uri_with_credentials()
    assert secret in store.uri_with_credentials()


@pytest.mark.s3
def test_s3_uses_default_credential_chain(s3_uri: str) -> None:
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"  # set by the s3_server fixture
    assert "access_key_id" not in s3_uri
    store = open_blob(s3_uri)
    store.set("k", b"v")
    assert store.get("k") == b"v"


def _client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "msg"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )


@pytest.mark.parametrize(
    ("code", "status", "expected", "not_expected"),
    [
        ("NoSuchBucket", 404, BlobLocationNotFound, (BlobUnavailable, BlobAuthError)),
        ("AccessDenied", 403, BlobAuthError, (BlobUnavailable,)),
        ("InvalidAccessKeyId", 403, BlobAuthError, (BlobUnavailable,)),
        ("SignatureDoesNotMatch", 403, BlobAuthError, (BlobUnavailable,)),
        ("403", 403, BlobAuthError, (BlobUnavailable,)),
        ("SlowDown", 503, BlobUnavailable, (BlobAuthError,)),
        ("InternalError", 500, BlobUnavailable, (BlobAuthError,)),
        ("WeirdGateway", 502, BlobUnavailable, (BlobAuthError,)),
        ("InvalidArgument", 400, BlobError, (BlobUnavailable, BlobAuthError, BlobLocationNotFound)),
    ],
)
def test_s3_error_mapping(
    code: str, status: int, expected: type[BlobError], not_expected: tuple[type[Exception], ...]
) -> None:
    store = S3Blob("bucket", endpoint_url="http://127.0.0.1:1")
    error = store._error(_client_error(code, status), "get", "k")
    assert isinstance(error, expected)
    assert not isinstance(error, not_expected)


@pytest.mark.parametrize(
    "exc",
    [
        botocore.exceptions.FlexibleChecksumError(
            error_msg="Expected checksum abc= did not match calculated checksum: def="),
        botocore.exceptions.ChecksumError(checksum_type="crc32", expected_checksum="a",
                                          actual_checksum="b"),
        botocore.exceptions.IncompleteReadError(actual_bytes=3, expected_bytes=9),
        botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_s3_bodies_damaged_or_cut_in_transit_are_unavailable(exc: Exception) -> None:
    """A GET body that fails its checksum or arrives short is retried (BlobUnavailable),
    not reported as a lasting BlobError that fails the read or the commit."""
    store = S3Blob("bucket", endpoint_url="http://127.0.0.1:1")
    error = store._error(exc, "get", "k")
    assert isinstance(error, BlobUnavailable) and isinstance(error, Unavailable)
    assert "'k'" in str(error)


# --- CachingBlob --------------------------------------------------------------------------


class CountingBlob(MemoryBlob):
    """A memory blob counting inner gets; ``gate`` (if set) blocks gets until released."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        value = super().get(key)
        if self.gate is not None:
            self.entered.set()
            self.gate.wait(10)
        return value


def test_cache_hits_misses_and_none_not_cached() -> None:
    inner = CountingBlob()
    inner.set("k", b"value")
    cache = CachingBlob(inner, 1000)
    assert cache.get("k") == b"value"
    assert cache.get("k") == b"value"
    assert (cache.hits, cache.misses, inner.gets) == (1, 1, 1)
    assert cache.get("absent") is None
    assert cache.get("absent") is None
    assert (cache.misses, inner.gets) == (3, 3)
    assert "absent" not in cache and "k" in cache


def test_cache_evicts_least_recently_used_by_bytes() -> None:
    inner = MemoryBlob()
    for name in "abcd":
        inner.set(name, name.encode() * 40)
    inner.set("huge", b"h" * 101)
    cache = CachingBlob(inner, 100, cache_on_set=False)
    cache.get("a")
    cache.get("b")
    assert cache.cached_bytes == 80
    cache.get("a")  # a is now the most recently used
    cache.get("c")  # 120 > 100: evicts b
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.cached_bytes == 80 and cache.evictions == 1
    cache.get("huge")  # larger than the whole cache: never cached
    assert "huge" not in cache and cache.cached_bytes == 80
    cache.get("d")
    cache.get("b")
    assert cache.cached_bytes <= 100 and len(cache) == 2


def test_cache_checks_each_held_value_once_against_its_crc(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``held_matching``: a held value whose CRC-32 matches is served, checked once
    while it stays held (a held value never changes); a value that does not match is
    dropped, so the next read goes to the store; a value written over the key, or
    admitted again after an eviction, is checked again."""
    from persist_pipeline.internal import checksum

    hashed: list[int] = []
    real = checksum.crc32
    monkeypatch.setattr(checksum, "crc32", lambda data: hashed.append(len(data)) or real(data))
    inner = MemoryBlob()
    cache = CachingBlob(inner, 100)
    cache.set("k", b"one" * 10)
    good = real(b"one" * 10)
    assert cache.held_matching("absent", good) is None
    assert cache.held_matching("k", good) == b"one" * 10
    assert cache.held_matching("k", good) == b"one" * 10
    assert hashed == [30]  # once
    assert cache.held_matching("k", None) == b"one" * 10 and hashed == [30]
    assert cache.held_matching("k", good ^ 1) is None  # not what was recorded: dropped
    assert "k" not in cache and inner.get("k") == b"one" * 10
    cache.get("k")
    assert cache.held_matching("k", good) == b"one" * 10 and hashed == [30, 30, 30]
    cache.set("k", b"two" * 10)  # another value under the key: checked again
    assert cache.held_matching("k", real(b"two" * 10)) == b"two" * 10
    assert len(hashed) == 4
    cache.set("e", b"e" * 80)  # evicts k
    assert "k" not in cache
    cache.get("k")
    assert cache.held_matching("k", real(b"two" * 10)) == b"two" * 10 and len(hashed) == 5


def test_cache_write_through_and_invalidation() -> None:
    inner = CountingBlob()
    cache = CachingBlob(inner, 1000)
    cache.set("k", b"one")
    assert inner.get("k") == b"one"  # written through
    inner.gets = 0
    assert cache.get("k") == b"one" and inner.gets == 0  # populated by the set
    cache.set("k", b"two")
    assert cache.get("k") == b"two"
    assert cache.delete("k") == 3
    assert cache.get("k") is None and inner.get("k") is None
    uncached = CachingBlob(inner, 1000, cache_on_set=False)
    uncached.set("j", b"x")
    assert "j" not in uncached


def test_cache_never_keeps_a_value_fetched_before_a_concurrent_overwrite() -> None:
    inner = CountingBlob()
    inner.set("k", b"old")
    cache = CachingBlob(inner, 1000)
    inner.gate = threading.Event()
    results: list[bytes | None] = []
    reader = threading.Thread(target=lambda: results.append(cache.get("k")))
    reader.start()
    assert inner.entered.wait(5)  # the reader has fetched "old" and is stalled
    inner.gate.set()
    inner.gate = None
    cache.set("k", b"new")
    reader.join(5)
    assert results == [b"old"]
    assert cache.get("k") == b"new"


def test_cache_thread_safety_keeps_byte_accounting() -> None:
    inner = MemoryBlob()
    cache = CachingBlob(inner, 2000)
    keys = [f"k{i}" for i in range(40)]
    for i, key in enumerate(keys):
        inner.set(key, bytes([i]) * (50 + i))

    def worker(seed: int) -> None:
        for j in range(300):
            key = keys[(seed * 7 + j * 13) % len(keys)]
            if j % 17 == 0:
                cache.set(key, inner.get(key) or b"")
            else:
                assert cache.get(key) == bytes([keys.index(key)]) * (50 + keys.index(key))

    pool = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert cache.cached_bytes == sum(len(inner.get(k) or b"") for k in keys if k in cache)
    assert cache.cached_bytes <= 2000
    assert cache.hits + cache.misses == 8 * 300 - 8 * len(range(0, 300, 17))


def test_cache_rejects_bad_size() -> None:
    for size in (-1, 1.5, True):
        with pytest.raises(InvalidConfig):
            CachingBlob(MemoryBlob(), size)  # type: ignore[arg-type]


# --- FaultyBlob ---------------------------------------------------------------------------


def _run_ops(store: FaultyBlob, n: int) -> list[str]:
    outcomes = []
    for i in range(n):
        op = ("set", "get", "delete", "list_keys")[i % 4]
        try:
            if op == "set":
                store.set(f"k{i % 7}", b"v")
            elif op == "get":
                store.get(f"k{i % 7}")
            elif op == "delete":
                store.delete(f"k{(i + 3) % 7}")
            else:
                list(store.list_keys())
            outcomes.append(f"{op}:ok")
        except BlobUnavailable as exc:
            outcomes.append(f"{op}:{'lost reply' if 'reply was lost' in str(exc) else 'failed'}")
    return outcomes


def test_faults_are_deterministic_per_seed() -> None:
    config = FaultConfig(fail_before=0.2, fail_after=0.2, slow=0.1, delay=0.0, seed=42)
    one, two = FaultyBlob(MemoryBlob(), config), FaultyBlob(MemoryBlob(), config)
    first, second = _run_ops(one, 200), _run_ops(two, 200)
    assert first == second
    assert one.history == two.history and one.injected == two.injected
    assert one.injected["fail_before"] > 0 and one.injected["fail_after"] > 0
    assert one.injected["slow"] > 0
    assert sum(1 for o in first if o.endswith("failed")) == one.injected["fail_before"]
    assert sum(1 for o in first if o.endswith("lost reply")) == one.injected["fail_after"]
    other = FaultyBlob(MemoryBlob(), FaultConfig(fail_before=0.2, fail_after=0.2, seed=43))
    assert _run_ops(other, 200) != first


def test_fault_lost_reply_really_ran() -> None:
    inner = MemoryBlob()
    store = FaultyBlob(inner, FaultConfig(fail_after=1.0))
    with pytest.raises(BlobUnavailable):
        store.set("k", b"written")
    assert inner.get("k") == b"written"
    with pytest.raises(BlobUnavailable):
        store.delete("k")
    assert inner.get("k") is None
    assert store.injected["fail_after"] == 2


def test_fault_before_did_not_run() -> None:
    inner = MemoryBlob()
    store = FaultyBlob(inner, FaultConfig(fail_before=1.0, operations=frozenset({"set"})))
    with pytest.raises(BlobUnavailable):
        store.set("k", b"v")
    assert inner.get("k") is None
    assert store.get("k") is None  # get is not faulted
    store.enabled = False
    store.set("k", b"v")
    assert inner.get("k") == b"v"


def test_fault_never_masks_invalid_input() -> None:
    store = FaultyBlob(MemoryBlob(), FaultConfig(fail_before=1.0))
    with pytest.raises(InvalidInput):
        store.set("../x", b"v")
    with pytest.raises(InvalidInput):
        store.list_keys("/abs")
    assert store.history == []


def test_local_blob_pickles(tmp_path: Path) -> None:
    local = LocalBlob(tmp_path)
    local.set("k", b"v")
    assert pickle.loads(pickle.dumps(local)).get("k") == b"v"


def test_fault_slow() -> None:
    store = FaultyBlob(MemoryBlob(), FaultConfig(slow=1.0, delay=0.05))
    started = time.monotonic()
    store.set("k", b"v")
    assert time.monotonic() - started >= 0.05
    assert store.get("k") == b"v"
    assert store.injected["slow"] == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"fail_before": 1.5}, {"fail_after": -0.1}, {"slow": "x"}, {"delay": -1.0},
     {"operations": frozenset({"nope"})}],
)
def test_fault_config_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidConfig):
        # Operations are checked against the wrapped backend's operations.
        FaultyBlob(MemoryBlob(), FaultConfig(**kwargs))


def test_get_range_reads_a_slice_and_refuses_bad_ranges(blob: Blob) -> None:
    blob.set("r/part", b"0123456789")
    assert blob.get_range("r/part", 2, 3) == b"234"
    assert blob.get_range("r/part", 8, 10) == b"89"  # fewer at the end
    assert blob.get_range("r/missing", 0, 4) is None
    for start, length in ((-1, 2), (0, -1), (True, 1), (0, 1.5)):
        with pytest.raises(InvalidInput):
            blob.get_range("r/part", start, length)  # type: ignore[arg-type]
    assert blob.get("r/part") == b"0123456789"  # unchanged
