"""Graceful shutdown and observability, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import text

from consumer_kit import ConsumerApp, Context, Outcome
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings


def sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_stop_drains_in_flight_work(database_url: str) -> None:
    app = ConsumerApp(make_settings(database_url, shutdown_grace_seconds=5))
    source = InMemorySource(namespace="drain", version=1)
    entered = asyncio.Event()

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        entered.set()
        await asyncio.sleep(0.3)

    await app.start()
    delivery = asyncio.create_task(source.deliver(id="drain-0001", body=b"x"))
    await asyncio.wait_for(entered.wait(), 10)
    await app.stop()
    assert (await delivery).outcome is Outcome.PROCESSED  # finished within the grace period
    try:
        await source.deliver(id="drain-0002", body=b"x")
    except RuntimeError as exc:  # intake stopped first
        assert "not running" in str(exc)
    else:
        raise AssertionError("a stopped source accepted a delivery")


async def test_stop_past_grace_releases_the_lease(database_url: str) -> None:
    settings = make_settings(database_url, shutdown_grace_seconds=0.2, inbox_lease_seconds=60)
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="grace", version=1)
    entered = asyncio.Event()

    @app.handler(source, name="grace")
    async def stuck(ctx: Context) -> None:
        entered.set()
        await asyncio.sleep(3600)

    await app.start()
    delivery = asyncio.create_task(source.deliver(id="grace-0001", body=b"x"))
    await asyncio.wait_for(entered.wait(), 10)
    await app.stop()
    assert delivery.cancelled() or isinstance(delivery.exception(), asyncio.CancelledError)

    # A new worker takes the delivery at once instead of waiting out the 60 s lease.
    app2 = ConsumerApp(settings)
    source2 = InMemorySource(namespace="grace", version=1)
    runs: list[int] = []

    @app2.handler(source2, name="grace")
    async def quick(ctx: Context) -> None:
        runs.append(ctx.attempt)

    async with app2.running():
        assert (await source2.deliver(id="grace-0001", body=b"x")).outcome is Outcome.PROCESSED
    assert runs == [2]


async def test_metrics_count_outcomes_by_source(database_url: str) -> None:
    app = ConsumerApp(make_settings(database_url))
    source = InMemorySource(namespace="metrics", version=1, name="memory:metrics-test")

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        pass

    before = {o: sample("consumer_kit_deliveries_total", source=source.name, outcome=o)
              for o in ("processed", "duplicate", "invalid")}
    async with app.running():
        await source.deliver(id="met-0001", body=b"x")
        await source.deliver(id="met-0001", body=b"x")
        await source.deliver(id=None, body=b"x")
    for outcome in ("processed", "duplicate", "invalid"):
        assert sample("consumer_kit_deliveries_total", source=source.name, outcome=outcome) == before[outcome] + 1
    assert sample("consumer_kit_handler_duration_seconds_count", source=source.name) >= 1
    assert sample("consumer_kit_dead_letters_total", source=source.name, reason="missing_stable_id") >= 1


async def test_the_worker_sweeps_expired_rows_by_itself_every_interval(database_url: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweeper a running app keeps: expired rows go without anyone asking, and sweeps start every
    SWEEP_INTERVAL_SECONDS from one's start to the next, so that a paced sweep (which takes a while)
    does not stretch the interval by its own length."""
    app = ConsumerApp(make_settings(database_url, sweep_interval_seconds=0.3, inbox_retention_seconds=1,
                                    inbox_tombstone_seconds=60))
    source = InMemorySource(namespace="swept", version=1)
    ran: list[str | None] = []

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        ran.append(ctx.delivery.id)

    swept, fifth = asyncio.Event(), asyncio.Event()
    starts: list[float] = []
    sweep = ConsumerApp.sweep

    async def timed_sweep(self: ConsumerApp) -> int:
        starts.append(asyncio.get_running_loop().time())
        if len(starts) == 5:
            fifth.set()
        count = await sweep(self)
        if count:
            swept.set()
        await asyncio.sleep(0.3)  # a sweep as long as the interval
        return count

    monkeypatch.setattr(ConsumerApp, "sweep", timed_sweep)
    async with app.running():
        for i in range(3):
            assert (await source.deliver(id=f"swept-{i}", body=b"x")).outcome is Outcome.PROCESSED
        await asyncio.wait_for(swept.wait(), 20)  # retention 1 s: the rows expire and the sweeper takes them
        async with app.engine.connect() as conn:
            left = (await conn.execute(text("SELECT count(*) FROM inbox WHERE consumer = 'handle'"))).scalar_one()
        assert left == 0
        late = await source.deliver(id="swept-0", body=b"x")
        assert late.outcome is Outcome.DEAD_LETTERED, late  # its tombstone: a late delivery, parked by default
        assert ran == ["swept-0", "swept-1", "swept-2"]  # the late repeat did not run again
        await asyncio.wait_for(fifth.wait(), 20)
    gaps = sorted(b - a for a, b in itertools.pairwise(starts))
    assert gaps[len(gaps) // 2] < 0.45, gaps  # about 0.3 s apart, not 0.3 s plus the sweep's own 0.3 s
