"""Tables stored as typed shards: how a table is named, stored and read back exactly.

The Dagster IO manager (:mod:`persist_pipeline.dagster_io`) stores assets with these;
nothing here imports Dagster, so the simulation and any other client store and read
tables the same way.

**Schema.** A table's Arrow schema becomes a :class:`~persist_pipeline.ShardSchema` whose
columns have *storage* types the row codec stores natively, kept beside the original
schema (in the shard schema's metadata), so a load returns exactly the types, field
metadata and schema metadata (pandas' index and dtypes) that were stored:

- dictionary columns (pandas categoricals) are stored as their values, and
  dictionary-encoded again on load: an ordered one with its stored categories in their
  order (kept in the shard schema: other categories start a generation), an unordered
  one with the categories its rows use;
- maps are stored as lists of ``key``/``value`` structs (top-level map columns);
- ``float16`` is stored as ``float32`` (exactly), and a column of nulls only (Arrow's
  ``null`` type, e.g. an all-``None`` pandas column) as a nullable ``int8``; other
  writers' values that such a column cannot hold are refused
  (:meth:`~persist_pipeline.ShardSchema.conform`), so a load never changes them;
- every other type the codec supports is stored as it is (integers, floats, booleans,
  decimals, strings, binary, dates, times, timestamps with their time zone, durations,
  lists and structs of these). Anything else is refused with a clear error.

Column names the storage format reserves (``k``, ``v``, ``t``, ``d``) are stored under
another name and renamed back on load.

**Keys.** With declared key columns (output metadata ``{"primary_key": [...]}``) the
shard is keyed: each key has one row, a materialization replaces changed rows and
deletes absent keys, and nullable value columns may be appended later (recorded by the
store's own commit: a store that is refused leaves the schema, and so what loads
return, as it was). Without, the
whole row is the key and equal rows keep their multiplicity (a collection, like a SQL
table). Rows come back sorted by their encoding, not in the order they were stored.

**Names.** An asset's shard is named after its key (``sales/orders``); a partition's
after the key and the partition (``sales/orders/_partitions/2026-11-25``; a segment
with other characters than ``A-Z a-z 0-9 . _ -`` is written as ``-`` plus its UTF-8
bytes in hex; too long a name ends in a hash instead). No table is stored at a folder
of partitions (a name whose last segment is ``_partitions``, unless it is the partition
keyed so): a partition keyed ``_v2`` is no generation of one. A materialization whose
schema no longer fits the shard's starts the asset's next
*generation*, a new shard named with a ``/_v<N>`` suffix (``sales/orders/_v2``); loads
read the newest generation, and every materialization reports the name it wrote. A
table whose generation was closed (its upper set to the empty frontier) is closed for
good: a store is refused, whatever its schema, and loads keep reading it. A column of
Arrow's null type (only nulls: an empty partition's, pandas' all-None column) takes the
type the current generation stores for it (and pandas' dtype for it), so it does not
start a new generation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist_pipeline.exceptions import (
    Contended,
    CorruptPart,
    InvalidFrontier,
    InvalidInput,
    InvalidUpdates,
    NotATable,
    NotYetAvailable,
    ResourceExhausted,
    SchemaMismatch,
    ShardNameNotFound,
    ShardNotFound,
    SinceViolation,
    UpperMismatch,
)
from persist_pipeline.frontier import MAX_TIME
from persist_pipeline.ids import ShardId
from persist_pipeline.internal import rowcodec
from persist_pipeline.names import PARTITIONS_FOLDER, generation_of, is_partitions_folder
from persist_pipeline.plan import LATEST
from persist_pipeline.schema import (
    ARROW_SCHEMA_META,
    COLUMNS_META,
    DICTIONARY_META,
    RESERVED_COLUMNS,
    ShardSchema,
    categories_bytes,
    narrow_types,
)
from persist_pipeline.write import encode_contents

if TYPE_CHECKING:
    from persist_pipeline.client import PersistClient
    from persist_pipeline.write import WriteHandle, WriteResult

#: The most bytes of one ordered dictionary the shard schema keeps.
MAX_DICTIONARY_BYTES = 1 << 20
#: Where a name's generations live, and its partitions.
_GENERATION = "/_v"
_PARTITIONS = f"/{PARTITIONS_FOLDER}/"
_PLAIN = re.compile(r"[A-Za-z0-9._-]+")
#: Names are at most this long (see :func:`persist_pipeline.names.check_name`).
_NAME_MAX = 200


class UnsupportedOutput(InvalidInput, TypeError):
    """An output the IO manager cannot store: not a table or data frame, or a column
    type the shard codec has no encoding for (a union, a map inside another column)."""


# --- names --------------------------------------------------------------------------------


def _segment(text: str, *, reserved_start: str = "-") -> str:
    """``text`` as one name segment: itself when plain, else ``-`` and its UTF-8 hex."""
    if _PLAIN.fullmatch(text) and not text.startswith(tuple(reserved_start)):
        return text
    return "-" + text.encode("utf-8").hex()


def asset_shard_name(path: Sequence[str], partition: str | None = None) -> str:
    """The shard name of an asset key's ``path`` (and a partition): see the module.

    A path segment that is not plain (``A-Z a-z 0-9 . _ -``), or starts with ``_``
    (reserved for ``_partitions`` and generations) or ``-`` (the escape), is written as
    ``-`` plus its UTF-8 bytes in hex; so is such a partition key.
    """
    name = "/".join(_segment(p, reserved_start="_-") for p in path)
    if partition is not None:
        name += _PARTITIONS + _segment(partition)
    if len(name) > _NAME_MAX - 12:  # room for a generation suffix
        digest = hashlib.sha256(name.encode()).hexdigest()[:32]
        name = f"{name[:_NAME_MAX - 12 - 34]}/h{digest}"
    return name


#: A table name's room for its generation suffix (``/_v<N>``).
_GENERATION_ROOM = 12
_GENERATION_SEGMENT = re.compile(r"_v[0-9]+")


def check_table_name(name: str) -> None:
    """Whether a table may be stored under ``name``: a name whose last segment is
    ``_v<N>`` is a generation of another name (a load of that name would return this
    table), one whose last segment is ``_partitions`` is a folder of partitions (its
    generations would be partitions' tables), and a name must leave room for its own
    generations' suffix.

    Raises:
        InvalidInput: any of these is violated.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"a table name is a non-empty string, got {name!r}")
    base, _, last = name.rpartition("/")
    # A partition key (after /_partitions/) may read _v<N>: it is no generation, since
    # no table is stored at the name of the partitions folder itself (its generation
    # _v<N> would be that partition's table, stored over).
    if is_partitions_folder(name):
        raise InvalidInput(f"table name {name!r}: a last segment {PARTITIONS_FOLDER} names "
                           f"the folder of a partitioned table's partitions (each "
                           f"{name}/<key> is one); choose another name")
    if _GENERATION_SEGMENT.fullmatch(last) and not (base and is_partitions_folder(base)):
        raise InvalidInput(f"table name {name!r}: a last segment _v<N> names a generation "
                           f"of another table (its schema after a change); choose another "
                           f"name")
    if len(name) > _NAME_MAX - _GENERATION_ROOM:
        raise InvalidInput(f"table name {name[:40]!r}... is {len(name)} characters; a table "
                           f"name has at most {_NAME_MAX - _GENERATION_ROOM}, leaving room "
                           f"for the suffix of a later generation")


def generation_name(base: str, generation: int) -> str:
    """The name of ``base``'s generation ``generation`` (1 is ``base`` itself)."""
    return base if generation == 1 else f"{base}{_GENERATION}{generation}"


def generations(base: str, names: Mapping[str, object]) -> list[int]:
    """The generations of ``base`` registered in ``names``, in order.

    Only names :func:`generation_name` gives count: ``base/_v1`` (or ``base/_v02``)
    registered literally, as before such table names were refused, is another table."""
    found = [1] if base in names else []
    for name in names:
        generation = generation_of(name)
        if generation is not None and generation[0] == base:
            found.append(generation[1])
    return sorted(found)


# --- storing ------------------------------------------------------------------------------

#: How many generations one store tries before giving up (concurrent schema changes).
MAX_GENERATION_ATTEMPTS = 20


@dataclass(frozen=True)
class Stored:
    """What :func:`store_table` did: the write, and the generation's name and shard."""

    result: WriteResult
    name: str
    shard: ShardId
    #: Why the table went to a newer generation than the newest one when this store
    #: began (``name`` is that newer one), in words for a log line: what changed
    #: (:func:`generation_reason`). None when it went to the newest, or to the first.
    new_generation: str | None = None


def store_table(client: PersistClient, name: str, table: pa.Table,
                primary_key: Sequence[str] | None = None, *, debug: str = "") -> Stored:
    """Make the newest generation of ``name`` hold exactly ``table``, in one write
    (:meth:`~persist_pipeline.WriteHandle.replace_contents`); a table whose schema no
    longer fits it starts the next generation. Never an older generation: loads read
    the newest.

    Raises:
        UnsupportedOutput: a column type cannot be stored.
        InvalidInput: ``primary_key`` does not name columns of the table, or a key
            appears twice.
        InvalidFrontier: the table's newest generation is closed (for good).
        NotATable: the table does not fit the shard ``name`` names, and no table store
            wrote that shard (ingestion's, the CLI's): no generation follows it.
        Contended: other stores kept starting newer generations (or changing their
            schemas) for ``MAX_GENERATION_ATTEMPTS`` attempts; store it again.
    """
    check_table_name(name)
    table = _arrow_table(name, table)
    primary_key = key_columns(primary_key)
    names = client.shard_names()
    table = _typed_nulls(client, name, names, table)
    plan = storage_plan(table.schema, primary_key, ordered_dictionaries(table))
    # Refused before any generation is opened: a bad table never starts an empty one.
    rows = _encode(plan, table, primary_key)
    for _ in range(MAX_GENERATION_ATTEMPTS):
        _refuse_closed(client, name, names)
        writer, gen_name, shard, reason = _open_generation(client, name, plan, names, debug)
        try:
            stored = Stored(writer._replace_encoded(rows), gen_name, shard, reason)
        except SchemaMismatch:
            # Another store changed this generation's schema otherwise after it was
            # opened (nothing was written): open again, in the next generation.
            names = client.shard_names()
            continue
        finally:
            writer.expire()
        # Another store may have started a newer generation after the names were
        # listed: then this table went where no load reads, and is stored again there.
        names = client.shard_names()
        if not _superseded(name, gen_name, names):
            return stored
    raise Contended(f"{name}: newer generations kept starting while this table was "
                    f"stored ({MAX_GENERATION_ATTEMPTS} attempts)")


def store_tables(client: PersistClient,
                 tables: Mapping[str, tuple[pa.Table, Sequence[str] | None]], *,
                 debug: str = "") -> dict[str, Stored]:
    """:func:`store_table` for several names at once, in ONE transaction: every name's
    newest generation holds its table afterwards, or (on any error) none changed. A
    generation that another store supersedes after this one chose it refuses the
    transaction (see :func:`_seal`), which then opens its generations again: never one
    table committed where loads read it and another where they do not.

    Args:
        tables: each name's table and primary key (None: none).

    Raises:
        as :func:`store_table`; ``UpperMismatch`` if other writers kept replacing one
        of the tables past ``retry_deadline_s``.
    """
    if not tables:
        raise InvalidInput("store_tables needs at least one table")
    # Every table is checked before any generation is opened: a bad one changes nothing.
    encoded = {}
    names = client.shard_names()
    for name, entry in tables.items():
        check_table_name(name)
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise InvalidInput(f"{name}: store_tables takes a (table, primary_key) pair "
                               f"per name, got {type(entry).__name__}")
        table, primary_key = entry
        table = _arrow_table(name, table)
        primary_key = key_columns(primary_key)
        table = _typed_nulls(client, name, names, table)
        plan = storage_plan(table.schema, primary_key, ordered_dictionaries(table))
        encoded[name] = (plan, _encode(plan, table, primary_key))
    for _ in range(MAX_GENERATION_ATTEMPTS):
        for name in encoded:
            _refuse_closed(client, name, names)
            # Before any generation is opened: opening one names it (for good) and
            # creates its shard, which a refusal of a later table would leave behind.
            _refuse_foreign_newest(client, name, names)
        opened: list[WriteHandle] = []
        try:
            txn = client.transaction()
            where: dict[str, tuple[str, ShardId, str | None]] = {}
            for name, (plan, rows) in encoded.items():
                writer, gen_name, shard, reason = _open_generation(client, name, plan,
                                                                   names, debug)
                opened.append(writer)
                # All or none of the tables where loads read them: a generation
                # superseded meanwhile refuses the whole transaction (see _seal).
                txn._replace_encoded(writer, rows, _newest_check(client, name, gen_name))
                where[name] = (gen_name, shard, reason)
            results = txn.commit()
        except SchemaMismatch:
            # As store_table: a generation's schema changed otherwise after it was opened
            # (nothing was written): open them again.
            names = client.shard_names()
            continue
        finally:
            for writer in opened:
                writer.expire()
        # As store_table: a newer generation started meanwhile stores them all again.
        names = client.shard_names()
        if not any(_superseded(name, gen_name, names)
                   for name, (gen_name, _, _) in where.items()):
            return {name: Stored(results[str(shard)], gen_name, shard, reason)
                    for name, (gen_name, shard, reason) in where.items()}
    raise Contended(f"{sorted(tables)}: newer generations kept starting while these "
                    f"tables were stored ({MAX_GENERATION_ATTEMPTS} attempts)")


def _typed_nulls(client: PersistClient, name: str, names: Mapping[str, ShardId],
                 table: pa.Table) -> pa.Table:
    """``table`` with each column of Arrow's null type (all nulls, no type: an empty
    partition's, or pandas' all-None column) cast to the type the table's current
    generation stores for it, so that an output with nothing in a column keeps the
    table's generation instead of starting a new one."""
    nulls = [i for i, f in enumerate(table.schema) if pa.types.is_null(f.type)]
    if not nulls:
        return table
    shard = _newest_written(client, name, generations(name, names))
    if shard is None:
        return table
    try:
        recorded = client._machine(shard).fetch_latest().schema
    except ShardNotFound:
        return table
    found = original_schema(ShardSchema.from_bytes(recorded)) if recorded else None
    if found is None:
        return table
    stored = found[0]
    typed = []
    for i in nulls:
        field = table.schema.field(i)
        index = stored.get_field_index(field.name)
        if index < 0 or pa.types.is_null(stored.field(index).type) \
                or not stored.field(index).nullable:
            continue
        target = stored.field(index).with_name(field.name)
        try:
            column = table.column(i).cast(target.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            continue  # stored as it is: its own generation
        table = table.set_column(i, target, column)
        typed.append(field.name)
    return _pandas_types_from(table, stored, typed)


def _pandas_types_from(table: pa.Table, stored: pa.Schema, names: list[str]) -> pa.Table:
    """``table`` with pandas' description of the columns ``names`` (its dtype) taken
    from the ``stored`` schema's: pandas calls an empty object column ``empty``, which
    would make an output with no rows start a generation of its own."""
    doc, kept = _pandas_meta(table.schema), _pandas_meta(stored)
    if doc is None or kept is None or not names:
        return table
    for name in names:
        was = _pandas_columns(kept, name)
        for column in _pandas_columns(doc, name):
            if len(was) == 1:
                for key in ("pandas_type", "numpy_type", "metadata"):
                    column[key] = was[0].get(key)
    return table.replace_schema_metadata({**(table.schema.metadata or {}),
                                          _PANDAS_META: json.dumps(doc).encode()})


def _encode(plan: StoragePlan, table: pa.Table, primary_key: Sequence[str] | None
            ) -> pa.Table:
    """``table`` as a shard's whole contents; a declared primary key holds once per row.

    Keys with value columns are checked by :func:`encode_contents`; a key made of every
    column is stored like a table without a key (a collection, where repeated rows keep
    their count), so its declared uniqueness is checked here.

    Raises:
        InvalidUpdates: a key appears twice.
    """
    rows = encode_contents(plan.shard_schema, to_storage(table, plan))
    if primary_key and not plan.shard_schema.value and \
            pc.count_distinct(rows.column("k")).as_py() != rows.num_rows:
        raise InvalidUpdates(f"primary_key {list(primary_key)}: a key appears more than "
                             "once in the table")
    return rows


def _superseded(name: str, gen_name: str, names: Mapping[str, object]) -> bool:
    """Whether ``name`` has a generation newer than ``gen_name`` (loads read that one)."""
    current = 1 if gen_name == name else int(gen_name[len(name) + len(_GENERATION):])
    found = generations(name, names)
    return bool(found) and found[-1] > current


def _refuse_closed(client: PersistClient, name: str, names: Mapping[str, ShardId]) -> None:
    """Refuse to store under ``name`` when the generation its loads read (the newest
    that holds a table) is closed.

    Closed is for good: the table is refused whatever the schema, rather than moved to a
    new generation, which a schema change would otherwise start (and which would leave
    every load by ``upper`` ambiguous, a closed generation having reached every upper).

    Raises:
        InvalidFrontier: that generation's shard is closed; nothing was changed.
    """
    for generation in reversed(generations(name, names)):
        gen_name = generation_name(name, generation)
        upper = _stored_upper(client, names[gen_name])
        if upper is None:
            raise InvalidFrontier(
                f"table {name!r} is closed: its generation {gen_name!r} (shard "
                f"{names[gen_name]}) has the empty upper, so it takes no more writes and "
                f"starts no new generation; store the table under another name")
        if upper != 0:
            return  # a generation named but not written yet is skipped, as loads do


def _open_generation(client: PersistClient, name: str, plan: StoragePlan,
                     names: Mapping[str, ShardId], debug: str
                     ) -> tuple[WriteHandle, str, ShardId, str | None]:
    """A writer of the newest generation of ``name`` that stores ``plan``'s schema
    exactly (a table whose schema no longer fits starts the next generation); with the
    generation's name and shard, and why it is not the newest one listed (None: it is,
    or there was none)."""
    found = generations(name, names)
    generation = found[-1] if found else 1
    reason: str | None = None
    for _ in range(MAX_GENERATION_ATTEMPTS):
        gen_name = generation_name(name, generation)
        # Through the registry itself: the client's resolve keeps generation names for
        # table stores like this one.
        shard = client.name_registry.resolve(gen_name, create=True)
        try:
            # The schema is recorded by the store's own commit: a refused store leaves
            # the generation's schema (and so its loads) as they were.
            writer = client._open_table_writer(shard, plan.shard_schema, debug=debug)
        except SchemaMismatch:
            _refuse_foreign(client, gen_name, shard, None)
            # Keys or types changed: a new generation, a new shard.
            reason = reason or generation_reason(client.schema(shard), plan.shard_schema)
            generation = generation + 1
            continue
        if writer.schema is None or not same_storage(writer.schema, plan.shard_schema):
            # Same columns with other metadata, or fewer value columns: a load must
            # return exactly this table, so it goes to a generation of its own.
            reason = reason or generation_reason(writer.schema, plan.shard_schema)
            writer.expire()
            _refuse_foreign(client, gen_name, shard, writer.schema)
            generation = generation + 1
            continue
        if generation > 1 and _stored_upper(client, shard) == 0:
            # This store may be the first to write the generation: the one before it is
            # moved first (see _seal), after this one was registered.
            previous = client.name_registry.lookup(generation_name(name, generation - 1))
            if previous is not None:
                _seal(client, previous)
        return writer, gen_name, shard, reason
    raise Contended(f"{name}: could not settle on a generation for this table's schema "
                    f"in {MAX_GENERATION_ATTEMPTS} attempts (its schema keeps changing)")


def _seal(client: PersistClient, shard: ShardId) -> None:
    """Move the upper of a generation that a newer one (registered before this is
    called) supersedes, without changing its contents: a ``store_tables`` that read it
    before can then no longer commit into it.

    Its commit would land where no load reads, while its other tables' commits land
    where loads read: half of one transaction visible (and all of it, if its store made
    again in the newest generation were refused). Loads read a newer generation only
    once it was written, and every store that may be the first to write one moves the
    one before it first (two such stores move it twice), after the newer one was
    registered. A store of several tables checks that each generation it writes is the
    newest registered after each read it plans on (``_newest_check``): a read that
    passed came before that registration, so its commit, expecting the upper it read,
    is refused once the newer generation can have been written. An upper moved by
    anyone since it was read here does the same: nothing more to do then. A closed
    generation takes no commit at all, and one never written (upper 0) is left so:
    moved, loads would take it for written.
    """
    writer = client.open_writer(shard, debug="table generation superseded")
    try:
        upper = writer.fetch_recent_upper()
        if upper:
            with contextlib.suppress(UpperMismatch):
                writer.compare_and_append([], upper, upper + 1)
    finally:
        writer.expire()


def _newest_check(client: PersistClient, name: str, gen_name: str) -> Callable[[], None]:
    """A check, run by a transaction's replace after each read of ``gen_name``'s shard,
    that refuses the transaction (``SchemaMismatch``, which makes ``store_tables`` open
    its generations again) once a newer generation of ``name`` is registered."""
    def check() -> None:
        if _superseded(name, gen_name, client.shard_names()):
            raise SchemaMismatch(f"{name}: a newer generation than {gen_name!r} was "
                                 "started while this table was stored")
    return check


def _refuse_foreign_newest(client: PersistClient, name: str,
                           names: Mapping[str, ShardId]) -> None:
    """Refuse, before anything is named or created, a store under ``name`` whose newest
    generation is a shard no table store wrote: :func:`_open_generation` would refuse
    it (:func:`_refuse_foreign`), after opening the generations of the tables before it.

    Raises:
        NotATable: as :func:`_refuse_foreign`; nothing was changed.
    """
    found = generations(name, names)
    if not found:
        return
    gen_name = generation_name(name, found[-1])
    shard = names[gen_name]
    try:
        recorded = client.schema(shard)
    except ShardNotFound:
        return  # named by a store that died before creating it
    if recorded is None and _stored_upper(client, shard) == 0:
        return  # named, not written yet: any table store takes it
    _refuse_foreign(client, gen_name, shard, recorded)


def _refuse_foreign(client: PersistClient, gen_name: str, shard: ShardId,
                    recorded: ShardSchema | None) -> None:
    """Refuse to start a generation after ``gen_name`` when its shard is not a table
    store's (ingestion's, the CLI's, a Spark write's: untyped, or typed without a
    table's schema). Generations are a table's own schema changes: a next one would
    make every table load of the name (an ``ingest/NAME`` input among them) read the
    new table instead of the shard that ingestion writes and the CLI and read plans
    read under that name.

    Raises:
        NotATable: the shard is not a table store's; nothing was changed.
    """
    if recorded is None:
        recorded = client.schema(shard)
    if recorded is not None and original_schema(recorded) is not None:
        return
    what = "untyped updates" if recorded is None else "a typed shard no table store wrote"
    raise NotATable(
        f"{gen_name!r} names shard {shard}, which holds {what} (ingestion, the CLI, a "
        "Spark write): a table is not stored over it, since table loads of the name would "
        "then read the table instead of that shard; store the table under another name "
        "(another asset key, or definition metadata dagster/table_name)")


def load_table(client: PersistClient, name: str, upper: int | None = None, *,
               what: str = "") -> pa.Table:
    """The table stored under ``name`` (its newest generation): its latest version, or
    the one whose write left its generation's upper at ``upper`` (the one generation
    that reached it; a generation's own name loads that generation, and the first
    generation's is ``name + "/_v1"``).

    Raises:
        ShardNameNotFound: no generation of ``name`` exists.
        NotYetAvailable: nothing was stored yet.
        InvalidInput: ``upper`` is beyond the shard's upper or not positive, or several
            generations reached it (load one by its name), or a row's count is
            negative. A typed shard no table store wrote loads as the table of its key
            and value columns, an untyped one as its ``k`` and ``v`` bytes.
        SinceViolation: ``upper`` is so old that compaction merged it away.
        ResourceExhausted: the rows' counts make a table of more rows than this process
            can hold (other writers' diffs: any 64-bit count); nothing changed.
    """
    what = what or name
    names = client.shard_names()
    first = _first_generation(name, names)
    found = [1] if first is not None else generations(name, names)
    if not found:
        raise ShardNameNotFound(f"{what}: no shard is named {name!r}")
    shard = first or client.resolve(generation_name(name, found[-1]))
    if upper is not None and len(found) > 1:
        shard = _generation_at(client, name, found, upper, what, names)
    elif len(found) > 1 and _stored_upper(client, shard) == 0:
        # A generation started by a store that never committed (its process died after
        # naming it) holds nothing yet: the table is still the previous one.
        shard = _newest_written(client, name, found) or shard
    # Before a reader is opened: a generation named by a store that died before creating
    # its shard holds nothing yet (NotYetAvailable), as an empty one does.
    as_of = as_of_upper(client, shard, upper, what)
    reader = client.open_reader(shard, debug="table load")
    try:
        # Decoded with the schema of the state the snapshot read: a store evolving the
        # schema meanwhile must not make the newer one decode the older rows.
        try:
            typed, schema = reader._snapshot_with_schema(_read_at(as_of, upper))
        except SinceViolation:
            # Readers released every time up to the upper (since == upper): no time
            # below it is exact, but the latest table is every update's sum, and so is
            # a version pinned at an upper no update was written at or after: the one
            # the last write left, also once empty appends moved the upper on (the seal
            # of a generation that a newer one passed).
            typed, schema, written = reader._contents_with_schema()
            if upper is not None and written > upper:
                raise
        if upper is not None and schema is not None:
            # The version a pinned load asks for has the columns it was stored with,
            # not those a later evolution appended (a prefix of them).
            stored = schema.as_of(as_of)
            if stored is not schema:
                typed = typed.select([*stored.columns, "t", "d"])
                schema = stored
    finally:
        reader.expire()
    if schema is None:
        # An untyped shard (the CLI's append, ingestion): its k and v bytes, as every
        # other entry point reads it.
        return _rows_by_count(typed).select(["k", "v"])
    return from_storage(typed, schema)


def _read_at(as_of: int, upper: int | None) -> int | str:
    """What a load reads at: a pinned load at ``as_of``; the latest at the upper of the
    very state whose schema decodes it (``"latest"``). An as_of looked up in an earlier
    state reads that older version, and a store evolving the schema in between would
    decode it with columns no store wrote it with: a table never stored."""
    return as_of if upper is not None else LATEST


def _rows_by_count(snapshot: pa.Table) -> pa.Table:
    """A consolidated snapshot's rows, each repeated ``d`` times (a table's rows).

    Raises:
        NotATable: a row's count is negative (retractions without rows).
    """
    counts = snapshot.column("d").to_numpy()
    if len(counts) and (counts.min() < 1):
        raise NotATable("the shard holds retractions without rows (a negative count), "
                           "which no table has")
    if len(counts) and counts.max() > 1:
        snapshot = _repeated(snapshot, counts)
    return snapshot


#: The most rows a load expands counts into: one int64 index per row must be
#: addressable (beyond it NumPy refuses the size with a ValueError, not a memory error).
_MAX_LOAD_ROWS = np.iinfo(np.intp).max // np.dtype(np.int64).itemsize


def _repeated(snapshot: pa.Table, counts: np.ndarray) -> pa.Table:
    """``snapshot``'s rows, each ``counts`` times.

    Raises:
        ResourceExhausted: the table would have more rows than this process can hold.
            Any 64-bit count is a valid diff (the API, the CLI and ingestion store
            them), so this is a limit of loading, not a problem of the shard.
    """
    # Exact: 64-bit counts may sum beyond 64 bits, where NumPy's sum would wrap.
    total = int(counts.sum()) if counts.max() <= _MAX_LOAD_ROWS // len(counts) \
        else sum(counts.tolist())
    try:
        if total > _MAX_LOAD_ROWS:
            raise MemoryError("beyond the addressable size")
        return snapshot.take(pa.array(np.repeat(np.arange(len(counts)), counts)))
    except MemoryError as e:
        raise ResourceExhausted(f"the shard's counts make a table of {total} rows, more than "
                                f"this process can hold ({e}); read it with a snapshot "
                                f"(rows with their counts) instead") from None


def _first_generation(name: str, names: Mapping[str, ShardId]) -> ShardId | None:
    """The shard of the first generation of a table when ``name`` names it explicitly
    (``base/_v1``: the first generation's own name is its base's, which loads the newest
    generation), unless ``name`` is registered as it is (a table stored under such a
    name before those were refused)."""
    suffix = _GENERATION + "1"
    if name in names or not name.endswith(suffix) \
            or is_partitions_folder(name[:-len(suffix)]):
        return None  # (the partition _v1 of a partitioned table: no generation)
    return names.get(name[:-len(suffix)])


def _newest_written(client: PersistClient, name: str, found: list[int]) -> ShardId | None:
    """The newest generation of ``name`` that holds a stored table, if any."""
    for generation in reversed(found):
        shard = client.resolve(generation_name(name, generation))
        if _stored_upper(client, shard) != 0:
            return shard
    return None


def _stored_upper(client: PersistClient, shard: ShardId) -> int | None:
    """A generation's upper; 0 when its shard was named but never created (the store
    that named it died first)."""
    try:
        upper: int | None = client.inspect(shard)["upper"]
    except ShardNotFound:
        return 0
    return upper


def _generation_at(client: PersistClient, name: str, found: list[int], upper: int,
                   what: str, registered: Mapping[str, ShardId]) -> ShardId:
    """The shard of the one generation of ``name`` whose write can have left its upper at
    ``upper``. Uppers count each generation's writes from its start, so after a schema
    change two generations may both have passed ``upper``: then which one reported it
    cannot be told, and the load is refused rather than return another version."""
    reached = []
    for generation in found:
        shard = client.resolve(generation_name(name, generation))
        current = _stored_upper(client, shard)
        if current is None or current >= upper:
            reached.append((generation, shard))
    if not reached:
        return client.resolve(generation_name(name, found[-1]))  # as_of_upper says why
    if len(reached) > 1:
        # Each generation by its own name: the first one's is base/_v1 (base itself
        # names them all).
        first = name + _GENERATION + "1"
        names = [generation_name(name, g) if g > 1 else first for g, _ in reached]
        if first in registered:
            # Registered literally (before such table names were refused): another
            # table, which a load of that name returns.
            how = (f"the first generation ({name!r}) has no name of its own: {first!r} "
                   f"is another table")
            names[0] = name
        else:
            how = f"the first generation's is {first!r}"
        raise InvalidInput(
            f"{what}: upper {upper} is ambiguous: the generations {names} (a schema change "
            f"starts a new one) all reached it; load the one the materialization wrote "
            f"by that generation's name (its dagster/table_name; {how}), e.g. "
            f"load_table(client, {names[-1]!r}, {upper})")
    return reached[0][1]


def as_of_upper(client: PersistClient, shard: str | ShardId, upper: int | None,
                what: str) -> int:
    """The time to read what the write that left the shard's upper at ``upper`` stored
    (None: the latest)."""
    current = _stored_upper(client, ShardId.parse(shard))
    if current == 0:
        raise NotYetAvailable(f"{what}: nothing stored yet (shard {shard})")
    if upper is not None:
        if isinstance(upper, bool) or not isinstance(upper, int) or upper < 1 \
                or (current is not None and upper > current):
            bound = "a positive integer" if current is None else f"an integer in [1, {current}]"
            raise InvalidInput(f"{what}: input metadata upper={upper!r} must be {bound} "
                               f"(the shard's upper)")
        return upper - 1
    # A closed shard (no upper) is complete at every time: its latest version is there.
    return MAX_TIME if current is None else int(current) - 1


# --- schemas ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoragePlan:
    """How one table schema is stored: the shard schema, and the table's original one."""

    shard_schema: ShardSchema
    original: pa.Schema
    storage_names: tuple[str, ...]


def _storage_type(type_: pa.DataType, where: str, top: bool) -> pa.DataType:
    if pa.types.is_dictionary(type_):
        return _storage_type(type_.value_type, where, top)
    if pa.types.is_map(type_):
        if not top:
            raise UnsupportedOutput(f"{where}: a map inside another column cannot be stored "
                                   f"(only top-level map columns)")
        return pa.list_(pa.struct([
            pa.field("key", _storage_type(type_.key_type, f"{where}.key", False), False),
            pa.field("value", _storage_type(type_.item_type, f"{where}.value", False))]))
    if pa.types.is_float16(type_):
        return pa.float32()
    if pa.types.is_null(type_):  # a column of nulls only (e.g. all None in pandas)
        return pa.int8()
    if pa.types.is_struct(type_):
        return pa.struct([pa.field(f.name, _storage_type(f.type, f"{where}.{f.name}", False),
                                   f.nullable) for f in type_])
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        item = _storage_type(type_.value_type, f"{where}[]", False)
        return pa.list_(item) if pa.types.is_list(type_) else pa.large_list(item)
    return type_


def ordered_dictionaries(table: pa.Table) -> dict[str, pa.Array]:
    """The dictionary of each top-level *ordered* dictionary column of ``table`` (a pandas
    ordered categorical): its categories and their order are part of its type, so
    they are kept in the shard schema.

    Raises:
        UnsupportedOutput: the column's chunks have different dictionaries (their order
            is ambiguous).
    """
    out: dict[str, pa.Array] = {}
    for field, column in zip(table.schema, table.columns, strict=True):
        type_ = field.type
        if not (pa.types.is_dictionary(type_) and type_.ordered):
            continue
        dictionaries = [chunk.dictionary for chunk in column.chunks]
        if not dictionaries:
            out[field.name] = pa.array([], type_.value_type)
            continue
        if any(not d.equals(dictionaries[0]) for d in dictionaries[1:]):
            raise UnsupportedOutput(f"column {field.name!r} is an ordered dictionary whose "
                                    f"chunks have different dictionaries: their order is "
                                    f"ambiguous (combine them into one first)")
        out[field.name] = dictionaries[0]
    return out


def _arrow_table(name: str, table: object) -> pa.Table:
    """Guarantee 7: a store of something that is not a ``pyarrow.Table`` (a record
    batch is taken as one) gets a typed error before anything is named or written (not an
    AttributeError from within)."""
    if isinstance(table, pa.RecordBatch):
        return pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise InvalidInput(f"{name}: a table store takes a pyarrow.Table, got "
                           f"{type(table).__name__}")
    return table


def key_columns(primary_key: str | Sequence[str] | None) -> list[str] | None:
    """``primary_key`` as a list of column names: one string is ONE column name.

    Guarantee 13: the key a table is stored with means the same at every entry point.
    The IO manager's output metadata reads ``"id"`` as the column ``id``; iterating a
    string here would key a table by the columns ``i`` and ``d`` instead (or by the
    wrong columns, silently, where one-letter columns exist).

    Raises:
        InvalidInput: ``primary_key`` is neither a string nor a sequence of strings.
    """
    if primary_key is None:
        return None
    if isinstance(primary_key, str):
        return [primary_key]
    if isinstance(primary_key, bytes | bytearray) or not isinstance(primary_key, Sequence) \
            or not all(isinstance(c, str) for c in primary_key):
        raise InvalidInput(f"primary_key must be a column name or a sequence of them, "
                           f"got {primary_key!r}")
    return list(primary_key)


def storage_plan(schema: pa.Schema, primary_key: Sequence[str] | None = None,
                 dictionaries: Mapping[str, pa.Array] | None = None) -> StoragePlan:
    """The shard schema that stores tables of ``schema`` (keyed by ``primary_key``), with
    the ``dictionaries`` of its ordered dictionary columns (:func:`ordered_dictionaries`).

    Raises:
        UnsupportedOutput: a column type cannot be stored.
        InvalidInput: a primary key column is not in the table, or repeated, or there
            is no column at all.
    """
    if not len(schema):
        raise UnsupportedOutput("a table without columns cannot be stored")
    names = schema.names
    if len(set(names)) != len(names):
        raise UnsupportedOutput(f"the table repeats a column name: {names}")
    keys = key_columns(primary_key) or []
    unknown = [k for k in keys if k not in names]
    if unknown or len(set(keys)) != len(keys):
        raise InvalidInput(f"primary_key {keys} must name distinct columns of the table "
                           f"{names}")
    storage_names = tuple(_storage_name(i, n, names) for i, n in enumerate(names))
    fields = []
    for field, stored in zip(schema, storage_names, strict=True):
        type_ = _storage_type(field.type, f"column {field.name!r}", True)
        try:
            rowcodec.check_type(type_, f"column {field.name!r}")
        except InvalidUpdates as e:
            raise UnsupportedOutput(str(e)) from None
        fields.append(pa.field(stored, type_, field.nullable))
    by_name = dict(zip(names, fields, strict=True))
    key_fields = [by_name[k] for k in keys] if keys else fields
    value_fields = [f for n, f in zip(names, fields, strict=True) if n not in keys] \
        if keys else []
    kept = _kept_schema(schema)
    metadata = {ARROW_SCHEMA_META: bytes(kept.serialize().to_pybytes()),
                COLUMNS_META: json.dumps(list(storage_names)).encode()}
    for name, dictionary in (dictionaries or {}).items():
        stored = storage_names[names.index(name)]
        raw = categories_bytes(dictionary)
        if len(raw) > MAX_DICTIONARY_BYTES:
            raise UnsupportedOutput(
                f"column {name!r} is an ordered categorical whose categories take "
                f"{len(raw)} bytes; the shard schema keeps them (in every state rollup), "
                f"up to {MAX_DICTIONARY_BYTES}: store it unordered, or its codes beside a "
                f"table of the categories")
        metadata[DICTIONARY_META + stored.encode()] = raw
    return StoragePlan(ShardSchema(key_fields, value_fields, metadata), schema, storage_names)


#: pandas' metadata in an Arrow schema (its index, column dtypes).
_PANDAS_META = b"pandas"


def _pandas_meta(schema: pa.Schema) -> dict[str, object] | None:
    raw = (schema.metadata or {}).get(_PANDAS_META)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _index_entries(doc: dict[str, object] | None) -> list[object]:
    """pandas' index descriptions: a stored column's name, or a RangeIndex's dict."""
    found = doc.get("index_columns") if doc is not None else None
    return found if isinstance(found, list) else []


def _range_indexes(doc: dict[str, object]) -> list[dict[str, object]]:
    return [d for d in _index_entries(doc) if isinstance(d, dict) and d.get("kind") == "range"]


def pandas_index_columns(schema: pa.Schema) -> list[str]:
    """The columns of ``schema`` that hold a pandas DataFrame's index (its metadata)."""
    return [c for c in _index_entries(_pandas_meta(schema)) if isinstance(c, str)]


def _kept_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` as the shard schema keeps it: without what one output has and the next
    may not, which would make every such output start a generation (a new shard):

    - the stop of each pandas RangeIndex (the row count; loads make it from the rows
      they return, :func:`_range_stops_set`);
    - an unordered dictionary column's index width and pandas' count of its categories
      and width of its codes (all follow the categories its rows use): kept as 32-bit
      indices;
    - the versions of pandas and pyarrow that wrote pandas' metadata (``pandas_version``,
      ``creator.version``; pyarrow never reads them back), and the dtype of string column
      *labels* (``column_indexes``: ``object`` in pandas 2, ``str`` in pandas 3; pyarrow
      gives labels the loading pandas' own string dtype either way), which would make an
      upgrade of either start a generation of every pandas-made table.

    Returns ``schema`` itself when there is nothing to leave out."""
    doc = _pandas_meta(schema)
    changed = False
    if doc is not None:
        if doc.get("pandas_version") is not None:
            doc["pandas_version"] = None
            changed = True
        creator = doc.get("creator")
        if isinstance(creator, dict) and creator.get("version") is not None:
            creator["version"] = None
            changed = True
        labels = doc.get("column_indexes")
        for level in labels if isinstance(labels, list) else []:
            if isinstance(level, dict) and level.get("pandas_type") == "unicode" \
                    and level.get("numpy_type") == "str":
                level["numpy_type"] = "object"
                changed = True
    for d in _range_indexes(doc) if doc is not None else []:
        if d.get("stop") is not None:
            d["stop"] = None
            changed = True
    fields = []
    for field in schema:
        type_ = field.type
        if pa.types.is_dictionary(type_) and not type_.ordered:
            if not type_.index_type.equals(pa.int32()):
                field = field.with_type(pa.dictionary(pa.int32(), type_.value_type))
                changed = True
            for column in _pandas_columns(doc, field.name):
                meta = column.get("metadata")
                if isinstance(meta, dict) and meta.get("num_categories") is not None:
                    meta["num_categories"] = None
                    changed = True
                if column.get("numpy_type") not in (None, "int32"):
                    column["numpy_type"] = "int32"  # the codes' width
                    changed = True
        fields.append(field)
    if not changed:
        return schema
    metadata = dict(schema.metadata or {})
    if doc is not None:
        metadata[_PANDAS_META] = json.dumps(doc).encode()
    return pa.schema(fields, metadata=metadata)


def _pandas_columns(doc: dict[str, object] | None, name: str) -> list[dict[str, object]]:
    """pandas' entries for the column ``name`` in its metadata ``doc``."""
    found = doc.get("columns") if doc is not None else None
    return [c for c in found if isinstance(c, dict) and c.get("field_name") == name] \
        if isinstance(found, list) else []


def _range_stops_set(schema: pa.Schema, num_rows: int) -> pa.Schema:
    """``schema`` with each pandas RangeIndex ending after ``num_rows`` rows."""
    doc = _pandas_meta(schema)
    ranges = _range_indexes(doc) if doc is not None else []
    if doc is None or not ranges:
        return schema
    for d in ranges:
        start, step = d.get("start"), d.get("step")
        if isinstance(start, int) and isinstance(step, int):
            d["stop"] = start + step * num_rows
    return schema.with_metadata({**(schema.metadata or {}),
                                 _PANDAS_META: json.dumps(doc).encode()})


def generation_reason(recorded: ShardSchema | None, planned: ShardSchema) -> str:
    """What makes a table stored as ``planned`` unfit for a generation that records
    ``recorded``, in words for a log line (a table store starts a new generation then:
    a new shard). The pandas index counts: a filtered frame's index is a column, an
    unfiltered one's a RangeIndex, and a RangeIndex's start and step are kept."""
    if recorded is None:
        return "the generation records no schema"
    old, new = original_schema(recorded), original_schema(planned)
    if old is None or new is None:
        return "the shard was written by another entry point than a table store"
    old_index, new_index = _index_description(old[0]), _index_description(new[0])
    index_columns = set(pandas_index_columns(old[0])) | set(pandas_index_columns(new[0]))
    old_types = {f.name: f.type for f in old[0] if f.name not in index_columns}
    new_types = {f.name: f.type for f in new[0] if f.name not in index_columns}
    changes = []
    # A table without a primary key has every column as its key: a column added to it
    # is reported as that, not as a key change.
    if (len(recorded.value) or len(planned.value)) and recorded.key.names != planned.key.names:
        changes.append(f"primary key {_declared_key(recorded)} -> {_declared_key(planned)}")
    added = [n for n in new_types if n not in old_types]
    dropped = [n for n in old_types if n not in new_types]
    if added:
        changes.append(f"columns added: {', '.join(added)}")
    if dropped:
        changes.append(f"columns dropped: {', '.join(dropped)}")
    changes += [f"column {n}: {old_types[n]} -> {t}" for n, t in new_types.items()
                if n in old_types and not old_types[n].equals(t)]
    if old_index != new_index:
        changes.append(f"pandas index {old_index} -> {new_index} (reset_index(drop=True) "
                       f"in the asset keeps one)")
    return "; ".join(changes) if changes else \
        "other schema metadata (column order, nullability, pandas dtypes or field metadata)"


def _declared_key(schema: ShardSchema) -> str:
    """A table shard's declared primary key, or that its whole row is the key (a key
    of every column is stored as no key is)."""
    return f"({', '.join(schema.key.names)})" if len(schema.value) else "none (the whole row)"


def _index_description(schema: pa.Schema) -> str:
    """A table's pandas index in words: ``RangeIndex(start=0, step=1)``, its columns,
    or none (not a pandas frame)."""
    doc = _pandas_meta(schema)
    entries = _index_entries(doc)
    if not entries:
        return "none"
    shown = []
    for entry in entries:
        if isinstance(entry, dict):
            shown.append(f"RangeIndex(start={entry.get('start')}, step={entry.get('step')})")
        else:
            shown.append(f"an Index stored as column {entry!r}")
    return ", ".join(shown)


def same_storage(recorded: ShardSchema, planned: ShardSchema) -> bool:
    """Whether a shard's recorded schema stores tables of ``planned``'s: equal, or equal
    once what an earlier version kept of one output (:func:`_kept_schema`) is left
    out."""
    if recorded == planned:
        return True
    found = original_schema(recorded)
    if found is None:
        return False
    cleared = _kept_schema(found[0])
    if cleared is found[0]:
        return False
    metadata = {**recorded.metadata,
                ARROW_SCHEMA_META: bytes(cleared.serialize().to_pybytes())}
    return ShardSchema(recorded.key, recorded.value, metadata, _recorded=True) == planned


def _storage_name(index: int, name: str, names: Sequence[str]) -> str:
    if name not in RESERVED_COLUMNS:
        return name
    candidate = f"{name}_col{index}"
    while candidate in names:
        candidate += "_"
    return candidate


def original_schema(shard_schema: ShardSchema) -> tuple[pa.Schema, list[str]] | None:
    """The original table schema a shard schema stores, and its columns' storage names
    (None: the shard was not written by the IO manager)."""
    raw = shard_schema.metadata.get(ARROW_SCHEMA_META)
    names = shard_schema.metadata.get(COLUMNS_META)
    if raw is None or names is None:
        return None
    return pa.ipc.read_schema(pa.py_buffer(raw)), json.loads(names)


def to_storage(table: pa.Table, plan: StoragePlan) -> pa.Table:
    """``table`` with its columns renamed and cast to their storage types."""
    fields = {f.name: f for f in [*plan.shard_schema.key, *plan.shard_schema.value]}
    columns = []
    for name, stored in zip(table.column_names, plan.storage_names, strict=True):
        column = table.column(name)
        target = fields[stored].type
        try:
            columns.append(column if column.type.equals(target) else column.cast(target))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise UnsupportedOutput(f"column {name!r} ({column.type}) cannot be stored as "
                                   f"{target}: {e}") from None
    return pa.Table.from_arrays(columns, names=list(plan.storage_names))


def from_storage(typed: pa.Table, shard_schema: ShardSchema) -> pa.Table:
    """A typed snapshot (storage columns plus ``t`` and ``d``) as the stored table:
    original names, types and metadata, each row repeated ``d`` times. A typed shard
    no table store wrote (the CLI's, Spark's, the API's) is the table of its key and
    value columns, as every other entry point reads it."""
    found = original_schema(shard_schema)
    # Only a table store's table has a key each row holds once: another writer's typed
    # shard is a multiset of its (key, value) rows, as every reader shows it.
    stored_as_table = found is not None
    if found is None:
        found = pa.schema([*shard_schema.key, *shard_schema.value]), shard_schema.columns
    schema, storage_names = found
    # As this version keeps it: a shard an earlier version stored may hold rows of later
    # outputs with more categories than its recorded index width.
    schema = _kept_schema(schema)
    if stored_as_table:
        _check_is_table(typed, shard_schema,
                        dict(zip(storage_names, schema.names, strict=True)))
    typed = _rows_by_count(typed)
    columns = []
    for field, stored in zip(schema, storage_names, strict=True):
        dictionary = shard_schema.categories(stored)
        column = typed.column(stored)
        columns.append(_cast_back(column, field.type) if dictionary is None
                       else _with_dictionary(column, field.type, dictionary, stored))
    return pa.Table.from_arrays(columns, schema=_range_stops_set(schema, typed.num_rows))


def _check_is_table(typed: pa.Table, shard_schema: ShardSchema,
                    names: Mapping[str, str]) -> None:
    """Refuse contents no table store leaves, which other writers' appends can: a row
    counted below once (a retraction of a row never added) has no table to show, and a
    keyed table holds each key once (a load showing two rows for a key would break the
    key the table was stored with).

    Raises:
        NotATable: either; the first offending key is named.
    """
    counts = typed.column("d")
    if len(counts) and pc.min(counts).as_py() < 1:
        row = typed.filter(pc.less(counts, 1)).slice(0, 1).to_pylist()[0]
        raise NotATable(f"the shard holds a row counted {row.pop('d')} (a retraction of "
                        f"a row never added, by a write other than a table store): "
                        f"{_shown(row, shard_schema.columns, names)}; storing the table again "
                        f"replaces its contents")
    if not shard_schema.value or not len(counts):
        return  # the whole row is the key: equal rows keep their multiplicity
    keys = shard_schema.key.names
    repeated = typed.filter(pc.greater(counts, 1))
    if not repeated.num_rows:
        # By the keys' row encoding: defined for every type a key column can have.
        encoded = rowcodec.encode_rows([typed.column(c) for c in keys], typed.num_rows,
                                       strip_trailing_nulls=False)
        if pc.count_distinct(encoded).as_py() != typed.num_rows:
            seen = pc.value_counts(encoded)
            twice = seen.field("values").filter(pc.greater(seen.field("counts"), 1))[0]
            repeated = typed.filter(pc.equal(encoded, twice))
    if repeated.num_rows:
        row = repeated.select(keys).slice(0, 1).to_pylist()[0]
        raise NotATable(f"the keyed table holds key {_shown(row, keys, names)} more than once "
                        f"(rows appended by a write other than a table store, which "
                        f"replaces each key's row); storing the table again replaces its "
                        f"contents")


def _shown(row: Mapping[str, object], columns: Sequence[str],
           names: Mapping[str, str]) -> str:
    """``row``'s ``columns`` under the table's own column names, shortened."""
    text = repr({names.get(c, c): row[c] for c in columns if c in row})
    return text if len(text) <= 200 else text[:200] + "...}"


def _with_dictionary(values: pa.ChunkedArray, type_: pa.DictionaryType,
                     dictionary: pa.Array, stored: str) -> pa.ChunkedArray:
    """``values`` encoded with the stored ``dictionary`` (its categories in their order,
    unused ones included)."""
    flat = values.combine_chunks()
    if not flat.type.equals(dictionary.type):
        flat = flat.cast(dictionary.type)
    indices = pc.index_in(flat, value_set=dictionary)
    if indices.null_count != flat.null_count:
        raise CorruptPart(f"column {stored!r} holds a value outside its stored dictionary")
    return pa.chunked_array([pa.DictionaryArray.from_arrays(
        indices.cast(type_.index_type), dictionary, ordered=type_.ordered)], type_)


def _cast_back(column: pa.ChunkedArray, type_: pa.DataType) -> pa.ChunkedArray:
    if column.type.equals(type_):
        return column
    if pa.types.is_null(type_):
        return pa.chunked_array([pa.nulls(len(column))], pa.null())
    if pa.types.is_map(type_):
        return pa.chunked_array([_as_map(chunk, type_) for chunk in column.chunks], type_)
    if pa.types.is_dictionary(type_):
        # An unordered categorical: encoded again from its values (Arrow casts only
        # strings to a dictionary type, not e.g. integers or dates).
        values = column if column.type.equals(type_.value_type) \
            else column.cast(type_.value_type)
        return values.dictionary_encode().cast(type_)
    if any(pa.types.is_null(t) for t in narrow_types(type_)):
        # Arrow casts no values to null inside a struct or list: built child by child.
        return pa.chunked_array([_with_nulls(chunk, type_) for chunk in column.chunks],
                                type_)
    return column.cast(type_)


def _with_nulls(values: pa.Array, type_: pa.DataType) -> pa.Array:
    """A storage array as ``type_``, which may have fields or items of Arrow's null type
    (stored as int8, all null) at any depth."""
    if values.type.equals(type_):
        return values
    if pa.types.is_null(type_):
        return pa.nulls(len(values))
    mask = values.is_null() if values.null_count else None
    if pa.types.is_struct(type_):
        children = [_with_nulls(values.field(i), f.type) for i, f in enumerate(type_)]
        return pa.StructArray.from_arrays(children, fields=list(type_), mask=mask)
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        items = _with_nulls(values.values, type_.value_type)
        make = pa.ListArray if pa.types.is_list(type_) else pa.LargeListArray
        return make.from_arrays(values.offsets, items, type=type_, mask=mask)
    return values.cast(type_)


def _as_map(chunk: pa.Array, type_: pa.MapType) -> pa.Array:
    entries = chunk.flatten()
    keys = _with_nulls(entries.field("key"), type_.key_type)
    items = _with_nulls(entries.field("value"), type_.item_type)
    offsets = chunk.offsets
    if chunk.null_count:
        return pa.MapArray.from_arrays(offsets, keys, items, type=type_,
                                       mask=pc.is_null(chunk))
    return pa.MapArray.from_arrays(offsets, keys, items, type=type_)
