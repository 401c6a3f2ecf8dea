"""How consumer-kit runs uvicorn (the worker's HTTP sources and the served coordinator): bounded requests.

uvicorn bounds neither the size of a request head with its fast parser (httptools buffers a head of
any size; h11's ``h11_max_incomplete_event_size`` caps only what is buffered *incomplete*, so a large
head that arrives in one read passes) nor the time a client takes to send a request: its
``timeout_keep_alive`` runs only between requests and stops at the first byte, so a client that
trickles a head or a body a byte at a time (slowloris) holds its connection, and the server's
shutdown, forever (uvicorn's ``--timeout-request-start`` was proposed and never merged). An ASGI
middleware cannot close that gap: the application is called only once the whole head has been read.

uvicorn has no public way to put code between a socket and its HTTP protocol (its protocol classes are
not its public API), so the bound is a front of our own: :func:`serve_until` accepts the clients'
connections on the listening socket, and each gets a gate (:class:`BoundedHttp`) that hands its bytes on,
over a Unix socket, to uvicorn (``http="httptools"``) serving the app on that Unix socket, and hands
uvicorn's answers back. The gate frames the byte stream with a parser of its own (httptools, with the
leniency uvicorn sets on its own, so both see the same requests) and, per request:

- a head over ``HTTP_MAX_HEADER_BYTES`` is answered 431 and the connection closed, before the excess
  reaches uvicorn's parser;
- a request not received whole ``HTTP_REQUEST_TIMEOUT_SECONDS`` after its first byte (or after the
  connection opened, for a connection that sends nothing) is cut off: 408 while its head is
  incomplete, a plain close once the application is reading its body (the application then sees the
  client as disconnected).

Everything else (parsing for the application, keep-alive, graceful shutdown) is uvicorn's, unchanged;
flow control is passed through (a side that cannot keep up pauses reading on the other). Time spent
processing a request or sending its response is not bounded here.

What the front costs, against the gate that wrapped uvicorn's (internal) protocol class in the same
process: a second hop per request over a Unix socket (two more reads and writes each way), measured with
bench/coordinator.py (HttpCoordinator against ``consumer-kit coordinator serve``); and uvicorn's log and
``request.client`` see the Unix socket, not the client's address (the gate logs that address itself).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
from typing import Any, cast

import httptools
import uvicorn

from consumer_kit import metrics
from consumer_kit.errors import ConfigurationError
from consumer_kit.settings import Settings

log = logging.getLogger("consumer_kit.http.server")

LINGER_SECONDS = 2.0
"""After a refusal, how long the rest of the client's request is read and discarded before the close,
so that unread bytes do not turn the answer into a connection reset the client never reads past."""


def _refusal(status: int, phrase: str, code: str) -> bytes:
    body = b'{"error": "' + code.encode("ascii") + b'"}'
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("ascii") + body


_HEAD_TOO_LARGE = _refusal(431, "Request Header Fields Too Large", "request_header_too_large")
_TIMED_OUT = _refusal(408, "Request Timeout", "request_timeout")


class BoundedHttp(asyncio.Protocol):
    """One client connection: its bytes go through the gate (see the module docstring) to a connection of
    its own to uvicorn on ``upstream`` (a Unix socket path), and uvicorn's answers come back."""

    def __init__(self, upstream: str, max_header_bytes: int, request_seconds: float) -> None:
        self.max_header_bytes, self.request_seconds = max_header_bytes, request_seconds
        self._upstream_path = upstream
        self._loop = asyncio.get_running_loop()
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(_Framing(self))
        try:  # as uvicorn's protocol does, so that both parsers accept the same bytes
            self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # pragma: no cover (httptools < 0.6.3, like uvicorn)
            pass
        self._transport: asyncio.Transport | None = None
        self._upstream: asyncio.Transport | None = None
        self._pending: list[bytes] | None = []  # what arrived before the upstream connection was made
        self._connecting: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._upgraded = False
        self._messages = 0  # requests begun on this connection
        self.in_head = False  # inside a request head (begun, headers not complete)
        self.head_bytes = 0  # bytes of the current head seen in completed parts (URL, header lines)
        self._whole_chunks = 0  # bytes of the reads that fell wholly inside the current head
        self.oversized = False

    # asyncio.Protocol, the client's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self._arm()  # a connection that never sends a request is closed too
        self._connecting = self._loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            upstream, _ = await self._loop.create_unix_connection(lambda: _Upstream(self), self._upstream_path)
        except OSError:  # uvicorn stopped listening (shutting down): as if this server had
            self._close()
            return
        if self._transport is None or self._transport.is_closing() or self._refused:
            upstream.close()
            return
        self._upstream = upstream
        pending, self._pending = self._pending or [], None
        if pending:
            upstream.write(b"".join(pending))

    def data_received(self, data: bytes) -> None:
        if self._refused or self._upgraded:
            return  # lingering after a refusal, or bytes past an upgrade request: discarded
        if self._parser is not None:
            before, was_in_head = self._messages, self.in_head
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                # None of our servers upgrades: uvicorn answers the request, and its parser, stopped at
                # the upgrade, reads nothing after it. Neither do we, so that bytes trickling in cannot
                # keep resetting uvicorn's keep-alive timer; it closes the connection after the answer.
                self._upgraded = True
                self._disarm()
            except httptools.HttpParserError:
                self._untrack()  # uvicorn's parser fails on the same bytes and answers 400
            if self.in_head and was_in_head and before == self._messages:
                self._whole_chunks += len(data)
            if self.oversized or (self.in_head and self._whole_chunks > self.max_header_bytes):
                self._refuse("request_header_too_large", _HEAD_TOO_LARGE)
                return
        if self._upstream is not None:
            self._upstream.write(data)
        elif self._pending is not None:
            self._pending.append(data)

    def eof_received(self) -> None:
        # As uvicorn's own protocol: a client that half-closes is closed (returning None closes us).
        if self._upstream is not None:
            self._upstream.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._parser = None
        self._transport = None
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self._upstream is not None:
            self._upstream.close()  # uvicorn sees the client disconnect (the application too)

    def pause_writing(self) -> None:  # the client reads slower than uvicorn answers
        if self._upstream is not None:
            self._upstream.pause_reading()

    def resume_writing(self) -> None:
        if self._upstream is not None and not self._upstream.is_closing():
            self._upstream.resume_reading()

    # uvicorn's side (from _Upstream)

    def upstream_data(self, data: bytes) -> None:
        if self._transport is not None and not self._refused:
            self._transport.write(data)

    def upstream_paused(self, paused: bool) -> None:  # uvicorn reads slower than the client sends
        if self._transport is not None and not self._transport.is_closing():
            (self._transport.pause_reading if paused else self._transport.resume_reading)()

    def upstream_closed(self) -> None:
        self._upstream = None
        if not self._refused:  # after a refusal the linger closes us
            self._close()

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()  # what is written still goes out first

    # The gate

    def message_begun(self) -> None:
        self._messages += 1
        self.in_head, self.head_bytes, self._whole_chunks, self.oversized = True, 0, 0, False
        if self._timer is None:  # the first request's bound runs from the connection's opening
            self._arm()

    def message_complete(self) -> None:
        self._disarm()

    def _untrack(self) -> None:
        """Stop framing (the stream is no longer HTTP we can follow); the connection closes at the bound
        at the latest (uvicorn closes it at once after its 400)."""
        self._parser = None
        self.in_head = False
        if self._timer is None:
            self._arm()

    def _arm(self) -> None:
        self._timer = self._loop.call_later(self.request_seconds, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self.in_head:
            self._refuse("request_timeout", _TIMED_OUT)
            return
        # Nothing sent yet, or a body still arriving: the application (if any) sees a disconnect.
        self._count("request_timeout")
        transport.close()

    def _refuse(self, reason: str, answer: bytes) -> None:
        transport = self._transport
        assert transport is not None
        self._count(reason)
        self._refused = True
        self._disarm()
        if self._upstream is not None:
            self._upstream.close()
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = self._loop.call_later(LINGER_SECONDS, transport.close)

    def _count(self, reason: str) -> None:
        metrics.HTTP_CUT_OFF.labels(reason).inc()
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        log.info("closed an HTTP connection from %s: %s", peer[0] if peer else "?", reason)


class _Upstream(asyncio.Protocol):
    """The gate's connection to uvicorn."""

    def __init__(self, gate: BoundedHttp) -> None:
        self._gate = gate

    def data_received(self, data: bytes) -> None:
        self._gate.upstream_data(data)

    def eof_received(self) -> None:
        return None  # the transport closes: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._gate.upstream_closed()

    def pause_writing(self) -> None:
        self._gate.upstream_paused(True)

    def resume_writing(self) -> None:
        self._gate.upstream_paused(False)


class _Framing:
    """The gate parser's callbacks: where requests begin and end, and how large their heads are."""

    __slots__ = ("_gate",)

    def __init__(self, gate: BoundedHttp) -> None:
        self._gate = gate

    def on_message_begin(self) -> None:
        self._gate.message_begun()

    def on_url(self, url: bytes) -> None:
        self._grow(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value) + 4)  # ": " and CRLF

    def on_headers_complete(self) -> None:
        self._gate.in_head = False

    def on_message_complete(self) -> None:
        self._gate.message_complete()

    def _grow(self, size: int) -> None:
        gate = self._gate
        gate.head_bytes += size
        if gate.head_bytes > gate.max_header_bytes:
            gate.oversized = True


class BoundedConfig(uvicorn.Config):
    """``uvicorn.Config`` with the request bounds :func:`serve_until` puts in front of uvicorn."""

    def __init__(self, app: Any, *, max_header_bytes: int, request_seconds: float, **options: Any) -> None:
        super().__init__(app, **options)
        self.max_header_bytes, self.request_seconds = max_header_bytes, request_seconds


def server_config(app: Any, settings: Settings, *, host: str, port: int, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for one of our servers: ``app`` on ``host:port`` behind the bounds of
    ``settings`` (``HTTP_MAX_HEADER_BYTES``, ``HTTP_REQUEST_TIMEOUT_SECONDS``), applied when it is run by
    :func:`serve_until`; without WebSockets (none of our servers speaks them); ``options`` go to
    ``uvicorn.Config`` as they are."""
    return BoundedConfig(app, host=host, port=port, http="httptools", ws="none",
                         max_header_bytes=settings.http_max_header_bytes,
                         request_seconds=settings.http_request_timeout_seconds, **options)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, for :func:`serve_until`; a :class:`ConfigurationError` saying
    so when it cannot be (the port is taken, the address is not this host's).

    Bound by us before anything else starts, rather than by uvicorn once the app is up: uvicorn answers
    a failed bind with ``sys.exit`` from inside its task, which would end the process with the app still
    open and a traceback instead of one clear line."""
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


async def serve_until(server: uvicorn.Server, stop: asyncio.Event, sock: socket.socket | None = None) -> None:
    """Run ``server`` until it stops by itself (uvicorn takes SIGTERM and SIGINT while it runs) or
    ``stop`` is set; either way it stops gracefully (stop accepting, finish the requests in flight).
    ``sock``: a socket from :func:`listen` to serve on (uvicorn then does not bind one itself). A server
    configured by :func:`server_config` is served behind its bounds (see the module docstring)."""
    config = server.config
    if isinstance(config, BoundedConfig):
        if sock is None:
            sock = listen(config.host, config.port)
        with tempfile.TemporaryDirectory(prefix="consumer-kit-http-") as folder:
            await _serve_bounded(server, config, stop, sock, os.path.join(folder, "uvicorn.sock"))
        return
    await _serve(server, stop, sock)


async def _serve_bounded(server: uvicorn.Server, config: BoundedConfig, stop: asyncio.Event,
                         sock: socket.socket, path: str) -> None:
    inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        inner.bind(path)
        # Listening before uvicorn starts: a client accepted meanwhile waits in this backlog, as it
        # would in the listening socket's, until uvicorn serves.
        inner.listen(config.backlog)
        front = await asyncio.get_running_loop().create_server(
            lambda: BoundedHttp(path, config.max_header_bytes, config.request_seconds), sock=sock,
            backlog=config.backlog)
    except BaseException:
        inner.close()
        raise
    try:
        await _serve(server, stop, inner, front=front, shown=sock)
    finally:
        front.close()
        inner.close()


async def _serve(server: uvicorn.Server, stop: asyncio.Event, sock: socket.socket | None,
                 front: asyncio.Server | None = None, shown: socket.socket | None = None) -> None:
    shown = shown or sock
    if shown is not None:
        host, port = shown.getsockname()[:2]
        log.info("serving http://%s:%d", f"[{host}]" if ":" in host else host, port)
    serving = asyncio.ensure_future(server.serve(sockets=[sock] if sock is not None else None))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if front is not None:
            front.close()  # stop accepting; the connections open finish with uvicorn's
        server.should_exit = True
        await serving
    finally:
        stopping.cancel()
        if not serving.done():
            serving.cancel()
