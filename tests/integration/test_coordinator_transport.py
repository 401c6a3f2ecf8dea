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


async def _misbehave(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
    handled = asyncio.Semaphore(0)  # one release per connection handled to its end

    async def misbehaving(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _misbehave(reader, writer)
        finally:
            handled.release()

    server = await asyncio.start_server(misbehaving, "127.0.0.1", 0)
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
            if path.startswith("/"):  # the server saw the client go: its writer is closed
                async with asyncio.timeout(5):
                    await handled.acquire()
    finally:
        server.close()
        await server.wait_closed()
    assert raised[0] is raised[1], raised
    assert raised[0] is {"/garbage": httpx.RemoteProtocolError, "/cut": httpx.RemoteProtocolError,
                         "/silent": httpx.ReadTimeout, "refused": httpx.ConnectError,
                         "ftp": httpx.UnsupportedProtocol}[path]


async def _scripted(answers: list[bytes]) -> tuple[asyncio.Server, list[int]]:
    """A server that answers each request it reads on a connection with the next of ``answers`` (raw
    bytes), and records how many connections it was given."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                answer = answers.pop(0)
                writer.write(answer)
                await writer.drain()
                lowered = answer.lower()
                if b"connection: close" in lowered or not (b"content-length" in lowered or b"chunked" in lowered):
                    break  # as the answer said, or its body ends at the close
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the client hung up: nothing more to answer (the connection is closed below)
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), connections


def _base(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_chunked_close_delimited_and_interim_answers_are_read_whole() -> None:
    server, connections = await _scripted([
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\nx-a: 1\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the close",
        b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n",
    ])
    try:
        async with httpx.AsyncClient(transport=KeepAliveTransport()) as client:
            first = await client.post(_base(server) + "/a", content=b"x")
            assert (first.status_code, first.text) == (200, "abcde")
            second = await client.post(_base(server) + "/b", content=b"x")
            assert (second.status_code, second.text, second.headers["x-a"]) == (201, "ok", "1")
            assert second.reason_phrase == "Created"
            third = await client.post(_base(server) + "/c", content=b"x")
            assert (third.status_code, third.text) == (200, "until the close")
            assert (await client.post(_base(server) + "/d", content=b"x")).status_code == 204
    finally:
        server.close()
    assert len(connections) == 2  # the close-delimited answer ended its connection; the next took a new one


async def test_connection_close_and_stray_bytes_keep_a_connection_out_of_the_pool() -> None:
    server, connections = await _scripted([
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\nconnection: close\r\n\r\na",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nbEXTRA",  # bytes past the answer: out of step
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nc",
    ])
    try:
        async with httpx.AsyncClient(transport=KeepAliveTransport()) as client:
            for expected in "abc":
                assert (await client.post(_base(server) + "/", content=b"x")).text == expected
                await asyncio.sleep(0.05)
    finally:
        server.close()
    assert len(connections) == 3


async def test_a_large_answer_streams_through_flow_control() -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: over the read high-water mark several times
    server, _ = await _scripted([b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body])
    try:
        async with httpx.AsyncClient(transport=KeepAliveTransport()) as client:
            async with client.stream("POST", _base(server) + "/", content=b"x") as response:
                received = b""
                async for chunk in response.aiter_raw():
                    received += chunk
                    await asyncio.sleep(0)
        assert received == body
    finally:
        server.close()


@pytest.mark.parametrize("header", [(b"x-a", b"1\r\nx-injected: 2"), (b"x a", b"1"), (b"x-a", b"\x00")])
async def test_a_header_that_could_split_the_head_is_refused_before_anything_is_sent(
        recorder: Recorder, header: tuple[bytes, bytes]) -> None:
    transport = KeepAliveTransport()
    with pytest.raises(httpx.LocalProtocolError):
        await transport.exchange(b"POST", httpx.URL(url(recorder)), [header], b"", {})
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(httpx.LocalProtocolError):
            await client.post(url(recorder), headers=[header])
    assert recorder.segments == []


async def test_exchange_reads_the_whole_answer_and_reuses_the_connection(recorder: Recorder) -> None:
    transport = KeepAliveTransport()
    try:
        for _ in range(3):
            answer = await transport.exchange(b"POST", httpx.URL(url(recorder)), [(b"X-A", b"1")], b"{}", {})
            assert (answer.status_code, answer.content, answer.header("Content-Length")) == (200, b"ok", "2")
    finally:
        await transport.aclose()
    assert recorder.connections == 1
    assert recorder.segments[0].startswith(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1:")
    assert recorder.segments[0].endswith(b"\r\nContent-Length: 2\r\nX-A: 1\r\n\r\n{}")


async def test_a_cancelled_exchange_closes_its_connection_and_frees_its_slot(recorder: Recorder) -> None:
    recorder.delay = 0.3
    transport = KeepAliveTransport(limits=httpx.Limits(max_connections=1))
    try:
        stuck = asyncio.create_task(transport.exchange(b"POST", httpx.URL(url(recorder)), [], b"x", {}))
        await asyncio.sleep(0.05)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        recorder.delay = 0.0
        answer = await transport.exchange(b"POST", httpx.URL(url(recorder)), [], b"y", {"pool": 1.0})
        assert answer.content == b"ok"
    finally:
        await transport.aclose()
    assert recorder.connections == 2  # the cancelled one was not pooled
