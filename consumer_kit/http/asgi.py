"""The ASGI face of a :class:`~consumer_kit.ConsumerApp` (Starlette): HTTP sources, health, metrics.

``app.asgi()`` routes each :class:`~consumer_kit.http.HttpSource`'s path to its ``handle`` and serves

- ``GET /healthz``: 200 while the process is up;
- ``GET /readyz``: 200 when the app takes work (``app.readiness()``: every source started and none
  saying it is not ready, the database answering with its schema at head); 503 with the reason
  otherwise;
- ``GET /metrics``: the Prometheus exposition;
- the operator's console under ``CONSOLE_PATH``, when it is set (:mod:`consumer_kit.console`).

Its lifespan starts and stops the ConsumerApp (``app.running()``) when another server runs it (say
``uvicorn module:app.asgi()``); ``consumer-kit run`` starts the app itself before it listens
(:func:`serve`), so that a stop signal during a slow start-up cancels it. Mounted inside another
Starlette or FastAPI app, whose router does not run a mounted app's lifespan, give the parent
``lifespan=consumer_kit.http.asgi.lifespan(app)``.

The request helpers and the base class of the HTTP sources are in :mod:`consumer_kit.http.intake`;
this module needs of the app only :class:`ServedApp`, so it imports nothing of :mod:`consumer_kit.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from consumer_kit import logs
from consumer_kit.http import HttpSource

if TYPE_CHECKING:
    from consumer_kit.app import ConsumerApp
    from consumer_kit.settings import Settings

log = logging.getLogger("consumer_kit.http.asgi")


class _Handled(Protocol):
    @property
    def source(self) -> object: ...


class _Readiness(Protocol):
    @property
    def ready(self) -> bool: ...

    @property
    def reason(self) -> str | None: ...

    @property
    def source(self) -> str | None: ...

    @property
    def detail(self) -> str | None: ...


class ServedApp(Protocol):
    """What this module needs of a :class:`~consumer_kit.ConsumerApp`: its handlers' sources, its
    settings, ``readiness()``, ``running()``, ``asgi()``, ``start()`` and ``stop()``."""

    @property
    def specs(self) -> Sequence[_Handled]: ...

    async def readiness(self) -> _Readiness: ...

    @property
    def settings(self) -> Settings: ...

    def running(self) -> contextlib.AbstractAsyncContextManager[object]: ...

    def asgi(self) -> Starlette: ...

    async def start(self) -> None: ...

    async def stop(self, grace: float | None = None) -> None: ...


def lifespan(app: ServedApp) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    """A Starlette/FastAPI ``lifespan`` that runs ``app`` (start on startup, drain on shutdown)."""

    @contextlib.asynccontextmanager
    async def run(_parent: Any) -> AsyncIterator[None]:
        async with app.running():
            yield

    return run


def build(app: ServedApp) -> Starlette:
    """The ASGI application of ``app``: its HTTP sources, ``/healthz``, ``/readyz``, ``/metrics``."""
    routes: list[BaseRoute] = []
    for spec in app.specs:
        source = spec.source
        if isinstance(source, HttpSource):
            routes.append(Route(source.path, source.handle, methods=list(source.methods),
                                name=source.name))

    async def healthz(_request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(_request: Request) -> Response:
        readiness = await app.readiness()
        if readiness.ready:
            return JSONResponse({"ready": True})
        answer = {"ready": False, "reason": readiness.reason}
        answer.update({name: value for name in ("source", "detail")
                       if (value := getattr(readiness, name)) is not None})
        log.info("not ready: %s", answer)
        return JSONResponse(answer, status_code=503)

    async def metrics_endpoint(_request: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    routes += [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    if app.settings.console_path:
        from typing import cast

        from consumer_kit.console import Console  # Jinja2 and itsdangerous: the console extra, only when asked

        console = Console(app.settings, app=cast("ConsumerApp", app), counts_from_start=True)
        routes.append(Mount(app.settings.console_path, app=console.asgi()))
    return Starlette(routes=routes, lifespan=lifespan(app))


async def serve(app: ServedApp, *, host: str, port: int, log_level: str = "info",
                stop: asyncio.Event | None = None) -> None:
    """Start ``app``, serve ``app.asgi()`` under uvicorn until SIGTERM/SIGINT (or ``stop``), then drain
    (what ``consumer-kit run`` does for an app with HTTP sources).

    The app is started here, before uvicorn listens, rather than by uvicorn's lifespan, so that a stop
    signal during a slow start-up cancels it (uvicorn would only note the signal and wait for the
    start-up to end). On a stop uvicorn stops accepting and finishes the requests in flight (at most
    ``SHUTDOWN_GRACE_SECONDS``), then the app drains. Requests are bounded as
    :mod:`consumer_kit.http.server` says.
    """
    import uvicorn

    from consumer_kit.http.server import listen, serve_until, server_config
    from consumer_kit.signals import run_app, stop_event

    sock = listen(host, port)  # a port that is taken stops us before anything is opened
    try:
        stop = stop if stop is not None else stop_event()
        # LOG_FORMAT=json: uvicorn's records go to the root logger's JSON handler, not its own text ones.
        own_logging = {"log_config": None} if logs.json_configured() else {}
        config = server_config(app.asgi(), app.settings, host=host, port=port, lifespan="off",
                               log_level=log_level.lower(), **own_logging,
                               timeout_graceful_shutdown=int(app.settings.shutdown_grace_seconds) or None)
        await run_app(app, stop, lambda: serve_until(uvicorn.Server(config), stop, sock))
    finally:
        sock.close()
