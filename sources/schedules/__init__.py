"""Scheduled jobs: ``Schedule(name, cron=... | every=...)`` fires ticks keyed by their intended
instant, once across every replica that runs it. Needs the ``schedules`` extra:
``pip install 'consumer-kit[schedules]'``."""

try:
    import croniter  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    from consumer_kit.extras import missing_extra

    raise missing_extra("schedules", "consumer_kit.sources.schedules", exc) from exc

from consumer_kit.sources.schedules.catchup import CatchUp, Overlap, SkipReason
from consumer_kit.sources.schedules.clock import DatabaseClock, ManualClock, ScheduleClock
from consumer_kit.sources.schedules.source import Fired, Schedule, ScheduleDelivery, ScheduleStatus

__all__ = [
    "CatchUp",
    "DatabaseClock",
    "Fired",
    "ManualClock",
    "Overlap",
    "Schedule",
    "ScheduleClock",
    "ScheduleDelivery",
    "ScheduleStatus",
    "SkipReason",
]
