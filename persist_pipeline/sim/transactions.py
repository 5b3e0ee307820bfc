"""Simulated clients of multi-shard transactions and of group commit.

Transactors commit pair transactions on two shards shared by every transactor of the
seed (one row per transaction, the same key in both), inline or in blob, at the uppers
they believe current (sometimes stale), while they also append to the first shard
alone; now and then one commits a pair whose second append holds no rows, then commits
it again with the same tokens through fresh writers, as a process that never learnt the
outcome does, or commits one twice at once from two threads (a retry that did not wait
for the first attempt's answer). Compaction and GC run on both shards as on every shard of the seed.

What they check: a transaction's row is in both shards or neither, read in the order
first, second, first again (a commit lands in both at one moment, so the first read's
rows are in the second's, and the second's in the third's); an acknowledged
transaction is never lost; a refused one is never written; a retried one that landed
is reported committed, neither refused nor written twice.

Grouped writers are processes of several threads sharing one client, each appending to
its own shard (or one of the pair) at once, so their appends meet in the client's
group-commit funnel; each append's outcome is checked alike: acknowledged, present;
refused, absent. Now and then another thread expires a grouped writer's handle while
its append is on its way: once both are done, the expired writer must not be in the
shard's state (the append never registers it again).

Now and then a transactor commits an untyped append to a shard id that does not exist
yet while another process creates that shard typed; the append's keys and values are
valid encodings of the schema's rows, so only its untypedness tells it apart. Whoever
wins, the shard is typed and empty, or untyped with the append's rows: a typed shard
holding them is a defect.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from persist_pipeline.exceptions import (
    BackendError,
    CommitDeadlineExceeded,
    Indeterminate,
    LeaseExpired,
    NotYetAvailable,
    PersistError,
    SchemaMismatch,
    ShardNotFound,
    SinceViolation,
    UpperMismatch,
)
from persist_pipeline.ids import ShardId, new_token
from persist_pipeline.schema import ShardSchema
from persist_pipeline.sim.scheduler import Process

if TYPE_CHECKING:
    from persist_pipeline.client import PersistClient
    from persist_pipeline.sim.runner import SimRun
    from persist_pipeline.transaction import Transaction
    from persist_pipeline.write import WriteHandle, WriteResult

#: Transaction rows' keys start with this; the first shard's lone appends do not.
TXN_PREFIX = b"txn/"
#: Grouped writers' rows' keys start with this.
GROUPED_PREFIX = b"grp/"
#: The first shard's rows of transactions that also create a name start with this.
NAMED_PREFIX = b"named/"


@dataclass
class Txn:
    """One pair transaction and what its committer was told."""

    key: bytes
    status: str = "pending"  # pending | acked | failed | unknown
    #: Its append to the second shard held no rows (its row is in the first only).
    first_only: bool = False


@dataclass
class TxnLedger:
    """What the transactors of one seed share: the pair of shards and every attempt."""

    pair: tuple[str, str] | None = None
    txns: list[Txn] = field(default_factory=list)
    count: int = 0
    #: Grouped writers' appends: (shard, entry).
    singles: list[tuple[str, Txn]] = field(default_factory=list)
    #: Transactions that created a name: (name, entry).
    named: list[tuple[str, Txn]] = field(default_factory=list)


def _ledger(run: SimRun) -> TxnLedger:
    ledger: TxnLedger = run.txns
    if ledger.pair is None:
        ledger.pair = (str(ShardId.new()), str(ShardId.new()))
    return ledger


def _open_writers(run: SimRun, client: PersistClient,
                  pair: tuple[str, str]) -> list[WriteHandle] | None:
    writers = []
    for shard in pair:
        writer = run.retry_open(functools.partial(client.open_writer, shard))
        if writer is None:
            return None
        writers.append(writer)
    return writers


def _commit(run: SimRun, client: PersistClient, ledger: TxnLedger,
            writers: list[WriteHandle], stale: bool) -> None:
    pair = ledger.pair
    assert pair is not None
    ledger.count += 1
    entry = Txn(TXN_PREFIX + b"%d" % ledger.count)
    big = run.rng.random() < 0.3  # blob parts uploaded before the round trip
    txn = client.transaction()
    for shard, writer in zip(pair, writers, strict=True):
        upper = writer.upper if stale else run.monitors.get(shard).upper
        if upper is None:
            return
        value = b"v" * (6000 if big else 3)
        txn.compare_and_append(writer, [(entry.key, value, upper, 1)], upper, upper + 1)
    ledger.txns.append(entry)
    _commit_recording(txn, entry)


def _commit_recording(txn: Transaction, entry: Txn) -> None:
    """Commit ``txn``; record in ``entry`` what its committer was told."""
    try:
        txn.commit()
        entry.status = "acked"
    except (UpperMismatch, CommitDeadlineExceeded, LeaseExpired):
        entry.status = "failed"
    except Indeterminate:
        entry.status = "unknown"


def _abort_naming(run: SimRun, client: PersistClient, ledger: TxnLedger,
                  writers: list[WriteHandle]) -> None:
    """A transaction that appends to the pair's first shard and to a name no shard has,
    aborted before it commits (its caller's code failed): it leaves no name behind
    (names are never deleted), nor the shard the name would have named."""
    pair = ledger.pair
    assert pair is not None
    upper = run.monitors.get(pair[0]).upper
    if upper is None:
        return
    name = f"aborted/{run.rng.getrandbits(48):012x}"
    txn = client.transaction()
    try:
        txn.compare_and_append(writers[0], [(b"never", b"", upper, 1)], upper, upper + 1)
        txn.compare_and_append(name, [(b"never", b"", 0, 1)], 0, 1)
        fresh = txn._new_names.get(name)
        txn.abort()
        found = client.name_registry.lookup(name)
        created = fresh is not None and fresh in client.list_shards()
    except BackendError:
        txn.abort()
        return  # a store fault (also an Indeterminate): nothing to check this time
    if found is not None:
        run.violation(f"an aborted transaction left the name {name!r} registered")
    if created:
        run.violation(f"an aborted transaction left the shard {fresh} it made for "
                      f"{name!r} behind")


def _commit_naming(run: SimRun, client: PersistClient, ledger: TxnLedger,
                   writers: list[WriteHandle]) -> None:
    """A transaction appending to the pair's first shard (at an upper now and then
    stale) and to a name no shard has: the name must be registered exactly when the
    transaction landed, never by a commit that was refused (names are never deleted)."""
    pair = ledger.pair
    assert pair is not None
    stale = run.rng.random() < 0.4
    upper = writers[0].upper if stale else run.monitors.get(pair[0]).upper
    if upper is None:
        return
    tag = f"{run.rng.getrandbits(48):012x}"
    name, entry = f"named/{tag}", Txn(NAMED_PREFIX + tag.encode())
    txn = client.transaction()
    try:
        txn.compare_and_append(writers[0], [(entry.key, b"", upper, 1)], upper, upper + 1)
        txn.compare_and_append(name, [(entry.key, b"", 0, 1)], 0, 1)
    except BackendError:
        txn.abort()
        return  # a store fault while adding (a name lookup): nothing committed
    ledger.named.append((name, entry))
    _commit_recording(txn, entry)


def check_named(run: SimRun, client: PersistClient, where: str) -> None:
    """Each name a transaction created is registered iff its row is in the pair's first
    shard; an acknowledged one is both, a refused one neither."""
    ledger: TxnLedger = run.txns
    if ledger.pair is None or not ledger.named:
        return
    # Only outcomes known before the reads (a commit in flight may land after them).
    settled = [(n, e) for n, e in ledger.named if e.status != "pending"]
    landed = _keys(client, ledger.pair[0], NAMED_PREFIX)
    if landed is None:
        return
    names = client.shard_names()
    for name, entry in settled:
        registered, present = name in names, entry.key in landed
        if entry.status == "acked" and not (registered and present):
            run.violation(f"{where}: acknowledged transaction naming {name!r} LOST "
                          f"(name registered: {registered}, row present: {present})")
        elif entry.status == "failed" and (registered or present):
            run.violation(f"{where}: refused transaction naming {name!r} was written "
                          f"(name registered: {registered}, row present: {present})")
        elif registered != present:
            run.violation(f"{where}: transaction naming {name!r} landed in part (name "
                          f"registered: {registered}, row present: {present})")


def _start_pair_retry(run: SimRun, ledger: TxnLedger, *, first_only: bool
                      ) -> tuple[tuple[str, str], list[int | None], Txn, list[str]] | None:
    """The shards, their uppers as last seen, a new ledger entry and two recorded tokens
    of a pair transaction to commit more than once; None while an upper is unknown."""
    pair = ledger.pair
    assert pair is not None
    uppers = [run.monitors.get(shard).upper for shard in pair]
    if None in uppers:
        return None
    ledger.count += 1
    return pair, uppers, Txn(TXN_PREFIX + b"%d" % ledger.count, first_only=first_only), \
        [new_token(), new_token()]


def _commit_and_retry(run: SimRun, client: PersistClient, ledger: TxnLedger) -> None:
    """A pair transaction whose append to the second shard holds no rows, committed with
    recorded tokens, then committed again with the same tokens through fresh writers
    (the shards' ids), as a process does that never learnt the outcome: a transaction
    that landed is reported committed again, never refused nor written twice."""
    started = _start_pair_retry(run, ledger, first_only=True)
    if started is None:
        return
    pair, uppers, entry, tokens = started

    def commit() -> dict[str, WriteResult]:
        txn = client.transaction()
        for shard, upper, token, rows in zip(pair, uppers, tokens,
                                             ([(entry.key, b"v", uppers[0], 1)], []),
                                             strict=True):
            assert upper is not None
            txn.compare_and_append(shard, rows, upper, upper + 1, idempotency_token=token)
        return txn.commit()

    ledger.txns.append(entry)
    try:
        commit()
        entry.status = "acked"
    except (UpperMismatch, CommitDeadlineExceeded):
        entry.status = "failed"
        return
    except Indeterminate:
        entry.status = "unknown"
    run.think()
    try:
        again = commit()
    except (UpperMismatch, CommitDeadlineExceeded) as e:
        if entry.status == "acked":
            run.violation(f"committed transaction {entry.key!r}, retried with its tokens, "
                          f"was refused ({type(e).__name__})")
        else:
            entry.status = "failed"
        return
    except Indeterminate:
        return
    if entry.status == "acked" and not all(r.already_committed for r in again.values()):
        run.violation(f"committed transaction {entry.key!r}, retried with its tokens, was "
                      f"committed again (written twice)")
    entry.status = "acked"


def _commit_racing_retry(run: SimRun, proc: Process, client: PersistClient,
                         ledger: TxnLedger) -> None:
    """A pair transaction committed by two threads of one process at once with the same
    tokens, through fresh writers (a retry whose timer fired while the first attempt was
    still on its way), its rows inline or in blob parts uploaded by each: one lands and
    the other finds it (its own parts deleted, the landed ones kept), or both are
    refused; never one acknowledged and the other refused for its upper, never written
    twice. (One refused for its own commit deadline fences nothing: the other may land.)"""
    started = _start_pair_retry(run, ledger, first_only=False)
    if started is None:
        return
    pair, uppers, entry, tokens = started
    value = b"r" * (6000 if run.rng.random() < 0.5 else 3)
    told: list[str] = []

    def commit() -> None:
        txn = client.transaction()
        try:
            for shard, upper, token in zip(pair, uppers, tokens, strict=True):
                assert upper is not None
                txn.compare_and_append(shard, [(entry.key, value, upper, 1)], upper,
                                       upper + 1, idempotency_token=token)
            txn.commit()
            told.append("acked")
        except UpperMismatch:
            told.append("refused")
        except CommitDeadlineExceeded:
            # This commit's own parts were uploaded too long ago: it refused itself, but
            # fences nothing (the other, uploaded later, may still land).
            told.append("late")
        except Indeterminate:
            told.append("unknown")
        if len(told) == 2:
            _settle_race(run, client, ledger, entry, told)

    ledger.txns.append(entry)
    run.spawn(f"{proc.name}-retry{ledger.count}", proc, commit)
    commit()


def _settle_race(run: SimRun, client: PersistClient, ledger: TxnLedger, entry: Txn,
                 told: list[str]) -> None:
    """Both commits of a raced transaction answered: an upper mismatch (which settles
    the other commit's batch from history first) never meets an acknowledgement, and the
    rows are in each shard at most once."""
    if "acked" in told and "refused" in told:
        run.violation(f"transaction {entry.key!r} committed twice at once with its tokens: "
                      f"one commit acknowledged, the other refused")
    entry.status = "acked" if "acked" in told else "unknown" if "unknown" in told \
        else "failed"
    assert ledger.pair is not None
    for shard in ledger.pair:
        try:
            diffs = latest_diffs(client, shard, entry.key)
        except (Indeterminate, NotYetAvailable, SinceViolation, LeaseExpired):
            # A store fault, a since moved on, a reader paused past its lease: the next
            # check reads again.
            continue
        if diffs is not None and diffs.get(entry.key, 0) > 1:
            run.violation(f"transaction {entry.key!r} committed twice at once with its "
                          f"tokens was written twice to shard {shard}")


def latest_diffs(client: PersistClient, shard: str, prefix: bytes) -> dict[bytes, int] | None:
    """``{key: d}`` of the keys with ``prefix`` in ``shard`` at its latest complete time
    (None: no time yet)."""
    try:
        upper = client._machine(shard).fetch_latest().upper
    except ShardNotFound:
        return {}  # never created (its opener crashed first): it holds nothing
    if not upper:
        return None
    reader = client.open_reader(shard)
    try:
        table = reader.snapshot(upper - 1)
    finally:
        reader.expire()
    return {k: d for k, d in zip(table.column("k").to_pylist(), table.column("d").to_pylist(),
                                 strict=True) if k.startswith(prefix)}


def _keys(client: PersistClient, shard: str, prefix: bytes = TXN_PREFIX) -> set[bytes] | None:
    """The keys with ``prefix`` of ``shard`` at its latest complete time (None: no time
    yet)."""
    diffs = latest_diffs(client, shard, prefix)
    return None if diffs is None else set(diffs)


def check(run: SimRun, client: PersistClient, where: str) -> None:
    """Every transaction whole in both shards; none acked lost, none refused written."""
    ledger: TxnLedger = run.txns
    if ledger.pair is None:
        return
    a, b = ledger.pair
    # Acknowledged before the reads start: a later acknowledgement may be of a commit
    # that landed after them.
    acked = [e.key for e in ledger.txns if e.status == "acked"]
    first, second, third = _keys(client, a), _keys(client, b), _keys(client, a)
    if first is None or second is None or third is None:
        return
    first_only = {e.key for e in ledger.txns if e.first_only}
    if not first - first_only <= second:
        run.violation(f"{where}: transactions {sorted(first - first_only - second)[:3]} in "
                      f"the first shard but not (later) in the second: a transaction landed "
                      f"in one shard only")
    if not second <= third:
        run.violation(f"{where}: transactions {sorted(second - third)[:3]} in the second shard "
                      f"but not (later) in the first: a transaction landed in one shard only")
    for key in acked:
        if key not in first:
            run.violation(f"{where}: acknowledged transaction {key!r} LOST")
    for entry in ledger.txns:
        if entry.status == "failed" and entry.key in first | second | third:
            run.violation(f"{where}: refused transaction {entry.key!r} was written")
    check_grouped(run, client, where)
    check_named(run, client, where)


def check_grouped(run: SimRun, client: PersistClient, where: str) -> None:
    """Every grouped append acknowledged before the read is there; none refused is."""
    # The appends recorded before the reads start (others keep appending meanwhile), and
    # those acknowledged by then: a later acknowledgement may be of a later commit.
    singles = list(run.txns.singles)
    acked = [(shard, e.key) for shard, e in singles if e.status == "acked"]
    shards = sorted({shard for shard, _ in singles})
    present = {shard: _keys(client, shard, GROUPED_PREFIX) or set() for shard in shards}
    for shard, key in acked:
        if key not in present[shard]:
            run.violation(f"{where}: acknowledged grouped append {key!r} LOST")
    for shard, entry in singles:
        if entry.status == "failed" and entry.key in present[shard]:
            run.violation(f"{where}: refused grouped append {entry.key!r} was written")


def _grouped_loop(run: SimRun, proc: Process, client: PersistClient, shard: str) -> None:
    """One thread of a grouped writer: appends to ``shard`` at its upper (sometimes a
    stale one), recording what it is told. Now and then another thread of its process
    expires the handle while the append is on its way (waiting in the funnel, uploading,
    re-run after a lost race): the append then commits before the expiry or is refused
    with ``LeaseExpired``, and once both are done the expired writer is not in the
    shard's state (never registered again by the append)."""
    ledger: TxnLedger = run.txns
    writer = run.retry_open(functools.partial(client.open_writer, shard))
    if writer is None:
        return
    while not run.stopping:
        run.think(scale=0.5)
        upper = writer.upper if run.rng.random() < 0.3 else run.monitors.get(shard).upper
        if upper is None:
            return
        ledger.count += 1
        entry = Txn(GROUPED_PREFIX + b"%d" % ledger.count)
        ledger.singles.append((shard, entry))
        value = b"w" * (6000 if run.rng.random() < 0.2 else 3)
        racing: list[bool] | None = None
        expired = False
        if run.expiry_rng.random() < EXPIRY_RACES:
            racing = []
            run.spawn(f"{proc.name}-expire{ledger.count}", proc,
                      functools.partial(_expire_racing, run, client, writer, racing))
        try:
            writer.compare_and_append([(entry.key, value, upper, 1)], upper, upper + 1)
            entry.status = "acked"
        except (UpperMismatch, CommitDeadlineExceeded):
            entry.status = "failed"
        except Indeterminate:
            entry.status = "unknown"
        except LeaseExpired:
            entry.status, expired = "failed", True
        except PersistError as e:
            entry.status = "unknown"
            run.violation(f"grouped writer: unexpected {type(e).__name__}: {e}")
        run.ops += 1
        if racing is not None:
            racing.append(True)
            _check_expired(run, client, writer, racing)
        if racing is not None or expired:
            writer = run.retry_open(functools.partial(client.open_writer, shard))
            if writer is None:
                return


#: How often a grouped append races an expiry of its handle by another thread.
EXPIRY_RACES = 0.05


def _expire_racing(run: SimRun, client: PersistClient, writer: WriteHandle,
                   racing: list[bool]) -> None:
    """Another thread's ``expire()`` of a handle whose append is on its way."""
    try:
        writer.expire()
    except (Indeterminate, ShardNotFound):
        racing.append(False)  # not known to be expired: its entry lapses with its lease
    else:
        racing.append(True)
    _check_expired(run, client, writer, racing)


def _check_expired(run: SimRun, client: PersistClient, writer: WriteHandle,
                   racing: list[bool]) -> None:
    """Once both the append and the expiry that raced it are done (``racing`` holds two
    answers, all True when the expiry committed): the writer is not in the state."""
    if len(racing) < 2 or not all(racing):
        return
    try:
        state = client._machine(writer.shard_id).fetch_latest()
    except (Indeterminate, ShardNotFound):
        return  # a store fault: nothing to check this time
    if writer.writer_id in state.writers:
        run.violation(f"grouped writer: writer {writer.writer_id} of shard "
                      f"{writer.shard_id}, expired by another thread, is registered again")


def grouped_writer(run: SimRun, proc: Process) -> None:
    """Four threads of one process (one client, one funnel) appending at once: one to
    each shard of the pair, one to a shard of its own, and one more to that shard, so
    groups commit side by side on different shards while an append waits for its
    shard's group to end; then checks."""
    client = run.client(proc)
    ledger = _ledger(run)
    assert ledger.pair is not None
    own = str(ShardId.new())
    for i, shard in enumerate((ledger.pair[1], own, own)):
        run.spawn(f"{proc.name}-g{i}", proc,
                  functools.partial(_grouped_loop, run, proc, client, shard))
    _grouped_loop(run, proc, client, ledger.pair[0])


def transactor(run: SimRun, proc: Process) -> None:
    """Pair transactions (fresh or stale uppers), lone appends to the first shard, and
    checks of both shards."""
    client = run.client(proc)
    ledger = _ledger(run)
    assert ledger.pair is not None
    pair = ledger.pair
    writers = _open_writers(run, client, pair)
    if writers is None:
        return
    while not run.stopping:
        run.think()
        if run.typing_rng.random() < TYPED_MID_COMMIT:
            _untyped_commit_typed_meanwhile(run, client)
            run.ops += 1
            continue
        roll = run.rng.random()
        try:
            if run.profile.naming_commits and roll < 0.3:
                # Only where the profile asks: other profiles keep their draws.
                _commit_naming(run, client, ledger, writers)
            elif roll < 0.6:
                _commit(run, client, ledger, writers, stale=run.rng.random() < 0.3)
            elif roll < 0.63:
                _commit_and_retry(run, client, ledger)
            elif roll < 0.65:
                _commit_racing_retry(run, proc, client, ledger)
            elif roll < 0.68:
                _abort_naming(run, client, ledger, writers)
            elif roll < 0.8:
                a = pair[0]
                upper = run.monitors.get(a).upper
                if upper is not None:
                    writers[0].compare_and_append([(b"solo", b"", upper, 1)], upper, upper + 1)
            else:
                check(run, client, "transactor")
        except LeaseExpired:
            writers = _open_writers(run, client, pair)
            if writers is None:
                return
        except (Indeterminate, UpperMismatch, CommitDeadlineExceeded, NotYetAvailable,
                SinceViolation):
            pass
        except PersistError as e:
            run.violation(f"transactor: unexpected {type(e).__name__}: {e}")
        run.ops += 1


#: How often a transactor's step is an untyped commit to a new shard typed meanwhile.
TYPED_MID_COMMIT = 0.05


def _untyped_commit_typed_meanwhile(run: SimRun, client: PersistClient) -> None:
    """A transaction's untyped append to a fresh shard id that another process creates
    typed while the commit is on its way. Its rows' keys and values are valid
    encodings of rows of that schema: taken for typed rows, they would land in the typed
    shard. Whoever wins, the shard reads typed and empty, or untyped with the rows."""
    schema = ShardSchema({"id": pa.int64()}, {"a": pa.string()})
    encoded = schema.to_updates(pa.table({"id": [1, 2], "a": ["x", None], "t": [0, 0],
                                          "d": [1, 1]})).table()
    rows = list(zip(encoded.column("k").to_pylist(), encoded.column("v").to_pylist(),
                    [0, 0], [1, 1], strict=True))
    shard = str(ShardId.new())
    typer = run.new_process(f"txn-typer-of-{shard[:9]}")
    typed: list[bool] = []

    def type_it() -> None:
        run.think(scale=0.3)
        other = run.client(typer)
        try:
            other.open_writer(shard, schema=schema).stop_heartbeats()
            typed.append(True)
        except (SchemaMismatch, Indeterminate):
            typed.append(False)  # the transaction created it first (or a fault)
        except PersistError as e:
            typed.append(False)
            run.violation(f"typing a fresh shard: unexpected {type(e).__name__}: {e}")

    txn = client.transaction()
    try:
        txn.compare_and_append(shard, rows, 0, 1)
    except Indeterminate:
        txn.abort()
        return
    run.spawn(typer.name, typer, type_it)
    try:
        txn.commit()
    except (SchemaMismatch, Indeterminate, UpperMismatch, CommitDeadlineExceeded):
        pass  # typed first (refused as untyped), or a fault
    except PersistError as e:
        run.violation(f"untyped transaction to a shard typed meanwhile: unexpected "
                      f"{type(e).__name__}: {e}")
    while not typed and not run.stopping:
        run.think()
    try:
        state = client._machine(shard).fetch_latest()
    except (Indeterminate, ShardNotFound):
        return
    if state.schema and state.batches:
        run.violation(f"typed shard {shard} holds the rows of an untyped transaction "
                      f"(committed into it once another process typed it)")


ROLES = {"transactor": transactor, "grouped_writer": grouped_writer}
