"""The store's one seam to the database: a connection that runs :mod:`~consumer_kit.store.sql` statements.

:class:`~consumer_kit.store.connections.Database` opens connections on the app's SQLAlchemy engine
and chooses, once, how statements run on them (:class:`Executor`):

- :class:`AsyncpgExecutor` when the engine's driver is asyncpg: the store's statements go straight to
  the asyncpg connection under SQLAlchemy's (``Connection.connection.driver_connection``,
  public API), at asyncpg's cost per statement instead of SQLAlchemy's; transactions are asyncpg's,
  and the SQLAlchemy connection stays in autocommit so that it never begins or ends one of its own. A
  handler's ``ctx.db`` (an ``AsyncSession`` on the same connection) and ``ctx.connection`` (the asyncpg
  connection) both run inside the delivery's transaction.
- :class:`SqlAlchemyExecutor` otherwise (SQLite, psycopg): every statement and transaction through
  SQLAlchemy.

Statements outside :meth:`Executor.begin` commit on their own (autocommit).

**A connection in doubt is never pooled.** Every ``await`` may be cancelled (a broker reconnect, the
shutdown grace, an HTTP client that hangs up). If a transaction's start, commit or rollback does not
finish cleanly, or the connection is still inside a transaction afterwards, the asyncpg connection is
terminated on the spot and SQLAlchemy is told to invalidate it; and every checkout from an asyncpg
engine refuses a connection that is closed or inside a transaction (SQLAlchemy's documented
``checkout`` + ``DisconnectionError`` pattern), so that even a connection whose invalidation was itself
cancelled cannot carry a stale transaction into the next delivery. (Without this, later "transactions"
on such a connection would run as savepoints inside one that never commits, and be acknowledged.)
A statement or transaction that meets a connection the server ended fails as the lost connection it
is, whichever turn of the event loop asyncpg read the end in (:mod:`.driver_errors`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import operator
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from sqlalchemy import TextClause, bindparam, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from consumer_kit.store.database import DEFERRED
from consumer_kit.store.driver_errors import connection_ended, ended_by_the_server
from consumer_kit.store.sql import SQLALCHEMY_TYPES, TYPES, Statement

if TYPE_CHECKING:
    import asyncpg

log = logging.getLogger("consumer_kit.store")

T = TypeVar("T")


class SessionUnavailable(RuntimeError):
    """``ctx.db`` on a connection checked out without an SQLAlchemy session (``driver="asyncpg"``)."""

Row = Mapping[str, Any]
Params = Mapping[str, Any]


class Executor(abc.ABC):
    """One checked-out connection: runs statements, in autocommit or inside :meth:`begin`.

    ``discarded`` is set once the connection was found in doubt and closed: nothing more can run on
    it, and the caller takes another connection for what is left to do."""

    dialect: str
    discarded: bool = False

    @abc.abstractmethod
    async def execute(self, statement: Statement, params: Params) -> int:
        """Run a statement; the number of rows it changed."""

    @abc.abstractmethod
    async def fetch_one(self, statement: Statement, params: Params) -> Row | None:
        """The first row of a statement's result, or ``None``."""

    @abc.abstractmethod
    async def fetch_all(self, statement: Statement, params: Params) -> list[Row]:
        """Every row of a statement's result."""

    @abc.abstractmethod
    async def execute_many(self, statement: Statement, params: Sequence[Params]) -> None:
        """Run a statement once per parameter set."""

    @abc.abstractmethod
    def begin(self, *, deferred: bool = False) -> contextlib.AbstractAsyncContextManager[None]:
        """A transaction on this connection: committed on a clean exit, rolled back otherwise.
        ``deferred``: on SQLite, take the write lock at the first write rather than at once."""

    @property
    def driver(self) -> asyncpg.Connection | None:
        """The asyncpg connection, when statements run on asyncpg (``ctx.connection``)."""
        return None

    # ``ctx.db``: an AsyncSession on this connection, made on first use. It joins the connection's
    # transaction and cannot end it: on SQLAlchemy's executor the transaction is the connection's
    # own, which a session bound to it never commits; on asyncpg's, SQLAlchemy is in autocommit and
    # the transaction is asyncpg's, so the session's commit has nothing to end.
    _conn: AsyncConnection
    _session: AsyncSession | None = None

    @property
    def session(self) -> AsyncSession:
        """An ``AsyncSession`` inside this connection's transaction (``ctx.db``), made on first use."""
        if self._session is None:
            self._session = AsyncSession(bind=self._conn, expire_on_commit=False)
        return self._session

    def session_made(self) -> AsyncSession | None:
        """The session, if anyone used it."""
        return self._session

    async def close_session(self) -> None:
        """Close the session if one was made (it holds no database state of its own)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


class SqlAlchemyExecutor(Executor):
    """Statements and transactions through SQLAlchemy (SQLite, and PostgreSQL on psycopg).

    Every database call runs to its end even when the delivery is cancelled meanwhile (the
    cancellation is raised right after it, see :func:`to_the_end`): a ``CancelledError`` thrown into
    SQLAlchemy's async adapters loses the driver's cursor mid-statement (aiosqlite then keeps the
    statement open and the write lock held until the garbage collector finds the cursor)."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn
        self.dialect = conn.dialect.name
        self._sqlite = self.dialect == "sqlite"

    async def _run(self, statement: Statement, params: Params | Sequence[Params], rows: bool) -> Any:
        clause = _clause(statement, self.dialect)
        conn = self._conn

        async def run() -> Any:
            if conn.in_transaction():
                return _consume(await conn.execute(clause, params), rows, self._sqlite)
            # Autocommit: one statement, its own transaction; on SQLite a deferred one (a lone
            # statement has no read-then-write upgrade to protect, and a read never takes the write lock).
            await self._deferred(True)
            try:
                async with conn.begin():
                    return _consume(await conn.execute(clause, params), rows, self._sqlite)
            finally:
                await self._deferred(False)

        return await to_the_end(run())

    async def execute(self, statement: Statement, params: Params) -> int:
        return int(await self._run(statement, params, rows=False))

    async def fetch_one(self, statement: Statement, params: Params) -> Row | None:
        found: list[Row] = await self._run(statement, params, rows=True)
        return found[0] if found else None

    async def fetch_all(self, statement: Statement, params: Params) -> list[Row]:
        found: list[Row] = await self._run(statement, params, rows=True)
        return found

    async def execute_many(self, statement: Statement, params: Sequence[Params]) -> None:
        if params:
            await self._run(statement, list(params), rows=False)

    @contextlib.asynccontextmanager
    async def begin(self, *, deferred: bool = False) -> AsyncIterator[None]:
        transaction = self._conn.begin()

        async def start() -> None:
            await self._deferred(deferred)
            try:
                await transaction.start()
            finally:
                await self._deferred(False)

        try:
            await to_the_end(start())
        except BaseException:  # cancelled once it had begun: end it here, not in the pool's reset
            if transaction.is_active:
                await to_the_end(transaction.rollback())
            raise
        try:
            yield
        except BaseException:
            await to_the_end(transaction.rollback())
            raise
        await to_the_end(transaction.commit())

    async def _deferred(self, deferred: bool) -> None:
        if self._sqlite:
            await self._conn.execution_options(**{DEFERRED: deferred})

    async def close_session(self) -> None:
        await to_the_end(super().close_session())


async def to_the_end(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end even if the awaiting task is cancelled meanwhile; then raise the
    cancellation. (A database call on SQLite is local and short; the busy timeout bounds it.)"""
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what this task reports
        raise


class AsyncpgExecutor(Executor):
    """The store's statements on the asyncpg connection under an SQLAlchemy one (see the module
    docstring); ``discarded`` once the connection was found in doubt and terminated."""

    dialect = "postgresql"

    def __init__(self, driver: asyncpg.Connection, conn: AsyncConnection | None = None) -> None:
        self._driver = driver
        if conn is not None:
            self._conn = conn

    @property
    def has_session(self) -> bool:
        """Whether this connection is SQLAlchemy's (and serves ``ctx.db``), not the store pool's."""
        return hasattr(self, "_conn")

    @property
    def session(self) -> AsyncSession:
        if not hasattr(self, "_conn"):
            raise SessionUnavailable("this connection was checked out without an SQLAlchemy session")
        return super().session

    @property
    def driver(self) -> asyncpg.Connection:
        return self._driver

    # Each statement says a connection the server ended as the lost connection it is (see ended_by_the_server).

    async def execute(self, statement: Statement, params: Params) -> int:
        sql, _, args = numbered(statement)
        try:
            return _rowcount(await self._driver.execute(sql, *args(params)))
        except Exception as exc:
            if ended_by_the_server(exc):
                raise self.lost() from None
            raise

    async def fetch_one(self, statement: Statement, params: Params) -> Row | None:
        sql, _, args = numbered(statement)
        try:
            row: Row | None = await self._driver.fetchrow(sql, *args(params))
        except Exception as exc:
            if ended_by_the_server(exc):
                raise self.lost() from None
            raise
        return row

    async def fetch_all(self, statement: Statement, params: Params) -> list[Row]:
        sql, _, args = numbered(statement)
        try:
            rows: list[Row] = await self._driver.fetch(sql, *args(params))
        except Exception as exc:
            if ended_by_the_server(exc):
                raise self.lost() from None
            raise
        return rows

    async def execute_many(self, statement: Statement, params: Sequence[Params]) -> None:
        if params:
            sql, _, args = numbered(statement)
            try:
                await self._driver.executemany(sql, [args(p) for p in params])
            except Exception as exc:
                if ended_by_the_server(exc):
                    raise self.lost() from None
                raise

    def begin(self, *, deferred: bool = False) -> contextlib.AbstractAsyncContextManager[None]:
        return _AsyncpgTransaction(self)

    def lost(self) -> Exception:
        """The error for a statement that met the server's end of the connection (see
        :func:`ended_by_the_server`): asyncpg's for a lost connection. Nothing more runs on this one."""
        self.discarded = True  # asyncpg closed it already: there is nothing to terminate
        return connection_ended()

    def in_transaction(self) -> bool:
        """Whether the connection is inside a transaction; ``False`` once it is lost (asyncpg's pool takes a
        lost connection back at once, and its handle then refuses every call, this one too)."""
        try:
            return bool(self._driver.is_in_transaction())
        except Exception as exc:
            import asyncpg

            if isinstance(exc, asyncpg.InterfaceError):
                return False
            raise

    def discard(self) -> None:
        """Terminate the connection now (synchronously: nothing can interrupt it); the pool drops it."""
        if not self.discarded:
            self.discarded = True
            log.warning("a database connection was left in doubt (interrupted transaction); discarding it")
            import asyncpg

            with contextlib.suppress(asyncpg.InterfaceError):  # lost, and taken back by its pool already
                self._driver.terminate()


class _AsyncpgTransaction:
    """:meth:`AsyncpgExecutor.begin`: asyncpg's transaction, and the executor discarded whenever its end
    is in doubt. (A class, not a generator-based context manager: it runs for every delivery.)"""

    __slots__ = ("_executor", "_transaction")

    def __init__(self, executor: AsyncpgExecutor) -> None:
        self._executor = executor
        self._transaction = executor.driver.transaction()

    async def __aenter__(self) -> None:
        try:
            await self._transaction.start()
        except Exception as exc:
            self._settled(False)
            if ended_by_the_server(exc):
                raise self._executor.lost() from None
            raise
        except BaseException:
            self._settled(False)
            raise

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: object) -> None:
        settled = False
        executor = self._executor
        try:
            if exc is not None:
                try:
                    await self._transaction.rollback()
                    settled = True
                except asyncio.CancelledError:
                    raise  # cancelled again while rolling back: discarded below
                except Exception as rollback_error:  # discarded below; the first error wins
                    raise exc from (executor.lost() if ended_by_the_server(rollback_error) else rollback_error)
                return  # the block's exception goes on
            try:
                await self._transaction.commit()
            except Exception as error:
                if ended_by_the_server(error):
                    raise executor.lost() from None
                # The server refused the commit (a deferred constraint, a serialization failure): it
                # answered, and the transaction is over. Anything else leaves it in doubt.
                settled = getattr(error, "sqlstate", None) is not None and not executor.in_transaction()
                raise
            settled = True
        finally:
            self._settled(settled)

    def _settled(self, settled: bool) -> None:
        # Not settled: start, commit or rollback was interrupted (cancelled, or the connection failed),
        # so whether a transaction is still open is unknown. Never let it be pooled.
        executor = self._executor
        if not settled or (not executor.discarded and executor.in_transaction()):
            executor.discard()


def lost_to_a_conflict(exc: BaseException) -> bool:
    """Whether PostgreSQL aborted the transaction for a deadlock or a serialization failure (SQLSTATE
    40P01, 40001): it rolled back, and running it again is the documented answer."""
    for error in (exc, getattr(exc, "orig", None), exc.__cause__):
        if getattr(error, "sqlstate", None) in ("40P01", "40001"):
            return True
    return False


CONFLICT_TRIES = 5
"""How many times a transaction that lost to a conflict (:func:`lost_to_a_conflict`) is run in all."""


async def rerun_on_conflict(run: Callable[[Statement, Params], Awaitable[T]], statement: Statement,
                            params: Params) -> T:
    """``run(statement, params)`` for one statement in autocommit, run again when PostgreSQL aborted it
    for a deadlock or a serialization failure (it rolled back whole). The one-statement creation,
    alone or carried by the inbox's claim, takes its count row before it writes the receipt; the
    portable path writes the receipt first. Two creations with one key can each hold what the other
    waits for, and PostgreSQL has aborted creations of distinct keys too, under many at once. That is
    the database's conflict, not the caller's error."""
    for attempt in range(1, CONFLICT_TRIES + 1):
        try:
            return await run(statement, params)
        except Exception as exc:
            if attempt == CONFLICT_TRIES or not lost_to_a_conflict(exc):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


# --- statement forms --------------------------------------------------------------------------------

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class Numbered(NamedTuple):
    """A statement as asyncpg runs it: ``sql`` with ``$n`` for each distinct ``:name``, the ``names`` in
    that order, and ``args``, which picks a parameter mapping's values in that order (JSON as text)."""

    sql: str
    names: tuple[str, ...]
    args: Callable[[Params], Sequence[Any]]


@lru_cache(maxsize=256)
def numbered(statement: Statement) -> Numbered:
    """The statement with numbered parameters, and how to order its parameters (see :class:`Numbered`)."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    sql = _PARAM.sub(number, statement.sql)
    return Numbered(sql, tuple(names), _picker(names))


def _picker(names: Sequence[str]) -> Callable[[Params], Sequence[Any]]:
    """``params -> values in names' order``: an ``itemgetter`` (the claim has a dozen parameters, and a
    comprehension over them was a fifth of the store's own Python work a delivery), JSON dumped after."""
    if not names:
        return lambda params: ()
    pick: Callable[[Params], Sequence[Any]] = operator.itemgetter(*names)
    if len(names) == 1:
        one = operator.itemgetter(names[0])
        pick = lambda params: (one(params),)  # noqa: E731 - itemgetter of one name gives the value itself
    dumped = [i for i, name in enumerate(names) if TYPES.get(name) == "json"]
    if not dumped:
        return pick

    def with_json(params: Params) -> list[Any]:
        values = list(pick(params))
        for i in dumped:
            if values[i] is not None:
                values[i] = json.dumps(values[i])
        return values

    return with_json


def _rowcount(status: str) -> int:
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else 0


@lru_cache(maxsize=256)
def _clause(statement: Statement, dialect: str) -> TextClause:
    sql = statement.text(dialect)
    typed = [bindparam(name, type_=SQLALCHEMY_TYPES[TYPES[name]])
             for name in dict.fromkeys(_PARAM.findall(sql)) if name in TYPES]
    return text(sql).bindparams(*typed)


def _consume(result: Any, rows: bool, sqlite: bool) -> Any:
    if not rows:
        return result.rowcount
    found = [dict(row) for row in result.mappings()]
    return [_from_sqlite(row) for row in found] if sqlite else found


def _from_sqlite(row: dict[str, Any]) -> dict[str, Any]:
    """SQLite's stored text back to the values PostgreSQL's driver returns (by column name)."""
    for name, value in row.items():
        kind = TYPES.get(name)
        if kind is None or value is None:
            continue
        if kind == "datetime" and isinstance(value, str):
            row[name] = datetime.fromisoformat(value).replace(tzinfo=UTC)
        elif kind == "json" and isinstance(value, str):
            row[name] = json.loads(value)
        elif kind == "bool":
            row[name] = bool(value)
    return row
