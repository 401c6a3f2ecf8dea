"""The worker of the console's browser tests, run as a user runs one: ``consumer-kit run
tests.browser.console_app:app --port N`` with ``CONSOLE_PATH`` set.

It consumes ``CONSOLE_TEST_QUEUE`` (RabbitMQ). An order whose body says ``"wait_for_fix": true`` is
parked ``not_ready`` until a file named after the order exists in ``CONSOLE_TEST_FIXED_DIR`` (the fix an
operator deploys before replaying); every run of the handler that gets through records the order in
``console_test_effects``, so a test counts how often the handler ran.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Column, Integer, MetaData, String, Table

from consumer_kit import ConsumerApp, Context, Settings, TerminalError
from consumer_kit.sources.rabbitmq import RabbitMQSource

metadata = MetaData()
effects = Table(
    "console_test_effects", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", String(100), nullable=False),
)

app = ConsumerApp(Settings())
orders = RabbitMQSource(queue=os.environ.get("CONSOLE_TEST_QUEUE", "console-test"), namespace="orders", version=1,
                        retry_delays=(0.2,))


def _fixed(order: str) -> bool:
    return Path(os.environ.get("CONSOLE_TEST_FIXED_DIR", "/nonexistent"), order).exists()


@app.handler(orders, name="orders")
async def take_order(ctx: Context) -> None:
    """Record the order, or park it while its fix is not there."""
    order = ctx.delivery.json()
    if order.get("wait_for_fix") and not _fixed(str(order["order"])):
        raise TerminalError("the pricing service does not know this order's currency yet", reason="not_ready")
    await ctx.db.execute(effects.insert().values(order_id=str(order["order"])))
