"""The NATS publisher of the outbox relay: :class:`NatsPublisher` implements
:class:`consumer_kit.outbox.Publisher`. It publishes each outbox row through JetStream with
``Nats-Msg-Id`` set to the row's id and waits for the stream's ``PubAck``: a row the relay publishes
again (its mark as published was lost) is dropped by the stream as a repeat inside the stream's
duplicate window (two minutes by default), and a consumer keyed by ``Nats-Msg-Id`` acknowledges one that
comes later as a duplicate. A subject no stream captures is a failure, so the row stays pending."""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.aio.client import Client
from nats.js import JetStreamContext

from consumer_kit.errors import ConfigurationError
from consumer_kit.outbox import OutboxMessage
from consumer_kit.settings import Settings
from consumer_kit.sources.nats.connection import connect
from consumer_kit.sources.nats.message import MSG_ID_HEADER

FAILED_CONNECT_REUSE_SECONDS = 1.0  # how long a failed connect answers later publishes


class NatsPublisher:
    """Publishes outbox rows: ``destination`` is the subject. Connects lazily (``url``, else the
    ``NATS_URL`` setting); nats-py reconnects by itself afterwards. The headers of a row are the
    message's (a traced row's ``traceparent`` among them)."""

    messaging_system = "nats"

    def __init__(self, url: str | None = None, *, settings: Settings | None = None,
                 connection_name: str = "consumer-kit-relay") -> None:
        self.url = url
        self.settings = settings
        self.connection_name = connection_name
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self._lock = asyncio.Lock()
        self._failed: tuple[float, ConfigurationError] | None = None  # the last failed connect, and when

    async def _ready(self) -> JetStreamContext:
        async with self._lock:
            if self._js is not None and self._client is not None and not self._client.is_closed:
                return self._js
            if self._failed is not None and time.monotonic() - self._failed[0] < FAILED_CONNECT_REUSE_SECONDS:
                raise self._failed[1]  # one failed connect answers the publishes of a batch waiting behind it
            url = (self.settings or Settings()).require_nats_url(self.url)
            try:
                self._client = await connect(url, self.connection_name)
            except ConfigurationError as exc:
                self._failed = (time.monotonic(), exc)
                raise
            self._failed = None
            timeout = (self.settings or Settings()).outbox_publish_timeout_seconds
            self._js = self._client.jetstream(timeout=timeout)
            return self._js

    async def check(self) -> None:
        """Connect now (the relay calls it first, to say at once when the server cannot be reached)."""
        await self._ready()

    async def publish(self, message: OutboxMessage) -> None:
        """Publish and wait for the stream's ``PubAck``; raise when none comes (no stream, a timeout)."""
        js = await self._ready()
        headers = dict(message.headers)
        headers[MSG_ID_HEADER] = message.id
        await js.publish(message.destination, message.body, headers=headers)

    async def close(self) -> None:
        """Close the connection."""
        async with self._lock:
            client, self._client, self._js = self._client, None, None
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
