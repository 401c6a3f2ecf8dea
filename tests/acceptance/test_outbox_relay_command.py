"""``consumer-kit outbox relay`` on its own: publishes committed rows, and exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from consumer_kit import ConsumerApp
from tests.conftest import TEST_HMAC_KEY, make_settings
from tests.integration.rabbit import AMQP_URL, declare, delete_queues, drain, wait_until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-test-{secrets.token_hex(4)}"
    await declare(name)
    yield name
    await delete_queues(name)


def start_relay(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen([str(Path(sys.executable).with_name("consumer-kit")), "outbox", "relay"],
                                env=env, stdout=output, stderr=output)


async def test_relay_command_publishes_and_stops_cleanly(
        pg_database: str, queue: str, tmp_path: Path) -> None:
    app = ConsumerApp(make_settings(pg_database, db_pool_size=2))
    env = dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY,
               RABBITMQ_URL=AMQP_URL, OUTBOX_POLL_SECONDS="0.2")
    log = tmp_path / "relay.log"
    relay = start_relay(env, log)
    try:
        async with app.running():
            async with app.engine.begin() as conn:
                ids = [await app.outbox.enqueue(conn, queue, f"event-{i}") for i in range(25)]

            async def published() -> bool:
                return (await app.outbox.stats()).pending == 0

            await wait_until(published, 30, "the relay command to publish")
    finally:
        relay.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(relay.wait, 20)
    assert code == 0, log.read_text()
    assert sorted(m.message_id or "" for m in await drain(queue)) == sorted(ids)
