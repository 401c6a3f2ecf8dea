"""The long-running commands: ``run`` (an app, like uvicorn), ``coordinator serve`` and ``outbox relay``."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from consumer_kit.cli.parsing import DATABASE, EVERY_SETTING, app_dir_option, port
from consumer_kit.cli.running import load_app, run_async, settings_from_env, with_stop
from consumer_kit.errors import ConfigurationError
from consumer_kit.extras import missing_extra

if TYPE_CHECKING:
    from consumer_kit.app import ConsumerApp

log = logging.getLogger("consumer_kit.cli")


def require_work(app: ConsumerApp, target: str) -> None:
    """Refuse an app that would start and do nothing: no handler, and no outbox to relay."""
    if not app.specs and app.publisher is None:
        raise ConfigurationError(f"{target} has no handlers, so it has nothing to run: register one with "
                                 "@app.handler(source) (or give it an outbox to relay with app.relay_outbox)")


def run(args: argparse.Namespace) -> int:
    """``consumer-kit run module:app``: until SIGTERM/SIGINT, then drain; ``--port`` serves ``app.asgi()``."""
    from consumer_kit.http import http_paths
    from consumer_kit.signals import StopRequested, StopSignals, run_app

    signals = StopSignals()
    try:
        signals.install()  # before the app's module is imported: that can take a while too
        app = load_app(args.app, app_dir=args.app_dir)
        require_work(app, args.app)
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
    from consumer_kit.signals import StopRequested, StopSignals

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


async def outbox_relay(app_target: str | None, app_dir: str | None = None) -> int:
    """``consumer-kit outbox relay``: publish committed outbox rows (the app's publisher, else RABBITMQ_URL's)."""
    import asyncio
    import signal

    from consumer_kit.outbox import OutboxRelay, Publisher
    from consumer_kit.store import AppMigrations, Database, Outbox, create_engine, ensure_schema

    app = load_app(app_target, app_dir=app_dir) if app_target else None
    settings = app.settings if app is not None else settings_from_env()
    publisher: Publisher | None = app.publisher if app is not None else None
    if publisher is None:
        from consumer_kit.sources.rabbitmq import AmqpPublisher

        publisher = AmqpPublisher(settings.require_rabbitmq_url(), settings=settings)
    engine = create_engine(settings.database_url, pooler=settings.database_pooler)
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
        commands, "run", help="run an app: module:app or path/to/app.py:app",
        description="Run an app until SIGTERM/SIGINT, then drain. With --port it also serves /healthz, "
        "/readyz and /metrics (and its HTTP sources' paths); without --port it serves nothing over HTTP. An "
        "app with no handlers is refused.", environment=EVERY_SETTING)
    running.add_argument("app", help="module:app (say myapp.worker:app) or path/to/app.py:app: the ConsumerApp "
                         "to run")
    app_dir_option(running)
    running.add_argument("--host", default="127.0.0.1", help="the address --port listens on (0.0.0.0 in a container)")
    running.add_argument("--port", type=port, default=None,
                         help="serve /healthz, /readyz, /metrics and the HTTP sources on this port, 0 to 65535 (0: "
                         "any free one; unset: no HTTP server, and an app with HTTP sources needs it)")
    running.set_defaults(func=run)

    coordinator = command(commands, "coordinator", help="the coordinator server",
                          description="The coordinator: the service that creates sessions under idempotency keys.")
    coordinator_commands = coordinator.add_subparsers(dest="coordinator_command", required=True, metavar="COMMAND")
    serving = command(coordinator_commands, "serve", help="serve the coordinator under uvicorn",
                      description="Serve the embedded coordinator over HTTP (POST /v1/sessions, /v1/delegations, "
                      "GET /metrics, /healthz) on its database, until SIGTERM/SIGINT.",
                      environment=("database_url", "db_pool_size", "coordinator_tokens", "coordinator_body_limit_bytes",
                                   "*idempotency_*", "http_*", "shutdown_grace_seconds", "sweep_*"))
    serving.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serving.add_argument("--port", type=port, default=8080, help="the port to listen on, 0 to 65535 (0: any free one)")
    serving.set_defaults(func=coordinator_serve)

    outbox = command(commands, "outbox", help="the transactional outbox",
                     description="The transactional outbox: messages committed with a handler's effects.")
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True, metavar="COMMAND")
    relay = command(outbox_commands, "relay", help="publish committed outbox rows until SIGTERM",
                    description="Publish committed outbox rows, each under its stable message id, until "
                    "SIGTERM/SIGINT: with the publisher of --app's app, else to RABBITMQ_URL's broker.",
                    environment=(*DATABASE, "rabbitmq_url", "outbox_*", "sweep_*"))
    relay.add_argument("--app", default=None, help="module:app or path/to/app.py:app whose settings and publisher "
                       "to use (unset: RABBITMQ_URL's broker; with it, the app's Settings() reads every setting)")
    app_dir_option(relay)
    relay.set_defaults(func=lambda a: run_async(outbox_relay(a.app, a.app_dir)))
