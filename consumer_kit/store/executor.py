"""The store's one seam to the database: a connection that runs :mod:`~consumer_kit.store.sql` statements.

:class:`Database` opens connections on the app's SQLAlchemy engine and chooses, once, how statements
run on them (:class:`Executor`):

- :class:`AsyncpgExecutor` when the engine's driver is asyncpg: the store's statements go straight to
  the asyncpg connection under SQLAlchemy's (``AsyncConnection.get_raw_connection().driver_connection``,
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
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from datetime import UTC, datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import bindparam, event, text
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.sql.elements import TextClause

from consumer_kit.store.database import DEFERRED
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
    cancellation is raised right after it, see :func:`_to_the_end`): a ``CancelledError`` thrown into
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

        return await _to_the_end(run())

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
            await _to_the_end(start())
        except BaseException:  # cancelled once it had begun: end it here, not in the pool's reset
            if transaction.is_active:
                await _to_the_end(transaction.rollback())
            raise
        try:
            yield
        except BaseException:
            await _to_the_end(transaction.rollback())
            raise
        await _to_the_end(transaction.commit())

    async def _deferred(self, deferred: bool) -> None:
        if self._sqlite:
            await self._conn.execution_options(**{DEFERRED: deferred})

    async def close_session(self) -> None:
        await _to_the_end(super().close_session())


async def _to_the_end(awaitable: Awaitable[T]) -> T:
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
    def session(self) -> AsyncSession:
        if not hasattr(self, "_conn"):
            raise SessionUnavailable("this connection was checked out without an SQLAlchemy session")
        return super().session

    @property
    def driver(self) -> asyncpg.Connection:
        return self._driver

    async def execute(self, statement: Statement, params: Params) -> int:
        sql, names = _numbered(statement)
        return _rowcount(await self._driver.execute(sql, *_args(names, params)))

    async def fetch_one(self, statement: Statement, params: Params) -> Row | None:
        sql, names = _numbered(statement)
        row: Row | None = await self._driver.fetchrow(sql, *_args(names, params))
        return row

    async def fetch_all(self, statement: Statement, params: Params) -> list[Row]:
        sql, names = _numbered(statement)
        rows: list[Row] = await self._driver.fetch(sql, *_args(names, params))
        return rows

    async def execute_many(self, statement: Statement, params: Sequence[Params]) -> None:
        if params:
            sql, names = _numbered(statement)
            await self._driver.executemany(sql, [_args(names, p) for p in params])

    @contextlib.asynccontextmanager
    async def begin(self, *, deferred: bool = False) -> AsyncIterator[None]:
        driver = self._driver
        transaction = driver.transaction()
        settled = False
        try:
            await transaction.start()
            try:
                yield
            except BaseException as exc:
                try:
                    await transaction.rollback()
                    settled = True
                except asyncio.CancelledError:
                    raise  # cancelled again while rolling back: discarded below
                except Exception as rollback_error:  # discarded below; the first error wins
                    raise exc from rollback_error
                raise
            await transaction.commit()
            settled = True
        finally:
            # Not settled: start, commit or rollback was interrupted (cancelled, or the connection
            # failed), so whether a transaction is still open is unknown. Never let it be pooled.
            if not settled or (not self.discarded and driver.is_in_transaction()):
                self.discard()

    def discard(self) -> None:
        """Terminate the connection now (synchronously: nothing can interrupt it); the pool drops it."""
        if not self.discarded:
            self.discarded = True
            log.warning("a database connection was left in doubt (interrupted transaction); discarding it")
            self._driver.terminate()


class Database:
    """The store's database: the app's SQLAlchemy engine, and the executor chosen once for its driver.

    On asyncpg the store's own statements (claims, lookups, completions of handlers registered with
    ``driver="asyncpg"``) run on a small asyncpg pool the store owns outright, made on first use and
    sized like the engine's pool: an asyncpg checkout costs a fifth of an SQLAlchemy one (whose
    async layer is three greenlet switches a checkout). Work that needs ``ctx.db`` takes an
    SQLAlchemy connection (``connect(session=True)``), and so does lease upkeep (renewals, releases),
    so that handlers holding every store connection cannot starve it.
    """

    def __init__(self, engine: AsyncEngine, *, pool_size: int | None = None) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self.asyncpg = engine.dialect.driver == "asyncpg"
        self._pool: asyncpg.Pool | None = None
        self._opening: asyncio.Future[asyncpg.Pool] | None = None
        self._pool_size = pool_size or _pool_size(engine)
        if self.asyncpg:
            # Autocommit: SQLAlchemy never begins or ends a transaction on these connections; the
            # executor's own (asyncpg) transactions do. The option only changes a flag per checkout.
            self._engine = engine.execution_options(isolation_level="AUTOCOMMIT")
            if not event.contains(engine.sync_engine, "checkout", _refuse_in_doubt):
                event.listen(engine.sync_engine, "checkout", _refuse_in_doubt)
            # The engine's disposal closes the store's pool too (abruptly: nothing is in flight then).
            event.listen(engine.sync_engine, "engine_disposed", lambda _engine: self._terminate())
        else:
            self._engine = engine

    @contextlib.asynccontextmanager
    async def connect(self, *, session: bool = False) -> AsyncIterator[Executor]:
        """A connection for a unit of work; statements autocommit outside ``begin()``. ``session``: it
        also serves an SQLAlchemy ``AsyncSession`` (``ctx.db``)."""
        if not self.asyncpg:
            async with self._sqlalchemy() as executor:
                yield executor
        elif session:
            async with self._engine.connect() as conn:
                raw = await conn.get_raw_connection()
                executor = AsyncpgExecutor(raw.driver_connection, conn)
                try:
                    yield executor
                finally:
                    try:
                        await executor.close_session()
                    finally:
                        if executor.discarded or executor.driver.is_in_transaction():
                            executor.discard()
                            await conn.invalidate()
        else:
            pool = self._pool or await self._open_pool()
            # asyncpg shields its own release; a connection still inside a transaction is rolled back
            # by it, and one the executor terminated is replaced.
            async with pool.acquire() as driver:
                executor = AsyncpgExecutor(driver)
                try:
                    yield executor
                finally:
                    if not executor.discarded and driver.is_in_transaction():
                        executor.discard()

    async def _open_pool(self) -> asyncpg.Pool:
        # One opening for all the first callers at once (each would open a pool, and a connection).
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._create_pool())
        try:
            return await asyncio.shield(self._opening)
        except BaseException:
            if self._opening.done() and (self._opening.cancelled() or self._opening.exception() is not None):
                self._opening = None  # failed: the next caller tries again
            raise

    async def _create_pool(self) -> asyncpg.Pool:
        import asyncpg

        dsn = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=self._pool_size, init=_json_codec,
                                         reset=_transaction_scoped_reset)
        assert pool is not None
        self._pool = pool
        return pool

    async def close(self) -> None:
        """Close the store's own pool, if it opened one (the engine is the caller's)."""
        pool, self._pool, self._opening = self._pool, None, None
        if pool is not None:
            await pool.close()

    def _terminate(self) -> None:
        pool, self._pool, self._opening = self._pool, None, None
        if pool is not None:
            pool.terminate()

    @contextlib.asynccontextmanager
    async def _sqlalchemy(self) -> AsyncIterator[Executor]:
        conn = self._engine.connect()
        try:
            await _to_the_end(conn.start())
        except BaseException:  # cancelled once it was checked out: give it back
            if conn.sync_connection is not None:
                await _to_the_end(conn.close())
            raise
        executor = SqlAlchemyExecutor(conn)
        try:
            yield executor
        finally:
            try:
                await executor.close_session()
            finally:
                await _to_the_end(conn.close())

    def needs_session_connection(self, uses_db: bool) -> bool:
        """Whether work that uses ``ctx.db`` needs a connection of the other kind (asyncpg only)."""
        return self.asyncpg and uses_db

    @contextlib.asynccontextmanager
    async def transaction(self, *, deferred: bool = False, session: bool = False) -> AsyncIterator[Executor]:
        """A connection inside a transaction, for one short unit of work."""
        async with self.connect(session=session) as executor, executor.begin(deferred=deferred):
            yield executor


def _pool_size(engine: AsyncEngine) -> int:
    size = getattr(engine.pool, "size", None)
    return int(size()) if callable(size) else 5


async def _json_codec(connection: asyncpg.Connection) -> None:
    """The store's pool reads and writes JSON as SQLAlchemy's asyncpg dialect sets it up (text in,
    parsed values out), so that statements behave the same on either kind of connection."""
    await connection.set_type_codec("json", encoder=str.encode, decoder=lambda value: json.loads(value.decode()),
                                    schema="pg_catalog", format="binary")


async def _transaction_scoped_reset(connection: asyncpg.Connection) -> None:
    """Pool reset: nothing beyond what asyncpg always does (end a transaction left open). Like
    SQLAlchemy's pool, the store's resets only what a transaction scopes: its statements change no
    session state, and asyncpg's full reset would cost a round trip per checkout."""


def _refuse_in_doubt(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """Pool ``checkout`` hook: a connection that is closed or still inside a transaction is thrown
    away and another one checked out."""
    driver = dbapi_connection.driver_connection
    if driver.is_closed() or driver.is_in_transaction():
        log.warning("discarding a pooled database connection that was %s",
                    "closed" if driver.is_closed() else "inside a transaction")
        raise DisconnectionError("connection in doubt")


# --- statement forms --------------------------------------------------------------------------------

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@lru_cache(maxsize=256)
def _numbered(statement: Statement) -> tuple[str, tuple[tuple[str, bool], ...]]:
    """PostgreSQL's text with ``$n`` for each distinct ``:name``, and the names in order (with
    whether each is JSON, which asyncpg takes as text)."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    sql = _PARAM.sub(number, statement.sql)
    return sql, tuple((name, TYPES.get(name) == "json") for name in names)


def _args(names: tuple[tuple[str, bool], ...], params: Params) -> list[Any]:
    return [json.dumps(params[name]) if is_json and params[name] is not None else params[name]
            for name, is_json in names]


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
