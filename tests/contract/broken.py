"""Sources that break the contract on purpose, built on the public names only, so that
``test_broken_sources.py`` can show the contract failing them: a suite that cannot fail proves nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from consumer_kit import Delivery, OperationKey, Outcome, Result, Settings, Settlement, Source
from consumer_kit.testing import InMemorySource
from tests.contract.adapters.memory import MemoryAdapter
from tests.contract.adapters.rabbitmq import RabbitMQAdapter
from tests.contract.base import Capability

Dispatch = Callable[[Delivery], Awaitable[Result]]  # what a source is given to hand deliveries over


class AcknowledgesFirst(InMemorySource):
    """Answers ACK as soon as a delivery arrives and runs it afterwards, as a receiver that answers 200
    before its handler committed: work in flight when the worker stops is lost."""

    def __init__(self, *, namespace: str, version: int) -> None:
        super().__init__(namespace=namespace, version=version)
        self.running: set[asyncio.Task[Result]] = set()

    async def deliver_delivery(self, delivery: Delivery) -> Result:
        task = asyncio.create_task(super().deliver_delivery(delivery))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        return Result(Outcome.PROCESSED, Settlement.ACK)


class DropsUnkeyable(InMemorySource):
    """Answers a delivery without a stable id as parked, but never hands it to the pipeline: nothing
    is kept for an operator, the work is dropped."""

    async def deliver_delivery(self, delivery: Delivery) -> Result:
        if delivery.id is None:
            return Result(Outcome.INVALID, Settlement.DEAD_LETTER, "missing_stable_id")
        return await super().deliver_delivery(delivery)


class AcknowledgingFirstMemory(MemoryAdapter):
    id = "memory-acknowledges-first"
    capabilities = frozenset({Capability.STOP})
    source_class = AcknowledgesFirst


class DroppingUnkeyableMemory(MemoryAdapter):
    id = "memory-drops-unkeyable"
    capabilities = frozenset({Capability.UNKEYABLE})
    source_class = DropsUnkeyable


class AcksOnArrival:
    """A source (``consumer_kit.Source``) around another that hands the pipeline a dispatch answering
    ACK at once while the delivery runs on in a task: the broker forgets the message before its
    handler committed."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.name, self.namespace, self.version = inner.name, inner.namespace, inner.version
        self.running: set[asyncio.Task[Result]] = set()

    def key(self, delivery: Delivery) -> OperationKey:
        return self.inner.key(delivery)

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        async def run(delivery: Delivery) -> Result:
            return await dispatch(delivery)

        async def acknowledged_at_once(delivery: Delivery) -> Result:
            task = asyncio.create_task(run(delivery))
            self.running.add(task)
            task.add_done_callback(self.running.discard)
            return Result(Outcome.PROCESSED, Settlement.ACK)

        await self.inner.start(acknowledged_at_once, settings)

    async def stop(self) -> None:
        await self.inner.stop()

    async def close(self) -> None:
        await self.inner.close()


class AcknowledgingFirstRabbitMQ(RabbitMQAdapter):
    id = "rabbitmq-acknowledges-first"
    capabilities = frozenset({Capability.STOP})

    def make_source(self) -> Source:
        return AcksOnArrival(super().make_source())
