"""The per-delivery algorithm, on SQLite and on the real PostgreSQL server, for handlers that write
through ``ctx.db`` (SQLAlchemy, on asyncpg and on psycopg) and through ``ctx.connection`` (asyncpg)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from consumer_kit import (
    ConsumerApp,
    Context,
    Outcome,
    RetryableError,
    Settings,
    Settlement,
    TerminalError,
)
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings, truncate_all

effects_metadata = MetaData()
effects = Table(
    "test_effects",
    effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ticket", String(50), nullable=False),
)


async def make_effects_table(app: ConsumerApp) -> None:
    async with app.engine.begin() as conn:
        await conn.run_sync(effects_metadata.drop_all)
        await conn.run_sync(effects_metadata.create_all)


async def effect_count(app: ConsumerApp) -> int:
    async with app.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(effects))).scalar_one())


@dataclass(frozen=True)
class Target:
    """A database and the way the handler writes to it."""

    url: str
    driver: Literal["sqlalchemy", "asyncpg"] = "sqlalchemy"

    def settings(self, **overrides: object) -> Settings:
        return make_settings(self.url, **overrides)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("psycopg", marks=pytest.mark.postgres),
                        pytest.param("postgres-ctx.connection", marks=pytest.mark.postgres)])
async def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """The ``database_url`` targets with ``ctx.db``, and PostgreSQL with ``ctx.connection``."""
    if request.param == "sqlite":
        return Target(f"sqlite+aiosqlite:///{tmp_path}/consumer-kit.db")
    url = request.getfixturevalue("pg_url")
    await truncate_all(url)
    if request.param == "psycopg":
        return Target(url.replace("+asyncpg://", "+psycopg://"))
    return Target(url, "asyncpg" if request.param.endswith("ctx.connection") else "sqlalchemy")


def takeovers() -> float:
    """``consumer_kit_inbox_takeovers_total`` of the tests' source, as /metrics would show it."""
    return REGISTRY.get_sample_value("consumer_kit_inbox_takeovers_total", {"source": "memory:ticket-queue"}) or 0.0


def build(target: Target | Settings, *, single_transaction: bool = False,
          extra: Callable[[Context], Awaitable[None]] | None = None,
          before: Callable[[Context], Awaitable[None]] | None = None, **overrides: object,
          ) -> tuple[ConsumerApp, InMemorySource, list[str]]:
    """An app whose handler records a ticket (through ``target``'s driver); ``overrides`` are settings."""
    if isinstance(target, Target):
        driver, app = target.driver, ConsumerApp(target.settings(**overrides))
    else:
        driver, app = "sqlalchemy", ConsumerApp(target)
    source = InMemorySource(namespace="ticket-queue", version=1)
    runs: list[str] = []

    @app.handler(source, single_transaction=single_transaction, driver=driver)
    async def handle(ctx: Context) -> None:
        runs.append(ctx.key_digest)
        if before is not None:  # waits before the first write: SQLite serialises writers
            await before(ctx)
        ticket = ctx.delivery.json()["key"]
        if driver == "asyncpg":
            await ctx.connection.execute("INSERT INTO test_effects (ticket) VALUES ($1)", ticket)
        else:
            await ctx.db.execute(effects.insert().values(ticket=ticket))
        if extra is not None:
            await extra(ctx)

    return app, source, runs


@pytest.mark.parametrize("single", [False, True], ids=["two-txn", "one-txn"])
async def test_duplicate_runs_once(target: Target, single: bool) -> None:
    app, source, runs = build(target, single_transaction=single)
    async with app.running():
        await make_effects_table(app)
        first = await source.deliver(id="msg-0001", body=b'{"key": "T-1"}')
        second = await source.deliver(id="msg-0001", body=b'{"key": "T-1"}')
        assert (first.outcome, first.settlement) == (Outcome.PROCESSED, Settlement.ACK)
        assert (second.outcome, second.settlement) == (Outcome.DUPLICATE, Settlement.ACK)
        assert len(runs) == 1
        assert await effect_count(app) == 1


@pytest.mark.parametrize("single", [False, True], ids=["two-txn", "one-txn"])
async def test_conflict_is_parked_and_writes_nothing(target: Target, single: bool) -> None:
    app, source, runs = build(target, single_transaction=single)
    async with app.running():
        await make_effects_table(app)
        await source.deliver(id="msg-0002", body=b'{"key": "T-1"}')
        conflict = await source.deliver(id="msg-0002", body=b'{"key": "T-2"}')
        assert (conflict.outcome, conflict.settlement) == (Outcome.CONFLICT, Settlement.DEAD_LETTER)
        assert len(runs) == 1
        assert await effect_count(app) == 1
        [parked] = await app.dead_letters.list(reason="conflict")
        assert parked.body == b'{"key": "T-2"}'
        assert parked.key_digest is not None and len(parked.key_digest) == 64


async def test_concurrent_instances_run_once(target: Target) -> None:
    release = asyncio.Event()
    entered = asyncio.Event()

    async def slow(ctx: Context) -> None:
        entered.set()
        await release.wait()

    app1, source1, runs1 = build(target, before=slow)
    app2, source2, runs2 = build(target)
    async with app1.running(), app2.running():
        await make_effects_table(app1)
        first = asyncio.create_task(source1.deliver(id="msg-0003", body=b'{"key": "T-3"}'))
        await asyncio.wait_for(entered.wait(), 10)
        second = await source2.deliver(id="msg-0003", body=b'{"key": "T-3"}')
        assert (second.outcome, second.settlement) == (Outcome.IN_PROGRESS, Settlement.RETRY_LATER)
        assert second.delay is not None and second.delay > 0
        release.set()
        assert (await first).outcome is Outcome.PROCESSED
        again = await source2.deliver(id="msg-0003", body=b'{"key": "T-3"}')
        assert again.outcome is Outcome.DUPLICATE
        assert len(runs1) + len(runs2) == 1
        assert await effect_count(app1) == 1


async def test_takeover_after_crash_and_late_completion_rolls_back(target: Target) -> None:
    # The first holder's lease is short and never renewed (a process that froze or died).

    release = asyncio.Event()
    entered = asyncio.Event()

    async def freeze(ctx: Context) -> None:
        entered.set()
        await release.wait()

    app1, source1, runs1 = build(target, before=freeze, inbox_lease_seconds=0.3, inbox_heartbeat_seconds=3600)
    app2, source2, runs2 = build(target)
    before = takeovers()
    async with app1.running(), app2.running():
        await make_effects_table(app1)
        first = asyncio.create_task(source1.deliver(id="msg-0004", body=b'{"key": "T-4"}'))
        await asyncio.wait_for(entered.wait(), 10)
        await asyncio.sleep(0.5)  # the lease runs out
        taken = await source2.deliver(id="msg-0004", body=b'{"key": "T-4"}')
        assert taken.outcome is Outcome.PROCESSED
        assert takeovers() == before + 1  # a lease that ran out: counted
        release.set()
        late = await first
        assert (late.outcome, late.settlement) == (Outcome.LEASE_LOST, Settlement.RETRY_LATER)
        assert len(runs1) == 1 and len(runs2) == 1
        assert await effect_count(app1) == 1  # the late holder's insert was rolled back
        assert (await source1.deliver(id="msg-0004", body=b'{"key": "T-4"}')).outcome is Outcome.DUPLICATE


async def test_a_lease_the_database_lost_rolls_the_effect_back(target: Target) -> None:
    """A claim commits without waiting for its flush to disk (PostgreSQL), so a crash of the database
    server can lose it: the row is gone while the handler runs. Its completion then matches nothing, the
    effect rolls back, and the redelivery claims the key afresh and runs it once."""
    lost: list[bool] = []

    async def lose_the_lease(ctx: Context) -> None:
        if not lost:
            lost.append(True)
            async with app.engine.begin() as conn:
                assert (await conn.execute(text("DELETE FROM inbox"))).rowcount == 1

    app, source, runs = build(target, before=lose_the_lease)
    async with app.running():
        await make_effects_table(app)
        late = await source.deliver(id="msg-0009", body=b'{"key": "T-9"}')
        assert (late.outcome, late.settlement) == (Outcome.LEASE_LOST, Settlement.RETRY_LATER)
        assert await effect_count(app) == 0
        again = await source.deliver(id="msg-0009", body=b'{"key": "T-9"}')
        assert (again.outcome, again.settlement) == (Outcome.PROCESSED, Settlement.ACK)
        assert len(runs) == 2 and await effect_count(app) == 1
        assert (await source.deliver(id="msg-0009", body=b'{"key": "T-9"}')).outcome is Outcome.DUPLICATE


async def test_heartbeat_keeps_a_long_handler_alive(target: Target) -> None:

    release = asyncio.Event()
    entered = asyncio.Event()

    async def long_running(ctx: Context) -> None:
        entered.set()
        await release.wait()

    app1, source1, _ = build(target, before=long_running, inbox_lease_seconds=0.4)
    app2, source2, _ = build(target, inbox_lease_seconds=0.4)
    async with app1.running(), app2.running():
        await make_effects_table(app1)
        first = asyncio.create_task(source1.deliver(id="msg-0005", body=b'{"key": "T-5"}'))
        await asyncio.wait_for(entered.wait(), 10)
        await asyncio.sleep(1.0)  # 2.5 leases: only renewals keep it
        assert (await source2.deliver(id="msg-0005", body=b'{"key": "T-5"}')).outcome is Outcome.IN_PROGRESS
        release.set()
        assert (await first).outcome is Outcome.PROCESSED
        assert await effect_count(app1) == 1


@pytest.mark.parametrize("single", [False, True], ids=["two-txn", "one-txn"])
async def test_retryable_failures_then_success(target: Target, single: bool) -> None:

    failures = {"left": 3}

    async def flaky(ctx: Context) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("downstream unavailable")

    app, source, runs = build(target, single_transaction=single, extra=flaky, retry_attempts=2)
    before = takeovers()
    async with app.running():
        await make_effects_table(app)
        first = await source.deliver(id="msg-0006", body=b'{"key": "T-6"}')
        assert (first.outcome, first.settlement) == (Outcome.RETRY, Settlement.RETRY_LATER)
        assert await effect_count(app) == 0  # each failed attempt rolled back its insert
        second = await source.deliver(id="msg-0006", body=b'{"key": "T-6"}', attempt=2)
        assert second.outcome is Outcome.PROCESSED
        assert len(runs) == 4
        assert await effect_count(app) == 1
    assert takeovers() == before  # the failed delivery gave its lease back: its retry is no takeover


@pytest.mark.parametrize("single", [False, True], ids=["two-txn", "one-txn"])
async def test_terminal_failure_is_parked_and_rolled_back(target: Target, single: bool) -> None:
    async def reject(ctx: Context) -> None:
        raise TerminalError("ticket is malformed", reason="bad_ticket")

    app, source, runs = build(target, single_transaction=single, extra=reject)
    async with app.running():
        await make_effects_table(app)
        result = await source.deliver(id="msg-0007", body=b'{"key": "T-7"}')
        assert (result.outcome, result.settlement, result.reason) == (
            Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER, "bad_ticket")
        assert await effect_count(app) == 0
        [parked] = await app.dead_letters.list()
        assert parked.reason == "bad_ticket" and parked.body == b'{"key": "T-7"}'
        assert "ticket is malformed" in (parked.detail or "")
        again = await source.deliver(id="msg-0007", body=b'{"key": "T-7"}')
        assert (again.outcome, again.settlement) == (Outcome.DUPLICATE, Settlement.ACK)
        assert len(runs) == 1


@pytest.mark.parametrize("single", [False, True], ids=["two-txn", "one-txn"])
async def test_max_deliveries_exhausts(target: Target, single: bool) -> None:
    async def always(ctx: Context) -> None:
        raise RetryableError("still down", delay=0.0)

    app, source, _ = build(target, single_transaction=single, extra=always, max_deliveries=3)
    async with app.running():
        await make_effects_table(app)
        outcomes = [(await source.deliver(id="msg-0008", body=b'{"key": "T-8"}')).outcome for _ in range(3)]
        assert outcomes == [Outcome.RETRY, Outcome.RETRY, Outcome.DEAD_LETTERED]
        [parked] = await app.dead_letters.list()
        assert parked.reason == "retries_exhausted" and parked.attempts == 3
        assert await effect_count(app) == 0


@pytest.mark.parametrize(
    "bad_id", ["", "x" * 256, "a\x00b", "a\x7fb", "a\u0085b", " lead", "trail ", "trail\n", "\nlead"]
)
async def test_invalid_keys_are_parked(settings: Settings, bad_id: str) -> None:
    app, source, runs = build(settings)
    async with app.running():
        result = await source.deliver(id=bad_id, body=b'{"key": "T-9"}')
        assert (result.outcome, result.settlement, result.reason) == (
            Outcome.INVALID, Settlement.DEAD_LETTER, "invalid_key")
        [parked] = await app.dead_letters.list()
        assert parked.reason == "invalid_key" and parked.key_digest is None
        assert parked.body == b'{"key": "T-9"}'
        assert not runs


async def test_missing_id_is_parked(settings: Settings) -> None:
    app, source, runs = build(settings)
    async with app.running():
        result = await source.deliver(id=None, body=b'{"key": "T-10"}')
        assert (result.outcome, result.settlement, result.reason) == (
            Outcome.INVALID, Settlement.DEAD_LETTER, "missing_stable_id")
        assert await app.dead_letters.count(reason="missing_stable_id") == 1
        assert not runs


class Base(DeclarativeBase):
    pass


class Ticket(Base):
    __tablename__ = "test_orm_tickets"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(50))


@pytest.mark.parametrize("single", [False, True], ids=["two-txn", "one-txn"])
async def test_orm_objects_commit_with_the_inbox_record(database_url: str, single: bool) -> None:
    app = ConsumerApp(make_settings(database_url))
    source = InMemorySource(namespace="orm", version=1)
    fail = {"once": True}

    @app.handler(source, single_transaction=single)
    async def handle(ctx: Context) -> None:
        ctx.db.add(Ticket(key=ctx.delivery.json()["key"]))
        if fail["once"]:
            fail["once"] = False
            await ctx.db.flush()
            raise ConnectionError("after the flush: must roll back")

    async with app.running():
        async with app.engine.begin() as conn:
            await conn.run_sync(Base.metadata.drop_all)
            await conn.run_sync(Base.metadata.create_all)
        assert (await source.deliver(id="orm-0001", body=b'{"key": "T-1"}')).outcome is Outcome.PROCESSED
        assert (await source.deliver(id="orm-0001", body=b'{"key": "T-1"}')).outcome is Outcome.DUPLICATE
        async with app.engine.connect() as conn:
            keys = (await conn.execute(select(Ticket.key))).scalars().all()
        assert keys == ["T-1"]
