"""The long-running commands: ``run`` (an app, like uvicorn), ``coordinator serve`` and ``outbox relay``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from consumer_kit.cli.running import load_app, run_async, settings_from_env, with_stop
from consumer_kit.errors import ConfigurationError
from consumer_kit.extras import missing_extra
from consumer_kit.http import http_paths
from consumer_kit.signals import StopRequested, StopSignals, run_app
from consumer_kit.store import AppMigrations, Database, create_engine, ensure_schema

log = logging.getLogger("consumer_kit.cli")


def run(args: argparse.Namespace) -> int:
    """``consumer-kit run module:app``: until SIGTERM/SIGINT, then drain; ``--port`` serves ``app.asgi()``."""
    signals = StopSignals()
    try:
        signals.install()  # before the app's module is imported: that can take a while too
        app = load_app(args.app)
        paths = http_paths(spec.source for spec in app.specs)
        if paths and args.port is None:
            raise ConfigurationError(f"{args.app} has HTTP sources ({', '.join(paths)}): give --port to serve them")
        if args.port is not None:
            try:
                from consumer_kit.http.asgi import serve
                from consumer_kit.http.server import server_config  # noqa: F401 (uvicorn, httptools)
            except ModuleNotFoundError as exc:
                raise ConfigurationError(str(missing_extra(
                    "http", "--port (health, readiness and metrics over HTTP)", exc))) from exc
        signals.defer()
    except StopRequested:
        log.info("stop signal before start-up: not started")
        return 0
    try:
        if args.port is not None:
            run_async(with_stop(signals, lambda stop: serve(
                app, host=args.host, port=args.port, log_level=args.log_level, stop=stop)))
        else:
            run_async(with_stop(signals, lambda stop: run_app(app, stop)))
    finally:
        signals.install()  # the loop's handlers went with it; a late signal must not kill the exit
    return 0


def coordinator_serve(args: argparse.Namespace) -> int:
    """``consumer-kit coordinator serve``: the embedded coordinator over HTTP, until SIGTERM/SIGINT."""
    signals = StopSignals()
    try:
        signals.install()
        try:
            from consumer_kit.coordinator.server import serve
        except ModuleNotFoundError as exc:
            raise ConfigurationError(str(missing_extra("coordinator", "the coordinator server", exc))) from exc
        settings = settings_from_env()
        signals.defer()
    except StopRequested:
        log.info("stop signal before start-up: not started")
        return 0
    # uvicorn installs uvloop only when it owns the loop (uvicorn.run); serve() runs inside ours, so
    # choose it here: the stock loop cost the served coordinator about a third more CPU per request.
    try:
        run_async(with_stop(signals, lambda stop: serve(settings, host=args.host, port=args.port, stop=stop)))
    finally:
        signals.install()
    return 0


async def outbox_relay(app_target: str | None) -> int:
    """``consumer-kit outbox relay``: publish committed outbox rows (the app's publisher, else RABBITMQ_URL's)."""
    from consumer_kit.outbox import OutboxRelay, Publisher
    from consumer_kit.store import Outbox

    app = load_app(app_target) if app_target else None
    settings = app.settings if app is not None else settings_from_env()
    publisher: Publisher | None = app.publisher if app is not None else None
    if publisher is None:
        from consumer_kit.sources.rabbitmq import AmqpPublisher

        publisher = AmqpPublisher(settings.require_rabbitmq_url(), settings=settings)
    engine = create_engine(settings.database_url)
    database = Database(engine)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await ensure_schema(engine, app=AppMigrations.from_settings(settings))
        await OutboxRelay(Outbox(database), publisher, settings,
                          tracer_provider=app.tracer_provider if app is not None else None).run(stop)
    finally:
        await publisher.close()
        await database.close()
        await engine.dispose()
    return 0


def add_commands(commands: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``run``, ``coordinator serve`` and ``outbox relay`` on ``commands`` (``command`` makes
    a sub-parser)."""
    running = command(
        commands, "run", help="run an app: module:app",
        description="Run an app until SIGTERM/SIGINT, then drain. With --port it also serves /healthz, "
        "/readyz and /metrics (and its HTTP sources' paths); without --port it serves nothing over HTTP.")
    running.add_argument("app", help="module:app (the current directory is importable)")
    running.add_argument("--host", default="127.0.0.1", help="the address --port listens on (0.0.0.0 in a container)")
    running.add_argument("--port", type=int, default=None,
                     help="serve /healthz, /readyz, /metrics and the HTTP sources here (unset: no HTTP server; an "
                     "app with HTTP sources needs it)")
    running.set_defaults(func=run)

    coordinator = command(commands, "coordinator", help="the coordinator server")
    coordinator_commands = coordinator.add_subparsers(dest="coordinator_command", required=True, metavar="COMMAND")
    serving = command(coordinator_commands, "serve", help="serve the coordinator under uvicorn")
    serving.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serving.add_argument("--port", type=int, default=8080, help="the port to listen on")
    serving.set_defaults(func=coordinator_serve)

    outbox = command(commands, "outbox", help="the transactional outbox")
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True, metavar="COMMAND")
    relay = command(outbox_commands, "relay", help="publish committed outbox rows until SIGTERM")
    relay.add_argument("--app", default=None, help="module:app whose settings and publisher to use "
                       "(default: RABBITMQ_URL's broker)")
    relay.set_defaults(func=lambda a: run_async(outbox_relay(a.app)))
