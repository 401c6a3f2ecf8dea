"""The Redis example worker as a user runs it (``consumer-kit run examples.redis_worker:app``) against the
local Redis and PostgreSQL: orders added with duplicates (the same ``message-id`` in a second entry), the
worker SIGKILLed mid-stream and started again under another consumer name, which takes over what the
killed one held once it sat idle (the run itself: :mod:`tests.acceptance.example_workers`); then every
order is recorded once, every announcement is in the events stream under one ``message-id`` each,
``XPENDING`` is 0, and a worker started with ``--port`` is ready and counts a late duplicate in ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio
from sqlalchemy import func, select

from consumer_kit import ConsumerApp
from consumer_kit.sources.redis import MESSAGE_ID_FIELD
from consumer_kit.testing.server import free_port
from examples import redis_worker
from tests.acceptance.example_workers import Worker, kill_and_restart
from tests.acceptance.test_nats_worker import serve
from tests.acceptance.test_worker_port import sample
from tests.conftest import TEST_HMAC_KEY, make_settings
from tests.integration.rabbit import wait_until
from tests.integration.redis_env import GROUP, REDIS_URL, pending_count, text, unique_stream, unread
from tests.processes import stop_cleanly, wait_until_served

pytestmark = [pytest.mark.redis, pytest.mark.postgres]

ORDERS = 400


@pytest.fixture
async def streams() -> AsyncIterator[tuple[str, str]]:
    """The orders stream and the events stream, both the test's own and deleted after."""
    async with unique_stream(prefix="ck-orders") as orders, unique_stream(prefix="ck-events") as events:
        yield orders, events


async def add(stream: str, numbers: range) -> None:
    """``XADD`` the orders ``numbers``, each with its ``message-id`` (the key) and its JSON ``body``."""
    async with redis.asyncio.Redis.from_url(REDIS_URL) as client, client.pipeline(transaction=False) as pipe:
        for i in numbers:
            pipe.xadd(stream, {MESSAGE_ID_FIELD: f"order-{i:05d}",
                               "body": json.dumps({"order": f"O-{i}", "amount": i})})
        await pipe.execute()


async def add_with_duplicates(stream: str) -> None:
    """Every order, then every fifth again: a producer that added the same work twice."""
    await add(stream, range(ORDERS))
    await add(stream, range(0, ORDERS, 5))


async def announcements(events: str) -> dict[str, set[bytes]]:
    """The events stream's entries: the bodies under each ``message-id`` (the outbox row id)."""
    by_id: dict[str, set[bytes]] = {}
    async with redis.asyncio.Redis.from_url(REDIS_URL) as client:
        for _, fields in await client.xrange(events):
            by_id.setdefault(text(fields[MESSAGE_ID_FIELD.encode()]), set()).add(fields[b"body"])
    return by_id


async def test_sigkill_mid_stream_then_restart_records_each_order_once(
        pg_database: str, streams: tuple[str, str], tmp_path: Path) -> None:
    orders, events = streams
    env = dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY, REDIS_URL=REDIS_URL,
               ORDERS_STREAM=orders, ORDERS_GROUP=GROUP, EVENTS_STREAM=events, ORDERS_CLAIM_IDLE_SECONDS="3",
               INBOX_LEASE_SECONDS="2", DB_POOL_SIZE="5", OUTBOX_POLL_SECONDS="0.2", SHUTDOWN_GRACE_SECONDS="10")
    worker = Worker("redis_worker", env, tmp_path / "worker.log")
    await worker.init()

    async def held() -> int:
        return await pending_count(orders) + await unread(orders)

    await kill_and_restart(worker, pg_database, orders=ORDERS, publish=lambda: add_with_duplicates(orders),
                           depth=held, kill_after=100, finish_seconds=60)
    by_id = await announcements(events)
    assert {json.loads(body)["order"] for bodies in by_id.values() for body in bodies} == {
        f"O-{i}" for i in range(ORDERS)}
    # A repeat can only be a row the killed relay had added but not recorded: same id, same body.
    assert len(by_id) == ORDERS and all(len(bodies) == 1 for bodies in by_id.values())
    assert await pending_count(orders) == 0

    # Started again with --port: ready, and a late copy of an order is a counted duplicate, not a new row.
    port = free_port()
    served = serve("redis_worker", env, port)
    source = f"redis:{orders}"
    try:
        await asyncio.to_thread(wait_until_served, served, f"http://127.0.0.1:{port}/readyz")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            assert (await client.get("/readyz")).json() == {"ready": True}
            await add(orders, range(7, 8))

            async def counted() -> bool:
                text = (await client.get("/metrics")).text
                return sample(text, "consumer_kit_deliveries_total", outcome="duplicate", source=source) == 1.0

            await wait_until(counted, 15, "/metrics to count the late copy as a duplicate")
            text = (await client.get("/metrics")).text
            for series in ("consumer_kit_redis_claimed_total", "consumer_kit_redis_trimmed_total",
                           "consumer_kit_redis_lost_total"):
                assert sample(text, series, source=source) == 0.0, series
    finally:
        await asyncio.to_thread(stop_cleanly, served)
    assert await pending_count(orders) == 0
    observer = ConsumerApp(make_settings(pg_database, db_pool_size=1))
    async with observer.running(), observer.engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(redis_worker.orders))).scalar_one() == ORDERS
