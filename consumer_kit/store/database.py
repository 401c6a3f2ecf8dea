"""Engines and schema management: migrations applied at start on SQLite, checked on PostgreSQL.

Two sets of migrations live in one database: consumer-kit's own (shipped in the package, bookkept in
``consumer_kit_alembic_version``), and, when ``APP_MIGRATIONS`` names them, the app's (:class:`AppMigrations`,
bookkept in ``alembic_version`` by default): plain Alembic revision files in a directory of the app's,
run by an environment consumer-kit ships (``consumer_kit/app_migrations``) on the same connection,
after consumer-kit's, in the same transaction (on PostgreSQL either both upgrades commit or neither).

Every function here that connects first translates a connection that fails into
:class:`~consumer_kit.errors.DatabaseUnavailable` (see :mod:`.diagnosis`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, event, inspect, text
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from consumer_kit.errors import ConfigurationError, DatabaseUnavailable, SchemaOutOfDate
from consumer_kit.extras import missing_extra
from consumer_kit.retry import START_UP
from consumer_kit.store.diagnosis import dropped_because, safe_url, unavailable

log = logging.getLogger("consumer_kit.store")

if TYPE_CHECKING:
    from consumer_kit.settings import Pooler, Settings

DEFERRED = "consumer_kit_sqlite_deferred"
"""Execution option: on SQLite, begin this connection's transactions DEFERRED instead of IMMEDIATE."""

VERSION_TABLE = "consumer_kit_alembic_version"
"""Alembic's bookkeeping table, named so that it cannot clash with the application's own Alembic."""


POOLER = "consumer_kit_pooler"
"""Engine execution option: what stands between the engine and PostgreSQL (``DATABASE_POOLER``), as
:func:`create_engine` was told; the store's own pool and the outbox relay read it from the engine."""


def create_engine(url: str, *, pool_size: int = 20, pooler: Pooler = "none") -> AsyncEngine:
    """An async engine for ``url`` with the settings consumer-kit relies on.

    SQLite gets WAL mode, a busy timeout (writers queue instead of failing at once) and
    ``BEGIN IMMEDIATE`` so that a read-then-write transaction cannot deadlock on lock upgrade. A URL
    that does not parse, or names a database consumer-kit cannot use, is a DatabaseUnavailable (whose
    message never quotes the URL: it may hold a password). ``pooler="transaction"``
    (``DATABASE_POOLER``): PostgreSQL is reached through a pooler in transaction mode, so that the
    drivers keep no prepared statement past a transaction (:func:`pooled_connect_args`).
    """
    try:
        scheme = make_url(url).drivername
    except (ArgumentError, ValueError, TypeError):
        raise DatabaseUnavailable(
            "DATABASE_URL does not parse as a database URL (not shown: it may hold a password); it should read "
            "like sqlite:///consumer-kit.db or postgresql://user:password@host:5432/database") from None
    if scheme.split("+")[0] not in ("sqlite", "postgresql"):
        raise DatabaseUnavailable(f"DATABASE_URL names a {scheme} database: consumer-kit works on SQLite "
                                  "(sqlite:///file.db) and PostgreSQL (postgresql://…)")
    try:
        if scheme.startswith("sqlite"):
            engine = create_async_engine(url, connect_args={"timeout": 30})
            _sqlite_pragmas(engine)
            return engine
        # No pre-ping: it costs a round trip per checkout. A connection that died is an error in
        # the pipeline, which retries the delivery; the pool then replaces it.
        if pooler == "transaction":
            return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800,
                                       connect_args=pooled_connect_args(scheme), execution_options={POOLER: pooler})
        return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800)
    except ModuleNotFoundError as exc:
        extra = "psycopg" if "+psycopg" in scheme else "postgres"
        raise ConfigurationError(str(missing_extra(extra, f"DATABASE_URL {scheme}://…", exc))) from exc
    except (NoSuchModuleError, ArgumentError, ValueError) as exc:
        raise DatabaseUnavailable(f"DATABASE_URL's driver {scheme!r} cannot be used ({type(exc).__name__}): "
                                  "use sqlite:///file.db or postgresql://…") from None


def pooled_connect_args(scheme: str) -> dict[str, Any]:
    """The driver's arguments for a pooler in transaction mode, which gives each transaction whichever
    server connection is free: a statement prepared under a name in one transaction is not there in
    the next (PgBouncer before 1.21 does not carry them over).

    psycopg prepares nothing (``prepare_threshold=None``). asyncpg caches none (``statement_cache_size=0``:
    its own statements are then parsed where they run, in the transaction that runs them); SQLAlchemy's
    asyncpg adapter caches none either, and the one it still prepares for each statement (to learn the
    result's columns) gets a name no other statement has, so that it never meets another's on a server
    connection (SQLAlchemy's documented ``prepared_statement_name_func``)."""
    if "+asyncpg" in scheme:
        return {"statement_cache_size": 0, "prepared_statement_cache_size": 0,
                "prepared_statement_name_func": _unique_statement_name}
    return {"prepare_threshold": None}


def _unique_statement_name() -> str:
    return f"__consumer_kit_{uuid.uuid4().hex}__"


def pooler_of(engine: AsyncEngine) -> Pooler:
    """What stands between ``engine`` and its database, as :func:`create_engine` was told (an engine
    made elsewhere: nothing)."""
    said = engine.get_execution_options().get(POOLER, "none")
    return "transaction" if said == "transaction" else "none"


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


@dataclass(frozen=True, slots=True)
class AppMigrations:
    """The app's own Alembic revisions (``APP_MIGRATIONS``): ``directory`` holds the revision files,
    ``version_table`` is where the database records which ran."""

    directory: Path
    version_table: str = "alembic_version"

    @classmethod
    def from_settings(cls, settings: Settings) -> AppMigrations | None:
        """``APP_MIGRATIONS`` as a directory (``path/to/versions``, or ``package:sub/dir`` inside an
        installed package), or ``None`` when it is not set."""
        location = settings.app_migrations
        if not location:
            return None
        path = Path(location)
        if ":" in location and not path.exists():
            package, _, inside = location.partition(":")
            try:
                path = Path(str(resources.files(package) / inside))
            except (ModuleNotFoundError, TypeError) as exc:
                raise ConfigurationError(f"APP_MIGRATIONS {location!r}: package {package!r} cannot be imported "
                                         f"({type(exc).__name__})") from None
        if not path.is_dir():
            raise ConfigurationError(f"APP_MIGRATIONS {location!r} is not a directory (of Alembic revision files)")
        return cls(path, settings.app_migrations_table)

    def config(self) -> Config:
        """The Alembic configuration that runs these revisions with consumer-kit's app environment."""
        config = Config()
        config.set_main_option("script_location", str(resources.files("consumer_kit") / "app_migrations"))
        config.set_main_option("path_separator", "os")  # one directory: split on os.pathsep, which it lacks
        config.set_main_option("version_locations", str(self.directory))
        config.attributes["version_table"] = self.version_table
        return config

    def head(self) -> str | None:
        """The newest revision in the directory (``None`` when it holds none)."""
        try:
            return ScriptDirectory.from_config(self.config()).get_current_head()
        except CommandError as exc:
            raise ConfigurationError(f"APP_MIGRATIONS {str(self.directory)!r}: {exc}") from None

    def revision(self, message: str) -> Path:
        """Write a new, empty revision file after the newest one; its path."""
        try:
            script = command.revision(self.config(), message=message)
        except CommandError as exc:
            raise ConfigurationError(f"APP_MIGRATIONS {str(self.directory)!r}: {exc}") from None
        assert script is not None and not isinstance(script, list)
        return Path(script.path)


def _upgrade(connection: Connection, revision: str, app: AppMigrations | None) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)
    if app is not None:
        app_config = app.config()
        app_config.attributes["connection"] = connection
        try:
            command.upgrade(app_config, "heads")
        except CommandError as exc:
            raise ConfigurationError(f"APP_MIGRATIONS {str(app.directory)!r}: {exc}") from None


@functools.cache
def head_revision() -> str | None:
    """The newest revision this package ships (read from the migration scripts once)."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _current(connection: Connection, table: str = VERSION_TABLE) -> str | None:
    # The version table read directly rather than through alembic's MigrationContext, which logs two
    # INFO lines each time: too many for a readiness probe every few seconds.
    if not inspect(connection).has_table(table):
        return None
    versions = connection.execute(text(f'SELECT version_num FROM "{table}"')).scalars().all()
    return versions[0] if len(versions) == 1 else None


@contextlib.asynccontextmanager
async def _reachable(engine: AsyncEngine) -> AsyncIterator[None]:
    """A connection that cannot be made comes out as DatabaseUnavailable, in words."""
    try:
        yield
    except (ConfigurationError, asyncio.CancelledError):
        raise
    except Exception as exc:
        error = unavailable(exc, engine.url)
        if error is None:
            raise
        raise error from exc


async def upgrade(engine: AsyncEngine, revision: str = "head", *, app: AppMigrations | None = None) -> None:
    """Apply consumer-kit's migrations up to ``revision``, then the app's (what ``consumer-kit db
    upgrade`` runs), in one transaction."""
    async with _reachable(engine), engine.begin() as conn:
        await conn.run_sync(_upgrade, revision, app)


async def schema_revisions(engine: AsyncEngine) -> tuple[str | None, str | None]:
    """``(current, head)``: the database's revision and the newest one this package ships."""
    async with _reachable(engine), engine.connect() as conn:
        return await conn.run_sync(_current), head_revision()


async def app_revisions(engine: AsyncEngine, app: AppMigrations) -> tuple[str | None, str | None]:
    """``(current, head)`` of the app's migrations."""
    head = app.head()
    async with _reachable(engine), engine.connect() as conn:
        return await conn.run_sync(_current, app.version_table), head


async def ensure_schema(engine: AsyncEngine, *, app: AppMigrations | None = None) -> None:
    """Upgrade SQLite in place (the app's migrations too); refuse to run on an out-of-date PostgreSQL
    schema (consumer-kit's or the app's).

    A worker's first statement meets whatever the database is going through. A connection the server
    ends while it is in use (an administrator's cut, a failover) or cannot serve yet (a server still
    starting) is opened again as :data:`~consumer_kit.retry.START_UP` allows (five attempts within ten
    seconds), each time with a warning. Anything else (a refused port or login, a missing database or
    schema) is reported at once: waiting cannot fix it, and the one-line error says what will."""
    budget = START_UP.budget()
    while True:
        try:
            if engine.dialect.name == "sqlite":
                await upgrade(engine, app=app)
            else:
                await check_schema(engine, app=app)
            return
        except Exception as exc:
            why = dropped_because(exc)
            delay = None if why is None else budget.next_delay()
            if delay is None:
                raise
            log.warning("the database at %s: %s; opening a connection again in %.1f s", safe_url(engine.url), why,
                        delay)
            await asyncio.sleep(delay)


async def check_schema(engine: AsyncEngine, *, app: AppMigrations | None = None) -> None:
    """Refuse (SchemaOutOfDate) a database whose schema is not at head, without changing anything; a
    SQLite file that does not exist is refused rather than created (DatabaseUnavailable)."""
    path = sqlite_path(engine)
    if path is not None and not path.exists():
        raise DatabaseUnavailable(f"there is no database at {safe_url(engine.url)} (no file {str(path)!r}): "
                                  "nothing has run with this DATABASE_URL here yet, or it points elsewhere")
    current, head = await schema_revisions(engine)
    if current is None:
        raise SchemaOutOfDate(f"the database at {safe_url(engine.url)} has no consumer-kit tables: run "
                              "`consumer-kit db upgrade` with this DATABASE_URL first")
    if current != head:
        raise SchemaOutOfDate(
            f"the database schema is at revision {current}, this consumer-kit needs {head}: "
            "run `consumer-kit db upgrade` (with the same DATABASE_URL) first"
        )
    if app is not None:
        current, head = await app_revisions(engine, app)
        if current != head:
            raise SchemaOutOfDate(f"the app's tables are at revision {current or 'none'}, APP_MIGRATIONS holds "
                                  f"{head}: run `consumer-kit db upgrade` first")
    await refuse_an_unannounced_pooler(engine)


UNANNOUNCED_POOLER = ("the database at {url} is reached through a pooler in transaction mode (PgBouncer's "
                      "pool_mode = transaction: {sign}), which DATABASE_POOLER does not say: set "
                      "DATABASE_POOLER=transaction")
"""The one line that refuses to start behind a pooler that ``DATABASE_POOLER`` does not announce."""

_PROBE = "consumer_kit.pooler_probe"
# 42P05 duplicate_prepared_statement, 26000 invalid_sql_statement_name: a statement prepared under a name
# by another client on the same server connection, or one of ours missing from the connection we were given.
_PREPARED_STATEMENT_CLASH = ("42P05", "26000")


async def refuse_an_unannounced_pooler(engine: AsyncEngine) -> None:
    """Refuse (ConfigurationError, one line) to run on PostgreSQL behind a pooler in transaction mode
    that ``DATABASE_POOLER`` does not announce: there, prepared statements fail at random under load,
    and the outbox relay's LISTEN hears nothing.

    There is no statement that asks a pooler what it is (PgBouncer's ``SHOW`` is for its admin console
    only), so this looks for its effect: a session setting made on one connection and read on a second
    one opened while the first is idle. Directly on PostgreSQL the second is another session and does not
    see it; through a transaction pooler the second is given the server connection the first left
    (PgBouncer hands out the one most recently freed), setting and prepared statements included."""
    if engine.dialect.name != "postgresql" or pooler_of(engine) == "transaction":
        return
    mark = secrets.token_hex(8)
    # The second connection is not the engine's: its pool may have room for one only.
    other = create_async_engine(engine.url, poolclass=NullPool)
    try:
        async with engine.connect() as first:
            # Deliberately session-wide (is_local false): the one thing a transaction pooler does not keep apart.
            await first.execute(text("SELECT set_config(:name, :mark, false)"), {"name": _PROBE, "mark": mark})
            await first.commit()
            async with other.connect() as second:
                seen = await second.scalar(text("SELECT current_setting(:name, true)"), {"name": _PROBE})
                await second.commit()
            await first.execute(text("SELECT set_config(:name, '', false)"), {"name": _PROBE})
            await first.commit()
    except DBAPIError as exc:
        if _sqlstate(exc) not in _PREPARED_STATEMENT_CLASH:
            raise
        sign = "another connection's prepared statement met ours"
        raise ConfigurationError(UNANNOUNCED_POOLER.format(url=safe_url(engine.url), sign=sign)) from None
    finally:
        await other.dispose()
    if seen == mark:
        sign = "a second connection was given the first one's session"
        raise ConfigurationError(UNANNOUNCED_POOLER.format(url=safe_url(engine.url), sign=sign))


def _sqlstate(exc: DBAPIError) -> str | None:
    # asyncpg's errors (under SQLAlchemy's adapter error, as its __cause__) and psycopg's carry it as sqlstate.
    for error in (exc.orig, exc.orig.__cause__ if exc.orig is not None else None):
        code = getattr(error, "sqlstate", None)
        if isinstance(code, str):
            return code
    return None


def sqlite_path(engine: AsyncEngine) -> Path | None:
    """The file of a SQLite database (``None`` for another database, or SQLite in memory)."""
    if engine.dialect.name != "sqlite":
        return None
    database = engine.url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)
