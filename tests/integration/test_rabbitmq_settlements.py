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
import random
import uuid

import aio_pika
import pytest

from sources.rabbitmq import _Settlements
from tests.integration.rabbit import AMQP_URL, publish

pytestmark = pytest.mark.asyncio

MESSAGES = 2000


async def test_acks_rejects_and_nacks_under_write_pressure_arrive_as_meant() -> None:
    queue, dead = f"settle-{uuid.uuid4().hex[:8]}", f"settle-{uuid.uuid4().hex[:8]}.dead"
    connection = await aio_pika.connect(AMQP_URL)
    try:
        setup = await connection.channel()
        await setup.declare_queue(dead, durable=False, auto_delete=False)
        await setup.declare_queue(queue, durable=False, arguments={
            "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead})
        await publish(queue, [(f"m-{i}", b"x") for i in range(MESSAGES)])

        channel = await connection.channel()
        await channel.set_qos(prefetch_count=MESSAGES)
        received: list[aio_pika.abc.AbstractIncomingMessage] = []
        all_in = asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.append(message)
            if len(received) == MESSAGES:
                all_in.set()

        await (await channel.get_queue(queue)).consume(on_message)
        await asyncio.wait_for(all_in.wait(), 30)

        settlements = _Settlements()
        for message in received:
            settlements.received(message)
        meant_dead = {m.message_id for m in received if int(str(m.message_id)[2:]) % 7 in (0, 3)}

        async def settle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await asyncio.sleep(random.random() * 0.05)
            if message.message_id not in meant_dead:
                await settlements.ack(message)
            elif int(str(message.message_id)[2:]) % 2:
                await settlements.reject(message, requeue=False)
            else:
                await settlements.nack(message, requeue=False)

        async def flood() -> None:  # other frames on the same connection keep its frame queue full
            other = await connection.channel()
            for _ in range(20):
                await asyncio.gather(*(other.default_exchange.publish(aio_pika.Message(b"f"), routing_key=dead + ".x")
                                       for _ in range(200)))

        await asyncio.gather(flood(), *(settle(m) for m in received))
        await asyncio.sleep(0.5)  # the last frames reach the broker
        assert not channel.is_closed, "a settlement closed the channel (PRECONDITION_FAILED)"
        await channel.close()  # anything left unsettled goes back to the queue and is counted below

        check = await connection.channel()
        dead_queue = await check.declare_queue(dead, passive=True)
        main_queue = await check.declare_queue(queue, passive=True)
        assert main_queue.declaration_result.message_count == 0
        dead_ids = set()
        while (message := await dead_queue.get(fail=False, no_ack=True)) is not None:
            dead_ids.add(message.message_id)
        assert dead_ids == meant_dead
    finally:
        cleanup = await connection.channel()
        for name in (queue, dead):
            await cleanup.queue_delete(name)
        await connection.close()


async def test_a_settlement_whose_caller_is_cancelled_still_goes_out() -> None:
    # A delivery's task can be cancelled while it waits for its ack to be sent (its channel closing,
    # the shutdown's grace running out): the settlement was asked for and must still reach the broker,
    # in its order, or a message meant to be dead-lettered would come back and one acked run again.
    queue, dead = f"settle-{uuid.uuid4().hex[:8]}", f"settle-{uuid.uuid4().hex[:8]}.dead"
    connection = await aio_pika.connect(AMQP_URL)
    try:
        setup = await connection.channel()
        await setup.declare_queue(dead, durable=False, auto_delete=False)
        await setup.declare_queue(queue, durable=False, arguments={
            "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead})
        await publish(queue, [(f"m-{i}", b"x") for i in range(200)])
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=200)
        received: list[aio_pika.abc.AbstractIncomingMessage] = []
        all_in = asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.append(message)
            if len(received) == 200:
                all_in.set()

        await (await channel.get_queue(queue)).consume(on_message)
        await asyncio.wait_for(all_in.wait(), 30)
        settlements = _Settlements()
        for message in received:
            settlements.received(message)
        # Every message settled by a task cancelled as soon as it has asked: odd ones rejected.
        tasks = [asyncio.ensure_future(settlements.reject(m, requeue=False) if i % 2 else settlements.ack(m))
                 for i, m in enumerate(received)]
        await asyncio.sleep(0)  # each task has asked (its settlement is queued) and waits for the send
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert all(task.cancelled() for task in tasks), "the callers were not waiting when cancelled"
        await asyncio.sleep(0.5)  # the sender goes on without them
        assert not channel.is_closed
        await channel.close()  # anything unsettled would go back to the queue
        check = await connection.channel()
        assert (await check.declare_queue(queue, passive=True)).declaration_result.message_count == 0
        assert (await check.declare_queue(dead, passive=True)).declaration_result.message_count == 100
        await check.queue_delete(queue)
        await check.queue_delete(dead)
    finally:
        await connection.close()
