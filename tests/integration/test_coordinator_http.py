"""The served coordinator over a real loopback socket, through HttpCoordinator and raw httpx."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import select

from consumer_kit import InvalidKey
from consumer_kit.coordinator import (
    CoordinatorRejected,
    HttpCoordinator,
    IdempotencyKeyConflict,
    IdempotencyResultInactive,
    ReceiptLimitExceeded,
    SessionRequest,
)
from consumer_kit.retry import RetryPolicy
from consumer_kit.store import create_engine
from consumer_kit.store.tables import idempotency_receipts
from consumer_kit.testing.server import served_coordinator
from tests.conftest import make_settings

KEY = "ticket-queue:v1:m-1-session"
REQUEST = SessionRequest(labels=("research-agent",), task="Prepare T-1")
TOKENS = {"tok-a": ("t1", "app1"), "tok-b": ("t1", "app2"), "tok-c": ("t2", "app1")}
FAST = RetryPolicy(attempts=3, total_seconds=5, base_backoff=0.01, max_backoff=0.05)


@pytest.fixture
async def base_url(database_url: str) -> AsyncIterator[str]:
    settings = make_settings(database_url, idempotency_max_receipts_per_scope=5, coordinator_body_limit_bytes=4096)
    async with served_coordinator(settings, TOKENS) as url:
        yield url


def client(base_url: str, token: str = "tok-a", **kwargs: object) -> HttpCoordinator:
    return HttpCoordinator(base_url, token=token, policy=FAST, **kwargs)  # type: ignore[arg-type]


async def test_recipe_over_http(base_url: str) -> None:
    coord = client(base_url)
    try:
        first = await coord.create_session(REQUEST, idempotency_key=KEY)
        again = await coord.create_session(REQUEST, idempotency_key=KEY)
        assert not first.replayed and again.replayed and again.session_id == first.session_id
        with pytest.raises(IdempotencyKeyConflict):
            await coord.create_session(REQUEST.model_copy(update={"labels": ("other",)}), idempotency_key=KEY)
        await coord.end_session(first.session_id)
        with pytest.raises(IdempotencyResultInactive):
            await coord.create_session(REQUEST, idempotency_key=KEY)
    finally:
        await coord.aclose()


async def test_wire_answers(base_url: str) -> None:
    auth = {"Authorization": "Bearer tok-a"}
    body = REQUEST.model_dump(mode="json")
    async with httpx.AsyncClient(base_url=base_url) as http:
        created = await http.post("/v1/sessions", json=body, headers={**auth, "Idempotency-Key": KEY})
        assert created.status_code == 201 and set(created.json()) == {"session_id", "status", "expires_at"}
        assert "Idempotency-Replayed" not in created.headers
        replay = await http.post("/v1/sessions", json=body, headers={**auth, "Idempotency-Key": KEY})
        assert replay.status_code == 201 and replay.json() == created.json()
        assert replay.headers["Idempotency-Replayed"] == "true"
        conflict = await http.post("/v1/sessions", json={**body, "task": "changed"},
                                   headers={**auth, "Idempotency-Key": KEY})
        assert (conflict.status_code, conflict.json()) == (409, {"error": "idempotency_key_conflict"})
        ended = await http.post(f"/v1/sessions/{created.json()['session_id']}/end", headers=auth)
        assert ended.status_code == 204
        inactive = await http.post("/v1/sessions", json=body, headers={**auth, "Idempotency-Key": KEY})
        assert (inactive.status_code, inactive.json()) == (409, {"error": "idempotency_result_inactive"})
        # (surrounding spaces cannot cross HTTP/1.1: parsers strip them; the client refuses them)
        for bad in ("", "x" * 256, "tab\there", "caf\u00e9" * 60):  # 240 characters, 300 UTF-8 bytes
            answer = await http.post("/v1/sessions", json=body,
                                     headers={b"Authorization": b"Bearer tok-a", b"Idempotency-Key": bad.encode()})
            assert (answer.status_code, answer.json()) == (400, {"error": "invalid_idempotency_key"})
        for headers in ({"Authorization": "Bearer nope"}, {}, {"Authorization": "Basic tok-a"}):
            answer = await http.post("/v1/sessions", json=body, headers=headers)
            assert answer.status_code == 401
        assert (await http.post("/v1/sessions/unknown/end", headers=auth)).status_code == 404
        assert (await http.post("/v1/sessions", content=b"{not json", headers=auth)).status_code == 400
        assert (await http.get("/healthz")).status_code == 200
        metrics = (await http.get("/metrics")).text
        for outcome in ("created", "replayed", "conflicts", "invalid", "expired"):
            assert f'caracal_idempotency_requests_total{{outcome="{outcome}"}}' in metrics
        assert "caracal_idempotency_receipts " in metrics and "caracal_idempotency_oldest_seconds " in metrics


async def test_routing_answers_as_an_http_server_should(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as http:
        unknown = await http.post("/v1/elsewhere", headers={"Authorization": "Bearer tok-a"})
        assert unknown.status_code == 404
        wrong = await http.get("/v1/sessions")
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
        assert (await http.post("/healthz")).status_code == 405
        assert (await http.get("/v1/sessions/s-1/end")).status_code == 405
        head = await http.head("/healthz")
        assert (head.status_code, head.content) == (200, b"")
        health = await http.get("/healthz")
        assert (health.json(), health.headers["content-type"]) == ({"status": "ok"}, "application/json")
        unknown_action = await http.post("/v1/sessions/s-1/pause", headers={"Authorization": "Bearer tok-a"})
        assert (unknown_action.status_code, unknown_action.json()) == (404, {"error": "not_found"})
        ended = await http.post("/v1/sessions/s-1/end")  # no bearer: refused before the session is looked up
        assert (ended.status_code, ended.json()) == (401, {"error": "unauthorized"})


async def test_utf8_keys_cross_the_wire(base_url: str) -> None:
    coord = client(base_url)
    key = "caf\u00e9:v1:" + "\u00e9" * 100  # 200 UTF-8 bytes: valid
    first = await coord.create_session(REQUEST, idempotency_key=key)
    assert (await coord.create_session(REQUEST, idempotency_key=key)).session_id == first.session_id
    await coord.aclose()


async def test_body_limit(base_url: str) -> None:
    auth = {"Authorization": "Bearer tok-a", "Idempotency-Key": KEY}
    big = {"task": "x" * 3000, "metadata": {"pad": "y" * 2000}}
    received: list[int] = []

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the server must count
        for _ in range(1000):
            received.append(1)
            yield b" " * 1024

    async with httpx.AsyncClient(base_url=base_url) as http:
        declared = await http.post("/v1/sessions", json=big, headers=auth)
        assert declared.status_code == 413
        streamed = await http.post("/v1/sessions", content=chunked(), headers=auth)
        assert streamed.status_code == 413
        small = await http.post("/v1/sessions", json={"task": "fits"}, headers=auth)
        assert small.status_code == 201
    # A declared 10 MB body is refused from its headers alone: the server answers without waiting for it.
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-a\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n{")
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=5)
    writer.close()
    assert status_line.split()[1] == b"413"
    # A chunked body (no Content-Length) is counted while streaming: 413 before the body ever ends.
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-a\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b" " * 1024 + b"\r\n")
    for _ in range(5):
        writer.write(b"400\r\n" + b" " * 1024 + b"\r\n")
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=5)
    writer.close()
    assert status_line.split()[1] == b"413"


async def test_isolation_by_bearer(base_url: str) -> None:
    sessions = set()
    for token in ("tok-a", "tok-b", "tok-c"):
        coord = client(base_url, token)
        receipt = await coord.create_session(REQUEST, idempotency_key=KEY)
        assert not receipt.replayed
        sessions.add(receipt.session_id)
        await coord.aclose()
    assert len(sessions) == 3
    other = client(base_url, "tok-b")
    with pytest.raises(CoordinatorRejected) as caught:  # a session of another application
        await other.end_session(next(iter(sessions - {(await other.create_session(
            REQUEST, idempotency_key=KEY)).session_id})))
    assert caught.value.status == 404
    await other.aclose()


async def test_receipt_cap_over_http(base_url: str) -> None:
    coord = client(base_url)
    for n in range(5):
        await coord.create_session(REQUEST, idempotency_key=f"k:{n}")
    with pytest.raises(ReceiptLimitExceeded):
        await coord.create_session(REQUEST, idempotency_key="k:5")
    async with httpx.AsyncClient(base_url=base_url) as http:
        answer = await http.post("/v1/sessions", json={}, headers={"Authorization": "Bearer tok-a",
                                                                    "Idempotency-Key": "k:6"})
    assert (answer.status_code, answer.json()) == (429, {"error": "idempotency_receipt_limit"})
    await coord.aclose()


async def test_client_validates_keys_and_generates_one(base_url: str, database_url: str) -> None:
    coord = client(base_url)
    with pytest.raises(InvalidKey):
        await coord.create_session(REQUEST, idempotency_key=" bad")
    receipt = await coord.create_session(REQUEST)  # no key: a generated one, kept the shorter window
    assert not receipt.replayed
    await coord.aclose()
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(select(idempotency_receipts.c.generated))).all()
    finally:
        await engine.dispose()
    assert [row.generated for row in rows] == [True]


async def test_bearer_refreshed_once(base_url: str) -> None:
    refreshes: list[int] = []

    async def refresh() -> str:
        refreshes.append(1)
        return "tok-a"

    coord = client(base_url, "expired-token", refresh_token=refresh)
    assert not (await coord.create_session(REQUEST, idempotency_key=KEY)).replayed
    assert refreshes == [1]
    await coord.aclose()

    async def useless() -> str:
        refreshes.append(2)
        return "still-wrong"

    coord = client(base_url, "expired-token", refresh_token=useless)
    with pytest.raises(CoordinatorRejected) as caught:
        await coord.create_session(REQUEST, idempotency_key=KEY)
    assert caught.value.status == 401 and refreshes == [1, 2]
    await coord.aclose()


async def test_delegations_over_http(base_url: str) -> None:
    from consumer_kit.coordinator import DelegationRequest

    coord = client(base_url)
    session = await coord.create_session(REQUEST)
    request = DelegationRequest(from_session_id=session.session_id, to_subject="agent-2", scopes=("read",))
    first = await coord.create_delegation(request, idempotency_key=KEY)
    again = await coord.create_delegation(request, idempotency_key=KEY)
    assert not first.replayed and again.replayed and again.delegation_id == first.delegation_id
    with pytest.raises(IdempotencyKeyConflict):
        await coord.create_delegation(request.model_copy(update={"scopes": ("write",)}), idempotency_key=KEY)
    await coord.aclose()


async def test_the_served_app_sweeps_while_it_is_up_and_stops_sweeping_with_it(database_url: str) -> None:
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import func

    from consumer_kit.coordinator import EmbeddedCoordinator
    from consumer_kit.coordinator.server import create_app
    from consumer_kit.store import ensure_schema
    from consumer_kit.testing.server import served_asgi

    now = [datetime.now(UTC)]
    settings = make_settings(database_url, idempotency_retention_seconds=10)
    engine = create_engine(settings.database_url)
    coordinator = EmbeddedCoordinator(engine, settings, clock=lambda: now[0], tenant="t-sweep", application="a")

    async def receipts() -> int:
        async with engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(idempotency_receipts).where(
                idempotency_receipts.c.tenant == "t-sweep"))).scalar_one())

    try:
        await ensure_schema(engine)
        for n in range(3):
            await coordinator.create_session(REQUEST, idempotency_key=f"sweep:v1:{n}")
        assert await receipts() == 3
        now[0] += timedelta(seconds=11)  # all three past their retention
        async with served_asgi(create_app(coordinator, {}, sweep_interval=0.05), settings=settings):
            async with asyncio.timeout(10):
                while await receipts():  # noqa: ASYNC110 (polled: the sweep is the server's own)
                    await asyncio.sleep(0.05)
        await coordinator.create_session(REQUEST, idempotency_key="sweep:v1:after")
        await asyncio.sleep(0.2)  # the server is gone: nothing sweeps any more
        now[0] += timedelta(seconds=11)
        await asyncio.sleep(0.2)
        assert await receipts() == 1
    finally:
        await coordinator.close()
        await engine.dispose()
