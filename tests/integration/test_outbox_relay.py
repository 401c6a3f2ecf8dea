"""The relay on PostgreSQL and RabbitMQ: two relays publish each row once, a relay killed mid-batch
loses nothing, rows wait out an unreachable broker, and NOTIFY wakes an idle relay."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest

from consumer_kit import ConsumerApp
from consumer_kit.outbox import OutboxMessage, OutboxRelay
from consumer_kit.sources.rabbitmq import AmqpPublisher
from tests.conftest import make_settings
from tests.integration.rabbit import AMQP_URL, TcpProxy, declare, delete_queues, depth, drain, wait_until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-test-{secrets.token_hex(4)}"
    await declare(name)
    yield name
    await delete_queues(name)


@pytest.fixture
async def app(pg_database: str) -> AsyncIterator[ConsumerApp]:
    app = ConsumerApp(make_settings(pg_database, db_pool_size=5, outbox_batch_size=50,
                                    outbox_poll_seconds=0.1, outbox_backoff_seconds=0.05,
                                    outbox_backoff_max_seconds=0.2))
    async with app.running():
        yield app


async def enqueue(app: ConsumerApp, queue: str, count: int) -> list[str]:
    async with app.engine.begin() as conn:
        return [await app.outbox.enqueue(conn, queue, f"event-{i}") for i in range(count)]


async def run_relay(relay: OutboxRelay, stop: asyncio.Event) -> asyncio.Task[None]:
    return asyncio.create_task(relay.run(stop))


async def test_two_relays_publish_every_row_once(app: ConsumerApp, queue: str) -> None:
    ids = await enqueue(app, queue, 600)
    stop = asyncio.Event()
    publishers = [AmqpPublisher(AMQP_URL), AmqpPublisher(AMQP_URL)]
    relays = [OutboxRelay(app.outbox, p, app.settings) for p in publishers]
    tasks = [await run_relay(r, stop) for r in relays]

    async def all_out() -> bool:
        return (await app.outbox.stats()).pending == 0

    await wait_until(all_out, 30, "every row published")
    stop.set()
    await asyncio.gather(*tasks)
    for publisher in publishers:
        await publisher.close()
    received = await drain(queue)
    assert sorted(m.message_id or "" for m in received) == sorted(ids)  # each id exactly once


class StallingPublisher(AmqpPublisher):
    """Confirms ``allowed`` messages, then hangs: the relay is killed in the middle of its batch."""

    def __init__(self, allowed: int) -> None:
        super().__init__(AMQP_URL)
        self.allowed = allowed
        self.stalled = asyncio.Event()

    async def publish(self, message: OutboxMessage) -> None:
        if self.allowed <= 0:
            self.stalled.set()
            await asyncio.Event().wait()
        self.allowed -= 1
        await super().publish(message)


async def test_a_relay_killed_mid_batch_loses_nothing(app: ConsumerApp, queue: str) -> None:
    ids = await enqueue(app, queue, 120)
    stalling = StallingPublisher(allowed=10)
    killed = asyncio.create_task(OutboxRelay(app.outbox, stalling, app.settings).run_once())
    await asyncio.wait_for(stalling.stalled.wait(), 10)

    async def ten_confirmed() -> bool:
        return await depth(queue) == 10

    await wait_until(ten_confirmed, 10, "the first ten publishes of the doomed batch")
    killed.cancel()  # dies holding its batch: the transaction rolls back, the row locks go
    await asyncio.gather(killed, return_exceptions=True)
    await stalling.close()
    survivor = AmqpPublisher(AMQP_URL)
    relay = OutboxRelay(app.outbox, survivor, app.settings)
    assert await relay.drain() == 120
    await survivor.close()
    received = [m.message_id or "" for m in await drain(queue)]
    # Every row went out under its own id; the only repeats are the ten the dead relay had confirmed
    # but not recorded, and they carry the same ids, so a consumer's inbox absorbs them.
    assert set(received) == set(ids)
    assert len(received) == 130
    assert (await app.outbox.stats()).pending == 0


async def test_rows_wait_while_the_broker_is_unreachable(app: ConsumerApp, queue: str) -> None:
    proxy = TcpProxy()
    await proxy.start()
    publisher = AmqpPublisher(proxy.url)
    relay = OutboxRelay(app.outbox, publisher, app.settings)
    stop = asyncio.Event()
    task = await run_relay(relay, stop)
    try:
        first = await enqueue(app, queue, 10)

        async def first_out() -> bool:
            return await depth(queue) == 10

        await wait_until(first_out, 15, "the first rows")
        await proxy.stop()  # the connection drops and the port refuses new ones
        later = await enqueue(app, queue, 40)
        await asyncio.sleep(1.0)
        stats = await app.outbox.stats()
        assert stats.pending == 40 and stats.oldest_age_seconds > 0.5
        row = await app.outbox.get(later[0])
        assert row is not None and row["attempts"] >= 1 and row["published_at"] is None
        assert await depth(queue) == 10
        await proxy.start()  # the broker is back on the same port

        async def all_out() -> bool:
            return (await app.outbox.stats()).pending == 0

        await wait_until(all_out, 20, "the pending rows after the broker returned")
    finally:
        stop.set()
        await task
        await publisher.close()
        await proxy.stop()
    received = sorted(m.message_id or "" for m in await drain(queue))
    assert received == sorted(first + later)


async def test_notify_wakes_an_idle_relay(app: ConsumerApp, queue: str) -> None:
    app.settings.outbox_poll_seconds = 30.0  # only a NOTIFY can make this relay look again soon
    publisher = AmqpPublisher(AMQP_URL)
    relay = OutboxRelay(app.outbox, publisher, app.settings)
    stop = asyncio.Event()
    task = await run_relay(relay, stop)
    try:
        await asyncio.sleep(0.5)  # the first, empty round is over; the relay now waits
        await enqueue(app, queue, 3)

        async def out() -> bool:
            return await depth(queue) == 3

        await wait_until(out, 5, "the notified relay to publish")
    finally:
        stop.set()
        await task
        await publisher.close()
