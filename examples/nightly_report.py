"""A nightly report: at 02:00 Berlin time, total the previous day's sales into one report row.

Run it next to the app's other workers, as many replicas as you like (each night's report is made
once, whichever replica gets there first)::

    export DATABASE_URL=postgresql://app@db/app IDEMPOTENCY_HMAC_KEY=...
    consumer-kit db upgrade
    python -m examples.nightly_report init      # creates the example's own tables
    consumer-kit run examples.nightly_report:app --port 8000   # and /healthz, /readyz, /metrics

or from an external scheduler (a Kubernetes CronJob at ``0 2 * * *`` with ``timeZone: Europe/Berlin``,
a systemd timer)::

    consumer-kit schedule run examples.nightly_report:app nightly-report
    consumer-kit schedule list examples.nightly_report:app

The report is for the day before the tick's *intended* time (``scheduled_for``), never the day the
job happens to run: a run caught up at 09:00, or retried after midnight, still reports the right day.
A day whose report was already made is not made again (the tick's key is its instant), and a night
the clocks change still has exactly one report.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo

from sqlalchemy import Column, Date, DateTime, Integer, MetaData, String, Table, func, select

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.schedules import Schedule, ScheduleDelivery
from examples import create_tables

BERLIN = ZoneInfo("Europe/Berlin")

metadata = MetaData()
sales = Table(
    "example_sales",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("sold_at", DateTime(timezone=True), nullable=False),
    Column("amount_cents", Integer, nullable=False),
)
reports = Table(
    "example_nightly_reports",
    metadata,
    Column("day", Date, primary_key=True),
    Column("sales", Integer, nullable=False),
    Column("total_cents", Integer, nullable=False),
    Column("scheduled_for", String(20), nullable=False),
    Column("late_by_seconds", Integer, nullable=False),
)

settings = Settings()
app = ConsumerApp(settings)
nightly = Schedule("nightly-report", cron="0 2 * * *", timezone="Europe/Berlin",
                   catch_up="latest", misfire_grace_seconds=6 * 3600, overlap="forbid")


def report_day(tick: ScheduleDelivery) -> date:
    """The day a tick reports on: the Berlin day before its intended fire time."""
    return (tick.scheduled_for.astimezone(BERLIN) - timedelta(days=1)).date()


@app.handler(nightly, name="nightly-report")
async def nightly_report(ctx: Context) -> None:
    """Total the day's sales; the report row commits with the inbox record or not at all."""
    tick = ctx.delivery
    assert isinstance(tick, ScheduleDelivery)
    day = report_day(tick)
    start = datetime(day.year, day.month, day.day, tzinfo=BERLIN)
    end = start + timedelta(days=1)  # a Berlin day, 23 or 25 hours long on the nights the clocks change
    query = select(func.count(), func.coalesce(func.sum(sales.c.amount_cents), 0)).where(
        sales.c.sold_at >= start, sales.c.sold_at < end)
    count, total = (await ctx.db.execute(query)).one()
    await ctx.db.execute(reports.insert().values(
        day=day, sales=int(count), total_cents=int(total), scheduled_for=str(tick.id),
        late_by_seconds=int(tick.late_by.total_seconds())))


async def init() -> None:
    """Create the example's tables (the framework's own come from ``consumer-kit db upgrade``)."""
    await create_tables(settings, metadata)


if __name__ == "__main__":
    if sys.argv[1:] != ["init"]:
        raise SystemExit("usage: python -m examples.nightly_report init")
    asyncio.run(init())
