"""What a handler gets: its key, the delivery, a database session inside the completing transaction,
an outbox in that transaction, and derived keys for every downstream call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncSession

from consumer_kit.delivery import Delivery
from consumer_kit.keys import OperationKey
from consumer_kit.store.outbox import OutboxWriter


@dataclass(slots=True)
class Context:
    """The handler's view of one delivery.

    ``db`` is an ``AsyncSession`` whose transaction also marks the delivery completed in the inbox:
    what the handler writes through it commits if and only if the delivery is recorded as done, and
    rolls back if the handler raises or the lease was lost. Do not commit it yourself.
    ``outbox.publish(destination, body, headers=...)`` stages a message in that same transaction.
    """

    key: OperationKey
    delivery: Delivery
    db: AsyncSession
    attempt: int
    key_digest: str
    outbox: OutboxWriter
    session: Any = None  # the coordinator's session receipt; None when no coordinator is configured
    http: httpx.AsyncClient | None = None
    connection: Any = None
    """The asyncpg connection inside the delivery's transaction, for a handler registered with
    ``driver="asyncpg"`` (PostgreSQL): asyncpg's speed, with the same guarantee as ``db``."""

    def derive(self, destination: str) -> str:
        """The idempotency key for ``destination``: ``<destination>:<this key>``."""
        return self.key.derive(destination)

    def idempotency_headers(self, destination: str) -> dict[str, str]:
        """``{"Idempotency-Key": <derived key>}``, for a downstream HTTP call that deduplicates."""
        return {"Idempotency-Key": self.derive(destination)}
