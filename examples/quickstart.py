"""The smallest useful consumer: a handler whose database write commits with the inbox record.

Run it as a worker with ``consumer-kit run examples.quickstart:app`` (it idles until SIGTERM, since
an in-memory source has no broker), or ``python -m examples.quickstart`` to push a few deliveries
through it, redeliveries included.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import Column, Integer, MetaData, String, Table

from consumer_kit import ConsumerApp, Context, Settings, TerminalError
from consumer_kit.testing import InMemorySource

metadata = MetaData()
tickets = Table(
    "quickstart_tickets", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", String(50), nullable=False),
)

app = ConsumerApp(Settings())
source = InMemorySource(namespace="ticket-queue", version=1)


@app.handler(source, name="quickstart")
async def prepare(ctx: Context) -> None:
    """Record the ticket; a ticket without a key can never succeed, so it is parked."""
    ticket = ctx.delivery.json()
    if "key" not in ticket:
        raise TerminalError("ticket has no key", reason="malformed_ticket")
    await ctx.db.execute(tickets.insert().values(key=ticket["key"]))


async def main() -> list[str]:
    """Deliver three messages, one of them twice; return the outcomes."""
    async with app.running():
        async with app.engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        outcomes = []
        for message_id, body in [("m-1", b'{"key": "T-1"}'), ("m-1", b'{"key": "T-1"}'),
                                 ("m-2", b'{"key": "T-2"}'), ("m-3", b"{}")]:
            result = await source.deliver(id=message_id, body=body)
            outcomes.append(result.outcome.value)
        return outcomes


if __name__ == "__main__":
    print(asyncio.run(main()))
