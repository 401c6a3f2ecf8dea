"""The coordinator server on a real loopback socket, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

from consumer_kit.coordinator.embedded import EmbeddedCoordinator
from consumer_kit.settings import Settings
from consumer_kit.store import create_engine, ensure_schema
from consumer_kit.store.pglane import PgLane


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.asynccontextmanager
async def served_coordinator(settings: Settings, tokens: dict[str, tuple[str, str]]) -> AsyncIterator[str]:
    """Serve an :class:`EmbeddedCoordinator` on ``settings.database_url`` under uvicorn on 127.0.0.1 and a
    free port, in this event loop, configured as ``consumer-kit coordinator serve`` is; yields the base URL.
    ``tokens`` maps bearer -> (tenant, application)."""
    import uvicorn

    from consumer_kit.coordinator.server import create_app
    from consumer_kit.httpserver import server_config

    engine = create_engine(settings.database_url, pool_size=settings.db_pool_size)
    lane: PgLane | None = None
    try:
        await ensure_schema(engine)
        lane = await PgLane.for_engine(engine, size=settings.db_pool_size)
        app = create_app(EmbeddedCoordinator(engine, settings, lane=lane), tokens)
        port = free_port()
        server = uvicorn.Server(server_config(app, settings, host="127.0.0.1", port=port, log_level="warning",
                                              access_log=False, lifespan="on"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()  # raises what stopped the server
            await asyncio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await task
    finally:
        if lane is not None:
            await lane.close()
        await engine.dispose()
