"""The coordinator over HTTP: a Starlette app serving an :class:`EmbeddedCoordinator` (DESIGN.md's wire
table), run by ``consumer-kit coordinator serve``.

Bearer tokens come from ``COORDINATOR_TOKENS``; each maps to the tenant and application that scope
its receipts. Bodies are refused over ``COORDINATOR_BODY_LIMIT_BYTES`` from ``Content-Length`` when
given and by counting while streaming otherwise, so an oversized body is never read whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

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


MAX_JSON_DEPTH = 32
"""Request bodies nested deeper (objects and arrays) are ``400 invalid_request``, refused before they are
parsed: no request field needs it, and deep nesting costs recursion in parsing, validation and the
fingerprint."""


def _error(status: int, code: str) -> JSONResponse:
    return JSONResponse({"error": code}, status_code=status)


class _Endpoints:
    """The coordinator's endpoints, for the bearers of ``tokens`` (bearer -> (tenant, application))."""

    def __init__(self, coordinator: EmbeddedCoordinator, tokens: dict[str, tuple[str, str]]) -> None:
        self.limit = coordinator.settings.coordinator_body_limit_bytes
        # Tokens are looked up by their SHA-256, so the lookup's timing says nothing about a token's bytes.
        self.by_digest = {hashlib.sha256(t.encode()).digest(): coordinator.scoped(*scope)
                          for t, scope in tokens.items()}

    def authenticate(self, request: Request) -> EmbeddedCoordinator | None:
        credentials = request.headers.getlist("authorization")
        if len(credentials) != 1:  # none, or two to choose from: we never pick one
            return None
        scheme, _, token = credentials[0].partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        return self.by_digest.get(hashlib.sha256(token.strip().encode()).digest())

    async def read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            raise _TooLarge()
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limit:
                raise _TooLarge()
            chunks.append(chunk)
        return loads_json(b"".join(chunks), max_depth=MAX_JSON_DEPTH)  # UnparseableJson is a ValueError

    async def create(self, request: Request, operation: str) -> Response:
        scoped = self.authenticate(request)
        if scoped is None:
            return _error(401, "unauthorized")
        keys = request.headers.getlist("idempotency-key")
        if len(keys) > 1:  # which one was meant? Never pick one (as the webhook receiver with signatures)
            metrics.REQUESTS.labels("invalid").inc()
            return _error(400, "invalid_idempotency_key")
        key = keys[0] if keys else None
        if key is not None:
            try:
                # Starlette decodes header bytes as latin-1; keys are UTF-8 (their 255-byte limit counts UTF-8 bytes).
                key = validate_key(key.encode("latin-1").decode("utf-8"))
            except (InvalidKey, UnicodeError):
                metrics.REQUESTS.labels("invalid").inc()
                return _error(400, "invalid_idempotency_key")
        try:
            payload = await self.read_json(request)
        except _TooLarge:
            return _error(413, "body_too_large")
        except ValueError:
            return _error(400, "invalid_request")
        except ClientDisconnect:  # gone, or cut off for sending too slowly: nobody reads an answer
            return _error(400, "client_disconnected")
        generated = request.headers.get(GENERATED_HEADER, "").lower() == "generated"
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
        headers = {"Idempotency-Replayed": "true"} if replayed else {}
        return JSONResponse(body, status_code=201, headers=headers)

    async def sessions(self, request: Request) -> Response:
        return await self.create(request, "session")

    async def delegations(self, request: Request) -> Response:
        return await self.create(request, "delegation")

    async def finish(self, request: Request) -> Response:
        scoped = self.authenticate(request)
        if scoped is None:
            return _error(401, "unauthorized")
        session_id = request.path_params["session_id"]
        try:
            if request.path_params["action"] == "end":
                await scoped.end_session(session_id)
            elif request.path_params["action"] == "revoke":
                await scoped.revoke_session(session_id)
            else:
                return _error(404, "not_found")
        except CoordinatorRejected as exc:
            return _error(exc.status or 400, exc.code)
        return Response(status_code=204)


def create_app(coordinator: EmbeddedCoordinator, tokens: dict[str, tuple[str, str]], *,
               sweep_interval: float | None = None) -> Starlette:
    """The ASGI app. ``tokens`` maps bearer -> (tenant, application); ``sweep_interval`` runs the
    retention cleaner in the background while the app is up."""
    endpoints = _Endpoints(coordinator, tokens)

    async def metrics_endpoint(_request: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(_sweep_forever(coordinator, sweep_interval)) if sweep_interval else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    return Starlette(
        routes=[
            Route("/v1/sessions", endpoints.sessions, methods=["POST"]),
            Route("/v1/delegations", endpoints.delegations, methods=["POST"]),
            Route("/v1/sessions/{session_id}/{action}", endpoints.finish, methods=["POST"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


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
    engine = create_engine(settings.database_url, pool_size=settings.db_pool_size)
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
