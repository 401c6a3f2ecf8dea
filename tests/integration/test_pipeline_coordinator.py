"""The pipeline's coordinator step, with the embedded coordinator (SQLite, PostgreSQL) and with
HttpCoordinator against the served coordinator on loopback; plus the user harness running the recipe."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from consumer_kit import (
    ConfigurationError,
    ConsumerApp,
    Context,
    Delivery,
    Outcome,
    RetryableError,
    Settings,
    Settlement,
)
from consumer_kit.coordinator import (
    CoordinatorUnavailable,
    EmbeddedCoordinator,
    IdempotencyResultInactive,
    SessionReceipt,
    SessionRequest,
)
from consumer_kit.store.receipts import STRIPES
from consumer_kit.testing import InMemorySource, RecipeHarness
from consumer_kit.testing.server import served_coordinator
from tests.conftest import make_settings

effects_metadata = MetaData()
effects = Table("coord_test_effects", effects_metadata,
                Column("id", Integer, primary_key=True, autoincrement=True),
                Column("ticket", String(50), nullable=False))


def build(settings: Settings, **app_kwargs: Any) -> tuple[ConsumerApp, InMemorySource, list[SessionReceipt | None]]:
    app = ConsumerApp(settings, **app_kwargs)
    source = InMemorySource(namespace="ticket-queue", version=1)
    sessions: list[SessionReceipt | None] = []

    @app.handler(source, labels=["research-agent"], task=lambda d: f"Prepare {d.json()['key']}")
    async def handle(ctx: Context) -> None:
        sessions.append(ctx.session)
        await ctx.db.execute(effects.insert().values(ticket=ctx.delivery.json()["key"]))

    return app, source, sessions


async def prepare(app: ConsumerApp) -> Callable[[], Awaitable[int]]:
    async with app.engine.begin() as conn:
        await conn.run_sync(effects_metadata.drop_all)
        await conn.run_sync(effects_metadata.create_all)

    async def count() -> int:
        async with app.engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(effects))).scalar_one())

    return count


async def test_session_created_and_ended_after_commit(settings: Settings) -> None:
    app, source, sessions = build(settings)
    async with app.running():
        await prepare(app)
        assert isinstance(app.coordinator, EmbeddedCoordinator)
        result = await source.deliver(id="m-1", body=b'{"key": "T-1"}')
        assert (result.outcome, result.settlement) == (Outcome.PROCESSED, Settlement.ACK)
        assert sessions[0] is not None and not sessions[0].replayed
        key = source.key(source.settled[0][0]).derive("session")
        with pytest.raises(IdempotencyResultInactive):  # ended once the transaction committed
            await app.coordinator.create_session(
                SessionRequest(labels=("research-agent",), task="Prepare T-1",
                               ttl_seconds=settings.coordinator_session_ttl_seconds), idempotency_key=key)
        assert (await source.deliver(id="m-1", body=b'{"key": "T-1"}')).outcome is Outcome.DUPLICATE


async def test_session_ends_only_if_the_transaction_commits(settings: Settings) -> None:
    """The embedded coordinator shares the inbox's database, so the session is ended inside the
    handler's transaction: a rollback after the end statement leaves it active for the retry."""
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="ticket-queue", version=1)
    sessions: list[SessionReceipt | None] = []

    @app.handler(source, labels=["research-agent"], task="Prepare T-9")
    async def handle(ctx: Context) -> None:
        sessions.append(ctx.session)
        await ctx.db.execute(effects.insert().values(ticket="T-9"))
        if len(sessions) == 1:
            raise RetryableError("downstream not ready", delay=0)

    async with app.running():
        count = await prepare(app)
        first = await source.deliver(id="m-9", body=b"{}")
        assert first.outcome is Outcome.RETRY and await count() == 0
        second = await source.deliver(id="m-9", body=b"{}", attempt=2)
        assert second.outcome is Outcome.PROCESSED and await count() == 1
        assert sessions[0] is not None and sessions[1] is not None
        assert sessions[1].replayed and sessions[1].session_id == sessions[0].session_id
        request = SessionRequest(labels=("research-agent",), task="Prepare T-9",
                                 ttl_seconds=settings.coordinator_session_ttl_seconds)
        with pytest.raises(IdempotencyResultInactive):
            await app.coordinator.create_session(request, idempotency_key=source.key(
                source.settled[0][0]).derive("session"))


@pytest.mark.postgres
async def test_session_rides_on_the_claim_and_ends_with_the_completion(pg_database: str) -> None:
    """On PostgreSQL the embedded coordinator's creation is carried by the claim's statement and its
    ending by the completion's: a delivery that does not get the lease creates no session, and a
    completion that lost its lease leaves the session active for the attempt that takes over."""
    settings = make_settings(pg_database)
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="ticket-queue", version=1)
    sessions: list[SessionReceipt] = []

    @app.handler(source, labels=["research-agent"], task="Prepare", driver="asyncpg", name="riding")
    async def handle(ctx: Context) -> None:
        assert ctx.session is not None
        sessions.append(ctx.session)
        if ctx.delivery.id == "m-3" and ctx.attempt == 1:  # another worker takes the row over meanwhile
            async with app.engine.begin() as other:
                await other.exec_driver_sql(
                    "UPDATE inbox SET lease_token = 'stolen', locked_until = now() - interval '1 second'"
                    " WHERE consumer = 'riding' AND state = 'started'")

    async def status(session_id: str) -> str:
        async with app.engine.connect() as conn:
            return str((await conn.exec_driver_sql(
                "SELECT status FROM coordinator_resources WHERE id = $1", (session_id,))).scalar_one())

    async def receipts() -> int:
        assert isinstance(app.coordinator, EmbeddedCoordinator)
        return (await app.coordinator.store.stats())[0]

    async with app.running():
        async with app.engine.connect() as conn:  # opened at start: the first creation rides too
            stripes = (await conn.exec_driver_sql(
                "SELECT count(*) FROM idempotency_scopes WHERE tenant = 'local' AND operation = 'session'"
                " AND live = 0")).scalar_one()
        assert stripes == STRIPES
        assert (await source.deliver(id="m-0", body=b"{}")).outcome is Outcome.PROCESSED
        assert await status(sessions[0].session_id) == "ended"

        held = Delivery(id="m-1", body=b"{}")
        async with app.database.connect() as ex:
            lease = await app.inbox.claim(ex, "riding", app.pipeline.digester.candidates(source.key(held)),
                                          held.fingerprint(), namespace="ticket-queue", version=1)
        assert lease.acquired
        before = await receipts()
        assert (await source.deliver_delivery(held)).outcome is Outcome.IN_PROGRESS
        assert await receipts() == before  # no lease, no session

        assert (await source.deliver(id="m-2", body=b"{}")).outcome is Outcome.PROCESSED
        assert await receipts() == before + 1 and await status(sessions[-1].session_id) == "ended"

        assert (await source.deliver(id="m-3", body=b"{}")).outcome is Outcome.LEASE_LOST
        first = sessions[-1]
        assert await status(first.session_id) == "active"  # the ending rolled back with the completion
        retried = await source.deliver(id="m-3", body=b"{}", attempt=2)
        assert retried.outcome is Outcome.PROCESSED
        assert sessions[-1].replayed and sessions[-1].session_id == first.session_id
        assert await status(first.session_id) == "ended"


@pytest.mark.postgres
async def test_concurrent_claims_of_one_key_create_one_session(pg_database: str) -> None:
    """Twenty deliveries of one new key at once: one claim wins, and only its statement creates a
    session; the losers' riders take no receipt slot."""
    app = ConsumerApp(make_settings(pg_database))
    source = InMemorySource(namespace="ticket-queue", version=1)
    runs: list[SessionReceipt | None] = []

    @app.handler(source, labels=["research-agent"], task="Prepare", driver="asyncpg", name="racing")
    async def handle(ctx: Context) -> None:
        runs.append(ctx.session)
        await asyncio.sleep(0.05)  # still running while the others claim

    async with app.running():
        results = await asyncio.gather(*(source.deliver(id="m-race", body=b"{}") for _ in range(20)))
        async with app.engine.connect() as conn:
            resources = (await conn.exec_driver_sql("SELECT count(*) FROM coordinator_resources")).scalar_one()
            receipts, live = (await conn.exec_driver_sql(
                "SELECT (SELECT count(*) FROM idempotency_receipts),"
                " (SELECT sum(live) FROM idempotency_scopes WHERE operation = 'session')")).one()
    outcomes = [r.outcome for r in results]
    assert outcomes.count(Outcome.PROCESSED) == 1 and len(runs) == 1
    assert set(outcomes) <= {Outcome.PROCESSED, Outcome.IN_PROGRESS, Outcome.DUPLICATE}
    assert (resources, receipts, live) == (1, 1, 1)


async def test_an_invalid_session_request_parks_the_delivery_at_once(settings: Settings) -> None:
    """A task this delivery makes that no session may carry (over 4096 characters) is bad input: parked
    with its reason on the first delivery, not retried until the budget runs out."""
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="ticket-queue", version=1)
    runs: list[int] = []

    @app.handler(source, labels=["research-agent"], task=lambda d: "Prepare " + d.text() * 5000)
    async def handle(ctx: Context) -> None:
        runs.append(1)

    async with app.running():
        result = await source.deliver(id="m-long", body="x")
        assert (result.outcome, result.settlement, result.reason) == (
            Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER, "invalid_session_request")
        [parked] = await app.dead_letters.list()
        assert parked.reason == "invalid_session_request" and "task" in (parked.detail or "")
        assert (await source.deliver(id="m-long", body="x")).outcome is Outcome.DUPLICATE  # parked key
    assert runs == []


def test_a_fixed_task_that_cannot_be_a_session_is_refused_at_registration(sqlite_url: str) -> None:
    app = ConsumerApp(make_settings(sqlite_url))
    with pytest.raises(ConfigurationError, match="valid session request"):
        app.handler(InMemorySource(namespace="n", version=1), task="x" * 5000)


async def test_recipe_with_the_harness(settings: Settings) -> None:
    app, source, _sessions = build(settings)
    async with app.running():
        count = await prepare(app)
        report = await RecipeHarness(app, source, effects=count).run(
            body=b'{"key": "T-1"}', changed_body=b'{"key": "T-2"}')
        report.assert_ok()
        assert await app.dead_letters.count(reason="inactive") == 1
        assert await app.dead_letters.count(reason="conflict") == 1


async def test_coordinator_conflict_parks_the_delivery(settings: Settings) -> None:
    task = {"value": "Prepare"}
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="ticket-queue", version=1)
    calls: list[int] = []

    @app.handler(source, labels=["a"], task=lambda d: task["value"])
    async def handle(ctx: Context) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RetryableError("first delivery fails after the session was created", delay=0)

    async with app.running():
        first = await source.deliver(id="m-1", body=b"{}")
        assert first.outcome is Outcome.RETRY
        task["value"] = "Prepare differently"  # a deploy changed the session's fields under one key
        result = await source.deliver(id="m-1", body=b"{}", attempt=2)
        assert (result.outcome, result.settlement, result.reason) == (
            Outcome.CONFLICT, Settlement.DEAD_LETTER, "conflict")
    assert len(calls) == 1  # the handler did not run for the conflicting delivery


class Unavailable(EmbeddedCoordinator):
    async def create_session(self, request: SessionRequest, *, idempotency_key: str | None = None,
                             generated_key: bool = False) -> SessionReceipt:
        raise CoordinatorUnavailable("down", delay=7)


async def test_unavailable_coordinator_retries_later(sqlite_url: str) -> None:
    settings = make_settings(sqlite_url)
    from consumer_kit.store import create_engine

    engine = create_engine(sqlite_url)
    app, source, sessions = build(settings, coordinator=Unavailable(engine, settings))
    async with app.running():
        result = await source.deliver(id="m-1", body=b'{"key": "T-1"}')
    await engine.dispose()
    assert (result.outcome, result.settlement, result.delay) == (Outcome.RETRY, Settlement.RETRY_LATER, 7)
    assert sessions == []  # the handler never ran without its session


async def test_handler_without_labels_or_task_gets_no_session(settings: Settings) -> None:
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="plain", version=1)
    seen: list[object] = []

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        seen.append(ctx.session)

    async with app.running():
        assert (await source.deliver(id="m-1", body=b"{}")).outcome is Outcome.PROCESSED
    assert seen == [None]


async def test_recipe_through_http_coordinator_on_loopback(database_url: str) -> None:
    """The pipeline with COORDINATOR_URL set: HttpCoordinator against the served coordinator."""
    server_settings = make_settings(database_url)
    async with served_coordinator(server_settings, {"worker-token": ("acme", "tickets")}) as url:
        settings = make_settings(database_url, coordinator_url=url, coordinator_token="worker-token")
        app, source, _ = build(settings)
        async with app.running():
            from consumer_kit.coordinator import HttpCoordinator

            assert isinstance(app.coordinator, HttpCoordinator)
            count = await prepare(app)
            report = await RecipeHarness(app, source, effects=count).run(
                body=b'{"key": "T-1"}', changed_body=b'{"key": "T-2"}')
    report.assert_ok()
