"""The contract's adapters for :class:`~consumer_kit.sources.rabbitmq.RabbitMQSource` on the real
broker: keyed by the AMQP ``message_id`` (a message without one is published as a foreign producer
would, :func:`tests.integration.rabbit.publish_without_id`); the redelivery is the same
``message_id`` published again; the cut is the broker closing the source's connection."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Self

import aio_pika
import pytest

from consumer_kit import Settings, Source
from consumer_kit.sources.rabbitmq import NO_ID_HEADER, REASON_HEADER, RabbitMQSource
from tests.conftest import make_settings
from tests.contract.base import EVERY_SOURCE, Capability, Sent, SourceAdapter
from tests.integration.rabbit import (
    AMQP_URL,
    close_connections_named,
    depth,
    publish,
    publish_without_id,
)

RETRY_DELAY = 0.2
# aio-pika reads its robust connection's options from the URL: after a cut, connect again in 0.5 s
# rather than the default 5 s.
SOURCE_URL = AMQP_URL + "?reconnect_interval=0.5"


class RabbitMQAdapter(SourceAdapter):
    id = "rabbitmq"
    capabilities = EVERY_SOURCE | {Capability.UNKEYABLE, Capability.TRACE, Capability.CUT}
    marks = (pytest.mark.rabbitmq, pytest.mark.postgres)
    database = "postgres"  # the inbox on PostgreSQL, as a RabbitMQ worker runs in production

    def __init__(self) -> None:
        super().__init__()
        self.queue = f"ck-contract-{secrets.token_hex(4)}"

    @classmethod
    @contextlib.asynccontextmanager
    async def prepared(cls, request: pytest.FixtureRequest) -> AsyncIterator[Self]:
        adapter = cls()
        try:
            yield adapter
        finally:
            connection = await aio_pika.connect(AMQP_URL)
            async with connection:
                for name in (adapter.queue, f"{adapter.queue}.dlq", adapter.retry_queue):
                    channel = await connection.channel()
                    await channel.queue_delete(name)

    def settings(self, database_url: str, **overrides: object) -> Settings:
        values: dict[str, object] = {"retry_attempts": 1, "retry_later_seconds": 0.1, "rabbitmq_url": AMQP_URL}
        values.update(overrides)
        return make_settings(database_url, **values)

    def make_source(self) -> Source:
        return RabbitMQSource(queue=self.queue, namespace=f"contract-{self.queue}", version=1, url=SOURCE_URL,
                              retry_delays=(RETRY_DELAY,), prefetch=8)

    async def send(self, stable_id: str, *, traceparent: str | None = None) -> Sent:
        headers = {"traceparent": traceparent} if traceparent else None
        await publish(self.queue, [(stable_id, b'{"contract": true}')], headers=headers)
        return Sent(stable_id)

    async def send_in_order(self, stable_ids: Sequence[str]) -> list[Sent]:
        await publish(self.queue, [(stable_id, b'{"contract": true}') for stable_id in stable_ids])
        return [Sent(stable_id) for stable_id in stable_ids]

    async def send_again(self, sent: Sent) -> Sent:
        assert sent.key_id is not None
        return await self.send(sent.key_id)

    async def send_unkeyed(self) -> Sent:
        await publish_without_id(self.queue, [b'{"contract": "no message_id"}'])
        return Sent(None)

    @property
    def retry_queue(self) -> str:
        return f"{self.queue}.retry.{round(RETRY_DELAY * 1000)}ms"

    async def _on_queue(self) -> int:
        return await depth(self.queue) + await depth(self.retry_queue)

    async def acked(self, sent: Sent) -> bool:
        # Ready messages only: one delivered and not yet acknowledged is not counted (the cases check
        # left_over() again once the consumer is gone, and what it held is back on the queue).
        return await self._on_queue() == 0

    async def dead_lettered(self, sent: Sent, reason: str) -> bool:
        return await self._on_queue() == 0 and reason in await self._dead_copies(sent.key_id)

    async def _dead_copies(self, key_id: str | None) -> list[str]:
        """The reasons of the copies of ``key_id`` (``None``: of those without a message id) in the
        dead-letter queue, read without taking them: unacknowledged, they go back when the channel closes."""
        source: RabbitMQSource = self.current
        reasons: list[str] = []
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(source.dead_letter_queue, passive=True)
            while (message := await queue.get(fail=False)) is not None:
                headers = message.headers or {}
                if (message.message_id or None) == key_id or (key_id is None and NO_ID_HEADER in headers):
                    reasons.append(str(headers.get(REASON_HEADER)))
        return reasons

    async def cut(self) -> None:
        source: RabbitMQSource = self.current
        assert await asyncio.to_thread(close_connections_named, source.name) >= 1, "no connection to close"

    async def left_over(self) -> int:
        return await self._on_queue()


class OrderedRabbitMQAdapter(RabbitMQAdapter):
    """One consumer, one message at a time (``prefetch=1``), a retry given back to the broker
    (``retry_delays=()``: ``basic.nack`` with requeue, which puts it back at its place)."""

    id = "rabbitmq-ordered"
    capabilities = frozenset({Capability.ORDER})

    def make_source(self) -> Source:
        return RabbitMQSource(queue=self.queue, namespace=f"contract-{self.queue}", version=1, url=SOURCE_URL,
                              retry_delays=(), prefetch=1)

    async def _on_queue(self) -> int:
        return await depth(self.queue)
