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
is closed. Timeouts, TLS and the HTTP/1.1 protocol are httpcore's own.

Only public seams are used: the transport is an ``httpx.AsyncBaseTransport`` (httpx's one-method
transport interface) over ``httpcore.AsyncHTTPConnection`` (httpcore's one-connection class, which takes
the SSL context, keep-alive expiry and network backend as arguments). ``httpx.AsyncHTTPTransport`` has no
public way to run on another pool, so what it does around its pool is repeated here: the request and
the response are translated between httpx's and httpcore's models, and httpcore's exceptions are mapped
to httpx's (:data:`_ERRORS`; httpx's own map is private). tests/integration/test_coordinator_transport.py
checks that each failure comes out as the same httpx exception as from ``httpx.AsyncHTTPTransport``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterable
from typing import Any, NoReturn

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
                    network_backend=_COALESCING)
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


class _CoalescingBackend(httpcore.AsyncNetworkBackend):
    """httpcore's default network backend, with streams that send a request's head with its body.

    httpcore writes the request head and each body chunk separately, so a small POST was two
    ``send`` calls and two TCP segments, and the server woke up (and parsed) twice per request.
    """

    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        return _CoalescingStream(await self._backend.connect_tcp(
            host, port, timeout=timeout, local_address=local_address, socket_options=socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        return _CoalescingStream(await self._backend.connect_unix_socket(
            path, timeout=timeout, socket_options=socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _CoalescingStream(httpcore.AsyncNetworkStream):
    """Holds back the first write after a read (a request's head) until the next write or read.

    Only the head is held, never body bytes: a streamed body still goes out chunk by chunk, and
    a request without a body is flushed by the empty end-of-message write or by the first read.
    """

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._held = b""
        self._holding = True

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._holding and not self._held and buffer:
            self._held = buffer
            return
        held, self._held, self._holding = self._held, b"", False
        data = held + buffer
        if data:
            await self._stream.write(data, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            held, self._held = self._held, b""
            await self._stream.write(held, timeout)
        self._holding = True
        return await self._stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._held = b""
        await self._stream.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        return _CoalescingStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


_COALESCING = _CoalescingBackend()
