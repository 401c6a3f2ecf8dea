"""The ASGI face of a :class:`~consumer_kit.ConsumerApp` (Starlette): HTTP sources, health, metrics.

``app.asgi()`` routes each :class:`~consumer_kit.http.HttpSource`'s path to its ``handle`` and serves

- ``GET /healthz``: 200 while the process is up;
- ``GET /readyz``: 200 when the app is started, the database answers and its schema is at head; 503
  otherwise;
- ``GET /metrics``: the Prometheus exposition.

Its lifespan starts and stops the ConsumerApp (``app.running()``), so uvicorn (``consumer-kit run``)
drives the whole worker. Mounted inside another Starlette or FastAPI app, whose router does not run
a mounted app's lifespan, give the parent ``lifespan=consumer_kit.asgi.lifespan(app)``.

The helpers below are shared by the HTTP sources: a capped body reader, single-valued header access,
and the one mapping of verdicts and rejections to responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from sqlalchemy import text
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from consumer_kit import metrics
from consumer_kit.delivery import Result
from consumer_kit.http import (
    HttpSource,
    MalformedRequest,
    PayloadTooLarge,
    RequestRejected,
    answer_for,
)
from consumer_kit.store import schema_revisions

if TYPE_CHECKING:
    from consumer_kit.app import ConsumerApp

log = logging.getLogger("consumer_kit.asgi")

_PRIVATE_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, at most ``limit`` bytes; :class:`PayloadTooLarge` before anything is hashed.

    A declared ``Content-Length`` over the limit is refused before reading; the stream is counted as
    it arrives as well, so a lying (or absent) ``Content-Length`` cannot get more than ``limit`` in.
    """
    declared = request.headers.getlist("content-length")
    if len(declared) > 1:
        raise MalformedRequest("repeated_content_length")
    if declared:
        try:
            length = int(declared[0])
        except ValueError:
            raise MalformedRequest("malformed_content_length") from None
        if length > limit:
            raise PayloadTooLarge()
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge()
            chunks.append(chunk)
    except ClientDisconnect:
        raise MalformedRequest("client_disconnected") from None
    return b"".join(chunks)


def single_headers(request: Request, required_single: Iterable[str] = ()) -> dict[str, str]:
    """The request's headers, lower-cased, one value each; credentials (``Authorization``,
    ``Cookie``) left out, since the result is stored with a parked delivery.

    A header named in ``required_single`` that arrives more than once is :class:`MalformedRequest`:
    a verifier must never have to guess which of two signatures or ids was meant.
    """
    names = set(required_single)
    headers: dict[str, str] = {}
    for raw_name, raw_value in request.scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        if name in headers and name in names:
            raise MalformedRequest("repeated_header")
        if name not in _PRIVATE_HEADERS:
            headers[name] = raw_value.decode("latin-1")
    return headers


def respond(result: Result) -> Response:
    """The response to a pipeline verdict (see :func:`consumer_kit.http.answer_for`)."""
    answer = answer_for(result)
    return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers)


def reject(source: str, exc: RequestRejected) -> Response:
    """The response to a refused request, counted by reason (never a key, a secret or a detail)."""
    metrics.HTTP_REJECTED.labels(source, exc.code if exc.status != 401 else "unauthenticated").inc()
    body = {"error": "unauthenticated" if exc.status == 401 else exc.code}
    challenge = getattr(exc, "challenge", None)
    headers = {"WWW-Authenticate": challenge} if challenge else None
    return JSONResponse(body, status_code=exc.status, headers=headers)


def unavailable() -> Response:
    """503 for a source that is not (or no longer) accepting deliveries."""
    return JSONResponse({"error": "not_accepting"}, status_code=503, headers={"Retry-After": "1"})


def lifespan(app: ConsumerApp) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    """A Starlette/FastAPI ``lifespan`` that runs ``app`` (start on startup, drain on shutdown)."""

    @contextlib.asynccontextmanager
    async def run(_parent: Any) -> AsyncIterator[None]:
        async with app.running():
            yield

    return run


def build(app: ConsumerApp) -> Starlette:
    """The ASGI application of ``app``: its HTTP sources, ``/healthz``, ``/readyz``, ``/metrics``."""
    routes: list[Route] = []
    for spec in app.specs:
        source = spec.source
        if isinstance(source, HttpSource):
            routes.append(Route(source.path, source.handle, methods=list(source.methods),
                                name=source.name))

    async def healthz(_request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(_request: Request) -> Response:
        try:
            engine = app.engine
        except RuntimeError:
            return JSONResponse({"ready": False, "reason": "not_started"}, status_code=503)
        try:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
            current, head = await schema_revisions(engine)
        except Exception as exc:
            log.warning("readiness check failed: %s", type(exc).__name__)
            return JSONResponse({"ready": False, "reason": "database_unreachable"}, status_code=503)
        if current != head:
            return JSONResponse({"ready": False, "reason": "schema_out_of_date"}, status_code=503)
        return JSONResponse({"ready": True})

    async def metrics_endpoint(_request: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    routes += [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan(app))


async def serve(app: ConsumerApp, *, host: str, port: int, log_level: str = "info",
                stop: asyncio.Event | None = None) -> None:
    """Start ``app``, serve ``app.asgi()`` under uvicorn until SIGTERM/SIGINT (or ``stop``), then drain
    (what ``consumer-kit run`` does for an app with HTTP sources).

    The app is started here, before uvicorn listens, rather than by uvicorn's lifespan, so that a stop
    signal during a slow start-up cancels it (uvicorn would only note the signal and wait for the
    start-up to end). On a stop uvicorn stops accepting and finishes the requests in flight (at most
    ``SHUTDOWN_GRACE_SECONDS``), then the app drains. Requests are bounded as
    :mod:`consumer_kit.httpserver` says.
    """
    import uvicorn

    from consumer_kit.httpserver import serve_until, server_config
    from consumer_kit.signals import run_app, stop_event

    stop = stop if stop is not None else stop_event()
    config = server_config(app.asgi(), app.settings, host=host, port=port, lifespan="off",
                           log_level=log_level.lower(),
                           timeout_graceful_shutdown=int(app.settings.shutdown_grace_seconds) or None)
    await run_app(app, stop, lambda: serve_until(uvicorn.Server(config), stop))
