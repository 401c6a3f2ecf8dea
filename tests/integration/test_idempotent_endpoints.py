"""Idempotent HTTP endpoints as a client meets them: the app of :mod:`tests.integration.idempotent_app`
(FastAPI, the three styles) served by uvicorn on a loopback port, spoken to with httpx over TCP, on a
SQLite file, on a PostgreSQL database of this module's own, and on one whose inbox is partitioned
(``INBOX_PARTITION_SECONDS``).

One server per database serves the module's tests (each test uses keys and tickets of its own); it runs
in a thread with an event loop of its own, so that what a test does while waiting (a database read, a
gather of 200 requests) is a client's, not the server's. What the server logs is kept, and after each
test neither it nor ``/metrics`` may show any key the test sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import psycopg
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from consumer_kit import OperationKey
from consumer_kit.store import Inbox, partitions, utcnow
from consumer_kit.testing.server import served_asgi
from tests.conftest import Spans, make_settings, migrated_database, run_in_thread, span_texts
from tests.integration.idempotent_app import build

RESPONSE_LIMIT = 4096
Sample = tuple[str, frozenset[tuple[str, str]]]


# --- the server -------------------------------------------------------------------------------------


class Logged(logging.Handler):
    """Every record the process logs while the server runs, as an operator would read it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(self.format(record))


class Server:
    """``api`` under uvicorn (``served_asgi``) in a thread with an event loop of its own."""

    def __init__(self, api: FastAPI) -> None:
        self.api = api
        self.base = ""
        self.failure: BaseException | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="idempotent-app", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by __enter__/__exit__, not left to the thread
            self.failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with served_asgi(self.api, log_level="info") as base:
            self.base = base
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> Server:
        self._thread.start()
        if not self._ready.wait(60) or self.failure is not None or not self.base:
            raise RuntimeError("the server did not start") from self.failure
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the server did not stop"
        if self.failure is not None:
            raise self.failure


class Database:
    """A database of the module's own, and the effects the routes wrote into it, read by a client of
    its own (not the app's). ``partitioned``: its inbox is the partitioned one."""

    def __init__(self, url: str, *, partitioned: bool = False) -> None:
        self.url = url
        self.partitioned = partitioned

    @property
    def conninfo(self) -> str:
        return self.url.replace("postgresql+asyncpg://", "postgresql://")

    def advisory_locks(self) -> int:
        """How many advisory locks are held in this PostgreSQL database."""
        with psycopg.connect(self.conninfo) as conn:
            row = conn.execute("SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
                               " WHERE l.locktype = 'advisory' AND d.datname = current_database()").fetchone()
        return int(row[0]) if row else 0

    def effects(self, ticket: str) -> list[tuple[str, str | None, int]]:
        """The rows the routes wrote for ``ticket``: (route, caller, attempt)."""
        query = "SELECT route, caller, attempt FROM idem_effects WHERE ticket = {p} ORDER BY attempt"
        if self.url.startswith("sqlite"):
            with sqlite3.connect(self.url.split("///", 1)[1]) as conn:
                return [tuple(r) for r in conn.execute(query.format(p="?"), (ticket,)).fetchall()]
        with psycopg.connect(self.conninfo) as conn:
            return [tuple(r) for r in conn.execute(query.format(p="%s"), (ticket,)).fetchall()]


PARTITIONED = pytest.param("partitioned", marks=pytest.mark.postgres)
PARTITION_SECONDS = 3600  # no generation rotates or leaves by itself while the module runs


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres), PARTITIONED])
def database(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    """A SQLite file, or a PostgreSQL database created (unique name) and migrated for this module, its
    inbox made the partitioned one for ``partitioned``."""
    if request.param == "sqlite":
        yield Database(f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('idem')}/idem.db")
        return
    with migrated_database("ck_idem") as url:
        made = Database(url, partitioned=request.param == "partitioned")
        if made.partitioned:
            run_in_thread(_partition(made))
        yield made


async def _partition(database: Database) -> None:
    conn = await asyncpg.connect(database.conninfo)
    try:
        await partitions.partition(conn, seconds=PARTITION_SECONDS, now=utcnow())
    finally:
        await conn.close()


def retention(database: Database) -> int:
    """``INBOX_RETENTION_SECONDS``: short, so that a key can be seen again after its record expired. On the
    plain table an expired row is a duplicate until a sweep deletes it, and rows are swept only when a test
    asks; on the partitioned inbox it is the key's tombstone at once, so retention must outlast a test's
    repeats (200 requests at once take more than a second on a busy host)."""
    return 3 if database.partitioned else 1


def app_settings(database: Database) -> Any:
    return make_settings(database.url, inbox_retention_seconds=retention(database), inbox_tombstone_seconds=3600,
                         idempotent_response_limit_bytes=RESPONSE_LIMIT,
                         inbox_partition_seconds=PARTITION_SECONDS if database.partitioned else 0)


@pytest.fixture(scope="module")
def served(database: Database) -> Iterator[tuple[Server, Logged]]:
    logged = Logged()
    root, kit = logging.getLogger(), logging.getLogger("consumer_kit")
    level = kit.level
    root.addHandler(logged)
    kit.setLevel(logging.DEBUG)
    try:
        with Server(build(app_settings(database))) as server:
            yield server, logged
    finally:
        root.removeHandler(logged)
        kit.setLevel(level)


# --- the client -------------------------------------------------------------------------------------


def quoted(key: str) -> str:
    """The key as the draft sends it: an sf-string."""
    return f'"{key}"'


class Client:
    """A test's view of the served app: requests, the effects written, the metrics; the keys it used."""

    def __init__(self, http: httpx.AsyncClient, database: Database) -> None:
        self.http = http
        self.database = database
        self.keys: list[str] = []
        self.began = datetime.now(UTC)  # the rows written since are the test's own

    def key(self) -> str:
        made = f"client-key-{uuid.uuid4().hex}"
        self.keys.append(made)
        return made

    @staticmethod
    def ticket() -> str:
        return f"t-{uuid.uuid4().hex[:12]}"

    async def post(self, path: str, key: str | None, order: dict[str, Any], *, token: str | None = None,
                   params: str = "") -> httpx.Response:
        headers = {} if key is None else {"Idempotency-Key": quoted(key)}
        if order.get("raise_times") or order.get("use_connection"):  # uvicorn closes it after a route raised
            headers["Connection"] = "close"
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return await self.http.post(path + params, json=order, headers=headers)

    async def status(self, path: str, key: str, *, token: str | None = None) -> httpx.Response:
        headers = {"Idempotency-Key": quoted(key)}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return await self.http.get(f"{path}/status", headers=headers)

    async def state_becomes(self, path: str, key: str, state: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            answer = (await self.status(path, key)).json()
            if answer["state"] == state:
                return dict(answer)
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(0.02)

    def effects(self, ticket: str) -> list[tuple[str, str | None, int]]:
        return self.database.effects(ticket)

    async def metrics(self) -> dict[Sample, float]:
        text = (await self.http.get("/ops/metrics")).text
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def grew(before: dict[Sample, float], after: dict[Sample, float], name: str, **labels: str) -> float:
    sample = (name, frozenset(labels.items()))
    return after.get(sample, 0.0) - before.get(sample, 0.0)


def outcomes(before: dict[Sample, float], after: dict[Sample, float], endpoint: str) -> dict[str, float]:
    """The requests counted per outcome of ``endpoint`` between two readings (the non-zero ones)."""
    name = "consumer_kit_http_idempotent_requests_total"
    counted = {dict(labels)["outcome"]: value - before.get((n, labels), 0.0)
               for (n, labels), value in after.items() if n == name and dict(labels)["endpoint"] == endpoint}
    return {outcome: n for outcome, n in counted.items() if n}


@pytest.fixture
async def client(served: tuple[Server, Logged], database: Database) -> AsyncIterator[Client]:
    server, logged = served
    start = len(logged.texts)
    async with httpx.AsyncClient(base_url=server.base, timeout=30) as http:
        made = Client(http, database)
        yield made
        exposition = (await http.get("/ops/metrics")).text
    logs = "\n".join(logged.texts[start:])
    assert not [k for k in made.keys if k in logs], "a raw key in the server's log"
    assert not [k for k in made.keys if k in exposition], "a raw key in /metrics"


def replayed(answer: httpx.Response) -> bool:
    return bool(answer.headers.get("idempotency-replayed") == "true")


def error(answer: httpx.Response) -> str:
    return str(answer.json()["error"])


async def past_retention(client: Client, rows: int) -> None:
    """Let the keys the test wrote pass their retention, and sweep: on the plain table the sweep deletes their
    ``rows`` (at least), keeping their digests as tombstones; on the partitioned inbox an expired row is its
    key's tombstone already, and nothing is deleted (its generation leaves later, whole). There the test's rows
    are made to expire now rather than waited for (its retention is longer: see :func:`retention`)."""
    if client.database.partitioned:
        conn = await asyncpg.connect(client.database.conninfo)
        try:
            assert await conn.execute("UPDATE inbox SET expires_at = now() WHERE created_at >= $1",
                                      client.began) == f"UPDATE {rows}"
        finally:
            await conn.close()
    else:
        await asyncio.sleep(retention(client.database) + 0.1)
    swept = (await client.http.post("/_test/sweep")).json()["swept"]
    assert swept == 0 if client.database.partitioned else swept >= rows


# --- the rules --------------------------------------------------------------------------------------


async def test_a_request_without_a_usable_key_is_a_400_and_runs_nothing(client: Client) -> None:
    ticket = client.ticket()
    order = json.dumps({"ticket": ticket}).encode()
    key = client.key()
    sends = [
        ([], "idempotency_key_missing"),
        ([("Idempotency-Key", key)], "idempotency_key_malformed"),  # bare: not an sf-string
        ([("Idempotency-Key", quoted("k" * 256))], "idempotency_key_malformed"),
        ([("Idempotency-Key", quoted("tab\there"))], "idempotency_key_malformed"),
        ([("Idempotency-Key", quoted(" " + key))], "idempotency_key_malformed"),
        ([("Idempotency-Key", quoted(key)), ("Idempotency-Key", quoted(key))], "idempotency_key_repeated"),
    ]
    before = await client.metrics()
    for headers, code in sends:
        answer = await client.http.post("/labels", content=order,
                                        headers=[("Content-Type", "application/json"), *headers])
        assert (answer.status_code, error(answer)) == (400, code), headers
        assert answer.headers["content-type"] == "application/json"
    too_big = await client.http.post("/labels", content=b'{"ticket": "' + b"x" * 300_000 + b'"}',
                                     headers={"Idempotency-Key": quoted(key), "Content-Type": "application/json"})
    assert (too_big.status_code, error(too_big)) == (413, "payload_too_large")
    # (the 413 is the middleware's, cut off before FastAPI resolves the route's dependency: no endpoint
    # is known to count it under)
    assert outcomes(before, await client.metrics(), "labels") == {
        "key_missing": 1, "key_malformed": 4, "key_repeated": 1}
    assert client.effects(ticket) == []
    # parameters of the sf-string are no part of the key: the same key with one is the same operation
    first = await client.http.post("/labels", content=order, headers={
        "Idempotency-Key": quoted(key) + ";client=retry-1", "Content-Type": "application/json"})
    again = await client.post("/labels", key, {"ticket": ticket})
    assert (first.status_code, again.status_code, replayed(again)) == (201, 201, True)
    assert again.json() == first.json()


async def test_the_first_request_runs_once_and_every_repeat_gets_its_response(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    assert (await client.status("/labels", key)).status_code == 404
    before = await client.metrics()
    first = await client.post("/labels", key, {"ticket": ticket, "size": 10})
    assert first.status_code == 201 and not replayed(first)
    assert first.headers["location"] == f"/labels/{first.json()['id']}"
    assert "x-run" in first.headers  # a header a replay does not repeat
    assert client.effects(ticket) == [("labels", None, 1)]

    again = await client.post("/labels", key, {"ticket": ticket, "size": 10})
    # the same object serialised otherwise (key order, spaces) is the same request
    reserialised = await client.http.post("/labels", content=json.dumps({"size": 10, "ticket": ticket}, indent=3),
                                          headers={"Idempotency-Key": quoted(key),
                                                   "Content-Type": "application/json; charset=utf-8"})
    for repeat in (again, reserialised):
        assert replayed(repeat)
        assert (repeat.status_code, repeat.content) == (first.status_code, first.content)
        for header in ("content-type", "location"):
            assert repeat.headers[header] == first.headers[header]
        assert "x-run" not in repeat.headers
    assert client.effects(ticket) == [("labels", None, 1)]
    assert outcomes(before, await client.metrics(), "labels") == {"processed": 1, "replayed": 2}
    status = (await client.status("/labels", key)).json()
    assert (status["state"], status["status"]) == ("completed", 201)
    assert status["created_at"] < status["expires_at"]


@pytest.mark.parametrize("path", ["/labels", "/staged"])
async def test_the_route_sees_the_request_as_a_delivery_without_credentials_or_key(client: Client,
                                                                                   path: str) -> None:
    order = {"ticket": client.ticket(), "show_delivery": True}
    before = datetime.now(UTC)
    answer = await client.http.post(path, json=order, headers={
        "Idempotency-Key": quoted(client.key()), "Authorization": "Bearer token-a", "Cookie": "session=s",
        "X-Request-Tag": "tag-1"})
    assert answer.status_code == 201, answer.text
    shown = answer.json()
    assert shown["headers"]["x-request-tag"] == "tag-1"
    assert shown["headers"]["content-type"] == "application/json"
    assert not {"authorization", "cookie", "idempotency-key"} & set(shown["headers"])
    assert shown["attributes"] == {"method": "POST", "path": path}
    assert (shown["body"], shown["attempt"], shown["id"]) == (order, 1, None)
    assert before - timedelta(seconds=1) <= datetime.fromisoformat(shown["received_at"]) <= datetime.now(UTC)


async def test_a_request_fastapi_finds_invalid_keeps_no_record_and_its_correction_runs(client: Client) -> None:
    """FastAPI's own 422 (a body that does not validate) comes after the key was claimed: the claim is
    withdrawn, not the 422 stored, so the corrected request under the same key runs."""
    key, ticket = client.key(), client.ticket()
    before = await client.metrics()
    invalid = await client.post("/labels", key, {"sleep": "not a number"})  # no ticket, a bad sleep
    assert invalid.status_code == 422 and "detail" in invalid.json() and not replayed(invalid)
    assert (await client.status("/labels", key)).status_code == 404  # no record of it
    corrected = await client.post("/labels", key, {"ticket": ticket})
    again = await client.post("/labels", key, {"ticket": ticket})
    assert (corrected.status_code, replayed(corrected)) == (201, False)
    assert (again.status_code, replayed(again), again.content) == (201, True, corrected.content)
    assert client.effects(ticket) == [("labels", None, 1)]
    assert outcomes(before, await client.metrics(), "labels") == {"invalid_request": 1, "processed": 1,
                                                                  "replayed": 1}


async def test_the_same_key_on_another_request_is_a_422(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    first = await client.post("/labels", key, {"ticket": ticket}, params="?a=1&b=2")
    assert first.status_code == 201
    same_query = await client.post("/labels", key, {"ticket": ticket}, params="?b=2&a=1")
    assert replayed(same_query) and same_query.content == first.content  # the query's order is no matter
    before = await client.metrics()
    for order, params in (({"ticket": ticket, "size": 1}, "?a=1&b=2"), ({"ticket": ticket}, "?a=1"),
                          ({"ticket": ticket}, "?a=1&b=3"), ({"ticket": ticket}, "")):
        answer = await client.post("/labels", key, order, params=params)
        assert (answer.status_code, error(answer)) == (422, "idempotency_key_reused")
        assert not replayed(answer)
    assert outcomes(before, await client.metrics(), "labels") == {"key_reused": 4}
    # another path under the same keys (the prefix's): another request
    charge = client.key()
    assert (await client.post("/payments/charges", charge, {"ticket": ticket})).status_code == 201
    refund = await client.post("/payments/refunds", charge, {"ticket": ticket})
    assert (refund.status_code, error(refund)) == (422, "idempotency_key_reused")
    assert client.effects(ticket) == [("labels", None, 1), ("payments-charges", None, 1)]


async def test_a_repeat_while_the_first_runs_is_a_409_with_retry_after(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket, "gate": True}
    first = asyncio.create_task(client.post("/labels", key, order))
    try:
        running = await client.state_becomes("/labels", key, "in_progress")
        assert 1 <= running["retry_after"] <= 30  # the lease: INBOX_LEASE_SECONDS
        before = await client.metrics()
        repeat = await client.post("/labels", key, order)
        assert (repeat.status_code, error(repeat)) == (409, "request_in_progress")
        assert 1 <= int(repeat.headers["retry-after"]) <= 30
        other = await client.post("/labels", key, {"ticket": ticket})  # another request: told so at once
        assert (other.status_code, error(other)) == (422, "idempotency_key_reused")
        assert outcomes(before, await client.metrics(), "labels") == {"in_progress": 1, "key_reused": 1}
    finally:
        await client.http.post(f"/_test/gates/{ticket}")
        done = await first
    assert done.status_code == 201 and not replayed(done)
    after = await client.post("/labels", key, order)
    assert replayed(after) and after.content == done.content
    assert client.effects(ticket) == [("labels", None, 1)]


async def test_a_route_that_raises_writes_nothing_and_its_retry_runs(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket, "raise_times": 1}
    before = await client.metrics()
    failed = await client.post("/labels", key, order)
    assert failed.status_code == 500 and not replayed(failed)
    assert client.effects(ticket) == []  # the row the route wrote was rolled back
    assert (await client.status("/labels", key)).json()["state"] == "released"
    retry = await client.post("/labels", key, order)
    assert retry.status_code == 201 and not replayed(retry)
    assert client.effects(ticket) == [("labels", None, 2)]  # the second attempt of the operation
    assert replayed(await client.post("/labels", key, order))
    assert outcomes(before, await client.metrics(), "labels") == {"failed": 1, "processed": 1, "replayed": 1}


async def test_a_503_the_route_answers_is_not_kept(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket, "unavailable_times": 1}
    busy = await client.post("/labels", key, order)
    assert (busy.status_code, busy.json()) == (503, {"error": "busy"})  # the route's own answer, passed on
    assert client.effects(ticket) == []
    retry = await client.post("/labels", key, order)
    assert retry.status_code == 201 and not replayed(retry)
    assert client.effects(ticket) == [("labels", None, 2)]


async def test_a_4xx_the_route_chose_is_kept_and_replayed(client: Client) -> None:
    for status in (404, 409):
        key, ticket = client.key(), client.ticket()
        order = {"ticket": ticket, "status": status}
        first = await client.post("/labels", key, order)
        assert (first.status_code, first.json()) == (status, {"error": "no_such_order", "ticket": ticket})
        again = await client.post("/labels", key, order)
        assert (again.status_code, again.content, replayed(again)) == (status, first.content, True)
        assert "retry-after" not in again.headers
        assert client.effects(ticket) == [("labels", None, 1)]  # its writes committed with it, once
        assert (await client.status("/labels", key)).json()["status"] == status


async def test_a_response_too_big_to_keep_is_a_500_and_never_half_kept(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket, "size": RESPONSE_LIMIT + 100}
    before = await client.metrics()
    for _attempt in range(2):
        answer = await client.post("/labels", key, order)
        assert (answer.status_code, error(answer)) == (500, "idempotent_response_too_large")
        assert not replayed(answer)
        assert client.effects(ticket) == []
        assert (await client.status("/labels", key)).json()["state"] == "released"
    assert outcomes(before, await client.metrics(), "labels") == {"too_large": 2}
    fits = await client.post("/labels", key, {**order, "size": RESPONSE_LIMIT - 200})  # another request
    assert (fits.status_code, error(fits)) == (422, "idempotency_key_reused")


async def test_a_route_past_its_time_limit_is_a_503_and_writes_nothing(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    before = await client.metrics()
    started = time.monotonic()
    answer = await client.post("/slow", key, {"ticket": ticket, "sleep": 5})
    assert time.monotonic() - started < 3  # the route's limit is 0.5 s
    assert (answer.status_code, error(answer), answer.headers["retry-after"]) == (503, "request_timed_out", "1")
    assert client.effects(ticket) == []
    assert (await client.status("/slow", key)).json()["state"] == "released"
    assert outcomes(before, await client.metrics(), "slow") == {"timed_out": 1}
    fast = await client.post("/slow", client.key(), {"ticket": ticket})
    assert fast.status_code == 201 and client.effects(ticket) == [("slow", None, 1)]


async def test_routes_that_are_not_idempotent_work_as_before(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    answers = [await client.post("/plain", key, {"ticket": ticket}) for _ in range(2)]
    assert [(a.status_code, a.json(), replayed(a)) for a in answers] == [(201, {"ticket": ticket}, False)] * 2
    assert [r[0] for r in client.effects(ticket)] == ["plain", "plain"]
    assert (await client.http.post("/plain", json={"ticket": ticket})).status_code == 201
    assert (await client.http.get("/payments/charges/ch-1")).json() == {"charge": "ch-1"}  # GET: not covered
    assert (await client.http.get("/ops/healthz")).status_code == 200
    assert (await client.http.get("/ops/readyz")).json() == {"ready": True}
    assert (await client.http.get("/nowhere")).status_code == 404


async def test_the_prefix_style(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    missing = await client.post("/payments/charges", None, {"ticket": ticket})
    assert (missing.status_code, error(missing)) == (400, "idempotency_key_missing")
    before = await client.metrics()
    first = await client.post("/payments/charges", key, {"ticket": ticket})
    again = await client.post("/payments/charges", key, {"ticket": ticket})
    assert (first.status_code, again.status_code, replayed(first), replayed(again)) == (201, 201, False, True)
    assert again.content == first.content and again.headers["location"] == first.headers["location"]
    assert client.effects(ticket) == [("payments-charges", None, 1)]
    assert outcomes(before, await client.metrics(), "payments") == {"processed": 1, "replayed": 1}


async def test_the_starlette_endpoint_style(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket}
    first = await client.http.post("/receipts", json=order, headers={"Idempotency-Key": key})  # bare_keys=True
    again = await client.post("/receipts", key, order)  # the same key quoted
    assert (first.status_code, again.status_code, replayed(first), replayed(again)) == (201, 201, False, True)
    assert again.content == first.content
    assert again.headers["x-receipt"] == first.headers["x-receipt"]  # a replay_headers header is kept
    assert "x-run" not in again.headers
    assert client.effects(ticket) == [("receipts", None, 1)]
    reused = await client.post("/receipts", key, {"ticket": client.ticket()})
    assert (reused.status_code, error(reused)) == (422, "idempotency_key_reused")
    missing = await client.post("/receipts", None, order)
    assert (missing.status_code, error(missing)) == (400, "idempotency_key_missing")


async def test_a_key_seen_again_after_its_record_was_swept(client: Client) -> None:
    refuse, run, ticket = client.key(), client.key(), client.ticket()
    order = {"ticket": ticket}
    assert (await client.post("/late/refuse", refuse, order)).status_code == 201
    ran = await client.post("/late/run", run, order)
    assert ran.status_code == 201
    await past_retention(client, 2)
    assert (await client.status("/late/refuse", refuse)).json() == {"state": "expired"}
    before = await client.metrics()
    late = await client.post("/late/refuse", refuse, order)
    assert (late.status_code, error(late)) == (422, "idempotency_key_expired")
    again = await client.post("/late/run", run, order)
    assert again.status_code == 201 and not replayed(again) and again.json()["id"] != ran.json()["id"]
    assert replayed(await client.post("/late/run", run, order))
    assert sorted(client.effects(ticket)) == [("late-refuse", None, 1), ("late-run", None, 1), ("late-run", None, 1)]
    after = await client.metrics()
    late_total = "consumer_kit_late_deliveries_total"
    assert grew(before, after, late_total, source="http:late-refuse", action="refused") == 1
    assert grew(before, after, late_total, source="http:late-run", action="processed") == 1
    assert grew(before, after, late_total, source="http:late-run", action="refused") == 0
    assert outcomes(before, after, "late-refuse") == {"key_expired": 1}
    assert outcomes(before, after, "late-run") == {"processed": 1, "replayed": 1}


@pytest.mark.parametrize("path", ["/labels", "/one", "/staged"])
async def test_200_requests_at_once_with_one_key_run_it_once(client: Client, path: str) -> None:
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket, "sleep": 0.05}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=str(client.http.base_url), limits=limits, timeout=60) as many:
        answers = await asyncio.gather(*(many.post(path, json=order, headers={"Idempotency-Key": quoted(key)})
                                         for _ in range(200)))
    ran = [a for a in answers if a.status_code == 201 and not replayed(a)]
    assert len(ran) == 1, [a.status_code for a in answers]
    for answer in answers:
        if answer.status_code == 409:
            assert error(answer) == "request_in_progress" and int(answer.headers["retry-after"]) >= 1
            # in one transaction on SQLite, whose one writer the first holds, the others wait and replay;
            # a staged route holds nothing while it runs, so its repeats replay the one that was written
            assert not (path == "/one" and on_sqlite(client)) and path != "/staged"
        else:
            assert (answer.status_code, answer.content) == (201, ran[0].content)
    assert client.effects(ticket) == [(path.strip("/"), None, 1)]
    late = await client.post(path, key, order)
    assert replayed(late) and late.content == ran[0].content


async def test_tenants_keep_their_keys_apart(client: Client) -> None:
    key, mine, theirs = client.key(), client.ticket(), client.ticket()
    a = await client.post("/labels", key, {"ticket": mine}, token="token-a")
    b = await client.post("/labels", key, {"ticket": theirs}, token="token-b")  # same key, other tenant
    assert (a.status_code, b.status_code, replayed(b)) == (201, 201, False)
    assert (a.json()["caller"], b.json()["caller"]) == ("tenant-a", "tenant-b")
    assert client.effects(mine) == [("labels", "tenant-a", 1)]
    assert client.effects(theirs) == [("labels", "tenant-b", 1)]
    for token, first in (("token-a", a), ("token-b", b)):
        ticket = mine if token == "token-a" else theirs
        repeat = await client.post("/labels", key, {"ticket": ticket}, token=token)
        assert replayed(repeat) and repeat.content == first.content

    # B sending A's very request under A's key runs B's own operation, never A's answer
    shared, ticket = client.key(), client.ticket()
    a_first = await client.post("/labels", shared, {"ticket": ticket}, token="token-a")
    assert (await client.status("/labels", shared, token="token-b")).status_code == 404
    assert (await client.status("/labels", shared, token="token-a")).json()["state"] == "completed"
    b_same = await client.post("/labels", shared, {"ticket": ticket}, token="token-b")
    unscoped = await client.post("/labels", shared, {"ticket": ticket})
    assert (b_same.status_code, replayed(b_same), unscoped.status_code, replayed(unscoped)) == (201, False, 201, False)
    assert len({a_first.json()["id"], b_same.json()["id"], unscoped.json()["id"]}) == 3
    assert b_same.json()["caller"] == "tenant-b" and unscoped.json()["caller"] is None
    assert sorted(client.effects(ticket), key=str) == sorted(
        [("labels", "tenant-a", 1), ("labels", "tenant-b", 1), ("labels", None, 1)], key=str)
    assert (await client.post("/labels", shared, {"ticket": ticket}, token="bogus")).status_code == 401


async def test_neither_the_log_nor_the_metrics_show_a_key(client: Client, served: tuple[Server, Logged]) -> None:
    _server, logged = served
    start = len(logged.texts)
    before = await client.metrics()
    keys = [client.key() for _ in range(5)]
    ticket = client.ticket()
    await client.post("/labels", keys[0], {"ticket": ticket})
    await client.post("/labels", keys[0], {"ticket": ticket})
    await client.post("/labels", keys[0], {"ticket": ticket, "size": 1})
    await client.post("/labels", keys[1], {"ticket": client.ticket(), "raise_times": 1})
    await client.post("/labels", keys[2], {"ticket": ticket, "size": RESPONSE_LIMIT * 2})
    await client.post("/slow", keys[3], {"ticket": ticket, "sleep": 2})
    await client.http.post("/labels", json={"ticket": ticket}, headers={"Idempotency-Key": keys[4]})
    after = await client.metrics()
    assert outcomes(before, after, "labels") == {"processed": 1, "replayed": 1, "key_reused": 1, "failed": 1,
                                                 "too_large": 1, "key_malformed": 1}
    assert grew(before, after, "consumer_kit_http_idempotent_seconds_count", endpoint="labels") == 1
    logs = "\n".join(logged.texts[start:])
    # what went wrong is there to read (so the log was captured), each key only as its digest
    assert "Exception in ASGI application" in logs and "RuntimeError: the route failed on purpose" in logs
    assert f"over the {RESPONSE_LIMIT} byte limit" in logs and "[labels " in logs
    # (the client fixture checks that no key is in the log or in /metrics)


# --- tracing ----------------------------------------------------------------------------------------


TRACEPARENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT_SPAN = "b7ad6b7169203331"


def attributes_of(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def traced_requests(base: str, key: str, ticket: str) -> list[int]:
    parent = f"00-{TRACEPARENT_TRACE}-{TRACEPARENT_SPAN}-01"
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        answers = [
            await http.post("/labels", json={"ticket": ticket}, headers={"Idempotency-Key": quoted(key),
                                                                          "traceparent": parent}),
            await http.post("/labels", json={"ticket": ticket}, headers={"Idempotency-Key": quoted(key)}),
            await http.post("/labels", json={"ticket": ticket, "size": 1}, headers={"Idempotency-Key": quoted(key)}),
            await http.post("/labels", json={"ticket": ticket}, headers={"Idempotency-Key": key}),
        ]
    return [a.status_code for a in answers]


async def test_each_request_is_a_server_span_with_the_keys_digest(database: Database, spans: Spans) -> None:
    key, ticket = f"traced-{uuid.uuid4().hex}", f"t-{uuid.uuid4().hex[:12]}"
    api = build(app_settings(database), tracer_provider=spans.provider, telemetry={"tracing": False})
    async with served_asgi(api) as base:
        assert await traced_requests(base, key, ticket) == [201, 201, 422, 400]
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            busy = await http.post("/labels", json={"ticket": f"{ticket}-busy", "unavailable_times": 1},
                                   headers={"Idempotency-Key": quoted(f"{key}-busy")})
            slow = await http.post("/slow", json={"ticket": ticket, "sleep": 3},
                                   headers={"Idempotency-Key": quoted(key)})
        assert (busy.status_code, slow.status_code) == (503, 503)
    # a 5xx given back says what the client was answered
    (busy_span,) = [s for s in spans.named("POST labels") if attributes_of(s)["consumer_kit.outcome"] == "failed"]
    assert attributes_of(busy_span)["http.response.status_code"] == 503
    slow_span = dict(spans.one("POST slow").attributes or {})
    assert (slow_span["http.response.status_code"], slow_span["consumer_kit.outcome"]) == (503, "timed_out")
    requests = [s for s in spans.named("POST labels") if s is not busy_span]
    assert len(requests) == 4, [s.name for s in spans.finished]
    assert {s.kind for s in requests} == {SpanKind.SERVER}
    first, replay, reused, malformed = sorted(requests, key=lambda s: s.start_time or 0)
    assert format(first.context.trace_id, "032x") == TRACEPARENT_TRACE  # the client's trace goes on
    assert first.parent is not None and format(first.parent.span_id, "016x") == TRACEPARENT_SPAN
    seen = [(attributes_of(s)["http.response.status_code"], attributes_of(s)["consumer_kit.outcome"])
            for s in (first, replay, reused, malformed)]
    assert seen == [(201, "processed"), (201, "replayed"), (422, "key_reused"), (400, "key_malformed")]
    for span in requests:
        attributes = dict(span.attributes or {})
        assert (attributes["http.request.method"], attributes["url.path"], attributes["consumer_kit.endpoint"]) == (
            "POST", "/labels", "labels")
    digests = {dict(s.attributes or {}).get("consumer_kit.key.digest") for s in (first, replay, reused)}
    assert len(digests) == 1 and None not in digests  # one key, one digest
    assert "consumer_kit.key.digest" not in dict(malformed.attributes or {})
    assert not [t for t in span_texts(spans.finished) if key in t]


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_inside_fastapis_own_server_span_the_request_is_its_child(database: Database, spans: Spans) -> None:
    key, ticket = f"traced-{uuid.uuid4().hex}", f"t-{uuid.uuid4().hex[:12]}"
    api = build(app_settings(database), tracer_provider=spans.provider,
                telemetry={"tracer_provider": spans.provider})
    async with served_asgi(api) as base:
        assert await traced_requests(base, key, ticket) == [201, 201, 422, 400]
    ours = spans.named("POST labels")
    assert len(ours) == 4 and {s.kind for s in ours} == {SpanKind.INTERNAL}
    by_id = {s.context.span_id: s for s in spans.finished}
    servers = {s.context.span_id for s in spans.finished if s.kind is SpanKind.SERVER and s.name == "POST /labels"}
    assert len(servers) == 4
    for span in ours:  # under FastAPI's span of the request (through its span of the dependencies)
        line = [span]
        while line[-1].parent is not None and line[-1].parent.span_id in by_id:
            line.append(by_id[line[-1].parent.span_id])
        assert line[-1].context.span_id in servers, [s.name for s in line]
    assert not [t for t in span_texts(spans.finished) if key in t]


# --- one transaction (single_transaction=True) ------------------------------------------------------


def on_sqlite(client: Client) -> bool:
    return client.database.url.startswith("sqlite")


@pytest.mark.parametrize("path", ["/one", "/fast/orders"])
async def test_in_one_transaction_the_first_request_runs_once_and_repeats_replay(client: Client, path: str) -> None:
    key, ticket = client.key(), client.ticket()
    name = path.strip("/").replace("/", "-")
    before = await client.metrics()
    first = await client.post(path, key, {"ticket": ticket})
    assert first.status_code == 201 and not replayed(first)
    repeats = [await client.post(path, key, {"ticket": ticket}) for _ in range(20)]  # the later ones read first
    assert all(replayed(r) and (r.status_code, r.content) == (201, first.content) for r in repeats)
    assert repeats[0].headers["location"] == first.headers["location"]
    other = await client.post(path, key, {"ticket": ticket, "size": 1})
    assert (other.status_code, error(other)) == (422, "idempotency_key_reused")
    assert client.effects(ticket) == [(name, None, 1)]
    endpoint = name.split("-")[0]
    assert outcomes(before, await client.metrics(), endpoint) == {"processed": 1, "replayed": 20, "key_reused": 1}


async def test_in_one_transaction_tenants_keep_their_keys_apart(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    a = await client.post("/one", key, {"ticket": ticket}, token="token-a")
    b = await client.post("/one", key, {"ticket": ticket}, token="token-b")
    assert (a.status_code, b.status_code, replayed(b)) == (201, 201, False)
    assert (await client.status("/one", key, token="token-a")).json()["state"] == "completed"
    assert (await client.status("/one", key)).status_code == 404
    assert sorted(client.effects(ticket), key=str) == sorted([("one", "tenant-a", 1), ("one", "tenant-b", 1)], key=str)


async def test_in_one_transaction_a_repeat_while_the_first_runs(client: Client) -> None:
    """PostgreSQL: the key's lock is held, so the repeat (and another request with the key) is a 409 at
    once. SQLite: its one writer has the repeat wait for the first, whose answer it then gets."""
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket, "gate": True}
    first = asyncio.create_task(client.post("/one", key, order))
    try:
        if on_sqlite(client):
            await asyncio.sleep(0.3)  # nothing of it is visible while it runs: give it time to start
            repeat = asyncio.create_task(client.post("/one", key, order))
            await asyncio.sleep(0.3)
            assert not repeat.done()
        else:
            deadline = time.monotonic() + 10
            while not client.database.advisory_locks():  # the first holds its key
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            answer = await client.post("/one", key, order)
            assert (answer.status_code, error(answer)) == (409, "request_in_progress")
            assert answer.headers["retry-after"] == "1"
            other = await client.post("/one", key, {"ticket": ticket})
            assert (other.status_code, error(other)) == (409, "request_in_progress")
            assert (await client.status("/one", key)).status_code == 404  # nothing committed while it runs
    finally:
        await client.http.post(f"/_test/gates/{ticket}")
        done = await first
    assert done.status_code == 201 and not replayed(done)
    if on_sqlite(client):
        waited = await repeat
        assert replayed(waited) and waited.content == done.content
    assert client.effects(ticket) == [("one", None, 1)]


async def test_in_one_transaction_a_failure_leaves_nothing_behind(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket, "raise_times": 1, "unavailable_times": 2}
    raised = await client.post("/one", key, order)
    assert raised.status_code == 500 and client.effects(ticket) == []
    busy = await client.post("/one", key, order)  # no lease to wait out: it runs again at once
    assert busy.status_code == 503 and client.effects(ticket) == []
    assert (await client.status("/one", key)).status_code == 404
    ran = await client.post("/one", key, order)
    assert ran.status_code == 201 and not replayed(ran)
    assert client.effects(ticket) == [("one", None, 1)]
    assert replayed(await client.post("/one", key, order))


async def test_in_one_transaction_a_key_seen_again_after_its_record_was_swept(client: Client) -> None:
    refuse, run, ticket = client.key(), client.key(), client.ticket()
    assert (await client.post("/one/late", refuse, {"ticket": ticket})).status_code == 201
    ran = await client.post("/one/late-run", run, {"ticket": ticket})
    assert ran.status_code == 201
    await past_retention(client, 2)
    late = await client.post("/one/late", refuse, {"ticket": ticket})
    assert (late.status_code, error(late)) == (422, "idempotency_key_expired")
    again = await client.post("/one/late-run", run, {"ticket": ticket})
    assert again.status_code == 201 and not replayed(again) and again.json()["id"] != ran.json()["id"]
    assert replayed(await client.post("/one/late-run", run, {"ticket": ticket}))
    assert sorted(client.effects(ticket)) == [("one-late", None, 1), ("one-late-run", None, 1),
                                              ("one-late-run", None, 1)]


# --- staged routes (staged=True) ----------------------------------------------------------------------


@pytest.mark.parametrize("twice", [False, True], ids=["one-statement", "two-statements"])
async def test_staged_the_first_request_runs_once_and_repeats_replay(client: Client, twice: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL on asyncpg one staged statement goes with the key in a single statement; two go in
    one transaction after the route, as on SQLite. Either way: written once, replayed after."""
    sent: list[str] = []
    write_with_key = Inbox.write_with_key

    async def counted(inbox: Inbox, *args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs["statement"])
        return await write_with_key(inbox, *args, **kwargs)

    monkeypatch.setattr(Inbox, "write_with_key", counted)  # the server runs in this process
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket, "stage_twice": twice}
    wrote = [("staged", None, 1), ("staged-again", None, 1)] if twice else [("staged", None, 1)]
    before = await client.metrics()
    first = await client.post("/staged", key, order)
    assert first.status_code == 201 and not replayed(first)
    assert sorted(client.effects(ticket), key=str) == sorted(wrote, key=str)
    repeats = [await client.post("/staged", key, order) for _ in range(10)]  # the later ones read first
    assert all(replayed(r) and (r.status_code, r.content) == (201, first.content) for r in repeats)
    assert repeats[0].headers["location"] == first.headers["location"]
    other = await client.post("/staged", key, {**order, "size": 1})
    assert (other.status_code, error(other)) == (422, "idempotency_key_reused")
    theirs = await client.post("/staged", key, order, token="token-a")  # another tenant's key
    assert (theirs.status_code, replayed(theirs)) == (201, False)
    assert (await client.status("/staged", key)).json()["state"] == "completed"
    assert sorted(client.effects(ticket), key=str) == sorted([*wrote, *((r, "tenant-a", a) for r, _, a in wrote)],
                                                           key=str)
    assert outcomes(before, await client.metrics(), "staged") == {"processed": 2, "replayed": 10, "key_reused": 1}
    # in one statement: at least the first request and the other tenant's (a repeat may be answered
    # by a read before its route runs, or by its statement's conflict)
    if twice or on_sqlite(client) or client.database.partitioned:  # the partitioned inbox: one transaction
        assert sent == []
    else:
        assert len(sent) >= 2 and set(sent) == {sent[0]}


async def test_staged_a_failure_or_a_5xx_writes_nothing_and_the_retry_runs(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    order = {"ticket": ticket, "raise_times": 1, "unavailable_times": 2}
    raised = await client.post("/staged", key, order)
    assert raised.status_code == 500 and client.effects(ticket) == []
    busy = await client.post("/staged", key, order)
    assert busy.status_code == 503 and client.effects(ticket) == []
    assert (await client.status("/staged", key)).status_code == 404
    ran = await client.post("/staged", key, order)
    assert ran.status_code == 201 and not replayed(ran)
    assert replayed(await client.post("/staged", key, order))
    assert client.effects(ticket) == [("staged", None, 1)]
    too_big = await client.post("/staged", client.key(), {"ticket": client.ticket(), "size": RESPONSE_LIMIT})
    assert (too_big.status_code, error(too_big)) == (500, "idempotent_response_too_large")


async def test_a_staged_route_that_reaches_for_the_connection_fails_and_writes_nothing(client: Client) -> None:
    key, ticket = client.key(), client.ticket()
    answer = await client.post("/staged", key, {"ticket": ticket, "use_connection": True})
    assert answer.status_code == 500
    assert client.effects(ticket) == [] and (await client.status("/staged", key)).status_code == 404


async def test_staged_a_key_seen_again_after_its_record_was_swept(client: Client) -> None:
    refuse, run, ticket = client.key(), client.key(), client.ticket()
    assert (await client.post("/staged", refuse, {"ticket": ticket})).status_code == 201
    ran = await client.post("/staged/run", run, {"ticket": ticket})
    assert ran.status_code == 201
    await past_retention(client, 2)
    before = await client.metrics()
    late = await client.post("/staged", refuse, {"ticket": ticket})
    assert (late.status_code, error(late)) == (422, "idempotency_key_expired")
    again = await client.post("/staged/run", run, {"ticket": ticket})
    assert again.status_code == 201 and not replayed(again) and again.json()["id"] != ran.json()["id"]
    assert replayed(await client.post("/staged/run", run, {"ticket": ticket}))
    assert sorted(client.effects(ticket)) == [("staged", None, 1), ("staged-run", None, 1), ("staged-run", None, 1)]
    after = await client.metrics()
    late_total = "consumer_kit_late_deliveries_total"
    assert grew(before, after, late_total, source="http:staged", action="refused") == 1
    assert grew(before, after, late_total, source="http:staged-run", action="processed") == 1
    assert outcomes(before, after, "staged") == {"key_expired": 1}
    assert outcomes(before, after, "staged-run") == {"processed": 1, "replayed": 1}


# --- the partitioned inbox (INBOX_PARTITION_SECONDS) ----------------------------------------------------


async def rotate(database: Database) -> int:
    """Make the next generation the current one, as the sweeper does once a generation has taken keys for
    ``INBOX_PARTITION_SECONDS``; the new generation."""
    conn = await asyncpg.connect(database.conninfo)
    try:
        await partitions.make_ahead(conn)
        for _ in range(100):
            generation = await partitions.rotate(conn, utcnow())
            if generation is not None:
                return generation
            await asyncio.sleep(0.01)  # a write held the rotation lock past the rotation's wait: again
        raise AssertionError("the inbox did not rotate")
    finally:
        await conn.close()


async def generation_of(database: Database, consumer: str, key: OperationKey) -> list[int]:
    """The generations of the rows of ``key`` (as the app digests it) in ``consumer``'s scope."""
    digest = app_settings(database).digester().candidates(key)[0]
    conn = await asyncpg.connect(database.conninfo)
    try:
        # Kept for an hour more: the module's retention is seconds, and the repeat must find the row, not its
        # tombstone, however slowly this host runs.
        await conn.execute("UPDATE inbox SET expires_at = expires_at + interval '1 hour'"
                           " WHERE consumer = $1 AND key_digest = $2", consumer, digest)
        return [g for (g,) in await conn.fetch("SELECT generation FROM inbox WHERE consumer = $1"
                                               " AND key_digest = $2", consumer, digest)]
    finally:
        await conn.close()


@pytest.mark.parametrize("database", [PARTITIONED], indirect=True)
@pytest.mark.parametrize("path", ["/labels", "/one", "/staged"])
async def test_a_key_written_in_an_older_generation_is_replayed(client: Client, path: str) -> None:
    """On each path: a key whose row is in the generation before the current one is still the same request
    (replayed) or another one (422); a new key goes to the current generation; each key one row."""
    key, ticket = client.key(), client.ticket()
    name = path.strip("/")
    first = await client.post(path, key, {"ticket": ticket})
    assert first.status_code == 201 and not replayed(first)
    written = await generation_of(client.database, f"http:{name}", OperationKey(name, 1, key))
    assert len(written) == 1
    assert await rotate(client.database) == written[0] + 1
    again = await client.post(path, key, {"ticket": ticket})
    assert replayed(again) and (again.status_code, again.content) == (201, first.content)
    other = await client.post(path, key, {"ticket": ticket, "size": 1})
    assert (other.status_code, error(other)) == (422, "idempotency_key_reused")
    new = client.key()
    assert (await client.post(path, new, {"ticket": ticket})).status_code == 201
    assert await generation_of(client.database, f"http:{name}", OperationKey(name, 1, key)) == written
    assert await generation_of(client.database, f"http:{name}", OperationKey(name, 1, new)) == [written[0] + 1]
    assert client.effects(ticket) == [(name, None, 1), (name, None, 1)]
