"""SQS end to end with the inbox on the real PostgreSQL server: re-sent duplicates keyed by an
attribute, and the outbox relay publishing through SqsPublisher to standard and FIFO queues."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Column, Integer, MetaData, String, Table, distinct, func, select, text

from consumer_kit import ConsumerApp, Context
from consumer_kit.outbox import OutboxMessage, OutboxRelay
from consumer_kit.sources.sqs import MESSAGE_ID_ATTRIBUTE, SqsPublisher, SQSSource
from tests.integration.rabbit import wait_until
from tests.integration.sqs_env import Moto, attribute

pytestmark = [pytest.mark.sqs, pytest.mark.postgres]

effects_metadata = MetaData()
effects = Table(
    "sqs_effects", effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_ref", String(100), nullable=False),
)


async def whereabouts(app: ConsumerApp, moto: Moto, url: str, dlq: str) -> str:
    """Where the orders without an effect are: their inbox rows (by digest), the parked rows, the queues."""
    from consumer_kit.keys import OperationKey

    async with app.engine.connect() as conn:
        have = {row[0] for row in (await conn.execute(select(effects.c.order_ref))).all()}
        missing = sorted({f"order-{i:04d}" for i in range(2_000)} - have)[:5]
        rows = {m: (await conn.execute(text(
            "SELECT state, outcome, attempts, last_error FROM inbox WHERE key_digest = :d"),
            {"d": app.settings.digester().candidates(OperationKey("orders", 1, f"O-{m[6:]}"))[0]})).all()
            for m in missing}
        parked = (await conn.execute(text("SELECT reason, detail FROM dead_letters"))).all()
    return (f"missing {missing} inbox {rows} parked {parked[:5]} depth {await moto.depth(url)}"
            f" dlq depth {await moto.depth(dlq)}")


async def counts(app: ConsumerApp) -> tuple[int, int]:
    async with app.engine.connect() as conn:
        row = (await conn.execute(select(func.count(), func.count(distinct(effects.c.order_ref))))).one()
    return int(row[0]), int(row[1])


async def test_two_thousand_with_resent_duplicates(moto: Moto, pg_database: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    url, dlq = await moto.queue()
    app = ConsumerApp(moto.settings(pg_database, db_pool_size=10))
    source = SQSSource(queue_url=url, namespace="orders", version=1, key="order-id", dead_letter_queue_url=dlq,
                       max_in_flight=40, retry_delays=(0.5,))

    @app.handler(source, name="sqs-orders")
    async def record(ctx: Context) -> None:
        await ctx.db.execute(effects.insert().values(order_ref=ctx.delivery.text()))

    def message(i: int) -> dict[str, object]:
        return {"MessageBody": f"order-{i:04d}", "MessageAttributes": {"order-id": attribute(f"O-{i:04d}")}}

    # Every tenth order is sent again by its publisher: a new SQS message (new MessageId) with the same
    # key, right behind the original so both usually arrive in one receive batch.
    messages = []
    for i in range(2_000):
        messages.append(message(i))
        if i % 10 == 0:
            messages.append(message(i))
    with caplog.at_level(logging.WARNING, logger="consumer_kit.sources.sqs"):
        async with app.running():
            async with app.engine.begin() as conn:
                await conn.run_sync(effects_metadata.drop_all)
                await conn.run_sync(effects_metadata.create_all)
            await moto.send(url, messages)  # while the worker runs, as a live producer would

            async def done() -> bool:
                return (await counts(app))[1] == 2_000 and await moto.depth(url) == 0

            try:
                await wait_until(done, 120, "2,000 effects and an empty queue")
            except AssertionError as exc:  # rare, under heavy load: say where the missing orders are
                raise AssertionError(f"{exc}; {await whereabouts(app, moto, url, dlq)}") from None
            assert await counts(app) == (2_000, 2_000)
            assert await app.dead_letters.count() == 0
    # Each copy waited for its original in this worker and was acknowledged as a duplicate, none sent
    # back to the queue while the original's lease was live. (SQS, and moto, may deliver a message
    # again after its delete: more duplicates are possible, never fewer.)
    outcomes = {outcome: REGISTRY.get_sample_value("consumer_kit_deliveries_total",
                                                   {"source": source.name, "outcome": outcome}) or 0
                for outcome in ("processed", "duplicate", "in_progress")}
    assert outcomes["processed"] == 2_000 and outcomes["duplicate"] >= 200 and outcomes["in_progress"] == 0
    assert await moto.depth(url) == 0 and await moto.depth(dlq) == 0
    # Every batched call went through: no BatchEntryIdsNotDistinct, no failed delete or change. Except
    # one failure that is moto's own: two of its request threads can receive one message at once, and
    # a receipt handle minted just after the message's delete is refused (ReceiptHandleIsInvalid); the
    # message is gone and its effect written, so nothing is lost (real SQS never refuses a handle it gave).
    assert not [r.getMessage() for r in caplog.records
                if r.name == "consumer_kit.sources.sqs" and "ReceiptHandleIsInvalid" not in r.getMessage()]


async def test_the_relay_publishes_through_sqs_and_consumers_key_by_the_row_id(
        moto: Moto, pg_database: str) -> None:
    events, events_dlq = await moto.queue()
    ordered, _ = await moto.queue(fifo=True, dead_letter=False)
    settings = moto.settings(pg_database, db_pool_size=5, outbox_batch_size=50, outbox_poll_seconds=0.1)
    app = ConsumerApp(settings)
    app.relay_outbox(SqsPublisher(settings=settings))
    async with app.running():
        async with app.engine.begin() as conn:
            ids = [await app.outbox.enqueue(conn, events.rsplit("/", 1)[1], f"event-{i}",  # by queue name
                                            headers={"content-type": "text/plain"}) for i in range(120)]
            fifo_ids = [await app.outbox.enqueue(conn, ordered, f"step-{i}",
                                                 headers={"message-group-id": "order-1"}) for i in range(12)]

        async def all_out() -> bool:
            return (await app.outbox.stats()).pending == 0

        await wait_until(all_out, 30, "every row published")
    # A relay that dies after SQS accepted a message sends it again with the same row id: on a FIFO
    # queue SQS drops the copy, on a standard queue the consumer's inbox does (key= the row id).
    publisher = SqsPublisher(settings=settings)
    try:
        await asyncio.gather(
            publisher.publish(OutboxMessage(id=fifo_ids[0], destination=ordered, body=b"step-0",
                                            headers={"message-group-id": "order-1"})),
            publisher.publish(OutboxMessage(id=ids[0], destination=events, body=b"event-0",
                                            headers={"content-type": "text/plain"})))
    finally:
        await publisher.close()
    assert await moto.depth(ordered) == 12 and await moto.depth(events) == 121
    steps = await moto.drain(ordered)
    assert [m["Body"] for m in steps] == [f"step-{i}" for i in range(12)]  # the outbox's order, one group
    assert [m["Attributes"]["MessageDeduplicationId"] for m in steps] == fifo_ids

    consumer = ConsumerApp(settings)
    source = SQSSource(queue_url=events, namespace="events", version=1, key=MESSAGE_ID_ATTRIBUTE,
                       dead_letter_queue_url=events_dlq, retry_delays=(0.2,))
    seen: list[tuple[str, str]] = []

    @consumer.handler(source, name="sqs-events")
    async def on_event(ctx: Context) -> None:
        seen.append((ctx.delivery.headers[MESSAGE_ID_ATTRIBUTE], ctx.delivery.headers["content-type"]))

    async with consumer.running():
        async def consumed() -> bool:
            return await moto.depth(events) == 0

        await wait_until(consumed, 30, "the events queue to empty")
    assert sorted(row_id for row_id, _ in seen) == sorted(ids)  # the re-sent copy ran nothing
    assert {content_type for _, content_type in seen} == {"text/plain"}


async def test_a_publish_that_sqs_refuses_fails_that_row_only(moto: Moto, sqlite_url: str) -> None:
    events, _ = await moto.queue(dead_letter=False)
    ordered, _ = await moto.queue(fifo=True, dead_letter=False)
    publisher = SqsPublisher(settings=moto.settings(sqlite_url))
    messages = [OutboxMessage(id="row-1", destination=events, body=b"fine", headers={}),
                OutboxMessage(id="row-2", destination=ordered, body=b"no group", headers={}),
                OutboxMessage(id="row-3", destination=events, body=b"bad header", headers={"AWS.x": "1"}),
                OutboxMessage(id="row-4", destination=events, body=b"x" * 2_000_000, headers={}),
                OutboxMessage(id="row-5", destination="ck-no-such-queue", body=b"lost?", headers={}),
                OutboxMessage(id="row-6", destination=events, body=b"y" * 300_000, headers={})]
    try:
        results = await asyncio.gather(*(publisher.publish(m) for m in messages), return_exceptions=True)
    finally:
        await publisher.close()
    assert results[0] is None and results[5] is None  # over the classic 256 KiB batch size: sent alone
    assert "message-group-id" in str(results[1])
    assert "not a valid SQS message attribute name" in str(results[2])
    assert isinstance(results[3], Exception) and isinstance(results[4], Exception)
    assert Counter(m["Body"][:4] for m in await moto.drain(events)) == {"fine": 1, "yyyy": 1}


async def test_rows_wait_out_an_unreachable_endpoint(moto: Moto, sqlite_url: str) -> None:
    events, _ = await moto.queue(dead_letter=False)
    with socket.socket() as probe:  # a port that was just free: nothing listens there
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    settings = moto.settings(sqlite_url)
    app = ConsumerApp(settings)
    async with app.running():
        async with app.engine.begin() as conn:
            row = await app.outbox.enqueue(conn, events, "kept")
        unreachable = SqsPublisher(settings=settings, endpoint_url=dead)
        try:
            assert await OutboxRelay(app.outbox, unreachable, settings).run_once() == (0, 1)
        finally:
            await unreachable.close()
        assert (await app.outbox.stats()).pending == 1
        async with app.engine.begin() as conn:  # the failed row is due again after its backoff: now
            await conn.execute(text("UPDATE outbox SET available_at = created_at"))
        reachable = SqsPublisher(settings=settings)
        try:
            assert await OutboxRelay(app.outbox, reachable, settings).run_once() == (1, 0)
        finally:
            await reachable.close()
    [message] = await moto.drain(events)
    assert message["Body"] == "kept" and message["MessageAttributes"][MESSAGE_ID_ATTRIBUTE]["StringValue"] == row
