"""A Redis Streams worker: consume orders, record each in PostgreSQL, announce it through the outbox.

Run it the way production would::

    export DATABASE_URL=postgresql://app@db/app IDEMPOTENCY_HMAC_KEY=... REDIS_URL=redis://:password@host:6379/0
    consumer-kit db upgrade
    python -m examples.redis_worker init      # the example's table (streams and the group need no init)
    consumer-kit run examples.redis_worker:app --port 8000   # and /healthz, /readyz, /metrics

Each entry of the stream ``ORDERS_STREAM`` (default ``orders``), read by the consumer group
``ORDERS_GROUP`` (default ``order-recorders``), must carry a ``message-id`` field, its key (a producer
that adds the same order twice gives both the same one), and a ``body`` field with the JSON order
``{"order": "...", "amount": 12}``. The handler inserts one ``example_redis_orders`` row and stages an
``order.recorded`` event for the stream ``EVENTS_STREAM`` (default ``<ORDERS_STREAM>-events``) in the
same transaction; the relay that ``consumer-kit run`` starts adds it there with the outbox row id in
its ``message-id`` field, which is what a consumer of the events keys by. A redelivered entry changes
nothing, and a worker killed at any point and started again records each order once: what it held is
taken over by a running replica once it sat idle for ``ORDERS_CLAIM_IDLE_SECONDS`` (default 30).
Nothing acknowledged is lost only if Redis keeps it: ``appendonly yes`` with ``appendfsync always``.
"""

from __future__ import annotations

import os

from sqlalchemy import MetaData

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.redis import MESSAGE_ID_FIELD, RedisStreamPublisher, RedisStreamSource
from examples import create_tables
from examples.orders import main, orders_table, record_and_announce

ORDERS_STREAM = os.environ.get("ORDERS_STREAM", "orders")
ORDERS_GROUP = os.environ.get("ORDERS_GROUP", "order-recorders")
EVENTS_STREAM = os.environ.get("EVENTS_STREAM", f"{ORDERS_STREAM}-events")

metadata = MetaData()
orders = orders_table("example_redis_orders", metadata)

settings = Settings()
app = ConsumerApp(settings)
source = RedisStreamSource(
    stream=ORDERS_STREAM, group=ORDERS_GROUP, namespace="redis-orders", version=1, key=MESSAGE_ID_FIELD,
    max_in_flight=int(os.environ.get("ORDERS_MAX_IN_FLIGHT", "32")),
    claim_idle_seconds=float(os.environ.get("ORDERS_CLAIM_IDLE_SECONDS", "30")),
    retry_delays=(0.5, 2.0, 10.0),
)
app.relay_outbox(RedisStreamPublisher(settings=settings))


@app.handler(source, name="record-redis-order")
async def record_order(ctx: Context) -> None:
    """Record the order and announce it on EVENTS_STREAM."""
    await record_and_announce(ctx, orders, EVENTS_STREAM)


async def init() -> None:
    """Create the example's table. Redis needs nothing made first: the source creates its group (and the
    orders stream) at start, reading from the stream's first entry, so orders added before any worker
    ran are read too; the relay's ``XADD`` makes the events stream. consumer-kit's own tables come from
    ``consumer-kit db upgrade``."""
    await create_tables(settings, metadata)


if __name__ == "__main__":
    main("examples.redis_worker", init)
