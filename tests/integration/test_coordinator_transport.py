"""KeepAliveTransport (HttpCoordinator's pool) against a raw HTTP/1.1 server that records what it sees:
connections are reused and bounded, a request's head and body arrive in one segment, a connection
the server closed while idle is not reused, and a full pool times out as httpx says it should."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from consumer_kit.coordinator.transport import KeepAliveTransport
from consumer_kit.testing.server import free_port


@dataclass
class Recorder:
    connections: int = 0
    segments: list[bytes] = field(default_factory=list)
    delay: float = 0.0
    close_after_response: bool = False
    server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        buffer = b""
        try:
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                self.segments.append(chunk)
                buffer += chunk
                while b"\r\n\r\n" in buffer:
                    head, _, rest = buffer.partition(b"\r\n\r\n")
                    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    if len(rest) < length:
                        break
                    buffer = rest[length:]
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    await writer.drain()
                    if self.close_after_response:
                        writer.close()
                        return
        finally:
            writer.close()


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()
    rec.server = await asyncio.start_server(rec.handle, "127.0.0.1", 0)
    yield rec
    rec.server.close()


def url(rec: Recorder) -> str:
    assert rec.server is not None
    return f"http://127.0.0.1:{rec.server.sockets[0].getsockname()[1]}/x"


async def test_sequential_requests_share_one_connection_and_send_one_segment(recorder: Recorder) -> None:
    async with httpx.AsyncClient(transport=KeepAliveTransport()) as client:
        for _ in range(5):
            response = await client.post(url(recorder), json={"a": 1})
            assert response.status_code == 200 and response.text == "ok"
        assert (await client.get(url(recorder))).text == "ok"  # no body: the head still goes out
    assert recorder.connections == 1
    assert len(recorder.segments) == 6
    assert all(segment.endswith(b'{"a":1}') for segment in recorder.segments[:5])


async def test_concurrency_is_bounded_by_max_connections(recorder: Recorder) -> None:
    recorder.delay = 0.02
    transport = KeepAliveTransport(limits=httpx.Limits(max_connections=3))
    async with httpx.AsyncClient(transport=transport) as client:
        responses = await asyncio.gather(*(client.post(url(recorder), content=b"x") for _ in range(12)))
    assert all(r.status_code == 200 for r in responses)
    assert recorder.connections == 3


async def test_a_connection_the_server_closed_is_not_reused(recorder: Recorder) -> None:
    recorder.close_after_response = True
    async with httpx.AsyncClient(transport=KeepAliveTransport()) as client:
        for _ in range(3):
            assert (await client.post(url(recorder), content=b"x")).text == "ok"
            await asyncio.sleep(0.05)  # the close reaches the client before the next request
    assert recorder.connections == 3


async def test_a_full_pool_times_out(recorder: Recorder) -> None:
    recorder.delay = 0.5
    transport = KeepAliveTransport(limits=httpx.Limits(max_connections=1))
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, pool=0.05)) as client:
        first = asyncio.create_task(client.post(url(recorder), content=b"x"))
        await asyncio.sleep(0.05)
        with pytest.raises(httpx.PoolTimeout):
            await client.post(url(recorder), content=b"y")
        assert (await first).status_code == 200
        assert (await client.post(url(recorder), content=b"z")).status_code == 200  # the slot came back


async def test_a_cancelled_request_gives_its_slot_back(recorder: Recorder) -> None:
    recorder.delay = 0.3
    transport = KeepAliveTransport(limits=httpx.Limits(max_connections=1))
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, pool=1.0)) as client:
        stuck = asyncio.create_task(client.post(url(recorder), content=b"x"))
        await asyncio.sleep(0.05)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        assert (await client.post(url(recorder), content=b"y")).status_code == 200


async def test_an_idle_connection_past_keepalive_expiry_is_not_reused(recorder: Recorder) -> None:
    transport = KeepAliveTransport(limits=httpx.Limits(max_connections=4, keepalive_expiry=0.1))
    async with httpx.AsyncClient(transport=transport) as client:
        assert (await client.post(url(recorder), content=b"x")).text == "ok"
        assert (await client.post(url(recorder), content=b"x")).text == "ok"  # within the expiry: reused
        await asyncio.sleep(0.3)
        assert (await client.post(url(recorder), content=b"x")).text == "ok"
    assert recorder.connections == 2


async def _misbehaving(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    path = head.split(b" ", 2)[1]
    if path == b"/garbage":
        writer.write(b"this is not HTTP\r\n\r\n")
    elif path == b"/cut":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part")
    elif path == b"/silent":
        await reader.read()  # no answer; until the client gives up
    await writer.drain()
    writer.close()
    await writer.wait_closed()


@pytest.mark.parametrize("path", ["/garbage", "/cut", "/silent", "refused", "ftp"])
async def test_failures_are_the_httpx_exceptions_httpx_own_transport_raises(path: str) -> None:
    """The exception map repeats httpx's (which is private): each failure must come out as the same
    httpx exception from both transports, so this fails if httpx or httpcore change theirs."""
    server = await asyncio.start_server(_misbehaving, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = {"refused": f"http://127.0.0.1:{free_port()}/", "ftp": "ftp://127.0.0.1/"}.get(
        path, f"http://127.0.0.1:{port}{path}")
    raised: list[type[BaseException]] = []
    try:
        for transport in (httpx.AsyncHTTPTransport(), KeepAliveTransport()):
            async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, read=0.2)) as client:
                with pytest.raises(httpx.TransportError) as caught:
                    await client.get(target)
                raised.append(caught.type)
    finally:
        server.close()
        await server.wait_closed()
    assert raised[0] is raised[1], raised
    assert raised[0] is {"/garbage": httpx.RemoteProtocolError, "/cut": httpx.RemoteProtocolError,
                         "/silent": httpx.ReadTimeout, "refused": httpx.ConnectError,
                         "ftp": httpx.UnsupportedProtocol}[path]
