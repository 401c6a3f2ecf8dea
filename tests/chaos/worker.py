"""The worker the chaos suite runs as a user would (``consumer-kit run tests.chaos.worker:app``).

``CHAOS_TRANSPORT`` picks the source: ``rabbitmq`` (the queue ``CHAOS_QUEUE``), ``nats`` (the stream
``CHAOS_QUEUE``, subject ``CHAOS_SUBJECT``, its unacknowledged messages back 3 s after a kill) or
``redis`` (the stream ``CHAOS_QUEUE``, group ``CHAOS_GROUP``, keyed by the entry's ``chaos-id``, a dead
consumer's entries claimed after 3 s idle). ``CHAOS_PATH`` picks the handler: ``default`` (two
transactions, an effect row through ``ctx.db``), ``single`` (``single_transaction=True``, the same row),
and on RabbitMQ only ``batch`` (the same, 64 deliveries a transaction), ``staged`` (``staged=True`` on
asyncpg: the handler stages the row, which goes with the key's in one statement) or ``outbox`` (two
transactions, the row and an outbox message to ``CHAOS_QUEUE.out``, published by the relay running in
the same process). The effect row names the business id: the AMQP ``message_id`` on RabbitMQ, the body (the same
id) on NATS and Redis.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import text

from consumer_kit import Batch, ConsumerApp, Context, Settings

TRANSPORT = os.environ.get("CHAOS_TRANSPORT", "rabbitmq")
PATH = os.environ.get("CHAOS_PATH", "default")
QUEUE = os.environ.get("CHAOS_QUEUE", "ck-chaos")
RETRY_DELAYS = (0.5, 1.0, 2.0)
SETTLE_AFTER_KILL_SECONDS = 3.0  # NATS ack wait, Redis claim idle: how soon a killed worker's messages return

settings = Settings()
app = ConsumerApp(settings)


def _source() -> Any:
    if TRANSPORT == "nats":
        from consumer_kit.sources.nats import NatsSource
        return NatsSource(stream=QUEUE, subject=os.environ["CHAOS_SUBJECT"], namespace="chaos", version=1,
                          name=f"{QUEUE}-worker", ack_wait_seconds=SETTLE_AFTER_KILL_SECONDS,
                          retry_delays=RETRY_DELAYS)
    if TRANSPORT == "redis":
        from consumer_kit.sources.redis import RedisStreamSource
        return RedisStreamSource(stream=QUEUE, group=os.environ["CHAOS_GROUP"], namespace="chaos", version=1,
                                 name=f"{QUEUE}-worker", key="chaos-id",
                                 claim_idle_seconds=SETTLE_AFTER_KILL_SECONDS, retry_delays=RETRY_DELAYS)
    if TRANSPORT != "rabbitmq":
        raise ValueError(f"CHAOS_TRANSPORT={TRANSPORT!r}: rabbitmq, nats or redis")
    from consumer_kit.sources.rabbitmq import AmqpPublisher, RabbitMQSource
    if PATH == "outbox":
        app.relay_outbox(AmqpPublisher(connection_name=f"{QUEUE}-relay"))
    return RabbitMQSource(queue=QUEUE, namespace="chaos", version=1, name=f"{QUEUE}-worker",
                          prefetch=128 if PATH == "batch" else 32, retry_delays=RETRY_DELAYS)


if TRANSPORT != "rabbitmq" and PATH not in ("default", "single"):
    raise ValueError(f"CHAOS_PATH={PATH!r} runs on RabbitMQ only; {TRANSPORT} runs default and single")
source = _source()


@app.handler(source, name="chaos", single_transaction=PATH in ("single", "batch"),
             batch=Batch(max_size=64, max_wait_ms=5) if PATH == "batch" else None,
             staged=PATH == "staged", driver="asyncpg" if PATH == "staged" else "sqlalchemy")
async def handle(ctx: Context) -> None:
    message_id = ctx.delivery.id if TRANSPORT == "rabbitmq" else ctx.delivery.text()
    if PATH == "staged":
        ctx.stage("INSERT INTO chaos_effects (message_id) VALUES ($1)", message_id)
        return
    await ctx.db.execute(text("INSERT INTO chaos_effects (message_id) VALUES (:m)"), {"m": message_id})
    if PATH == "outbox":
        ctx.outbox.publish(f"{QUEUE}.out", (message_id or "").encode(), headers={"origin": "chaos"})
