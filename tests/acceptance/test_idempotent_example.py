"""The label API (examples/idempotent_api.py) as a user runs it: ``consumer-kit db upgrade``, ``python -m
examples.idempotent_api init``, then ``python -m examples.idempotent_api --port N`` on PostgreSQL, with its
outbox relayed to RabbitMQ and a carrier of the test's own behind ``CARRIER_URL``.

Each key and tenant books one label, one row and one ``label.created`` event, whatever the client does:
repeats, another tenant's same key, a carrier that fails once (503, the key released, the retry books),
a dozen retrying clients at once (409 with ``Retry-After`` until the first answer is stored, then that
answer), and a process SIGKILLed in the middle of a request (its lease runs out, the retry takes the key
over and the carrier is asked again under the same derived key). SIGTERM stops it cleanly (exit 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_retries import Retry, RetryTransport
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from consumer_kit.testing.server import free_port, served_asgi
from tests.conftest import PG_ADMIN_URL, TEST_HMAC_KEY, _admin
from tests.integration.rabbit import AMQP_URL, delete_queues, depth, drain, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {"tok-acme": "acme", "tok-globex": "globex"}
ACME, GLOBEX = {"Authorization": "Bearer tok-acme"}, {"Authorization": "Bearer tok-globex"}
LABEL = {"order": "A-1001", "carrier": "ups", "weight_grams": 1200}


class Carrier:
    """A carrier's booking API as the label API calls it: ``POST /shipments`` with an ``Idempotency-Key``,
    which it deduplicates by (the same key: the same tracking number). It can fail the next requests
    (503) or hold them until told."""

    def __init__(self) -> None:
        self.keys: list[str] = []  # the Idempotency-Key of every request, in order
        self.booked: dict[str, str] = {}
        self.fail_next = 0
        self.hold: asyncio.Event | None = None
        self.arrived = asyncio.Event()

    async def shipments(self, request: Request) -> Response:
        key = request.headers["idempotency-key"]
        await request.json()
        self.keys.append(key)
        self.arrived.set()
        if self.fail_next:
            self.fail_next -= 1
            return JSONResponse({"error": "down for maintenance"}, status_code=503)
        if self.hold is not None:
            await self.hold.wait()
        tracking = self.booked.setdefault(key, f"1Z{len(self.booked) + 1:06d}")
        return JSONResponse({"tracking_number": tracking})


@pytest.fixture
async def carrier() -> AsyncIterator[tuple[Carrier, str]]:
    own = Carrier()
    async with served_asgi(Starlette(routes=[Route("/shipments", own.shipments, methods=["POST"])])) as url:
        yield own, url


@pytest.fixture
async def label_database() -> AsyncIterator[str]:
    """A PostgreSQL database of the test's own, empty: ``consumer-kit db upgrade`` makes its schema."""
    name = f"ck_labels_{secrets.token_hex(4)}"
    await _admin(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-labels-{secrets.token_hex(4)}"
    yield name
    await delete_queues(name)


@pytest.fixture
def env(label_database: str, queue: str, carrier: tuple[Carrier, str]) -> dict[str, str]:
    own = {key: value for key, value in os.environ.items()
           if not re.match(r"(IDEMPOTENCY_|INBOX_|RABBITMQ_|DATABASE_URL$|LABEL_|CARRIER_)", key)}
    return {**own, "DATABASE_URL": label_database, "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY, "RABBITMQ_URL": AMQP_URL,
            "LABEL_EVENTS_QUEUE": queue, "LABEL_API_TOKENS": json.dumps(TOKENS), "CARRIER_URL": carrier[1],
            "OUTBOX_POLL_SECONDS": "0.2", "DB_POOL_SIZE": "5", "LOG_LEVEL": "INFO"}


class Api:
    """``python -m examples.idempotent_api --port N`` with ``env``, its output in ``log``."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.process: subprocess.Popen[bytes] | None = None
        self.base = ""

    async def setup(self) -> None:
        """What a deployment runs once: consumer-kit's schema, then the example's table and queue."""
        for command in ([str(Path(sys.executable).with_name("consumer-kit")), "db", "upgrade"],
                        [sys.executable, "-m", "examples.idempotent_api", "init"]):
            done = await asyncio.to_thread(subprocess.run, command, cwd=ROOT, env=self.env, capture_output=True,
                                           timeout=120)
            assert done.returncode == 0, done.stderr.decode()

    async def start(self) -> str:
        port = free_port()
        self.process = await asyncio.to_thread(self._spawn, port)
        self.base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as client:
            for _ in range(300):
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(f"{self.base}/readyz", timeout=2)).status_code == 200:
                        return self.base
                assert self.process.poll() is None, self.output()
                await asyncio.sleep(0.1)
        raise AssertionError(f"never ready:\n{self.output()}")

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as output:
            return subprocess.Popen([sys.executable, "-m", "examples.idempotent_api", "--port", str(port)],
                                    cwd=ROOT, env=self.env, stdout=output, stderr=output)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=20)

    async def stop(self) -> int:
        """SIGTERM, and the exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.process.wait, 30)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def api(env: dict[str, str], tmp_path: Path) -> Iterator[Api]:
    own = Api(env, tmp_path / "api.log")
    yield own
    if own.process is not None and own.process.poll() is None:
        own.process.kill()
        own.process.wait(timeout=20)


def key() -> str:
    return str(uuid.uuid4())


def keyed(client_key: str, who: dict[str, str]) -> dict[str, str]:
    return {**who, "Idempotency-Key": f'"{client_key}"'}


def retrying(base: str) -> httpx.AsyncClient:
    """A client that retries a 409 after its Retry-After, as a client of an idempotent API should."""
    retry = Retry(total=30, allowed_methods=["POST"], status_forcelist=[409], respect_retry_after_header=True,
                  backoff_factor=0.2, max_backoff_wait=10)
    return httpx.AsyncClient(base_url=base, transport=RetryTransport(httpx.AsyncHTTPTransport(), retry=retry),
                             timeout=30)


async def rows(url: str) -> list[dict[str, Any]]:
    engine = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://"))
    try:
        async with engine.connect() as conn:
            found = await conn.execute(text(
                "SELECT id, tenant, order_ref, tracking_number FROM example_labels ORDER BY id"))
            return [dict(row) for row in found.mappings()]
    finally:
        await engine.dispose()


async def events(queue: str, count: int) -> list[dict[str, Any]]:
    """The ``label.created`` events on ``queue``, once ``count`` of them are there (and no more come)."""

    async def there() -> bool:
        return await depth(queue) >= count

    await wait_until(there, 30, f"{count} events on {queue}")
    await asyncio.sleep(0.5)  # a late extra one would show now
    taken = await drain(queue)
    assert len({message.message_id for message in taken}) == len(taken)
    return [json.loads(message.body) for message in taken]


def metric(exposition: str, outcome: str) -> float:
    series = f'consumer_kit_http_idempotent_requests_total{{endpoint="labels",outcome="{outcome}"}}'
    found = re.search(rf"^{re.escape(series)} (\S+)$", exposition, re.MULTILINE)
    assert found, outcome
    return float(found.group(1))


async def test_each_key_and_tenant_books_one_label_whatever_the_client_sends(
        api: Api, carrier: tuple[Carrier, str], label_database: str, queue: str) -> None:
    api.env["INBOX_LEASE_SECONDS"] = "3"  # the 409's Retry-After, which the retrying clients wait out
    own_carrier = carrier[0]
    await api.setup()
    base = await api.start()
    first_key, failing_key, crowded_key = key(), key(), key()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        first = await client.post("/labels", json=LABEL, headers=keyed(first_key, ACME))
        again = await client.post("/labels", json=LABEL, headers=keyed(first_key, ACME))
        reused = await client.post("/labels", json={**LABEL, "order": "A-1002"}, headers=keyed(first_key, ACME))
        other_tenant = await client.post("/labels", json=LABEL, headers=keyed(first_key, GLOBEX))
        missing = await client.post("/labels", json=LABEL, headers=ACME)
        bare = await client.post("/labels", json=LABEL, headers={**ACME, "Idempotency-Key": first_key})
        stranger = await client.post("/labels", json=LABEL, headers=keyed(first_key, {"Authorization": "Bearer x"}))
        assert first.status_code == 201, first.text
        label = first.json()
        assert first.headers["location"] == f"/labels/{label['label']}"
        assert (again.status_code, again.json(), again.headers["idempotency-replayed"]) == (201, label, "true")
        assert again.headers["location"] == first.headers["location"]
        assert (reused.status_code, reused.json()) == (422, {"error": "idempotency_key_reused"})
        assert other_tenant.status_code == 201 and other_tenant.json()["label"] != label["label"]
        assert (missing.status_code, missing.json()) == (400, {"error": "idempotency_key_missing"})
        assert (bare.status_code, bare.json()) == (400, {"error": "idempotency_key_malformed"})
        assert stranger.status_code == 401

        status = await client.get("/labels/status", headers=keyed(first_key, ACME))
        unknown = await client.get("/labels/status", headers=keyed(key(), ACME))
        assert status.status_code == 200 and status.json()["state"] == "completed" and status.json()["status"] == 201
        assert (unknown.status_code, unknown.json()) == (404, {"state": "unknown"})
        mine = await client.get(f"/labels/{label['label']}", headers=ACME)
        theirs = await client.get(f"/labels/{label['label']}", headers=GLOBEX)
        assert (mine.status_code, mine.json()["tracking_number"], theirs.status_code) == (
            200, label["tracking_number"], 404)

        # The carrier fails once: 503, nothing kept, the key given back; the client's retry books.
        own_carrier.fail_next = 1
        failed = await client.post("/labels", json=LABEL, headers=keyed(failing_key, ACME))
        retried = await client.post("/labels", json=LABEL, headers=keyed(failing_key, ACME))
        assert failed.status_code == 503 and failed.headers["retry-after"] == "5"
        assert retried.status_code == 201 and "idempotency-replayed" not in retried.headers

    # A dozen clients send one request at once while the carrier takes a second to answer the first.
    own_carrier.hold = asyncio.Event()
    async with retrying(base) as crowd:
        sent = [asyncio.create_task(crowd.post("/labels", json=LABEL, headers=keyed(crowded_key, ACME)))
                for _ in range(12)]
        await asyncio.sleep(1)
        own_carrier.hold.set()
        answers = await asyncio.gather(*sent)
    assert {answer.status_code for answer in answers} == {201}
    assert len({answer.json()["label"] for answer in answers}) == 1
    assert sum("idempotency-replayed" in answer.headers for answer in answers) == 11

    async with httpx.AsyncClient(base_url=base) as client:
        exposition = (await client.get("/metrics")).text
    assert metric(exposition, "processed") == 4
    assert metric(exposition, "replayed") == 12
    assert metric(exposition, "in_progress") >= 1
    assert (metric(exposition, "key_reused"), metric(exposition, "key_missing"),
            metric(exposition, "key_malformed"), metric(exposition, "failed")) == (1, 1, 1, 1)

    booked = await rows(label_database)
    assert [(row["tenant"], row["order_ref"]) for row in booked] == [
        ("acme", "A-1001"), ("globex", "A-1001"), ("acme", "A-1001"), ("acme", "A-1001")]
    announced = await events(queue, 4)
    assert sorted(event["label"] for event in announced) == [row["id"] for row in booked]
    assert {event["type"] for event in announced} == {"label.created"}
    # The carrier was asked once per booking, and twice for the one that failed, under one derived key.
    assert len(own_carrier.keys) == 5 and len(set(own_carrier.keys)) == 4

    assert await api.stop() == 0
    output = api.output()
    assert "Traceback" not in output, output
    for client_key in (first_key, failing_key, crowded_key):
        assert client_key not in output  # logged as digests, never as keys


async def test_a_request_whose_process_dies_runs_again_once_its_lease_ran_out(
        api: Api, carrier: tuple[Carrier, str], label_database: str, queue: str, tmp_path: Path) -> None:
    # Two replicas behind one address, as a load balancer would have them; the first dies mid-request.
    api.env["INBOX_LEASE_SECONDS"] = "8"
    own_carrier = carrier[0]
    await api.setup()
    base = await api.start()
    replica = Api(api.env, tmp_path / "replica.log")
    try:
        other = await replica.start()
        client_key = key()
        own_carrier.hold = asyncio.Event()
        async with httpx.AsyncClient(timeout=30) as client:
            cut = asyncio.create_task(client.post(f"{base}/labels", json=LABEL, headers=keyed(client_key, ACME)))
            await asyncio.wait_for(own_carrier.arrived.wait(), 20)  # the route runs: the key claimed, unfinished
            api.kill()
            with pytest.raises(httpx.TransportError):
                await cut
            own_carrier.hold.set()
            early = await client.post(f"{other}/labels", json=LABEL, headers=keyed(client_key, ACME))
            status = await client.get(f"{other}/labels/status", headers=keyed(client_key, ACME))
        assert early.status_code == 409 and 1 <= int(early.headers["retry-after"]) <= 8, early.text
        assert status.json()["state"] == "in_progress"
        async with retrying(other) as client:  # waits out the dead replica's lease, then takes the key over
            answer = await client.post("/labels", json=LABEL, headers=keyed(client_key, ACME))
        assert answer.status_code == 201 and "idempotency-replayed" not in answer.headers, answer.text

        booked = await rows(label_database)
        assert [(row["id"], row["tracking_number"]) for row in booked] == [
            (answer.json()["label"], answer.json()["tracking_number"])]
        assert [event["label"] for event in await events(queue, 1)] == [answer.json()["label"]]
        # The carrier saw the booking twice under one key (the dead attempt's and the retry's): it booked once.
        assert len(own_carrier.keys) == 2 and len(set(own_carrier.keys)) == 1 and len(own_carrier.booked) == 1
        assert await replica.stop() == 0
        assert "Traceback" not in replica.output() and client_key not in replica.output()
    finally:
        if replica.process is not None and replica.process.poll() is None:
            replica.kill()
