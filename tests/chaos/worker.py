"""The worker the chaos suite runs as a user would (``consumer-kit run tests.chaos.worker:app``).

``CHAOS_PATH`` picks the handler: ``default`` (two transactions, an effect row through ``ctx.db``),
``single`` (``single_transaction=True``, the same row), ``batch`` (the same, 64 deliveries a
transaction) or ``outbox`` (two transactions, the row and an outbox message to ``CHAOS_QUEUE.out``,
published by the relay running in the same process).
"""

from __future__ import annotations

import os

from sqlalchemy import text

from consumer_kit import Batch, ConsumerApp, Context, Settings
from consumer_kit.sources.rabbitmq import AmqpPublisher, RabbitMQSource

PATH = os.environ.get("CHAOS_PATH", "default")
QUEUE = os.environ.get("CHAOS_QUEUE", "ck-chaos")

settings = Settings()
app = ConsumerApp(settings)
source = RabbitMQSource(queue=QUEUE, namespace="chaos", version=1, name=f"{QUEUE}-worker",
                        prefetch=128 if PATH == "batch" else 32,
                        retry_delays=(0.5, 1.0, 2.0))
if PATH == "outbox":
    app.relay_outbox(AmqpPublisher(connection_name=f"{QUEUE}-relay"))


@app.handler(source, name="chaos", single_transaction=PATH in ("single", "batch"),
             batch=Batch(max_size=64, max_wait_ms=5) if PATH == "batch" else None)
async def handle(ctx: Context) -> None:
    message_id = ctx.delivery.id
    await ctx.db.execute(text("INSERT INTO chaos_effects (message_id) VALUES (:m)"), {"m": message_id})
    if PATH == "outbox":
        ctx.outbox.publish(f"{QUEUE}.out", (message_id or "").encode(), headers={"origin": "chaos"})
