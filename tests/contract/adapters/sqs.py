"""The contract's adapters for :class:`~consumer_kit.sources.sqs.SQSSource` on moto's server over
HTTP. SQS mints a new ``MessageId`` for every send, so the source keys by a business id in a message
attribute (``key=``): a redelivery is the same attribute sent again, and a message without it has no
stable id. The source reaches the server through a :class:`~tests.integration.rabbit.TcpProxy`, so
that the cut is the endpoint going away under the source (and coming back)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar, Self

import pytest
from prometheus_client import REGISTRY

from consumer_kit import Settings, Source
from consumer_kit.sources.sqs import REASON_ATTRIBUTE, SQSSource
from tests.contract.base import EVERY_SOURCE, Capability, Sent, SourceAdapter
from tests.integration.rabbit import TcpProxy, wait_until
from tests.integration.sqs_env import Moto, attribute

KEY_ATTRIBUTE = "contract-id"
BODY = '{"contract": true}'


class SqsAdapter(SourceAdapter):
    id = "sqs"
    capabilities = EVERY_SOURCE | {Capability.UNKEYABLE, Capability.TRACE, Capability.CUT}
    marks = (pytest.mark.sqs,)
    fifo: ClassVar[bool] = False

    def __init__(self, moto: Moto, proxy: TcpProxy, url: str, dlq: str) -> None:
        super().__init__()
        self.moto, self.proxy, self.url, self.dlq = moto, proxy, url, dlq
        self.namespace = f"contract-sqs-{secrets.token_hex(4)}"

    @classmethod
    @contextlib.asynccontextmanager
    async def prepared(cls, request: pytest.FixtureRequest) -> AsyncIterator[Self]:
        endpoint: str = request.getfixturevalue("moto_endpoint")
        moto = Moto(endpoint)
        proxy = TcpProxy(target=("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
        try:
            url, dlq = await moto.queue(fifo=cls.fifo, visibility=5, prefix="ck-contract")
            await proxy.start()
            yield cls(moto, proxy, url, dlq)
        finally:
            await proxy.stop()
            await moto.cleanup()

    def settings(self, database_url: str, **overrides: object) -> Settings:
        values: dict[str, object] = {"retry_attempts": 1, "retry_later_seconds": 0.1,
                                     "sqs_endpoint_url": f"http://127.0.0.1:{self.proxy.port}"}
        values.update(overrides)
        return self.moto.settings(database_url, **values)

    def make_source(self) -> Source:
        return SQSSource(queue_url=self.url, namespace=self.namespace, version=1, key=KEY_ATTRIBUTE,
                         dead_letter_queue_url=self.dlq, retry_delays=(0.2,))

    def _message(self, stable_id: str | None, traceparent: str | None = None) -> dict[str, Any]:
        attributes = {} if stable_id is None else {KEY_ATTRIBUTE: attribute(stable_id)}
        if traceparent is not None:
            attributes["traceparent"] = attribute(traceparent)
        message: dict[str, Any] = {"MessageBody": BODY}
        if attributes:
            message["MessageAttributes"] = attributes
        return message

    async def send(self, stable_id: str, *, traceparent: str | None = None) -> Sent:
        await self.moto.send(self.url, [self._message(stable_id, traceparent)])
        return Sent(stable_id)

    async def send_again(self, sent: Sent) -> Sent:
        assert sent.key_id is not None
        return await self.send(sent.key_id)

    async def send_unkeyed(self) -> Sent:
        await self.moto.send(self.url, [self._message(None)])
        return Sent(None)

    async def acked(self, sent: Sent) -> bool:
        return await self.moto.depth(self.url) == 0  # visible or held: deleted means gone

    async def dead_lettered(self, sent: Sent, reason: str) -> bool:
        return await self.moto.depth(self.url) == 0 and reason in await self._dead_copies(sent.key_id)

    async def _dead_copies(self, key_id: str | None) -> list[str]:
        """The reasons of the dead-letter queue's copies of ``key_id`` (``None``: of those without
        one), received with a visibility of 0, so that they stay."""
        answer = await asyncio.to_thread(
            self.moto.sqs.receive_message, QueueUrl=self.dlq, MaxNumberOfMessages=10, VisibilityTimeout=0,
            WaitTimeSeconds=0, MessageAttributeNames=["All"])
        reasons = []
        for message in answer.get("Messages", []):
            attributes = message.get("MessageAttributes", {})
            if attributes.get(KEY_ATTRIBUTE, {}).get("StringValue") == key_id:
                reasons.append(attributes[REASON_ATTRIBUTE]["StringValue"])
        return reasons

    def _receive_failures(self) -> float:
        return REGISTRY.get_sample_value("consumer_kit_sqs_receive_failures_total",
                                         {"source": self.current.name}) or 0.0

    async def cut(self) -> None:
        failures = self._receive_failures()
        await self.proxy.stop()

        async def lost() -> bool:
            return self._receive_failures() > failures

        await wait_until(lost, 20, "the source to lose its endpoint")

    async def restore(self) -> None:
        await self.proxy.start()  # on the same port: the endpoint is back

    async def left_over(self) -> int:
        return await self.moto.depth(self.url)


class FifoSqsAdapter(SqsAdapter):
    """A FIFO queue, one message group: the order case only. One poller, as
    tests/integration/test_sqs_source.py explains (moto's receive is not atomic per group)."""

    id = "sqs-fifo"
    capabilities = frozenset({Capability.ORDER})
    fifo = True

    def make_source(self) -> Source:
        return SQSSource(queue_url=self.url, namespace=self.namespace, version=1, key=KEY_ATTRIBUTE,
                         dead_letter_queue_url=self.dlq, retry_delays=(0.3,), pollers=1)

    async def send_in_order(self, stable_ids: Sequence[str]) -> list[Sent]:
        await self.moto.send(self.url, [dict(self._message(stable_id), MessageGroupId="contract",
                                             MessageDeduplicationId=stable_id) for stable_id in stable_ids])
        return [Sent(stable_id) for stable_id in stable_ids]
