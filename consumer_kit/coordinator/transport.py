"""An httpx transport speaking HTTP/1.1 with httptools' parser, over keep-alive connections of its own.

``HttpCoordinator`` is an httpx client; its own client runs on this transport instead of httpx's
default (httpcore's pool over h11). Measured in bench/coordinator.py on a 2-core host, a creation cost
the client 550-620 us of CPU on httpcore and h11 (h11 parses and httpcore manages every connection in
pure Python, with an anyio lock or two per request), ~225 us with aiohttp, and ~80 us with a client
on httptools' parser. So this transport frames responses with httptools (MagicStack's binding of
llhttp, the parser uvicorn and our servers run on; a dependency already) and does by hand only what
a pool of HTTP/1.1 connections to a few origins needs:

- a semaphore of ``max_connections`` and a stack of idle connections per origin: a request takes a
  slot, the most recently used idle connection (if it is still sound and within ``keepalive_expiry``)
  or a new one, and gives both back when its response has been read;
- a request's head and body go out in one write (one TCP segment, one wake-up of the server);
- a connection in doubt (an error, a cancelled await, bytes arriving while idle, ``Connection:
  close``) is closed, never pooled. Nothing is awaited in that cleanup, so a cancellation cannot
  interrupt it.

Only public interfaces are used: httpx's one-method transport (``httpx.AsyncBaseTransport``) and its
models, httptools' ``HttpResponseParser`` and asyncio's protocols. Failures are httpx's own
exceptions, the same one for the same failure as from ``httpx.AsyncHTTPTransport``
(tests/integration/test_coordinator_transport.py checks each). Not supported, as no coordinator
needs them: proxies, HTTP/2, upgrades, and answers to ``HEAD``.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

import httptools
import httpx

_Key = tuple[bytes, bytes, int]

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\x00\r\n]|^[ \t]|[ \t]$")
_BAD_TARGET = re.compile(rb"[\x00-\x20\x7f]")
_HIGH_WATER = 262_144
"""Bytes of a response body received and not read yet above which the socket is not read."""


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """An httpx transport (HTTP/1.1, no proxy) whose pool gives each request a keep-alive connection
    of its own (see the module docstring). ``limits``: ``max_connections`` and ``keepalive_expiry`` are
    applied (``max_keepalive_connections`` is not: every connection under the bound is kept)."""

    def __init__(self, *, limits: httpx.Limits | None = None, verify: ssl.SSLContext | bool = True) -> None:
        limits = limits or httpx.Limits(max_connections=100, keepalive_expiry=5.0)
        self._ssl_context = httpx.create_ssl_context(verify=verify, trust_env=False)
        self._keepalive_expiry = limits.keepalive_expiry
        self._slots = asyncio.Semaphore(limits.max_connections) if limits.max_connections else None
        self._idle: dict[_Key, list[_Connection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` on a connection of its own; reading its response to the end (or closing it)
        gives the connection back."""
        url = request.url
        _check_scheme(url)
        head, body, chunked = await _serialize(request)
        stream = request.stream if chunked else None
        assert stream is None or isinstance(stream, httpx.AsyncByteStream)
        timeouts = request.extensions.get("timeout", {})
        closing = b"close" in request.headers.get("connection", "").encode().lower()
        key, connection = await self._open(url, head, body, stream, timeouts, closing=closing)
        extensions = {"http_version": b"HTTP/1.1", "reason_phrase": connection.reason}
        if connection.complete:  # the usual small answer, whole in the first read: no stream to manage
            content = connection.take_body()
            self.give_back(key, connection)
            return httpx.Response(connection.status, headers=connection.headers,
                                  stream=httpx.ByteStream(content), extensions=extensions)
        return httpx.Response(connection.status, headers=connection.headers, extensions=extensions,
                              stream=_Body(self, key, connection, timeouts.get("read")))

    async def exchange(self, method: bytes, url: httpx.URL, headers: list[tuple[bytes, bytes]], body: bytes,
                       timeouts: dict[str, float | None]) -> Answer:
        """One request with a body in memory, its whole answer read: what ``HttpCoordinator`` sends,
        without building httpx's request and response models (a seventh of its CPU per creation).
        ``Host`` and ``Content-Length`` are added; ``headers`` are checked as in any request."""
        _check_scheme(url)
        lines = [method, b" ", url.raw_path, b" HTTP/1.1\r\nHost: ", url.netloc,
                 b"\r\nContent-Length: ", b"%d" % len(body), b"\r\n"]
        _check_request(method, url.raw_path, headers)
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        lines.append(b"\r\n")
        key, connection = await self._open(url, b"".join(lines), body, None, timeouts, closing=False)
        chunks: list[bytes] = []
        try:
            while chunk := await connection.next_chunk(timeouts.get("read")):
                chunks.append(chunk)
        except BaseException:
            connection.abort()
            self.give_back(key, connection)
            raise
        self.give_back(key, connection)
        return Answer(connection.status, connection.headers, chunks[0] if len(chunks) == 1 else b"".join(chunks))

    async def _open(self, url: httpx.URL, head: bytes, body: bytes, stream: httpx.AsyncByteStream | None,
                    timeouts: dict[str, float | None], *, closing: bool) -> tuple[_Key, _Connection]:
        """A slot, a connection, the request sent on it and its answer's head read; on any failure (or
        cancellation) the connection is closed and the slot freed."""
        if self._closed:
            raise RuntimeError("the transport is closed")
        slots = self._slots
        if slots is not None and slots.locked():  # wait for a slot, at most the pool timeout
            try:
                async with asyncio.timeout(timeouts.get("pool")):
                    await slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no connection became free within the pool timeout") from None
        elif slots is not None:
            await slots.acquire()  # one is free: taken at once
        key = (url.raw_scheme, url.raw_host, url.port or (443 if url.raw_scheme == b"https" else 80))
        connection: _Connection | None = None
        try:
            connection = self._idle_connection(key)
            if connection is None:
                connection = await self._connect(key, timeouts.get("connect"))
            connection.begin(closing)
            await connection.send(head, body, timeouts.get("write"))
            if stream is not None:  # a body of unknown length, sent in chunks
                async for chunk in stream:
                    if chunk:
                        await connection.send(b"%x\r\n" % len(chunk), chunk + b"\r\n", timeouts.get("write"))
                await connection.send(b"0\r\n\r\n", b"", timeouts.get("write"))
            await connection.wait_for_head(timeouts.get("read"))
        except BaseException:
            # Not pooled: an error or a cancellation left this connection in doubt.
            if connection is not None:
                connection.abort()
            self._release()
            raise
        return key, connection

    def _idle_connection(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            candidate = idle.pop()
            if candidate.reusable(self._keepalive_expiry):
                return candidate
            candidate.abort()
        return None

    async def _connect(self, key: _Key, within: float | None) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        hostname = host.decode("ascii")
        secure = scheme == b"https"
        try:
            async with asyncio.timeout(within):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), hostname, port,
                    ssl=self._ssl_context if secure else None, server_hostname=hostname if secure else None)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {hostname}:{port} within {within}s") from None
        except OSError as exc:  # ssl.SSLError and socket.gaierror are OSErrors
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return connection

    def _release(self) -> None:
        if self._slots is not None:
            self._slots.release()

    def give_back(self, key: _Key, connection: _Connection) -> None:
        """A response read to its end (or closed): its connection back among the idle ones when it can
        serve another request (else closed), and its slot free."""
        try:
            if connection.keep_alive and not self._closed:
                connection.idle_since = asyncio.get_running_loop().time()
                self._idle.setdefault(key, []).append(connection)
            else:
                connection.abort()
        finally:
            self._release()

    async def aclose(self) -> None:
        """Close the idle connections; a response still open closes its own when it is closed."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    @property
    def connections(self) -> int:
        """How many idle connections are ready for a request."""
        return sum(len(connections) for connections in self._idle.values())


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole HTTP answer, as :meth:`KeepAliveTransport.exchange` returns it."""

    status_code: int
    raw_headers: list[tuple[bytes, bytes]]
    content: bytes

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or ``None``."""
        wanted = name.lower().encode("latin-1")
        for key, value in self.raw_headers:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return None


def _check_scheme(url: httpx.URL) -> None:
    if url.raw_scheme not in (b"http", b"https"):
        raise httpx.UnsupportedProtocol(f"unsupported scheme {url.scheme!r}")


def _check_request(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse what could split or confuse the request's head, as h11 refuses it."""
    if not _TOKEN.fullmatch(method):
        raise httpx.LocalProtocolError(f"illegal method {method!r}")
    if method == b"HEAD":
        raise httpx.UnsupportedProtocol("HEAD is not supported by this transport")
    if not target or _BAD_TARGET.search(target):
        raise httpx.LocalProtocolError("illegal request target")
    for name, value in headers:
        if not _TOKEN.fullmatch(name):
            raise httpx.LocalProtocolError("illegal header name")
        if _BAD_VALUE.search(value):
            raise httpx.LocalProtocolError("illegal header value")


async def _serialize(request: httpx.Request) -> tuple[bytes, bytes, bool]:
    """The request's head, its body (when it is not streamed) and whether the body is streamed in
    chunks."""
    method, target, headers = request.method.encode("ascii"), request.url.raw_path, request.headers.raw
    _check_request(method, target, headers)
    lines = [method, b" ", target, b" HTTP/1.1\r\n"]
    chunked = False
    for name, value in headers:
        if name.lower() == b"transfer-encoding":
            chunked = value.strip().lower() == b"chunked"
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    head = b"".join(lines)
    if chunked:
        return head, b"", True
    try:
        return head, request.content, False
    except httpx.RequestNotRead:  # a streamed body with a Content-Length: read it, it is sent whole
        return head, await request.aread(), False


class _Body(httpx.AsyncByteStream):
    """A response body still arriving; read to its end (or closed), it gives its connection back."""

    def __init__(self, transport: KeepAliveTransport, key: _Key, connection: _Connection,
                 timeout: float | None) -> None:
        self._transport, self._key, self._connection, self._timeout = transport, key, connection, timeout
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        try:
            while True:
                chunk = await connection.next_chunk(self._timeout)
                if not chunk:
                    break
                yield chunk
        except BaseException:
            await self.aclose()
            raise
        if not self._done:
            self._done = True
            self._transport.give_back(self._key, connection)

    async def aclose(self) -> None:
        if self._done:
            return
        self._done = True
        connection = self._connection
        if not connection.complete:  # a body not read to its end: the connection is in doubt
            connection.abort()
        self._transport.give_back(self._key, connection)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: its transport, its response parser, and the response in progress.
    A read waits on a future of its own (cleared when that wait ends, however it ends)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self._busy = False  # a request is out or its response is being read
        self._dirty = False  # bytes or an EOF came with no request out: the stream is out of step
        self._lost = False
        self._eof = False
        self._error: BaseException | None = None
        self._write_paused = False
        self._read_paused = False
        self._closing_request = False
        self._begin_response()

    def _begin_response(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._buffered = 0
        self.head_done = False
        self.complete = False
        self._until_close = False  # a body without a length: it ends at the close
        self._server_keeps_alive = False
        self._got_bytes = False

    # What the pool asks

    def reusable(self, expiry: float | None) -> bool:
        return (not self._dirty and not self._lost and not self._eof and self.keep_alive
                and (expiry is None or self._loop.time() - self.idle_since < expiry))

    @property
    def keep_alive(self) -> bool:
        return (self.complete and not self._lost and not self._eof and not self._dirty
                and not self._closing_request and self._server_keeps_alive)

    def begin(self, closing: bool) -> None:
        self._begin_response()
        self._busy, self._closing_request = True, closing

    async def send(self, head: bytes, body: bytes, within: float | None) -> None:
        transport = self.transport
        if transport is None or self._lost or transport.is_closing():
            raise httpx.WriteError("the connection is closed")
        transport.write(head + body if body else head)
        while self._write_paused and not self._lost:
            try:
                await self._wait(within)
            except TimeoutError:
                raise httpx.WriteTimeout(f"nothing could be sent within {within}s") from None
        if self._lost and self._error is not None and not self._got_bytes:
            raise httpx.WriteError(str(self._error) or type(self._error).__name__)

    async def wait_for_head(self, within: float | None) -> None:
        while not self.head_done:
            self._raise_if_failed(head=True)
            try:
                await self._wait(within)
            except TimeoutError:
                raise httpx.ReadTimeout(f"no response within {within}s") from None

    async def next_chunk(self, within: float | None) -> bytes:
        """The next part of the body, ``b""`` at its end."""
        while not self._chunks:
            if self.complete:
                return b""
            self._raise_if_failed(head=False)
            try:
                await self._wait(within)
            except TimeoutError:
                raise httpx.ReadTimeout(f"nothing was received within {within}s") from None
        return self.take_body()

    def take_body(self) -> bytes:
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        if self._read_paused and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _raise_if_failed(self, *, head: bool) -> None:
        if self._error is not None and not isinstance(self._error, OSError):
            raise self._error  # the parser's verdict, already an httpx exception
        if not self._lost and not self._eof:
            return
        if self._error is not None:
            raise httpx.ReadError(str(self._error) or type(self._error).__name__)
        if head:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    async def _wait(self, within: float | None) -> None:
        """Until :meth:`_wake`; ``TimeoutError`` after ``within`` seconds. A timer of the loop's own
        rather than ``asyncio.timeout``, whose bookkeeping around each wait (the task's cancel count,
        a context manager) was a tenth of the client's CPU per creation."""
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(within, _expire, waiter) if within is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self) -> None:
        self._busy = False
        self._dirty = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self._dirty = True
        if self.transport is not None:
            self.transport.close()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy or self.complete:
            self._dirty = True  # nothing was asked: the next request could not trust this stream
            self._wake()
            return
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("the server switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"the server's answer is not HTTP/1.1: {exc}"))
        if self._buffered > _HIGH_WATER and self.transport is not None and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        self._eof = True
        self._end_at_close()
        self._wake()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if exc is not None and self._error is None:
            self._error = exc
        self._end_at_close()
        self._wake()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake()

    def _end_at_close(self) -> None:
        if self.head_done and self._until_close and not self.complete and self._error is None:
            self.complete = True

    def _fail(self, error: httpx.TransportError) -> None:
        if self._error is None:
            self._error = error
        if self.transport is not None:
            self.transport.abort()

    # httptools' callbacks

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self.reason, self.headers = b"", []
            return
        self.status, self.head_done = status, True
        self._server_keeps_alive = self._parser.should_keep_alive()  # as the head says (read it here: llhttp
        # resets what it knows of a message once the message is complete)
        names = {name.lower() for name, _ in self.headers}
        self._until_close = (b"content-length" not in names and b"transfer-encoding" not in names
                             and status not in (204, 304))

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True
            self._busy = False
