"""Alembic environment for consumer-kit's own tables.

consumer-kit runs migrations with a connection it opened (``config.attributes["connection"]``); the
plain ``alembic`` command works too, given ``DATABASE_URL``.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import Connection

from consumer_kit.settings import Settings
from consumer_kit.store.database import VERSION_TABLE, create_engine
from consumer_kit.store.tables import metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_with_own_engine() -> None:
    settings = Settings()
    engine = create_engine(settings.database_url, pooler=settings.database_pooler)
    async with engine.begin() as conn:
        await conn.run_sync(_run)
    await engine.dispose()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    asyncio.run(_run_with_own_engine())
