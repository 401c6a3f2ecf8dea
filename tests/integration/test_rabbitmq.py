"""RabbitMQSource against the real broker and PostgreSQL: dedup at volume, dead letters, a broker-side
close, and two workers sharing a queue."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, distinct, func, select

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.rabbitmq import NO_ID_HEADER, REASON_HEADER, RabbitMQSource
from tests.conftest import make_settings
from tests.integration.rabbit import (
    AMQP_URL,
    close_connections_named,
    delete_queues,
    depth,
    drain,
    publish,
    publish_without_id,
    wait_until,
)

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]

effects_metadata = MetaData()
effects = Table(
    "rabbit_effects", effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("message", String(100), nullable=False),
    Column("worker", String(20), nullable=False),
)


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-test-{secrets.token_hex(4)}"
    yield name
    await delete_queues(name)


@pytest.fixture
async def pg(pg_database: str) -> str:
    settings = make_settings(pg_database)
    app = ConsumerApp(settings)
    async with app.running():
        async with app.engine.begin() as conn:
            await conn.run_sync(effects_metadata.drop_all)
            await conn.run_sync(effects_metadata.create_all)
    return pg_database


def worker(settings: Settings, queue: str, tag: str, *, prefetch: int = 32,
           single_transaction: bool = False) -> tuple[ConsumerApp, RabbitMQSource]:
    app = ConsumerApp(settings)
    source = RabbitMQSource(queue=queue, namespace="orders", version=1, url=AMQP_URL,
                            name=f"{queue}-{tag}", retry_delays=(0.2, 0.5), prefetch=prefetch)

    @app.handler(source, name="rabbit-test", single_transaction=single_transaction)
    async def handle(ctx: Context) -> None:
        await ctx.db.execute(effects.insert().values(message=ctx.delivery.text(), worker=tag))

    return app, source


async def counts(app: ConsumerApp) -> tuple[int, int]:
    async with app.engine.connect() as conn:
        row = (await conn.execute(select(func.count(), func.count(distinct(effects.c.message))))).one()
    return int(row[0]), int(row[1])


async def test_four_thousand_with_duplicates(pg: str, queue: str) -> None:
    """Many at once on the single-transaction path (the chaos command runs 10,000 under faults)."""
    ids = [f"order-{i:05d}" for i in range(4000)]
    messages = [(i, i.encode()) for i in ids] + [(i, i.encode()) for i in ids[::10]]  # 10% twice
    # The single-transaction path, the fast one for handlers whose only effect is in the database.
    app, _ = worker(make_settings(pg, db_pool_size=10), queue, "a", prefetch=100, single_transaction=True)
    async with app.running():
        await publish(queue, messages)

        async def done() -> bool:
            return (await counts(app))[0] >= 4000 and await depth(queue) == 0

        await wait_until(done, 90, "4,000 effects")
        await asyncio.sleep(0.3)  # let any stray duplicate land, had there been one
        assert await counts(app) == (4000, 4000)
    # The consumer is gone: anything it had left unacknowledged would be back in the queue now.
    assert await depth(queue) == 0
    assert await depth(f"{queue}.dlq") == 0


async def test_missing_message_id_is_dead_lettered(pg: str, queue: str) -> None:
    app, _ = worker(make_settings(pg, db_pool_size=5), queue, "a")
    async with app.running():
        await publish(queue, [("has-id-1", b"fine")])
        await publish_without_id(queue, [b"no-id-1", b"no-id-2"])

        async def parked() -> bool:
            return await depth(f"{queue}.dlq") == 2 and (await counts(app))[0] == 1

        await wait_until(parked, 20, "two dead letters")
        letters = await app.dead_letters.list(reason="missing_stable_id")
        assert sorted(letter.body for letter in letters) == [b"no-id-1", b"no-id-2"]
        assert all(letter.key_digest is None for letter in letters)
    assert await depth(queue) == 0
    dlq = await drain(f"{queue}.dlq")
    assert sorted(m.body for m in dlq) == [b"no-id-1", b"no-id-2"]
    assert all((m.headers or {})[REASON_HEADER] == "missing_stable_id" for m in dlq)
    # aiormq gives every publish a random message_id; the copy says the original had none.
    assert all((m.headers or {})[NO_ID_HEADER] == 1 for m in dlq)


async def test_a_message_that_cannot_be_read_is_dead_lettered_not_held(pg: str, queue: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a message into a delivery raises nowhere we know of; if it did, the message would be held
    unacked and fail again on every redelivery. It is dead-lettered with its reason instead."""
    import consumer_kit.sources.rabbitmq.source as rabbitmq  # the source's reader, where it calls it

    real = rabbitmq.to_delivery

    def to_delivery(message: Any, replays: Any = None) -> Any:
        if message.message_id == "broken-1":
            raise ValueError("a field nobody expected")
        return real(message, replays)

    monkeypatch.setattr(rabbitmq, "to_delivery", to_delivery)
    app, _ = worker(make_settings(pg, db_pool_size=5), queue, "a")
    async with app.running():
        await publish(queue, [("fine-1", b"fine"), ("broken-1", b"broken")])

        async def settled() -> bool:
            return await depth(f"{queue}.dlq") == 1 and (await counts(app))[0] == 1

        await wait_until(settled, 20, "one processed, one dead-lettered")
    assert await depth(queue) == 0
    dlq = await drain(f"{queue}.dlq")
    assert [(m.body, (m.headers or {})[REASON_HEADER]) for m in dlq] == [(b"broken", "unreadable")]


async def test_recovers_after_the_broker_closes_the_connection(pg: str, queue: str) -> None:
    app, source = worker(make_settings(pg, db_pool_size=5), queue, "a", prefetch=16)
    async with app.running():
        await publish(queue, [(f"m-{i:04d}", f"m-{i:04d}".encode()) for i in range(300)])

        async def some() -> bool:
            return (await counts(app))[0] >= 50

        await wait_until(some, 20, "the first effects")
        assert await asyncio.to_thread(close_connections_named, source.name) == 1
        await publish(queue, [(f"m-{i:04d}", f"m-{i:04d}".encode()) for i in range(300, 600)])

        async def all_done() -> bool:
            return (await counts(app))[1] == 600 and await depth(queue) == 0

        await wait_until(all_done, 60, "all 600 effects after the reconnect")
        await asyncio.sleep(0.3)
        assert await counts(app) == (600, 600)
    assert await depth(queue) == 0


def cut_while_declaring(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Have the broker close the connection named ``name`` while the first queue declaration is in
    flight (declaring over and over until the close went through); returns the list the number of
    connections closed is appended to. Patches aio-pika's public ``RobustChannel.declare_queue``."""
    declare, cuts = aio_pika.RobustChannel.declare_queue, []

    async def declare_during_a_cut(self: aio_pika.RobustChannel, *args: Any, **kwargs: Any) -> Any:
        if not cuts:
            cut = asyncio.ensure_future(asyncio.to_thread(close_connections_named, name))
            try:
                while not cut.done():
                    await declare(self, *args, **kwargs)
            finally:
                cuts.append(await cut)
        return await declare(self, *args, **kwargs)

    monkeypatch.setattr(aio_pika.RobustChannel, "declare_queue", declare_during_a_cut)
    return cuts


async def test_a_broker_cut_during_start_up_is_connected_again(pg: str, queue: str, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The broker closes the source's connection while it sets up its queues (a restart, an operator),
    with calls in flight: the start-up opens a new connection and goes on, instead of ending the worker
    (without the retry, aiormq's cancellation of the calls in flight ended the start-up)."""
    app, source = worker(make_settings(pg, db_pool_size=5), queue, "a")
    cuts = cut_while_declaring(monkeypatch, source.name)
    with caplog.at_level(logging.WARNING, logger="consumer_kit.sources.rabbitmq"):
        async with app.running():
            await publish(queue, [(f"c-{i}", f"c-{i}".encode()) for i in range(20)])

            async def done() -> bool:
                return (await counts(app))[1] == 20 and await depth(queue) == 0

            await wait_until(done, 30, "20 effects after the cut")
    assert cuts == [1]
    assert "the broker closed the connection during start-up" in caplog.text


@pytest.mark.parametrize("when", ["waiting to connect again", "declaring"])
async def test_a_cancelled_start_up_ends_cancelled_and_leaves_no_connection(
        pg: str, queue: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, when: str) -> None:
    """A stop signal during start-up cancels it. Cancelled in the wait after a broker cut, or while a
    queue declaration is in flight (where aiormq's own cancellations are taken for the broker's), the
    start-up ends with the cancellation, and leaves no connection open to the broker or the database."""
    app, source = worker(make_settings(pg, db_pool_size=5), queue, "a")
    starting: asyncio.Future[None] | None = None
    if when == "declaring":
        declare = aio_pika.RobustChannel.declare_queue

        async def cancelled_while_declaring(self: aio_pika.RobustChannel, *args: Any, **kwargs: Any) -> Any:
            assert starting is not None
            starting.cancel()
            return await declare(self, *args, **kwargs)

        monkeypatch.setattr(aio_pika.RobustChannel, "declare_queue", cancelled_while_declaring)
    else:
        cut_while_declaring(monkeypatch, source.name)
    with caplog.at_level(logging.WARNING, logger="consumer_kit.sources.rabbitmq"):
        starting = asyncio.ensure_future(app.start())
        if when != "declaring":
            while "connecting again" not in caplog.text:
                assert not starting.done(), starting
                await asyncio.sleep(0.01)
            starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
    assert await asyncio.to_thread(close_connections_named, source.name) == 0
    with pytest.raises(RuntimeError, match="not started"):  # the start-up's stop disposed of the engine
        _ = app.engine


async def test_two_workers_share_a_queue(pg: str, queue: str) -> None:
    app1, _ = worker(make_settings(pg, db_pool_size=5), queue, "one", prefetch=8)
    app2, _ = worker(make_settings(pg, db_pool_size=5), queue, "two", prefetch=8)
    async with app1.running(), app2.running():
        await publish(queue, [(f"w-{i:04d}", f"w-{i:04d}".encode()) for i in range(1_000)])

        async def done() -> bool:
            return (await counts(app1))[0] >= 1_000 and await depth(queue) == 0

        await wait_until(done, 60, "1,000 effects")
        async with app1.engine.connect() as conn:
            per_worker = dict((await conn.execute(
                select(effects.c.worker, func.count()).group_by(effects.c.worker))).all())
        assert await counts(app1) == (1_000, 1_000)
    assert per_worker.get("one", 0) > 0 and per_worker.get("two", 0) > 0
    assert await depth(queue) == 0


async def test_retry_later_goes_through_the_retry_queue(pg: str, queue: str) -> None:
    settings = make_settings(pg, db_pool_size=5, retry_attempts=1, retry_later_seconds=0.1)
    app = ConsumerApp(settings)
    source = RabbitMQSource(queue=queue, namespace="orders", version=1, url=AMQP_URL, retry_delays=(0.2, 0.4))
    attempts: list[int] = []

    @app.handler(source)
    async def flaky(ctx: Context) -> None:
        attempts.append(ctx.delivery.attempt)
        if len(attempts) < 3:
            raise ConnectionError("downstream down")
        await ctx.db.execute(effects.insert().values(message=ctx.delivery.text(), worker="r"))

    async with app.running():
        await publish(queue, [("retry-me-1", b"retry-me-1")])

        async def done() -> bool:
            return (await counts(app))[0] == 1

        await wait_until(done, 20, "the third attempt to succeed")
    assert attempts == [1, 2, 3]
    assert await depth(queue) == 0 and await depth(f"{queue}.retry.200ms") == 0


async def test_passive_check_reports_missing_queues(queue: str, sqlite_url: str) -> None:
    app = ConsumerApp(make_settings(sqlite_url))
    source = RabbitMQSource(queue=queue, namespace="orders", version=1, url=AMQP_URL, declare=False)

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        pass

    from consumer_kit import ConfigurationError

    with pytest.raises(ConfigurationError, match="missing"):
        await app.start()


@pytest.mark.parametrize("path", ["two-txn", "one-txn", "batch"])
async def test_a_connection_cut_lets_running_deliveries_finish(pg: str, queue: str, path: str) -> None:
    """The broker closes the connection while a handler runs: the delivery is not cancelled, it
    commits; its ack went with the channel, so the redelivery is acknowledged as a duplicate. (Batched
    and untraced, the source hands deliveries over with ``soon``: the batch's own task runs them.)"""
    from opentelemetry import trace

    from consumer_kit import Batch

    app = ConsumerApp(make_settings(pg), tracer_provider=trace.NoOpTracerProvider() if path == "batch" else None)
    source = RabbitMQSource(queue=queue, namespace="orders", version=1, url=AMQP_URL, name=f"{queue}-cut",
                            retry_delays=(0.2,), prefetch=4)
    entered, release = asyncio.Event(), asyncio.Event()
    runs: list[str] = []

    @app.handler(source, name="rabbit-cut", single_transaction=path != "two-txn",
                 batch=Batch(max_size=4, max_wait_ms=5) if path == "batch" else None)
    async def handle(ctx: Context) -> None:
        runs.append(ctx.delivery.text())
        entered.set()
        await release.wait()
        await ctx.db.execute(effects.insert().values(message=ctx.delivery.text(), worker="cut"))

    async with app.running():
        await publish(queue, [("cut-1", b"order-cut-1")])
        await asyncio.wait_for(entered.wait(), 10)
        assert close_connections_named(f"{queue}-cut") >= 1
        await asyncio.sleep(0.5)  # the channel is gone while the handler still runs
        release.set()

        async def settled() -> bool:
            return await counts(app) == (1, 1) and await depth(queue) == 0

        await wait_until(settled, 20, "the effect committed once and the queue empty")
    assert runs == ["order-cut-1"]  # the redelivery did not run the handler again


async def test_batches_of_64_isolate_poison_and_flaky_messages(pg: str, queue: str) -> None:
    """10,000 messages in batches of 64, 1% poison (TerminalError) and 1% flaky (fails once): every
    good message's effect once, every poison one parked with its reason, and no other redelivered.
    Untraced, as a worker without an OpenTelemetry SDK runs: the source hands deliveries to their
    batches with ``soon``, the path such a worker takes."""
    from opentelemetry import trace

    from consumer_kit import Batch, TerminalError

    app = ConsumerApp(make_settings(pg, db_pool_size=4), tracer_provider=trace.NoOpTracerProvider())
    source = RabbitMQSource(queue=queue, namespace="orders", version=1, url=AMQP_URL, name=f"{queue}-batch",
                            retry_delays=(0.2,), prefetch=256)
    redelivered: list[str] = []
    flaked: set[str] = set()

    @app.handler(source, name="rabbit-batch", single_transaction=True, batch=Batch(max_size=64, max_wait_ms=5))
    async def handle(ctx: Context) -> None:
        body = ctx.delivery.text()
        if ctx.delivery.attempt > 1:
            redelivered.append(body)
        await ctx.db.execute(effects.insert().values(message=body, worker="batch"))
        if body.endswith("-poison"):
            raise TerminalError("poison", reason="poison")
        if body.endswith("-flaky") and body not in flaked:
            flaked.add(body)
            raise ConnectionError("once")

    def body(i: int) -> str:
        return f"order-{i}" + ("-poison" if i % 100 == 7 else "-flaky" if i % 100 == 13 else "")

    async with app.running():
        await publish(queue, [(f"b-{i}", body(i).encode()) for i in range(10_000)])

        async def settled() -> bool:
            return await depth(queue) == 0 and (await counts(app))[1] == 9_900

        await wait_until(settled, 120, "every good message recorded and the queue empty")
        assert await counts(app) == (9_900, 9_900)  # each good effect once; poison ones rolled back
        assert await app.dead_letters.count(reason="poison") == 100
    assert [m.headers.get(REASON_HEADER) for m in await drain(f"{queue}.dlq")] == ["poison"] * 100
    assert redelivered == []  # isolated in process: no neighbour went back to the broker
