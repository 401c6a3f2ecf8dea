"""The dedup window, at its edges: a key is recognised as a duplicate for at least
INBOX_RETENTION_SECONDS after its first claim (and after its completion, less one lease, when the
handler ran long), a sweep at any time inside that window leaves it alone; once swept, its tombstone
catches it as late for INBOX_TOMBSTONE_SECONDS after the sweep; after that the key is new again. On
both paths, on SQLite and PostgreSQL (asyncpg and psycopg)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from consumer_kit import ConsumerApp, Context, Outcome
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings

RETENTION, TOMBSTONE, LEASE = 3600, 7200, 30
SECOND = timedelta(seconds=1)


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


def build(url: str, clock: Clock, *, single: bool) -> tuple[ConsumerApp, InMemorySource, list[str]]:
    app = ConsumerApp(make_settings(url, inbox_retention_seconds=RETENTION, inbox_tombstone_seconds=TOMBSTONE,
                                    inbox_lease_seconds=LEASE), clock=clock)
    source = InMemorySource(namespace="window", version=1, name=f"window-{'single' if single else 'two'}")
    runs: list[str] = []

    @app.handler(source, name=source.name, single_transaction=single)
    async def handle(ctx: Context) -> None:
        runs.append(ctx.delivery.text())

    return app, source, runs


@pytest.mark.parametrize("single", [False, True], ids=["two-transactions", "one-transaction"])
async def test_the_window_from_the_first_claim_to_the_tombstones_end(database_url: str, single: bool) -> None:
    clock = Clock()
    first = clock.now
    app, source, runs = build(database_url, clock, single=single)
    async with app.running():
        assert (await source.deliver(id="w-1", body=b"once")).outcome is Outcome.PROCESSED

        clock.now = first + timedelta(seconds=RETENTION) - SECOND  # the window's last second
        assert await app.sweep() == 0
        assert (await source.deliver(id="w-1", body=b"once")).outcome is Outcome.DUPLICATE

        clock.now = first + timedelta(seconds=RETENTION) + SECOND  # past it, but not yet swept: still known
        assert (await source.deliver(id="w-1", body=b"once")).outcome is Outcome.DUPLICATE
        assert await app.sweep() == 1
        swept_at = clock.now
        late = await source.deliver(id="w-1", body=b"once")
        assert (late.outcome, late.reason) == (Outcome.DEAD_LETTERED, "arrived_after_retention")

        clock.now = swept_at + timedelta(seconds=TOMBSTONE) - SECOND  # the tombstone's last second
        await app.sweep()
        late = await source.deliver(id="w-1", body=b"once")
        assert (late.outcome, late.reason) == (Outcome.DEAD_LETTERED, "arrived_after_retention")

        clock.now = swept_at + timedelta(seconds=TOMBSTONE) + SECOND
        await app.sweep()  # the tombstone goes: the key is a key like any other
        assert (await source.deliver(id="w-1", body=b"once")).outcome is Outcome.PROCESSED
    assert runs == ["once", "once"]


async def test_a_long_handler_is_remembered_from_its_completion(database_url: str) -> None:
    """A handler that ran past a lease (renewing it): the window runs from its completion, less at most
    one lease, not from the claim, so the sweep cannot take the key early."""
    clock = Clock()
    app = ConsumerApp(make_settings(database_url, inbox_retention_seconds=RETENTION, inbox_tombstone_seconds=TOMBSTONE,
                                    inbox_lease_seconds=LEASE), clock=clock)
    source = InMemorySource(namespace="window", version=1, name="window-long")
    runs: list[str] = []
    ran_for = timedelta(seconds=LEASE * 4)

    @app.handler(source, name="window-long")
    async def slow(ctx: Context) -> None:
        clock.now += ran_for  # the handler's work took four leases (kept alive by its heartbeat)
        runs.append("long")

    async with app.running():
        claimed = clock.now
        assert (await source.deliver(id="w-long", body=b"x")).outcome is Outcome.PROCESSED
        completed = clock.now
        assert completed - claimed == ran_for
        clock.now = completed + timedelta(seconds=RETENTION - LEASE) - SECOND
        assert await app.sweep() == 0
        assert (await source.deliver(id="w-long", body=b"x")).outcome is Outcome.DUPLICATE
        clock.now = completed + timedelta(seconds=RETENTION) + SECOND
        assert await app.sweep() == 1
    assert runs == ["long"]
