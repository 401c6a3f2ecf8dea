"""A table of effects for the source tests: one ``ticket`` column their handlers write a row into, and
the count of rows per ticket read back (an effect that happened twice shows as 2)."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from consumer_kit import Context


class EffectTable:
    """The effects table ``name`` on whichever database a test gives it."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def prepare(self, database_url: str) -> None:
        """Create the table if missing, and empty it (a PostgreSQL database is the run's, not the test's)."""
        engine = create_async_engine(database_url)
        try:
            async with engine.begin() as conn:
                await conn.exec_driver_sql(f"CREATE TABLE IF NOT EXISTS {self.name} (ticket VARCHAR(200) NOT NULL)")
                await conn.exec_driver_sql(f"DELETE FROM {self.name}")
        finally:
            await engine.dispose()

    async def write(self, ctx: Context, ticket: str) -> None:
        """The handler's effect: one row, in the delivery's transaction."""
        await ctx.db.execute(text(f"INSERT INTO {self.name} (ticket) VALUES (:t)"), {"t": ticket})

    async def counts(self, database_url: str) -> dict[str, int]:
        """Rows per ticket."""
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                rows = (await conn.exec_driver_sql(f"SELECT ticket, count(*) FROM {self.name} GROUP BY ticket")).all()
        finally:
            await engine.dispose()
        return {r[0]: int(r[1]) for r in rows}
