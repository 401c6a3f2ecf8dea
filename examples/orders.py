"""What the RabbitMQ, SQS, NATS and Redis example workers share: the table an order is recorded in, the
recording itself (inside the handler's transaction) and its announcement through the outbox, and the
``python -m examples.<worker> init`` command that creates the table. Each worker names its own table,
source, publisher and where its events go."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table

from consumer_kit import ConfigurationError, Context


def orders_table(name: str, metadata: MetaData) -> Table:
    """The table of recorded orders: one row an order, with the key digest it was recorded under."""
    return Table(
        name,
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("order_ref", String(100), nullable=False),
        Column("amount", Integer, nullable=False),
        Column("key_digest", String(16), nullable=False),
    )


async def record(ctx: Context, orders: Table) -> dict[str, Any]:
    """Insert the delivered order ``{"order": "...", "amount": 12}`` into ``orders`` in the handler's
    transaction; the ``order.recorded`` event to announce it with."""
    order = ctx.delivery.json()
    await ctx.db.execute(orders.insert().values(
        order_ref=order["order"], amount=int(order["amount"]), key_digest=ctx.key_digest))
    return {"type": "order.recorded", "order": order["order"], "amount": order["amount"]}


async def record_and_announce(ctx: Context, orders: Table, destination: str) -> None:
    """:func:`record` the order and stage its ``order.recorded`` event for ``destination`` (a queue,
    subject or stream) in the same transaction: both commit with the inbox row or not at all."""
    event = await record(ctx, orders)
    ctx.outbox.publish(destination, json.dumps(event).encode(), headers={"content-type": "application/json"})


def main(module: str, init: Callable[[], Awaitable[None]]) -> None:
    """``python -m <module> init``: run the example's ``init``; a configuration it cannot work with is
    one line on stderr and exit status 2, as the ``consumer-kit`` command answers it."""
    if sys.argv[1:] != ["init"]:
        raise SystemExit(f"usage: python -m {module} init")
    try:
        asyncio.run(init())
    except ConfigurationError as exc:
        print(f"python -m {module} init: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
