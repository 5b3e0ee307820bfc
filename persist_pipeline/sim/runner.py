"""Run the deterministic simulation: one seed, or many, and report one line."""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from persist_pipeline import retry
from persist_pipeline import spark as spark_driver
from persist_pipeline.client import PersistClient
from persist_pipeline.config import InlinePolicy, PersistConfig
from persist_pipeline.exceptions import Indeterminate, PersistError
from persist_pipeline.ids import ShardId, new_critical_reader_id, seeded_ids
from persist_pipeline.internal.sync import event_factory, inline_workers, lock_factory
from persist_pipeline.sim import actors, ingestion, plans, seams, table_pairs, transactions
from persist_pipeline.sim.monitor import Model, Monitor, Monitors
from persist_pipeline.sim.scheduler import (
    Nemesis,
    Process,
    Scheduler,
    SimClock,
    SimDeadlock,
    SimEvent,
    SimLock,
)
from persist_pipeline.sim.seams import SeamState
from persist_pipeline.sim.stores import SimBlob, SimConsensus

T = TypeVar("T")

#: The three inline settings every guarantee must hold under: on (with a small budget,
#: so writes fall through to blob often), off, and permanent backpressure.
INLINE_SETTINGS = (InlinePolicy(1024, 3000), InlinePolicy(0, 0), InlinePolicy(1024, 0))

#: Every simulated process kind, by role name.
ROLES = {**actors.ROLES, **seams.ROLES, **transactions.ROLES, **ingestion.ROLES,
         **plans.ROLES, **table_pairs.ROLES}

#: The share of seeds whose processes (and blob stores) have skewed wall clocks (their
#: offsets: up to past half the orphan sweep's age, 8 s in ``sim_config``, and near the
#: reader lease, 6 s, so a clock compared across machines shows).
SKEW_SEEDS = 0.5

Cast = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class Profile:
    """A family of workloads: how many processes of each role a seed draws (from these
    ranges), and whether readers may use a part cache. Seeds rotate over the profiles
    (swarm testing: a narrower cast reaches its own races far more often)."""

    cast: Cast
    part_cache: bool = True
    #: Skewed clocks in every seed of the profile (else in a share of seeds), and the
    #: offsets they draw from.
    skewed: bool = False
    skew_choices_s: tuple[float, ...] = (-5.0, -2.0, 0.0, 0.0, 2.0, 5.0)
    #: Faults of its own (else the default nemesis).
    nemesis: Nemesis | None = None
    #: How much longer than a writer a listener thinks between polls (a listen that
    #: lags behind the writers); lower, its polls meet more faults.
    listen_lag: float = 3.0
    #: How often simulated heartbeat threads renew leases (one drawn per seed).
    heartbeat_choices_s: tuple[float, ...] = (0.05, 0.3, 1.5)
    #: Start a compactor when the cast has none (a shard nobody compacts keeps every
    #: batch in its head, which is what some races need).
    compaction: bool = True
    #: Spark writers now and then commit an earlier write again, with its token and
    #: parts, as a driver does that never learnt the outcome.
    recommits: bool = False
    #: Spark now and then aborts a write before the worker that commits it has started
    #: (the late commit must refuse: the abort may have deleted its parts).
    aborts_before_commit: bool = False
    #: Each process's own ``gc_orphan_min_age_s``, drawn from these (empty: the seed's
    #: config for all): GCs and writers configured with different ages, a shorter one
    #: than the shard's among them.
    orphan_age_choices_s: tuple[float, ...] = ()
    #: Each process's own ``persist_inline_update_max_bytes``, drawn from these (empty:
    #: the seed's policy for all); the seed's policy then always inlines.
    inline_max_choices: tuple[int, ...] = ()
    #: A listener's process opens a second listen on the same reader while the first
    #: polls and releases since.
    sibling_listens: bool = False
    #: In seeds with a WAL store, the final check compacts every shard until nothing is
    #: pending and then finds no part left in the WAL store (it holds fresh write parts
    #: only: compaction moves them all to the main store).
    final_wal_flush: bool = True
    #: Transactors now and then commit a transaction that also creates a name (at a
    #: stale upper of the other shard now and then, so the commit refuses it).
    naming_commits: bool = False


PROFILES: dict[str, Profile] = {
    # Everything at once.
    "mixed": Profile({"writer": (1, 3), "appender": (0, 2), "reader": (0, 2),
                      "listener": (1, 1), "controller": (0, 2), "compactor": (0, 1),
                      "spark_compactor": (0, 1), "gc": (1, 2), "opener": (0, 1)}),
    # A listen whose reader alone holds since back, under compaction and GC.
    "listen": Profile({"writer": (1, 2), "appender": (0, 1), "listener": (1, 1),
                       "compactor": (1, 1), "gc": (1, 1)}, sibling_listens=True),
    # Reads racing compaction and GC without a cache to hide deleted parts.
    "reads": Profile({"writer": (1, 2), "reader": (1, 2), "listener": (0, 1),
                      "compactor": (1, 1), "gc": (1, 2), "opener": (0, 1)},
                     part_cache=False),
    # Writers, appenders and critical readers racing on the upper and the token.
    "writes": Profile({"writer": (2, 3), "appender": (1, 2), "controller": (1, 2),
                       "spark_compactor": (0, 1), "gc": (1, 1)}),
    # A typed shard: upserts and deletes by writers opened with older schemas while it
    # evolves, typed Spark appends, typed reads; names raced for; its own maintenance.
    "typed": Profile({"typed_writer": (2, 3), "evolver": (1, 1), "typed_reader": (1, 2),
                      "spark_writer": (1, 1), "namer": (0, 1), "table_writer": (0, 2),
                      "compactor": (1, 1),
                      "spark_compactor": (0, 1), "gc": (1, 2)}, recommits=True),
    # Where features meet: Spark writes planned before a shard is typed, huge diffs,
    # listens after the largest time, beside ordinary writers and maintenance.
    "seams": Profile({"spark_writer": (1, 2), "overflow_writer": (1, 1), "closer": (0, 1),
                      "configured_writer": (0, 1), "table_writer": (1, 2),
                      "writer": (1, 2), "reader": (0, 1), "namer": (0, 1),
                      "compactor": (1, 1), "gc": (1, 2)}, aborts_before_commit=True),
    # Clocks and lost replies: blob writes racing GCs whose clocks are off (every
    # process's wall clock skewed) and that are configured with other orphan ages than
    # the writers', commits whose replies are lost while the writer pauses past its
    # lease and GC truncates the record that would settle them.
    "clocks": Profile({"writer": (2, 3), "appender": (0, 1), "gc": (2, 2)}, skewed=True,
                      compaction=False,
                      skew_choices_s=(-8.0, -4.0, 0.0, 4.0, 8.0),
                      nemesis=Nemesis(pause_at_cas=0.25, pause_choices_s=(1.0, 2.0, 3.5),
                                      pause_then_lose=0.08),
                      orphan_age_choices_s=(1.0, 8.0, 16.0)),
    # Multi-shard transactions racing each other and lone writers of one of their
    # shards, threads of one process whose appends meet in its group-commit funnel, and
    # pipeline ingestion of landed files whose runs die between commit and record (or
    # retry a step that failed after it), with lost replies, pauses and maintenance on
    # every shard.
    "transactions": Profile({"transactor": (1, 2), "grouped_writer": (1, 2),
                             "ingester": (1, 2), "writer": (0, 1), "compactor": (1, 1),
                             "gc": (1, 2)},
                            nemesis=Nemesis(pause_at_cas=0.1, pause_then_lose=0.05)),
    # Consensus and blob stores down for longer than the retry deadline: every caller
    # gets its outage answer (a read fails, a write is Indeterminate) mid-listen,
    # mid-downgrade, mid-expiry and mid-maintenance, and must neither lose what it
    # already took nor remember as done what failed.
    "outages": Profile({"writer": (1, 2), "appender": (0, 1), "reader": (0, 1),
                        "listener": (2, 3), "controller": (0, 1), "compactor": (0, 1),
                        "gc": (0, 1)},
                       nemesis=Nemesis(outage=0.01), listen_lag=0.5),
    # Processes configured with different inline maxima writing one shard while a
    # limiter lowers (below what the shard holds, or to 0) and raises its recorded max
    # and compaction flushes: no append leaves more inline bytes than the recorded max.
    "inline": Profile({"writer": (2, 3), "appender": (0, 1), "limiter": (0, 1),
                       "compactor": (0, 1), "gc": (0, 1)},
                      inline_max_choices=(600, 3000, 12000)),
    # Read plans held across heartbeats, or past their reader's lease, while compaction
    # moves their parts (out of the WAL store too) and GC collects and truncates; no
    # part cache to hide a deleted part.
    "plans": Profile({"writer": (2, 3), "plan_reader": (1, 2), "reader": (0, 1),
                      "compactor": (1, 1), "gc": (2, 2)}, part_cache=False),
    # Checks of the stores (verify, shallow and deep) racing compaction, which replaces
    # parts (moving them out of the WAL store too), and GC, which collects them; no part
    # cache: every check finds nothing wrong.
    "verify": Profile({"writer": (2, 3), "verifier": (1, 2), "compactor": (1, 1),
                       "spark_compactor": (0, 1), "gc": (2, 2)}, part_cache=False),
    # Reads of parts and rollups that now and then return a flipped bit (the objects
    # intact) while writers, readers (through the part cache, which keeps what a read
    # returned), listeners, compaction (in-process and Spark), GC and checks of the
    # stores run: every read returns the rows written, or the bytes are never used.
    "checksums": Profile({"writer": (1, 2), "reader": (1, 2), "listener": (0, 1),
                          "verifier": (0, 1), "compactor": (1, 1),
                          "spark_compactor": (0, 1), "gc": (1, 1)},
                         nemesis=Nemesis(bad_read=0.15)),
    # Transactions that create a name beside their append to a shard others write too,
    # refused by stale uppers, and Spark writes to new names (some jobs aborted), with
    # lost replies and pauses at the commit: each name is registered exactly when its
    # write landed.
    "naming": Profile({"transactor": (2, 3), "spark_naming_writer": (1, 1),
                       "compactor": (1, 1), "gc": (1, 2)},
                      nemesis=Nemesis(pause_at_cas=0.1, pause_then_lose=0.1),
                      naming_commits=True),
    # Several tables stored in one transaction (store_tables) racing single-table
    # stores of the same names, schema evolution and new generations, compaction that
    # advances the tables' times to their uppers, and GC, with lost replies and pauses
    # at the commit: each pair store lands in both tables or in neither.
    "tables": Profile({"pair_storer": (1, 3), "pair_checker": (1, 1), "compactor": (1, 1),
                       "gc": (1, 2)},
                      nemesis=Nemesis(pause_at_cas=0.1, pause_then_lose=0.05)),
}

#: The profiles seeds take in turn (``profile_for``). A profile added later is left out
#: (run it with ``--profile``): adding one would move every seed to another profile,
#: and the negative controls are checked at the seeds that catch them now.
ROTATION = ("mixed", "listen", "reads", "writes", "typed", "seams", "clocks",
            "transactions", "outages")


def profile_for(seed: int) -> str:
    return ROTATION[seed % len(ROTATION)]

#: Scheduler steps after the workload stops, for calls in flight to finish.
DRAIN_STEPS = 20_000


def sim_config(policy: InlinePolicy, cache_bytes: int) -> PersistConfig:
    """Short leases and deadlines, so pauses cross them often; no background threads."""
    return PersistConfig(
        inline_policy=policy, blob_target_size_bytes=16384, rollup_threshold=6,
        reader_lease_duration_s=6.0, heartbeat_interval_s=0, gc_orphan_min_age_s=8.0,
        blob_cache_bytes=cache_bytes, retry_deadline_s=20.0, listen_poll_interval_s=0.2,
        background_maintenance=False, read_fetch_threads=1,
        # Tiny, so the Spark driver splits merges by key range under every fault.
        compaction_split_bytes=64)


@dataclass
class SeedResult:
    seed: int
    steps: int
    ops: int
    lost_replies: int
    failed_calls: int
    pauses: int
    stalls: int
    crashes: int
    violations: list[str]
    outages: int = 0
    bad_reads: int = 0


class SimRun:
    """One seed's world: the stores, the monitor, the model and the simulated clients."""

    def __init__(self, seed: int, steps: int, nemesis: Nemesis | None = None,
                 profile: str | None = None) -> None:
        self.seed = seed
        self.profile = PROFILES[profile or profile_for(seed)]
        self.steps = steps
        self.rng = random.Random(seed)
        self.scheduler = Scheduler(self.rng, nemesis or self.profile.nemesis or Nemesis())
        self.clock = SimClock(self.scheduler)
        self.violations: list[str] = []
        self.policy = INLINE_SETTINGS[0 if self.profile.inline_max_choices
                                      else seed % len(INLINE_SETTINGS)]
        # Without a part cache every read goes to the store (and meets every delete).
        caches = (0, 1 << 16) if self.profile.part_cache else (0,)
        self.config = sim_config(self.policy, self.rng.choice(caches))
        self.shard = ""
        self.critical_id = ""
        self.monitors = Monitors(self.policy, self.violations)
        self.monitors.unrecorded_max_bytes = max((self.policy.max_bytes,
                                                  *self.profile.inline_max_choices))
        self.model = Model(self.violations)
        # Clock skew, a fault of its own: in these seeds every process (and each blob
        # store) has a wall clock off by up to well past half the orphan sweep's age.
        self.skewed = self.rng.random() < SKEW_SEEDS or self.profile.skewed
        self.consensus = SimConsensus(self.scheduler, self.monitors)
        self.main = SimBlob("main", self.scheduler, self.monitors, self._skew())
        self.wal = (SimBlob("wal", self.scheduler, self.monitors, self._skew())
                    if seed % 2 else None)
        self.monitors.stores.update({"main": self.main, **({"wal": self.wal} if self.wal
                                                           else {})})
        self.seams = SeamState()
        self.txns = transactions.TxnLedger()
        self.ingestion = ingestion.Ingestion()
        self.spark_blob_uri = f"sim://{seed}/main"
        self.spark_wal_uri = f"sim://{seed}/wal" if self.wal else None
        self.stopping = False
        self.ops = 0
        # How often simulated heartbeat threads renew leases (the library's own heartbeat
        # threads are off: they would run on OS threads, outside the scheduler).
        self.heartbeat_interval_s = self.rng.choice(self.profile.heartbeat_choices_s)
        self._processes = 0
        self._orphan_ages: dict[str, float] = {}
        self._inline_maxima: dict[str, int] = {}
        # Drawn apart from the seed's other choices, which stay as they were.
        self._age_rng = random.Random(seed + 0x5EED_A6E)
        self._inline_rng = random.Random(seed + 0x1_11E)
        #: Whether a grouped append races an expiry of its handle (drawn apart too).
        self.expiry_rng = random.Random(seed + 0xE_C91E)
        #: Whether a transactor's untyped append to a new shard races another process
        #: typing that shard (drawn apart too).
        self.typing_rng = random.Random(seed + 0x7_1BED)

    # --- for the actors ------------------------------------------------------------------

    def violation(self, text: str) -> None:
        self.violations.append(text)

    @property
    def monitor(self) -> Monitor:
        """The main (untyped) shard's monitor."""
        return self.monitors.get(self.shard)

    def client(self, proc: Process | None = None) -> PersistClient:
        """A client of process ``proc`` (on its own clocks and config), or of the driver."""
        if proc is None:
            return PersistClient(self.consensus, self.main, self.wal, self.config, self.clock)
        return PersistClient(self.consensus, self.main, self.wal, self.config_of(proc),
                             SimClock(self.scheduler, proc))

    def config_of(self, proc: Process) -> PersistConfig:
        """Process ``proc``'s config: the seed's, with its own orphan age and inline max
        if it drew them."""
        config = self.config
        age = self._orphan_ages.get(proc.name)
        if age is not None:
            config = replace(config, gc_orphan_min_age_s=age)
        most = self._inline_maxima.get(proc.name)
        if most is not None:
            config = replace(config, inline_policy=replace(config.inline_policy,
                                                           max_bytes=most))
        return config

    @property
    def longest_orphan_age_s(self) -> float:
        """The longest orphan age any process (or the driver) is configured with."""
        return max([self.config.gc_orphan_min_age_s, *self._orphan_ages.values()])

    def _skew(self) -> float:
        if not self.skewed:
            return 0.0
        return self.rng.choice(self.profile.skew_choices_s)

    def shards(self) -> list[str]:
        """Every shard of this seed that exists (the main one first; the others are
        the typed, scratch and table shards actors made): maintained and checked."""
        others = [s for s in self.monitors.by_shard if s != self.shard]
        return [self.shard, *(s for s in others if self.monitors.exists(s))]


    def think(self, scale: float = 1.0) -> None:
        self.clock.sleep(self.rng.expovariate(1.0 / (0.05 * scale)))

    def spawn(self, name: str, process: Process, body: Callable[[], None]) -> None:
        self.scheduler.spawn(name, process, self._guarded(name, body))

    def _guarded(self, name: str, body: Callable[[], None]) -> Callable[[], None]:
        """``body``, with a library error that escapes the thread recorded as a violation
        (an actor checks the errors it expects; any other one is a defect)."""
        def run() -> None:
            try:
                body()
            except PersistError as e:
                self.violation(f"thread {name}: uncaught {type(e).__name__}: {e}")

        return run

    def retry_open(self, open_: Callable[[], T]) -> T | None:
        """Open a handle, retrying while consensus is unavailable."""
        while not self.stopping:
            try:
                return open_()
            except Indeterminate:
                self.think()
            except PersistError as e:
                self.violation(f"opening a handle: unexpected {type(e).__name__}: {e}")
                return None
        return None

    def new_process(self, name: str) -> Process:
        """A process with its own clocks (skewed in skewed seeds)."""
        if self.profile.orphan_age_choices_s:
            self._orphan_ages[name] = self._age_rng.choice(self.profile.orphan_age_choices_s)
        if self.profile.inline_max_choices:
            self._inline_maxima[name] = self._inline_rng.choice(self.profile.inline_max_choices)
        return Process(name, wall_skew_s=self._skew(),
                       mono_origin_s=self.rng.uniform(0.0, 1e6))

    def start(self, role: str, delay_s: float = 0.0) -> None:
        self._processes += 1
        proc = self.new_process(f"{role}{self._processes}")
        body = ROLES[role]
        self.scheduler.spawn(proc.name, proc, self._guarded(proc.name, lambda: body(self, proc)),
                             delay_s)
        self._roles[proc.name] = role

    # --- the run -------------------------------------------------------------------------

    def run(self) -> SeedResult:
        self._roles: dict[str, str] = {}
        with ExitStack() as stack:
            stack.enter_context(seeded_ids(random.Random(self.seed)))
            stack.enter_context(lock_factory(lambda reentrant: SimLock(self.scheduler,
                                                                        reentrant)))
            stack.enter_context(event_factory(lambda: SimEvent(self.scheduler)))
            stack.enter_context(inline_workers())
            stack.enter_context(_seeded_jitter(self.seed))
            stack.enter_context(_spark_blobs(self))
            stack.enter_context(_spark_markers())
            self._setup()
            self._workload()
            self._final_checks()
        s = self.scheduler.stats
        return SeedResult(self.seed, s.steps, self.ops, s.lost_replies, s.failed_calls,
                          s.pauses, s.stalls, s.crashes, list(self.violations), s.outages,
                          s.bad_reads)

    def _setup(self) -> None:
        self.shard = str(ShardId.new())
        self.critical_id = new_critical_reader_id()
        setup = self.client()
        setup.open_writer(self.shard).stop_heartbeats()

    def _workload(self) -> None:
        s = self.scheduler
        crashed_roles: list[str] = []

        def restart_crashed() -> None:
            for task in list(s.tasks):
                if task.process.crashed and task.process.name in self._roles:
                    crashed_roles.append(self._roles.pop(task.process.name))
            while crashed_roles:
                self.start(crashed_roles.pop(), delay_s=self.rng.uniform(0.1, 2.0))

        for role, (least, most) in self.profile.cast.items():
            for _ in range(self.rng.randint(least, most)):
                self.start(role, delay_s=self.rng.uniform(0, 0.5))
        if self.profile.compaction and not any(
                r in self._roles.values() for r in ("compactor", "spark_compactor")):
            self.start("compactor")
        done = 0
        try:
            while done < self.steps:
                ran = s.run(min(50, self.steps - done))
                restart_crashed()
                if ran == 0:
                    break
                done += ran
            self.stopping = True
            s.run(DRAIN_STEPS)
        except SimDeadlock as e:
            # A liveness failure: a thread waits for a wake-up nobody will give.
            self.stopping = True
            self.violation(str(e))
        s.kill_all()

    def _final_checks(self) -> None:
        """With every client gone and faults off: the data, then a final GC, then leaks."""
        s = self.scheduler
        s.faults_enabled = False
        s.now += self.longest_orphan_age_s + self.config.reader_lease_duration_s + 1
        client = self.client()
        try:
            for shard in self.shards():
                client.gc(shard)
            if self.wal is not None and self.profile.final_wal_flush:
                self._flush_wal(client)
            seams.final_check(self, client)
            transactions.check(self, client, "final check")
            ingestion.check(self, client, "final check")
            upper = client._machine(self.shard).fetch_latest().upper
            if upper:
                reader = client.open_reader(self.shard)
                table = reader.snapshot(upper - 1)
                self.model.check(upper - 1, actors._rows(table), "final snapshot")
                reader.expire()
            for w in self.model.writes.values():
                if w.status == "pending":
                    w.status = "unknown"
            s.now += self.longest_orphan_age_s + 1
            for _ in range(2):
                for shard in self.shards():
                    client.gc(shard)
        except PersistError as e:
            self.violation(f"final check: unexpected {type(e).__name__}: {e}")
            return
        leaked = self.monitors.leaked()
        if leaked:
            self.violation(f"{len(leaked)} blobs leaked after the final GC, e.g. {leaked[0]}")


    def _flush_wal(self, client: PersistClient) -> None:
        """Compaction until nothing is pending moves every part out of the WAL store;
        the snapshots after it are checked against the model as before."""
        for shard in self.shards():
            for _ in range(3):
                if not client.compact(shard)["requests"]:
                    break
            state = client._machine(shard).fetch_latest()
            left = [p.key for b in state.batches.values() for p in b.hollow_parts()
                    if p.store == "wal"]
            if left:
                self.violation(f"final check: shard {shard} keeps {len(left)} part(s) in "
                               f"the WAL store after compaction ran until nothing was "
                               f"pending, e.g. {left[0]}")


@contextmanager
def _seeded_jitter(seed: int) -> Iterator[None]:
    state = retry.JITTER.getstate()
    retry.JITTER.seed(seed)
    try:
        yield
    finally:
        retry.JITTER.setstate(state)


@contextmanager
def _spark_markers() -> Iterator[None]:
    """Spark writes' commit markers in a folder of this seed's, removed after it (a
    simulated driver that crashes mid-commit leaves its marker, as a real one would)."""
    from persist_pipeline import spark_source

    previous = spark_source.MARKER_DIR
    with tempfile.TemporaryDirectory(prefix="persist-sim-") as folder:
        spark_source.MARKER_DIR = Path(folder)
        try:
            yield
        finally:
            spark_source.MARKER_DIR = previous


@contextmanager
def _spark_blobs(run: SimRun) -> Iterator[None]:
    """Executors open blob stores by URI: point the sim URIs at the simulated stores."""
    spark_driver._OPEN_BLOBS[run.spark_blob_uri] = run.main
    if run.wal is not None and run.spark_wal_uri:
        spark_driver._OPEN_BLOBS[run.spark_wal_uri] = run.wal
    try:
        yield
    finally:
        spark_driver._OPEN_BLOBS.pop(run.spark_blob_uri, None)
        if run.spark_wal_uri:
            spark_driver._OPEN_BLOBS.pop(run.spark_wal_uri, None)


#: The counters a seed reports and a batch sums.
_COUNTERS = ("steps", "ops", "lost_replies", "failed_calls", "pauses", "stalls", "crashes",
             "outages", "bad_reads")


@dataclass
class SimReport:
    """The outcome of a batch of seeds."""

    seeds: int = 0
    steps: int = 0
    ops: int = 0
    lost_replies: int = 0
    failed_calls: int = 0
    pauses: int = 0
    stalls: int = 0
    crashes: int = 0
    outages: int = 0
    bad_reads: int = 0
    seconds: float = 0.0
    failures: list[SeedResult] = field(default_factory=list)

    @property
    def violations(self) -> int:
        return sum(len(f.violations) for f in self.failures)

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    def line(self) -> str:
        return (f"seeds={self.seeds} steps={self.steps} ops={self.ops} "
                f"lost_replies={self.lost_replies} failed_calls={self.failed_calls} "
                f"pauses={self.pauses} stalls={self.stalls} crashes={self.crashes} "
                f"outages={self.outages} bad_reads={self.bad_reads} "
                f"violations={self.violations} "
                f"ops_per_s={self.ops_per_s:.0f}")

    def add(self, r: SeedResult) -> None:
        self.seeds += 1
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(r, name))
        if r.violations:
            self.failures.append(r)


def run_seed(seed: int, steps: int = 2000, nemesis: Nemesis | None = None,
             profile: str | None = None) -> SeedResult:
    """Run one seed (with its profile, or ``profile``); a seed always runs the same way."""
    return SimRun(seed, steps, nemesis, profile).run()


def run_seeds(seeds: list[int], steps: int = 2000, *, stop_at_first: bool = False,
              profile: str | None = None,
              progress: Callable[[SimReport], None] | None = None) -> SimReport:
    report = SimReport()
    started = time.monotonic()
    for seed in seeds:
        report.add(run_seed(seed, steps, profile=profile))
        report.seconds = time.monotonic() - started
        if progress is not None:
            progress(report)
        if stop_at_first and report.failures:
            break
    report.seconds = time.monotonic() - started
    return report


def describe(result: SeedResult, limit: int = 5) -> list[str]:
    out = [f"seed {result.seed}: {len(result.violations)} violation(s)"]
    out += [f"  {v}" for v in result.violations[:limit]]
    return out


__all__: list[Any] = ["SeedResult", "SimReport", "SimRun", "describe", "run_seed", "run_seeds"]
