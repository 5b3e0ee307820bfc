"""Simulated table stores of several tables in one transaction
(:func:`persist_pipeline.tables.store_tables`), racing single-table stores of the same
names (:func:`~persist_pipeline.tables.store_table`), schema evolution in place and new
generations, compaction that advances the tables' times to their uppers, and GC.

Every stored table carries a tag of its store in every row (a pair store's two tables
the same one), so a load tells which store wrote what it returns. The checks:

- a load returns exactly the table some store wrote under that name, never a mix, and
  never the table of a store that was refused (a refused ``store_tables`` changes none
  of its tables);
- a pair store is atomic: a load of one table showing it, followed by a load of the
  other, never finds there a store that had returned before the pair store began (the
  pair's own table, or a later one, must be there);
- a load pinned to the upper a store reported returns that store's table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from persist_pipeline.exceptions import (
    CommitDeadlineExceeded,
    Contended,
    Indeterminate,
    LeaseExpired,
    NotYetAvailable,
    PersistError,
    ShardNotFound,
    UpperMismatch,
)
from persist_pipeline.sim.scheduler import Process
from persist_pipeline.sim.seams import (
    _canonical,
    _load_and_check_pinned,
    _release_and_compact_table,
)

if TYPE_CHECKING:
    from persist_pipeline.client import PersistClient
    from persist_pipeline.sim.runner import SimRun

#: The two names every pair store writes together (single stores write one of them).
PAIR_NAMES = ("sim/pair/a", "sim/pair/b")

#: Outcomes whose effect is unknown: the store may or may not have landed.
_UNKNOWN = (Indeterminate, CommitDeadlineExceeded, LeaseExpired)


@dataclass
class TaggedStore:
    """One store call: the canonical rows it stored per name, its logical start and
    return (``ended`` None: still running, or its process died), and its outcome."""

    tables: dict[str, list[str]]
    started: int
    ended: int | None = None
    #: "running", "ok", "unknown" (it may have landed) or "refused" (it changed nothing).
    outcome: str = "running"


@dataclass
class PairLedger:
    stores: dict[str, TaggedStore] = field(default_factory=dict)
    events: int = 0
    tags: int = 0

    def event(self) -> int:
        self.events += 1
        return self.events


def _ledger(run: SimRun) -> PairLedger:
    ledger = run.seams.extra.get("pairs")
    if ledger is None:
        ledger = run.seams.extra["pairs"] = PairLedger()
    assert isinstance(ledger, PairLedger)
    return ledger


def _table(run: SimRun, tag: str) -> tuple[pa.Table, list[str] | None]:
    """A table of one to five rows, each carrying ``tag``: keyed by an int id, now and
    then with a nullable column added (its generation's schema evolves in place), a
    string id or no key (a new generation)."""
    rng = run.rng
    ids = rng.sample(range(8), rng.randint(1, 5))
    kind = rng.random()
    if kind < 0.1:  # a schema change: a string id, a new generation
        return pa.table({"id": pa.array([str(i) for i in ids], pa.string()),
                         "tag": [tag] * len(ids)}), ["id"]
    table = pa.table({"id": pa.array(ids, pa.int64()), "tag": [tag] * len(ids)})
    if kind < 0.2:  # no key: another generation too
        return table, None
    if kind >= 0.85:  # a nullable column appended: the generation evolves
        return table.append_column("tier", pa.array([i % 3 or None for i in ids],
                                                    pa.int64())), ["id"]
    return table, ["id"]


def pair_storer(run: SimRun, proc: Process) -> None:
    """Stores both tables in one ``store_tables``, or one of them alone, compacts a
    generation after releasing its times, and loads both to check them."""
    client = run.client(proc)
    while not run.stopping:
        run.think(scale=2.0)
        roll = run.rng.random()
        if roll < 0.4:
            _store_pair(run, client, proc.name)
        elif roll < 0.6:
            _store_one(run, client, proc.name)
        elif roll < 0.7:
            _release_and_compact_table(run, client, run.rng.choice(PAIR_NAMES))
        elif roll < 0.78 and run.seams.pinned:
            _load_and_check_pinned(run, client, run.rng.choice(run.seams.pinned))
        else:
            _load_both(run, client)
        run.ops += 1


def _new_store(run: SimRun, names: tuple[str, ...]) -> tuple[str, dict[str, tuple[
        pa.Table, list[str] | None]], TaggedStore]:
    ledger = _ledger(run)
    ledger.tags += 1
    tag = f"t{ledger.tags}"
    tables = {name: _table(run, tag) for name in names}
    entry = TaggedStore({n: _canonical(t) for n, (t, _) in tables.items()}, ledger.event())
    ledger.stores[tag] = entry
    return tag, tables, entry


def _store_pair(run: SimRun, client: PersistClient, debug: str) -> None:
    from persist_pipeline import tables as tables_module

    _, tables, entry = _new_store(run, PAIR_NAMES)
    try:
        stored = tables_module.store_tables(client, tables, debug=debug)
    except _UNKNOWN:
        entry.outcome = "unknown"
    except (UpperMismatch, Contended):
        # Documented refusals: none of the tables changed.
        entry.outcome = "refused"
    except PersistError as e:
        entry.outcome = "unknown"
        run.violation(f"store_tables: unexpected {type(e).__name__}: {e}")
    else:
        entry.outcome = "ok"
        for name, result in stored.items():
            if result.result.upper is not None:
                own = result.name if result.name != name else name + "/_v1"
                run.seams.pinned.append((own, result.result.upper, entry.tables[name]))
    entry.ended = _ledger(run).event()


def _store_one(run: SimRun, client: PersistClient, debug: str) -> None:
    """A single-table store of one of the names, racing the pair stores."""
    from persist_pipeline import tables as tables_module

    name = run.rng.choice(PAIR_NAMES)
    _, tables, entry = _new_store(run, (name,))
    table, keys = tables[name]
    try:
        tables_module.store_table(client, name, table, keys, debug=debug)
    except (*_UNKNOWN, UpperMismatch, Contended):
        # A single store may have landed in a generation a newer one then superseded.
        entry.outcome = "unknown"
    except PersistError as e:
        entry.outcome = "unknown"
        run.violation(f"store_table of {name}: unexpected {type(e).__name__}: {e}")
    else:
        entry.outcome = "ok"
    entry.ended = _ledger(run).event()


def _load(run: SimRun, client: PersistClient, name: str) -> TaggedStore | None:
    """The store whose table a load of ``name`` returned (checked to be exactly that
    table, of a store not refused); None when nothing was loaded."""
    from persist_pipeline import tables as tables_module

    try:
        got = tables_module.load_table(client, name)
    except (ShardNotFound, NotYetAvailable, Indeterminate, LeaseExpired):
        return None
    except PersistError as e:
        run.violation(f"load_table {name}: unexpected {type(e).__name__}: {e}")
        return None
    tags = set(got.column("tag").to_pylist()) if "tag" in got.column_names else set()
    if len(tags) != 1:
        run.violation(f"a load of {name} mixes stores (tags {sorted(map(str, tags))}): "
                      f"{got.to_pylist()[:4]}")
        return None
    tag = str(tags.pop())
    entry = _ledger(run).stores.get(tag)
    if entry is None or name not in entry.tables:
        run.violation(f"a load of {name} returned store {tag}, which never stored it")
        return None
    if _canonical(got) != entry.tables[name]:
        run.violation(f"a load of {name} returned store {tag}'s tag with other rows: "
                      f"{got.to_pylist()[:4]}")
    if entry.outcome == "refused":
        run.violation(f"a load of {name} returned the table of store {tag}, which was "
                      f"refused (a refused store_tables must change none of its tables)")
    return entry


def _load_both(run: SimRun, client: PersistClient) -> bool:
    """Load one table, then the other: once a pair store shows in the first, the second
    has that store's table or a later one's. Whether both loaded a table."""
    ledger = _ledger(run)
    first, second = PAIR_NAMES if run.rng.random() < 0.5 else PAIR_NAMES[::-1]
    seen = _load(run, client, first)
    loaded = ledger.event()
    other = _load(run, client, second)
    if seen is None or other is None:
        return False
    if second not in seen.tables:
        return True
    if other is not seen and other.ended is not None and other.ended < seen.started:
        tag = next(t for t, s in ledger.stores.items() if s is seen)
        was = next(t for t, s in ledger.stores.items() if s is other)
        run.violation(f"store_tables {tag} showed in {first} (by event {loaded}) but a "
                      f"later load of {second} returned store {was}, which had returned "
                      f"before {tag} began: the pair landed in one table only")
    return True


def pair_checker(run: SimRun, proc: Process) -> None:
    """Loads both tables, one after the other, often: a pair store seen in one table
    only is found while the other one's store is still on its way."""
    client = run.client(proc)
    while not run.stopping:
        # Slower until the first store landed: loads that find nothing take steps from
        # the stores.
        run.think(scale=0.5 if _load_both(run, client) else 4.0)
        run.ops += 1


ROLES = {"pair_storer": pair_storer, "pair_checker": pair_checker}
