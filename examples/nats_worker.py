"""A NATS JetStream worker: consume orders, record each in PostgreSQL, announce it through the outbox.

Run it the way production would::

    export DATABASE_URL=postgresql://app@db/app IDEMPOTENCY_HMAC_KEY=... NATS_URL=nats://...
    consumer-kit db upgrade
    python -m examples.nats_worker init      # the example's table and the events stream, if missing
    consumer-kit run examples.nats_worker:app --port 8000   # and /healthz, /readyz, /metrics

Each message on ``ORDERS_SUBJECT`` (default ``orders.>``, captured by the stream ``ORDERS_STREAM``,
default ``ORDERS``, which the source creates if missing) must carry a ``Nats-Msg-Id`` header, its key,
and a JSON body ``{"order": "...", "amount": 12}``. The handler inserts one ``example_nats_orders``
row and stages an ``order.recorded`` event for ``EVENTS_SUBJECT`` (default ``order-events.recorded``,
captured by ``EVENTS_STREAM``, default ``ORDER_EVENTS``) in the same transaction; the relay that
``consumer-kit run`` starts publishes it with the outbox row id as its ``Nats-Msg-Id`` and waits for
the stream's acknowledgement. A redelivered message changes nothing, and a worker killed at any point
and started again records each order once: what it held comes back after ``ORDERS_ACK_WAIT_SECONDS``
(default 30).
"""

from __future__ import annotations

import os

from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError
from sqlalchemy import MetaData

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.nats import NatsPublisher, NatsSource
from consumer_kit.sources.nats.connection import connect
from examples import create_tables
from examples.orders import main, orders_table, record_and_announce

ORDERS_STREAM = os.environ.get("ORDERS_STREAM", "ORDERS")
ORDERS_SUBJECT = os.environ.get("ORDERS_SUBJECT", "orders.>")
EVENTS_STREAM = os.environ.get("EVENTS_STREAM", "ORDER_EVENTS")
EVENTS_SUBJECT = os.environ.get("EVENTS_SUBJECT", "order-events.recorded")

metadata = MetaData()
orders = orders_table("example_nats_orders", metadata)

settings = Settings()
app = ConsumerApp(settings)
source = NatsSource(
    stream=ORDERS_STREAM, subject=ORDERS_SUBJECT, namespace="nats-orders", version=1,
    max_in_flight=int(os.environ.get("ORDERS_MAX_IN_FLIGHT", "32")),
    ack_wait_seconds=float(os.environ.get("ORDERS_ACK_WAIT_SECONDS", "30")),
    retry_delays=(0.5, 2.0, 10.0),
)
app.relay_outbox(NatsPublisher(settings=settings))


@app.handler(source, name="record-nats-order")
async def record_order(ctx: Context) -> None:
    """Record the order and announce it on EVENTS_SUBJECT."""
    await record_and_announce(ctx, orders, EVENTS_SUBJECT)


async def init() -> None:
    """Create the example's table and the events stream unless it exists (a subject no stream captures
    gets no acknowledgement, and its outbox row would stay pending). The orders stream and the durable
    consumer are made by the source at start; consumer-kit's own tables by ``consumer-kit db upgrade``."""
    # A server that is not there, or refuses the login, is one line naming it (no password shown).
    client = await connect(settings.require_nats_url(), "examples.nats_worker-init")
    try:
        js = client.jetstream()
        try:
            await js.stream_info(EVENTS_STREAM)
        except NotFoundError:
            await js.add_stream(StreamConfig(name=EVENTS_STREAM, subjects=[EVENTS_SUBJECT], storage=StorageType.FILE))
    finally:
        await client.close()
    await create_tables(settings, metadata)


if __name__ == "__main__":
    main("examples.nats_worker", init)
