"""The contract's adapter for :class:`~consumer_kit.testing.InMemorySource`: the test is the producer,
and, like an HTTP client, it sends again whatever got no acknowledgement."""

from __future__ import annotations

import asyncio
import secrets

from opentelemetry.trace import SpanKind

from consumer_kit import Result, Settings, Settlement, Source
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings
from tests.contract.base import EVERY_SOURCE, Capability, Sent, SourceAdapter


class MemoryAdapter(SourceAdapter):
    """``source.deliver(...)`` in a task of its own per send; its :class:`Result` is the answer."""

    id = "memory"
    capabilities = EVERY_SOURCE | {Capability.UNKEYABLE, Capability.TRACE}
    span_kind = SpanKind.INTERNAL
    source_class: type[InMemorySource] = InMemorySource

    def __init__(self) -> None:
        super().__init__()
        self.namespace = f"contract-memory-{secrets.token_hex(4)}"

    def settings(self, database_url: str, **overrides: object) -> Settings:
        values: dict[str, object] = {"retry_attempts": 1, "retry_later_seconds": 0.1}
        values.update(overrides)
        return make_settings(database_url, **values)

    def make_source(self) -> Source:
        return self.source_class(namespace=self.namespace, version=1)

    def _deliver(self, sent: Sent, stable_id: str | None, headers: dict[str, str]) -> Sent:
        source: InMemorySource = self.current
        sent.attempts.append(asyncio.create_task(source.deliver(
            id=stable_id, body=b'{"contract": true}', headers=headers, attempt=len(sent.attempts) + 1)))
        sent.detail = (stable_id, headers)
        return sent

    async def send(self, stable_id: str, *, traceparent: str | None = None) -> Sent:
        return self._deliver(Sent(stable_id), stable_id, {"traceparent": traceparent} if traceparent else {})

    async def send_again(self, sent: Sent) -> Sent:
        stable_id, headers = sent.detail
        return self._deliver(Sent(sent.key_id), stable_id, headers)

    async def send_unkeyed(self) -> Sent:
        return self._deliver(Sent(None), None, {})

    def _settled(self, sent: Sent) -> Result | None:
        answer = sent.answer
        return answer if isinstance(answer, Result) else None

    async def acked(self, sent: Sent) -> bool:
        result = self._settled(sent)
        return result is not None and result.settlement is Settlement.ACK

    async def dead_lettered(self, sent: Sent, reason: str) -> bool:
        result = self._settled(sent)
        return result is not None and result.settlement is Settlement.DEAD_LETTER and result.reason == reason

    async def retry_as_told(self, sent: Sent) -> None:
        await sent.attempts[-1]
        result = self._settled(sent)
        assert result is not None and result.settlement is Settlement.RETRY_LATER, result
        stable_id, headers = sent.detail
        self._deliver(sent, stable_id, headers)

    async def resend_unsettled(self, sent: Sent) -> None:
        await asyncio.wait([sent.attempts[-1]])
        if not await self.acked(sent):
            stable_id, headers = sent.detail
            self._deliver(sent, stable_id, headers)
