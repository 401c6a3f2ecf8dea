"""An app with schedules, run by the acceptance tests as a user would (``consumer-kit run`` and
``consumer-kit schedule run``); its behaviour is set by environment variables.

- ``ticker`` fires every second; with ``TICKER_BLOCK=1`` its handler records that it started (in a
  transaction of its own, so the test can see it) and then never finishes: a process to SIGKILL mid-tick.
- ``report`` fires hourly and is run by hand in the tests: its handler takes ``REPORT_SECONDS`` (or,
  with ``REPORT_UNTIL`` set to a path, waits until that file exists) and, with ``REPORT_FAIL=1``, fails.
"""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import timedelta

from sqlalchemy import Column, Integer, MetaData, String, Table
from sqlalchemy.ext.asyncio import AsyncEngine

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.schedules import Schedule
from consumer_kit.store import create_engine

metadata = MetaData()
effects = Table(
    "test_cli_schedule_effects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("schedule", String(50), nullable=False),
    Column("tick", String(40), nullable=False),
    Column("pid", Integer, nullable=False),
)
started = Table(
    "test_cli_schedule_started",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("tick", String(40), nullable=False),
    Column("pid", Integer, nullable=False),
)

settings = Settings()
app = ConsumerApp(settings)
ticker = Schedule("ticker", every=timedelta(seconds=1), catch_up="all")
report = Schedule("report", cron="0 * * * *")
_engine: AsyncEngine | None = None


@app.handler(ticker, name="ticker")
async def tick(ctx: Context) -> None:
    """Record the tick; or, in a process told to block, say so and hang."""
    global _engine
    if os.environ.get("TICKER_BLOCK") == "1":
        _engine = _engine or create_engine(settings.database_url, pool_size=2)
        async with _engine.begin() as conn:
            await conn.execute(started.insert().values(tick=str(ctx.delivery.id), pid=os.getpid()))
        await asyncio.Event().wait()
    await ctx.db.execute(effects.insert().values(schedule="ticker", tick=ctx.delivery.id, pid=os.getpid()))


@app.handler(report, name="report")
async def make_report(ctx: Context) -> None:
    """Take a while (``REPORT_SECONDS``, or until the file ``REPORT_UNTIL`` exists), then record the
    tick, or fail (``REPORT_FAIL=1``)."""
    await asyncio.sleep(float(os.environ.get("REPORT_SECONDS", "0")))
    until = os.environ.get("REPORT_UNTIL")
    # Polled: the test that creates the file is another process, which no asyncio.Event can reach.
    while until and not await asyncio.to_thread(os.path.exists, until):  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    if os.environ.get("REPORT_FAIL") == "1":
        raise RuntimeError("the report store is down")
    await ctx.db.execute(effects.insert().values(schedule="report", tick=ctx.delivery.id, pid=os.getpid()))


async def init() -> None:
    """Create (or empty) the tables above."""
    engine = create_engine(settings.database_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
            for table in (effects, started):
                await conn.execute(table.delete())
    finally:
        await engine.dispose()


if __name__ == "__main__":
    if sys.argv[1:] != ["init"]:
        raise SystemExit("usage: python -m tests.acceptance.schedule_app init")
    asyncio.run(init())
