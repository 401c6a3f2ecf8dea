"""``consumer-kit db upgrade|check|revision``: consumer-kit's schema and the app's (APP_MIGRATIONS)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from consumer_kit.cli.parsing import DATABASE
from consumer_kit.cli.running import settings_from_env
from consumer_kit.errors import ConfigurationError

if TYPE_CHECKING:
    from consumer_kit.settings import Settings


async def schema(action: str) -> int:
    """``db upgrade`` (``action="upgrade"``) or ``db check``: exit 1 when a schema is not at its head."""
    from consumer_kit.store import AppMigrations, app_revisions, create_engine, schema_revisions, upgrade
    from consumer_kit.store.database import sqlite_path
    from consumer_kit.store.diagnosis import safe_url

    settings = settings_from_env()
    app = AppMigrations.from_settings(settings)
    engine = create_engine(settings.database_url, pooler=settings.database_pooler)
    try:
        if action == "upgrade":
            await upgrade(engine, app=app)
        else:
            path = sqlite_path(engine)
            if path is not None and not path.exists():  # a check never creates the file it checks
                raise ConfigurationError(f"there is no database at {safe_url(engine.url)}: nothing has run with "
                                         "this DATABASE_URL here yet (`consumer-kit db upgrade` makes it)")
        current, head = await schema_revisions(engine)
        print(f"schema revision {current or 'none'} (head {head})")
        ok = current == head
        if app is not None:
            current, head = await app_revisions(engine, app)
            print(f"app schema revision {current or 'none'} (head {head or 'none'}, APP_MIGRATIONS)")
            ok = ok and current == head
        return 0 if ok else 1
    finally:
        await engine.dispose()


async def partition_inbox() -> int:
    """``db partition-inbox``: make the plain inbox the partitioned one (INBOX_PARTITION_SECONDS), its rows kept."""
    import asyncpg
    from sqlalchemy.engine import make_url

    from consumer_kit.store import partitions, utcnow

    settings = settings_from_env()
    url = make_url(settings.database_url)
    if url.get_backend_name() != "postgresql" or not settings.inbox_partition_seconds:
        raise ConfigurationError("the partitioned inbox is PostgreSQL's: set DATABASE_URL to it and "
                                 "INBOX_PARTITION_SECONDS to the length of a generation (say 86400)")
    conn = await asyncpg.connect(url.set(drivername="postgresql").render_as_string(hide_password=False))
    try:
        made = await partitions.partition(conn, seconds=settings.inbox_partition_seconds, now=utcnow())
        current = await conn.fetchval("SELECT current FROM inbox_rotation")
    finally:
        await conn.close()
    seconds = settings.inbox_partition_seconds
    print(f"the inbox {'is now' if made else 'was already'} partitioned: generations of "
          f"{int(seconds) if seconds.is_integer() else seconds} s, new keys in generation {current}")
    return 0


def revision(args: argparse.Namespace) -> int:
    """``db revision -m MESSAGE``: a new, empty revision file in APP_MIGRATIONS."""
    from consumer_kit.store import AppMigrations

    app = AppMigrations.from_settings(settings_from_env())
    if app is None:
        raise ConfigurationError("APP_MIGRATIONS is not set: set it to the directory for your app's revisions "
                                 "(say myapp/migrations), then run this again")
    print(app.revision(args.message))
    return 0


async def refuse_missing(settings: Settings) -> None:
    """Refuse, rather than create, a database that is not there (for commands that only read)."""
    from consumer_kit.store import check_schema, create_engine

    engine = create_engine(settings.database_url, pool_size=1, pooler=settings.database_pooler)
    try:
        await check_schema(engine)
    finally:
        await engine.dispose()


def _partition(_args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(partition_inbox())


def _run(action: str) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        import asyncio

        return asyncio.run(schema(action))

    return run


def add_commands(commands: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``db upgrade|check|revision`` on ``commands`` (``command`` makes a sub-parser)."""
    group = command(commands, "db", help="schema management",
                    description="consumer-kit's tables (its Alembic migrations) and the app's own (APP_MIGRATIONS).")
    db_commands = group.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    upgrade_command = command(
        db_commands, "upgrade", help="apply consumer-kit's migrations, then the app's (APP_MIGRATIONS)",
        description="Apply consumer-kit's migrations to DATABASE_URL, then the app's (APP_MIGRATIONS), and print "
        "the revisions; exit 1 when a schema is still not at its head.", environment=DATABASE)
    upgrade_command.set_defaults(func=_run("upgrade"))
    check_command = command(
        db_commands, "check", help="exit 1 when the schema (or the app's) is out of date",
        description="Print DATABASE_URL's schema revision (and the app's); exit 1 when either is not at its head. "
        "It never creates a database.", environment=DATABASE)
    check_command.set_defaults(func=_run("check"))
    part = command(
        db_commands, "partition-inbox", help="make the inbox the partitioned one (INBOX_PARTITION_SECONDS)",
        description="Turn the plain inbox table into the partitioned one (PostgreSQL), its rows kept as its first "
        "generation. The column and index are added online; the last step renames the table in one short "
        "transaction, tried until it gets its lock. Stop the workers for it, then start them with "
        "INBOX_PARTITION_SECONDS set.", environment=(*DATABASE, "inbox_partition_seconds"))
    part.set_defaults(func=_partition)
    new = command(db_commands, "revision", help="write a new, empty revision file in APP_MIGRATIONS",
                  description="Write a new, empty Alembic revision file in APP_MIGRATIONS, after the newest one, "
                  "and print its path.", environment=("app_migrations",))
    new.add_argument("-m", "--message", required=True, help="what the revision does (its file is named after it)")
    new.set_defaults(func=revision)
