"""The contract's adapter for :class:`~consumer_kit.sources.nats.NatsSource` on the real server, one
stream of its own per case, keyed by ``Nats-Msg-Id``. The stream's duplicate window is short, and a
redelivery is the same ``Nats-Msg-Id`` published again after it (inside the window JetStream itself
drops the repeat); a message without the header has no stable id. Acknowledged means the durable
consumer has nothing pending or unacknowledged; the source reaches the server through a
:class:`~tests.integration.rabbit.TcpProxy`, so the cut is the server going away under the source."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from typing import Self

import pytest

from consumer_kit import Settings, Source
from consumer_kit.sources.nats import ORIGINAL_MSG_ID_HEADER, REASON_HEADER, NatsSource
from tests.conftest import make_settings
from tests.contract.base import EVERY_SOURCE, Capability, Sent, SourceAdapter
from tests.integration.nats_env import (
    DUPLICATE_WINDOW,
    Stream,
    connected,
    consumer_state,
    own_stream,
    publish,
)
from tests.integration.rabbit import TcpProxy, wait_until

BODY = b'{"contract": true}'
ACK_WAIT = 5.0  # seconds: an ack lost in the cut comes back this soon as a redelivery


class NatsAdapter(SourceAdapter):
    id = "nats"
    capabilities = EVERY_SOURCE | {Capability.UNKEYABLE, Capability.TRACE, Capability.CUT}
    marks = (pytest.mark.nats,)

    def __init__(self, stream: Stream, proxy: TcpProxy) -> None:
        super().__init__()
        self.stream, self.proxy = stream, proxy
        self.namespace = f"contract-nats-{secrets.token_hex(4)}"

    @classmethod
    @contextlib.asynccontextmanager
    async def prepared(cls, request: pytest.FixtureRequest) -> AsyncIterator[Self]:
        proxy = TcpProxy(target=("127.0.0.1", 4222))
        async with own_stream(prefix="ck-contract") as stream:
            await proxy.start()
            try:
                yield cls(stream, proxy)
            finally:
                await proxy.stop()

    def settings(self, database_url: str, **overrides: object) -> Settings:
        values: dict[str, object] = {"retry_attempts": 1, "retry_later_seconds": 0.1,
                                     "nats_url": f"nats://127.0.0.1:{self.proxy.port}"}
        values.update(overrides)
        return make_settings(database_url, **values)

    def make_source(self) -> Source:
        return NatsSource(stream=self.stream.name, subject=self.stream.subject, namespace=self.namespace, version=1,
                          retry_delays=(0.2,), ack_wait_seconds=ACK_WAIT, max_in_flight=8)

    async def send(self, stable_id: str, *, traceparent: str | None = None) -> Sent:
        headers = {"traceparent": traceparent} if traceparent else None
        await publish(self.stream, [(stable_id, BODY)], headers=headers)
        return Sent(stable_id, detail=time.monotonic())

    async def send_again(self, sent: Sent) -> Sent:
        assert sent.key_id is not None
        await asyncio.sleep(max(0.0, sent.detail + 2 * DUPLICATE_WINDOW - time.monotonic()))
        return await self.send(sent.key_id)

    async def send_unkeyed(self) -> Sent:
        await publish(self.stream, [(None, b'{"contract": "no Nats-Msg-Id"}')])
        return Sent(None, detail=time.monotonic())

    @property
    def durable(self) -> str:
        source: NatsSource = self.current
        return source.durable

    async def _outstanding(self) -> int:
        try:
            waiting, unacked = await consumer_state(self.stream, self.durable)
        except Exception:  # the consumer is not there yet: nothing was taken
            return -1
        return waiting + unacked

    async def acked(self, sent: Sent) -> bool:
        return await self._outstanding() == 0

    async def dead_lettered(self, sent: Sent, reason: str) -> bool:
        return await self._outstanding() == 0 and reason in await self._dead_copies(sent.key_id)

    async def _dead_copies(self, key_id: str | None) -> list[str]:
        """The reasons of the dead-letter stream's copies of ``key_id`` (``None``: of those without one)."""
        source: NatsSource = self.current
        reasons: list[str] = []
        async with connected(self.stream.url) as client:
            js = client.jetstream()
            try:
                info = await js.stream_info(source.dead_letter_stream)
            except Exception:
                return []
            for sequence in range(info.state.first_seq, info.state.last_seq + 1):
                message = await js.get_msg(source.dead_letter_stream, sequence)
                headers = message.headers or {}
                if headers.get(ORIGINAL_MSG_ID_HEADER) == key_id:
                    reasons.append(str(headers.get(REASON_HEADER)))
        return reasons

    async def cut(self) -> None:
        source: NatsSource = self.current
        await self.proxy.stop()

        async def lost() -> bool:
            return source.unready_reason() is not None

        await wait_until(lost, 20, "the source to lose its connection")

    async def restore(self) -> None:
        await self.proxy.start()  # on the same port: the server is back

    async def left_over(self) -> int:
        return max(0, await self._outstanding())
