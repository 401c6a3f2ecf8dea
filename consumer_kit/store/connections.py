"""Connections for the store: :class:`Database` opens them on the app's SQLAlchemy engine and hands out
the executor chosen once for its driver (see :mod:`consumer_kit.store.executor`).

**A connection in doubt is never pooled.** Every ``await`` may be cancelled (a broker reconnect, the
shutdown grace, an HTTP client that hangs up). A connection an executor found in doubt is terminated
and dropped from its pool; and every checkout from an asyncpg engine refuses a connection that is
closed or inside a transaction (SQLAlchemy's documented ``checkout`` + ``DisconnectionError``
pattern), so that even a connection whose invalidation was itself cancelled cannot carry a stale
transaction into the next delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine

from consumer_kit.store.database import pooler_of
from consumer_kit.store.driver_errors import connection_ended, ended_by_the_server, taken_back
from consumer_kit.store.executor import AsyncpgExecutor, Executor, SqlAlchemyExecutor, to_the_end

if TYPE_CHECKING:
    import asyncpg
    from sqlalchemy.engine import ExceptionContext

log = logging.getLogger("consumer_kit.store")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the database can do, as the layers above the store need to know it: they ask this, never
    the database's name (:attr:`Database.can`)."""

    shared_reads: bool
    """Look-ups of many deliveries under way at once can be read together, in one statement on a
    connection of the store's, so that a look before a claim takes no connection of the caller's."""
    one_writer: bool
    """One write transaction at a time (SQLite's database lock): a second writer only waits for the
    first, and a read before a write costs less than a write that finds the key taken."""
    writes_in_claim: bool
    """One statement may write several tables (PostgreSQL's data-modifying CTEs): a coordinator's
    session is created in the claim's statement and ended in the completion's."""


POSTGRESQL = Capabilities(shared_reads=True, one_writer=False, writes_in_claim=True)
SQLITE = Capabilities(shared_reads=False, one_writer=True, writes_in_claim=False)


class Database:
    """The store's database: the app's SQLAlchemy engine, and the executor chosen once for its driver.

    On asyncpg the store's own statements (claims, lookups, completions of handlers registered with
    ``driver="asyncpg"``) run on a small asyncpg pool the store owns outright, made on first use, closed by
    :meth:`close` and sized like the engine's pool: an asyncpg checkout costs a fifth of an SQLAlchemy one (whose
    async layer is three greenlet switches a checkout). Work that needs ``ctx.db`` takes an
    SQLAlchemy connection (``connect(session=True)``), and so does lease upkeep (renewals, releases),
    so that handlers holding every store connection cannot starve it.
    """

    def __init__(self, engine: AsyncEngine, *, pool_size: int | None = None) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self.can = POSTGRESQL if self.dialect == "postgresql" else SQLITE
        """What this database can do (see :class:`Capabilities`)."""
        self.asyncpg = engine.dialect.driver == "asyncpg"
        self.pooler = pooler_of(engine)
        """What stands between the store and PostgreSQL (``DATABASE_POOLER``, told to :func:`create_engine`):
        behind a pooler in transaction mode, the store's own pool keeps no prepared statement and nothing
        relies on a server connection's session (the outbox relay then polls instead of listening)."""
        self._pool: asyncpg.Pool | None = None
        self._opening: asyncio.Future[asyncpg.Pool] | None = None
        self._pool_size = pool_size or _pool_size(engine)
        # A pool listener, not an engine one: any listener of the engine's own events (even
        # engine_disposed) makes every statement on its connections run SQLAlchemy's event dispatch,
        # the handlers' ctx.db statements included. So the store's pool is closed by close(), not by
        # the engine's disposal.
        if self.asyncpg and not event.contains(engine.sync_engine, "checkout", _checked_out):
            event.listen(engine.sync_engine, "checkout", _checked_out)
            # A dialect event: it costs a statement nothing until one fails.
            event.listen(engine.sync_engine, "handle_error", _ended_under_a_statement)

    def connect(self, *, session: bool = False) -> contextlib.AbstractAsyncContextManager[Executor]:
        """A connection for a unit of work; statements autocommit outside ``begin()``. ``session``: it
        also serves an SQLAlchemy ``AsyncSession`` (``ctx.db``)."""
        if not self.asyncpg:
            return self._sqlalchemy()
        return _SessionCheckout(self.engine) if session else _PoolCheckout(self)

    async def pool(self) -> asyncpg.Pool:
        """The store's own asyncpg pool, opened on first use."""
        return self._pool or await self._open_pool()

    async def _open_pool(self) -> asyncpg.Pool:
        # One opening for all the first callers at once (each would open a pool, and a connection).
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._create_pool())
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        except BaseException:
            # Every caller waiting on a failed opening gets its error; the first to see it clears it
            # (a later caller's opening is not this one's to clear), and the next caller tries again.
            if self._opening is opening and opening.done() and (opening.cancelled() or opening.exception() is not None):
                self._opening = None
            raise

    async def _create_pool(self) -> asyncpg.Pool:
        import asyncpg

        dsn = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        # Behind a pooler in transaction mode no statement is cached: each is parsed where it runs, on
        # the server connection of its own transaction (asyncpg's statement_cache_size=0).
        cache = {"statement_cache_size": 0} if self.pooler == "transaction" else {}
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=self._pool_size, init=_json_codec,
                                         reset=_transaction_scoped_reset, **cache)
        assert pool is not None
        self._pool = pool
        return pool

    async def close(self) -> None:
        """Close the store's own pool, if it opened one (the engine is the caller's). Whoever makes a
        ``Database`` closes it: disposing of the engine does not."""
        pool, self._pool, self._opening = self._pool, None, None
        if pool is not None:
            await pool.close()

    @contextlib.asynccontextmanager
    async def _sqlalchemy(self) -> AsyncIterator[Executor]:
        conn = self.engine.connect()
        try:
            await to_the_end(conn.start())
        except BaseException:  # cancelled once it was checked out: give it back
            if conn.sync_connection is not None:
                await to_the_end(conn.close())
            raise
        executor = SqlAlchemyExecutor(conn)
        try:
            yield executor
        finally:
            try:
                await executor.close_session()
            finally:
                await to_the_end(conn.close())

    def aside(self, holding: Executor | None) -> contextlib.AbstractAsyncContextManager[Executor]:
        """A connection for short work beside a delivery that holds ``holding`` (its lease's upkeep,
        parking it once that connection was lost): from the other pool than ``holding``'s on asyncpg,
        so that deliveries holding every connection of one pool cannot starve it."""
        return self.connect(session=not (isinstance(holding, AsyncpgExecutor) and holding.has_session))

    @contextlib.asynccontextmanager
    async def transaction(self, *, deferred: bool = False, session: bool = False) -> AsyncIterator[Executor]:
        """A connection inside a transaction, for one short unit of work."""
        async with self.connect(session=session) as executor, executor.begin(deferred=deferred):
            yield executor


# The two checkouts on asyncpg are classes, not generator-based context managers: one of them runs for
# every delivery, and contextlib's machinery cost more Python than either's own work.


class _PoolCheckout:
    """A connection of the store's own asyncpg pool. asyncpg shields its own release; a connection
    still inside a transaction is rolled back by it, and one the executor terminated is replaced."""

    __slots__ = ("_database", "_executor", "_pool")

    def __init__(self, database: Database) -> None:
        self._database = database

    async def __aenter__(self) -> AsyncpgExecutor:
        self._pool = await self._database.pool()
        self._executor = AsyncpgExecutor(await self._pool.acquire())
        return self._executor

    async def __aexit__(self, *exc_info: object) -> None:
        executor = self._executor
        if not executor.discarded and executor.in_transaction():
            executor.discard()
        try:
            await self._pool.release(executor.driver)
        except Exception as exc:
            if not taken_back(exc):
                raise


class _SessionCheckout:
    """A connection of the engine's pool that also serves ``ctx.db``, its asyncpg connection running
    the store's statements. Autocommit at the DB-API level: SQLAlchemy's asyncpg adapter then never
    begins or ends a transaction on it (it would begin a savepoint inside the executor's); the
    executor's own (asyncpg) transactions do. Set through the DB-API connection's ``autocommit``
    attribute, which every checkout puts back to the engine's setting (:func:`_checked_out`): it is
    one attribute, where ``execution_options(isolation_level=...)`` is a greenlet trip and
    SQLAlchemy's isolation bookkeeping out and back (~5% of a ctx.db delivery's Python), and an engine
    option is applied through an engine_connect listener (see :class:`Database`)."""

    __slots__ = ("_conn", "_executor")

    def __init__(self, engine: AsyncEngine) -> None:
        self._conn = engine.connect()

    async def __aenter__(self) -> AsyncpgExecutor:
        conn = await self._conn.__aenter__()
        # Connection.connection (the pooled DB-API connection) of a connection just checked out is an
        # attribute, not I/O: it spares get_raw_connection()'s trip through a greenlet.
        pooled = conn.sync_connection.connection  # type: ignore[union-attr]
        pooled.dbapi_connection.autocommit = True  # type: ignore[union-attr]
        self._executor = AsyncpgExecutor(pooled.driver_connection, conn)
        return self._executor

    async def __aexit__(self, *exc_info: Any) -> None:
        executor, conn = self._executor, self._conn
        try:
            try:
                await executor.close_session()
            finally:
                if executor.discarded or executor.in_transaction():
                    executor.discard()
                    await conn.invalidate()
        finally:
            await conn.__aexit__(*exc_info)


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


def _ended_under_a_statement(context: ExceptionContext) -> BaseException | None:
    """``handle_error``: a statement through SQLAlchemy (``ctx.db``) that met the server's end of its
    connection halfway (:func:`~consumer_kit.store.driver_errors.ended_by_the_server`) fails with the error
    SQLAlchemy raises for a connection lost under a statement, invalidated, as the store's do. (SQLAlchemy
    chains the driver's own error under it, as it does for every error.)"""
    original = context.original_exception
    if not ended_by_the_server(original.__cause__):
        return None
    context.is_disconnect = True
    dbapi_error = context.dialect.loaded_dbapi.Error
    lost = connection_ended()
    orig = dbapi_error(f"{type(lost)}: {lost}")  # the form SQLAlchemy's asyncpg adapter gives driver errors
    orig.__cause__ = lost
    return DBAPIError.instance(context.statement, context.parameters, orig, dbapi_error,
                               connection_invalidated=True, dialect=context.dialect)


def _checked_out(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """Pool ``checkout`` hook: a connection that is closed or still inside a transaction is thrown
    away and another one checked out; one that served ``ctx.db`` is back at the engine's
    isolation setting (``autocommit = False`` restores the level the engine was configured with)."""
    driver = dbapi_connection.driver_connection
    if driver.is_closed() or driver.is_in_transaction():
        log.warning("discarding a pooled database connection that was %s",
                    "closed" if driver.is_closed() else "inside a transaction")
        raise DisconnectionError("connection in doubt")
    dbapi_connection.autocommit = False
