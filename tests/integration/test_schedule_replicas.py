"""Several replicas of one schedule on PostgreSQL: every replica dispatches what it sees due, the inbox
admits one run of each tick, and due-ness is the database's clock, not the replicas' own."""

from __future__ import annotations

import asyncio
import contextlib
import random
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import func, select, text

from consumer_kit import ConsumerApp
from consumer_kit.sources.schedules import ManualClock, Schedule, ScheduleDelivery
from consumer_kit.store import utcnow
from tests.conftest import make_settings
from tests.integration.schedules import (
    START,
    caught_up,
    effect_counts,
    effects,
    replica,
    reset_effects,
    wait_until,
)

pytestmark = pytest.mark.postgres


def contended(source: str) -> float:
    """Deliveries of ``source`` that found their tick done or held by another replica."""
    return sum(REGISTRY.get_sample_value("consumer_kit_deliveries_total", {"source": source, "outcome": outcome})
               or 0.0 for outcome in ("duplicate", "in_progress"))


async def test_three_replicas_over_200_ticks_run_each_tick_once(pg_database: str) -> None:
    clock = ManualClock(START)
    rng = random.Random(13)

    async def busy(delivery: ScheduleDelivery) -> None:
        await asyncio.sleep(rng.uniform(0.0, 0.02))  # long enough for the others to find it held

    schedules = [Schedule("fleet", every=timedelta(minutes=1), catch_up="all", clock=clock) for _ in range(3)]
    apps = [replica(make_settings(pg_database, db_pool_size=2, schedule_poll_seconds=0.5), schedule, f"r{i}", busy)
            for i, schedule in enumerate(schedules)]
    before = contended("fleet")
    async with contextlib.AsyncExitStack() as stack:
        for app in apps:
            await stack.enter_async_context(app.running())
        await reset_effects(apps[0])
        await wait_until(lambda: caught_up(schedules[0], clock))
        ticks = 0
        while ticks < 200:
            step = 3 if rng.random() < 0.1 and ticks <= 197 else 1  # now and then a short backlog
            clock.advance(timedelta(minutes=step))
            ticks += step

            async def done(expected: int = ticks) -> bool:
                return sum((await effect_counts(apps[0])).values()) >= expected \
                    and all([await caught_up(s, clock) for s in schedules])

            await wait_until(done, what=f"tick {ticks}")
        counts = await effect_counts(apps[0])
    assert len(counts) == 200 and set(counts.values()) == {1}  # each tick's effect exactly once
    expected = {(START.replace(second=0) + timedelta(minutes=m)).strftime("%Y-%m-%dT%H:%M:%SZ")
                for m in range(1, 201)}
    assert set(counts) == expected
    assert contended("fleet") > before  # the replicas did dispatch the same ticks


async def test_replicas_with_skewed_clocks_fire_what_the_databases_clock_made_due(pg_database: str) -> None:
    skews = [timedelta(seconds=-90), timedelta(seconds=90)]
    schedules = [Schedule("skewed", every=timedelta(seconds=1), catch_up="all") for _ in skews]
    apps = []
    for index, (schedule, skew) in enumerate(zip(schedules, skews, strict=True)):
        # The app's clock (leases, retention) is skewed; the schedule reads the database's. Leases are
        # long enough that the skew cannot make one replica take over another's running tick.
        settings = make_settings(pg_database, db_pool_size=2, inbox_lease_seconds=600)
        apps.append(replica(settings, schedule, f"r{index}"))
        apps[-1].clock = lambda skew=skew: utcnow() + skew  # type: ignore[misc]
    observer = ConsumerApp(make_settings(pg_database, db_pool_size=1))
    async with observer.running():
        await reset_effects(observer)

        async def database_now() -> datetime:
            async with observer.engine.connect() as conn:
                value: datetime = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
            return value.astimezone(UTC)

        started = await database_now()
        async with contextlib.AsyncExitStack() as stack:
            for app in apps:
                await stack.enter_async_context(app.running())

            async def some() -> bool:
                return sum((await effect_counts(observer)).values()) >= 3

            await wait_until(some, what="three ticks")
        ended = await database_now()
        counts = await effect_counts(observer)
        async with observer.engine.connect() as conn:
            total = (await conn.execute(select(func.count()).select_from(effects))).scalar_one()
    ticks = sorted(datetime.fromisoformat(tick.replace("Z", "+00:00")) for tick in counts)
    assert total == len(ticks) and set(counts.values()) == {1}
    assert started - timedelta(seconds=1) <= ticks[0] and ticks[-1] <= ended  # none early, no backfill
    assert all(b - a == timedelta(seconds=1) for a, b in pairwise(ticks))  # none missed
