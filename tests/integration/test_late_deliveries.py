"""Late deliveries: one older than the inbox's retention (by its source's send time), or of a key
whose record the sweeper deleted (its tombstone), may repeat work already done: parked as
arrived_after_retention by default, processed when LATE_DELIVERY_POLICY=process; counted either way."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY

from consumer_kit import ConsumerApp, Context, Delivery, Outcome, Settlement
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings

RETENTION = 3600


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


def build(url: str, policy: str, clock: Clock, **overrides: object) -> tuple[ConsumerApp, InMemorySource, list[str]]:
    app = ConsumerApp(make_settings(url, inbox_retention_seconds=RETENTION, late_delivery_policy=policy,
                                    **overrides), clock=clock)
    source = InMemorySource(namespace="late", version=1, name=f"late-{policy}")
    runs: list[str] = []

    @app.handler(source, name="late")
    async def handle(ctx: Context) -> None:
        runs.append(ctx.delivery.text())

    return app, source, runs


def late_count(source: str, action: str) -> float:
    return REGISTRY.get_sample_value("consumer_kit_late_deliveries_total",
                                     {"source": source, "action": action}) or 0.0


@pytest.mark.parametrize("policy", ["park", "process"])
async def test_a_delivery_sent_before_the_retention_window(database_url: str, policy: str) -> None:
    app, source, runs = build(database_url, policy, Clock())
    before = late_count(source.name, "parked" if policy == "park" else "processed")
    async with app.running():
        old = Delivery(id="old-1", body=b"old", sent_at=datetime.now(UTC) - timedelta(seconds=RETENTION + 60))
        result = await source.deliver_delivery(old)
        fresh = await source.deliver_delivery(
            Delivery(id="new-1", body=b"new", sent_at=datetime.now(UTC) - timedelta(seconds=5)))
        parked = await app.dead_letters.list(reason="arrived_after_retention")
    assert fresh.outcome is Outcome.PROCESSED
    if policy == "park":
        assert (result.outcome, result.settlement, result.reason) == (
            Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER, "arrived_after_retention")
        assert runs == ["new"] and [p.body for p in parked] == [b"old"]
    else:
        assert result.outcome is Outcome.PROCESSED and runs == ["old", "new"] and parked == []
    assert late_count(source.name, "parked" if policy == "park" else "processed") == before + 1
    age = REGISTRY.get_sample_value("consumer_kit_delivery_age_seconds_count", {"source": source.name})
    assert age is not None and age >= 2


@pytest.mark.parametrize("policy", ["park", "process"])
async def test_a_key_seen_again_after_its_record_was_swept(database_url: str, policy: str) -> None:
    clock = Clock()
    app, source, runs = build(database_url, policy, clock, inbox_tombstone_seconds=7200)
    async with app.running():
        assert (await source.deliver(id="swept-1", body=b"first")).outcome is Outcome.PROCESSED
        clock.now += timedelta(seconds=RETENTION + 60)
        assert await app.sweep() >= 1  # the record is gone; on park, its tombstone stays
        again = await source.deliver(id="swept-1", body=b"first")
        if policy == "park":
            assert (again.outcome, again.reason) == (Outcome.DEAD_LETTERED, "arrived_after_retention")
            assert runs == ["first"]
            clock.now += timedelta(seconds=7200 + 60)
            await app.sweep()  # the tombstone expires too: the key is new again
            assert (await source.deliver(id="swept-1", body=b"first")).outcome is Outcome.PROCESSED
            assert runs == ["first", "first"]
        else:
            assert again.outcome is Outcome.PROCESSED and runs == ["first", "first"]


async def test_a_single_transaction_handler_meets_the_tombstone_too(database_url: str) -> None:
    clock = Clock()
    app = ConsumerApp(make_settings(database_url, inbox_retention_seconds=RETENTION), clock=clock)
    source = InMemorySource(namespace="late", version=1, name="late-single")
    runs: list[str] = []

    @app.handler(source, name="late-single", single_transaction=True)
    async def handle(ctx: Context) -> None:
        runs.append(ctx.delivery.text())

    async with app.running():
        assert (await source.deliver(id="swept-2", body=b"x")).outcome is Outcome.PROCESSED
        clock.now += timedelta(seconds=RETENTION + 60)
        await app.sweep()
        again = await source.deliver(id="swept-2", body=b"x")
    assert (again.outcome, again.reason) == (Outcome.DEAD_LETTERED, "arrived_after_retention")
    assert runs == ["x"]


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_an_amqp_message_is_aged_by_its_timestamp(pg_database: str) -> None:
    """The AMQP ``timestamp`` property is the send time: a message published long before the
    retention window is parked, one published now is processed."""
    import secrets

    import aio_pika

    from consumer_kit.sources.rabbitmq import RabbitMQSource
    from tests.integration.rabbit import AMQP_URL, delete_queues, wait_until

    queue = f"ck-test-{secrets.token_hex(4)}"
    app = ConsumerApp(make_settings(pg_database, inbox_retention_seconds=RETENTION))
    source = RabbitMQSource(queue=queue, namespace="late", version=1, url=AMQP_URL, retry_delays=(0.2,))
    runs: list[str] = []

    @app.handler(source, name="late-amqp")
    async def handle(ctx: Context) -> None:
        runs.append(ctx.delivery.text())

    try:
        async with app.running():
            connection = await aio_pika.connect(AMQP_URL)
            async with connection:
                channel = await connection.channel(publisher_confirms=True)
                for message_id, age in (("amqp-old", RETENTION + 600), ("amqp-new", 5)):
                    await channel.default_exchange.publish(aio_pika.Message(
                        message_id.encode(), message_id=message_id,
                        timestamp=datetime.now(UTC) - timedelta(seconds=age)), routing_key=queue)

            async def settled() -> bool:
                return runs == ["amqp-new"] and await app.dead_letters.count(reason="arrived_after_retention") == 1

            await wait_until(settled, 15, "the old message parked and the new one processed")
    finally:
        await delete_queues(queue)


def test_an_sns_notification_is_aged_by_its_own_timestamp() -> None:
    import json

    from consumer_kit.sources.envelopes import unwrap

    queued = datetime(2026, 1, 2, tzinfo=UTC)
    body = json.dumps({"Type": "Notification", "MessageId": "m-1", "TopicArn": "arn:aws:sns:r:1:t",
                       "Message": "{}", "Timestamp": "2026-01-01T10:00:00.000Z"}).encode()
    [delivery] = unwrap("sns", message_id="sqs-1", body=body, headers={}, sent_at=queued)
    assert delivery.sent_at == datetime(2026, 1, 1, 10, tzinfo=UTC)  # SNS's time, not the queue's
    [plain] = unwrap("sqs", message_id="sqs-2", body=b"x", headers={}, sent_at=queued)
    assert plain.sent_at == queued
