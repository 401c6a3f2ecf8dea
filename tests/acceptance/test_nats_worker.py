"""The NATS example worker as a user runs it (``consumer-kit run examples.nats_worker:app``) against the
local JetStream server and PostgreSQL: orders published with duplicates (the same ``Nats-Msg-Id`` again,
after the stream's duplicate window, so that it reaches the worker), the worker SIGKILLed mid-stream and
started again (the run itself: :mod:`tests.acceptance.example_workers`); then every order is recorded
once, every announcement is in the events stream under one id each, the durable consumer holds nothing,
and a worker started with ``--port`` is ready and counts a late duplicate in ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from examples import nats_worker
from tests.acceptance.example_workers import Worker, assert_announced_once, kill_and_restart, rows, served
from tests.acceptance.test_worker_port import sample
from tests.conftest import TEST_HMAC_KEY
from tests.integration.nats_env import (
    DUPLICATE_WINDOW,
    NATS_URL,
    Stream,
    connected,
    consumer_state,
    own_stream,
    publish,
)
from tests.integration.rabbit import wait_until

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

ORDERS = 600
DURABLE = "consumer-kit-nats-orders"  # the example's namespace, as the source names its durable consumer


@pytest.fixture
async def streams() -> AsyncIterator[tuple[Stream, Stream]]:
    """The orders stream and the events stream, both the test's own (init finds the events one and keeps it)."""
    async with own_stream(prefix="ck-orders") as orders, own_stream(prefix="ck-events") as events:
        yield orders, events


def order(i: int) -> tuple[str, bytes]:
    return f"order-{i:05d}", json.dumps({"order": f"O-{i}", "amount": i}).encode()


async def publish_with_duplicates(orders: Stream) -> None:
    """Every order, then every fifth again once the duplicate window has passed: a redelivery from outside."""
    await publish(orders, [order(i) for i in range(ORDERS)])
    await asyncio.sleep(DUPLICATE_WINDOW * 3)
    await publish(orders, [order(i) for i in range(0, ORDERS, 5)])


async def announcements(events: Stream) -> dict[str, set[bytes]]:
    """The events stream's messages: the bodies under each ``Nats-Msg-Id`` (the outbox row id)."""
    by_id: dict[str, set[bytes]] = {}
    async with connected() as client:
        js = client.jetstream()
        subscription = await js.pull_subscribe(events.subject, stream=events.name)  # an ephemeral reader
        while True:
            try:
                batch = await subscription.fetch(500, timeout=1)
            except TimeoutError:
                return by_id
            for message in batch:
                by_id.setdefault((message.headers or {}).get("Nats-Msg-Id", ""), set()).add(message.data)
                await message.ack()


async def test_sigkill_mid_stream_then_restart_records_each_order_once(
        pg_database: str, streams: tuple[Stream, Stream], tmp_path: Path) -> None:
    orders, events = streams
    env = dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY, NATS_URL=NATS_URL,
               ORDERS_STREAM=orders.name, ORDERS_SUBJECT=orders.subject, EVENTS_STREAM=events.name,
               EVENTS_SUBJECT=f"{events.prefix}.recorded", ORDERS_ACK_WAIT_SECONDS="3", INBOX_LEASE_SECONDS="2",
               DB_POOL_SIZE="5", OUTBOX_POLL_SECONDS="0.2", SHUTDOWN_GRACE_SECONDS="10")
    worker = Worker("nats_worker", env, tmp_path / "worker.log")
    await worker.init()

    async def held() -> int:
        return sum(await consumer_state(orders, DURABLE))  # not delivered yet + delivered and not acked

    await kill_and_restart(worker, pg_database, orders=ORDERS, publish=lambda: publish_with_duplicates(orders),
                           depth=held, kill_after=150, finish_seconds=60)
    assert_announced_once(await announcements(events), ORDERS)
    assert await consumer_state(orders, DURABLE) == (0, 0)

    # Started again with --port: ready, and a late copy of an order is a counted duplicate, not a new row.
    source = f"nats:{orders.name}/{DURABLE}"
    async with served("nats_worker", env) as client:
        await publish(orders, [order(7)])

        async def counted() -> bool:
            text = (await client.get("/metrics")).text
            return sample(text, "consumer_kit_deliveries_total", outcome="duplicate", source=source) == 1.0 \
                and sample(text, "consumer_kit_nats_settlements_total", action="ack", source=source) == 1.0

        await wait_until(counted, 15, "/metrics to count the late copy as a duplicate, acknowledged")
        text = (await client.get("/metrics")).text
        assert sample(text, "consumer_kit_nats_settlements_total", action="nak", source=source) == 0.0
        assert sample(text, "consumer_kit_nats_settlements_total", action="term", source=source) == 0.0
    assert await consumer_state(orders, DURABLE) == (0, 0)
    assert await rows(pg_database, nats_worker.orders) == ORDERS
