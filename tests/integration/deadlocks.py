"""A real PostgreSQL deadlock against a creation's statement, so that tests can show it is run again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import datetime
from typing import TypeVar

import asyncpg
from sqlalchemy.engine import URL, make_url

from consumer_kit.store.receipts import Scope, stripe_of

T = TypeVar("T")


async def deadlocked(url: str | URL, scope: Scope, digest: str, now: datetime, starts: str, run: Awaitable[T]) -> T:
    """Await ``run``, whose statement (its text starting with ``starts``) creates a receipt for ``digest``
    in ``scope``, after walking that statement into a deadlock which PostgreSQL resolves by aborting it.

    Another transaction inserts the same key's receipt and keeps it uncommitted: the statement takes
    its count row (the stripe of ``digest``) and waits for that receipt. The other transaction then
    asks for the count row. Its deadlock_timeout is long, so only the statement's backend runs the
    check, and the statement is the one aborted. The other transaction then rolls back; ``run``'s
    result is returned (the caller checks it was created once)."""
    where = (scope.tenant, scope.application, scope.operation)
    other = await asyncpg.connect(make_url(url).set(drivername="postgresql").render_as_string(hide_password=False))
    try:
        await other.execute("SET deadlock_timeout = '60s'")
        transaction = other.transaction()
        await transaction.start()
        await other.execute(
            "INSERT INTO idempotency_receipts (tenant, application, operation, key_digest, fingerprint,"
            " resource_id, response, generated, created_at, expires_at)"
            " VALUES ($1, $2, $3, $4, 'f', 'r', '{}', false, $5, $5)", *where, digest, now)
        task = asyncio.ensure_future(run)
        waiting = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                   " AND wait_event_type = 'Lock' AND query LIKE $1")
        while not await other.fetchval(waiting, starts + "%"):
            assert not task.done(), task
            await other.execute("SELECT pg_stat_clear_snapshot()")  # the view is read once per transaction
            await asyncio.sleep(0.01)
        # This waits for the statement to end, which waits for this transaction: it returns (well
        # before its own 60 s deadlock check) only once PostgreSQL aborted the statement.
        await other.execute("UPDATE idempotency_scopes SET live = live WHERE tenant = $1 AND application = $2"
                            " AND operation = $3 AND stripe = $4", *where, stripe_of(digest), timeout=30)
        await transaction.rollback()
        return await task
    finally:
        await other.close()
