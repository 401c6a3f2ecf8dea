"""A parked RabbitMQ message replayed with ``consumer-kit parked replay``: it goes back on its queue, the
running worker runs its handler once under the same key, and a second replay of it is acknowledged as
a duplicate without running again."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from consumer_kit import ConsumerApp
from tests.acceptance.cli_run import cli
from tests.conftest import TEST_HMAC_KEY, make_settings, truncate_all
from tests.integration.rabbit import AMQP_URL, declare, delete_queues, depth, drain, publish, wait_until
from tests.processes import terminated

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.parked_app"


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-parked-{secrets.token_hex(4)}"
    yield name
    await delete_queues(name)


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``consumer-kit run`` the app; ``--log-level`` after the sub-command: it logs its duplicates."""
    with log.open("wb") as output:
        return subprocess.Popen(
            [str(Path(sys.executable).with_name("consumer-kit")), "run", f"{APP}:app", "--log-level", "DEBUG"],
            cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)


async def test_a_parked_rabbitmq_message_replays_once_then_as_a_duplicate(
        pg_url: str, queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await truncate_all(pg_url)
    fixed = tmp_path / "fixed"
    env = {"DATABASE_URL": pg_url, "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY, "RABBITMQ_URL": AMQP_URL,
           "APP_MIGRATIONS": str(Path(__file__).with_name("parked_migrations")), "PARKED_TEST_QUEUE": queue,
           "PARKED_TEST_FIXED_FILE": str(fixed), "DB_POOL_SIZE": "3"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (await asyncio.to_thread(cli, "db", "upgrade")).code == 0
    observer = ConsumerApp(make_settings(pg_url, db_pool_size=2, app_migrations=env["APP_MIGRATIONS"]))
    await declare(queue)
    log = tmp_path / "worker.log"
    worker = start_worker({**os.environ, **env}, log)
    try:
        async with observer.running(sources=()):
            async with observer.engine.begin() as conn:
                await conn.execute(text("DELETE FROM parked_test_effects"))

            async def effects() -> int:
                async with observer.engine.connect() as conn:
                    return int((await conn.execute(
                        select(func.count()).select_from(text("parked_test_effects")))).scalar_one())

            async def said(words: str) -> bool:
                return log.read_bytes().count(words.encode()) > 0

            await wait_until(lambda: said("consumer-kit started"), 60, "the worker to start")
            await publish(queue, [("order-7", b'{"park": true}')])

            async def parked() -> bool:
                return await observer.dead_letters.count() == 1

            await wait_until(parked, 30, "the message to be parked")
            [letter] = await observer.dead_letters.list()
            assert letter.reason == "not_ready" and letter.source == f"rabbitmq:{queue}"
            assert len(await drain(f"{queue}.dlq")) == 1  # the broker's copy, as before

            fixed.touch()  # the fix is deployed; the operator replays
            first = await asyncio.to_thread(cli, "parked", "replay", f"{APP}:app", "--id", letter.id,
                                            fresh=(APP,))
            assert first.code == 0, first.err
            assert [row["action"] for row in first.json()] == ["requeued"]

            async def ran_once() -> bool:
                return await effects() == 1

            await wait_until(ran_once, 30, "the replayed message to run its handler")

            second = await asyncio.to_thread(cli, "parked", "replay", f"{APP}:app", "--id", letter.id,
                                             fresh=(APP,))
            assert [row["action"] for row in second.json()] == ["requeued"]
            await wait_until(lambda: said("duplicate delivery acknowledged"), 30, "the second replay to be acked")
            assert await depth(queue) == 0 and await depth(f"{queue}.dlq") == 0
            assert await effects() == 1  # the handler ran once in all
            assert await observer.dead_letters.count() == 1  # nothing parked again
            shown = (await asyncio.to_thread(cli, "parked", "show", letter.id)).json()[0]
            assert shown["replays"] == 2 and [h["outcome"] for h in shown["history"]] == ["requeued", "requeued"]
    finally:
        code = await terminated(worker)
    assert code == 0, log.read_text()[-3000:]
    # One traceback only: the handler's TerminalError, logged with the park it caused; nothing crashed.
    assert log.read_text().count("Traceback") == 1
    assert " ERROR consumer_kit.pipeline delivery parked: not_ready" in log.read_text()
    assert "order-7" not in log.read_text()  # the key's id: not even at DEBUG
