"""The transactional outbox: messages written in the same transaction as the effect that causes them.

A handler stages messages with ``ctx.outbox.publish(...)`` (:class:`OutboxWriter`); the pipeline
inserts them in the transaction that also completes the inbox row, so a message exists if and only if
its effect committed. Code outside a handler uses :meth:`Outbox.enqueue` inside its own transaction.

A handler row's id is an HMAC of the consumer, the operation key and the publish's position, so a
handler that runs again after a takeover writes the same ids, and the raw key is never stored. The
relay (:mod:`consumer_kit.outbox`) publishes each row with that id as the destination's dedup id.

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
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from consumer_kit.keys import KeyDigester, OperationKey
from consumer_kit.store import sql
from consumer_kit.store.connections import Database
from consumer_kit.store.executor import Executor, Row, SqlAlchemyExecutor
from consumer_kit.store.inbox import Clock, utcnow

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
    return {"id": message_id, "destination": destination,
            "body": body.encode("utf-8") if isinstance(body, str) else bytes(body),
            "headers": dict(headers or {}), "created_at": now, "available_at": now + timedelta(seconds=delay)}


async def write(ex: Executor, rows: list[dict[str, Any]]) -> None:
    """Insert outbox rows in ``ex``'s transaction; on PostgreSQL, wake the relays when it commits.

    Ids derive from the key: a row that exists already came from an attempt of the same work (one
    that completed, or one whose lease we hold now). It is skipped; the inbox completion decides who
    wins."""
    await ex.execute_many(sql.INSERT_OUTBOX, rows)
    if ex.dialect == "postgresql":
        await ex.execute(sql.NOTIFY, {"channel": NOTIFY_CHANNEL})  # delivered at commit, if it commits


@dataclass(slots=True)
class OutboxWriter:
    """``ctx.outbox``: stages messages during a handler; the pipeline writes them in its transaction."""

    digester: KeyDigester
    consumer: str
    key: OperationKey
    clock: Clock = utcnow
    trace_headers: Callable[[], Mapping[str, str]] | None = None
    """Traced, the current span's context as headers (``traceparent``...), stored with each row so
    that the relay publishes it on; headers given to :meth:`publish` win."""
    _rows: list[dict[str, Any]] = field(default_factory=list)

    def publish(self, destination: str, body: bytes | str, *, headers: Mapping[str, str] | None = None,
                delay: float = 0.0) -> str:
        """Stage a message for ``destination``; returns its stable message id.

        The row commits with the handler's effect and the inbox completion, or not at all. The id is
        the same every time this handler publishes its n-th message for this key.
        """
        position = len(self._rows)
        message_id = self.digester.digest(f"outbox:{self.consumer}:{position}:{self.key}")
        if self.trace_headers is not None:
            headers = {**self.trace_headers(), **(headers or {})}
        self._rows.append(_row(message_id, destination, body, headers, self.clock(), delay))
        return message_id

    async def flush(self, ex: Executor) -> None:
        """Insert the staged rows in the delivery's transaction (the pipeline calls this)."""
        if self._rows:
            await write(ex, self.take())

    def take(self) -> list[dict[str, Any]]:
        """The staged rows, to be written with others (a batch's); none are left staged."""
        rows, self._rows = self._rows, []
        return rows


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

    def __init__(self, database: Database, *, clock: Clock = utcnow,
                 trace_headers: Callable[[], Mapping[str, str]] | None = None) -> None:
        self.database = database
        self.clock = clock
        self.trace_headers = trace_headers
        """The current span's context as headers, which :meth:`enqueue` stores with each row (the app
        passes :func:`consumer_kit.tracing.current_headers`; the store knows no tracing)."""

    async def enqueue(self, session: AsyncSession | AsyncConnection, destination: str, body: bytes | str, *,
                      headers: Mapping[str, str] | None = None, message_id: str | None = None,
                      delay: float = 0.0) -> str:
        """Insert a message inside the caller's SQLAlchemy transaction (outside a handler); returns its id.
        With a span current (OpenTelemetry), the row carries its context (``trace_headers``).

        Pass ``message_id`` when the caller has a stable identity for the message (so a repeated
        transaction cannot publish twice under different ids); by default it is random.
        """
        message_id = message_id or secrets.token_hex(16)
        conn = await session.connection() if isinstance(session, AsyncSession) else session
        if not conn.in_transaction():
            raise RuntimeError("Outbox.enqueue runs inside the caller's transaction: begin one first")
        if self.trace_headers is not None:  # the current span's context, if any
            headers = {**self.trace_headers(), **(headers or {})}
        await write(SqlAlchemyExecutor(conn), [_row(message_id, destination, body, headers, self.clock(), delay)])
        return message_id

    @contextlib.asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[OutboxBatch]:
        """Claim up to ``limit`` due rows; on leaving, record what the caller marked on the batch.

        PostgreSQL: the rows stay locked (``SKIP LOCKED`` for other relays) until the marks commit.
        """
        params = {"now": self.clock(), "limit": limit}
        if self.database.dialect == "postgresql":
            async with self.database.transaction() as ex:
                batch = OutboxBatch([_message(row) for row in await ex.fetch_all(sql.CLAIM_OUTBOX, params)])
                yield batch
                await self._record(ex, batch)
            return
        async with self.database.connect() as ex:
            batch = OutboxBatch([_message(row) for row in await ex.fetch_all(sql.CLAIM_OUTBOX, params)])
        yield batch
        async with self.database.transaction() as ex:
            await self._record(ex, batch)

    async def _record(self, ex: Executor, batch: OutboxBatch) -> None:
        now = self.clock()
        await ex.execute_many(sql.MARK_PUBLISHED, [{"id": i, "now": now} for i in batch.published])
        await ex.execute_many(sql.MARK_FAILED, [
            {"id": i, "last_error": error, "available_at": now + timedelta(seconds=retry_in)}
            for i, (error, retry_in) in batch.failed.items()])

    async def stats(self) -> OutboxStats:
        """How many rows wait to be published, and how old the oldest is."""
        async with self.database.connect() as ex:
            row = await ex.fetch_one(sql.OUTBOX_STATS, {})
        assert row is not None
        oldest = row["oldest"]
        age = (self.clock() - oldest).total_seconds() if oldest is not None else 0.0
        return OutboxStats(int(row["pending"]), max(0.0, age))

    async def get(self, message_id: str) -> dict[str, Any] | None:
        """One row by id (for operators and tests)."""
        async with self.database.connect() as ex:
            row = await ex.fetch_one(sql.GET_OUTBOX, {"id": message_id})
        return dict(row) if row is not None else None

    async def sweep(self, retention_seconds: float, *, batch_size: int = 500) -> int:
        """Delete rows published more than ``retention_seconds`` ago, in short batches."""
        total = 0
        while True:
            before = self.clock() - timedelta(seconds=retention_seconds)
            async with self.database.connect() as ex:
                deleted = await ex.execute(sql.SWEEP_OUTBOX, {"before": before, "limit": batch_size})
            total += deleted
            if deleted < batch_size:
                return total

    @contextlib.asynccontextmanager
    async def listen(self, wake: Callable[[], None]) -> AsyncIterator[bool]:
        """Call ``wake`` whenever rows are written (PostgreSQL NOTIFY, on asyncpg); yields whether it
        listens. Elsewhere it yields ``False`` and the relay relies on polling."""
        if not self.database.asyncpg:
            yield False
            return
        if self.database.pooler == "transaction":
            # LISTEN belongs to a server connection's session, which a pooler in transaction mode hands
            # to other clients between transactions: the notifications would go to whoever holds it. The
            # relay polls (OUTBOX_POLL_SECONDS) instead.
            yield False
            return

        def notified(*_args: Any) -> None:
            wake()

        async with self.database.connect() as ex:
            driver = ex.driver
            assert driver is not None
            await driver.add_listener(NOTIFY_CHANNEL, notified)
            try:
                yield True
            finally:
                try:
                    await driver.remove_listener(NOTIFY_CHANNEL, notified)
                except BaseException:
                    ex.discard()  # type: ignore[attr-defined]  # never pool a connection still listening
                    raise


def _message(row: Row) -> OutboxMessage:
    return OutboxMessage(id=row["id"], destination=row["destination"], body=bytes(row["body"]),
                         headers=dict(row["headers"] or {}), attempts=int(row["attempts"]))
