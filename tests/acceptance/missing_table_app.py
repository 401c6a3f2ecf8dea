"""An app deployed without its table: a schedule fires every second and its handler writes to
``ck_never_created``, which nothing made. ``consumer-kit run`` must stop with one line saying so."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import text

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.schedules import Schedule

app = ConsumerApp(Settings())
every_second = Schedule("table-probe", every=timedelta(seconds=1), catch_up="latest")


@app.handler(every_second, name="table-probe")
async def probe(ctx: Context) -> None:
    """Record the tick in a table that was never created."""
    await ctx.db.execute(text("INSERT INTO ck_never_created (tick) VALUES (:tick)"), {"tick": ctx.delivery.id})
