"""The contract's adapter for :class:`~consumer_kit.sources.redis.RedisStreamSource` on the real
server (127.0.0.1:6379), one stream of its own per case. The source keys by the ``message-id`` field,
as a consumer of the outbox publisher does: a redelivery is the same ``message-id`` added again (a
new entry), and an entry without the field has no stable id. Acknowledged means read by the group and
no longer pending; the cut is the server closing the source's connections (``CLIENT KILL``)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Self

import pytest

from consumer_kit import Settings, Source
from consumer_kit.sources.redis import ENTRY_ID_FIELD, MESSAGE_ID_FIELD, REASON_FIELD, RedisStreamSource
from tests.conftest import make_settings
from tests.contract.base import EVERY_SOURCE, Capability, Sent, SourceAdapter
from tests.integration.redis_env import (
    GROUP,
    REDIS_URL,
    add,
    dead_letters,
    delivered,
    kill_connections_named,
    pending,
    pending_count,
    unique_stream,
    unread,
)

BODY = '{"contract": true}'


class RedisStreamAdapter(SourceAdapter):
    id = "redis"
    capabilities = EVERY_SOURCE | {Capability.UNKEYABLE, Capability.TRACE, Capability.CUT}
    marks = (pytest.mark.redis,)

    def __init__(self, stream: str) -> None:
        super().__init__()
        self.stream = stream
        self.namespace = f"contract-redis-{secrets.token_hex(4)}"

    @classmethod
    @contextlib.asynccontextmanager
    async def prepared(cls, request: pytest.FixtureRequest) -> AsyncIterator[Self]:
        async with unique_stream(prefix="ck-contract") as stream:
            yield cls(stream)

    def settings(self, database_url: str, **overrides: object) -> Settings:
        values: dict[str, object] = {"retry_attempts": 1, "retry_later_seconds": 0.1, "redis_url": REDIS_URL}
        values.update(overrides)
        return make_settings(database_url, **values)

    def make_source(self) -> Source:
        return RedisStreamSource(stream=self.stream, group=GROUP, namespace=self.namespace, version=1,
                                 key=MESSAGE_ID_FIELD, retry_delays=(0.2,), claim_idle_seconds=2.0, max_in_flight=8)

    async def send(self, stable_id: str, *, traceparent: str | None = None) -> Sent:
        fields = {"body": BODY, MESSAGE_ID_FIELD: stable_id}
        if traceparent is not None:
            fields["traceparent"] = traceparent
        return Sent(stable_id, detail=await add(self.stream, fields))

    async def send_again(self, sent: Sent) -> Sent:
        assert sent.key_id is not None
        return await self.send(sent.key_id)

    async def send_unkeyed(self) -> Sent:
        return Sent(None, detail=await add(self.stream, {"body": '{"contract": "no message-id"}'}))

    async def acked(self, sent: Sent) -> bool:
        return await delivered(self.stream, sent.detail) and \
            all(p["id"] != sent.detail for p in await pending(self.stream))

    async def dead_lettered(self, sent: Sent, reason: str) -> bool:
        copies = [c for c in await dead_letters(self.stream) if c.get(ENTRY_ID_FIELD) == sent.detail]
        return await self.acked(sent) and reason in [c.get(REASON_FIELD) for c in copies]

    async def cut(self) -> None:
        source: RedisStreamSource = self.current
        assert await kill_connections_named(source.name) >= 1, "no connection to close"

    async def left_over(self) -> int:
        return await pending_count(self.stream) + await unread(self.stream)
