"""The Redis example worker as a user runs it (``consumer-kit run examples.redis_worker:app``) against the
local Redis and PostgreSQL: orders added with duplicates (the same ``message-id`` in a second entry), the
worker SIGKILLed mid-stream and started again under another consumer name, which takes over what the
killed one held once it sat idle (the run itself: :mod:`tests.acceptance.example_workers`); then every
order is recorded once, every announcement is in the events stream under one ``message-id`` each,
``XPENDING`` is 0, and a worker started with ``--port`` is ready and counts a late duplicate in ``/metrics``."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest
import redis.asyncio

from consumer_kit.sources.redis import MESSAGE_ID_FIELD
from examples import redis_worker
from tests.acceptance.example_workers import Worker, assert_announced_once, kill_and_restart, rows, served
from tests.acceptance.test_worker_port import sample
from tests.conftest import TEST_HMAC_KEY
from tests.integration.rabbit import wait_until
from tests.integration.redis_env import GROUP, REDIS_URL, pending_count, text, unique_stream, unread

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
        rows = cast(list[tuple[bytes, dict[bytes, bytes]]], await client.xrange(events))
        for _, fields in rows:
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
    assert_announced_once(await announcements(events), ORDERS)
    assert await pending_count(orders) == 0

    # Started again with --port: ready, and a late copy of an order is a counted duplicate, not a new row.
    source = f"redis:{orders}"
    async with served("redis_worker", env) as client:
        await add(orders, range(7, 8))

        async def counted() -> bool:
            text = (await client.get("/metrics")).text
            return sample(text, "consumer_kit_deliveries_total", outcome="duplicate", source=source) == 1.0

        await wait_until(counted, 15, "/metrics to count the late copy as a duplicate")
        text = (await client.get("/metrics")).text
        for series in ("consumer_kit_redis_claimed_total", "consumer_kit_redis_trimmed_total",
                       "consumer_kit_redis_lost_total"):
            assert sample(text, series, source=source) == 0.0, series
    assert await pending_count(orders) == 0
    assert await rows(pg_database, redis_worker.orders) == ORDERS
