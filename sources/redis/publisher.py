"""The Redis Streams publisher of the outbox relay: :class:`RedisStreamPublisher` implements
:class:`consumer_kit.outbox.Publisher`. Each row is one ``XADD <destination> * body <body> message-id
<row id> <header> <value> ...``; the server's reply is the confirmation.

Redis 7 has no idempotent ``XADD``: a row published again after a lost reply (the relay retries it)
makes a second entry with the same ``message-id``. The consumer's inbox absorbs it when the source keys
by that field, ``RedisStreamSource(..., key=MESSAGE_ID_FIELD)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis.asyncio
import redis.exceptions

from consumer_kit.errors import ConfigurationError
from consumer_kit.outbox import OutboxMessage
from consumer_kit.settings import Settings
from consumer_kit.sources.redis.connection import client, unreachable
from consumer_kit.sources.redis.message import MESSAGE_ID_FIELD

FAILED_CONNECT_REUSE_SECONDS = 1.0  # how long a failed connect answers later publishes
BODY_FIELD = "body"


class RedisStreamPublisher:
    """Publishes outbox rows: ``destination`` is the stream. ``maxlen`` trims each stream to about that
    many entries (``MAXLEN ~``; entries trimmed before a group read them are lost to it). Connects
    lazily and again after any failure. The headers of a row become fields of the entry (a traced
    row's ``traceparent`` among them), after ``body`` and ``message-id``, which they cannot replace."""

    messaging_system = "redis"

    def __init__(self, url: str | None = None, *, settings: Settings | None = None, maxlen: int | None = None,
                 client_name: str = "relay") -> None:
        if maxlen is not None and maxlen < 1:
            raise ConfigurationError("maxlen must be at least 1 (or None: no trimming)")
        self.url = url
        self.settings = settings
        self.maxlen = maxlen
        self.client_name = client_name
        self._client: redis.asyncio.Redis | None = None
        self._lock = asyncio.Lock()
        self._failed: tuple[float, ConfigurationError] | None = None  # the last failed connect, and when

    async def _ready(self) -> redis.asyncio.Redis:
        async with self._lock:
            if self._client is not None:
                return self._client
            if self._failed is not None and time.monotonic() - self._failed[0] < FAILED_CONNECT_REUSE_SECONDS:
                raise self._failed[1]  # a batch's publishes: one failed connect answers them all
            url = (self.settings or Settings()).require_redis_url(self.url)
            connection = None
            try:
                connection = client(url, self.client_name)
                await connection.ping()
            except (redis.exceptions.RedisError, OSError, ValueError, TypeError) as exc:
                if connection is not None:
                    with contextlib.suppress(Exception):
                        await connection.aclose()
                error = unreachable(exc, url, "the outbox relay")
                self._failed = (time.monotonic(), error)
                raise error from exc
            self._failed, self._client = None, connection
            return connection

    async def check(self) -> None:
        """Connect now (the relay calls it first, to say at once when the server cannot be reached)."""
        await self._ready()

    async def publish(self, message: OutboxMessage) -> None:
        """``XADD`` the row and wait for the reply; raise on any failure (the row stays pending)."""
        connection = await self._ready()
        fields: dict[str, str | bytes] = {BODY_FIELD: message.body, MESSAGE_ID_FIELD: message.id}
        fields.update({name: value for name, value in message.headers.items() if name not in fields})
        try:
            await connection.xadd(message.destination, fields,  # type: ignore[arg-type]
                                  maxlen=self.maxlen, approximate=True)
        except redis.exceptions.ResponseError:
            raise  # the server answered (a wrong type at that key, say): the connection is fine
        except Exception:
            async with self._lock:
                if self._client is connection:  # not one a concurrent publish has just reopened
                    await self._drop()
            raise

    async def _drop(self) -> None:
        connection, self._client = self._client, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.aclose()

    async def close(self) -> None:
        """Close the connection."""
        async with self._lock:
            await self._drop()
