"""A handler as ``@app.handler`` registered it (:class:`HandlerSpec`), with its options: the batch it
gathers deliveries into (:class:`Batch`) and the coordinator session it asks for."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from consumer_kit.context import Context
from consumer_kit.coordinator.protocol import SessionRequest
from consumer_kit.delivery import Delivery, Source
from consumer_kit.settings import Settings

Handler = Callable[[Context], Awaitable[Any]]

MAX_BATCH = 64
"""The largest batch: PostgreSQL keeps 64 subtransactions per transaction in shared memory."""


@dataclass(frozen=True, slots=True)
class Batch:
    """How a handler's deliveries are gathered into one transaction: up to ``max_size`` (at most 64),
    waiting at most ``max_wait_ms`` after the first for more to arrive, with at most
    ``max_concurrent`` batches of the handler running at once. While they run, what arrives gathers
    into the next batch, which starts as soon as one ends: a busy consumer runs full batches (one
    claim, one commit and one acknowledgement for many deliveries), a quiet one waits at most
    ``max_wait_ms``."""

    max_size: int = 64
    max_wait_ms: float = 5.0
    max_concurrent: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.max_size <= MAX_BATCH:
            raise ValueError(f"Batch.max_size must be between 1 and {MAX_BATCH}")
        if self.max_wait_ms < 0:
            raise ValueError("Batch.max_wait_ms cannot be negative")
        if self.max_concurrent < 1:
            raise ValueError("Batch.max_concurrent must be at least 1")


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """A handler bound to its source, as ``@app.handler`` registered it."""

    func: Handler
    source: Source
    consumer: str  # the inbox scope; keep it stable across deploys
    single_transaction: bool = False
    max_deliveries: int | None = None
    labels: tuple[str, ...] = ()
    task: Callable[[Delivery], str] | str | None = None
    driver: str = "sqlalchemy"  # or "asyncpg": the handler uses ctx.connection (PostgreSQL on asyncpg)
    batch: Batch | None = None  # gather deliveries into one transaction (single_transaction only)
    staged: bool = False  # the handler only stages its writes: run it with nothing held (single_transaction)

    @property
    def uses_db(self) -> bool:
        """Whether the handler may write through ``ctx.db`` (it was not registered ``driver="asyncpg"``)."""
        return self.driver != "asyncpg"

    @property
    def wants_session(self) -> bool:
        """Whether deliveries of this handler get a coordinator session."""
        return bool(self.labels or self.task)


def session_request(spec: HandlerSpec, delivery: Delivery, settings: Settings) -> SessionRequest:
    """The coordinator session a handler's delivery asks for: its labels, its task, the session TTL."""
    task = spec.task(delivery) if callable(spec.task) else spec.task
    return SessionRequest(labels=spec.labels, task=task, ttl_seconds=settings.coordinator_session_ttl_seconds)
