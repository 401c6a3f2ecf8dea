"""The example worker as a user runs it (``consumer-kit run examples.rabbitmq_worker:app``): killed with
SIGKILL mid-stream and started again, it records every order once and announces each once (by id);
SIGTERM drains it and it exits 0 (the run itself: :mod:`tests.acceptance.example_workers`)."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.acceptance.example_workers import Worker, kill_and_restart
from tests.conftest import TEST_HMAC_KEY
from tests.integration.rabbit import AMQP_URL, declare, delete_queues, depth, drain, publish

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]

ORDERS = 1_500


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-test-{secrets.token_hex(4)}"
    yield name
    await delete_queues(name)


async def test_sigkill_mid_stream_then_restart_records_each_order_once(
        pg_database: str, queue: str, tmp_path: Path) -> None:
    env = dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY,
               RABBITMQ_URL=AMQP_URL, ORDERS_QUEUE=queue, EVENTS_QUEUE=f"{queue}.events",
               INBOX_LEASE_SECONDS="2", DB_POOL_SIZE="5", OUTBOX_POLL_SECONDS="0.2",
               SHUTDOWN_GRACE_SECONDS="10")
    worker = Worker("rabbitmq_worker", env, tmp_path / "worker.log")
    await worker.init()
    await declare(queue)  # before publishing: the default exchange drops what it cannot route
    orders = [(f"order-{i:05d}", json.dumps({"order": f"O-{i}", "amount": i}).encode()) for i in range(ORDERS)]

    async def queued() -> int:
        return await depth(queue)

    await kill_and_restart(worker, pg_database, orders=ORDERS, publish=lambda: publish(queue, orders), depth=queued,
                           kill_after=200, finish_seconds=90)
    events = await drain(f"{queue}.events")
    announced = {json.loads(m.body)["order"] for m in events}
    assert announced == {f"O-{i}" for i in range(ORDERS)}
    # A repeat can only be a row the killed relay had confirmed but not recorded: same id, same body.
    by_id: dict[str, set[bytes]] = {}
    for message in events:
        by_id.setdefault(message.message_id or "", set()).add(message.body)
    assert len(by_id) == ORDERS and all(len(bodies) == 1 for bodies in by_id.values())
