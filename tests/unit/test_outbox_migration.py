"""Migration 0003_outbox creates exactly the outbox table the store defines."""

from __future__ import annotations

from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection

from consumer_kit.store import create_engine, metadata, upgrade


def _diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return [d for d in compare_metadata(context, metadata)
            if "consumer_kit_alembic_version" not in str(d)]


async def test_upgrade_head_matches_the_table_definitions(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        await upgrade(engine)
        async with engine.connect() as conn:
            differences = await conn.run_sync(_diff)
    finally:
        await engine.dispose()
    assert [d for d in differences if "outbox" in str(d)] == []
