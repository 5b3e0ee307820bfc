"""Group commit: a process's concurrent appends to different shards share consensus
round trips through the client's funnel, and each still succeeds or fails on its own."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from persist_pipeline import InlinePolicy, PersistClient, PersistConfig, ShardId, UpperMismatch
from persist_pipeline.exceptions import Indeterminate, InvalidConfig
from persist_pipeline.internal import transitions
from persist_pipeline.internal.clock import SYSTEM_CLOCK
from persist_pipeline.internal.funnel import Funnel
from persist_pipeline.internal.machine import MachineMetrics
from tests.fixtures.location import location_kinds, make_location
from tests.helpers import rows


def _read(client: PersistClient, shard: ShardId) -> list[tuple[bytes, bytes, int]]:
    upper = client._machine(str(shard)).fetch_latest().upper
    reader = client.open_reader(shard)
    try:
        return rows(reader.snapshot(upper - 1)) if upper else []
    finally:
        reader.expire()


def _concurrent_appends(client: PersistClient, n: int, stale: int | None) -> list[object]:
    """``n`` threads append to ``n`` shards at once (thread ``stale`` with a wrong
    expected upper); returns each thread's result or error."""
    shards = [ShardId.new() for _ in range(n)]
    writers = [client.open_writer(s) for s in shards]
    barrier = threading.Barrier(n)
    outcomes: list[object] = [None] * n

    def append(i: int) -> None:
        expected = 5 if i == stale else 0
        barrier.wait()
        try:
            outcomes[i] = writers[i].compare_and_append([(b"k%d" % i, b"v", expected, 1)],
                                                        expected, expected + 1)
        except Exception as e:  # asserted below
            outcomes[i] = e

    threads = [threading.Thread(target=append, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i, shard in enumerate(shards):
        expected_rows = [] if i == stale else [(b"k%d" % i, b"v", 1)]
        assert _read(client, shard) == expected_rows
    return outcomes


def test_concurrent_appends_share_round_trips_and_fail_alone(location):
    """With a window, 8 threads' appends to 8 shards commit in fewer groups than
    appends; the one with a wrong upper gets its own UpperMismatch and the seven others
    commit."""
    cfg = PersistConfig(group_commit_window_s=0.05)
    client = location.client(InlinePolicy(), cfg)
    before = (client.metrics.group_commits, client.metrics.group_commit_appends)
    outcomes = _concurrent_appends(client, 8, stale=3)
    assert isinstance(outcomes[3], UpperMismatch) and outcomes[3].current == 0
    assert all(getattr(o, "upper", None) == 1 for i, o in enumerate(outcomes) if i != 3)
    groups = client.metrics.group_commits - before[0]
    appends = client.metrics.group_commit_appends - before[1]
    assert appends >= 8 and groups < 8, (groups, appends)
    client.close()


def test_without_group_commit_each_append_commits_alone(tmp_path):
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                config=PersistConfig(group_commit=False))
    outcomes = _concurrent_appends(client, 4, stale=None)
    assert all(getattr(o, "upper", None) == 1 for o in outcomes)
    assert client.metrics.group_commits == 0
    client.close()


@pytest.mark.parametrize("bad", [dict(group_commit="yes"), dict(group_commit_window_s=2.0),
                                 dict(group_commit_window_s=-1.0),
                                 dict(group_commit_max_inflight_bytes=0),
                                 dict(group_commit_max_inflight_bytes=1.5)])
def test_bad_group_commit_settings_are_refused(bad):
    with pytest.raises(InvalidConfig):
        PersistConfig(**bad)


class _WaitWatchingClock:
    """The real clock, telling the test when someone sleeps on it: the funnel sleeps
    between its checks of an admission that found no room."""

    def __init__(self) -> None:
        self.slept = threading.Event()

    def now_ms(self) -> int:
        return SYSTEM_CLOCK.now_ms()

    def monotonic(self) -> float:
        return SYSTEM_CLOCK.monotonic()

    def sleep(self, seconds: float) -> None:
        self.slept.set()
        SYSTEM_CLOCK.sleep(seconds)


def test_the_in_flight_bound_blocks_writers_beyond_it():
    """With a bound of 100 bytes, a second 80-byte append waits until the first is
    done; a lone append larger than the bound still goes."""
    clock = _WaitWatchingClock()
    funnel = Funnel(clock, MachineMetrics(), window_s=0.0, max_inflight_bytes=100)
    from persist_pipeline.internal.funnel import _Entry

    def on(shard: str) -> Any:
        return SimpleNamespace(shard_id=shard)  # all the funnel reads of a machine

    first = _Entry(on("a"), None, None, 80)  # type: ignore[arg-type]
    funnel._admit(first)
    admitted = threading.Event()
    second = _Entry(on("b"), None, None, 80)  # type: ignore[arg-type]
    t = threading.Thread(target=lambda: (funnel._admit(second), admitted.set()))
    t.start()
    # The second admission has found no room (it sleeps before looking again), not
    # merely not run yet.
    assert clock.slept.wait(5), "the second append was never refused"
    assert not admitted.is_set() and funnel._inflight == 80
    with funnel._queue_lock:
        funnel._inflight -= first.size  # the first append is done
    assert admitted.wait(5) and funnel._inflight == 80
    t.join()
    with funnel._queue_lock:
        funnel._inflight = 0
    huge = _Entry(on("c"), None, None, 1000)  # type: ignore[arg-type]
    funnel._admit(huge)
    assert funnel._inflight == 1000


def test_a_writer_waiting_for_room_is_not_overtaken_by_smaller_later_ones():
    """Room in the in-flight bound goes to the writers waiting for it in arrival order:
    a later, smaller append that would fit must not go first, or a steady stream of
    small appends keeps the bytes in flight above what a larger one needs, and that one
    waits for as long as the stream lasts."""
    funnel = Funnel(_WaitWatchingClock(), MachineMetrics(), window_s=0.0,
                    max_inflight_bytes=100)
    from persist_pipeline.internal.funnel import _Entry

    def entry(shard: str, size: int) -> Any:
        return _Entry(SimpleNamespace(shard_id=shard), None, None, size)  # type: ignore[arg-type]

    def admit_in_thread(e: Any) -> threading.Event:
        done = threading.Event()
        threading.Thread(target=lambda: (funnel._admit(e), done.set()), daemon=True).start()
        return done

    first = entry("a", 60)
    funnel._admit(first)
    big_in = admit_in_thread(entry("b", 80))
    assert not big_in.wait(0.3)  # no room: 60 + 80 > 100
    small_in = admit_in_thread(entry("c", 30))  # 60 + 30 would fit
    assert not small_in.wait(0.5), "a later, smaller append overtook the waiting one"
    with funnel._queue_lock:
        funnel._inflight -= first.size  # the first append is done
    assert big_in.wait(5) and not small_in.wait(0.3)  # 80 + 30 > 100
    with funnel._queue_lock:
        funnel._inflight -= 80  # so is the big one
    assert small_in.wait(5) and funnel._inflight == 30


class _InterruptedLock:
    """A lock that raises KeyboardInterrupt (a signal landing while the thread takes
    it) at the next acquisition by the thread named ``victim``."""

    def __init__(self, victim: str) -> None:
        self._lock = threading.Lock()
        self.victim = victim
        self.armed = False

    def __enter__(self) -> object:
        if self.armed and threading.current_thread().name == self.victim:
            self.armed = False
            raise KeyboardInterrupt
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)


def test_a_writer_interrupted_while_waiting_for_room_leaves_the_line():
    """A signal may land anywhere in a writer's wait for room, also while it takes the
    funnel's lock between two sleeps: its place in the line must go with it, or every
    later writer of the client waits behind an append nobody will ever admit."""
    clock = _WaitWatchingClock()
    funnel = Funnel(clock, MachineMetrics(), window_s=0.0, max_inflight_bytes=100)
    lock = _InterruptedLock("big")
    funnel._queue_lock = lock  # type: ignore[assignment]
    from persist_pipeline.internal.funnel import _Entry

    def entry(shard: str, size: int) -> Any:
        return _Entry(SimpleNamespace(shard_id=shard), None, None, size)  # type: ignore[arg-type]

    first = entry("a", 60)
    funnel._admit(first)
    outcome: list[BaseException] = []

    def big() -> None:
        try:
            funnel._admit(entry("b", 80))
        except BaseException as e:  # asserted below
            outcome.append(e)

    thread = threading.Thread(target=big, name="big", daemon=True)
    thread.start()
    assert clock.slept.wait(5)  # in line, waiting for room
    lock.armed = True
    thread.join(5)
    assert outcome and isinstance(outcome[0], KeyboardInterrupt)
    small_in = threading.Event()
    threading.Thread(target=lambda: (funnel._admit(entry("c", 30)), small_in.set()),
                     daemon=True).start()
    assert small_in.wait(5), "a later writer waits behind an interrupted one"


class _GatedWindowClock:
    """The system clock, except that each thread's group-commit window lasts until the
    test opens that thread's gate."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.gates: dict[str, threading.Event] = {}
        self.waiting: dict[str, threading.Event] = {}

    def now_ms(self) -> int:
        return SYSTEM_CLOCK.now_ms()

    def monotonic(self) -> float:
        return SYSTEM_CLOCK.monotonic()

    def sleep(self, seconds: float) -> None:
        name = threading.current_thread().name
        if seconds == self.window_s and name in self.gates:
            self.waiting[name].set()
            assert self.gates[name].wait(30)
            return
        SYSTEM_CLOCK.sleep(seconds)

    def gate(self, name: str) -> None:
        self.gates[name], self.waiting[name] = threading.Event(), threading.Event()


def test_a_leader_whose_group_fails_leaves_no_append_of_its_own_behind():
    """Two appends to one shard lead a group each (a window is set); the later one's
    thread takes the earlier append (a shard's oldest goes first), whose transition fails
    with an error that is no persist error (a bug, an interrupt): that thread's own
    append was never tried, and it must not be committed by the next group once its
    caller got the error."""
    client = PersistClient.open("mem://", "mem://", config=PersistConfig(group_commit=False))
    shard = ShardId.new()
    machine = client._machine(shard)
    machine.open(create=True)
    clock = _GatedWindowClock(0.05)
    funnel = Funnel(clock, MachineMetrics(), window_s=clock.window_s,
                    max_inflight_bytes=1 << 20)
    outcomes: dict[str, object] = {}

    def broken(state: Any) -> Any:
        raise RuntimeError("a bug in the first append's transition")

    def register(state: Any) -> Any:
        return transitions.register_writer(state, "second", machine.now_ms(), 60_000)

    def append(name: str, transition: Any) -> None:
        try:
            outcomes[name] = funnel.commit(machine, transition)
        except BaseException as e:  # asserted below
            outcomes[name] = e

    threads = {}
    for name, transition in (("first", broken), ("second", register)):
        clock.gate(name)
        threads[name] = threading.Thread(target=append, args=(name, transition), name=name)
        threads[name].start()
        assert clock.waiting[name].wait(10)  # leading a group, in its window
    clock.gates["second"].set()  # takes the first append (the shard's oldest) and fails
    threads["second"].join(10)
    assert isinstance(outcomes["second"], RuntimeError)
    clock.gates["first"].set()  # the next group
    threads["first"].join(10)
    assert isinstance(outcomes["first"], Indeterminate)
    assert "second" not in machine.fetch_latest().writers, \
        "an append whose caller got an error was committed afterwards"
    client.close()


@pytest.mark.timeout(120)
def test_many_threads_on_many_shards_all_commit(durable_location):
    """32 threads each appending 20 times to its own shard through one client: every
    append lands once, in fewer round trips than appends."""
    client = durable_location.client(InlinePolicy())
    shards = [ShardId.new() for _ in range(32)]
    writers = [client.open_writer(s) for s in shards]
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            for t in range(20):
                writers[i].compare_and_append([(b"r%d" % t, b"", t, 1)], t, t + 1)
        except Exception as e:  # asserted below
            errors.append(f"{type(e).__name__}: {e}")

    before = client.metrics.group_commits
    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert errors == []
    for shard in shards:
        assert _read(client, shard) == sorted((b"r%d" % t, b"", 1) for t in range(20))
    assert client.metrics.group_commits - before < 32 * 20
    client.close()


def test_a_group_commits_while_another_waits_for_its_round_trip(monkeypatch):
    """While one group's compare-and-set is held up in consensus, an append to another
    shard commits as a group of its own; an append to the held shard waits for that
    group and then commits after it, in order."""
    client = PersistClient.open("mem://", "mem://", inline_policy=InlinePolicy())
    a, b = ShardId.new(), ShardId.new()
    first_a, second_a, only_b = (client.open_writer(a), client.open_writer(a),
                                 client.open_writer(b))
    gate, held = threading.Event(), threading.Event()
    real_cas = client.consensus.compare_and_set

    def gated(shard, expected, new):
        if shard == str(a) and not gate.is_set():
            held.set()
            assert gate.wait(30)
        return real_cas(shard, expected, new)

    monkeypatch.setattr(client.consensus, "compare_and_set", gated)
    results: dict[str, object] = {}

    def append(name, writer, lo):
        try:
            results[name] = writer.compare_and_append([(name.encode(), b"", lo, 1)], lo, lo + 1)
        except Exception as e:  # asserted below
            results[name] = e

    t_a = threading.Thread(target=append, args=("a1", first_a, 0))
    t_a.start()
    assert held.wait(30)  # a's group is in its round trip
    t_b = threading.Thread(target=append, args=("b", only_b, 0))
    t_b.start()
    t_b.join(10)  # a group at a time would hold b behind a's until the gate opens
    assert not t_b.is_alive() and results["b"].upper == 1 and t_a.is_alive()
    t_a2 = threading.Thread(target=append, args=("a2", second_a, 1))
    t_a2.start()
    gate.set()
    t_a.join(30)
    t_a2.join(30)
    assert results["a1"].upper == 1 and results["a2"].upper == 2
    assert _read(client, a) == [(b"a1", b"", 1), (b"a2", b"", 1)]
    assert _read(client, b) == [(b"b", b"", 1)]
    client.close()


def _poll(condition: Any, what: str) -> None:
    deadline = SYSTEM_CLOCK.monotonic() + 10
    while not condition():
        assert SYSTEM_CLOCK.monotonic() < deadline, f"timed out waiting for {what}"
        SYSTEM_CLOCK.sleep(0.002)


def test_a_lone_append_beside_a_group_in_flight_waits_to_share_the_next_round_trip(
        monkeypatch):
    """While a group of two appends is in its round trip, one arriving append does not
    spend the free slot on itself: it waits, and the next one to arrive commits both in
    one round trip (the group in flight is still held). A busy process's threads are
    about to come back; a group of one would leave them queued behind it."""
    client = PersistClient.open("mem://", "mem://", inline_policy=InlinePolicy())
    names = ["p", "q", "r", "s", "t", "u"]
    shards = {n: ShardId.new() for n in names}
    writers = {n: client.open_writer(shards[n]) for n in names}
    gates = {n: threading.Event() for n in "pqr"}
    held = {n: threading.Event() for n in "pqr"}
    by_shard = {str(shards[n]): n for n in names}
    real_cas, real_many = client.consensus.compare_and_set, client.consensus.compare_and_set_many

    def hold(shard_names: list[str]) -> None:
        for n in shard_names:
            if n in gates:
                held[n].set()
                assert gates[n].wait(30)

    def cas(shard, expected, new):
        hold([by_shard[shard]])
        return real_cas(shard, expected, new)

    def cas_many(writes):
        hold(sorted(by_shard[w.shard] for w in writes))
        return real_many(writes)

    monkeypatch.setattr(client.consensus, "compare_and_set", cas)
    monkeypatch.setattr(client.consensus, "compare_and_set_many", cas_many)
    results: dict[str, object] = {}

    def start(n: str) -> threading.Thread:
        def append() -> None:
            try:
                results[n] = writers[n].compare_and_append([(n.encode(), b"", 0, 1)], 0, 1)
            except Exception as e:  # asserted below
                results[n] = e

        thread = threading.Thread(target=append, name=n)
        thread.start()
        return thread

    funnel = client._funnel
    assert funnel is not None
    threads = {"p": start("p")}
    assert held["p"].wait(30)  # a group of one in flight ...
    threads["q"] = start("q")
    assert held["q"].wait(30)  # ... and beside it another one: both slots taken
    threads["r"], threads["s"] = start("r"), start("s")
    _poll(lambda: len(funnel._queue) == 2, "r and s to queue")
    gates["p"].set()  # p's group ends; r leads r and s as one group, held
    assert held["r"].wait(30)
    gates["q"].set()
    threads["q"].join(30)
    groups, grouped = client.metrics.group_commits, client.metrics.group_commit_appends
    threads["t"] = start("t")
    _poll(lambda: len(funnel._queue) == 1 or "t" in results, "t to queue or commit")
    assert "t" not in results, "a lone append took the free slot for itself"
    threads["u"] = start("u")
    threads["t"].join(30)
    threads["u"].join(30)
    assert results["t"].upper == 1 and results["u"].upper == 1  # type: ignore[attr-defined]
    assert (client.metrics.group_commits - groups,
            client.metrics.group_commit_appends - grouped) == (1, 2)
    assert threads["r"].is_alive() and threads["s"].is_alive()  # still in their round trip
    gates["r"].set()
    for thread in threads.values():
        thread.join(30)
    for n in names:
        assert results[n].upper == 1, results[n]  # type: ignore[attr-defined]
        assert _read(client, shards[n]) == [(n.encode(), b"", 1)]
    client.close()


def _interrupt_once(monkeypatch: Any, name: str, after: bool) -> list[str]:
    """Make ``Funnel.<name>`` raise KeyboardInterrupt once, on entry (a signal landing
    as the call starts) or after it returned (landing before its caller stored the
    result): the instants right after a writer claimed a slot, bytes or a group."""
    original = getattr(Funnel, name)
    fired: list[str] = []

    def interrupted(self: Funnel, *args: Any, **kwargs: Any) -> Any:
        if fired:
            return original(self, *args, **kwargs)
        fired.append(name)
        if not after:
            raise KeyboardInterrupt
        original(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Funnel, name, interrupted)
    return fired


@pytest.mark.timeout(60)
@pytest.mark.parametrize("window_s, name, after", [
    (0.0, "_claim_alone", True),    # bytes and a group-of-one slot claimed
    (0.0, "_commit_alone", False),  # about to commit that group of one
    (0.01, "_admit", True),         # bytes claimed, queued
    (0.01, "_lead", False),         # a leader's slot claimed
    (0.01, "_take", True),          # a group taken
])
@pytest.mark.parametrize("kind", location_kinds("embedded", "pg-s3"))
def test_an_interrupt_right_after_a_claim_in_the_funnel_leaks_nothing(
        monkeypatch, request, tmp_path, kind, window_s, name, after):
    """A KeyboardInterrupt (any BaseException) may land right after a writer claimed
    in-flight bytes, a leader's slot or a group, before it entered the code that gives
    them back: the claim must go with the interrupted writer, or later writers of the
    client wait forever on the in-flight bound or for a leader. The interrupted append
    is not committed behind its caller's back, and later appends all commit."""
    location = make_location(kind, request, tmp_path)
    # A bound one append fills: a leaked byte count blocks every later writer.
    client = location.client(InlinePolicy(), PersistConfig(
        group_commit_window_s=window_s, group_commit_max_inflight_bytes=64))
    shard, other = ShardId.new(), ShardId.new()
    writer, other_writer = client.open_writer(shard), client.open_writer(other)
    fired = _interrupt_once(monkeypatch, name, after)
    with pytest.raises(KeyboardInterrupt):
        writer.compare_and_append([(b"lost", b"v" * 40, 0, 1)], 0, 1)
    assert fired == [name]
    errors: list[BaseException] = []

    def later(w: Any, key: bytes) -> None:
        try:
            for t in range(3):
                w.compare_and_append([(key + b"%d" % t, b"v" * 40, t, 1)], t, t + 1)
        except BaseException as e:  # asserted below
            errors.append(e)

    threads = [threading.Thread(target=later, args=(w, k), daemon=True)
               for w, k in ((writer, b"a"), (other_writer, b"b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "later appends hang behind the interrupt"
    assert errors == []
    assert _read(client, shard) == [(b"a%d" % t, b"v" * 40, 1) for t in range(3)]
    assert _read(client, other) == [(b"b%d" % t, b"v" * 40, 1) for t in range(3)]
    client.close()


@pytest.mark.timeout(60)
def test_appends_a_leader_took_go_back_in_line_when_it_is_interrupted(monkeypatch, tmp_path):
    """A leader interrupted right after it took a group, before it sent the group's
    commit, never tried the other threads' appends in it: those go back in line, and
    their own threads commit them (none hangs, none is lost); the leader's own append
    is not committed behind its caller's back."""
    client = PersistClient.open(f"sqlite:///{tmp_path / 'c.db'}", f"file://{tmp_path / 'b'}",
                                config=PersistConfig(group_commit=False))
    first_shard, second_shard = ShardId.new(), ShardId.new()
    machines = {"first": client._machine(first_shard), "second": client._machine(second_shard)}
    for m in machines.values():
        m.open(create=True)
    clock = _GatedWindowClock(0.05)
    funnel = Funnel(clock, MachineMetrics(), window_s=clock.window_s,
                    max_inflight_bytes=1 << 20)
    original = Funnel._take

    def take(self: Funnel, *args: Any) -> Any:
        group = original(self, *args)
        if threading.current_thread().name == "second":
            assert len(group) == 2  # both appends, the first one's too
            raise KeyboardInterrupt
        return group

    monkeypatch.setattr(Funnel, "_take", take)
    outcomes: dict[str, object] = {}

    def append(name: str) -> None:
        machine = machines[name]

        def register(state: Any) -> Any:
            return transitions.register_writer(state, name, machine.now_ms(), 60_000)

        try:
            outcomes[name] = funnel.commit(machine, register)
        except BaseException as e:  # asserted below
            outcomes[name] = e

    threads = {}
    for name in ("first", "second"):
        clock.gate(name)
        threads[name] = threading.Thread(target=append, args=(name,), name=name, daemon=True)
        threads[name].start()
        assert clock.waiting[name].wait(10)  # leading a group, in its window
    clock.gates["second"].set()  # takes both appends, then is interrupted
    threads["second"].join(10)
    assert isinstance(outcomes["second"], KeyboardInterrupt)
    clock.gates["first"].set()
    threads["first"].join(10)
    assert not threads["first"].is_alive(), "an append its leader took and dropped hangs"
    assert not isinstance(outcomes["first"], BaseException), outcomes["first"]
    assert "first" in machines["first"].fetch_latest().writers
    assert "second" not in machines["second"].fetch_latest().writers, \
        "an append whose caller got an interrupt was committed afterwards"
    client.close()


def _two_appends_at_once(client: PersistClient, shard: ShardId,
                         bounds: list[tuple[int, int]]) -> list[object]:
    """Two threads append to ``shard`` at once (thread ``i`` from ``bounds[i]``, each
    through its own writer); each one's result or error."""
    writers = [client.open_writer(shard), client.open_writer(shard)]
    barrier = threading.Barrier(2)
    outcomes: list[object] = [None, None]

    def append(i: int) -> None:
        lower, upper = bounds[i]
        barrier.wait()
        try:
            outcomes[i] = writers[i].compare_and_append([(b"w%d" % i, b"v", lower, 1)],
                                                        lower, upper)
        except Exception as e:  # asserted by the caller
            outcomes[i] = e

    threads = [threading.Thread(target=append, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "an append to the shard hangs"
    for w in writers:
        w.expire()
    return outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", location_kinds("embedded", "pg-s3"))
def test_appends_to_one_shard_arriving_in_one_window_commit_in_a_valid_order(
        request, tmp_path, kind):
    """Two threads append to the SAME shard at once, inside one group-commit window,
    each on its own expected upper. Whatever order they arrive in, the outcome is one a
    serial order gives: a chained pair (0->1, 1->2) both commits in order or the later
    one is refused with UpperMismatch naming the upper it found; a racing pair (both
    0->1) commits exactly one. No append is lost, none applied on an upper it did not
    expect."""
    location = make_location(kind, request, tmp_path)
    client = location.client(InlinePolicy(), PersistConfig(group_commit_window_s=0.02))
    for round_ in range(6):
        chained = round_ % 2 == 0
        shard = ShardId.new()
        outcomes = _two_appends_at_once(client, shard,
                                        [(0, 1), (1, 2)] if chained else [(0, 1), (0, 1)])
        ok = [not isinstance(o, Exception) for o in outcomes]
        refused = [o for o in outcomes if isinstance(o, Exception)]
        assert all(isinstance(e, UpperMismatch) for e in refused), refused
        got = _read(client, shard)
        if chained:
            if all(ok):
                assert got == [(b"w0", b"v", 1), (b"w1", b"v", 1)]
                assert [getattr(o, "upper", None) for o in outcomes] == [1, 2]
            else:
                # The second arrived first: refused on the upper it found (0), then
                # the first commits alone.
                assert ok == [True, False] and refused[0].current == 0, outcomes
                assert got == [(b"w0", b"v", 1)]
        else:
            assert sorted(ok) == [False, True], outcomes
            assert refused[0].current == 1
            winner = ok.index(True)
            assert got == [(b"w%d" % winner, b"v", 1)]
    client.close()
