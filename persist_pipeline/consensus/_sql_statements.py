"""The consensus schema and every statement :class:`SqlConsensus` runs.

Statements are SQLAlchemy Core constructs built once at import. :func:`compile_all`
renders them once per kind of engine (and process) into driver SQL with bound parameters
(never formatted values), optionally as server-side prepared statements (PostgreSQL), so
the hot path executes a ready string on a raw DBAPI cursor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    and_,
    bindparam,
    delete,
    exists,
    func,
    insert,
    literal_column,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

metadata = MetaData()

#: One row per record: a shard's records are numbered 1, 2, 3, ... by ``seqno``.
consensus = Table(
    "consensus",
    metadata,
    Column("shard", Text, nullable=False),
    Column("seqno", BigInteger, nullable=False),
    Column("data", LargeBinary, nullable=False),
    Column("summary", LargeBinary, nullable=False),
    PrimaryKeyConstraint("shard", "seqno"),
)

#: One row per shard ever created, so ``list_heads`` can do one index lookup per shard.
shards = Table("shards", metadata, Column("shard", Text, primary_key=True))

_shard = bindparam("shard", type_=Text)
_seqno = bindparam("seqno", type_=BigInteger)
_data = bindparam("data", type_=LargeBinary)
_summary = bindparam("summary", type_=LargeBinary)
_new_row = (_shard, _seqno, _data, _summary)
_columns = ["shard", "seqno", "data", "summary"]


def _head_seqno_of(shard: ColumnElement[Any], *correlate: Any) -> ColumnElement[Any]:
    """``(SELECT max(seqno) FROM consensus WHERE shard = <shard>)``: an index lookup."""
    h = consensus.alias("h")
    query = select(func.max(h.c.seqno)).where(h.c.shard == shard)
    return query.correlate(*correlate).scalar_subquery()


def _lateral_listings() -> dict[str, ClauseElement]:
    """``list_shards`` and ``list_heads`` for PostgreSQL and CockroachDB: per registered
    shard one backward probe of the primary key (a plain join or EXISTS lets PostgreSQL's
    planner pick a hash join over every record)."""
    s, c = shards.alias("s"), consensus.alias("c")
    head = (
        select(c.c.seqno, c.c.summary)
        .where(c.c.shard == s.c.shard)
        .order_by(c.c.seqno.desc())
        .limit(literal_column("1", Integer))
        .lateral("head")
    )
    return {
        "list_shards": select(s.c.shard).select_from(s.join(head, true())).order_by(s.c.shard),
        "list_heads": select(s.c.shard, head.c.seqno, head.c.summary)
        .select_from(s.join(head, true()))
        .order_by(s.c.shard),
    }


def _correlated_listings() -> dict[str, ClauseElement]:
    """``list_shards`` and ``list_heads`` for SQLite (no LATERAL): its planner runs the
    correlated lookups per registered shard through the primary key."""
    s, c = shards.alias("s"), consensus.alias("c")
    return {
        "list_shards": select(s.c.shard)
        .where(exists().where(c.c.shard == s.c.shard))
        .order_by(s.c.shard),
        "list_heads": select(c.c.shard, c.c.seqno, c.c.summary)
        .select_from(
            s.join(c, and_(c.c.shard == s.c.shard, c.c.seqno == _head_seqno_of(s.c.shard, s)))
        )
        .order_by(c.c.shard),
    }


def _statements(insert: Callable[[Table], Any], *, lateral: bool) -> dict[str, ClauseElement]:
    """Every statement, with ``insert`` the dialect's ``insert`` (for ON CONFLICT)."""
    e = consensus.alias("e")
    no_records = ~exists().where(e.c.shard == _shard)
    return {
        "head": select(consensus.c.seqno, consensus.c.data, consensus.c.summary)
        .where(consensus.c.shard == _shard)
        .order_by(consensus.c.seqno.desc())
        .limit(literal_column("1", Integer)),
        "head_seqno": select(_head_seqno_of(_shard)),
        # Compare-and-set: one INSERT that only inserts when the head is as expected;
        # concurrent winners of the head check collide on the primary key and all but
        # one insert nothing (ON CONFLICT DO NOTHING), so rowcount 1 means success.
        "cas": insert(consensus)
        .from_select(
            _columns,
            select(*_new_row).where(
                _head_seqno_of(_shard) == bindparam("expected", type_=BigInteger)
            ),
        )
        .on_conflict_do_nothing(),
        # Creation (expected None): only if the shard has no record at all, so a stale
        # creator cannot re-insert seqno 1 after truncation removed it.
        "create": insert(consensus)
        .from_select(_columns, select(*_new_row).where(no_records))
        .on_conflict_do_nothing(),
        "register": insert(shards).values(shard=_shard).on_conflict_do_nothing(),
        "scan": select(consensus.c.seqno, consensus.c.data, consensus.c.summary)
        .where(
            consensus.c.shard == _shard,
            consensus.c.seqno >= bindparam("from_seqno", type_=BigInteger),
        )
        .order_by(consensus.c.seqno)
        .limit(bindparam("limit", type_=BigInteger)),
        "scan_all": select(consensus.c.seqno, consensus.c.data, consensus.c.summary)
        .where(
            consensus.c.shard == _shard,
            consensus.c.seqno >= bindparam("from_seqno", type_=BigInteger),
        )
        .order_by(consensus.c.seqno),
        "truncate": delete(consensus).where(
            consensus.c.shard == _shard,
            consensus.c.seqno < bindparam("below", type_=BigInteger),
        ),
        **(_lateral_listings() if lateral else _correlated_listings()),
    }


def multi_cas(n: int) -> ClauseElement:
    """Compare-and-set of ``n`` shards as ONE statement, so it is all or nothing: insert
    every new row iff every shard's head is its expected seqno. Unlike ``cas`` it has no
    ON CONFLICT clause: a competitor that won one of the seqnos makes the whole insert
    fail on the primary key instead of skipping that row and committing the others.
    Parameters ``shard_i``, ``seqno_i``, ``data_i``, ``summary_i``, ``expected_i``."""
    rows = [
        select(
            bindparam(f"shard_{i}", type_=Text).label("shard"),
            bindparam(f"seqno_{i}", type_=BigInteger).label("seqno"),
            bindparam(f"data_{i}", type_=LargeBinary).label("data"),
            bindparam(f"summary_{i}", type_=LargeBinary).label("summary"),
        )
        for i in range(n)
    ]
    new = (rows[0] if n == 1 else union_all(*rows)).subquery("new")
    # NULL-safe: an expected NULL matches a shard without records (its creation).
    heads_match = and_(
        *(
            _head_seqno_of(bindparam(f"shard_{i}", type_=Text)).is_not_distinct_from(
                bindparam(f"expected_{i}", type_=BigInteger))
            for i in range(n)
        )
    )
    return insert(consensus).from_select(
        _columns, select(new.c.shard, new.c.seqno, new.c.data, new.c.summary).where(heads_match)
    )


def multi_cas_arrays() -> ClauseElement:
    """:func:`multi_cas` for PostgreSQL as ONE statement for any number of shards: the
    rows come as parallel arrays (``shards``, ``seqnos``, ``datas``, ``summaries``,
    ``expecteds``) unnested server-side, so it is prepared once per connection."""
    shards_p = bindparam("shards", type_=postgresql.ARRAY(Text))
    expected_p = bindparam("expecteds", type_=postgresql.ARRAY(BigInteger))
    new = func.unnest(
        shards_p,
        bindparam("seqnos", type_=postgresql.ARRAY(BigInteger)),
        bindparam("datas", type_=postgresql.ARRAY(LargeBinary)),
        bindparam("summaries", type_=postgresql.ARRAY(LargeBinary)),
    ).table_valued("shard", "seqno", "data", "summary").render_derived(name="new")
    wanted = func.unnest(shards_p, expected_p).table_valued("shard", "expected").render_derived(
        name="w")
    h = consensus.alias("h")
    head = select(func.max(h.c.seqno)).where(h.c.shard == wanted.c.shard).scalar_subquery()
    mismatch = exists(
        select(literal_column("1", Integer)).select_from(wanted)
        .where(head.is_distinct_from(wanted.c.expected))
    )
    return insert(consensus).from_select(
        _columns, select(new.c.shard, new.c.seqno, new.c.data, new.c.summary).where(~mismatch)
    )


#: Multi-shard compare-and-sets of up to this many shards are prepared on PostgreSQL in
#: :func:`multi_cas`'s fixed shape, one statement per width: cheaper per call than the
#: array form (no array literals to build, parse and unnest), which serves wider ones.
SMALL_MULTI_CAS = 8

PG_STATEMENTS = _statements(postgresql.insert, lateral=True)
SQLITE_STATEMENTS = _statements(sqlite.insert, lateral=False)


@dataclass(frozen=True, slots=True)
class Rendered:
    """One statement rendered for one engine.

    Attributes:
        sql: what ``cursor.execute`` runs, with positional placeholders.
        names: the parameter name for each placeholder, in order.
        defaults: values of parameters SQLAlchemy generated itself (e.g. OFFSET 0).
        prepare: for a server-side prepared statement, the ``PREPARE`` to run once per
            connection before ``sql`` (an ``EXECUTE``) can be used; else None.
    """

    sql: str
    names: tuple[str, ...]
    defaults: Mapping[str, Any]
    prepare: str | None = None
    _getter: Callable[[Mapping[str, Any]], Any] = field(init=False, repr=False,
                                                         compare=False)

    def __post_init__(self) -> None:
        # Picks every name's value in one C call when ``params`` has them all (the
        # compare-and-set does): itemgetter of two or more names returns a tuple.
        object.__setattr__(self, "_getter", itemgetter(*self.names)
                           if len(self.names) >= 2 else self._args_with_defaults)

    def args(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        """The positional arguments for ``sql`` from named ``params``."""
        try:
            args: tuple[Any, ...] = self._getter(params)
            return args
        except KeyError:
            return self._args_with_defaults(params)

    def _args_with_defaults(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        defaults = self.defaults
        return tuple([params[n] if n in params else defaults[n] for n in self.names])


def _plain(stmt: ClauseElement, dialect: Dialect) -> Rendered:
    compiled = cast(SQLCompiler, stmt.compile(dialect=dialect))
    return Rendered(compiled.string, tuple(compiled.positiontup or ()), dict(compiled.params))


def _prepared(name: str, stmt: ClauseElement) -> Rendered:
    dialect = postgresql.dialect(paramstyle="numeric_dollar")  # type: ignore[no-untyped-call]
    compiled = cast(SQLCompiler, stmt.compile(dialect=dialect))
    names = tuple(compiled.positiontup or ())
    types = ", ".join(dialect.type_compiler_instance.process(compiled.binds[n].type) for n in names)
    declared = f" ({types})" if names else ""
    prepare = f"PREPARE pp_{name}{declared} AS {compiled.string}"
    placeholders = ", ".join(["%s"] * len(names))
    execute = f"EXECUTE pp_{name} ({placeholders})" if names else f"EXECUTE pp_{name}"
    return Rendered(execute, names, dict(compiled.params), prepare)


def compile_multi_cas(kind: str, dialect: Dialect, n: int) -> Rendered:
    """:func:`multi_cas` for ``n`` shards rendered for an engine of ``kind`` (plain
    statements: the shape varies with ``n``; callers cache them per ``n``)."""
    if kind == "sqlite":
        return _plain(multi_cas(n), dialect)
    fmt = PGDialect_psycopg2(paramstyle="format")  # type: ignore[no-untyped-call]
    return _plain(multi_cas(n), fmt)


#: :func:`compile_all`'s renderings, by :func:`_dialect_key`.
_COMPILED: dict[tuple[Any, ...], dict[str, Rendered]] = {}


def _dialect_key(kind: str, dialect: Dialect) -> tuple[Any, ...]:
    """What a rendering depends on: the kind, and the dialect's class, parameter style
    and server version (None before its first connection)."""
    return (kind, type(dialect), dialect.paramstyle,
            getattr(dialect, "server_version_info", None))


def compile_all(kind: str, dialect: Dialect) -> dict[str, Rendered]:
    """Every statement rendered for an engine of ``kind`` using ``dialect``.

    The statements are fixed and :class:`Rendered` is immutable, so each kind and
    dialect configuration is rendered once per process and every store opened after
    that gets a copy of the same renderings (rendering them all took about 35 ms, paid
    by every :class:`~persist_pipeline.consensus.sql.SqlConsensus` opened).

    Args:
        kind: ``"postgresql"`` (server-side prepared statements), ``"cockroachdb"``
            (plain statements; CockroachDB caches plans itself) or ``"sqlite"`` (plain;
            the sqlite3 module caches prepared statements per connection).
        dialect: the engine's dialect.
    """
    key = _dialect_key(kind, dialect)
    rendered = _COMPILED.get(key)
    if rendered is None:
        rendered = _COMPILED.setdefault(key, _compile_all(kind, dialect))
    return dict(rendered)


def _compile_all(kind: str, dialect: Dialect) -> dict[str, Rendered]:
    if kind == "postgresql":
        prepared = {name: _prepared(name, stmt) for name, stmt in PG_STATEMENTS.items()}
        prepared["cas_many"] = _prepared("cas_many", multi_cas_arrays())
        for n in range(1, SMALL_MULTI_CAS + 1):
            prepared[f"cas_many_{n}"] = _prepared(f"cas_many_{n}", multi_cas(n))
        return prepared
    if kind == "cockroachdb":
        fmt = PGDialect_psycopg2(paramstyle="format")  # type: ignore[no-untyped-call]
        return {name: _plain(stmt, fmt) for name, stmt in PG_STATEMENTS.items()}
    return {name: _plain(stmt, dialect) for name, stmt in SQLITE_STATEMENTS.items()}
