"""Waiting for a statement that sleeps (``pg_sleep``) to be running on the test's database: how the
cancellation tests know the statement they cancel is under way, not yet sent or already done."""

from __future__ import annotations

import asyncio

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

_RUNNING = text("SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep%' AND state = 'active'"
                " AND datname = current_database() AND pid <> pg_backend_pid()")


async def _running(conn: AsyncConnection) -> bool:
    """One look at ``pg_stat_activity``, in a transaction of its own: PostgreSQL snapshots the view at a
    transaction's first read of it, so polling inside one transaction sees the same rows for ever."""
    try:
        return bool((await conn.execute(_RUNNING)).scalar())
    finally:
        await conn.rollback()


async def sleeping_statement(engine: AsyncEngine, task: asyncio.Task[object], *, within: float = 60) -> None:
    """Return once a ``pg_sleep`` statement runs on ``engine``'s database, which ``task`` sent; fail if
    ``task`` ends first (saying how), or after ``within`` seconds (a loaded CI host is slow)."""
    deadline = asyncio.get_running_loop().time() + within
    async with engine.connect() as conn:
        while not await _running(conn):
            assert not task.done(), task  # it ended before its statement ran: say how
            assert asyncio.get_running_loop().time() < deadline, "the statement did not start"
            await asyncio.sleep(0.02)
