"""Settlements of one channel under write pressure, on a real broker.

aiormq queues outgoing frames in a queue of ten; a frame that waits for room can be overtaken by a later
one. Settlements sent concurrently could then reach the broker out of order, and a multiple ack that
overtook the reject of a lower delivery tag settled that delivery as acked (lost instead of
dead-lettered), after which the late reject closed the channel with PRECONDITION_FAILED "unknown
delivery tag". The source sends every settlement of a channel through one ordered sender; this proves
that what was meant to be dead-lettered is, what was meant to be acked is gone, and the channel lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aio_pika
import pytest

from consumer_kit.sources.rabbitmq.settlement import Settlements
from tests.integration.rabbit import AMQP_URL, publish

pytestmark = pytest.mark.asyncio

MESSAGES = 2000


@dataclass
class Received:
    connection: aio_pika.abc.AbstractConnection
    channel: aio_pika.abc.AbstractChannel
    messages: list[aio_pika.abc.AbstractIncomingMessage]
    settlements: Settlements
    queue: str
    dead: str

    async def depths(self) -> tuple[int, int]:
        """Messages left in the queue and in its dead-letter queue (after the channel closed)."""
        check = await self.connection.channel()
        main = await check.declare_queue(self.queue, passive=True)
        dead = await check.declare_queue(self.dead, passive=True)
        return main.declaration_result.message_count or 0, dead.declaration_result.message_count or 0


@contextlib.asynccontextmanager
async def all_received(count: int) -> AsyncIterator[Received]:
    """``count`` messages published to a fresh queue (dead-lettered to another) and all delivered,
    unsettled, to one channel whose deliveries a ``Settlements`` knows; both queues deleted after."""
    queue, dead = f"settle-{uuid.uuid4().hex[:8]}", f"settle-{uuid.uuid4().hex[:8]}.dead"
    connection = await aio_pika.connect(AMQP_URL)
    try:
        setup = await connection.channel()
        await setup.declare_queue(dead, durable=False, auto_delete=False)
        await setup.declare_queue(queue, durable=False, arguments={
            "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead})
        await publish(queue, [(f"m-{i}", b"x") for i in range(count)])
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=count)
        received: list[aio_pika.abc.AbstractIncomingMessage] = []
        all_in = asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.append(message)
            if len(received) == count:
                all_in.set()

        await (await channel.get_queue(queue)).consume(on_message)
        await asyncio.wait_for(all_in.wait(), 30)
        settlements = Settlements()
        for message in received:
            settlements.received(message)
        yield Received(connection, channel, received, settlements, queue, dead)
    finally:
        cleanup = await connection.channel()
        for name in (queue, dead):
            await cleanup.queue_delete(name)
        await connection.close()


async def test_acks_rejects_and_nacks_under_write_pressure_arrive_as_meant() -> None:
    async with all_received(MESSAGES) as got:
        settlements, received, channel, connection = got.settlements, got.messages, got.channel, got.connection
        meant_dead = {m.message_id for m in received if int(str(m.message_id)[2:]) % 7 in (0, 3)}

        async def settle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await asyncio.sleep(random.random() * 0.05)
            if message.message_id not in meant_dead:
                settlements.ack(message)
            elif int(str(message.message_id)[2:]) % 2:
                settlements.reject(message, requeue=False)
            else:
                settlements.nack(message, requeue=False)

        async def flood() -> None:  # other frames on the same connection keep its frame queue full
            other, nowhere = await connection.channel(), got.dead + ".x"
            for _ in range(20):
                await asyncio.gather(*(other.default_exchange.publish(aio_pika.Message(b"f"), routing_key=nowhere)
                                       for _ in range(200)))

        await asyncio.gather(flood(), *(settle(m) for m in received))
        await settlements.drained()
        await asyncio.sleep(0.5)  # the last frames reach the broker
        assert not channel.is_closed, "a settlement closed the channel (PRECONDITION_FAILED)"
        await channel.close()  # anything left unsettled goes back to the queue and is counted below

        assert (await got.depths())[0] == 0
        dead_queue = await (await connection.channel()).declare_queue(got.dead, passive=True)
        dead_ids = set()
        while (message := await dead_queue.get(fail=False, no_ack=True)) is not None:
            dead_ids.add(message.message_id)
        assert dead_ids == meant_dead


async def test_settlements_asked_for_are_all_sent_by_the_time_drained_returns() -> None:
    # Nobody waits for a settlement to be sent (a delivery asks and ends); the source's close() waits
    # for the senders instead, so that what was asked for before the channel closes reaches the broker,
    # in its order: a message meant to be dead-lettered must not come back, nor one acked run again.
    async with all_received(200) as got:
        for i, message in enumerate(got.messages):  # odd ones rejected, the rest acked
            if i % 2:
                got.settlements.reject(message, requeue=False)
            else:
                got.settlements.ack(message)
        await got.settlements.drained()
        await got.channel.close()  # at once: anything not yet sent would go back to the queue
        assert await got.depths() == (0, 100)


async def test_a_settlement_for_a_closed_channel_is_not_sent_and_the_broker_takes_the_message_back() -> None:
    async with all_received(20) as got:
        await got.channel.close()
        for message in got.messages:
            got.settlements.ack(message)  # logged, not raised: nothing can be sent on a closed channel
        await got.settlements.drained()
        assert await got.depths() == (20, 0)
