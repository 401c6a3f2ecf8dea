"""The ``consumer-kit`` command.

::

    consumer-kit run module:app     run an app until SIGTERM/SIGINT, then drain (like uvicorn)
                                    (--port N: app.asgi() under uvicorn on --host: /healthz, /readyz,
                                    /metrics and the HTTP sources' paths; an app with HTTP sources
                                    needs --port)
    consumer-kit db upgrade         apply the migrations to DATABASE_URL
    consumer-kit db check           exit 1 when DATABASE_URL's schema is out of date
    consumer-kit dead-letters list  parked deliveries with their reasons (JSON lines)
    consumer-kit demo               the retry-safety recipe end to end on embedded defaults
    consumer-kit coordinator serve  serve the coordinator over HTTP (COORDINATOR_TOKENS, DATABASE_URL)
    consumer-kit outbox relay       publish committed outbox rows (RABBITMQ_URL, or --app's publisher)
    consumer-kit schedule run module:app NAME [--at ISO]
                                    fire a schedule's tick due now (or the one at ISO) once, for an
                                    external cron; the exit code says what happened (SCHEDULE_EXIT_CODES)
    consumer-kit schedule list module:app
                                    each schedule's last and next fire and skipped ticks (JSON lines)

Configuration comes from :class:`~consumer_kit.settings.Settings` (the environment) only.
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
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from consumer_kit import logs
from consumer_kit.app import ConsumerApp
from consumer_kit.delivery import Outcome, Result, Settlement
from consumer_kit.errors import ConfigurationError
from consumer_kit.extras import missing_extra
from consumer_kit.http import http_paths
from consumer_kit.settings import Settings
from consumer_kit.signals import StopRequested, StopSignals, run_app
from consumer_kit.store import Database, DeadLetters, create_engine, ensure_schema, schema_revisions, upgrade

if TYPE_CHECKING:
    from consumer_kit.pipeline import HandlerSpec
    from sources.schedules import Schedule

Command = Callable[[argparse.Namespace], int]
T = TypeVar("T")
log = logging.getLogger("consumer_kit.cli")


def load_app(target: str) -> ConsumerApp:
    """Import ``module:attribute`` (the current directory is importable) and return the app."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise SystemExit(f"expected module:app, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    app = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(app, ConsumerApp):
        raise SystemExit(f"{target} is not a consumer_kit.ConsumerApp")
    return app


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
    settings = Settings()
    engine = create_engine(settings.database_url)
    try:
        if action == "upgrade":
            await upgrade(engine)
        current, head = await schema_revisions(engine)
        print(f"schema revision {current or 'none'} (head {head})")
        return 0 if current == head else 1
    finally:
        await engine.dispose()


async def _dead_letters(args: argparse.Namespace) -> int:
    settings = Settings()
    engine = create_engine(settings.database_url)
    try:
        letters = await DeadLetters(Database(engine)).list(consumer=args.consumer, reason=args.reason, limit=args.limit)
    finally:
        await engine.dispose()
    for letter in letters:
        # The key appears only as the first digits of its keyed digest, as everywhere else.
        print(json.dumps({
            "id": letter.id, "created_at": letter.created_at.isoformat(), "consumer": letter.consumer,
            "source": letter.source, "namespace": letter.namespace, "version": letter.version,
            "key_digest": letter.key_digest[:16] if letter.key_digest else None, "reason": letter.reason,
            "detail": letter.detail, "attempts": letter.attempts, "body_bytes": len(letter.body),
            "body": letter.body.decode("utf-8", "replace") if args.bodies else None,
        }))
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
        settings = Settings()
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
    settings = app.settings if app is not None else Settings()
    publisher: Publisher | None = app.publisher if app is not None else None
    if publisher is None:
        from sources.rabbitmq import AmqpPublisher

        publisher = AmqpPublisher(settings.require_rabbitmq_url(), settings=settings)
    engine = create_engine(settings.database_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await ensure_schema(engine)
        await OutboxRelay(Outbox(Database(engine)), publisher, settings,
                          tracer_provider=app.tracer_provider if app is not None else None).run(stop)
    finally:
        await publisher.close()
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (sub-commands register their own options)."""
    parser = argparse.ArgumentParser(prog="consumer-kit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    parser.add_argument("--log-format", default=os.environ.get("LOG_FORMAT", "text").lower(),
                        help="text, or json: one JSON object a line (default: LOG_FORMAT, else text)")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run", help="run an app: module:app",
        description="Run an app until SIGTERM/SIGINT, then drain. With --port it also serves /healthz, "
        "/readyz and /metrics (and its HTTP sources' paths); without --port it serves nothing over HTTP.")
    run.add_argument("app", help="module:app (the current directory is importable)")
    run.add_argument("--host", default="127.0.0.1",
                     help="the address --port listens on (default: %(default)s; 0.0.0.0 in a container)")
    run.add_argument("--port", type=int, default=None,
                     help="serve /healthz, /readyz, /metrics and the HTTP sources here (default: no HTTP "
                     "server; an app with HTTP sources needs it)")
    run.set_defaults(func=_run)

    db = commands.add_parser("db", help="schema management")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    db_commands.add_parser("upgrade", help="apply the migrations").set_defaults(
        func=lambda _a: asyncio.run(_db("upgrade")))
    db_commands.add_parser("check", help="exit 1 when the schema is out of date").set_defaults(
        func=lambda _a: asyncio.run(_db("check")))

    dead = commands.add_parser("dead-letters", help="inspect parked deliveries")
    dead_commands = dead.add_subparsers(dest="dead_command", required=True)
    listing = dead_commands.add_parser("list", help="the newest parked deliveries, one JSON object a line")
    listing.add_argument("--consumer")
    listing.add_argument("--reason")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--bodies", action="store_true", help="include the raw bodies (as UTF-8 text)")
    listing.set_defaults(func=lambda a: asyncio.run(_dead_letters(a)))

    demo = commands.add_parser("demo", help="the retry-safety recipe on embedded defaults")
    demo.add_argument("--verbose", action="store_true", help="also show the log of every step")
    demo.set_defaults(func=_demo)

    coordinator = commands.add_parser("coordinator", help="the coordinator server")
    coordinator_commands = coordinator.add_subparsers(dest="coordinator_command", required=True)
    serve = coordinator_commands.add_parser("serve", help="serve the coordinator under uvicorn")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.set_defaults(func=_coordinator_serve)

    outbox = commands.add_parser("outbox", help="the transactional outbox")
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True)
    relay = outbox_commands.add_parser("relay", help="publish committed outbox rows until SIGTERM")
    relay.add_argument("--app", default=None, help="module:app whose settings and publisher to use")
    relay.set_defaults(func=lambda a: run_async(_relay(a.app)))

    schedule = commands.add_parser("schedule", help="scheduled jobs (sources.schedules)")
    schedule_commands = schedule.add_subparsers(dest="schedule_command", required=True)
    fire = schedule_commands.add_parser(
        "run", help="fire one tick through the inbox (for Kubernetes CronJobs, systemd timers)",
        description="Fire the tick due now (the newest at or before the database's clock), or the one at "
        "--at, through the same inbox as the app's workers: two overlapping invocations run it once. Exit "
        "code: 0 processed, 3 duplicate, 4 failed (run again), 5 parked, 6 still in progress elsewhere.")
    fire.add_argument("app", help="module:app")
    fire.add_argument("name", help="the schedule's name")
    fire.add_argument("--at", help="the tick's instant, ISO 8601 with a zone (2026-03-08T07:00:00Z)")
    fire.add_argument("--wait", type=float, default=None,
                      help="seconds to wait for a tick another process is running (default: two leases)")
    fire.set_defaults(func=lambda a: asyncio.run(_schedule_run(a)))
    shown = schedule_commands.add_parser("list", help="each schedule's last and next fire and skipped ticks")
    shown.add_argument("app", help="module:app")
    shown.add_argument("--recent", type=int, default=10, help="how many skipped and pending ticks to show")
    shown.set_defaults(func=lambda a: asyncio.run(_schedule_list(a)))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``consumer-kit`` script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        logs.configure(args.log_level, args.log_format)
    except ValueError as exc:
        parser.error(str(exc))
    func: Command = args.func
    try:
        return func(args)
    except ConfigurationError as exc:
        print(f"consumer-kit: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
