# ruff: noqa: ASYNC109  (the timeout parameters are httpcore's network-stream interface)
"""An httpx transport whose connection pool hands each request a keep-alive connection of its own.

httpcore's ``AsyncConnectionPool`` re-plans the whole pool on every request and every response close:
each queued request is matched against every connection, every connection's socket is polled for
expiry, and when several requests queue at once they are all given the same idle connection, so all
but one fail with ``ConnectionNotAvailable`` and go round again. At 16 concurrent requests that was
about 11 passes and 23 socket polls per request, most of ``HttpCoordinator``'s CPU
(bench/coordinator.py). This pool keeps a stack of idle HTTP/1.1 connections per origin and a
semaphore of ``max_connections``: a request takes a slot, pops the most recently used idle connection
(checked once for expiry, as httpcore checks it) or opens one, and gives both back when its response
is closed. TLS and the HTTP/1.1 protocol are httpcore's own; its connections run on asyncio's
transports (:class:`_AsyncioBackend`) rather than anyio's.

Only public seams are used: the transport is an ``httpx.AsyncBaseTransport`` (httpx's one-method
transport interface) over ``httpcore.AsyncHTTPConnection`` (httpcore's one-connection class, which takes
the SSL context, keep-alive expiry and network backend as arguments), and the network backend is an
``httpcore.AsyncNetworkBackend`` (httpcore's interface for them). ``httpx.AsyncHTTPTransport`` has no
public way to run on another pool, so what it does around its pool is repeated here: the request and
the response are translated between httpx's and httpcore's models, and httpcore's exceptions are mapped
to httpx's (:data:`_ERRORS`; httpx's own map is private). tests/integration/test_coordinator_transport.py
checks that each failure comes out as the same httpx exception as from ``httpx.AsyncHTTPTransport``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterable
from typing import Any, NoReturn, cast

import httpcore
import httpx

_Key = tuple[bytes, bytes, int]

_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)
"""httpcore's exceptions and the httpx exception each becomes, the most specific first (as
``httpx.AsyncHTTPTransport`` maps them)."""


def _raise_mapped(exc: BaseException) -> NoReturn:
    for core, mapped in _ERRORS:
        if isinstance(exc, core):
            raise mapped(str(exc)) from exc
    raise exc


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """An httpx transport (HTTP/1.1, no proxy) whose pool gives each request a keep-alive connection
    of its own (see the module docstring). ``limits``: ``max_connections`` and ``keepalive_expiry`` are
    applied (``max_keepalive_connections`` is not: every connection under the bound is kept)."""

    def __init__(self, *, limits: httpx.Limits | None = None, verify: ssl.SSLContext | bool = True) -> None:
        limits = limits or httpx.Limits(max_connections=100, keepalive_expiry=5.0)
        self._ssl_context = httpx.create_ssl_context(verify=verify, trust_env=False)
        self._keepalive_expiry = limits.keepalive_expiry
        max_connections = limits.max_connections
        self._slots = asyncio.Semaphore(max_connections) if max_connections else None
        self._idle: dict[_Key, list[httpcore.AsyncHTTPConnection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` on a connection of its own; closing the response gives the connection back."""
        url = request.url
        if url.raw_scheme not in (b"http", b"https"):
            raise httpx.UnsupportedProtocol(f"unsupported scheme {url.scheme!r}")
        if self._closed:
            raise RuntimeError("the transport is closed")
        assert isinstance(request.stream, httpx.AsyncByteStream)
        if self._slots is not None:
            timeout = request.extensions.get("timeout", {}).get("pool")
            try:
                async with asyncio.timeout(timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no connection became free within the pool timeout") from None
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        origin = core_request.url.origin
        key = (origin.scheme, origin.host, origin.port)
        connection: httpcore.AsyncHTTPConnection | None = None
        try:
            idle = self._idle.get(key)
            while idle:
                candidate = idle.pop()
                if candidate.is_available() and not candidate.has_expired():
                    connection = candidate
                    break
                await candidate.aclose()
            if connection is None:
                connection = httpcore.AsyncHTTPConnection(
                    origin, ssl_context=self._ssl_context, keepalive_expiry=self._keepalive_expiry,
                    network_backend=_BACKEND)
            response = await connection.handle_async_request(core_request)
        except BaseException as exc:
            # A connection in doubt (an error, a cancellation mid-request) is closed, never pooled; its
            # slot is freed even if that close is itself cancelled.
            try:
                if connection is not None:
                    await connection.aclose()
            finally:
                self._release()
            _raise_mapped(exc)
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=_Returning(self, key, connection, response), extensions=response.extensions)

    def _release(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def give_back(self, key: _Key, connection: httpcore.AsyncHTTPConnection) -> None:
        """A response read to its end: its connection back among the idle ones (closed if it cannot serve
        another request), and its slot free."""
        try:
            if connection.is_available() and not self._closed:
                self._idle.setdefault(key, []).append(connection)
            else:
                await connection.aclose()
        finally:
            self._release()  # even when the close is cancelled: a lost slot would shrink the pool for good

    async def aclose(self) -> None:
        """Close the idle connections; a response still open closes its own when it is closed."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await connection.aclose()

    @property
    def connections(self) -> list[httpcore.AsyncHTTPConnection]:
        """The idle connections, ready for a request."""
        return [c for connections in self._idle.values() for c in connections]


class _Returning(httpx.AsyncByteStream):
    """The response body; closing it returns the connection (and its slot) to the pool."""

    def __init__(self, transport: KeepAliveTransport, key: _Key, connection: httpcore.AsyncHTTPConnection,
                 response: httpcore.Response) -> None:
        self._transport, self._key, self._connection, self._response = transport, key, connection, response
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_stream():
                yield chunk
        except BaseException as exc:
            await self.aclose()
            _raise_mapped(exc)

    async def aclose(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            await self._response.aclose()
        except Exception as exc:
            _raise_mapped(exc)
        finally:
            await self._transport.give_back(self._key, self._connection)


class _AsyncioBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network interface on asyncio's own transports, with streams that send a request's
    head with its body.

    httpcore's default backend runs on anyio, whose cancel scope, checkpoints and per-call attribute
    maps around every read and write were a fifth of ``HttpCoordinator``'s CPU per creation (bench
    coordinator). And httpcore writes the request head and each body chunk separately: a small POST
    was two ``send`` calls and two TCP segments, and the server woke up (and parsed) twice.

    Failures are httpcore's exceptions, as from its own backends: ``ConnectError``/``ConnectTimeout``
    while connecting (TLS included), ``ReadError``/``ReadTimeout`` and ``WriteError``/``WriteTimeout``
    after, so that :func:`_raise_mapped` makes the same httpx exceptions of them.
    """

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        pipe = _Pipe(loop)
        try:
            async with asyncio.timeout(timeout):
                transport, _ = await loop.create_connection(
                    lambda: pipe, host, port, local_addr=(local_address, 0) if local_address else None)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"no connection to {host}:{port} within {timeout}s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        stream = _AsyncioStream(transport, pipe)
        _set_options(stream, socket_options)
        return stream

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        pipe = _Pipe(loop)
        try:
            async with asyncio.timeout(timeout):
                transport, _ = await loop.create_unix_connection(lambda: pipe, path)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"no connection to {path} within {timeout}s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        stream = _AsyncioStream(transport, pipe)
        _set_options(stream, socket_options)
        return stream

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _set_options(stream: _AsyncioStream, options: Iterable[httpcore.SOCKET_OPTION] | None) -> None:
    sock = stream.get_extra_info("socket")
    try:
        for option in options or ():
            sock.setsockopt(*option)
    except OSError as exc:
        stream.transport.abort()
        raise httpcore.ConnectError(str(exc)) from exc


_READ_HIGH_WATER = 262_144
"""Bytes received and not read yet above which the socket is not read until they are."""


class _Pipe(asyncio.Protocol):
    """One connection's receive buffer and flow control; a read or a drain waits on a future of its own
    (cleared when that wait ends, however it ends: a cancelled read leaves nothing behind)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.lost = False
        self.error: Exception | None = None
        self.write_paused = False
        self.read_paused = False
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _READ_HIGH_WATER and self.transport is not None and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> None:
        self.eof = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost, self.error = True, exc
        self._wake()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until data, EOF, a loss or room to write arrives; ``TimeoutError`` after ``timeout``."""
        waiter = self.waiter = self.loop.create_future()
        try:
            async with asyncio.timeout(timeout):
                await waiter
        finally:
            self.waiter = None


class _AsyncioStream(httpcore.AsyncNetworkStream):
    """A connection as httpcore reads and writes it. The first write after a read (a request's head) is
    held until the next write or read: only the head, never body bytes, so a streamed body still goes
    out chunk by chunk, and a request without a body is flushed by the empty end-of-message write or
    by the first read."""

    def __init__(self, transport: asyncio.Transport, pipe: _Pipe) -> None:
        self.transport = transport
        self._pipe = pipe
        self._held = b""
        self._holding = True

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            held, self._held = self._held, b""
            await self._write(held, timeout)
        self._holding = True
        pipe = self._pipe
        while not pipe.buffer and not pipe.eof and not pipe.lost:
            try:
                await pipe.wait(timeout)
            except TimeoutError:
                raise httpcore.ReadTimeout(f"nothing was received within {timeout}s") from None
        if pipe.buffer:
            chunk = bytes(pipe.buffer[:max_bytes])
            del pipe.buffer[:max_bytes]
            if pipe.read_paused and len(pipe.buffer) <= _READ_HIGH_WATER // 4:
                pipe.read_paused = False
                self.transport.resume_reading()
            return chunk
        if pipe.error is not None:
            raise httpcore.ReadError(str(pipe.error) or type(pipe.error).__name__)
        return b""  # the peer closed: httpcore makes of it what it means at that point

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._holding and not self._held and buffer:
            self._held = buffer
            return
        held, self._held, self._holding = self._held, b"", False
        data = held + buffer
        if data:
            await self._write(data, timeout)

    async def _write(self, data: bytes, timeout: float | None) -> None:
        pipe = self._pipe
        if pipe.lost or self.transport.is_closing():
            error = pipe.error
            raise httpcore.WriteError(str(error) if error is not None else "the connection is closed")
        self.transport.write(data)
        while pipe.write_paused and not pipe.lost:
            try:
                await pipe.wait(timeout)
            except TimeoutError:
                raise httpcore.WriteTimeout(f"nothing could be sent within {timeout}s") from None
        if pipe.lost and pipe.error is not None:
            raise httpcore.WriteError(str(pipe.error))

    async def aclose(self) -> None:
        # As anyio closes its streams: one turn of the loop for what is buffered, then the socket is
        # closed for sure (in a finally: a close that is itself cancelled still closes).
        self._held = b""
        self.transport.close()
        try:
            await asyncio.sleep(0)
        finally:
            self.transport.abort()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        loop, pipe = self._pipe.loop, self._pipe
        try:
            async with asyncio.timeout(timeout):
                secured = await loop.start_tls(self.transport, pipe, ssl_context, server_hostname=server_hostname)
        except TimeoutError:
            self.transport.abort()
            raise httpcore.ConnectTimeout(f"no TLS handshake within {timeout}s") from None
        except (OSError, ssl.SSLError) as exc:  # ssl.SSLError is an OSError; named for the reader
            self.transport.abort()
            raise httpcore.ConnectError(str(exc)) from exc
        except BaseException:
            self.transport.abort()
            raise
        if secured is None:  # the loop found the connection closed under the handshake
            raise httpcore.ConnectError("the connection closed during the TLS handshake")
        pipe.transport = secured
        return _AsyncioStream(secured, pipe)

    def get_extra_info(self, info: str) -> Any:
        transport = self.transport
        if info == "is_readable":  # something arrived while idle (an EOF, a stray byte): not reusable
            pipe = self._pipe
            return bool(pipe.buffer) or pipe.eof or pipe.lost
        if info == "ssl_object":
            return transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return transport.get_extra_info("sockname")
        if info == "server_addr":
            return transport.get_extra_info("peername")
        if info == "socket":
            return transport.get_extra_info("socket")
        return None


_BACKEND = _AsyncioBackend()
