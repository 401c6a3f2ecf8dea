"""What the RabbitMQ and SQS worker acceptance tests share: an example worker as a user runs it
(``consumer-kit run examples.<worker>:app``), killed with SIGKILL mid-stream and started again,
records every order once and relays every announcement; SIGTERM drains it and it exits 0. Each test
brings its transport (how the orders are published, how deep the orders queue is) and checks the
announcements on it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Table, distinct, func, select

from consumer_kit import ConsumerApp
from consumer_kit.testing.server import free_port
from tests.conftest import make_settings
from tests.integration.rabbit import wait_until
from tests.processes import stop_cleanly, wait_until_served

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Worker:
    """An example worker (``examples.<module>``) run with ``env``, logging to ``log``."""

    module: str
    env: dict[str, str]
    log: Path

    async def init(self) -> None:
        """``python -m examples.<module> init``: the example's table, and its queues where it makes them."""
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", f"examples.{self.module}", "init"], cwd=ROOT, env=self.env,
            capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()

    def start(self) -> subprocess.Popen[bytes]:
        """``consumer-kit run examples.<module>:app``."""
        command = [str(Path(sys.executable).with_name("consumer-kit")), "--log-level", "WARNING",
                   "run", f"examples.{self.module}:app"]
        with self.log.open("ab") as output:
            return subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=output, stderr=output)


async def kill_and_restart(worker: Worker, pg_database: str, *, orders: int,
                           publish: Callable[[], Coroutine[Any, Any, None]], depth: Callable[[], Awaitable[int]],
                           kill_after: int, finish_seconds: float) -> None:
    """Publish ``orders`` orders while a first worker runs, SIGKILL it once it recorded ``kill_after``,
    start a second one, wait (``finish_seconds`` at most) until every order is recorded and the queue
    is empty, then until the outbox is relayed, and SIGTERM it: each order is recorded exactly once."""
    # The example's module reads its settings at import: look at its table through an app of our own.
    table = importlib.import_module(f"examples.{worker.module}").orders
    observer = ConsumerApp(make_settings(pg_database, db_pool_size=2))
    async with observer.running():
        async with observer.engine.begin() as conn:
            await conn.execute(table.delete())

        async def recorded() -> tuple[int, int]:
            query = select(func.count(), func.count(distinct(table.c.order_ref)))
            async with observer.engine.connect() as conn:
                total, unique = (await conn.execute(query)).one()
            return int(total), int(unique)

        first = worker.start()
        try:
            publishing = asyncio.create_task(publish())

            async def some() -> bool:
                return (await recorded())[0] >= kill_after

            await wait_until(some, 60, "the first worker to record some orders")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        killed_at = (await recorded())[0]
        await publishing
        assert killed_at < orders, "the worker finished before it could be killed mid-stream"

        second = worker.start()
        try:
            async def all_recorded() -> bool:
                return (await recorded())[1] == orders and await depth() == 0

            await wait_until(all_recorded, finish_seconds, "the restarted worker to record every order")

            async def all_announced() -> bool:
                return (await observer.outbox.stats()).pending == 0

            await wait_until(all_announced, 30, "every announcement to be relayed")
        finally:
            second.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(second.wait, 30)
        assert code == 0, worker.log.read_text()
        assert await recorded() == (orders, orders)  # exactly once, across the kill
    assert await depth() == 0  # the drained worker left nothing unacknowledged


def serve(module: str, env: dict[str, str], port: int) -> subprocess.Popen[str]:
    """``consumer-kit run examples.<module>:app --port <port>``, its output piped."""
    return subprocess.Popen([str(Path(sys.executable).with_name("consumer-kit")), "--log-level", "WARNING", "run",
                             f"examples.{module}:app", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextlib.asynccontextmanager
async def served(module: str, env: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    """The example worker started with ``--port``, once ``/readyz`` says it is ready: a client on it.
    After, SIGTERM: it must exit 0 without a traceback (the Redis test's too)."""
    port = free_port()
    process = serve(module, env, port)
    try:
        await asyncio.to_thread(wait_until_served, process, f"http://127.0.0.1:{port}/readyz")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            assert (await client.get("/readyz")).json() == {"ready": True}
            yield client
    finally:
        await asyncio.to_thread(stop_cleanly, process)


def assert_announced_once(by_id: dict[str, set[bytes]], orders: int) -> None:
    """Every order announced, under one id each (the outbox row's). A repeat of an id can only be a row
    the killed relay had published but not recorded as published: the same id with the same body."""
    assert {json.loads(body)["order"] for bodies in by_id.values() for body in bodies} == {
        f"O-{i}" for i in range(orders)}
    assert len(by_id) == orders and all(len(bodies) == 1 for bodies in by_id.values())


async def rows(pg_database: str, table: Table) -> int:
    """How many rows the example's table holds."""
    observer = ConsumerApp(make_settings(pg_database, db_pool_size=1))
    async with observer.running(), observer.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(table))).scalar_one())
