"""ASGI apps (the coordinator server, a worker's ``app.asgi()``) on a real loopback socket, for tests and
benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from consumer_kit.coordinator.embedded import EmbeddedCoordinator
from consumer_kit.settings import Settings
from consumer_kit.store import create_engine, ensure_schema

if TYPE_CHECKING:
    from starlette.types import ASGIApp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.asynccontextmanager
async def served_asgi(app: ASGIApp, *, log_level: str = "warning",
                      settings: Settings | None = None) -> AsyncIterator[str]:
    """Serve ``app`` (lifespan on) under uvicorn on 127.0.0.1 and a free port, in this event loop;
    yields the base URL. With ``settings``, behind the request bounds our own servers have
    (:func:`consumer_kit.http.server.server_config`). uvicorn's log records go to the root logger like
    any other (it installs no logging configuration of its own), so a test sees what the server logged."""
    import uvicorn

    from consumer_kit.http.server import listen, serve_until, server_config

    sock = listen("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    options = {"log_level": log_level, "log_config": None, "access_log": False, "lifespan": "on"}
    config = (server_config(app, settings, host="127.0.0.1", port=port, **options) if settings is not None
              else uvicorn.Config(app, host="127.0.0.1", port=port, **options))  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    stop = asyncio.Event()
    task = asyncio.create_task(serve_until(server, stop, sock))
    try:
        while not server.started:
            if task.done():
                task.result()  # raises what stopped the server
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await task
        sock.close()


@contextlib.asynccontextmanager
async def served_coordinator(settings: Settings, tokens: dict[str, tuple[str, str]]) -> AsyncIterator[str]:
    """Serve an :class:`EmbeddedCoordinator` on ``settings.database_url`` under uvicorn on 127.0.0.1 and a
    free port, in this event loop, configured as ``consumer-kit coordinator serve`` is; yields the base URL.
    ``tokens`` maps bearer -> (tenant, application)."""
    from consumer_kit.coordinator.server import create_app

    engine = create_engine(settings.database_url, pool_size=settings.db_pool_size,
                           pooler=settings.database_pooler)
    coordinator = EmbeddedCoordinator(engine, settings)
    try:
        await ensure_schema(engine)
        async with served_asgi(create_app(coordinator, tokens), settings=settings) as url:
            yield url
    finally:
        await coordinator.close()
        await engine.dispose()
