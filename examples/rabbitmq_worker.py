"""A RabbitMQ worker: consume orders, record each in PostgreSQL, announce it through the outbox.

Run it the way production would::

    export DATABASE_URL=postgresql://app@db/app IDEMPOTENCY_HMAC_KEY=... RABBITMQ_URL=amqp://...
    consumer-kit db upgrade
    python -m examples.rabbitmq_worker init      # creates the example's own table
    consumer-kit run examples.rabbitmq_worker:app --port 8000   # and /healthz, /readyz, /metrics

Each message on ``ORDERS_QUEUE`` (default ``orders``) must carry an AMQP ``message_id`` and a JSON
body ``{"order": "...", "amount": 12}``. The handler inserts one ``example_orders`` row and stages an
``order.recorded`` event for ``EVENTS_QUEUE`` (default ``orders.events``) in the same transaction;
the relay that ``consumer-kit run`` starts publishes it with a stable message id. A redelivered
message changes nothing, and a worker killed at any point and started again records each order once.
"""

from __future__ import annotations

import json
import os

import aio_pika
from sqlalchemy import MetaData

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.rabbitmq import AmqpPublisher, RabbitMQSource
from examples import create_tables
from examples.orders import main, orders_table, record

ORDERS_QUEUE = os.environ.get("ORDERS_QUEUE", "orders")
EVENTS_QUEUE = os.environ.get("EVENTS_QUEUE", f"{ORDERS_QUEUE}.events")

metadata = MetaData()
orders = orders_table("example_orders", metadata)

settings = Settings()
app = ConsumerApp(settings)
source = RabbitMQSource(
    queue=ORDERS_QUEUE, namespace="orders", version=1,
    prefetch=int(os.environ.get("ORDERS_PREFETCH", "32")),
    retry_delays=(0.5, 2.0, 10.0),
)
app.relay_outbox(AmqpPublisher(settings=settings))


@app.handler(source, name="record-order")
async def record_order(ctx: Context) -> None:
    """Record the order and announce it; both commit with the inbox row or not at all."""
    event = await record(ctx, orders)
    ctx.outbox.publish(EVENTS_QUEUE, json.dumps(event).encode(), headers={"content-type": "application/json"})


async def init() -> None:
    """Create the example's table and the events queue (the framework's own tables come from
    ``consumer-kit db upgrade``; the orders queue is declared by the source)."""
    await create_tables(settings, metadata)
    connection = await aio_pika.connect(settings.require_rabbitmq_url())
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(EVENTS_QUEUE, durable=True)


if __name__ == "__main__":
    main("examples.rabbitmq_worker", init)
