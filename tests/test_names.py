"""Named shards (``PersistClient.resolve``): a name registry in consensus.

On every consensus backend: the round trip, missing names, bad names changing nothing,
creators racing in threads and in processes (exactly one record, one id for all), lost
compare-and-set replies (ours committed, or a rival's won meanwhile), and name records
never mistaken for shards (listings, summaries, inspect and GC of every shard, the CLI,
the pipeline config). Negative controls show what a guessing or unchecked creator gets
wrong.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from assets.pipeline_config import load_pipeline_config, register_shard_name
from persist_pipeline import InvalidInput, PersistClient, PersistConfig, ShardId, ShardNotFound
from persist_pipeline.blob.memory import MemoryBlob
from persist_pipeline.consensus import open_consensus
from persist_pipeline.consensus.base import Consensus, VersionedData
from persist_pipeline.consensus.faults import FaultConfig, FaultyConsensus
from persist_pipeline.exceptions import (
    ConsensusUnavailable,
    Indeterminate,
    InvalidConfig,
    InvalidShardId,
    InvalidShardName,
    ShardNameNotFound,
)
from persist_pipeline.names import KEY_PREFIX, NameRegistry, registry_key
from tests.helpers import ForwardingConsensus, process_context
from tests.pipeline_support import (
    SYNTHETIC,
    Pipeline,
    base_config,
    failure_messages,
    make_pipeline,
)
from tests.test_cli import cli, env

__all__ = ["env", "make_pipeline"]  # fixtures, imported for pytest

ROWS = [(b"k", b"v", 0, 1)]


def _client(consensus_uri: str, consensus: Consensus | None = None,
            deadline_s: float | None = None) -> PersistClient:
    config = PersistConfig() if deadline_s is None else PersistConfig(retry_deadline_s=deadline_s)
    return PersistClient(consensus or open_consensus(consensus_uri), MemoryBlob(),
                         config=config)


@pytest.fixture
def client(consensus_uri: str) -> Iterator[PersistClient]:
    c = _client(consensus_uri)
    yield c
    c.close()


def _records(consensus_uri: str, key: str) -> list[VersionedData]:
    with open_consensus(consensus_uri) as consensus:
        return consensus.scan(key, 0)


def _all_keys(consensus_uri: str) -> list[str]:
    with open_consensus(consensus_uri) as consensus:
        return consensus.list_shards()


# --- the round trip -----------------------------------------------------------------------


def test_create_then_resolve_round_trip(consensus_uri: str, client: PersistClient) -> None:
    shard = client.resolve("orders", create=True)
    assert isinstance(shard, ShardId)
    assert client.resolve("orders") == shard
    assert client.resolve("orders", create=True) == shard  # idempotent, no new id
    other = _client(consensus_uri)  # no shared cache: read from consensus
    try:
        assert other.resolve("orders") == shard
        assert other.shard_names() == {"orders": shard}
    finally:
        other.close()
    [record] = _records(consensus_uri, registry_key("orders"))
    assert record.seqno == 1 and record.data == record.summary == str(shard).encode()
    # The name exists before the shard does; the first writer creates the shard.
    assert client.list_shards() == []
    with pytest.raises(ShardNotFound):
        client.inspect(shard)
    with client.open_writer(shard) as writer:
        writer.compare_and_append(ROWS, 0, 1)
    assert client.list_shards() == [str(shard)]
    assert client.inspect(client.resolve("orders"))["upper"] == 1
    # Names with every allowed character, and several names for one shard.
    assert client.register_name("team.a/orders_v2-prod", shard) == shard
    assert client.shard_names() == {"orders": shard, "team.a/orders_v2-prod": shard}


def test_missing_name_without_create_is_not_found_and_writes_nothing(
        consensus_uri: str, client: PersistClient) -> None:
    with pytest.raises(ShardNameNotFound, match=r"no shard named 'nope'; create it with "
                                                r"resolve\('nope', create=True\)"):
        client.resolve("nope")
    with pytest.raises(ShardNotFound):  # the family callers already catch
        client.resolve("nope", create=False)
    assert _all_keys(consensus_uri) == []
    assert client.shard_names() == {}


BAD_NAMES: list[Any] = [
    "", " orders", "orders ", "two words", "tab\there", "new\nline", "nul\x00", "ü",
    # Shaped like shard ids (fixed ones: test ids must be the same in every worker).
    "x" * 201, "a:b", "a*b", "s5f0e7c9a-3b2d-4e6f-8a1b-9c0d2e4f6a8b",
    "S5F0E7C9A-3B2D-4E6F-8A1B-9C0D2E4F6A8B", "s5F0E7C9A-3B2D-4E6F-8A1B-9C0D2E4F6A8B",
    None, 42, b"orders",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:20] for n in BAD_NAMES])
def test_bad_names_raise_typed_errors_and_change_nothing(consensus_uri: str,
                                                         client: PersistClient,
                                                         name: Any) -> None:
    for call in (lambda: client.resolve(name, create=True), lambda: client.resolve(name),
                 lambda: client.register_name(name, ShardId.new())):
        with pytest.raises(InvalidShardName):
            call()
    assert issubclass(InvalidShardName, InvalidInput)
    assert _all_keys(consensus_uri) == []


def test_longest_name_is_accepted_and_bad_ids_change_nothing(consensus_uri: str,
                                                             client: PersistClient) -> None:
    longest = "n" * 200
    assert client.resolve(longest, create=True) == client.resolve(longest)
    with pytest.raises(InvalidShardId):
        client.register_name("orders", "not-an-id")
    assert client.shard_names().keys() == {longest}


def test_library_shard_apis_do_not_take_names(client: PersistClient) -> None:
    """Names are resolved explicitly: a name (or a registry key) is never a shard id."""
    client.resolve("orders", create=True)
    for text in ("orders", KEY_PREFIX + "orders"):
        with pytest.raises(InvalidShardId):
            client.open_writer(text)
        with pytest.raises(InvalidShardId):
            client.inspect(text)


# --- races --------------------------------------------------------------------------------


def _race(clients: list[PersistClient], call: Callable[[PersistClient], Any]) -> list[Any]:
    """``call(client)`` in one thread per client, all released at once."""
    barrier = threading.Barrier(len(clients))

    def run(c: PersistClient) -> Any:
        barrier.wait()
        return call(c)

    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(run, clients))


def test_threads_creating_one_name_all_get_the_one_recorded_id(consensus_uri: str) -> None:
    # One client per thread: nothing cached is shared, as with separate processes.
    clients = [_client(consensus_uri) for _ in range(8)]
    try:
        for round_ in range(5):
            name = f"race-{round_}"
            got = _race(clients, lambda c, name=name: c.resolve(name, create=True))
            assert len(got) == 8 and len(set(got)) == 1
            [record] = _records(consensus_uri, registry_key(name))
            assert record.data == str(got[0]).encode()
        assert clients[0].shard_names() == {
            f"race-{r}": clients[0].resolve(f"race-{r}") for r in range(5)}
    finally:
        for c in clients:
            c.close()


def test_creators_that_all_found_no_record_all_get_the_one_recorded_id(
        consensus_uri: str) -> None:
    """The race forced: all 8 look the name up (none), then all 8 compare-and-set."""
    gate = threading.Barrier(8)
    wrapped = [LostReply(open_consensus(consensus_uri), gate) for _ in range(8)]
    clients = [_client(consensus_uri, w) for w in wrapped]
    try:
        got = _race(clients, lambda c: c.resolve("orders", create=True))
        assert [w.cas_calls for w in wrapped] == [1] * 8
        assert set(got) == {_recorded(consensus_uri, "orders")}
    finally:
        for c in clients:
            c.close()


def _process_resolver(uri: str, names: list[str], barrier: Any, out: Any) -> None:
    client = _client(uri)
    try:
        barrier.wait()
        out.put((os.getpid(), [str(client.resolve(n, create=True)) for n in names]))
    finally:
        client.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def shared_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A consensus store several processes can share: a SQLite file or PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'consensus.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.mark.slow
def test_processes_creating_the_same_names_all_get_the_recorded_ids(shared_uri: str) -> None:
    names = [f"proc-{i}" for i in range(4)]
    open_consensus(shared_uri).close()  # create the tables before the race
    ctx = process_context()
    out = ctx.Queue()
    barrier = ctx.Barrier(5)
    procs = [ctx.Process(target=_process_resolver, args=(shared_uri, names, barrier, out))
             for _ in range(5)]
    for p in procs:
        p.start()
    results = [out.get(timeout=180)[1] for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for i, name in enumerate(names):
        ids = {r[i] for r in results}
        assert len(ids) == 1, f"{name}: processes got different ids {ids}"
        [record] = _records(shared_uri, registry_key(name))
        assert record.data.decode() == ids.pop()


def test_control_unchecked_creation_hands_out_different_ids(consensus_uri: str) -> None:
    """Negative control: creators that mint an id and use it without reading back what
    was recorded (ignoring the compare-and-set's answer) disagree under the race."""
    clients = [_client(consensus_uri) for _ in range(8)]

    def naive(c: PersistClient) -> ShardId:
        mine = ShardId.new()
        payload = str(mine).encode()
        c.consensus.compare_and_set(registry_key("naive"), None,
                                    VersionedData(1, payload, payload))
        return mine

    got = _race(clients, naive)
    [record] = _records(consensus_uri, registry_key("naive"))
    assert len(set(got)) == 8  # every creator believes in its own id ...
    assert sum(1 for g in got if str(g).encode() == record.data) == 1  # ... one is right
    assert clients[0].resolve("naive") == ShardId.parse(record.data.decode())
    for c in clients:
        c.close()


# --- lost replies -------------------------------------------------------------------------


class LostReply(ForwardingConsensus):
    """Passes calls through; on chosen ``compare_and_set`` calls, first runs ``rival``
    (another creator's write reaching the database first), then runs the call or not
    (``commit``), and reports ConsensusUnavailable either way (the reply was lost)."""

    def __init__(self, inner: Consensus, gate: threading.Barrier | None = None) -> None:
        self.inner = inner
        self.gate = gate  # every compare_and_set waits here first (forces a race)
        self.lose = 0  # how many of the next compare_and_set replies to lose
        self.commit = True
        self.rival: Callable[[], None] | None = None
        self.cas_calls = 0

    def compare_and_set(self, shard: str, expected: int | None, new: VersionedData) -> bool:
        self.cas_calls += 1
        if self.gate is not None:
            self.gate.wait()
        if not self.lose:
            return self.inner.compare_and_set(shard, expected, new)
        self.lose -= 1
        if self.rival is not None:
            self.rival()
        if self.commit:
            self.inner.compare_and_set(shard, expected, new)
        raise ConsensusUnavailable("injected: the compare-and-set reply was lost")

    def close(self) -> None:
        self.inner.close()


def _recorded(consensus_uri: str, name: str) -> ShardId:
    [record] = _records(consensus_uri, registry_key(name))
    return ShardId.parse(record.data.decode())


def test_lost_reply_of_our_committed_creation_returns_the_recorded_id(
        consensus_uri: str) -> None:
    lossy = LostReply(open_consensus(consensus_uri))
    client = _client(consensus_uri, lossy)
    try:
        lossy.lose = 1
        got = client.resolve("orders", create=True)
        assert got == _recorded(consensus_uri, "orders")
        assert lossy.cas_calls == 1  # settled by reading the record, not by writing again
    finally:
        client.close()


def test_lost_reply_of_a_creation_that_did_not_land_is_retried(consensus_uri: str) -> None:
    lossy = LostReply(open_consensus(consensus_uri))
    client = _client(consensus_uri, lossy)
    try:
        lossy.lose, lossy.commit = 2, False
        got = client.resolve("orders", create=True)
        assert got == _recorded(consensus_uri, "orders")
        assert lossy.cas_calls == 3
    finally:
        client.close()


@pytest.mark.parametrize("commit", [True, False], ids=["ours-refused", "ours-not-sent"])
def test_lost_reply_while_a_rival_creator_wins_returns_the_rivals_id(
        consensus_uri: str, commit: bool) -> None:
    lossy = LostReply(open_consensus(consensus_uri))
    client = _client(consensus_uri, lossy)
    rival = _client(consensus_uri)
    rival_ids: list[ShardId] = []
    try:
        lossy.lose, lossy.commit = 1, commit
        lossy.rival = lambda: rival_ids.append(rival.resolve("orders", create=True))
        got = client.resolve("orders", create=True)
        assert got == rival_ids[0] == _recorded(consensus_uri, "orders")
    finally:
        client.close()
        rival.close()


def test_control_guessing_a_lost_reply_returns_an_id_that_was_not_recorded(
        consensus_uri: str) -> None:
    """Negative control: a creator that takes a lost reply for success returns its own
    id, though a rival's was recorded."""
    lossy = LostReply(open_consensus(consensus_uri))
    rival = _client(consensus_uri)

    def rival_creates() -> None:
        rival.resolve("orders", create=True)

    try:
        lossy.lose, lossy.rival = 1, rival_creates
        mine = ShardId.new()
        payload = str(mine).encode()
        with pytest.raises(ConsensusUnavailable):
            lossy.compare_and_set(registry_key("orders"), None,
                                  VersionedData(1, payload, payload))
        guessed = mine  # the guess: "it probably landed"
        assert guessed != _recorded(consensus_uri, "orders")
    finally:
        rival.close()
        lossy.close()


def test_every_reply_lost_at_random_still_returns_the_recorded_ids(consensus_uri: str) -> None:
    faulty = FaultyConsensus(open_consensus(consensus_uri),
                             FaultConfig(fail_before=0.3, fail_after=0.4, seed=12))
    client = _client(consensus_uri, faulty)
    try:
        got = {f"n{i}": client.resolve(f"n{i}", create=True) for i in range(20)}
        assert faulty.faults.injected["fail_after"] > 0
        assert faulty.faults.injected["fail_before"] > 0
        for name, shard in got.items():
            assert shard == _recorded(consensus_uri, name)
    finally:
        client.close()


def test_consensus_down_past_the_deadline_is_indeterminate_and_claims_nothing(
        consensus_uri: str) -> None:
    faulty = FaultyConsensus(open_consensus(consensus_uri),
                             FaultConfig(fail_before=1.0,
                                         operations=frozenset({"compare_and_set"})))
    client = _client(consensus_uri, faulty, deadline_s=0.2)
    try:
        with pytest.raises(Indeterminate):
            client.resolve("orders", create=True)
        assert _all_keys(consensus_uri) == []
    finally:
        client.close()


def test_registry_reads_only_on_a_cache_miss(consensus_uri: str) -> None:
    """Names never change, so a known name costs no query; an unknown one always reads."""
    with open_consensus(consensus_uri) as consensus:
        registry = NameRegistry(consensus, deadline_s=5)
        assert registry.lookup("orders") is None
        other = NameRegistry(consensus, deadline_s=5)
        created = other.resolve("orders", create=True)
        assert registry.lookup("orders") == created  # a miss is never cached
        consensus.close()
        assert registry.lookup("orders") == created  # a hit needs no consensus


# --- names are not shards -----------------------------------------------------------------


def test_listings_summaries_inspect_and_gc_skip_name_records(consensus_uri: str,
                                                            client: PersistClient) -> None:
    real = ShardId.new()
    with client.open_writer(real) as writer:
        writer.compare_and_append(ROWS, 0, 1)
    client.register_name("real", real)
    client.resolve("not-yet-created", create=True)
    raw = set(_all_keys(consensus_uri))
    assert raw == {str(real), registry_key("real"), registry_key("not-yet-created")}
    assert client.list_shards() == [str(real)]
    summaries = client.shard_summaries()
    assert list(summaries) == [str(real)] and summaries[str(real)].upper == 1
    # Maintenance over every shard works and leaves the registry alone.
    for shard in client.list_shards():
        assert client.inspect(shard)["upper"] == 1
        client.compact(shard)
        client.gc(shard)
    assert set(_all_keys(consensus_uri)) == raw
    assert client.resolve("real") == real
    assert client.shard_names() == {"not-yet-created": client.resolve("not-yet-created"),
                                    "real": real}


# --- the CLI ------------------------------------------------------------------------------


# ``env`` (a fixture) and ``cli`` come from tests.test_cli.


@pytest.mark.slow
def test_cli_takes_names_wherever_it_takes_shard_ids(env: dict[str, str],
                                                     tmp_path: Path) -> None:
    out = cli(env, "new-shard", "--name", "orders")
    assert out.returncode == 0, out.stderr
    shard = out.stdout.strip()
    ShardId.parse(shard)
    # Creating it again by name is idempotent: the registered shard.
    assert cli(env, "new-shard", "--name", "orders").stdout.strip() == shard
    assert cli(env, "resolve", "orders").stdout.strip() == shard
    assert json.loads(cli(env, "names").stdout) == {"orders": shard}
    csv = tmp_path / "u.csv"
    csv.write_text("k,v,t,d\nalice,signup,0,1\nbob,signup,1,1\n")
    out = cli(env, "append", "orders", str(csv), "--expected-upper", "0", "--new-upper", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(cli(env, "inspect", "orders").stdout)["upper"] == 2
    out = cli(env, "snapshot", "orders", "--as-of", "latest")
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 3, out.stderr
    out = cli(env, "plan", "orders")
    assert out.returncode == 0 and json.loads(out.stdout), out.stderr
    assert cli(env, "compact", "orders").returncode == 0
    assert cli(env, "gc", "orders").returncode == 0
    listing = json.loads(cli(env, "shards").stdout)
    assert list(listing) == [shard] and listing[shard]["names"] == ["orders"]
    # resolve --create registers the name and creates its shard, as new-shard --name.
    fresh = cli(env, "resolve", "--create", "later").stdout.strip()
    assert json.loads(cli(env, "names").stdout) == {"later": fresh, "orders": shard}
    assert sorted(json.loads(cli(env, "shards").stdout)) == sorted([shard, fresh])


@pytest.mark.slow
def test_cli_name_errors(env: dict[str, str]) -> None:
    shard = cli(env, "new-shard", "--name", "orders").stdout.strip()
    # A name no shard has is not found, as with resolve and an id of no shard (exit 1).
    out = cli(env, "inspect", "nope")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "'nope' is neither a shard id" in out.stderr and "registered" in out.stderr
    out = cli(env, "resolve", "nope")
    assert out.returncode == 1 and "no shard named 'nope'" in out.stderr
    out = cli(env, "inspect", "two words")  # not a name either: the id error
    assert out.returncode == 2 and "malformed shard id" in out.stderr
    other = str(ShardId.new())
    out = cli(env, "new-shard", "--name", "orders", "--id", other)
    assert out.returncode == 2 and shard in out.stderr and other in out.stderr
    out = cli(env, "new-shard", "--name", "bad name")
    assert out.returncode == 2 and "invalid shard name" in out.stderr
    assert json.loads(cli(env, "names").stdout) == {"orders": shard}  # nothing changed
    assert list(json.loads(cli(env, "shards").stdout)) == [shard]


# --- the pipeline config ------------------------------------------------------------------


def _write_config(tmp_path: Path, shards: dict[str, Any]) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(base_config(tmp_path / "data", shards)))
    return path


def _location_client(tmp_path: Path) -> PersistClient:
    (tmp_path / "data").mkdir(exist_ok=True)
    return PersistClient.open(f"sqlite:///{tmp_path / 'data' / 'consensus.db'}", "mem://",
                              env={})


def test_config_shard_id_may_be_a_registered_name(tmp_path: Path) -> None:
    with _location_client(tmp_path) as client:
        prod = client.resolve("clicks-prod", create=True)
    path = _write_config(tmp_path, {
        "clicks": {"shard_id": "clicks-prod", "source": SYNTHETIC},
        "other": {"source": SYNTHETIC}})
    # Looked up on the config's own location by default, or through ``names``.
    for config in (load_pipeline_config(path, env={}),
                   load_pipeline_config(path, env={}, names=lambda: {"clicks-prod": prod})):
        assert config.shard("clicks").shard_id == str(prod)
        assert config.shard("clicks").registered_name == "clicks-prod"
        assert config.shard("other").registered_name == ""


def test_config_with_an_unregistered_or_malformed_name_is_an_error(tmp_path: Path) -> None:
    _location_client(tmp_path).close()
    path = _write_config(tmp_path, {"clicks": {"shard_id": "nope", "source": SYNTHETIC}})
    with pytest.raises(InvalidConfig, match=r"shards\.clicks\.shard_id: 'nope' is not a "
                                            r"shard id, and no shard is registered"):
        load_pipeline_config(path, env={})
    path = _write_config(tmp_path, {"clicks": {"shard_id": "not an id", "source": SYNTHETIC}})
    with pytest.raises(InvalidConfig, match=r"shards\.clicks\.shard_id: malformed shard id"):
        load_pipeline_config(path, env={}, names=lambda: {})
    # Two names for one shard are two configured shards on one id: refused as before.
    with _location_client(tmp_path) as client:
        shard = client.resolve("a", create=True)
        client.register_name("b", shard)
    path = _write_config(tmp_path, {"x": {"shard_id": "a", "source": SYNTHETIC},
                                    "y": {"shard_id": "b", "source": SYNTHETIC}})
    with pytest.raises(InvalidConfig, match="two shards have the same shard_id"):
        load_pipeline_config(path, env={})


def test_register_shard_name_is_idempotent_and_refuses_another_shards_name(
        tmp_path: Path) -> None:
    path = _write_config(tmp_path, {"clicks": {"source": SYNTHETIC},
                                    "views": {"source": SYNTHETIC}})
    config = load_pipeline_config(path, env={})
    with _location_client(tmp_path) as client:
        clicks = config.shard("clicks")
        register_shard_name(client, clicks)
        register_shard_name(client, clicks)
        assert client.resolve("clicks") == ShardId.parse(clicks.shard_id)
        squatter = client.resolve("views", create=True)
        with pytest.raises(InvalidConfig) as e:
            register_shard_name(client, config.shard("views"))
        assert str(squatter) in str(e.value) and config.shard("views").shard_id in str(e.value)
        assert client.resolve("views") == squatter  # unchanged


def test_pipeline_writes_a_named_shard_and_registers_config_names(
        tmp_path: Path, make_pipeline: Any) -> None:
    with _location_client(tmp_path) as client:
        prod = client.resolve("clicks-prod", create=True)
        squatter = client.resolve("inventory", create=True)
    pipeline: Pipeline = make_pipeline({
        "clicks": {"shard_id": "clicks-prod", "source": SYNTHETIC},
        "inventory": {"source": SYNTHETIC}})
    assert pipeline.shard_id("clicks") == str(prod)
    result = pipeline.ingest("clicks")
    assert result.success
    client = pipeline.client()
    assert client.inspect(prod)["upper"] == 1
    assert client.shard_names() == {"clicks": prod, "clicks-prod": prod,
                                    "inventory": squatter}
    assert client.list_shards() == [str(prod)]
    # The config's inventory shard is not the one registered as "inventory".
    result = pipeline.ingest("inventory")
    assert not result.success
    [message] = failure_messages(result)
    assert str(squatter) in message and pipeline.shard_id("inventory") in message
    assert client.list_shards() == [str(prod)]  # nothing written
