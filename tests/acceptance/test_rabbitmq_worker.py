"""The example worker as a user runs it (``consumer-kit run examples.rabbitmq_worker:app``): killed with
SIGKILL mid-stream and started again, it records every order once and announces each once (by id);
SIGTERM drains it and it exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import distinct, func, select

from consumer_kit import ConsumerApp
from tests.conftest import TEST_HMAC_KEY, make_settings
from tests.integration.rabbit import AMQP_URL, declare, delete_queues, depth, drain, publish, wait_until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]
ORDERS = 1_500


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-test-{secrets.token_hex(4)}"
    yield name
    await delete_queues(name)


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    command = [str(Path(sys.executable).with_name("consumer-kit")), "--log-level", "WARNING",
               "run", "examples.rabbitmq_worker:app"]
    with log.open("ab") as output:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output)


async def test_sigkill_mid_stream_then_restart_records_each_order_once(
        pg_database: str, queue: str, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    env = dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY,
               RABBITMQ_URL=AMQP_URL, ORDERS_QUEUE=queue, EVENTS_QUEUE=f"{queue}.events",
               INBOX_LEASE_SECONDS="2", DB_POOL_SIZE="5", OUTBOX_POLL_SECONDS="0.2",
               SHUTDOWN_GRACE_SECONDS="10")
    init = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "examples.rabbitmq_worker", "init"], cwd=ROOT, env=env,
        capture_output=True, timeout=60)
    assert init.returncode == 0, init.stderr.decode()
    await declare(queue)  # before publishing: the default exchange drops what it cannot route
    # The example's module reads its settings at import: look at its tables through an app of our own.
    from examples import rabbitmq_worker as example

    observer = ConsumerApp(make_settings(pg_database, db_pool_size=2))
    async with observer.running():
        async with observer.engine.begin() as conn:
            await conn.execute(example.orders.delete())

        async def recorded() -> tuple[int, int]:
            query = select(func.count(), func.count(distinct(example.orders.c.order_ref)))
            async with observer.engine.connect() as conn:
                total, unique = (await conn.execute(query)).one()
            return int(total), int(unique)

        orders = [(f"order-{i:05d}", json.dumps({"order": f"O-{i}", "amount": i}).encode())
                  for i in range(ORDERS)]
        first = start_worker(env, log)
        try:
            await publish(queue, orders)

            async def some() -> bool:
                return (await recorded())[0] >= 200

            await wait_until(some, 60, "the first worker to record some orders")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        killed_at = (await recorded())[0]
        assert killed_at < ORDERS, "the worker finished before it could be killed mid-stream"

        second = start_worker(env, log)
        try:
            async def all_recorded() -> bool:
                return (await recorded())[1] == ORDERS and await depth(queue) == 0

            await wait_until(all_recorded, 90, "the restarted worker to record every order")

            async def all_announced() -> bool:
                return (await observer.outbox.stats()).pending == 0

            await wait_until(all_announced, 30, "every announcement to be relayed")
        finally:
            second.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(second.wait, 30)
        assert code == 0, log.read_text()
        assert await recorded() == (ORDERS, ORDERS)  # exactly once, across the kill

    assert await depth(queue) == 0  # the drained worker left nothing unacknowledged
    events = await drain(f"{queue}.events")
    announced = {json.loads(m.body)["order"] for m in events}
    assert announced == {f"O-{i}" for i in range(ORDERS)}
    # A repeat can only be a row the killed relay had confirmed but not recorded: same id, same body.
    by_id: dict[str, set[bytes]] = {}
    for message in events:
        by_id.setdefault(message.message_id or "", set()).add(message.body)
    assert len(by_id) == ORDERS and all(len(bodies) == 1 for bodies in by_id.values())
