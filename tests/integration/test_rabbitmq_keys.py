"""RabbitMQSource's explicit keys and CloudEvents envelope against the real broker (the inbox on a
SQLite file: these tests are about the source): aio-pika's random message ids, key= by header, and
the CloudEvents AMQP binding in binary and structured mode."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest

from consumer_kit import ConsumerApp, Context
from consumer_kit.sources.rabbitmq import REASON_HEADER, RabbitMQSource
from tests.conftest import make_settings
from tests.integration.rabbit import AMQP_URL, delete_queues, depth, drain, wait_until

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-test-{secrets.token_hex(4)}"
    yield name
    await delete_queues(name)


async def publish(queue: str, *messages: aio_pika.Message) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        for message in messages:
            await channel.default_exchange.publish(message, routing_key=queue)


def worker(sqlite_url: str, queue: str, **options: Any) -> tuple[ConsumerApp, list[tuple[str, bytes, dict[str, str]]]]:
    app = ConsumerApp(make_settings(sqlite_url))
    source = RabbitMQSource(queue=queue, namespace="orders", version=1, url=AMQP_URL, name=f"{queue}-keys",
                            retry_delays=(0.2,), **options)
    seen: list[tuple[str, bytes, dict[str, str]]] = []

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        seen.append((ctx.key.id, ctx.delivery.body, dict(ctx.delivery.headers)))

    return app, seen


async def test_aio_pika_gives_each_publish_a_random_message_id_so_key_by_a_business_id(
        queue: str, sqlite_url: str) -> None:
    # The trap: a publisher that re-sends after a lost confirm, without setting message_id, gets a new
    # random message_id from aiormq, so keying by message_id counts the order twice.
    by_message_id, seen_by_id = worker(sqlite_url, queue)
    async with by_message_id.running():
        await publish(queue, *(aio_pika.Message(b'{"order": "O-1"}', headers={"order-id": "O-1"}) for _ in range(2)))
        await wait_until(lambda: _true(len(seen_by_id) == 2), 20, "both copies")
    assert seen_by_id[0][0] != seen_by_id[1][0]  # two keys for one order

    # The fix: key= the header that holds the business id (or set message_id= when publishing).
    by_header, seen_by_header = worker(sqlite_url.replace(".db", "-2.db"), queue, key="order-id")
    async with by_header.running():
        await publish(queue, *(aio_pika.Message(b'{"order": "O-2"}', headers={"order-id": "O-2"}) for _ in range(2)),
                      aio_pika.Message(b'{"order": "?"}', headers={"trace": "t-1"}))

        async def settled() -> bool:
            return await depth(queue) == 0 and await depth(f"{queue}.dlq") == 1

        await wait_until(settled, 20, "the copies and the unkeyed one")
        letters = await by_header.dead_letters.list()
    assert [key_id for key_id, _, _ in seen_by_header] == ["O-2"]
    assert [(letter.reason, letter.body) for letter in letters] == [("missing_stable_id", b'{"order": "?"}')]
    [parked] = await drain(f"{queue}.dlq")
    assert (parked.headers or {})[REASON_HEADER] == "missing_stable_id"


async def test_cloudevents_in_amqp_binary_and_structured_mode(queue: str, sqlite_url: str) -> None:
    app, seen = worker(sqlite_url, queue, envelope="cloudevents")
    binary_headers = {"cloudEvents_specversion": "1.0", "cloudEvents_id": "ev-1", "cloudEvents_source": "/orders",
                      "cloudEvents_type": "order.created", "cloudEvents_subject": "O-1"}
    structured = {"specversion": "1.0", "id": "ev-2", "source": "/orders", "type": "order.created",
                  "datacontenttype": "application/json", "data": {"order": "O-2"}}
    async with app.running():
        await publish(
            queue,
            aio_pika.Message(b'{"order": "O-1"}', content_type="application/json", headers=binary_headers),
            # The same event again (a new random message_id): the key is the event's, so a duplicate.
            aio_pika.Message(b'{"order": "O-1"}', content_type="application/json", headers=binary_headers),
            aio_pika.Message(json.dumps(structured).encode(), content_type="application/cloudevents+json"),
            aio_pika.Message(b'{"order": "O-3"}', content_type="application/json", headers={"x": "not an event"}))

        async def settled() -> bool:
            return await depth(queue) == 0 and await depth(f"{queue}.dlq") == 1 and len(seen) == 2

        await wait_until(settled, 20, "two events, one duplicate and one parked")
    assert sorted((key_id, body) for key_id, body, _ in seen) == [
        ("/orders#ev-1", b'{"order": "O-1"}'), ("/orders#ev-2", b'{"order":"O-2"}')]
    headers = dict(next(h for k, _, h in seen if k == "/orders#ev-1"))
    assert headers["ce-subject"] == "O-1" and headers["content-type"] == "application/json"
    [parked] = await drain(f"{queue}.dlq")
    assert (parked.headers or {})[REASON_HEADER] == "envelope_mismatch" and parked.body == b'{"order": "O-3"}'


async def _true(value: bool) -> bool:
    await asyncio.sleep(0)
    return value
