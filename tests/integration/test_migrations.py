"""`upgrade head` on an empty database yields exactly the table definitions (STYLE.md rule 9)."""

from __future__ import annotations

from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection

import consumer_kit.coordinator.tables  # noqa: F401  (registers the coordinator's tables)
from consumer_kit.store import create_engine, metadata, upgrade
from consumer_kit.store.database import VERSION_TABLE


def _diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(
        connection, opts={"compare_type": True, "version_table": VERSION_TABLE})
    return list(compare_metadata(context, metadata))


async def test_upgrade_head_matches_table_definitions(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        await upgrade(engine)
        async with engine.connect() as conn:
            diff = await conn.run_sync(_diff)
            tables = await conn.run_sync(lambda c: set(c.dialect.get_table_names(c)))
    finally:
        await engine.dispose()
    assert diff == []
    assert {"inbox", "dead_letters", "idempotency_receipts", "idempotency_scopes",
            "coordinator_resources"} <= tables
