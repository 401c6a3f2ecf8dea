"""The coordinator over HTTP: an ASGI app serving an :class:`EmbeddedCoordinator` (DESIGN.md's wire
table), run by ``consumer-kit coordinator serve`` under uvicorn.

Bearer tokens come from ``COORDINATOR_TOKENS``; each maps to the tenant and application that scope
its receipts. Bodies are refused over ``COORDINATOR_BODY_LIMIT_BYTES`` from ``Content-Length`` when
given and by counting while streaming otherwise, so an oversized body is never read whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from consumer_kit.coordinator import metrics
from consumer_kit.coordinator.embedded import EmbeddedCoordinator
from consumer_kit.coordinator.http import GENERATED_HEADER
from consumer_kit.coordinator.protocol import DelegationRequest, SessionRequest
from consumer_kit.errors import (
    CoordinatorRejected,
    InvalidKey,
    ReceiptLimitExceeded,
)
from consumer_kit.http.server import listen, serve_until, server_config
from consumer_kit.keys import validate_key
from consumer_kit.settings import Settings
from consumer_kit.signals import StopRequested, stop_event, unless_stopped
from consumer_kit.store import create_engine, ensure_schema
from consumer_kit.untrusted import loads_json

log = logging.getLogger("consumer_kit.coordinator.server")


class _TooLarge(Exception):
    """The request body is over COORDINATOR_BODY_LIMIT_BYTES."""


class _Disconnected(Exception):
    """The client went away before its request's body was read."""


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    content: bytes
    headers: list[tuple[bytes, bytes]]


GENERATED_HEADER_BYTES = GENERATED_HEADER.lower().encode("ascii")


MAX_JSON_DEPTH = 32
"""Request bodies nested deeper (objects and arrays) are ``400 invalid_request``, refused before they are
parsed: no request field needs it, and deep nesting costs recursion in parsing, validation and the
fingerprint."""


_JSON = [(b"content-type", b"application/json")]


def _answer(status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> _Answer:
    content = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    return _Answer(status, content, _JSON + (headers or []))


def _error(status: int, code: str) -> _Answer:
    return _answer(status, {"error": code})


_REPLAYED = [(b"idempotency-replayed", b"true")]
_NO_CONTENT = _Answer(204, b"", [])
_HEALTHY = _answer(200, {"status": "ok"})
_FINISH = re.compile(r"/v1/sessions/([^/]+)/([^/]+)")
"""``/v1/sessions/{session_id}/{action}``, matched on the decoded path as Starlette's router matches it."""


class _Request:
    """What the endpoints read of a request: its headers by (lower-case) name, its body with a bound."""

    __slots__ = ("headers", "receive")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, []).append(value)
        self.headers = headers
        self.receive = receive

    def getlist(self, name: bytes) -> list[bytes]:
        return self.headers.get(name, [])

    def get(self, name: bytes) -> bytes | None:
        values = self.headers.get(name)
        return values[0] if values else None

    async def body(self, limit: int) -> bytes:
        """The whole body; :class:`_TooLarge` as soon as it is over ``limit`` bytes (declared or
        counted), :class:`_Disconnected` when the client goes first."""
        declared = self.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise _TooLarge()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _TooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Endpoints:
    """The coordinator's endpoints, for the bearers of ``tokens`` (bearer -> (tenant, application))."""

    def __init__(self, coordinator: EmbeddedCoordinator, tokens: dict[str, tuple[str, str]]) -> None:
        self.limit = coordinator.settings.coordinator_body_limit_bytes
        # Tokens are looked up by their SHA-256, so the lookup's timing says nothing about a token's bytes.
        self.by_digest = {hashlib.sha256(t.encode()).digest(): coordinator.scoped(*scope)
                          for t, scope in tokens.items()}

    def authenticate(self, request: _Request) -> EmbeddedCoordinator | None:
        credentials = request.getlist(b"authorization")
        if len(credentials) != 1:  # none, or two to choose from: we never pick one
            return None
        scheme, _, token = credentials[0].partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return None
        return self.by_digest.get(hashlib.sha256(token.strip()).digest())

    async def create(self, request: _Request, operation: str) -> _Answer:
        scoped = self.authenticate(request)
        if scoped is None:
            return _error(401, "unauthorized")
        keys = request.getlist(b"idempotency-key")
        if len(keys) > 1:  # which one was meant? Never pick one (as the webhook receiver with signatures)
            metrics.REQUESTS.labels("invalid").inc()
            return _error(400, "invalid_idempotency_key")
        key: str | None = None
        if keys:
            try:
                key = validate_key(keys[0].decode("utf-8"))  # keys are UTF-8 (their limit counts UTF-8 bytes)
            except (InvalidKey, UnicodeError):
                metrics.REQUESTS.labels("invalid").inc()
                return _error(400, "invalid_idempotency_key")
        try:
            payload = loads_json(await request.body(self.limit), max_depth=MAX_JSON_DEPTH)
        except _TooLarge:
            return _error(413, "body_too_large")
        except _Disconnected:  # gone, or cut off for sending too slowly: nobody reads an answer
            return _error(400, "client_disconnected")
        except ValueError:  # UnparseableJson
            return _error(400, "invalid_request")
        generated = (request.get(GENERATED_HEADER_BYTES) or b"").lower() == b"generated"
        try:
            if operation == "session":
                session = await scoped.create_session(
                    SessionRequest.model_validate(payload), idempotency_key=key, generated_key=generated)
                replayed = session.replayed
                body = {"session_id": session.session_id, "status": session.status,
                        "expires_at": session.expires_at.isoformat()}
            else:
                delegation = await scoped.create_delegation(
                    DelegationRequest.model_validate(payload), idempotency_key=key, generated_key=generated)
                replayed = delegation.replayed
                body = {"delegation_id": delegation.delegation_id, "status": delegation.status,
                        "expires_at": delegation.expires_at.isoformat()}
        except ValidationError:
            return _error(400, "invalid_request")
        except ReceiptLimitExceeded:
            return _error(429, ReceiptLimitExceeded.code)
        except CoordinatorRejected as exc:
            return _error(exc.status or 400, exc.code)
        return _answer(201, body, _REPLAYED if replayed else None)

    async def finish(self, request: _Request, session_id: str, action: str) -> _Answer:
        scoped = self.authenticate(request)
        if scoped is None:
            return _error(401, "unauthorized")
        try:
            if action == "end":
                await scoped.end_session(session_id)
            elif action == "revoke":
                await scoped.revoke_session(session_id)
            else:
                return _error(404, "not_found")
        except CoordinatorRejected as exc:
            return _error(exc.status or 400, exc.code)
        return _NO_CONTENT


class CoordinatorApp:
    """The coordinator's ASGI app (see :func:`create_app`).

    Its routing is written here rather than taken from Starlette: five fixed routes need one dict
    lookup (and one pattern), where Starlette's middleware stack, router and request and response
    objects were a fifth of the server's CPU per creation beyond the coordinator's own work
    (bench/coordinator.py). What Starlette answered is answered the same: 404 for an unknown path,
    405 with ``Allow`` for another method, ``HEAD`` wherever ``GET`` is; an exception in an endpoint
    reaches uvicorn, which logs it and answers 500."""

    def __init__(self, coordinator: EmbeddedCoordinator, tokens: dict[str, tuple[str, str]], *,
                 sweep_interval: float | None = None) -> None:
        self._coordinator = coordinator
        self._endpoints = _Endpoints(coordinator, tokens)
        self._sweep_interval = sweep_interval

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # no WebSockets here (our servers run uvicorn with ws="none")
            return
        answer = await self._route(scope, receive)
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": [*answer.headers, (b"content-length", b"%d" % len(answer.content))]
                    if answer.status != 204 else answer.headers})
        await send({"type": "http.response.body", "body": answer.content})

    async def _route(self, scope: Scope, receive: Receive) -> _Answer:
        path, method = scope["path"], scope["method"]
        endpoints = self._endpoints
        if path in ("/v1/sessions", "/v1/delegations"):
            if method != "POST":
                return _not_allowed("POST")
            operation = "session" if path == "/v1/sessions" else "delegation"
            return await endpoints.create(_Request(scope, receive), operation)
        if path in ("/healthz", "/metrics"):
            if method not in ("GET", "HEAD"):
                return _not_allowed("GET, HEAD")
            if path == "/healthz":
                return _HEALTHY
            return _Answer(200, generate_latest(), [(b"content-type", CONTENT_TYPE_LATEST.encode("latin-1"))])
        finish = _FINISH.fullmatch(path)
        if finish is not None:
            if method != "POST":
                return _not_allowed("POST")
            return await endpoints.finish(_Request(scope, receive), finish[1], finish[2])
        return _Answer(404, b"Not Found", [(b"content-type", b"text/plain; charset=utf-8")])

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        interval = self._sweep_interval
        task = asyncio.create_task(_sweep_forever(self._coordinator, interval)) if interval else None
        await send({"type": "lifespan.startup.complete"})
        try:
            await receive()  # lifespan.shutdown
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await send({"type": "lifespan.shutdown.complete"})


def _not_allowed(allow: str) -> _Answer:
    return _Answer(405, b"Method Not Allowed",
                   [(b"content-type", b"text/plain; charset=utf-8"), (b"allow", allow.encode("ascii"))])


def create_app(coordinator: EmbeddedCoordinator, tokens: dict[str, tuple[str, str]], *,
               sweep_interval: float | None = None) -> CoordinatorApp:
    """The ASGI app. ``tokens`` maps bearer -> (tenant, application); ``sweep_interval`` runs the
    retention cleaner in the background while the app is up (it needs the ASGI lifespan)."""
    return CoordinatorApp(coordinator, tokens, sweep_interval=sweep_interval)


async def _sweep_forever(coordinator: EmbeddedCoordinator, interval: float) -> None:
    while True:
        try:
            await coordinator.sweep()
        except Exception as exc:  # counted by sweep(); the next run may succeed
            log.error("receipt sweep failed: %s", type(exc).__name__)
        await asyncio.sleep(interval)


async def serve(settings: Settings, *, host: str = "127.0.0.1", port: int = 8080,
                stop: asyncio.Event | None = None) -> None:
    """Serve the coordinator on ``settings.database_url`` until SIGTERM/SIGINT (or ``stop``), then stop
    gracefully. A stop while the database is being prepared cancels that and closes what it opened.
    Requests are bounded as :mod:`consumer_kit.http.server` says."""
    import uvicorn

    stop = stop if stop is not None else stop_event()
    tokens = settings.coordinator_scopes()
    if not tokens:
        log.warning("COORDINATOR_TOKENS is empty: every request will be refused with 401")
    sock = listen(host, port)  # a port that is taken stops us before anything is opened
    engine = create_engine(settings.database_url, pool_size=settings.db_pool_size, pooler=settings.database_pooler)
    coordinator = EmbeddedCoordinator(engine, settings, digester=settings.digester())
    try:
        await unless_stopped(ensure_schema(engine), stop)
        app = create_app(coordinator, tokens, sweep_interval=settings.sweep_interval_seconds)
        config = server_config(app, settings, host=host, port=port, log_level="warning", access_log=False,
                               lifespan="on",
                               timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) or None)
        await serve_until(uvicorn.Server(config), stop, sock)
    except StopRequested:
        log.info("stop signal during start-up: stopped before serving")
    finally:
        sock.close()
        await coordinator.close()
        await engine.dispose()
