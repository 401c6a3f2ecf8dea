"""The ASGI face of a :class:`~consumer_kit.ConsumerApp` (Starlette): HTTP sources, health, metrics.

``app.asgi()`` routes each :class:`~consumer_kit.http.HttpSource`'s path to its ``handle`` and serves

- ``GET /healthz``: 200 while the process is up;
- ``GET /readyz``: 200 when the app is started, the database answers and its schema is at head; 503
  otherwise;
- ``GET /metrics``: the Prometheus exposition.

Its lifespan starts and stops the ConsumerApp (``app.running()``), so uvicorn (``consumer-kit run``)
drives the whole worker. Mounted inside another Starlette or FastAPI app, whose router does not run
a mounted app's lifespan, give the parent ``lifespan=consumer_kit.asgi.lifespan(app)``.

The request helpers and the base class of the HTTP sources are in :mod:`consumer_kit.http_intake`;
this module needs of the app only :class:`ServedApp`, so it imports nothing of :mod:`consumer_kit.app`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from consumer_kit.http import HttpSource
from consumer_kit.store import schema_revisions

if TYPE_CHECKING:
    from consumer_kit.settings import Settings

log = logging.getLogger("consumer_kit.asgi")


class _Handled(Protocol):
    @property
    def source(self) -> object: ...


class ServedApp(Protocol):
    """What this module needs of a :class:`~consumer_kit.ConsumerApp`: its handlers' sources, its
    engine (``RuntimeError`` until started), its settings, ``running()`` and ``asgi()``."""

    @property
    def specs(self) -> Sequence[_Handled]: ...

    @property
    def engine(self) -> AsyncEngine: ...

    @property
    def settings(self) -> Settings: ...

    def running(self) -> contextlib.AbstractAsyncContextManager[object]: ...

    def asgi(self) -> Starlette: ...


def lifespan(app: ServedApp) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    """A Starlette/FastAPI ``lifespan`` that runs ``app`` (start on startup, drain on shutdown)."""

    @contextlib.asynccontextmanager
    async def run(_parent: Any) -> AsyncIterator[None]:
        async with app.running():
            yield

    return run


def build(app: ServedApp) -> Starlette:
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


def serve(app: ServedApp, *, host: str, port: int, log_level: str = "info") -> None:
    """Run ``app.asgi()`` under uvicorn until SIGTERM/SIGINT (what ``consumer-kit run`` does for an app
    with HTTP sources): uvicorn stops accepting, finishes requests, then the lifespan drains the app."""
    import signal

    import uvicorn

    config = uvicorn.Config(
        app.asgi(), host=host, port=port, lifespan="on", log_level=log_level.lower(),
        timeout_graceful_shutdown=int(app.settings.shutdown_grace_seconds) or None,
    )
    # uvicorn re-raises the signal that stopped it once it has shut down, to the handlers that were
    # installed before; these ignore it, so a drained worker exits 0 as the non-HTTP `run` does.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
