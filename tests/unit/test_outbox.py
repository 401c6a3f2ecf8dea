"""The outbox and its relay on SQLite, with a publisher double: rows commit with the handler, ids are
stable across re-runs, and the relay publishes, backs off, reports and sweeps."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from consumer_kit import (
    ConsumerApp,
    Context,
    KeyDigester,
    OperationKey,
    RetryableError,
    Settings,
    TerminalError,
    metrics,
)
from consumer_kit.outbox import OutboxMessage, OutboxRelay, Publisher
from consumer_kit.testing import InMemorySource
from tests.conftest import TEST_HMAC_KEY, make_settings


class RecordingPublisher:
    """A publisher double: records what it is given, or fails while ``down`` is set."""

    def __init__(self) -> None:
        self.sent: list[OutboxMessage] = []
        self.down = False

    async def publish(self, message: OutboxMessage) -> None:
        if self.down:
            raise ConnectionError("broker unreachable")
        self.sent.append(message)

    async def close(self) -> None:
        pass


@pytest.fixture
def settings(sqlite_url: str) -> Iterator[Settings]:
    yield make_settings(sqlite_url, outbox_backoff_seconds=0.05, outbox_backoff_max_seconds=0.1,
                        outbox_poll_seconds=0.05)


def expected_id(consumer: str, key: OperationKey, position: int) -> str:
    return KeyDigester(TEST_HMAC_KEY.encode()).digest(f"outbox:{consumer}:{position}:{key}")


def test_publisher_double_fits_the_protocol() -> None:
    assert isinstance(RecordingPublisher(), Publisher)


async def test_rows_commit_with_the_handler_and_ids_are_stable(settings: Settings) -> None:
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="orders", version=1)
    published: list[list[str]] = []
    fail_first = {"left": 1}

    @app.handler(source, name="orders")
    async def handle(ctx: Context) -> None:
        ids = [ctx.outbox.publish("events", b"one", headers={"h": "1"}), ctx.outbox.publish("events", "two")]
        published.append(ids)
        if ctx.delivery.json().get("reject"):
            raise TerminalError("rejected", reason="rejected")
        if fail_first["left"]:
            fail_first["left"] -= 1
            raise RetryableError("try again", delay=0)

    async with app.running():
        assert (await source.deliver(id="order-0001", body=b"{}")).outcome.value == "retry"
        assert (await app.outbox.stats()).pending == 0
        assert (await source.deliver(id="order-0001", body=b"{}", attempt=2)).outcome.value == "processed"
        await source.deliver(id="order-0002", body=b'{"reject": true}')
        key = OperationKey("orders", 1, "order-0001")
        assert published[0] == published[1] == [expected_id("orders", key, 0), expected_id("orders", key, 1)]
        rows = [await app.outbox.get(i) for i in published[1]]
        assert [r["body"] for r in rows if r] == [b"one", b"two"]
        assert rows[0] is not None and rows[0]["headers"].pop("traceparent").startswith("00-")  # the suite traces
        assert rows[0]["headers"] == {"h": "1"}
        assert await app.outbox.get(published[2][0]) is None  # the rejected handler's rows rolled back
        assert (await app.outbox.stats()).pending == 2


async def test_enqueue_outside_a_handler_follows_the_callers_transaction(settings: Settings) -> None:
    app = ConsumerApp(settings)
    async with app.running():
        async with app.engine.connect() as conn:
            session = AsyncSession(bind=conn)
            async with conn.begin():
                kept = await app.outbox.enqueue(session, "events", b"kept", message_id="m-kept")
            transaction = await conn.begin()
            lost = await app.outbox.enqueue(session, "events", b"lost")
            await transaction.rollback()
            await session.close()
        assert kept == "m-kept" and await app.outbox.get(kept) is not None
        assert await app.outbox.get(lost) is None


async def test_relay_publishes_backs_off_and_recovers(settings: Settings) -> None:
    # A row's backoff long enough (1 s) that a busy host still asks again before it is due.
    app = ConsumerApp(settings.model_copy(update={"outbox_backoff_seconds": 0.5, "outbox_backoff_max_seconds": 1.0}))
    publisher = RecordingPublisher()
    async with app.running():
        async with app.engine.begin() as conn:
            ids = [await app.outbox.enqueue(conn, "events", f"m{i}") for i in range(5)]
        relay = OutboxRelay(app.outbox, publisher, app.settings)
        publisher.down = True
        assert await relay.run_once() == (0, 5)
        row = await app.outbox.get(ids[0])
        assert row is not None and row["attempts"] == 1 and "unreachable" in row["last_error"]
        assert await relay.run_once() == (0, 0)  # backed off: nothing is due yet
        stats = await relay.update_metrics()
        assert stats.pending == 5 and metrics.OUTBOX_PENDING._value.get() == 5
        publisher.down = False
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        for _ in range(500):
            if len(publisher.sent) == 5:
                break
            await asyncio.sleep(0.02)
        stop.set()
        await task
        assert sorted(m.id for m in publisher.sent) == sorted(ids)
        assert (await app.outbox.stats()).pending == 0
        assert await app.outbox.sweep(0) == 5
        assert await app.outbox.get(ids[0]) is None


async def test_app_runs_the_relay(settings: Settings) -> None:
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="orders", version=1)
    publisher = RecordingPublisher()
    app.relay_outbox(publisher)

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        ctx.outbox.publish("events", ctx.delivery.body)

    async with app.running():
        await source.deliver(id="order-0003", body=b"x")
        for _ in range(100):
            if publisher.sent:
                break
            await asyncio.sleep(0.02)
    assert [m.body for m in publisher.sent] == [b"x"]
    assert publisher.sent[0].destination == "events"
