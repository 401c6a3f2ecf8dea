"""The RabbitMQ publisher of the outbox relay: :class:`AmqpPublisher` implements
:class:`consumer_kit.outbox.Publisher`. It publishes outbox rows with publisher confirms,
``message_id`` = the row id, persistent, and mandatory (an unroutable destination is a failure, so the
row stays pending)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from consumer_kit.errors import ConfigurationError
from consumer_kit.outbox import OutboxMessage
from consumer_kit.settings import Settings
from consumer_kit.sources.rabbitmq.connection import CONNECT_TIMEOUT_SECONDS, unreachable

FAILED_CONNECT_REUSE_SECONDS = 1.0  # how long a failed connect answers later publishes


class AmqpPublisher:
    """Publishes outbox rows: ``destination`` is the routing key on ``exchange`` (default: the
    default exchange, so a queue name). Connects lazily and again after any failure. The headers of
    a row are the message's (a traced row's ``traceparent`` among them)."""

    messaging_system = "rabbitmq"

    def __init__(self, url: str | None = None, *, exchange: str = "", settings: Settings | None = None,
                 connection_name: str = "consumer-kit-relay") -> None:
        self.url = url
        self.exchange_name = exchange
        self.settings = settings
        self.connection_name = connection_name
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._lock = asyncio.Lock()
        self._failed: tuple[float, ConfigurationError] | None = None  # the last failed connect, and when

    async def _ready(self) -> AbstractExchange:
        async with self._lock:
            channel, exchange = self._channel, self._exchange
            if exchange is not None and channel is not None and not channel.is_closed:
                return exchange
            await self._drop()
            if self._failed is not None and time.monotonic() - self._failed[0] < FAILED_CONNECT_REUSE_SECONDS:
                # A batch's publishes wait here one behind another: one failed connect answers them all,
                # rather than each waiting out a timeout of its own.
                raise self._failed[1]
            url = (self.settings or Settings()).require_rabbitmq_url(self.url)
            try:
                connection = await aio_pika.connect(
                    url, timeout=CONNECT_TIMEOUT_SECONDS, client_properties={"connection_name": self.connection_name})
            except Exception as exc:
                error = unreachable(exc, url, "the outbox relay")
                self._failed = (time.monotonic(), error)
                raise error from exc
            self._failed = None
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if self.exchange_name:
                exchange = await channel.get_exchange(self.exchange_name, ensure=True)
            else:
                exchange = channel.default_exchange
            self._connection, self._channel, self._exchange = connection, channel, exchange
            return exchange

    async def check(self) -> None:
        """Connect now (the relay calls it first, to say at once when the broker cannot be reached)."""
        await self._ready()

    async def publish(self, message: OutboxMessage) -> None:
        """Publish and wait for the broker's confirm; raise on nack, return or connection loss."""
        exchange = await self._ready()
        amqp = aio_pika.Message(body=message.body, headers=dict(message.headers), message_id=message.id,
                                delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        try:
            await exchange.publish(amqp, routing_key=message.destination, mandatory=True)
        except (aio_pika.exceptions.DeliveryError, aio_pika.exceptions.PublishError):
            raise  # the broker answered (nack, unroutable): the connection is fine
        except Exception:
            async with self._lock:
                if self._exchange is exchange:  # not one a concurrent publish has just reopened
                    await self._drop()
            raise

    async def _drop(self) -> None:
        connection, self._connection, self._channel, self._exchange = self._connection, None, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()

    async def close(self) -> None:
        """Close the connection."""
        async with self._lock:
            await self._drop()
