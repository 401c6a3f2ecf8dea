"""Shared pieces of the schedule tests: an effect table, an app per replica, and waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from prometheus_client import REGISTRY
from sqlalchemy import Column, Float, Integer, MetaData, String, Table, func, select

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.schedules import ManualClock, Schedule, ScheduleDelivery, timing

metadata = MetaData()
effects = Table(
    "test_schedule_effects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("schedule", String(100), nullable=False),
    Column("tick", String(40), nullable=False),
    Column("late_by", Float, nullable=False),
    Column("replica", String(20), nullable=False),
)

START = datetime(2026, 3, 2, 12, 0, 30, tzinfo=UTC)


def replica(settings: Settings, schedule: Schedule, name: str = "r1",
            before: Callable[[ScheduleDelivery], Awaitable[None]] | None = None) -> ConsumerApp:
    """An app running ``schedule`` whose handler records one effect row per run, in its transaction."""
    app = ConsumerApp(settings)

    @app.handler(schedule, name="scheduled-job")
    async def job(ctx: Context) -> None:
        delivery = ctx.delivery
        assert isinstance(delivery, ScheduleDelivery)
        if before is not None:
            await before(delivery)
        await ctx.db.execute(effects.insert().values(
            schedule=schedule.name, tick=delivery.id, late_by=delivery.late_by.total_seconds(), replica=name))

    return app


async def reset_effects(app: ConsumerApp) -> None:
    async with app.engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.execute(effects.delete())


async def effect_ticks(app: ConsumerApp) -> list[str]:
    """The ticks of the effects, in the order they committed."""
    async with app.engine.connect() as conn:
        return [row[0] for row in await conn.execute(select(effects.c.tick).order_by(effects.c.id))]


async def effect_counts(app: ConsumerApp) -> dict[str, int]:
    async with app.engine.connect() as conn:
        rows = await conn.execute(select(effects.c.tick, func.count()).group_by(effects.c.tick))
        return {tick: int(count) for tick, count in rows}


async def wait_until(check: Callable[[], Awaitable[bool]], seconds: float = 20, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.01)


async def caught_up(schedule: Schedule, clock: ManualClock) -> bool:
    """Whether every tick due by the clock's now has been decided, and none is still pending."""
    status = await schedule.status()
    if status.decided_until is None or status.pending:
        return False
    return not timing.between(schedule.timing, status.decided_until, clock.time, limit=1)


def skipped_metric(schedule: str, reason: str) -> float:
    return REGISTRY.get_sample_value("consumer_kit_schedule_skipped_ticks_total",
                                     {"schedule": schedule, "reason": reason}) or 0.0
