"""HttpCoordinator against a real misbehaving server: a TCP proxy in front of the served coordinator
that answers 503, 429 with Retry-After, or forwards and then drops the connection after the
coordinator committed. Every attempt must carry the same key, and exactly one session is created."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from sqlalchemy import func, select

from consumer_kit.coordinator import (
    CoordinatorRejected,
    CoordinatorUnavailable,
    HttpCoordinator,
    IdempotencyKeyConflict,
    SessionRequest,
)
from consumer_kit.retry import RetryPolicy
from consumer_kit.store import create_engine
from consumer_kit.store.tables import coordinator_resources
from consumer_kit.testing.server import served_coordinator
from tests.conftest import make_settings

REQUEST = SessionRequest(labels=("research-agent",), task="Prepare T-1")
POLICY = RetryPolicy(attempts=6, total_seconds=10, base_backoff=0.01, max_backoff=0.05)


@dataclass
class Misbehaving:
    """Answers each request by the next fault in ``script`` ("pass" once the script is used up)."""

    backend: str
    script: list[str]
    keys: list[bytes | None] = field(default_factory=list)
    server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                fields = (line.partition(":") for line in lines[1:] if line)
                headers = {k.strip().lower(): v.strip() for k, _, v in fields}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                raw_key = next((line.partition(":")[2].strip().encode("latin-1") for line in lines[1:]
                                if line.lower().startswith("idempotency-key:")), None)
                self.keys.append(raw_key)
                fault = self.script.pop(0) if self.script else "pass"
                if fault.isdigit():
                    extra = "Retry-After: 1\r\n" if fault == "429" else ""
                    writer.write(f"HTTP/1.1 {fault} X\r\nContent-Length: 0\r\n{extra}\r\n".encode())
                    await writer.drain()
                    continue
                forward = {k: v for k, v in headers.items() if k not in ("host", "content-length", "connection")}
                if raw_key is not None:
                    forward["idempotency-key"] = raw_key  # type: ignore[assignment]
                async with httpx.AsyncClient() as http:
                    answer = await http.request(method, self.backend + path, content=body, headers=forward)
                if fault == "drop":  # the coordinator committed; the client never hears of it
                    writer.close()
                    return
                out = [f"HTTP/1.1 {answer.status_code} X".encode()]
                out += [f"{k}: {v}".encode() for k, v in answer.headers.items()
                        if k.lower() not in ("content-length", "transfer-encoding", "connection")]
                out += [f"Content-Length: {len(answer.content)}".encode(), b"", answer.content]
                writer.write(b"\r\n".join(out))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def backend(database_url: str) -> AsyncIterator[str]:
    async with served_coordinator(make_settings(database_url), {"tok": ("t", "a")}) as url:
        yield url


async def sessions_created(database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(coordinator_resources))).scalar_one())
    finally:
        await engine.dispose()


@pytest.mark.parametrize("explicit_key", [None, "ticket-queue:v1:m-7"])
async def test_faults_retried_with_one_key_and_one_session(backend: str, database_url: str,
                                                           explicit_key: str | None) -> None:
    proxy = Misbehaving(backend, ["503", "drop", "429", "drop", "pass"])
    async with proxy as url:
        coord = HttpCoordinator(url, token="tok", policy=POLICY)
        started = time.monotonic()
        receipt = await coord.create_session(REQUEST, idempotency_key=explicit_key)
        elapsed = time.monotonic() - started
        await coord.aclose()
    assert len(proxy.keys) == 5
    assert len(set(proxy.keys)) == 1 and proxy.keys[0]  # the same key on every attempt
    if explicit_key is not None:
        assert proxy.keys[0] == explicit_key.encode()
    else:
        assert len(proxy.keys[0]) >= 22  # 128 random bits, url-safe base64
    assert receipt.replayed  # the committed creation came back as a replay
    assert elapsed >= 1.0  # Retry-After: 1 was honoured
    assert await sessions_created(database_url) == 1


@pytest.mark.parametrize("status", ["400", "403", "404", "422"])
async def test_terminal_statuses_are_not_retried(backend: str, status: str) -> None:
    proxy = Misbehaving(backend, [status])
    async with proxy as url:
        coord = HttpCoordinator(url, token="tok", policy=POLICY)
        with pytest.raises(CoordinatorRejected) as caught:
            await coord.create_session(REQUEST)
        await coord.aclose()
    assert caught.value.status == int(status) and len(proxy.keys) == 1


async def test_conflict_is_not_retried(backend: str) -> None:
    proxy = Misbehaving(backend, [])
    async with proxy as url:
        coord = HttpCoordinator(url, token="tok", policy=POLICY)
        await coord.create_session(REQUEST, idempotency_key="k:1")
        with pytest.raises(IdempotencyKeyConflict):
            await coord.create_session(REQUEST.model_copy(update={"task": "other"}), idempotency_key="k:1")
        await coord.aclose()
    assert len(proxy.keys) == 2


async def test_budget_of_attempts_and_time(backend: str) -> None:
    proxy = Misbehaving(backend, ["503"] * 10)
    async with proxy as url:
        coord = HttpCoordinator(url, token="tok", policy=POLICY)
        with pytest.raises(CoordinatorUnavailable):
            await coord.create_session(REQUEST)
        assert len(proxy.keys) == POLICY.attempts
        # A Retry-After beyond the total budget ends the call instead of sleeping past the deadline.
        proxy.script[:] = ["429"] * 3
        short = HttpCoordinator(url, token="tok", policy=RetryPolicy(attempts=5, total_seconds=0.5))
        started = time.monotonic()
        with pytest.raises(CoordinatorUnavailable):
            await short.create_session(REQUEST)
        assert time.monotonic() - started < 0.5
        await coord.aclose()
        await short.aclose()


async def test_connection_refused_is_retried_then_unavailable() -> None:
    from consumer_kit.testing.server import free_port

    coord = HttpCoordinator(f"http://127.0.0.1:{free_port()}", token="tok",
                            policy=RetryPolicy(attempts=3, total_seconds=2, base_backoff=0.01))
    with pytest.raises(CoordinatorUnavailable):
        await coord.create_session(REQUEST)
    await coord.aclose()
