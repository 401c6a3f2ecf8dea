"""The app of the handler-failure tests, as a user's module: ``consumer-kit run
tests.acceptance.failing_app:app`` consumes the RabbitMQ queue ``FAILING_TEST_QUEUE``.

Its handler fails on every payment without an amount with ``KeyError``, the way a user's code often
does: the delivery's raw key is both in a local and in the exception's message.
"""

from __future__ import annotations

import os

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.rabbitmq import RabbitMQSource

app = ConsumerApp(Settings())
source = RabbitMQSource(queue=os.environ.get("FAILING_TEST_QUEUE", "failing-test"), namespace="payments", version=1,
                        retry_delays=(0.2,))


@app.handler(source, name="payments")
async def charge(ctx: Context) -> None:
    """Charge the payment's amount (there is none: it fails)."""
    order = str(ctx.key)
    payment = ctx.delivery.json()
    if "amount" not in payment:
        raise KeyError(f"amount (payment {order})")  # RAISED HERE
