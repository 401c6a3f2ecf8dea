"""Dead letters: deliveries parked with their reason and raw body, for an operator to inspect."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from consumer_kit.store.inbox import Clock, utcnow
from consumer_kit.store.tables import dead_letters


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One parked delivery. ``key_digest`` is ``None`` when the delivery could not be keyed."""

    id: str
    consumer: str
    source: str
    namespace: str
    version: int
    key_digest: str | None
    reason: str
    detail: str | None
    body: bytes
    headers: Mapping[str, Any]
    attempts: int
    created_at: datetime


class DeadLetters:
    """Park deliveries and list them."""

    def __init__(self, engine: AsyncEngine, *, clock: Clock = utcnow) -> None:
        self.engine = engine
        self.clock = clock

    async def park(
        self,
        *,
        consumer: str,
        source: str,
        namespace: str,
        version: int,
        key_digest: str | None,
        reason: str,
        body: bytes,
        headers: Mapping[str, str],
        attempts: int,
        detail: str | None = None,
        conn: AsyncConnection | None = None,
    ) -> str:
        """Store a parked delivery (inside ``conn``'s transaction when given) and return its id."""
        letter_id = secrets.token_hex(16)
        statement = dead_letters.insert().values(
            id=letter_id, consumer=consumer, source=source, namespace=namespace, version=version,
            key_digest=key_digest, reason=reason, detail=detail, body=body, headers=dict(headers),
            attempts=attempts, created_at=self.clock(),
        )
        if conn is not None:
            await conn.execute(statement)
        else:
            async with self.engine.begin() as own:
                await own.execute(statement)
        return letter_id

    async def list(
        self, *, consumer: str | None = None, reason: str | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        """The newest parked deliveries, optionally for one consumer or reason."""
        query = select(dead_letters).order_by(dead_letters.c.created_at.desc()).limit(limit)
        if consumer is not None:
            query = query.where(dead_letters.c.consumer == consumer)
        if reason is not None:
            query = query.where(dead_letters.c.reason == reason)
        async with self.engine.connect() as conn:
            return [DeadLetter(**row._asdict()) for row in await conn.execute(query)]

    async def count(self, *, reason: str | None = None) -> int:
        """How many deliveries are parked (for one reason, when given)."""
        query = select(func.count()).select_from(dead_letters)
        if reason is not None:
            query = query.where(dead_letters.c.reason == reason)
        async with self.engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())
