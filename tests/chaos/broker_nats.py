"""The chaos run's NATS JetStream side: a ``nats-server -js`` of the run's own (its store on disk), a
stream ``CK_CHAOS_<token>`` on ``ck-chaos.<token>.>``; the fault kills the server with SIGKILL and starts
it again on the same store while the worker consumes.

JetStream drops a message whose ``Nats-Msg-Id`` it saw within the stream's duplicate window, so the run
creates the stream with the smallest window the server accepts (100 ms) and publishes a duplicate again,
after the window, whenever the server answers that it dropped it: every duplicate reaches the consumer.
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

from tests.chaos.transport import Transport
from tests.integration.nats_env import NatsServer, connected

DUPLICATE_WINDOW_SECONDS = 0.1  # nats-server refuses less ("duplicates window needs to be >= 100ms")
DURABLE = "consumer-kit-chaos"  # the source's default durable name for namespace "chaos"
DOWN_SECONDS = 1.0  # how long the killed server stays down before it starts again


class NatsTransport(Transport):
    name = "nats"
    fault_name = "server restart"
    paths = ("default", "single")

    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.stream = f"CK_CHAOS_{token}"
        self.subject = f"ck-chaos.{token}.work"
        self.server = NatsServer()

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)
        async with connected(self.server.url) as client:
            await client.jetstream().add_stream(StreamConfig(
                name=self.stream, subjects=[f"ck-chaos.{self.token}.>"], storage=StorageType.FILE,
                duplicate_window=DUPLICATE_WINDOW_SECONDS))

    def env(self) -> dict[str, str]:
        return {"CHAOS_TRANSPORT": self.name, "NATS_URL": self.server.url, "CHAOS_QUEUE": self.stream,
                "CHAOS_SUBJECT": self.subject}

    async def publish(self, messages: list[str]) -> None:
        """Each id with ``Nats-Msg-Id`` set to it, 500 at a time; the ones JetStream dropped as duplicates
        (their first copy was within the window) again after the window, until none is dropped."""
        async with connected(self.server.url) as client:
            js = client.jetstream()
            waiting = list(messages)
            while waiting:
                dropped: list[str] = []
                for start in range(0, len(waiting), 500):
                    chunk = waiting[start:start + 500]
                    acks = await asyncio.gather(*(js.publish(self.subject, message_id.encode(),
                                                             headers={"Nats-Msg-Id": message_id})
                                                  for message_id in chunk))
                    dropped += [message_id for message_id, ack in zip(chunk, acks, strict=True) if ack.duplicate]
                waiting = dropped
                if waiting:
                    await asyncio.sleep(DUPLICATE_WINDOW_SECONDS * 3)
            stored = (await js.stream_info(self.stream)).state.messages
        assert stored == len(messages), f"the stream holds {stored} messages of the {len(messages)} published"

    async def counts(self) -> tuple[int, int]:
        """(not yet delivered + dead-lettered, delivered and not acknowledged) of the durable consumer."""
        async with connected(self.server.url) as client:
            js = client.jetstream()
            try:
                info = await js.consumer_info(self.stream, DURABLE)
                left, unacked = info.num_pending or 0, info.num_ack_pending or 0
            except NotFoundError:  # the worker has not declared it yet: everything is left
                left, unacked = (await js.stream_info(self.stream)).state.messages, 0
            with contextlib.suppress(NotFoundError):
                left += (await js.stream_info(f"{self.stream}_DEAD_LETTER")).state.messages
        return left, unacked

    async def fault(self) -> None:
        """SIGKILL the server, leave it down a moment (the worker meets a refused connection), start it again."""
        await asyncio.to_thread(self.server.kill)
        await asyncio.sleep(DOWN_SECONDS)
        await asyncio.to_thread(self.server.start)

    async def remove(self) -> None:
        await asyncio.to_thread(self.server.stop)
