"""``consumer-kit schedule run|list``: fire one tick of a schedule by hand (for an external cron), and
show each schedule's last and next fire (JSON lines, or a table: ``--format``, as ``parked`` has it)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import signal
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from consumer_kit.app import ConsumerApp
from consumer_kit.cli.db import refuse_missing
from consumer_kit.cli.output import add_format, print_rows
from consumer_kit.cli.running import load_app
from consumer_kit.delivery import Outcome, Result, Settlement
from consumer_kit.errors import ConfigurationError

if TYPE_CHECKING:
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
    if result.outcome is Outcome.PROCESSED:
        return "processed"
    if result.outcome is Outcome.DUPLICATE:
        return "parked" if result.reason == "already_dead_lettered" else "duplicate"
    if result.outcome is Outcome.IN_PROGRESS:
        return "in_progress"
    return "parked" if result.settlement is Settlement.DEAD_LETTER else "failed"


async def schedule_run(args: argparse.Namespace) -> int:
    """``schedule run module:app NAME [--at ISO]``: its exit code says how the tick settled."""
    from consumer_kit.sources.schedules.timing import key_id

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


LIST_COLUMNS = ("schedule", "version", "consumer", "timing", "catch_up", "overlap", "last_fired", "last_state",
                "last_reason", "next_fire", "pending", "skipped")
"""The columns of ``schedule list --format table``; its JSON lines hold these and ``recent_skips``."""


async def schedule_list(args: argparse.Namespace) -> int:
    """``schedule list module:app [--format json|table]``: a JSON line a schedule, or a table."""
    from consumer_kit.sources.schedules import Schedule
    from consumer_kit.sources.schedules.timing import key_id

    app = load_app(args.app)
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


def add_commands(commands: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``schedule`` and its sub-commands on ``commands`` (``command`` makes a sub-parser)."""
    schedule = command(commands, "schedule", help="scheduled jobs (consumer_kit.sources.schedules)")
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
    fire.set_defaults(func=lambda a: asyncio.run(schedule_run(a)))
    shown = command(schedule_commands, "list", help="each schedule's last and next fire and skipped ticks")
    shown.add_argument("app", help="module:app")
    shown.add_argument("--recent", type=int, default=10, help="how many skipped and pending ticks to show")
    add_format(shown)
    shown.set_defaults(func=lambda a: asyncio.run(schedule_list(a)))
