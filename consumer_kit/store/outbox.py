"""The transactional outbox: messages written in the same transaction as the effect that causes them.

A handler stages messages with ``ctx.outbox.publish(...)`` (:class:`OutboxWriter`); the pipeline
inserts them in the transaction that also completes the inbox row, so a message exists if and only if
its effect committed. Code outside a handler uses :meth:`Outbox.enqueue` inside its own transaction.

A handler row's id is an HMAC of the consumer, the operation key and the publish's position, so a
handler that runs again after a takeover writes the same ids, and the raw key is never stored. The
relay (:mod:`consumer_kit.relay`) publishes each row with that id as the destination's dedup id.

Claiming: on PostgreSQL a batch is locked ``FOR UPDATE SKIP LOCKED`` for the length of its
transaction, so several relays share the table without publishing a row twice; a relay that dies
mid-batch releases its rows with its connection, and they go out again with the same id. SQLite has
one relay: rows are read, published, then marked, without a write lock held across the network.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Row, delete, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from consumer_kit.keys import KeyDigester, OperationKey
from consumer_kit.store.inbox import Clock, utcnow
from consumer_kit.store.pglane import PgLane
from consumer_kit.store.tables import UTCDateTime, outbox

if TYPE_CHECKING:
    import asyncpg

NOTIFY_CHANNEL = "consumer_kit_outbox"
"""PostgreSQL channel notified when outbox rows are written; relays LISTEN on it."""


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """One outbox row as the relay hands it to a publisher. ``id`` is the dedup id to publish with."""

    id: str
    destination: str
    body: bytes
    headers: Mapping[str, str]
    attempts: int = 0


@dataclass(frozen=True, slots=True)
class OutboxStats:
    """Pending rows and the age of the oldest, for metrics and health checks."""

    pending: int
    oldest_age_seconds: float


def _row(message_id: str, destination: str, body: bytes | str, headers: Mapping[str, str] | None,
         now: datetime, delay: float) -> dict[str, Any]:
    return dict(
        id=message_id, destination=destination,
        body=body.encode("utf-8") if isinstance(body, str) else bytes(body),
        headers=dict(headers or {}), created_at=now, available_at=now + timedelta(seconds=delay),
        attempts=0, published_at=None, last_error=None,
    )


async def _insert(target: AsyncConnection | AsyncSession, rows: list[dict[str, Any]]) -> None:
    bind = target.bind if isinstance(target, AsyncSession) else target
    # Ids derive from the key: a row that exists already came from an attempt of the same work (one
    # that completed, or one whose lease we hold now). Skip it; the inbox completion decides who wins.
    insert = postgresql.insert if bind.dialect.name == "postgresql" else sqlite.insert
    await target.execute(insert(outbox).on_conflict_do_nothing(index_elements=[outbox.c.id]), rows)
    if bind.dialect.name == "postgresql":
        # Delivered at commit, and only if the transaction commits.
        await target.execute(text("SELECT pg_notify(:channel, '')"), {"channel": NOTIFY_CHANNEL})


@dataclass(slots=True)
class OutboxWriter:
    """``ctx.outbox``: stages messages during a handler; the pipeline writes them in its transaction."""

    session: AsyncSession | None
    digester: KeyDigester
    consumer: str
    key: OperationKey
    clock: Clock = utcnow
    _rows: list[dict[str, Any]] = field(default_factory=list)

    def publish(self, destination: str, body: bytes | str, *, headers: Mapping[str, str] | None = None,
                delay: float = 0.0) -> str:
        """Stage a message for ``destination``; returns its stable message id.

        The row commits with the handler's effect and the inbox completion, or not at all. The id is
        the same every time this handler publishes its n-th message for this key.
        """
        position = len(self._rows)
        message_id = self.digester.digest(f"outbox:{self.consumer}:{position}:{self.key}")
        self._rows.append(_row(message_id, destination, body, headers, self.clock(), delay))
        return message_id

    async def flush(self, connection: asyncpg.Connection | None = None) -> None:
        """Insert the staged rows through the handler's session, or through ``connection`` for a
        handler registered with ``driver="asyncpg"`` (the pipeline calls this)."""
        if self._rows:
            rows, self._rows = self._rows, []
            if connection is not None:
                await PgLane.insert_outbox(connection, rows, NOTIFY_CHANNEL)
            else:
                assert self.session is not None, "an asyncpg handler's rows go through its connection"
                await _insert(self.session, rows)


class OutboxBatch:
    """Rows claimed by one relay round, and what became of each."""

    def __init__(self, messages: list[OutboxMessage]) -> None:
        self.messages = messages
        self.published: list[str] = []
        self.failed: dict[str, tuple[str, float]] = {}

    def mark_published(self, message_id: str) -> None:
        """The destination confirmed the message."""
        self.published.append(message_id)

    def mark_failed(self, message_id: str, error: str, retry_in: float) -> None:
        """Publishing failed; try the row again after ``retry_in`` seconds."""
        self.failed[message_id] = (error[:500], retry_in)



class Outbox:
    """Write, claim, mark and sweep outbox rows; one method per database operation."""

    def __init__(self, engine: AsyncEngine, *, clock: Clock = utcnow) -> None:
        self.engine = engine
        self.clock = clock

    async def enqueue(self, session: AsyncSession | AsyncConnection, destination: str, body: bytes | str, *,
                      headers: Mapping[str, str] | None = None, message_id: str | None = None,
                      delay: float = 0.0) -> str:
        """Insert a message inside the caller's transaction (outside a handler); returns its id.

        Pass ``message_id`` when the caller has a stable identity for the message (so a repeated
        transaction cannot publish twice under different ids); by default it is random.
        """
        message_id = message_id or secrets.token_hex(16)
        await _insert(session, [_row(message_id, destination, body, headers, self.clock(), delay)])
        return message_id

    @contextlib.asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[OutboxBatch]:
        """Claim up to ``limit`` due rows; on leaving, record what the caller marked on the batch.

        PostgreSQL: the rows stay locked (``SKIP LOCKED`` for other relays) until the marks commit.
        """
        now = self.clock()
        due = (
            select(outbox.c.id, outbox.c.destination, outbox.c.body, outbox.c.headers, outbox.c.attempts)
            .where(outbox.c.published_at.is_(None), outbox.c.available_at <= now)
            .order_by(outbox.c.available_at)
            .limit(limit)
        )
        if self.engine.dialect.name == "postgresql":
            async with self.engine.begin() as conn:
                rows = (await conn.execute(due.with_for_update(skip_locked=True))).all()
                batch = OutboxBatch([_message(row) for row in rows])
                yield batch
                await self._record(conn, batch)
            return
        async with self.engine.connect() as conn:
            rows = (await conn.execute(due)).all()
        batch = OutboxBatch([_message(row) for row in rows])
        yield batch
        async with self.engine.begin() as conn:
            await self._record(conn, batch)

    async def _record(self, conn: AsyncConnection, batch: OutboxBatch) -> None:
        now = self.clock()
        if batch.published:
            await conn.execute(
                update(outbox).where(outbox.c.id.in_(batch.published))
                .values(published_at=now, attempts=outbox.c.attempts + 1, last_error=None)
            )
        for message_id, (error, retry_in) in batch.failed.items():
            await conn.execute(
                update(outbox).where(outbox.c.id == message_id)
                .values(attempts=outbox.c.attempts + 1, last_error=error,
                        available_at=now + timedelta(seconds=retry_in))
            )

    async def stats(self) -> OutboxStats:
        """How many rows wait to be published, and how old the oldest is."""
        oldest_created = func.min(outbox.c.created_at, type_=UTCDateTime())
        query = select(func.count(), oldest_created).where(outbox.c.published_at.is_(None))
        async with self.engine.connect() as conn:
            count, oldest = (await conn.execute(query)).one()
        age = (self.clock() - oldest).total_seconds() if oldest is not None else 0.0
        return OutboxStats(int(count), max(0.0, age))

    async def get(self, message_id: str) -> dict[str, Any] | None:
        """One row by id (for operators and tests)."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(outbox).where(outbox.c.id == message_id))).first()
        return row._asdict() if row is not None else None

    async def sweep(self, retention_seconds: float, *, batch_size: int = 500) -> int:
        """Delete rows published more than ``retention_seconds`` ago, in short batches."""
        total = 0
        while True:
            cutoff = self.clock() - timedelta(seconds=retention_seconds)
            async with self.engine.begin() as conn:
                ids = select(outbox.c.id).where(outbox.c.published_at <= cutoff).limit(batch_size)
                if conn.dialect.name == "postgresql":
                    ids = ids.with_for_update(skip_locked=True)
                found = list((await conn.execute(ids)).scalars())
                if found:
                    await conn.execute(delete(outbox).where(outbox.c.id.in_(found)))
            total += len(found)
            if len(found) < batch_size:
                return total

    @contextlib.asynccontextmanager
    async def listen(self, wake: Callable[[], None]) -> AsyncIterator[bool]:
        """Call ``wake`` whenever rows are written (PostgreSQL NOTIFY); yields whether it listens.

        On SQLite it yields ``False`` and the relay relies on polling.
        """
        if self.engine.dialect.name != "postgresql":
            yield False
            return
        async with self.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None

            def _notified(*_args: Any) -> None:
                wake()

            await raw.add_listener(NOTIFY_CHANNEL, _notified)
            try:
                yield True
            finally:
                with contextlib.suppress(Exception):
                    await raw.remove_listener(NOTIFY_CHANNEL, _notified)


def _message(row: Row[Any]) -> OutboxMessage:
    return OutboxMessage(id=row.id, destination=row.destination, body=bytes(row.body),
                         headers=dict(row.headers or {}), attempts=row.attempts)
