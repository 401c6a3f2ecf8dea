"""Schedules on one replica, on SQLite and on PostgreSQL (asyncpg and psycopg), with a manual clock:
keys by intended instant, no backfill, catch-up after downtime, misfires, overlap, retries and
parking, DST through the whole app."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from consumer_kit import ConfigurationError, Outcome, Settings
from consumer_kit.sources.schedules import ManualClock, Schedule, ScheduleDelivery, ScheduleStatus
from tests.conftest import make_settings, truncate_all
from tests.integration.schedules import (
    START,
    caught_up,
    effect_counts,
    effect_ticks,
    replica,
    reset_effects,
    skipped_metric,
    wait_until,
)

MINUTE = timedelta(minutes=1)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    """SQLite, and PostgreSQL on asyncpg (the schedule store's statements are the same on psycopg,
    which runs them as SQLite does, through SQLAlchemy; the database clock is tested on all three)."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path}/schedules.db"
    else:
        url = request.getfixturevalue("pg_url")
        await truncate_all(url)
    return make_settings(url, retry_attempts=1, retry_later_seconds=1, max_deliveries=3, schedule_poll_seconds=0.2)


async def run_for(settings: Settings, make: Callable[[], Schedule], clock: ManualClock,
                  steps: list[timedelta], *, fresh: bool = False) -> tuple[list[str], Schedule]:
    """Start an app with the schedule ``make()`` gives, move the clock by each step (waiting after each
    for the schedule to catch up), stop; the ticks of all effects so far."""
    schedule = make()
    app = replica(settings, schedule)
    async with app.running():
        if fresh:
            await reset_effects(app)
        await wait_until(lambda: caught_up(schedule, clock), what="the first look")
        for step in steps:
            clock.advance(step)
            await wait_until(lambda: caught_up(schedule, clock), what=f"catching up at {clock.time}")
        ticks = await effect_ticks(app)
    return ticks, schedule


async def test_each_tick_runs_once_keyed_by_its_intended_instant(settings: Settings) -> None:
    clock = ManualClock(START)
    seen: list[ScheduleDelivery] = []

    async def remember(delivery: ScheduleDelivery) -> None:
        seen.append(delivery)

    schedule = Schedule("billing", every=MINUTE, clock=clock)
    app = replica(settings, schedule, before=remember)
    async with app.running():
        await reset_effects(app)
        await wait_until(lambda: caught_up(schedule, clock))
        assert await effect_ticks(app) == []  # seen for the first time at 12:00:30: nothing to backfill
        clock.set(datetime(2026, 3, 2, 12, 1, 7, tzinfo=UTC))  # 7 s after the 12:01 tick
        await wait_until(lambda: caught_up(schedule, clock))
        clock.set(datetime(2026, 3, 2, 12, 2, 0, tzinfo=UTC))
        await wait_until(lambda: caught_up(schedule, clock))
        assert await effect_ticks(app) == ["2026-03-02T12:01:00Z", "2026-03-02T12:02:00Z"]
        first = seen[0]
        assert first.scheduled_for == datetime(2026, 3, 2, 12, 1, tzinfo=UTC)
        assert first.late_by == timedelta(seconds=7)
        assert str(schedule.key(first)) == "billing:v1:2026-03-02T12:01:00Z"

        # The same tick fired again (by hand, by another replica, by a CronJob) is a duplicate.
        again = await schedule.fire(datetime(2026, 3, 2, 12, 1, tzinfo=UTC))
        assert again.result.outcome is Outcome.DUPLICATE
        with pytest.raises(ConfigurationError, match="not due yet"):
            await schedule.fire(datetime(2026, 3, 2, 12, 3, tzinfo=UTC))
        with pytest.raises(ConfigurationError, match="is not a tick"):
            await schedule.fire(datetime(2026, 3, 2, 12, 1, 30, tzinfo=UTC))
        status = await schedule.status()
        assert status.last_fired is not None and status.last_fired.state == "done"
        assert status.last_fired.tick == datetime(2026, 3, 2, 12, 2, tzinfo=UTC)
        assert status.next_fire == datetime(2026, 3, 2, 12, 3, tzinfo=UTC)
        assert set((await effect_counts(app)).values()) == {1}


async def status_of(settings: Settings, schedule: Schedule) -> ScheduleStatus:
    """The schedule's state, read through an app that starts no source (as `schedule list` does)."""
    app = replica(settings, schedule)
    async with app.running(sources=()):
        return await schedule.status()


async def failed_and_deferred(schedule: Schedule, clock: ManualClock, attempts: list[str], count: int) -> None:
    """Wait for attempt ``count`` to have failed and its retry to be put off (past the clock's now)."""

    async def deferred() -> bool:
        status = await schedule.status()
        return len(attempts) >= count and bool(status.pending) and status.pending[0].not_before is not None \
            and status.pending[0].not_before > clock.time

    await wait_until(deferred, what=f"attempt {count} to fail and be deferred")


async def test_a_schedule_seen_for_the_first_time_does_not_backfill(settings: Settings) -> None:
    clock = ManualClock(datetime(2026, 3, 2, 12, 3, 10, tzinfo=UTC))
    ticks, schedule = await run_for(
        settings, lambda: Schedule("digest", cron="*/5 * * * *", clock=clock), clock,
        [timedelta(minutes=1), timedelta(minutes=1, seconds=50)], fresh=True)
    assert ticks == ["2026-03-02T12:05:00Z"]  # not 12:00, which was before the schedule was first seen
    assert (await status_of(settings, schedule)).skipped == {}


@pytest.mark.parametrize(("catch_up", "runs", "skipped"), [
    ("latest", ["12:11"], {"coalesced": 9}),
    ("all", [f"12:{m:02d}" for m in range(2, 12)], {}),
    ("none", [], {"misfire": 10}),
])
async def test_downtime_of_ten_intervals(settings: Settings, catch_up: Any, runs: list[str],
                                         skipped: dict[str, int]) -> None:
    name = f"export-{catch_up}"
    clock = ManualClock(START)

    def make() -> Schedule:
        return Schedule(name, every=MINUTE, catch_up=catch_up, clock=clock)

    before = {reason: skipped_metric(name, reason) for reason in ("coalesced", "misfire", "too_many")}
    ticks, _ = await run_for(settings, make, clock, [timedelta(seconds=35)], fresh=True)
    assert ticks == ["2026-03-02T12:01:00Z"]
    clock.advance(timedelta(minutes=10))  # down from 12:01:05 to 12:11:05: ticks 12:02 to 12:11 missed
    ticks, schedule = await run_for(settings, make, clock, [])
    assert ticks == ["2026-03-02T12:01:00Z"] + [f"2026-03-02T{hm}:00Z" for hm in runs]  # in order
    assert (await status_of(settings, schedule)).skipped == skipped
    for reason in ("coalesced", "misfire", "too_many"):
        assert skipped_metric(name, reason) - before[reason] == skipped.get(reason, 0)


async def test_all_runs_at_most_max_catch_up_the_newest_ones(settings: Settings) -> None:
    clock = ManualClock(START)

    def make() -> Schedule:
        return Schedule("rollup", every=MINUTE, catch_up="all", max_catch_up=3, clock=clock)

    await run_for(settings, make, clock, [], fresh=True)
    clock.advance(timedelta(minutes=10))  # 12:01 to 12:10 missed
    ticks, schedule = await run_for(settings, make, clock, [])
    assert ticks == ["2026-03-02T12:08:00Z", "2026-03-02T12:09:00Z", "2026-03-02T12:10:00Z"]
    status = await status_of(settings, schedule)
    assert status.skipped == {"too_many": 7}
    assert [(t.tick.minute, t.reason) for t in status.recent_skips] == [(m, "too_many") for m in range(7, 0, -1)]


async def test_ticks_later_than_the_misfire_grace_are_skipped(settings: Settings) -> None:
    clock = ManualClock(START)

    def make() -> Schedule:
        return Schedule("sync", every=MINUTE, misfire_grace_seconds=30, clock=clock)

    await run_for(settings, make, clock, [], fresh=True)
    clock.set(datetime(2026, 3, 2, 12, 1, 45, tzinfo=UTC))  # one tick, 45 s late: a misfire
    ticks, _ = await run_for(settings, make, clock, [])
    assert ticks == []
    clock.set(datetime(2026, 3, 2, 12, 4, 20, tzinfo=UTC))  # three ticks, the newest 20 s late: it runs
    ticks, schedule = await run_for(settings, make, clock, [])
    assert ticks == ["2026-03-02T12:04:00Z"]
    assert (await status_of(settings, schedule)).skipped == {"misfire": 1, "coalesced": 2}


class SlowFirst:
    """A ``before`` hook that remembers each tick started, and holds the first until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[str] = []

    async def __call__(self, delivery: ScheduleDelivery) -> None:
        self.started.append(str(delivery.id))
        if len(self.started) == 1:
            await self.release.wait()

    async def running(self, count: int) -> bool:
        return len(self.started) == count


async def test_overlap_forbid_skips_a_tick_while_the_previous_one_runs(settings: Settings) -> None:
    clock = ManualClock(START)
    slow_first = SlowFirst()
    schedule = Schedule("reindex", every=MINUTE, overlap="forbid", clock=clock)
    app = replica(settings, schedule, before=slow_first)
    async with app.running():
        await reset_effects(app)
        await wait_until(lambda: caught_up(schedule, clock))
        clock.advance(MINUTE)  # 12:01:30: the 12:01 tick starts and hangs
        await wait_until(lambda: slow_first.running(1))
        clock.advance(MINUTE)  # 12:02 comes due while 12:01 runs: skipped

        async def overlap_recorded() -> bool:
            return (await schedule.status()).skipped == {"overlap": 1}

        await wait_until(overlap_recorded)
        slow_first.release.set()
        await wait_until(lambda: caught_up(schedule, clock))
        clock.advance(MINUTE)  # 12:03 runs: nothing else is running
        await wait_until(lambda: caught_up(schedule, clock))
        assert await effect_ticks(app) == ["2026-03-02T12:01:00Z", "2026-03-02T12:03:00Z"]
        assert slow_first.started == ["2026-03-02T12:01:00Z", "2026-03-02T12:03:00Z"]


async def test_overlap_allow_starts_a_tick_on_time_while_the_previous_one_runs(settings: Settings) -> None:
    clock = ManualClock(START)
    slow_first = SlowFirst()
    schedule = Schedule("refresh", every=MINUTE, clock=clock)
    app = replica(settings, schedule, before=slow_first)
    async with app.running():
        await reset_effects(app)
        await wait_until(lambda: caught_up(schedule, clock))
        clock.advance(MINUTE)
        await wait_until(lambda: slow_first.running(1))
        clock.advance(MINUTE)
        await wait_until(lambda: slow_first.running(2))  # 12:02 starts although 12:01 has not finished

        async def second_done() -> bool:
            return await effect_ticks(app) == ["2026-03-02T12:02:00Z"]

        await wait_until(second_done)  # ... and commits first
        slow_first.release.set()
        await wait_until(lambda: caught_up(schedule, clock))
        assert sorted(await effect_ticks(app)) == ["2026-03-02T12:01:00Z", "2026-03-02T12:02:00Z"]


@pytest.mark.parametrize("failures", [2, 3])
async def test_a_failing_tick_is_retried_with_the_same_key_then_parked(settings: Settings, failures: int) -> None:
    """MAX_DELIVERIES=3, one attempt each: two failures then a success commit once; three park the tick."""
    clock = ManualClock(START)
    attempts: list[str] = []

    async def fail(delivery: ScheduleDelivery) -> None:
        attempts.append(str(delivery.id))
        if len(attempts) <= failures:
            raise RuntimeError("the report service is down")

    schedule = Schedule(f"ledger-{failures}", every=timedelta(hours=1), clock=clock)
    app = replica(settings, schedule, before=fail)
    async with app.running():
        await reset_effects(app)
        await wait_until(lambda: caught_up(schedule, clock))
        clock.set(datetime(2026, 3, 2, 13, 0, 1, tzinfo=UTC))
        for count in (1, 2):  # RETRY_LATER after each failure: the tick waits retry_later_seconds
            await failed_and_deferred(schedule, clock, attempts, count)
            clock.advance(timedelta(seconds=2))
        await wait_until(lambda: caught_up(schedule, clock))
        assert attempts == ["2026-03-02T13:00:00Z"] * 3
        last = (await schedule.status()).last_fired
        letters = await app.dead_letters.list(consumer="scheduled-job")
        if failures == 2:
            assert await effect_ticks(app) == ["2026-03-02T13:00:00Z"]
            assert last is not None and last.state == "done" and not letters
            return
        assert await effect_ticks(app) == []
        assert last is not None and (last.state, last.reason) == ("parked", "retries_exhausted")
        assert [letter.reason for letter in letters] == ["retries_exhausted"]
        assert letters[0].body == b'{"schedule":"ledger-3","version":1,"scheduled_for":"2026-03-02T13:00:00Z"}'
        clock.advance(timedelta(hours=1))  # the next tick is a new key: tried afresh, and it passes
        await wait_until(lambda: caught_up(schedule, clock))
        assert await effect_ticks(app) == ["2026-03-02T14:00:00Z"]


async def test_fixed_time_job_across_both_berlin_transitions_through_the_app(settings: Settings) -> None:
    clock = ManualClock(datetime(2026, 3, 27, 0, 0, tzinfo=UTC))

    def make(name: str = "nightly-spring") -> Schedule:
        return Schedule(name, cron="30 2 * * *", timezone="Europe/Berlin", clock=clock)

    ticks, _ = await run_for(settings, make, clock, [timedelta(hours=6)] * 4 * 4, fresh=True)
    assert ticks == ["2026-03-27T01:30:00Z", "2026-03-28T01:30:00Z",
                     "2026-03-29T01:00:00Z",  # 02:30 does not exist: the first instant after the gap
                     "2026-03-30T00:30:00Z"]
    clock.set(datetime(2026, 10, 24, 0, 0, tzinfo=UTC))
    ticks, _ = await run_for(settings, lambda: make("nightly-autumn"), clock, [timedelta(hours=6)] * 3 * 4)
    assert ticks[4:] == ["2026-10-24T00:30:00Z",
                         "2026-10-25T00:30:00Z",  # 02:30 happens twice: once, at the first
                         "2026-10-26T01:30:00Z"]


async def test_a_new_version_is_a_new_schedule(settings: Settings) -> None:
    clock = ManualClock(START)
    await run_for(settings, lambda: Schedule("audit", every=MINUTE, clock=clock), clock, [MINUTE], fresh=True)
    clock.advance(timedelta(minutes=5))
    _, schedule = await run_for(settings, lambda: Schedule("audit", every=MINUTE, version=2, clock=clock),
                                clock, [MINUTE])
    app = replica(settings, schedule)
    async with app.running(sources=()):
        assert await effect_ticks(app) == ["2026-03-02T12:01:00Z", "2026-03-02T12:07:00Z"]  # no v2 backfill
        assert (await schedule.status()).skipped == {}


async def test_a_tick_recorded_but_never_dispatched_runs_when_a_replica_next_looks(settings: Settings) -> None:
    clock = ManualClock(START)
    schedule = Schedule("orphan", every=MINUTE, clock=clock)
    app = replica(settings, schedule)
    async with app.running(sources=()):  # a replica that recorded a tick to run, then died
        await reset_effects(app)
        async with app.database.connect() as ex:
            now = START + timedelta(minutes=5)
            await schedule.store.create(ex, schedule.sid, decided_until=now, now=now)
            assert await schedule.store.record(ex, schedule.sid, START + timedelta(minutes=4, seconds=30),
                                               state="pending", reason=None, now=now)
    clock.set(START + timedelta(minutes=5))
    app = replica(settings, schedule)
    async with app.running():
        await wait_until(lambda: caught_up(schedule, clock))
        assert await effect_ticks(app) == ["2026-03-02T12:05:00Z"]


async def test_forbid_does_not_count_a_tick_whose_settlement_was_lost(settings: Settings) -> None:
    clock = ManualClock(START)
    schedule = Schedule("exclusive", every=MINUTE, overlap="forbid", clock=clock)
    app = replica(settings, schedule)
    async with app.running(sources=()):
        await reset_effects(app)
        # 12:01 was recorded and run through the inbox, and its process died before recording that.
        tick = START + timedelta(seconds=30)
        async with app.database.connect() as ex:
            await schedule.store.create(ex, schedule.sid, decided_until=tick, now=tick)
            await schedule.store.record(ex, schedule.sid, tick, state="pending", reason=None, now=tick)
        result = await app.pipeline.process(app.specs[0], schedule.delivery(tick, tick))
        assert result.outcome is Outcome.PROCESSED
    clock.set(START + timedelta(seconds=30) + MINUTE)
    app = replica(settings, schedule)
    async with app.running():
        await wait_until(lambda: caught_up(schedule, clock))
        assert await effect_ticks(app) == ["2026-03-02T12:01:00Z", "2026-03-02T12:02:00Z"]  # 12:02 not skipped
        status = await schedule.status()
        assert status.skipped == {} and status.last_fired is not None and status.last_fired.state == "done"


async def test_decided_ticks_are_swept_after_the_retention_pending_ones_never(settings: Settings) -> None:
    schedule = Schedule("swept", every=MINUTE, clock=ManualClock(START))
    app = replica(settings, schedule)
    async with app.running(sources=()):
        store, sid = schedule.store, schedule.sid
        async with app.database.connect() as ex:
            for minute, state in enumerate(["done", "skipped", "parked", "pending", "done"]):
                await store.record(ex, sid, START + timedelta(minutes=minute), state=state,
                                   reason="coalesced" if state == "skipped" else None, now=START)
        assert await store.sweep(sid, before=START + timedelta(minutes=4), batch_size=2) == 3
        async with app.database.connect() as ex:
            left = [await store.get(ex, sid, START + timedelta(minutes=m)) for m in range(5)]
        assert [record.state if record else None for record in left] == [None, None, None, "pending", "done"]


async def test_the_database_clock_end_to_end(database_url: str) -> None:
    """The default clock, the database's, on each driver: ticks every second, each once, none skipped."""
    schedule = Schedule("realtime", every=timedelta(seconds=1), catch_up="all")
    app = replica(make_settings(database_url), schedule)
    async with app.running():
        await reset_effects(app)

        async def two() -> bool:
            return len(await effect_ticks(app)) >= 2

        await wait_until(two, what="two ticks on the database's clock")
        before = await schedule.clock.now()
        assert before.tzinfo is not None and before.utcoffset() == timedelta(0)
        waited = asyncio.get_running_loop().time()
        await schedule.clock.sleep_until(before + timedelta(seconds=0.3))
        assert asyncio.get_running_loop().time() - waited >= 0.25  # never wakes (much) before the instant
        assert await schedule.clock.now() >= before + timedelta(seconds=0.3)
        ticks = sorted(datetime.fromisoformat(tick.replace("Z", "+00:00")) for tick in await effect_ticks(app))
    assert all(b - a == timedelta(seconds=1) for a, b in pairwise(ticks))
    with pytest.raises(ValueError, match="aware"):
        ManualClock(datetime(2026, 1, 1))
