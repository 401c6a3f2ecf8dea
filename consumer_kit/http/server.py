"""How consumer-kit runs uvicorn (the worker's HTTP sources and the served coordinator): bounded requests.

uvicorn bounds neither the size of a request head with its fast parser (httptools buffers a head of
any size; h11's ``h11_max_incomplete_event_size`` caps only what is buffered *incomplete*, so a large
head that arrives in one read passes) nor the time a client takes to send a request: its
``timeout_keep_alive`` runs only between requests and stops at the first byte, so a client that
trickles a head or a body a byte at a time (slowloris) holds its connection, and the server's
shutdown, forever (uvicorn's ``--timeout-request-start`` was proposed and never merged). An ASGI
middleware cannot close that gap: the application is called only once the whole head has been read.

So each connection gets a gate in front of uvicorn's httptools protocol (:class:`BoundedHttp`). The gate
frames the byte stream with a parser of its own (httptools, the same parser and leniencies uvicorn's
protocol uses, so both see the same requests) and, per request:

- a head over ``HTTP_MAX_HEADER_BYTES`` is answered 431 and the connection closed, before the excess
  reaches uvicorn's parser;
- a request not received whole ``HTTP_REQUEST_TIMEOUT_SECONDS`` after its first byte (or after the
  connection opened, for a connection that sends nothing) is cut off: 408 while its head is
  incomplete, a plain close once the application is reading its body (the application then sees the
  client as disconnected).

Everything else (parsing for the application, keep-alive, flow control, graceful shutdown) is uvicorn's
protocol, unchanged. Time spent processing a request or sending its response is not bounded here.

The gate also hands uvicorn's protocol a transport of its own (:class:`_Coalescing`) that sends a
response's head with its body: uvicorn writes them separately, which was two ``send`` calls and two
TCP segments per answer, and a client woken (and parsing) twice.

Only uvicorn's public surface is used. ``uvicorn.Config(http=...)`` takes a protocol class, and
:class:`BoundedConfig` lets ``Config.load()`` resolve uvicorn's own httptools class as it always does,
then hands uvicorn a gate class in its place (``Config.http_protocol_class``, the class uvicorn's server
makes each connection's protocol with). The gate holds uvicorn's protocol rather than subclassing it,
and speaks to it only through ``asyncio.Protocol``'s methods: no internal module of uvicorn is imported
and no attribute of its protocol is touched. ``tests/acceptance/test_server_bounds.py`` fails at once if
uvicorn stops making its protocols from that class (the 431 and 408 answers would not come).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable
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
    """uvicorn's httptools protocol behind a gate that bounds each request's head size and the time it
    takes to arrive (see the module docstring). :func:`bounded_http` makes one with given bounds."""

    inner: type[asyncio.Protocol]  # the protocol class uvicorn resolved for http="httptools"
    max_header_bytes = 16_384
    request_seconds = 30.0

    def __init__(self, **kwargs: Any) -> None:
        # kwargs are what uvicorn hands its protocol class (config, server_state, app_state, ...): passed
        # on as they are, so that the gate depends on none of them.
        self._inner = self.inner(**kwargs)
        self._loop = asyncio.get_running_loop()
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(_Framing(self))
        try:  # as uvicorn's protocol does, so that both parsers accept the same bytes
            self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # pragma: no cover (httptools < 0.6.3, like uvicorn)
            pass
        self._transport: asyncio.Transport | None = None
        self._out: _Coalescing | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._upgraded = False
        self._messages = 0  # requests begun on this connection
        self.in_head = False  # inside a request head (begun, headers not complete)
        self.head_bytes = 0  # bytes of the current head seen in completed parts (URL, header lines)
        self._whole_chunks = 0  # bytes of the reads that fell wholly inside the current head
        self.oversized = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._out = _Coalescing(self._transport, self._loop)
        self._arm()  # a connection that never sends a request is closed too
        self._inner.connection_made(self._out)

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
        self._inner.data_received(data)

    def eof_received(self) -> None:
        self._inner.eof_received()  # returns None: the transport closes (after a refusal too)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._parser = None
        if self._out is not None:
            self._out.discard()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

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
        self._flush()
        transport.close()

    def _refuse(self, reason: str, answer: bytes) -> None:
        transport = self._transport
        assert transport is not None
        self._count(reason)
        self._refused = True
        self._disarm()
        self._flush()  # an earlier answer still held goes first
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = self._loop.call_later(LINGER_SECONDS, transport.close)

    def _flush(self) -> None:
        if self._out is not None:
            self._out.flush()

    def _count(self, reason: str) -> None:
        metrics.HTTP_CUT_OFF.labels(reason).inc()
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        log.info("closed an HTTP connection from %s: %s", peer[0] if peer else "?", reason)


class _Coalescing(asyncio.Transport):
    """The connection's transport as uvicorn's protocol sees it: a small write (a response's head) is
    held until the next write, which goes out with it, or until the loop's next turn, whichever comes
    first. At most one write of at most ``HOLD_BYTES`` is ever held, so flow control (the transport's
    own buffer and its pause_writing/resume_writing) sees every byte within one turn of the loop; a
    close or an EOF sends what is held first, an abort drops it. No await is involved: nothing here
    can be cancelled halfway."""

    HOLD_BYTES = 4096

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held = b""
        self._flushing: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._held and len(data) <= self.HOLD_BYTES and not self._transport.is_closing():
            self._held = bytes(data)
            if self._flushing is None:
                self._flushing = self._loop.call_soon(self.flush)
            return
        held, self._held = self._held, b""
        self._transport.write(held + data if held else data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def flush(self) -> None:
        """Send what is held, now."""
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        held, self._held = self._held, b""
        if held and not self._transport.is_closing():
            self._transport.write(held)

    def discard(self) -> None:
        """Drop what is held (the connection is gone)."""
        self._held = b""
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self.discard()
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


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


def bounded_http(inner: type[asyncio.Protocol], max_header_bytes: int, request_seconds: float) -> type[BoundedHttp]:
    """A :class:`BoundedHttp` class in front of ``inner`` (uvicorn's protocol class), with these bounds."""
    return cast(type[BoundedHttp], type("BoundedHttp", (BoundedHttp,), {
        "inner": inner, "max_header_bytes": max_header_bytes, "request_seconds": request_seconds}))


class BoundedConfig(uvicorn.Config):
    """``uvicorn.Config`` (``http="httptools"``) whose connections go through the gate: once uvicorn's
    :meth:`load` has resolved its protocol class, the gate's class takes its place."""

    def __init__(self, app: Any, *, max_header_bytes: int, request_seconds: float, **options: Any) -> None:
        super().__init__(app, http="httptools", **options)
        self.max_header_bytes, self.request_seconds = max_header_bytes, request_seconds

    def load(self) -> None:
        """uvicorn's own loading, then the gate in front of the protocol class it chose."""
        super().load()
        self.http_protocol_class = bounded_http(self.http_protocol_class, self.max_header_bytes,
                                                self.request_seconds)


def server_config(app: Any, settings: Settings, *, host: str, port: int, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for one of our servers: ``app`` on ``host:port`` behind the bounds of
    ``settings`` (``HTTP_MAX_HEADER_BYTES``, ``HTTP_REQUEST_TIMEOUT_SECONDS``), without WebSockets
    (none of our servers speaks them); ``options`` go to ``uvicorn.Config`` as they are."""
    return BoundedConfig(app, host=host, port=port, ws="none", max_header_bytes=settings.http_max_header_bytes,
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
    ``sock``: a socket from :func:`listen` to serve on (uvicorn then does not bind one itself)."""
    if sock is not None:
        host, port = sock.getsockname()[:2]
        log.info("serving http://%s:%d", f"[{host}]" if ":" in host else host, port)
    serving = asyncio.ensure_future(server.serve(sockets=[sock] if sock is not None else None))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await serving
    finally:
        stopping.cancel()
        if not serving.done():
            serving.cancel()
