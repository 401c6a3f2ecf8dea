"""The ``consumer-kit`` command.

::

    consumer-kit run module:app     run an app until SIGTERM/SIGINT, then drain (like uvicorn)
                                    (--port N: app.asgi() under uvicorn on --host: /healthz, /readyz,
                                    /metrics and the HTTP sources' paths; an app with HTTP sources
                                    needs --port)
    consumer-kit db upgrade         apply consumer-kit's migrations to DATABASE_URL, then the app's (APP_MIGRATIONS)
    consumer-kit db check           exit 1 when DATABASE_URL's schema (or the app's) is out of date
    consumer-kit db revision -m M   a new, empty revision file in APP_MIGRATIONS
    consumer-kit parked list|groups|show|replay|discard
                                    parked deliveries (dead letters): inspect, replay, discard
                                    (``dead-letters`` is the same command under its old name)
    consumer-kit demo               the retry-safety recipe end to end on embedded defaults
    consumer-kit coordinator serve  serve the coordinator over HTTP (COORDINATOR_TOKENS, DATABASE_URL)
    consumer-kit outbox relay       publish committed outbox rows (RABBITMQ_URL, or --app's publisher)
    consumer-kit schedule run module:app NAME [--at ISO]
                                    fire a schedule's tick due now (or the one at ISO) once, for an
                                    external cron; the exit code says what happened (SCHEDULE_EXIT_CODES)
    consumer-kit schedule list module:app
                                    each schedule's last and next fire and skipped ticks (JSON lines)

Configuration comes from :class:`~consumer_kit.settings.Settings` (the environment) only.

Errors a person can act on (a database or broker that cannot be reached, a missing schema, a bad
``module:app``, a bad option) end the command with one line on stderr and exit code 2: no traceback,
no password from a URL, and no file created by a command that only reads.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import importlib
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from pydantic import ValidationError

from consumer_kit import cli_parked, logs
from consumer_kit.app import ConsumerApp
from consumer_kit.delivery import Outcome, Result, Settlement
from consumer_kit.errors import ConfigurationError
from consumer_kit.extras import missing_extra
from consumer_kit.http import http_paths
from consumer_kit.settings import Settings, explain
from consumer_kit.signals import StopRequested, StopSignals, run_app
from consumer_kit.store import (
    AppMigrations,
    Database,
    app_revisions,
    check_schema,
    create_engine,
    ensure_schema,
    schema_revisions,
    upgrade,
)
from consumer_kit.store.database import sqlite_path
from consumer_kit.store.diagnosis import safe_url

if TYPE_CHECKING:
    from consumer_kit.pipeline import HandlerSpec
    from sources.schedules import Schedule

Command = Callable[[argparse.Namespace], int]
T = TypeVar("T")
log = logging.getLogger("consumer_kit.cli")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def load_app(target: str) -> ConsumerApp:
    """Import ``module:attribute`` (the current directory is importable) and return the app; a target
    that cannot be loaded is a ConfigurationError that says why in one line."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"expected module:app (say myapp:app), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigurationError(f"cannot import {module_name!r} (from {target}): no such module here "
                                     f"(run from the directory that holds it, or install it)") from None
        raise ConfigurationError(f"importing {module_name!r} failed: {_where_raised(exc)}") from None
    except (ConfigurationError, StopRequested):
        raise
    except ValidationError as exc:  # its Settings(), read from the environment
        raise ConfigurationError(f"importing {module_name!r} failed: invalid setting: {explain(exc)}") from None
    except Exception as exc:  # the app's own module raised while it was imported: say where
        raise ConfigurationError(f"importing {module_name!r} failed: {_where_raised(exc)}") from None
    if not hasattr(module, attribute):
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r} (from {target})")
    app = getattr(module, attribute)
    if not isinstance(app, ConsumerApp):
        raise ConfigurationError(f"{target} is a {type(app).__name__}, not a consumer_kit.ConsumerApp")
    return app


def _where_raised(exc: BaseException) -> str:
    """``Type: message (file, line N)`` of the innermost frame in the app's own code."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if "importlib" not in frame.filename and not frame.filename.startswith("<frozen")]
    place = f" ({os.path.relpath(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""
    if isinstance(exc, SyntaxError) and exc.filename:
        place = f" ({os.path.relpath(exc.filename)}, line {exc.lineno})"
    message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    return f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}{place}"


def _settings() -> Settings:
    return Settings.from_env()


def _run(args: argparse.Namespace) -> int:
    signals = StopSignals()
    try:
        signals.install()  # before the app's module is imported: that can take a while too
        app = load_app(args.app)
        paths = http_paths(spec.source for spec in app.specs)
        if paths and args.port is None:
            raise ConfigurationError(f"{args.app} has HTTP sources ({', '.join(paths)}): give --port to serve them")
        if args.port is not None:
            try:
                from consumer_kit.asgi import serve
                from consumer_kit.httpserver import server_config  # noqa: F401 (uvicorn, httptools)
            except ModuleNotFoundError as exc:
                raise ConfigurationError(str(missing_extra(
                    "http", "--port (health, readiness and metrics over HTTP)", exc))) from exc
        signals.defer()
    except StopRequested:
        log.info("stop signal before start-up: not started")
        return 0
    try:
        if args.port is not None:
            run_async(_with_stop(signals, lambda stop: serve(
                app, host=args.host, port=args.port, log_level=args.log_level, stop=stop)))
        else:
            run_async(_with_stop(signals, lambda stop: run_app(app, stop)))
    finally:
        signals.install()  # the loop's handlers went with it; a late signal must not kill the exit
    return 0


async def _with_stop(signals: StopSignals, main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """``main(stop)``, with ``stop`` set by SIGTERM/SIGINT from inside the loop (or already, if one came
    while the loop was being made)."""
    return await main(signals.event())


async def _db(action: str) -> int:
    settings = _settings()
    app = AppMigrations.from_settings(settings)
    engine = create_engine(settings.database_url)
    try:
        if action == "upgrade":
            await upgrade(engine, app=app)
        else:
            path = sqlite_path(engine)
            if path is not None and not path.exists():  # a check never creates the file it checks
                raise ConfigurationError(f"there is no database at {safe_url(engine.url)}: nothing has run with "
                                         "this DATABASE_URL here yet (`consumer-kit db upgrade` makes it)")
        current, head = await schema_revisions(engine)
        print(f"schema revision {current or 'none'} (head {head})")
        ok = current == head
        if app is not None:
            current, head = await app_revisions(engine, app)
            print(f"app schema revision {current or 'none'} (head {head or 'none'}, APP_MIGRATIONS)")
            ok = ok and current == head
        return 0 if ok else 1
    finally:
        await engine.dispose()


def _db_revision(args: argparse.Namespace) -> int:
    app = AppMigrations.from_settings(_settings())
    if app is None:
        raise ConfigurationError("APP_MIGRATIONS is not set: set it to the directory for your app's revisions "
                                 "(say myapp/migrations), then run this again")
    print(app.revision(args.message))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from consumer_kit.demo import run_demo

    if not args.verbose:  # the table is the output; the steps' expected warnings are noise here
        for name in ("consumer_kit", "alembic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    return asyncio.run(run_demo())


def _coordinator_serve(args: argparse.Namespace) -> int:
    signals = StopSignals()
    try:
        signals.install()
        try:
            from consumer_kit.coordinator.server import serve
        except ModuleNotFoundError as exc:
            raise ConfigurationError(str(missing_extra("coordinator", "the coordinator server", exc))) from exc
        settings = _settings()
        signals.defer()
    except StopRequested:
        log.info("stop signal before start-up: not started")
        return 0
    # uvicorn installs uvloop only when it owns the loop (uvicorn.run); serve() runs inside ours, so
    # choose it here: the stock loop cost the served coordinator about a third more CPU per request.
    try:
        run_async(_with_stop(signals, lambda stop: serve(settings, host=args.host, port=args.port, stop=stop)))
    finally:
        signals.install()
    return 0


async def _relay(app_target: str | None) -> int:
    from consumer_kit.relay import OutboxRelay, Publisher
    from consumer_kit.store import Outbox

    app = load_app(app_target) if app_target else None
    settings = app.settings if app is not None else _settings()
    publisher: Publisher | None = app.publisher if app is not None else None
    if publisher is None:
        from sources.rabbitmq import AmqpPublisher

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


SCHEDULE_EXIT_CODES = {"processed": 0, "duplicate": 3, "failed": 4, "parked": 5, "in_progress": 6}
"""``consumer-kit schedule run``'s exit codes: processed (the handler ran and committed), duplicate (the
tick was done before: nothing ran), failed (it will be retried: run the command again), parked
(dead-lettered, or parked before), in_progress (another process still held it when the wait ran out).
2 is a usage or configuration error (an unknown schedule, an instant that is not a tick)."""


def _schedule(app: ConsumerApp, name: str) -> tuple[HandlerSpec, Schedule]:
    from sources.schedules import Schedule

    for spec in app.specs:
        if isinstance(spec.source, Schedule) and spec.source.name == name:
            return spec, spec.source
    names = sorted(spec.source.name for spec in app.specs if isinstance(spec.source, Schedule))
    raise ConfigurationError(f"the app has no schedule {name!r} (it has: {', '.join(names) or 'none'})")


def _instant(value: str) -> datetime:
    try:
        instant = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ConfigurationError(f"--at {value!r} is not an ISO 8601 instant") from None
    if instant.tzinfo is None:
        raise ConfigurationError(f"--at {value!r} has no time zone: give one (2026-03-08T07:00:00Z)")
    return instant


def _settled_as(result: Result) -> str:
    if result.outcome is Outcome.PROCESSED:
        return "processed"
    if result.outcome is Outcome.DUPLICATE:
        return "parked" if result.reason == "already_dead_lettered" else "duplicate"
    if result.outcome is Outcome.IN_PROGRESS:
        return "in_progress"
    return "parked" if result.settlement is Settlement.DEAD_LETTER else "failed"


async def _schedule_run(args: argparse.Namespace) -> int:
    from sources.schedules.timing import key_id

    app = load_app(args.app)
    spec, schedule = _schedule(app, args.name)
    at = _instant(args.at) if args.at else None
    # SIGTERM (a CronJob's deadline, a deleted pod) cancels the run: its transaction rolls back and the
    # lease is given back, so the next invocation runs the tick at once.
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        async with app.running(sources=()):
            fired = await schedule.fire(at, dispatch=functools.partial(app.pipeline.process, spec),
                                        wait_seconds=args.wait)
    except asyncio.CancelledError:
        print(json.dumps({"schedule": args.name, "status": "failed", "reason": "interrupted"}))
        return SCHEDULE_EXIT_CODES["failed"]
    status = _settled_as(fired.result)
    print(json.dumps({"schedule": args.name, "scheduled_for": key_id(fired.tick), "status": status,
                      "outcome": fired.result.outcome.value, "reason": fired.result.reason,
                      "key_digest": fired.result.key_digest}))
    return SCHEDULE_EXIT_CODES[status]


async def _schedule_list(args: argparse.Namespace) -> int:
    from sources.schedules import Schedule
    from sources.schedules.timing import key_id

    app = load_app(args.app)
    await _existing(app.settings)

    def instant(value: datetime | None) -> str | None:
        return None if value is None else key_id(value)

    async with app.running(sources=()):
        for spec in app.specs:
            if not isinstance(spec.source, Schedule):
                continue
            status = await spec.source.status(recent=args.recent)
            last = status.last_fired
            print(json.dumps({
                "schedule": status.name, "version": status.version, "consumer": spec.consumer,
                "timing": status.timing, "catch_up": spec.source.catch_up, "overlap": spec.source.overlap,
                "last_fired": instant(last.tick) if last else None, "last_state": last.state if last else None,
                "last_reason": last.reason if last else None, "next_fire": instant(status.next_fire),
                "pending": [instant(p.tick) for p in status.pending], "skipped": status.skipped,
                "recent_skips": [{"scheduled_for": instant(s.tick), "reason": s.reason} for s in status.recent_skips],
            }))
    return 0


async def _existing(settings: Settings) -> None:
    """Refuse, rather than create, a database that is not there (for commands that only read)."""
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        await check_schema(engine)
    finally:
        await engine.dispose()


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a long-lived service coroutine (a worker, the relay, the coordinator) on the fastest event
    loop installed: the worker's own CPU is mostly spent in the loop and the drivers under it."""
    # What is alive now (modules, the app and its settings) lives as long as the process: move it out
    # of the collector's generations, so that the full collections a busy worker triggers scan only
    # what was made since (measured: a full pass over the startup heap took ~0.1 s on a 2-core host).
    gc.freeze()
    with asyncio.Runner(loop_factory=_fast_loop_factory()) as runner:
        return runner.run(main)


def _fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (a dependency except on Windows), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr (exit 2), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help shows its default."""


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid level {value!r}: choose {', '.join(LOG_LEVELS)}")
    return level


def _log_format(value: str) -> str:
    log_format = value.strip().lower()
    if log_format not in logs.LOG_FORMATS:
        raise argparse.ArgumentTypeError(f"invalid log format {value!r}: choose {', '.join(logs.LOG_FORMATS)}")
    return log_format


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (sub-commands register their own options)."""
    parser = _Parser(prog="consumer-kit", description=__doc__.split("\n\n")[0], formatter_class=_Help)
    # --log-level and --log-format work after a sub-command too, where they override the ones before
    # (SUPPRESS: unset leaves the top-level value alone; unset everywhere, LOG_LEVEL / LOG_FORMAT decide).
    for options in (parser, common := argparse.ArgumentParser(add_help=False)):
        options.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS,
                             help=f"how much to log: {', '.join(LOG_LEVELS)} (DEBUG: consumer-kit's own logs "
                             "only; default: LOG_LEVEL, else INFO)")
        options.add_argument("--log-format", type=_log_format, default=argparse.SUPPRESS,
                             help="text, or json: one JSON object a line (default: LOG_FORMAT, else text)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(group: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = group.add_parser(name, parents=[common], formatter_class=_Help, **kwargs)
        return sub

    run = command(
        commands, "run", help="run an app: module:app",
        description="Run an app until SIGTERM/SIGINT, then drain. With --port it also serves /healthz, "
        "/readyz and /metrics (and its HTTP sources' paths); without --port it serves nothing over HTTP.")
    run.add_argument("app", help="module:app (the current directory is importable)")
    run.add_argument("--host", default="127.0.0.1", help="the address --port listens on (0.0.0.0 in a container)")
    run.add_argument("--port", type=int, default=None,
                     help="serve /healthz, /readyz, /metrics and the HTTP sources here (unset: no HTTP server; an "
                     "app with HTTP sources needs it)")
    run.set_defaults(func=_run)

    db = command(commands, "db", help="schema management")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    upgrade_command = command(db_commands, "upgrade", help="apply consumer-kit's migrations, then the app's "
                              "(APP_MIGRATIONS)")
    upgrade_command.set_defaults(func=lambda _a: asyncio.run(_db("upgrade")))
    command(db_commands, "check", help="exit 1 when the schema (or the app's) is out of date").set_defaults(
        func=lambda _a: asyncio.run(_db("check")))
    revision = command(db_commands, "revision", help="write a new, empty revision file in APP_MIGRATIONS")
    revision.add_argument("-m", "--message", required=True, help="what the revision does (its file is named after it)")
    revision.set_defaults(func=_db_revision)

    cli_parked.add_commands(commands, common, _Help, asyncio.run, load_app)

    demo = command(commands, "demo", help="the retry-safety recipe on embedded defaults")
    demo.add_argument("--verbose", action="store_true", help="also show the log of every step")
    demo.set_defaults(func=_demo)

    coordinator = command(commands, "coordinator", help="the coordinator server")
    coordinator_commands = coordinator.add_subparsers(dest="coordinator_command", required=True, metavar="COMMAND")
    serve = command(coordinator_commands, "serve", help="serve the coordinator under uvicorn")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=int, default=8080, help="the port to listen on")
    serve.set_defaults(func=_coordinator_serve)

    outbox = command(commands, "outbox", help="the transactional outbox")
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True, metavar="COMMAND")
    relay = command(outbox_commands, "relay", help="publish committed outbox rows until SIGTERM")
    relay.add_argument("--app", default=None, help="module:app whose settings and publisher to use "
                       "(default: RABBITMQ_URL's broker)")
    relay.set_defaults(func=lambda a: run_async(_relay(a.app)))

    schedule = command(commands, "schedule", help="scheduled jobs (sources.schedules)")
    schedule_commands = schedule.add_subparsers(dest="schedule_command", required=True, metavar="COMMAND")
    fire = command(
        schedule_commands, "run", help="fire one tick through the inbox (for Kubernetes CronJobs, systemd timers)",
        description="Fire the tick due now (the newest at or before the database's clock), or the one at "
        "--at, through the same inbox as the app's workers: two overlapping invocations run it once. Exit "
        "code: 0 processed, 3 duplicate, 4 failed (run again), 5 parked, 6 still in progress elsewhere.")
    fire.add_argument("app", help="module:app")
    fire.add_argument("name", help="the schedule's name")
    fire.add_argument("--at", help="the tick's instant, ISO 8601 with a zone (2026-03-08T07:00:00Z; default: the "
                      "tick due now)")
    fire.add_argument("--wait", type=float, default=None,
                      help="seconds to wait for a tick another process is running (default: two leases)")
    fire.set_defaults(func=lambda a: asyncio.run(_schedule_run(a)))
    shown = command(schedule_commands, "list", help="each schedule's last and next fire and skipped ticks")
    shown.add_argument("app", help="module:app")
    shown.add_argument("--recent", type=int, default=10, help="how many skipped and pending ticks to show")
    shown.set_defaults(func=lambda a: asyncio.run(_schedule_list(a)))
    return parser


def _from_env(parser: argparse.ArgumentParser, variable: str, default: str, check: Callable[[str], str]) -> str:
    try:
        return check(os.environ.get(variable, default))
    except argparse.ArgumentTypeError as exc:
        parser.error(f"{variable}: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``consumer-kit`` script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", None) or _from_env(parser, "LOG_LEVEL", "INFO", _log_level)
    log_format = getattr(args, "log_format", None) or _from_env(parser, "LOG_FORMAT", "text", _log_format)
    args.log_level, args.log_format = level, log_format  # for the commands that pass them on (uvicorn)
    logs.configure(level, log_format)
    if level == "DEBUG":  # consumer-kit's own: libraries' debug logs (aio-pika dumps message ids) stay at INFO
        logging.getLogger().setLevel(logging.INFO)
        logging.getLogger("consumer_kit").setLevel(logging.DEBUG)
    func: Command = args.func
    try:
        return func(args)
    except ConfigurationError as exc:
        print(f"consumer-kit: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # a missing optional extra: its hint is the whole message
        print(f"consumer-kit: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
