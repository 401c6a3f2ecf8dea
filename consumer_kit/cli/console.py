"""``consumer-kit console``: the operator's console on its own, against the database (and, given
``module:app``, with the app's handlers and sources, so that it can replay).

::

    consumer-kit console [module:app] [--app-dir DIR] [--host H] [--port P]

It serves the console under ``CONSOLE_PATH`` (``/console`` when unset; ``/`` redirects there) until
SIGTERM/SIGINT. Without an app it reads and discards, but does not replay: a replay needs the app's
sources. Sign-in comes from ``CONSOLE_TOKENS`` or ``CONSOLE_AUTH``, as in a worker. The console, the
store and uvicorn are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from consumer_kit.cli.parsing import EVERY_SETTING, app_dir_option, port
from consumer_kit.cli.running import load_app, run_async, settings_from_env, with_stop
from consumer_kit.errors import ConfigurationError
from consumer_kit.extras import missing_extra

if TYPE_CHECKING:
    import asyncio

    from consumer_kit.app import ConsumerApp
    from consumer_kit.console import Console
    from consumer_kit.settings import Settings

DEFAULT_PATH = "/console"


def command(args: argparse.Namespace) -> int:
    """Serve the console until SIGTERM/SIGINT."""
    from consumer_kit.signals import StopRequested, StopSignals

    signals = StopSignals()
    try:
        signals.install()
        try:
            import consumer_kit.console  # noqa: F401
            from consumer_kit.http.server import server_config  # noqa: F401 (uvicorn, httptools)
        except ModuleNotFoundError as exc:
            raise ConfigurationError(str(missing_extra("console", "the console", exc))) from exc
        except ImportError as exc:  # the console's own hint
            raise ConfigurationError(str(exc)) from exc
        app = load_app(args.app, app_dir=args.app_dir) if args.app else None
        settings = app.settings if app is not None else settings_from_env()
        signals.defer()
    except StopRequested:
        return 0
    try:
        run_async(with_stop(signals, lambda stop: serve(settings, app, host=args.host, port=args.port,
                                                        log_level=args.log_level, stop=stop)))
    finally:
        signals.install()
    return 0


@contextlib.asynccontextmanager
async def opened(settings: Settings, app: ConsumerApp | None) -> AsyncIterator[Console]:
    """The console of ``app`` (started with no source running) or of ``settings``' database alone."""
    from consumer_kit.console import Console
    from consumer_kit.store import Database, check_schema, create_engine

    if app is not None:
        async with app.running(sources=()):
            console = Console(settings, app=app)
            try:
                yield console
            finally:
                await console.close()
        return
    engine = create_engine(settings.database_url, pool_size=min(settings.db_pool_size, 4),
                           pooler=settings.database_pooler)
    database: Database | None = None
    try:
        await check_schema(engine)  # a missing schema is refused, never created by a command that reads
        database = Database(engine)
        yield Console(settings, database=database)
    finally:
        if database is not None:
            await database.close()
        await engine.dispose()


async def serve(settings: Settings, app: ConsumerApp | None, *, host: str, port: int, log_level: str,
                stop: asyncio.Event) -> None:
    """Serve the console under uvicorn on ``host:port`` until ``stop``."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import RedirectResponse
    from starlette.routing import Mount, Route

    from consumer_kit.http.server import listen, serve_until, server_config

    path = settings.console_path or DEFAULT_PATH
    sock = listen(host, port)
    try:
        async with opened(settings, app) as console:

            async def home(_request: Any) -> RedirectResponse:
                return RedirectResponse(f"{path}/", status_code=307)

            served = Starlette(routes=[Route("/", home), Mount(path, app=console.asgi())])
            config = server_config(served, settings, host=host, port=port, lifespan="off", log_level=log_level.lower())
            await serve_until(uvicorn.Server(config), stop, sock)
    finally:
        sock.close()


def add_commands(commands: Any, make: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``console`` on ``commands`` (``make`` makes a sub-parser)."""
    parser = make(
        commands, "console", help="serve the operator's console (parked deliveries, inbox, outbox) in a web page",
        description="Serve the operator's console on its own, under CONSOLE_PATH (/console when unset), until "
        "SIGTERM/SIGINT: parked deliveries by reason and source, each one's details, the outbox, live leases. "
        "With module:app it also shows the schedules and can replay, by the rules of `parked replay`; without, "
        "it reads and discards only. Sign-in: CONSOLE_TOKENS or CONSOLE_AUTH (no default credentials).",
        environment=EVERY_SETTING)
    parser.add_argument("app", nargs="?", default=None,
                        help="module:app or path/to/app.py:app, the app whose parked deliveries these are (needed "
                        "to replay them)")
    app_dir_option(parser)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=port, default=8000, help="the port to listen on, 0 to 65535 (0: any free one)")
    parser.set_defaults(func=command)
