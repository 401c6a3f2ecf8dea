"""Batched deliveries: many deliveries a transaction, a poison one isolated, every effect once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from opentelemetry import trace
from prometheus_client import REGISTRY
from sqlalchemy import text

from consumer_kit import Batch, ConfigurationError, ConsumerApp, Context, Outcome, Result, TerminalError
from consumer_kit.delivery import Delivery, Dispatch, DispatchSoon
from consumer_kit.settings import Settings
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings


class SoonSource(InMemorySource):
    """Hands deliveries over as the RabbitMQ source does: with ``dispatch.soon`` (no task, no awaited
    chain: the batch tells the result) whenever the dispatch takes them that way, else awaited."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.taken = 0  # deliveries ``soon`` took
        self.handed: DispatchSoon | None = None  # the app's dispatch, as start() is given it

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        await super().start(dispatch, settings)
        self.handed = dispatch if isinstance(dispatch, DispatchSoon) else None

    def soon(self, delivery: Delivery, then: Callable[[Result | None], None]) -> bool:
        """Hand ``delivery`` over with the app's ``soon`` (False when it would not take it)."""
        return self.handed is not None and self.handed.soon(delivery, then)

    async def deliver_delivery(self, delivery: Delivery) -> Result:
        told: asyncio.Future[Result | None] = asyncio.get_running_loop().create_future()
        if self.soon(delivery, told.set_result):
            self.taken += 1
            result = await told
            assert result is not None, "nothing was decided"
            self.settled.append((delivery, result))
            return result
        return await super().deliver_delivery(delivery)


HANDED = pytest.mark.parametrize("handed", ["awaited", "soon"])
"""Every batch test runs with the delivery's caller awaiting it and with ``soon`` (what RabbitMQ does)."""

UNTRACED = trace.NoOpTracerProvider()
"""``soon`` hands over only untraced deliveries (a traced one's span is current in its own task): the
suite traces every app, so the ``soon`` variants turn tracing off."""


def app_for(handed: str, url: str, **overrides: object) -> ConsumerApp:
    return ConsumerApp(make_settings(url, **overrides), tracer_provider=UNTRACED if handed == "soon" else None)


def source_for(handed: str, namespace: str) -> InMemorySource:
    return SoonSource(namespace=namespace, version=1) if handed == "soon" else InMemorySource(
        namespace=namespace, version=1)


def build(url: str, *, max_size: int = 16, handed: str = "awaited",
          **overrides: object) -> tuple[ConsumerApp, InMemorySource, list[str]]:
    app = app_for(handed, url, retry_attempts=2, **overrides)
    source = source_for(handed, "batched")
    runs: list[str] = []
    flaked: set[str] = set()

    @app.handler(source, name="batched", single_transaction=True, batch=Batch(max_size=max_size, max_wait_ms=20))
    async def handle(ctx: Context) -> None:
        ticket = ctx.delivery.text()
        runs.append(ticket)
        await ctx.db.execute(text("INSERT INTO batch_effects (ticket) VALUES (:t)"), {"t": ticket})
        ctx.outbox.publish("batched.out", ticket)
        if ticket.startswith("poison"):
            raise TerminalError("this one never works", reason="poison")
        if ticket.startswith("flaky") and ticket not in flaked:
            flaked.add(ticket)
            raise ConnectionError("once")

    return app, source, runs


async def prepare(app: ConsumerApp) -> None:
    async with app.engine.begin() as conn:
        await conn.exec_driver_sql("DROP TABLE IF EXISTS batch_effects")
        await conn.exec_driver_sql("CREATE TABLE batch_effects (ticket VARCHAR(40) NOT NULL)")


async def effects(app: ConsumerApp, table: str = "batch_effects") -> dict[str, int]:
    async with app.engine.connect() as conn:
        rows = (await conn.exec_driver_sql(f"SELECT ticket, count(*) FROM {table} GROUP BY ticket")).all()
    return {r[0]: int(r[1]) for r in rows}


def batch_count() -> float:
    return REGISTRY.get_sample_value("consumer_kit_batch_size_count") or 0.0


@HANDED
async def test_poison_and_flaky_deliveries_do_not_fail_their_batch(database_url: str, handed: str) -> None:
    app, source, runs = build(database_url, handed=handed)
    tickets = [f"good-{i}" for i in range(90)] + ["poison-1", "poison-2"] + [f"flaky-{i}" for i in range(3)]
    batches = batch_count()
    async with app.running():
        await prepare(app)
        results = await asyncio.gather(*(source.deliver(id=f"m-{t}", body=t) for t in tickets))
        again = await asyncio.gather(*(source.deliver(id=f"m-{t}", body=t) for t in tickets[:20]))
        seen = await effects(app)
        parked = await app.dead_letters.list(reason="poison")
        async with app.engine.connect() as conn:
            outbox = (await conn.exec_driver_sql("SELECT count(*) FROM outbox")).scalar_one()
    outcomes = dict(zip(tickets, (r.outcome for r in results), strict=True))
    assert all(outcomes[t] is Outcome.PROCESSED for t in tickets if not t.startswith("poison"))
    assert outcomes["poison-1"] is outcomes["poison-2"] is Outcome.DEAD_LETTERED
    assert {p.body for p in parked} == {b"poison-1", b"poison-2"}
    assert seen == {t: 1 for t in tickets if not t.startswith("poison")}  # each good effect once
    assert outbox == len(seen)  # outbox rows commit with their effect, none for the poison
    assert all(r.outcome is Outcome.DUPLICATE for r in again)
    assert batch_count() - batches < len(tickets) / 2  # they really were batched
    if handed == "soon":  # every delivery was handed over without a caller's coroutine
        assert isinstance(source, SoonSource) and source.taken == len(tickets) + len(again)
    # A good delivery ran again only when a failing neighbour rolled its batch back: at most once more
    # per failing delivery in its batch, never redelivered.
    assert max(runs.count(t) for t in tickets if t.startswith("good")) <= 1 + 5


@HANDED
async def test_a_key_twice_in_one_batch_runs_once(database_url: str, handed: str) -> None:
    app, source, runs = build(database_url, handed=handed)
    async with app.running():
        await prepare(app)
        results = await asyncio.gather(*(source.deliver(id="m-same", body="same") for _ in range(5)))
        seen = await effects(app)
    assert sorted(r.outcome for r in results) == sorted([Outcome.PROCESSED] + [Outcome.DUPLICATE] * 4)
    assert seen == {"same": 1} and runs == ["same"]


@pytest.mark.postgres
@HANDED
async def test_a_commit_that_fails_as_a_whole_is_halved_down_to_the_culprit(pg_database: str, handed: str) -> None:
    """Two deliveries of a batch break a deferred constraint together: only the commit fails, so the
    batch is halved until each stands alone; all the others commit, and one of the pair too."""
    app = app_for(handed, pg_database, retry_attempts=1, max_deliveries=1)
    source = source_for(handed, "deferred")

    @app.handler(source, name="deferred", single_transaction=True, batch=Batch(max_size=8, max_wait_ms=50))
    async def handle(ctx: Context) -> None:
        ticket = ctx.delivery.text()
        value = "clash" if ticket.startswith("clash") else ticket
        await ctx.db.execute(text("INSERT INTO deferred_effects (value) VALUES (:v)"), {"v": value})

    bisections = REGISTRY.get_sample_value("consumer_kit_batch_bisections_total") or 0.0
    async with app.running():
        async with app.engine.begin() as conn:
            await conn.exec_driver_sql("DROP TABLE IF EXISTS deferred_effects")
            await conn.exec_driver_sql("CREATE TABLE deferred_effects (value text, CONSTRAINT one_each UNIQUE (value)"
                                       " DEFERRABLE INITIALLY DEFERRED)")
        tickets = ["a", "b", "clash-1", "c", "d", "clash-2", "e", "f"]
        results = await asyncio.gather(*(source.deliver(id=f"m-{t}", body=t) for t in tickets))
        async with app.engine.connect() as conn:
            values = sorted(r[0] for r in (await conn.exec_driver_sql("SELECT value FROM deferred_effects")).all())
    outcomes = dict(zip(tickets, (r.outcome for r in results), strict=True))
    assert values == ["a", "b", "c", "clash", "d", "e", "f"]
    assert all(outcomes[t] is Outcome.PROCESSED for t in "abcdef")
    assert sorted([outcomes["clash-1"], outcomes["clash-2"]]) == sorted([Outcome.PROCESSED, Outcome.DEAD_LETTERED])
    assert (REGISTRY.get_sample_value("consumer_kit_batch_bisections_total") or 0.0) > bisections


@HANDED
async def test_arrivals_gather_while_the_allowed_batches_run(database_url: str, handed: str) -> None:
    """With one batch at a time, what arrives while it runs waits for it and goes in full batches."""
    app = app_for(handed, database_url)
    source = source_for(handed, "gathered")
    running = peak = 0

    @app.handler(source, name="gathered", single_transaction=True,
                 batch=Batch(max_size=16, max_wait_ms=1, max_concurrent=1))
    async def handle(ctx: Context) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.002)
        running -= 1

    batches = batch_count()
    async with app.running():
        results = await asyncio.gather(*(source.deliver(id=f"m-{i}", body=str(i)) for i in range(160)))
    assert all(r.outcome is Outcome.PROCESSED for r in results)
    assert peak == 1  # never two batches at once
    assert batch_count() - batches <= 160 / 16 + 1  # the first alone at most, then full ones


async def test_callers_cancelled_while_their_batch_runs_leave_it_to_commit(database_url: str) -> None:
    """A delivery's caller cancelled mid-batch (its channel closed) gives up only its answer: the batch
    commits every effect once, and the redelivery of each is a duplicate."""
    app = ConsumerApp(make_settings(database_url))
    source = InMemorySource(namespace="cancelled", version=1)
    runs: list[str] = []
    under_way, go_on = asyncio.Event(), asyncio.Event()

    @app.handler(source, name="cancelled", single_transaction=True, batch=Batch(max_size=16, max_wait_ms=20))
    async def handle(ctx: Context) -> None:
        runs.append(ctx.delivery.text())
        await ctx.db.execute(text("INSERT INTO batch_effects (ticket) VALUES (:t)"), {"t": ctx.delivery.text()})
        if len(runs) == 4:  # mid-batch: four handlers ran, twelve wait their turn
            under_way.set()
            await go_on.wait()

    tickets = [f"good-{i}" for i in range(16)]
    async with app.running():
        await prepare(app)
        callers = [asyncio.ensure_future(source.deliver(id=f"m-{t}", body=t)) for t in tickets]
        await asyncio.wait_for(under_way.wait(), 10)
        for caller in callers:
            caller.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
        assert all(caller.cancelled() for caller in callers)
        go_on.set()
        again = await asyncio.gather(*(source.deliver(id=f"m-{t}", body=t) for t in tickets))
        assert [r.outcome for r in again] == [Outcome.DUPLICATE] * len(tickets)
        assert await effects(app) == {t: 1 for t in tickets}
    assert sorted(runs) == sorted(tickets)


@HANDED
async def test_a_batch_the_store_fails_under_retries_its_deliveries_later(database_url: str, handed: str) -> None:
    """No connection for the batch: nothing was decided, so every delivery of it comes back
    RETRY_LATER ("store_error"), whichever way it was handed over, and nothing ran."""
    app, source, runs = build(database_url, handed=handed)
    async with app.running():
        database = app.pipeline.stores.database
        real = database.connect

        def refused(**kwargs: object) -> object:
            raise OSError("the database went away")

        database.connect = refused  # type: ignore[method-assign]
        try:
            results = await asyncio.gather(*(source.deliver(id=f"m-{i}", body=f"good-{i}") for i in range(5)))
        finally:
            database.connect = real  # type: ignore[method-assign]
    assert [(r.outcome, r.reason) for r in results] == [(Outcome.RETRY, "store_error")] * 5
    assert runs == []
    if handed == "soon":
        assert isinstance(source, SoonSource) and source.taken == 5


async def test_soon_leaves_to_the_awaited_path_what_it_cannot_take(database_url: str) -> None:
    """``soon`` takes only a batched handler's keyable, timely deliveries of keys that never failed in a
    batch; everything else is refused untouched and goes the awaited way, which parks, runs alone or
    retries it as before."""
    app = app_for("soon", database_url, retry_attempts=1, max_deliveries=1)
    batched, single = SoonSource(namespace="soon", version=1), SoonSource(namespace="plain", version=1)

    @app.handler(batched, name="soon-batched", single_transaction=True, batch=Batch(max_size=8, max_wait_ms=5))
    async def handle(ctx: Context) -> None:
        if ctx.delivery.text() == "poison":
            raise TerminalError("never works", reason="poison")

    @app.handler(single, name="soon-single", single_transaction=True)
    async def handle_single(ctx: Context) -> None:
        return None

    async with app.running():
        assert (await single.deliver(id="p-1", body="x")).outcome is Outcome.PROCESSED
        assert single.taken == 0  # not batched

        assert (await batched.deliver(id=None, body="x")).outcome is Outcome.INVALID  # unkeyable: parked
        assert batched.taken == 0
        old = Delivery(id="late-1", body=b"x", sent_at=datetime.now(UTC) - timedelta(days=30))
        assert (await batched.deliver_delivery(old)).outcome is Outcome.DEAD_LETTERED  # late: parked
        assert batched.taken == 0

        assert (await batched.deliver(id="b-1", body="poison")).outcome is Outcome.DEAD_LETTERED
        assert batched.taken == 1  # taken, failed in its batch, then ran alone and was parked
        again = await batched.deliver(id="b-1", body="poison", attempt=2)
        assert (again.outcome, again.reason) == (Outcome.DUPLICATE, "already_dead_lettered")
        assert batched.taken == 1  # its key failed in a batch: the single-delivery path, awaited
        assert (await batched.deliver(id="b-2", body="fine")).outcome is Outcome.PROCESSED
        assert batched.taken == 2

    traced = ConsumerApp(make_settings(database_url))  # the suite's tracer: every delivery has a span
    source = SoonSource(namespace="soon-traced", version=1)
    traced.handler(source, name="soon-traced", single_transaction=True, batch=Batch(max_size=8, max_wait_ms=5))(handle)
    async with traced.running():
        assert (await source.deliver(id="t-1", body="fine")).outcome is Outcome.PROCESSED
        assert source.taken == 0  # traced: its span is current in a task of its own


async def test_stop_finishes_the_batches_soon_handed_over(database_url: str) -> None:
    """Deliveries handed over with ``soon`` are no tasks the shutdown could wait for: it runs what is
    gathered and waits for the batches, and every delivery is told its result."""
    app = app_for("soon", database_url)
    source = SoonSource(namespace="stopping", version=1)

    @app.handler(source, name="stopping", single_transaction=True, batch=Batch(max_size=64, max_wait_ms=60_000))
    async def handle(ctx: Context) -> None:
        await ctx.db.execute(text("INSERT INTO batch_effects (ticket) VALUES (:t)"), {"t": ctx.delivery.text()})

    told: list[Result | None] = []
    await app.start()
    try:
        await prepare(app)
        for i in range(5):  # gathering: the batch would wait a minute for more
            assert source.soon(Delivery(id=f"s-{i}", body=f"s-{i}".encode()), told.append)
        await asyncio.sleep(0.05)
        assert told == []
        seen_before_stop = await effects(app)
    finally:
        await app.stop(grace=10)
    assert seen_before_stop == {}
    assert [r.outcome if r is not None else None for r in told] == [Outcome.PROCESSED] * 5
    async with ConsumerApp(make_settings(database_url)).running() as again:
        assert await effects(again) == {f"s-{i}": 1 for i in range(5)}


def test_a_batch_needs_a_single_transaction_handler() -> None:
    app = ConsumerApp(make_settings("sqlite+aiosqlite:///:memory:"))
    with pytest.raises(ConfigurationError, match="single_transaction"):
        app.handler(InMemorySource(namespace="b", version=1), batch=Batch())
    with pytest.raises(ValueError, match="between 1 and 64"):
        Batch(max_size=65)
    with pytest.raises(ValueError, match="max_concurrent"):
        Batch(max_concurrent=0)
