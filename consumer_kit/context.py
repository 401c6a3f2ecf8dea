"""What a handler gets: its key, the delivery, the database inside the transaction that completes the
delivery, an outbox in that transaction, and derived keys for every downstream call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy.ext.asyncio import AsyncSession

from consumer_kit.delivery import Delivery
from consumer_kit.errors import TerminalError
from consumer_kit.keys import OperationKey
from consumer_kit.store.executor import SessionUnavailable
from consumer_kit.store.outbox import OutboxWriter
from consumer_kit.store.staged import StagedWrites

if TYPE_CHECKING:
    from consumer_kit.store.executor import Executor


class Context:
    """The handler's view of one delivery.

    ``db`` is an ``AsyncSession`` whose transaction also marks the delivery completed in the inbox:
    what the handler writes through it commits if and only if the delivery is recorded as done, and
    rolls back if the handler raises or the lease was lost. Do not commit it yourself (a commit there
    does not end the delivery's transaction). ``outbox.publish(destination, body, headers=...)`` stages
    a message in that same transaction.
    """

    __slots__ = ("_executor", "_staged", "attempt", "delivery", "http", "key", "key_digest", "outbox", "session")

    def __init__(self, *, key: OperationKey, delivery: Delivery, executor: Executor, attempt: int,
                 key_digest: str, outbox: OutboxWriter, staged: StagedWrites, session: Any = None,
                 http: httpx.AsyncClient | None = None) -> None:
        self.key = key
        self._staged = staged
        self.delivery = delivery
        self._executor = executor
        self.attempt = attempt
        self.key_digest = key_digest
        self.outbox = outbox
        self.session = session
        """The coordinator's session receipt; ``None`` when the handler describes no session."""
        self.http = http

    @property
    def db(self) -> AsyncSession:
        """An SQLAlchemy ``AsyncSession`` inside the delivery's transaction (made on first use)."""
        try:
            return self._executor.session
        except SessionUnavailable:
            # A programming error no retry can fix: park the delivery with the reason.
            raise TerminalError("this handler was registered with driver='asyncpg': write through "
                                "ctx.connection, which is inside the delivery's transaction, not ctx.db",
                                reason="handler_misconfigured") from None

    @property
    def connection(self) -> Any:
        """The asyncpg connection inside the delivery's transaction (PostgreSQL on the asyncpg driver;
        ``None`` otherwise): asyncpg's speed, with the same guarantee as ``db``."""
        return self._executor.driver

    def stage(self, statement: Any, *args: Any, **params: Any) -> None:
        """Write ``statement`` after the handler returns, in the delivery's transaction, together with
        the same statement staged by the other deliveries of its batch: one ``executemany`` for all of
        them. ``ctx.stage("INSERT INTO t (a, b) VALUES ($1, $2)", a, b)`` writes through asyncpg
        (``ctx.connection``); ``ctx.stage(insert(t), a=a, b=b)`` or SQL text with ``:a`` through
        SQLAlchemy (``ctx.db``). Use it for writes whose result the handler does not need (inserts,
        updates by key): a failure surfaces at the commit, where on the batched path the batch is
        halved until the delivery whose write failed stands alone."""
        if args and params:
            raise TerminalError("ctx.stage takes positional arguments (asyncpg's $1) or keyword "
                                "parameters (SQLAlchemy's :name), not both", reason="handler_misconfigured")
        if args or (not params and isinstance(statement, str) and self._executor.driver is not None):
            if self._executor.driver is None:
                raise TerminalError("ctx.stage with positional arguments writes through ctx.connection "
                                    "(driver='asyncpg' on PostgreSQL); pass keyword parameters to write "
                                    "through SQLAlchemy", reason="handler_misconfigured")
            self._staged.driver(statement, args)
        else:
            self.db  # noqa: B018 - a handler registered driver="asyncpg" has no session: parked, with why
            self._staged.session(statement, params)

    def derive(self, destination: str) -> str:
        """The idempotency key for ``destination``: ``<destination>:<this key>``."""
        return self.key.derive(destination)

    def idempotency_headers(self, destination: str) -> dict[str, str]:
        """``{"Idempotency-Key": <derived key>}``, for a downstream HTTP call that deduplicates."""
        return {"Idempotency-Key": self.derive(destination)}
