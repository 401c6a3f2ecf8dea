"""The worker of ``python -m bench scaleout``, run as a user runs one: ``consumer-kit run bench.scaleout_app:app``.

Configured by the environment as a user's app is (``DATABASE_URL``, ``IDEMPOTENCY_HMAC_KEY``,
``RABBITMQ_URL``, ``DB_POOL_SIZE``, ...). It consumes ``SCALEOUT_QUEUE`` and writes one
``scaleout_effects`` row a message in the handler's transaction, through ``ctx.db`` (an SQLAlchemy
session), on the default two-transaction path or, with ``SCALEOUT_PATH=single``, with
``single_transaction=True``. The row carries the AMQP ``message_id``, so that an effect that happened
twice shows as two rows of one id (the table has no unique constraint that would hide it).
"""

from __future__ import annotations

import os

from sqlalchemy import text

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.rabbitmq import RabbitMQSource

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS scaleout_effects (message_id text NOT NULL,"
    " done_at timestamptz NOT NULL DEFAULT clock_timestamp())"
)
PATH = os.environ.get("SCALEOUT_PATH", "two")

settings = Settings()
app = ConsumerApp(settings)
source = RabbitMQSource(
    queue=os.environ.get("SCALEOUT_QUEUE", "ck-scaleout"),
    namespace="scaleout",
    version=1,
    prefetch=int(os.environ.get("SCALEOUT_PREFETCH", "32")),
)


@app.handler(source, name="scaleout", single_transaction=PATH == "single")
async def record(ctx: Context) -> None:
    """One effect row, committed with the delivery's completion."""
    await ctx.db.execute(text("INSERT INTO scaleout_effects (message_id) VALUES (:m)"), {"m": ctx.delivery.id})
