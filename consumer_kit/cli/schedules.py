"""``consumer-kit schedule run|list``: fire one tick of a schedule by hand (for an external cron), and
show each schedule's last and next fire (JSON lines, or a table: ``--format``, as ``parked`` has it).

Both load an app (``module:app`` or ``path/to/app.py:app``, looked up in ``--app-dir`` first when it
is given), so their ``--help`` lists every setting. The app, the store and asyncio are imported only
when a command runs: ``--help`` and a usage error load none of them.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import TYPE_CHECKING, Any

from consumer_kit.cli.db import refuse_missing
from consumer_kit.cli.output import add_format, print_rows
from consumer_kit.cli.parsing import EVERY_SETTING, app_dir_option
from consumer_kit.cli.running import load_app
from consumer_kit.errors import ConfigurationError

if TYPE_CHECKING:
    from consumer_kit.app import ConsumerApp
    from consumer_kit.delivery import Result
    from consumer_kit.pipeline import HandlerSpec
    from consumer_kit.sources.schedules import Schedule


SCHEDULE_EXIT_CODES = {"processed": 0, "duplicate": 3, "failed": 4, "parked": 5, "in_progress": 6}
"""``consumer-kit schedule run``'s exit codes: processed (the handler ran and committed), duplicate (the
tick was done before: nothing ran), failed (it will be retried: run the command again), parked
(dead-lettered, or parked before), in_progress (another process still held it when the wait ran out).
2 is a usage or configuration error (an unknown schedule, an instant that is not a tick)."""


def _schedule(app: ConsumerApp, name: str) -> tuple[HandlerSpec, Schedule]:
    from consumer_kit.sources.schedules import Schedule

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
    from consumer_kit.delivery import Outcome, Settlement

    if result.outcome is Outcome.PROCESSED:
        return "processed"
    if result.outcome is Outcome.DUPLICATE:
        return "parked" if result.reason == "already_dead_lettered" else "duplicate"
    if result.outcome is Outcome.IN_PROGRESS:
        return "in_progress"
    return "parked" if result.settlement is Settlement.DEAD_LETTER else "failed"


async def schedule_run(args: argparse.Namespace) -> int:
    """``schedule run module:app NAME [--at ISO]``: its exit code says how the tick settled."""
    import asyncio

    from consumer_kit.sources.schedules.timing import key_id

    app = load_app(args.app, app_dir=args.app_dir)
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


LIST_COLUMNS = ("schedule", "version", "consumer", "timing", "catch_up", "overlap", "last_fired", "last_state",
                "last_reason", "next_fire", "pending", "skipped")
"""The columns of ``schedule list --format table``; its JSON lines hold these and ``recent_skips``."""


async def schedule_list(args: argparse.Namespace) -> int:
    """``schedule list module:app [--format json|table]``: a JSON line a schedule, or a table."""
    from consumer_kit.sources.schedules import Schedule
    from consumer_kit.sources.schedules.timing import key_id

    app = load_app(args.app, app_dir=args.app_dir)
    await refuse_missing(app.settings)

    def instant(value: datetime | None) -> str | None:
        return None if value is None else key_id(value)

    rows: list[dict[str, Any]] = []
    async with app.running(sources=()):
        for spec in app.specs:
            if not isinstance(spec.source, Schedule):
                continue
            status = await spec.source.status(recent=args.recent)
            last = status.last_fired
            rows.append({
                "schedule": status.name, "version": status.version, "consumer": spec.consumer,
                "timing": status.timing, "catch_up": spec.source.catch_up, "overlap": spec.source.overlap,
                "last_fired": instant(last.tick) if last else None, "last_state": last.state if last else None,
                "last_reason": last.reason if last else None, "next_fire": instant(status.next_fire),
                "pending": [instant(p.tick) for p in status.pending], "skipped": status.skipped,
                "recent_skips": [{"scheduled_for": instant(s.tick), "reason": s.reason} for s in status.recent_skips],
            })
    print_rows(rows, args.format, LIST_COLUMNS)
    return 0


def _run(main: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import asyncio

        return asyncio.run(main(args))

    return run


def _count(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is less than 0")
    return number


def _app_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("app", help="module:app (say myapp.worker:app) or path/to/app.py:app: the ConsumerApp "
                        "whose schedules these are")
    app_dir_option(parser)


def add_commands(commands: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``schedule`` and its sub-commands on ``commands`` (``command`` makes a sub-parser)."""
    schedule = command(
        commands, "schedule", help="fire a schedule's tick by hand (for an external cron) and show each "
        "schedule's state",  # the same words as its entry in main.LAZY, which --help shows without this module
        description="A schedule's ticks outside the workers: fire the one due now (or one given) through the "
        "inbox, for an external cron, and show each schedule's last and next fire and its pending and skipped "
        "ticks.")
    schedule_commands = schedule.add_subparsers(dest="schedule_command", required=True, metavar="COMMAND")
    fire = command(
        schedule_commands, "run", help="fire one tick through the inbox (for Kubernetes CronJobs, systemd timers)",
        description="Fire the tick due now (the newest at or before the database's clock), or the one at "
        "--at, through the same inbox as the app's workers: two overlapping invocations run it once. Exit "
        "code: 0 processed, 3 duplicate, 4 failed (run again), 5 parked, 6 still in progress elsewhere.",
        environment=EVERY_SETTING)
    _app_arguments(fire)
    fire.add_argument("name", help="the schedule's name")
    fire.add_argument("--at", metavar="INSTANT", help="the tick's instant, ISO 8601 with a zone "
                      "(2026-03-08T07:00:00Z; unset: the tick due now)")
    fire.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                      help="how long to wait for a tick another process is running (unset: two leases)")
    fire.set_defaults(func=_run(schedule_run))
    shown = command(
        schedule_commands, "list", help="each schedule's last and next fire and skipped ticks",
        description="Each of the app's schedules, one JSON line (or table row) each: its timing, catch-up "
        "and overlap policies, its last fire and how it settled, its next fire, its pending ticks, and its "
        "skipped ticks counted by reason, the most recent listed. It never creates a database.",
        environment=EVERY_SETTING)
    _app_arguments(shown)
    shown.add_argument("--recent", type=_count, default=10, metavar="N",
                       help="how many pending ticks, and how many of the latest skipped ones, to list")
    add_format(shown)
    shown.set_defaults(func=_run(schedule_list))
