"""Engines and schema management: migrations applied at start on SQLite, checked on PostgreSQL."""

from __future__ import annotations

import asyncio
import functools
from importlib import resources
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, event, inspect, text
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from consumer_kit.errors import ConfigurationError, SchemaOutOfDate
from consumer_kit.extras import missing_extra

DEFERRED = "consumer_kit_sqlite_deferred"
"""Execution option: on SQLite, begin this connection's transactions DEFERRED instead of IMMEDIATE."""

VERSION_TABLE = "consumer_kit_alembic_version"
"""Alembic's bookkeeping table, named so that it cannot clash with the application's own Alembic."""


def create_engine(url: str, *, pool_size: int = 20) -> AsyncEngine:
    """An async engine for ``url`` with the settings consumer-kit relies on.

    SQLite gets WAL mode, a busy timeout (writers queue instead of failing at once) and
    ``BEGIN IMMEDIATE`` so that a read-then-write transaction cannot deadlock on lock upgrade.
    """
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": 30})
        _sqlite_pragmas(engine)
        return engine
    try:
        # No pre-ping: it costs a round trip per checkout. A connection that died is an error in
        # the pipeline, which retries the delivery; the pool then replaces it.
        return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800)
    except ModuleNotFoundError as exc:
        extra = "psycopg" if "+psycopg" in url.split("://", 1)[0] else "postgres"
        raise ConfigurationError(str(missing_extra(extra, f"DATABASE_URL {url.split('://', 1)[0]}://…", exc))) from exc


def _sqlite_pragmas(engine: AsyncEngine) -> None:
    sync_engine = engine.sync_engine

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, decide when transactions begin (pysqlite's own handling
        # starts them lazily at the first write, which breaks read-then-write atomicity).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(sync_engine, "handle_error")
    def _on_error(context: ExceptionContext) -> None:
        # A cancelled await (a broker reconnect, the shutdown grace, a client that hung up) is an "exit
        # exception" to SQLAlchemy, which then invalidates the connection. With aiosqlite that leaks the
        # sqlite3 connection, still inside its transaction and holding the write lock, until the
        # garbage collector finds it: every other writer waits out the busy timeout. The statement
        # runs to its end in aiosqlite's thread whatever happens to the awaiting task, and the
        # rollback queues behind it, so the connection is sound: keep it, and let it roll back.
        if isinstance(context.original_exception, asyncio.CancelledError):
            context.is_disconnect = False

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # A handler's transaction may wait on the network before it writes; it takes the write lock
        # at its first write instead of holding it all along (see DEFERRED below).
        options = conn.get_execution_options()
        if options.get("isolation_level") == "AUTOCOMMIT":
            return
        deferred = options.get(DEFERRED, False)
        conn.exec_driver_sql("BEGIN DEFERRED" if deferred else "BEGIN IMMEDIATE")


def alembic_config() -> Config:
    """The Alembic configuration of the migrations shipped inside the package."""
    config = Config()
    config.set_main_option("script_location", str(resources.files("consumer_kit") / "migrations"))
    return config


def _upgrade(connection: Connection, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


@functools.cache
def head_revision() -> str | None:
    """The newest revision this package ships (read from the migration scripts once)."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _current(connection: Connection) -> tuple[str | None, str | None]:
    # The version table read directly rather than through alembic's MigrationContext, which logs two
    # INFO lines each time: too many for a readiness probe every few seconds.
    if not inspect(connection).has_table(VERSION_TABLE):
        return None, head_revision()
    versions = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    return (versions[0] if len(versions) == 1 else None), head_revision()


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Apply the migrations up to ``revision`` (what ``consumer-kit db upgrade`` runs)."""
    async with engine.begin() as conn:
        await conn.run_sync(_upgrade, revision)


async def schema_revisions(engine: AsyncEngine) -> tuple[str | None, str | None]:
    """``(current, head)``: the database's revision and the newest one this package ships."""
    async with engine.connect() as conn:
        return await conn.run_sync(_current)


async def ensure_schema(engine: AsyncEngine) -> None:
    """Upgrade SQLite in place; refuse to run on an out-of-date PostgreSQL schema."""
    if engine.dialect.name == "sqlite":
        await upgrade(engine)
        return
    current, head = await schema_revisions(engine)
    if current != head:
        raise SchemaOutOfDate(
            f"the database schema is at revision {current or 'none'}, this consumer-kit needs {head}: "
            "run `consumer-kit db upgrade` (with the same DATABASE_URL) first"
        )
