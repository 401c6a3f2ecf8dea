"""An idempotent endpoint through a crash, as a user runs it: the app of
:mod:`tests.integration.idempotent_app` served by ``uvicorn --factory`` in a process of its own on a
PostgreSQL database of this module's own, with a 2 s lease.

A worker is SIGKILLed while a request is inside its route; a new one starts on the same port; a client
that retries as off-the-shelf clients do (httpx with ``httpx-retries``: connection errors, 409 and 503,
Retry-After honoured) gets the one effect's 201, and a replay after. And a route that outlives its lease
while a retry takes over cannot complete: one effect, the slow attempt's writes rolled back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import httpx
import psycopg
import pytest
from httpx_retries import Retry, RetryTransport
from prometheus_client.parser import text_string_to_metric_families

from consumer_kit.testing.server import free_port
from tests.conftest import TEST_HMAC_KEY, migrated_database
from tests.processes import wait_until_served

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
LEASE_SECONDS = 2


class Workers:
    """Workers serving the app on one database and one port, one after the other, each logging to a
    file of its own; the one still running at the end is stopped with SIGTERM. The module's tests share
    them: a worker a test leaves running serves the next (starting one costs seconds)."""

    def __init__(self, database_url: str, tmp_path: Path) -> None:
        self.database_url = database_url
        self.tmp_path = tmp_path
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.signals = tmp_path / "inside"
        self.signals.mkdir()
        self.env = {**os.environ, "DATABASE_URL": database_url, "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY,
                    "INBOX_LEASE_SECONDS": str(LEASE_SECONDS), "DB_POOL_SIZE": "4", "SHUTDOWN_GRACE_SECONDS": "2",
                    "SWEEP_INTERVAL_SECONDS": "3600", "IDEM_SIGNAL_DIR": str(self.signals)}
        self.started: list[tuple[subprocess.Popen[str], IO[bytes]]] = []

    async def serving(self) -> subprocess.Popen[str]:
        """The worker serving now, or a new one once it serves."""
        if self.started and self.started[-1][0].poll() is None:
            return self.started[-1][0]
        process = self._spawn()
        await asyncio.to_thread(wait_until_served, process, f"{self.base}/ops/readyz", seconds=60)
        return process

    def _spawn(self) -> subprocess.Popen[str]:
        log = (self.tmp_path / f"worker-{len(self.started)}.log").open("wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "tests.integration.idempotent_app:create", "--factory",
             "--host", "127.0.0.1", "--port", str(self.port), "--timeout-graceful-shutdown", "2"],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, text=True)
        self.started.append((process, log))
        return process

    def inside(self, ticket: str, attempt: int) -> bool:
        """Whether the route has written its row for ``ticket`` on ``attempt`` (and is still inside)."""
        return (self.signals / f"{ticket}.{attempt}").exists()

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.tmp_path.glob("worker-*.log")))

    def stop(self) -> list[int]:
        """SIGTERM to the worker still running; the exit codes of those that were."""
        codes: list[int] = []
        for process, log in self.started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    codes.append(process.wait(20))
                except subprocess.TimeoutExpired:
                    process.kill()
                    raise
            log.close()
        return codes


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    """A PostgreSQL database of this module's own (a unique name), migrated to head."""
    with migrated_database("ck_idem_crash") as url:
        yield url


@pytest.fixture(scope="module")
def workers(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    made = Workers(database_url, tmp_path_factory.mktemp("workers"))
    try:
        yield made
    finally:
        codes = made.stop()
    # uvicorn ends a SIGTERM's graceful shutdown by raising the signal again: -SIGTERM is its clean exit
    assert all(code in (0, -signal.SIGTERM) for code in codes), (codes, made.output()[-3000:])
    assert "Traceback" not in made.output()


def effects(database_url: str, ticket: str) -> list[tuple[str, int]]:
    """The rows the route committed for ``ticket`` (route, attempt), read by a client of our own."""
    with psycopg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://")) as conn:
        return [tuple(r) for r in conn.execute(
            "SELECT route, attempt FROM idem_effects WHERE ticket = %s ORDER BY attempt", (ticket,)).fetchall()]


async def until(condition: Callable[[], bool], what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


def retrying_client(base: str) -> httpx.AsyncClient:
    """A client that retries POSTs as off-the-shelf clients do: on connection errors (and a reset
    mid-request), and on 409 and 503, honouring Retry-After."""
    retry = Retry(total=30, allowed_methods=["POST"], status_forcelist=[409, 503], backoff_factor=0.1,
                  max_backoff_wait=2, respect_retry_after_header=True)
    return httpx.AsyncClient(base_url=base, transport=RetryTransport(transport=httpx.AsyncHTTPTransport(), retry=retry),
                             timeout=10)


def replayed(answer: httpx.Response) -> bool:
    return bool(answer.headers.get("idempotency-replayed") == "true")


async def killed_inside(workers: Workers, client: httpx.AsyncClient, path: str, order: dict[str, object],
                        headers: dict[str, str]) -> httpx.Response:
    """Send the request, SIGKILL the worker once its first attempt is inside the route, start another on
    the same port: the answer the retrying client ends with."""
    doomed = await workers.serving()
    request = asyncio.create_task(client.post(path, json=order, headers=headers))
    try:
        await until(lambda: workers.inside(str(order["ticket"]), 1), "the first attempt inside the route")
        doomed.kill()
        await asyncio.to_thread(doomed.wait, 10)
        await workers.serving()  # a new worker on the same port
        return await asyncio.wait_for(request, 60)
    finally:
        request.cancel()


async def test_a_worker_killed_inside_the_route_and_a_retrying_client(database_url: str, workers: Workers) -> None:
    key, ticket = f"crash-key-{uuid.uuid4().hex}", f"t-{uuid.uuid4().hex[:12]}"
    order: dict[str, object] = {"ticket": ticket, "sleep_first": 60}  # the first attempt hangs inside the route
    headers = {"Idempotency-Key": f'"{key}"'}
    async with retrying_client(workers.base) as client:
        answer = await killed_inside(workers, client, "/jobs", order, headers)
        assert answer.status_code == 201, answer.text
        assert answer.extensions["retry"].attempts_made >= 1  # the client did retry
        body = answer.json()
        assert (body["ticket"], body["attempt"]) == (ticket, 2)  # the second attempt of one operation
        assert effects(database_url, ticket) == [("jobs", 2)]  # the killed attempt's row never committed
        later = await client.post("/jobs", json=order, headers=headers)
        assert (later.status_code, replayed(later), later.content) == (201, True, answer.content)
        assert later.headers["location"] == answer.headers["location"]
    assert effects(database_url, ticket) == [("jobs", 2)]
    assert key not in workers.output()


async def test_in_one_transaction_a_worker_killed_inside_the_route_leaves_nothing_to_wait_for(
        database_url: str, workers: Workers) -> None:
    """``single_transaction=True``: the killed attempt's transaction dies with its connection, its key's
    lock with it, so the retry runs at once as a first attempt (no lease to wait out, no 409)."""
    key, ticket = f"crash-key-{uuid.uuid4().hex}", f"t-{uuid.uuid4().hex[:12]}"
    order: dict[str, object] = {"ticket": ticket, "hang_once": True}
    headers = {"Idempotency-Key": f'"{key}"'}
    async with retrying_client(workers.base) as client:
        answer = await killed_inside(workers, client, "/one", order, headers)
        assert answer.status_code == 201, answer.text
        assert answer.extensions["retry"].attempts_made >= 1
        assert (answer.json()["ticket"], answer.json()["attempt"]) == (ticket, 1)  # nothing of the first was kept
        assert effects(database_url, ticket) == [("one", 1)]
        later = await client.post("/one", json=order, headers=headers)
        assert (later.status_code, replayed(later), later.content) == (201, True, answer.content)
        exposition = (await client.get("/ops/metrics")).text
    counted = {s.labels["outcome"]: s.value for f in text_string_to_metric_families(exposition) for s in f.samples
               if s.name == "consumer_kit_http_idempotent_requests_total" and s.labels["endpoint"] == "one"}
    assert (counted["processed"], counted["replayed"], counted["in_progress"]) == (1, 1, 0)
    assert key not in workers.output()


async def test_a_completion_after_the_lease_was_taken_over_is_refused(database_url: str, workers: Workers) -> None:
    await workers.serving()
    key, ticket = f"lease-key-{uuid.uuid4().hex}", f"t-{uuid.uuid4().hex[:12]}"
    order = {"ticket": ticket, "sleep_first": LEASE_SECONDS + 1.5}  # outlives its lease (its time limit: 60 s)
    headers = {"Idempotency-Key": f'"{key}"'}
    async with httpx.AsyncClient(base_url=workers.base, timeout=30) as client:
        metrics_before = await lease_lost(client)
        slow = asyncio.create_task(client.post("/jobs", json=order, headers=headers))
        try:
            await until(lambda: workers.inside(ticket, 1), "the first attempt inside the route")

            async def state() -> str:
                return str((await client.get("/jobs/status", headers=headers)).json()["state"])

            assert await state() == "in_progress"
            deadline = time.monotonic() + 10
            while await state() != "released":  # the lease ran out while the route still runs
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert not slow.done()
            taken_over = await client.post("/jobs", json=order, headers=headers)
            assert taken_over.status_code == 201 and not replayed(taken_over)
            assert taken_over.json()["attempt"] == 2
            refused = await asyncio.wait_for(slow, 30)
        finally:
            slow.cancel()
        assert (refused.status_code, refused.json()) == (409, {"error": "request_in_progress"})
        assert refused.headers["retry-after"] == "1"
        assert effects(database_url, ticket) == [("jobs", 2)]  # the slow attempt's row rolled back
        # the slow attempt's client, retrying, gets the answer of the attempt that took over
        retry = await client.post("/jobs", json=order, headers=headers)
        assert (retry.status_code, replayed(retry), retry.content) == (201, True, taken_over.content)
        assert await lease_lost(client) - metrics_before == 1
    assert key not in workers.output()


async def lease_lost(client: httpx.AsyncClient) -> float:
    text = (await client.get("/ops/metrics")).text
    assert "lease-key-" not in text and "crash-key-" not in text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "consumer_kit_http_idempotent_requests_total"
               and s.labels == {"endpoint": "jobs", "outcome": "lease_lost"})
