"""Every HTTP server we run bounds a request's head size and the time a client takes to send a request:
``consumer-kit run`` (an app with HTTP sources) and ``consumer-kit coordinator serve``, each run as a
user runs it, spoken to over raw loopback sockets."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from consumer_kit.testing.server import free_port
from tests.conftest import TEST_HMAC_KEY
from tests.processes import stop_cleanly, wait_until_served

ROOT = Path(__file__).resolve().parents[2]
BOUND_SECONDS = 1
MAX_HEADER_BYTES = 4096
SLOW_SECONDS = 20  # how long the slow clients would take to finish: far past the bound


class Served(NamedTuple):
    base: str
    post_path: str  # where the server reads a request body


@pytest.fixture(scope="module", params=["worker", "coordinator"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A served worker (the Stripe example: an HTTP source) or coordinator with a 1 s request bound and
    4 KiB heads, for all the tests of this module; then SIGTERM and an exit status of 0."""
    tmp_path = tmp_path_factory.mktemp(request.param)
    port = free_port()
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path}/server.db", "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY,
           "HTTP_REQUEST_TIMEOUT_SECONDS": str(BOUND_SECONDS), "HTTP_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
           "STRIPE_WEBHOOK_SECRET": "whsec_bounds", "COORDINATOR_TOKENS": json.dumps({"tok": "acme/tickets"})}
    command = (["run", "examples.stripe_receiver:app"] if request.param == "worker" else ["coordinator", "serve"])
    process = subprocess.Popen([sys.executable, "-m", "consumer_kit.cli", *command, "--port", str(port)],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_served(process, f"{base}/healthz")
        yield Served(base, "/stripe/webhooks" if request.param == "worker" else "/v1/sessions")
    finally:
        stop_cleanly(process)


async def connect(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = base.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (or resets) the connection."""
    received = b""
    try:
        async with asyncio.timeout(SLOW_SECONDS + 15):
            while chunk := await reader.read(65536):
                received += chunk
    except ConnectionError:
        pass
    return received


async def trickle(writer: asyncio.StreamWriter, data: bytes) -> bool:
    """Send ``data`` a byte at a time over SLOW_SECONDS; False when the server cut the connection first."""
    try:
        for i in range(len(data)):
            writer.write(data[i:i + 1])
            await writer.drain()
            await asyncio.sleep(SLOW_SECONDS / len(data))
    except ConnectionError:
        return False
    return True


async def cut_off_while_trickling(base: str, head: bytes, slow: bytes) -> bytes:
    """Send ``head`` at once, then ``slow`` a byte at a time; return what the server sent before it
    closed the connection, having checked that it closed it before the slow part was all sent."""
    reader, writer = await connect(base)
    writer.write(head)
    await writer.drain()
    sending = asyncio.create_task(trickle(writer, slow))
    try:
        received = await read_until_closed(reader)
        assert not (sending.done() and sending.result()), "the server waited for the whole slow request"
        return received
    finally:
        sending.cancel()
        writer.close()


async def test_a_normal_request_is_served(server: Served) -> None:
    reader, writer = await connect(server.base)
    try:  # the head arrives in two parts, as it may over a real network, well within the bound
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"Accept: */*\r\n\r\n")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout=10)
        assert status_line.split()[1] == b"200"
    finally:
        writer.close()


async def test_an_oversized_head_is_refused(server: Served) -> None:
    for size in (2 * MAX_HEADER_BYTES, 4 * 1024 * 1024):  # in one read; in many
        reader, writer = await connect(server.base)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * size + b"\r\n\r\n")
        try:
            await writer.drain()
        except ConnectionError:
            pass  # closed while 4 MB were still being sent: refused as well
        received = await read_until_closed(reader)
        writer.close()
        if size < 65536:  # read whole before the refusal: the answer reaches the client
            assert received.startswith(b"HTTP/1.1 431 "), received[:100]
            assert received.endswith(b'{"error": "request_header_too_large"}')
        else:  # the answer, or a reset if the client was still sending
            assert received == b"" or received.startswith(b"HTTP/1.1 431 "), received[:100]
    async with httpx.AsyncClient(base_url=server.base) as http:  # a head just under the bound is served
        assert (await http.get("/healthz", headers={"X-Pad": "a" * (MAX_HEADER_BYTES - 200)})).status_code == 200


async def test_a_head_sent_slowly_is_cut_off(server: Served) -> None:
    received = await cut_off_while_trickling(server.base, b"GET /healthz HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200)
    assert received.startswith(b"HTTP/1.1 408 "), received[:100]


async def test_a_body_sent_slowly_is_cut_off(server: Served) -> None:
    body = json.dumps({"task": "t" * 180}).encode()
    head = (f"POST {server.post_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    received = await cut_off_while_trickling(server.base, head, body)
    assert received == b"", received[:100]  # the application was still reading: nothing to answer


async def test_an_upgrade_request_does_not_hold_the_connection(server: Served) -> None:
    # Served like any request (we speak no WebSocket or h2c); what follows is not read, so trickling
    # bytes cannot keep the connection open past uvicorn's keep-alive.
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    received = await cut_off_while_trickling(server.base, head, b"x" * 200)
    assert received.startswith(b"HTTP/1.1 200 "), received[:100]


async def test_a_silent_connection_is_closed(server: Served) -> None:
    reader, writer = await connect(server.base)
    try:
        assert await read_until_closed(reader) == b""
    finally:
        writer.close()
    async with httpx.AsyncClient(base_url=server.base) as http:  # and the server serves on
        assert (await http.get("/healthz")).status_code == 200
