"""The served coordinator under hostile or careless input, over a real loopback socket (SQLite and
PostgreSQL): delegations only from the caller's own active sessions, deeply nested JSON, a repeated
``Idempotency-Key`` or bearer. And the same delegation rule in process."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from sqlalchemy import func, select

from consumer_kit.coordinator import (
    CoordinatorRejected,
    DelegationRequest,
    EmbeddedCoordinator,
    HttpCoordinator,
    IdempotencyResultInactive,
    SessionRequest,
)
from consumer_kit.retry import RetryPolicy
from consumer_kit.settings import Settings
from consumer_kit.store import create_engine, ensure_schema
from consumer_kit.store.tables import coordinator_resources, idempotency_receipts
from consumer_kit.testing.server import served_coordinator
from tests.conftest import make_settings

# tok-a and tok-b: one tenant, two applications; tok-c: another tenant.
TOKENS = {"tok-a": ("t1", "app1"), "tok-b": ("t1", "app2"), "tok-c": ("t2", "app1")}
FAST = RetryPolicy(attempts=2, total_seconds=5, base_backoff=0.01, max_backoff=0.05)
SESSION = SessionRequest(labels=("research-agent",), task="Prepare T-1")


@pytest.fixture
async def base_url(database_url: str) -> AsyncIterator[str]:
    async with served_coordinator(make_settings(database_url), TOKENS) as url:
        yield url


@pytest.fixture
def server_errors() -> Iterator[list[logging.LogRecord]]:
    """What uvicorn logs at ERROR (an exception in the app: "Exception in ASGI application" + traceback).
    uvicorn's loggers do not propagate to the root logger, so listen on them directly."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.ERROR)
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "consumer_kit")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


def client(base_url: str, token: str) -> HttpCoordinator:
    return HttpCoordinator(base_url, token=token, policy=FAST)


async def delegations(database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            query = select(func.count()).select_from(coordinator_resources).where(
                coordinator_resources.c.kind == "delegation")
            return int((await conn.execute(query)).scalar_one())
    finally:
        await engine.dispose()


async def test_a_delegation_comes_only_from_an_own_session(base_url: str, database_url: str) -> None:
    owner, same_tenant_other_app, other_tenant = (client(base_url, t) for t in ("tok-a", "tok-b", "tok-c"))
    try:
        session = await owner.create_session(SESSION)
        request = DelegationRequest(from_session_id=session.session_id, to_subject="agent-2", scopes=("read",))
        for intruder in (same_tenant_other_app, other_tenant):
            for key in ("steal:v1:1", None):
                with pytest.raises(CoordinatorRejected) as refused:
                    await intruder.create_delegation(request, idempotency_key=key)
                assert (refused.value.status, refused.value.code) == (404, "session_not_found")
        missing = request.model_copy(update={"from_session_id": "0" * 32})
        with pytest.raises(CoordinatorRejected) as refused:
            await owner.create_delegation(missing, idempotency_key="d:v1:missing")
        assert (refused.value.status, refused.value.code) == (404, "session_not_found")
        assert await delegations(database_url) == 0  # nothing was created for any of them

        own = await owner.create_delegation(request, idempotency_key="d:v1:1")
        assert not own.replayed
        # A delegation's id is no session to delegate from.
        chained = request.model_copy(update={"from_session_id": own.delegation_id})
        with pytest.raises(CoordinatorRejected) as refused:
            await owner.create_delegation(chained)
        assert refused.value.status == 404
    finally:
        for each in (owner, same_tenant_other_app, other_tenant):
            await each.aclose()


async def test_the_wire_answers_for_delegation_sources(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as http:
        created = await http.post("/v1/sessions", json={"task": "t"}, headers={"Authorization": "Bearer tok-a"})
        session_id = created.json()["session_id"]
        body = {"from_session_id": session_id, "to_subject": "agent-2"}
        foreign = await http.post("/v1/delegations", json=body, headers={"Authorization": "Bearer tok-c"})
        assert (foreign.status_code, foreign.json()) == (404, {"error": "session_not_found"})
        own = await http.post("/v1/delegations", json=body, headers={"Authorization": "Bearer tok-a"})
        assert own.status_code == 201 and set(own.json()) == {"delegation_id", "status", "expires_at"}


async def test_ended_sessions_delegate_nothing_and_their_delegations_are_not_replayed(base_url: str) -> None:
    owner = client(base_url, "tok-a")
    try:
        session = await owner.create_session(SESSION)
        request = DelegationRequest(from_session_id=session.session_id, to_subject="agent-2")
        first = await owner.create_delegation(request, idempotency_key="d:v1:1")
        replay = await owner.create_delegation(request, idempotency_key="d:v1:1")
        assert replay.replayed and replay.delegation_id == first.delegation_id
        await owner.end_session(session.session_id)
        # Seed 000: a replay never hands out an identity that can no longer be used.
        with pytest.raises(IdempotencyResultInactive):
            await owner.create_delegation(request, idempotency_key="d:v1:1")
        for key in ("d:v1:2", None):  # a new delegation from the ended session
            with pytest.raises(CoordinatorRejected) as refused:
                await owner.create_delegation(request, idempotency_key=key)
            assert (refused.value.status, refused.value.code) == (409, "session_inactive")
        # The same key with other fields is still a conflict, whatever became of the session.
        with pytest.raises(CoordinatorRejected) as refused:
            await owner.create_delegation(request.model_copy(update={"to_subject": "x"}), idempotency_key="d:v1:1")
        assert refused.value.code == "idempotency_key_conflict"
    finally:
        await owner.aclose()


async def test_the_embedded_coordinator_enforces_the_same_rule(database_url: str) -> None:
    settings: Settings = make_settings(database_url)
    engine = create_engine(settings.database_url)
    acme = EmbeddedCoordinator(engine, settings, tenant="acme", application="tickets")
    try:
        await ensure_schema(engine)
        other = acme.scoped("globex", "tickets")
        session = await acme.create_session(SESSION)
        request = DelegationRequest(from_session_id=session.session_id, to_subject="agent-2")
        with pytest.raises(CoordinatorRejected) as refused:
            await other.create_delegation(request, idempotency_key="d:v1:1")
        assert (refused.value.status, refused.value.code) == (404, "session_not_found")
        assert not (await acme.create_delegation(request, idempotency_key="d:v1:1")).replayed
        await acme.revoke_session(session.session_id)
        with pytest.raises(IdempotencyResultInactive):
            await acme.create_delegation(request, idempotency_key="d:v1:1")
        with pytest.raises(CoordinatorRejected) as refused:
            await acme.create_delegation(request)
        assert (refused.value.status, refused.value.code) == (409, "session_inactive")
    finally:
        await acme.close()
        await engine.dispose()
    assert await delegations(database_url) == 1


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, body: bytes,
                   headers: dict[str, str]) -> tuple[int, bytes]:
    """One request and its whole response on an open connection (HTTP/1.1, Content-Length framed)."""
    head = f"POST {path} HTTP/1.1\r\nHost: coordinator\r\nContent-Type: application/json\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=10)
    assert status_line, "the server closed the connection"
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return int(status_line.split()[1]), await reader.readexactly(length)


async def test_deeply_nested_json_is_a_400_and_the_connection_lives_on(
        base_url: str, server_errors: list[logging.LogRecord]) -> None:
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    auth = {"Authorization": "Bearer tok-a"}
    try:
        nested = b"[" * 1000 + b"]" * 1000  # 2 KB, 1,000 levels: past the interpreter's recursion limit
        status, body = await exchange(reader, writer, "/v1/sessions", nested, auth)
        assert (status, json.loads(body)) == (400, {"error": "invalid_request"})
        # Shallow enough to parse, too deep to be a request: also refused before validation.
        metadata: dict[str, object] = {}
        for _ in range(40):
            metadata = {"a": metadata}
        status, body = await exchange(reader, writer, "/v1/sessions", json.dumps({"metadata": metadata}).encode(),
                                      {**auth, "Idempotency-Key": "deep:v1:1"})
        assert (status, json.loads(body)) == (400, {"error": "invalid_request"})
        # The same connection (keep-alive) still serves: a real request with nested metadata.
        reasonable = {"task": "t", "metadata": {"ticket": {"labels": [["a", "b"], {"c": [1, 2]}]}}}
        status, body = await exchange(reader, writer, "/v1/sessions", json.dumps(reasonable).encode(),
                                      {**auth, "Idempotency-Key": "deep:v1:2"})
        assert status == 201 and set(json.loads(body)) == {"session_id", "status", "expires_at"}
    finally:
        writer.close()
    assert not server_errors, [record.getMessage() for record in server_errors]


async def test_a_repeated_idempotency_key_or_bearer_is_refused(base_url: str, database_url: str) -> None:
    body = SESSION.model_dump(mode="json")
    async with httpx.AsyncClient(base_url=base_url) as http:
        twice = await http.post("/v1/sessions", json=body, headers=[
            ("Authorization", "Bearer tok-a"), ("Idempotency-Key", "k:v1:1"), ("Idempotency-Key", "k:v1:2")])
        assert (twice.status_code, twice.json()) == (400, {"error": "invalid_idempotency_key"})
        same_twice = await http.post("/v1/sessions", json=body, headers=[
            ("Authorization", "Bearer tok-a"), ("Idempotency-Key", "k:v1:1"), ("Idempotency-Key", "k:v1:1")])
        assert same_twice.status_code == 400
        bearers = await http.post("/v1/sessions", json=body, headers=[
            ("Authorization", "Bearer tok-a"), ("Authorization", "Bearer tok-c"), ("Idempotency-Key", "k:v1:1")])
        assert bearers.status_code == 401
        once = await http.post("/v1/sessions", json=body, headers={"Authorization": "Bearer tok-a",
                                                                   "Idempotency-Key": "k:v1:1"})
        assert once.status_code == 201 and "Idempotency-Replayed" not in once.headers
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:  # only the last request left a receipt
            count = (await conn.execute(select(func.count()).select_from(idempotency_receipts))).scalar_one()
    finally:
        await engine.dispose()
    assert count == 1
