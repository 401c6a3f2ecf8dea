"""Scheduled jobs: ``Schedule(name, cron=... | every=...)`` fires ticks keyed by their intended
instant, once across every replica that runs it. Needs the ``schedules`` extra:
``pip install 'consumer-kit[schedules]'``.

The parts, as every source has them where a schedule has one (no broker, so no publisher): the source
(:mod:`.source`, with the loop each replica runs in :mod:`.runner`), the message reader (a tick and its
delivery, :mod:`.message`), the settlement policy (how a tick's row records the pipeline's decision,
:mod:`.settlement`); besides them the timings (:mod:`.timing`), the catch-up policy (:mod:`.catchup`)
and the clock (:mod:`.clock`). The app hands a schedule its store objects when it starts
(:class:`~consumer_kit.source_store.SourceStore`)."""

try:
    import croniter  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    from consumer_kit.extras import missing_extra

    raise missing_extra("schedules", "consumer_kit.sources.schedules", exc) from exc

from consumer_kit.sources.schedules.catchup import CatchUp, Overlap, SkipReason
from consumer_kit.sources.schedules.clock import DatabaseClock, ManualClock, ScheduleClock
from consumer_kit.sources.schedules.message import ScheduleDelivery
from consumer_kit.sources.schedules.source import Fired, Schedule, ScheduleStatus

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
