"""The app of the parked-delivery tests, as a user's module: ``consumer-kit parked replay
tests.acceptance.parked_app:app`` loads it.

Its table (``parked_test_effects``) comes from its own migrations (``APP_MIGRATIONS``, in
``parked_migrations/``). A delivery whose body asks to be parked (``{"park": true}``) is parked
``not_ready`` until the file ``PARKED_TEST_FIXED_FILE`` exists (the "fix" an operator deploys before
replaying); everything else is recorded, once per run of the handler. With ``PARKED_TEST_QUEUE`` set
the deliveries come from that RabbitMQ queue, else from in-memory sources.
"""

from __future__ import annotations

import os

from sqlalchemy import Column, Integer, MetaData, String, Table, Text

from consumer_kit import ConsumerApp, Context, Settings, TerminalError
from consumer_kit.delivery import Source
from consumer_kit.testing import InMemorySource

metadata = MetaData()
effects = Table(
    "parked_test_effects", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("consumer", String(100), nullable=False),
    Column("body", Text, nullable=False),
)

app = ConsumerApp(Settings())
queue = os.environ.get("PARKED_TEST_QUEUE")
source: Source
if queue:
    from consumer_kit.sources.rabbitmq import RabbitMQSource

    source = RabbitMQSource(queue=queue, namespace="parked-test", version=1, retry_delays=(0.2,))
else:
    source = InMemorySource(namespace="parked-test", version=1)
other = InMemorySource(namespace="parked-other", version=1)


def _fixed() -> bool:
    return os.path.exists(os.environ.get("PARKED_TEST_FIXED_FILE", "/nonexistent"))


async def _record(ctx: Context, consumer: str) -> None:
    body = ctx.delivery.json()
    if body.get("park") and not _fixed():
        raise TerminalError("the app is not ready for it yet", reason="not_ready")
    await ctx.db.execute(effects.insert().values(consumer=consumer, body=ctx.delivery.text()))


@app.handler(source, name="parked_main")
async def record(ctx: Context) -> None:
    """Record the delivery (or park it, while the app is not fixed)."""
    await _record(ctx, "parked_main")


@app.handler(other, name="parked_other")
async def record_other(ctx: Context) -> None:
    """The same for the second source."""
    await _record(ctx, "parked_other")
