"""The chaos run's Redis Streams side: a ``redis-server`` of the run's own
(:class:`tests.integration.redis_env.RedisServer`: AOF, ``appendfsync always``, its files on disk), a
stream ``ck-chaos:<token>`` read by the group ``chaos``; the fault kills the server with SIGKILL and
starts it again on the same files while the worker consumes.

Every entry carries the business id twice, as its body and as the field ``chaos-id`` the worker keys by
(``key="chaos-id"``): a duplicate is the same id XADDed again, a new entry id the consumer must not run
twice.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from tests.chaos.transport import Transport
from tests.integration.redis_env import RedisServer

GROUP = "chaos"
DOWN_SECONDS = 1.0  # how long the killed server stays down before it starts again


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisTransport(Transport):
    name = "redis"
    fault_name = "server restart"
    paths = ("default", "single")

    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.stream = f"ck-chaos:{token}"
        self.server = RedisServer()

    async def start(self) -> None:
        await self.server.start()

    def env(self) -> dict[str, str]:
        return {"CHAOS_TRANSPORT": self.name, "REDIS_URL": self.server.url, "CHAOS_QUEUE": self.stream,
                "CHAOS_GROUP": GROUP}

    async def publish(self, messages: list[str]) -> None:
        client = aioredis.from_url(self.server.url)
        try:
            for start in range(0, len(messages), 500):
                pipe = client.pipeline(transaction=False)
                for chaos_id in messages[start:start + 500]:
                    pipe.xadd(self.stream, {"body": chaos_id, "chaos-id": chaos_id})
                await pipe.execute()
            stored = await client.xlen(self.stream)
        finally:
            await client.aclose()
        assert stored == len(messages), f"the stream holds {stored} entries of the {len(messages)} published"

    async def counts(self) -> tuple[int, int]:
        """(entries after the group's last-delivered-id + dead-lettered entries, XPENDING's count)."""
        client = aioredis.from_url(self.server.url)
        try:
            groups = {_text(group["name"]): group for group in await client.xinfo_groups(self.stream)}
            dead = await client.xlen(f"{self.stream}:dead-letter")
            if GROUP not in groups:  # the worker has not created it yet: everything is left
                return int(await client.xlen(self.stream)) + dead, 0
            last = _text(groups[GROUP]["last-delivered-id"])
            unread = len(await client.xrange(self.stream, min=f"({last}", max="+") or [])
            pending = int((await client.xpending(self.stream, GROUP))["pending"])
        finally:
            await client.aclose()
        return unread + dead, pending

    async def fault(self) -> None:
        """SIGKILL the server, leave it down a moment (the worker meets a refused connection), start it again."""
        await self.server.kill()
        await asyncio.sleep(DOWN_SECONDS)
        await self.server.start()

    async def remove(self) -> None:
        await self.server.stop()
