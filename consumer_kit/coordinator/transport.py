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
is closed. Timeouts, errors (mapped to httpx's exceptions by ``AsyncHTTPTransport``), TLS and the
HTTP/1.1 protocol are httpcore's own.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Any

import httpcore
import httpx


class KeepAliveTransport(httpx.AsyncHTTPTransport):
    """``httpx.AsyncHTTPTransport`` (HTTP/1.1, no proxy) on :class:`_KeepAlivePool`."""

    def __init__(self, *, limits: httpx.Limits | None = None, verify: ssl.SSLContext | bool = True) -> None:
        limits = limits or httpx.Limits(max_connections=100, keepalive_expiry=5.0)
        super().__init__(limits=limits, verify=verify, trust_env=False)
        self._pool = _KeepAlivePool(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
            max_connections=limits.max_connections,
            keepalive_expiry=limits.keepalive_expiry,
        )


class _KeepAlivePool(httpcore.AsyncConnectionPool):
    def __init__(self, *, ssl_context: ssl.SSLContext, max_connections: int | None,
                 keepalive_expiry: float | None) -> None:
        super().__init__(ssl_context=ssl_context, max_connections=max_connections,
                         keepalive_expiry=keepalive_expiry)
        self._limit = max_connections
        self._slots = asyncio.Semaphore(max_connections) if max_connections else None
        self._idle: dict[tuple[bytes, bytes, int], list[httpcore.AsyncHTTPConnection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        if request.url.scheme not in (b"http", b"https"):
            raise httpcore.UnsupportedProtocol(f"unsupported scheme {request.url.scheme!r}")
        if self._closed:
            raise RuntimeError("the connection pool is closed")
        if self._slots is not None:
            timeout = request.extensions.get("timeout", {}).get("pool")
            try:
                async with asyncio.timeout(timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpcore.PoolTimeout("no connection became free within the pool timeout") from None
        connection: httpcore.AsyncHTTPConnection | None = None
        try:
            origin = request.url.origin
            idle = self._idle.get((origin.scheme, origin.host, origin.port))
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
            response = await connection.handle_async_request(request)
        except BaseException:
            if connection is not None:
                await connection.aclose()
            self._release()
            raise
        return httpcore.Response(
            status=response.status, headers=response.headers, extensions=response.extensions,
            content=_Returning(self, origin, connection, response),
        )

    def _release(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def _give_back(self, origin: httpcore.Origin, connection: httpcore.AsyncHTTPConnection) -> None:
        if connection.is_available() and not self._closed:
            self._idle.setdefault((origin.scheme, origin.host, origin.port), []).append(connection)
        else:
            await connection.aclose()
        self._release()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await connection.aclose()

    async def __aexit__(self, exc_type: type[BaseException] | None = None,
                        exc_value: BaseException | None = None, traceback: TracebackType | None = None) -> None:
        await self.aclose()

    @property
    def connections(self) -> list[httpcore.AsyncConnectionInterface]:
        return [c for connections in self._idle.values() for c in connections]


class _Returning:
    """The response body; closing it returns the connection (and its slot) to the pool."""

    def __init__(self, pool: _KeepAlivePool, origin: httpcore.Origin, connection: httpcore.AsyncHTTPConnection,
                 response: httpcore.Response) -> None:
        self._pool, self._origin, self._connection, self._response = pool, origin, connection, response
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_stream():
                yield chunk
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            await self._response.aclose()
        finally:
            await self._pool._give_back(self._origin, self._connection)


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
