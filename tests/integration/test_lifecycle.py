"""Graceful shutdown and observability, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

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
