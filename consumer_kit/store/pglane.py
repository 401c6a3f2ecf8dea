"""The inbox's hot path on PostgreSQL, spoken to asyncpg directly.

SQLAlchemy's async layer costs about twice asyncpg's CPU per statement (measured by
``bench/pipeline.py``), and the claim and the completion run for every delivery. So on PostgreSQL
those statements go straight to asyncpg, on a pool of their own (the lane): the claim in autocommit
(one statement that also reports the row it found, so a repeat costs no second read), the
completion on the connection of the handler's transaction, so that it commits with the handler's
writes. Handlers registered with ``driver="asyncpg"`` run their whole transaction on a lane
connection. Another component's writes that must commit with a claim or a completion ride in the
same statement (:class:`Rider`). Everything else in the store stays on SQLAlchemy Core.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

if TYPE_CHECKING:  # asyncpg is the `postgres` extra: a SQLite-only install never imports it
    import asyncpg

_COLUMNS = (
    "consumer, key_digest, namespace, version, fingerprint, state, locked_until, lease_token, attempts,"
    " outcome, result, last_error, created_at, updated_at, expires_at"
)
LOOKUP = f"SELECT {_COLUMNS} FROM inbox WHERE consumer = $1 AND key_digest = $2"
# The two-transaction claim in one statement, in autocommit: insert the row, or take over a started
# row for the same request whose lease ran out (or was released), and in any case return the row as
# it stood (``inbox_row``, this statement's snapshot) for the verdict. The insert is skipped outright
# when the row is completed, dead, leased or for another request, so a redelivery of finished work
# writes, locks and flushes nothing. Concurrent claimers serialise on the row; one gets it.
_CLAIM_HEAD = (
    "inbox_row AS (SELECT state, fingerprint, locked_until, attempts, result FROM inbox"
    " WHERE consumer = $1 AND key_digest = $2),"
    " anchor AS (INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, locked_until,"
    " lease_token, attempts, created_at, updated_at, expires_at)"
    " SELECT $1::varchar, $2::varchar, $3::varchar, $4::integer, $5::varchar, 'started', $6::timestamptz,"
    " $7::varchar, 1, $8::timestamptz, $8::timestamptz, $9::timestamptz"
    " WHERE NOT EXISTS (SELECT 1 FROM inbox_row WHERE state <> 'started' OR fingerprint <> $5 OR locked_until > $8)"
    " ON CONFLICT (consumer, key_digest) DO UPDATE SET locked_until = $6, lease_token = $7,"
    " attempts = inbox.attempts + 1, updated_at = $8"
    " WHERE inbox.state = 'started' AND inbox.fingerprint = $5"
    " AND (inbox.locked_until IS NULL OR inbox.locked_until <= $8)"
    " RETURNING attempts)"
)
_CLAIM_COLUMNS = (
    "(SELECT attempts FROM anchor) AS anchor_rows, r.state AS inbox_state, r.fingerprint AS inbox_fingerprint,"
    " r.locked_until AS inbox_locked_until, r.attempts AS inbox_attempts, r.result AS inbox_result"
)  # prefixed: a rider's columns share the row
_CLAIM_SOURCE = "(SELECT 1) AS inbox_one LEFT JOIN inbox_row r ON true"
CLAIM = f"WITH {_CLAIM_HEAD} SELECT {_CLAIM_COLUMNS} FROM {_CLAIM_SOURCE}"
INSERT_COMPLETED = (
    "INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts, outcome,"
    " created_at, updated_at, expires_at)"
    " VALUES ($1, $2, $3, $4, $5, 'completed', 1, $6, $7, $7, $8)"
    " ON CONFLICT (consumer, key_digest) DO NOTHING"
)
# The single-transaction claim of a key that exists, inside the handler's transaction, in one round
# trip: finish a row an earlier failed attempt left started and unleased (the effect commits with it
# or not at all), or return the row as it stood. The insert is skipped outright when the row is
# completed, dead, leased or for another request, so such a row is never locked. A row that
# appeared after this statement's snapshot makes both branches empty (the caller looks it up again).
CLAIM_DONE_OR_INSPECT = (
    "WITH claimed AS ("
    " INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts, outcome,"
    " created_at, updated_at, expires_at)"
    " SELECT $1::varchar, $2::varchar, $3::varchar, $4::integer, $5::varchar, 'completed', 1, $6::varchar,"
    " $7::timestamptz, $7::timestamptz, $8::timestamptz"
    " WHERE NOT EXISTS (SELECT 1 FROM inbox WHERE consumer = $1 AND key_digest = $2"
    " AND (state <> 'started' OR fingerprint <> $5 OR locked_until > $7))"
    " ON CONFLICT (consumer, key_digest) DO UPDATE SET state = 'completed', locked_until = NULL,"
    " lease_token = NULL, attempts = inbox.attempts + 1, outcome = $6, last_error = NULL, updated_at = $7,"
    " expires_at = $8"
    " WHERE inbox.state = 'started' AND inbox.fingerprint = $5"
    " AND (inbox.locked_until IS NULL OR inbox.locked_until <= $7)"
    " RETURNING attempts)"
    " SELECT attempts AS anchor_rows, NULL::text AS inbox_state, NULL::text AS inbox_fingerprint,"
    " NULL::timestamptz AS inbox_locked_until, NULL::integer AS inbox_attempts, NULL::json AS inbox_result"
    " FROM claimed"
    " UNION ALL"
    " SELECT NULL, state, fingerprint, locked_until, attempts, result FROM inbox"
    " WHERE consumer = $1 AND key_digest = $2 AND NOT EXISTS (SELECT 1 FROM claimed)"
)
INSERT_OUTBOX = (
    "INSERT INTO outbox (id, destination, headers, body, created_at, available_at, attempts)"
    " VALUES ($1, $2, $3::json, $4, $5, $6, 0) ON CONFLICT (id) DO NOTHING"
)
# The expiry the claim wrote is kept when it is at least $7 (the completion's own, less a lease):
# an update that changes no indexed column can be a heap-only tuple update, which writes no index
# entries (ix_inbox_expires_at is the only index besides the key). Retention then counts from at
# most one lease before the completion instead of from it.
COMPLETE = (
    "UPDATE inbox SET state = 'completed', locked_until = NULL, lease_token = NULL, outcome = $4,"
    " last_error = NULL, updated_at = $5, expires_at = CASE WHEN expires_at >= $7 THEN expires_at ELSE $6 END"
    " WHERE consumer = $1 AND key_digest = $2 AND state = 'started' AND lease_token = $3"
)


_CLAIM_PARAMS = 9
_COMPLETE_PARAMS = 7


class Rider:
    """Writes of another component that must commit together with an inbox statement, carried in it.

    The embedded coordinator's session creation rides on the claim (it commits if and only if the
    claim does, and is skipped when the lease is not ours) and its session ending on the completion:
    one round trip and one commit fewer per delivery than separate statements. In the inbox's
    statement the common table expression ``anchor`` is the inbox write (the claim's ``RETURNING
    attempts``, one row when this attempt holds the lease; the completion's ``RETURNING 1``); the
    lane appends the rider's ``ctes``, which may read ``anchor``, selects its ``columns`` as well as
    the inbox's own (among them ``anchor_rows``: the claim's attempts, or how many rows were
    completed) and joins its ``source`` (one row) to the inbox's. The rider numbers its parameters
    from ``$1``; the lane shifts them past the inbox statement's own. Its names must not clash with
    the inbox's: ``anchor``, ``inbox_row`` and ``inbox_one``, and columns ``anchor_rows`` and ``inbox_*``.

    ``row`` is the row the statement returned, once it ran; it stays ``None`` when the rider was not
    carried (no lane: SQLite, or a claim that took another path), and the rider's owner then does its
    writes itself.
    """

    __slots__ = ("args", "columns", "ctes", "row", "source")

    def __init__(self, ctes: str, columns: str, source: str, args: tuple[Any, ...]) -> None:
        self.ctes = ctes
        self.columns = columns
        self.source = source
        self.args = args
        self.row: Any = None


@functools.lru_cache(maxsize=64)
def _with_rider(head: str, params: int, columns: str, source: str,
                ctes: str, rider_columns: str, rider_source: str) -> str:
    """An inbox statement (``WITH head SELECT columns FROM source``) carrying a rider's parts."""
    def shift(sql: str) -> str:
        return re.sub(r"\$(\d+)", lambda m: f"${int(m.group(1)) + params}", sql)

    return (f"WITH {head}, {shift(ctes)} SELECT {columns}, {shift(rider_columns)}"
            f" FROM {source}, {shift(rider_source)}")


async def _keep_session(connection: asyncpg.Connection) -> None:
    """Pool reset hook: nothing to reset (see :meth:`PgLane.open`)."""


class PgLane:
    """A small asyncpg pool for the inbox's per-delivery statements (see the module docstring)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    @classmethod
    async def open(cls, sqlalchemy_url: str, *, size: int) -> PgLane:
        """Open a pool on the database of a ``postgresql+asyncpg://`` URL."""
        import asyncpg

        dsn = make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)
        # The lane runs only the fixed statements below, in autocommit, and never changes session
        # state; asyncpg's default reset on release would cost a round trip per statement for nothing.
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=size, reset=_keep_session)
        assert pool is not None
        return cls(pool)

    @classmethod
    async def for_engine(cls, engine: AsyncEngine, *, size: int) -> PgLane | None:
        """A lane on ``engine``'s database when it is PostgreSQL, else ``None``."""
        if engine.dialect.name != "postgresql":
            return None
        return await cls.open(engine.url.render_as_string(hide_password=False), size=size)

    async def close(self) -> None:
        """Close the pool."""
        await self.pool.close()

    async def lookup(self, consumer: str, digest: str, *, conn: asyncpg.Connection | None = None,
                     ) -> dict[str, Any] | None:
        """The row of ``(consumer, digest)``, or ``None``; on ``conn`` when given (a lane connection the
        caller holds, maybe inside a transaction), else on a pooled one."""
        row = await (conn or self.pool).fetchrow(LOOKUP, consumer, digest)
        return None if row is None else dict(row)

    async def claim(
        self, consumer: str, digest: str, namespace: str, version: int, fingerprint: str, *,
        locked_until: datetime, token: str, now: datetime, expires_at: datetime, rider: Rider | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> tuple[int, None] | tuple[None, dict[str, Any] | None]:
        """Insert or take over the row (see ``CLAIM``): ``(attempts, None)`` when we hold the lease,
        else ``(None, row)`` with the row as the statement found it (``None`` when it was not there).
        ``rider``'s writes happen in the same statement, only when we hold the lease. On ``conn``
        (a lane connection the caller holds, not in a transaction) when given."""
        args = (consumer, digest, namespace, version, fingerprint, locked_until, token, now, expires_at)
        target = conn or self.pool
        if rider is None:
            row = await target.fetchrow(CLAIM, *args)
        else:
            row = rider.row = await target.fetchrow(_with_rider(
                _CLAIM_HEAD, _CLAIM_PARAMS, _CLAIM_COLUMNS, _CLAIM_SOURCE, rider.ctes, rider.columns,
                rider.source), *args, *rider.args)
        return _claimed(digest, row)

    @staticmethod
    async def insert_completed_on(
        conn: asyncpg.Connection, consumer: str, digest: str, namespace: str, version: int, fingerprint: str,
        *, outcome: str, now: datetime, expires_at: datetime,
    ) -> bool:
        """The common case of the single-transaction claim, a new key: insert the row already
        completed, inside ``conn``'s transaction; ``False`` when the key exists."""
        status = await conn.execute(
            INSERT_COMPLETED, consumer, digest, namespace, version, fingerprint, outcome, now, expires_at)
        return bool(status == "INSERT 0 1")

    @staticmethod
    async def claim_done_or_inspect_on(
        conn: asyncpg.Connection, consumer: str, digest: str, namespace: str, version: int, fingerprint: str,
        *, outcome: str, now: datetime, expires_at: datetime,
    ) -> tuple[int, None] | tuple[None, dict[str, Any] | None]:
        """The single-transaction claim inside ``conn``'s transaction (see ``CLAIM_DONE_OR_INSPECT``):
        ``(attempts, None)`` when this transaction completes the row; else ``(None, row)``, the row as
        it stood (``None`` when it appeared after this statement began: look it up again)."""
        return _claimed(digest, await conn.fetchrow(
            CLAIM_DONE_OR_INSPECT, consumer, digest, namespace, version, fingerprint, outcome, now, expires_at))

    def connection(self) -> Any:
        """``async with lane.connection() as conn, conn.transaction():`` for a handler registered with
        ``driver="asyncpg"``.

        Like SQLAlchemy's pool (and psycopg's, and PgBouncer in transaction mode), the lane resets only
        what a transaction scopes: a handler's writes commit or roll back with the delivery. Session
        state a handler sets outside the transaction's scope (``SET`` without ``LOCAL``, session
        advisory locks, ``LISTEN``, cursors ``WITH HOLD``) stays with the pooled connection; asyncpg's
        full reset on every release would cost each delivery another round trip.
        """
        return self.pool.acquire()

    @staticmethod
    async def complete_on(
        conn: asyncpg.Connection, consumer: str, digest: str, token: str, *, outcome: str,
        now: datetime, expires_at: datetime, keep_from: datetime, rider: Rider | None = None,
    ) -> bool:
        """:meth:`complete` on a lane connection; ``False`` when the lease was lost. The row's expiry
        becomes ``expires_at`` unless it is already ``keep_from`` or later (see ``COMPLETE``).
        ``rider``'s writes happen in the same statement (and roll back with the transaction when the
        lease was lost)."""
        args = (consumer, digest, token, outcome, now, expires_at, keep_from)
        if rider is None:
            return bool(await conn.execute(COMPLETE, *args) == "UPDATE 1")
        rider.row = await conn.fetchrow(_with_rider(
            f"anchor AS ({COMPLETE} RETURNING 1)", _COMPLETE_PARAMS, "(SELECT count(*) FROM anchor) AS anchor_rows",
            "(SELECT 1) AS inbox_one", rider.ctes, rider.columns, rider.source), *args, *rider.args)
        return bool(rider.row["anchor_rows"] == 1)

    @staticmethod
    async def insert_outbox(conn: asyncpg.Connection, rows: list[dict[str, Any]], channel: str) -> None:
        """Write staged outbox rows on a lane connection and notify the relays at commit."""
        await conn.executemany(INSERT_OUTBOX, [
            (r["id"], r["destination"], json.dumps(r["headers"]), r["body"], r["created_at"], r["available_at"])
            for r in rows
        ])
        await conn.execute("SELECT pg_notify($1, '')", channel)

    @staticmethod
    async def driver(conn: AsyncConnection) -> asyncpg.Connection:
        """The asyncpg connection under an SQLAlchemy connection (inside its transaction)."""
        raw = await conn.get_raw_connection()
        adapter = raw.dbapi_connection
        # SQLAlchemy's asyncpg adapter sends BEGIN lazily, with the first statement it executes. A
        # statement sent to the driver before that would run outside the transaction (autocommit), so
        # make the adapter begin now. The method is private (SQLAlchemy is pinned below 2.1); without
        # it, fall back to a statement through SQLAlchemy, which begins the same way.
        if not getattr(adapter, "_started", True):
            start = getattr(adapter, "_start_transaction", None)
            if start is not None:
                await start()
            else:
                await conn.exec_driver_sql("SELECT 1")
        driver: asyncpg.Connection = raw.driver_connection
        if not driver.is_in_transaction():
            raise RuntimeError("the inbox completion must run inside the handler's transaction")
        return driver

    async def insert_completed(
        self, conn: AsyncConnection, consumer: str, digest: str, namespace: str, version: int,
        fingerprint: str, *, outcome: str, now: datetime, expires_at: datetime,
    ) -> bool:
        """The single-transaction claim, inside ``conn``'s transaction; ``False`` on a conflict."""
        status = await (await self.driver(conn)).execute(
            INSERT_COMPLETED, consumer, digest, namespace, version, fingerprint, outcome, now, expires_at
        )
        return bool(status == "INSERT 0 1")

    async def complete(
        self, conn: AsyncConnection, consumer: str, digest: str, token: str, *, outcome: str,
        now: datetime, expires_at: datetime, keep_from: datetime, rider: Rider | None = None,
    ) -> bool:
        """Seed 003's completion, inside ``conn``'s transaction; ``False`` when the lease was lost."""
        return await self.complete_on(await self.driver(conn), consumer, digest, token, outcome=outcome,
                                      now=now, expires_at=expires_at, keep_from=keep_from, rider=rider)


def _claimed(digest: str, row: Any) -> tuple[int, None] | tuple[None, dict[str, Any] | None]:
    """A claim statement's answer: ``(attempts, None)`` when it took the row, else ``(None, row)`` with
    the inbox row as the statement saw it (``None`` when there was none)."""
    if row is None:
        return None, None
    if row["anchor_rows"] is not None:
        return int(row["anchor_rows"]), None
    if row["inbox_state"] is None:
        return None, None
    return None, {"key_digest": digest, "state": row["inbox_state"], "fingerprint": row["inbox_fingerprint"],
                  "locked_until": row["inbox_locked_until"], "attempts": row["inbox_attempts"],
                  "result": row["inbox_result"]}
