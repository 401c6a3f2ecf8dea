"""Dead letters: deliveries parked with their reason and raw body, for an operator to inspect."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from consumer_kit.store import sql
from consumer_kit.store.connections import Database
from consumer_kit.store.executor import Executor
from consumer_kit.store.inbox import Clock, utcnow


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

    def __init__(self, database: Database, *, clock: Clock = utcnow) -> None:
        self.database = database
        self.clock = clock

    async def park(
        self,
        ex: Executor | None = None,
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
    ) -> str:
        """Store a parked delivery (in ``ex``'s transaction when given, else on its own) and return its id."""
        letter_id = secrets.token_hex(16)
        params = {"id": letter_id, "consumer": consumer, "source": source, "namespace": namespace,
                  "version": version, "key_digest": key_digest, "reason": reason, "detail": detail,
                  "body": body, "headers": dict(headers), "attempts": attempts, "created_at": self.clock()}
        if ex is not None:
            await ex.execute(sql.INSERT_DEAD_LETTER, params)
        else:
            async with self.database.connect() as own:
                await own.execute(sql.INSERT_DEAD_LETTER, params)
        return letter_id

    async def list(
        self, *, consumer: str | None = None, reason: str | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        """The newest parked deliveries, optionally for one consumer or reason."""
        async with self.database.connect() as ex:
            rows = await ex.fetch_all(sql.LIST_DEAD_LETTERS, {"consumer": consumer, "reason": reason,
                                                              "limit": limit})
        return [DeadLetter(**{**dict(row), "body": bytes(row["body"])}) for row in rows]

    async def count(self, *, reason: str | None = None) -> int:
        """How many deliveries are parked (for one reason, when given)."""
        async with self.database.connect() as ex:
            row = await ex.fetch_one(sql.COUNT_DEAD_LETTERS, {"consumer": None, "reason": reason})
        assert row is not None
        return int(row["parked"])
