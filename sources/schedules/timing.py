"""When a schedule fires: its ticks as UTC instants, from a cron expression or a fixed interval.

**cron** expressions are matched on the wall clock of the schedule's time zone by croniter, iterating
naive wall-clock times (calendar arithmetic only: croniter never sees a time zone here). Which instants
those wall-clock times are is decided here, with zoneinfo, by Vixie cron's rules, because croniter's
own time-zone handling runs a fixed-time job twice in a repeated hour:

- a **fixed-time** job (its minute and hour fields, and seconds if given, hold no ``*``, as in
  ``30 2 * * *``) runs **once** in a repeated hour (at the first of the two instants), and a time that
  a skipped hour swallowed runs at the **first instant after the gap** (02:30 on the night the clocks
  jump from 02:00 to 03:00 runs at 03:00);
- an **interval** job (a ``*`` in the minute or hour field, as in ``*/15 * * * *``) follows real
  time: its ticks fall in both passes of a repeated hour and do not exist in a skipped one.

**every=** ticks are ``anchor + k * every`` in real time, the anchor being midnight at the start of
1 January 2000 in the schedule's time zone: daylight saving time never moves them.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, CroniterError, croniter

from consumer_kit.errors import ConfigurationError

# How far ahead a schedule must fire at least once to be accepted (leap days repeat every 4 to 8 years).
NEVER_FIRES_AFTER_YEARS = 30
# croniter's random fields (``R``) would give every replica different ticks.
_RANDOM = re.compile(r"(?<![a-z])r(?![a-z])", re.IGNORECASE)


class Timing(Protocol):
    """The ticks of a schedule."""

    def after(self, instant: datetime) -> Iterator[datetime]:
        """The ticks strictly after ``instant``, ascending, as aware UTC datetimes."""
        ...

    def describe(self) -> str:
        """The schedule as its author wrote it (``cron 30 2 * * * Europe/Berlin``)."""
        ...


def first_after(timing: Timing, instant: datetime) -> datetime | None:
    """The first tick after ``instant``; ``None`` when the schedule never fires again."""
    return next(iter(timing.after(instant)), None)


def between(timing: Timing, start: datetime, end: datetime, *, limit: int) -> list[datetime]:
    """Up to ``limit`` ticks in ``(start, end]``, ascending."""
    found: list[datetime] = []
    for tick in timing.after(start):
        if tick > end or len(found) == limit:
            break
        found.append(tick)
    return found


def latest(timing: Timing, instant: datetime) -> datetime | None:
    """The newest tick at or before ``instant`` (looking back at most ``NEVER_FIRES_AFTER_YEARS``)."""
    for span in (timedelta(minutes=1), timedelta(hours=1), timedelta(days=1), timedelta(days=32),
                 timedelta(days=367), timedelta(days=366 * NEVER_FIRES_AFTER_YEARS)):
        newest = None
        for tick in timing.after(instant - span):
            if tick > instant:
                break
            newest = tick
        if newest is not None:
            return newest
    return None


def is_tick(timing: Timing, instant: datetime) -> bool:
    """Whether ``instant`` is one of the schedule's ticks."""
    return first_after(timing, instant - timedelta(microseconds=1)) == instant


def key_id(tick: datetime) -> str:
    """The tick as the key's id: its UTC instant in ISO 8601 with ``Z`` (``2026-03-08T07:00:00Z``)."""
    return tick.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Wall(enum.Enum):
    ONCE = "once"  # the wall-clock time happens once
    TWICE = "twice"  # in a repeated hour
    NEVER = "never"  # in a skipped hour


class CronTiming:
    """Ticks of a cron expression on the wall clock of ``zone`` (see the module docstring)."""

    def __init__(self, expression: str, zone: ZoneInfo) -> None:
        if not isinstance(expression, str) or not expression.strip():
            raise ConfigurationError("cron= must be a cron expression such as '*/5 * * * *'")
        if _RANDOM.search(expression):
            raise ConfigurationError(f"cron expression {expression!r} has a random field (R): every replica "
                                     "must compute the same ticks")
        try:
            fields = croniter(expression, datetime(2000, 1, 1)).expressions
        except (CroniterError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"invalid cron expression {expression!r}: {exc}") from None
        self.expression = expression
        self.zone = zone
        # Vixie cron: a job is fixed-time unless its minute or hour field (or seconds, when given) has a *.
        timed = [fields[0], fields[1]] + ([fields[5]] if len(fields) > 5 else [])
        self.fixed_time = not any("*" in field for field in timed)

    def describe(self) -> str:
        return f"cron {self.expression} {self.zone.key}"

    def after(self, instant: datetime) -> Iterator[datetime]:
        instant = instant.astimezone(UTC)
        local = instant.astimezone(self.zone)
        start = local.replace(tzinfo=None)
        happens, early, late = self._instants(start)
        if happens is _Wall.TWICE and local.fold == 0:
            # ``instant`` is in a repeated hour's first pass: the second pass of the wall-clock times
            # before its own, which come after it, must be walked too.
            assert late is not None
            start -= late - early
        walls = croniter(self.expression, start - timedelta(seconds=1), ret_type=datetime)
        last: datetime | None = None
        second_pass: list[datetime] = []  # interval jobs: a repeated hour's ticks, run again after it
        while True:
            try:
                wall: datetime | None = walls.get_next(datetime)
            except CroniterBadDateError:  # no further match: the schedule has ended
                wall = None
            kind, first, second = self._instants(wall) if wall is not None else (None, None, None)
            if kind is not _Wall.TWICE and second_pass:
                for replayed in second_pass:
                    if replayed > instant and (last is None or replayed > last):
                        last = replayed
                        yield replayed
                second_pass.clear()
            if first is None:
                return
            if kind is _Wall.TWICE and not self.fixed_time:
                assert second is not None
                second_pass.append(second)
            elif kind is _Wall.NEVER and not self.fixed_time:
                continue
            # Ticks come out ascending; one a skipped hour swallowed can equal the next: it runs once.
            if first > instant and (last is None or first > last):
                last = first
                yield first

    def _instants(self, wall: datetime) -> tuple[_Wall, datetime, datetime | None]:
        """What ``wall`` is in the zone, and its instant(s): for a skipped time, the end of the gap."""
        early = wall.replace(tzinfo=self.zone, fold=0).astimezone(UTC)
        late = wall.replace(tzinfo=self.zone, fold=1).astimezone(UTC)
        if early == late:
            return _Wall.ONCE, early, None
        if early < late:
            return _Wall.TWICE, early, late
        # In a gap, fold=0 reads the time with the offset before the jump (after the gap ends) and fold=1
        # with the one after it (before the gap starts): the jump lies between, at a whole second.
        low, high = int(late.timestamp()), int(early.timestamp())
        while low + 1 < high:
            middle = (low + high) // 2
            if datetime.fromtimestamp(middle, self.zone).replace(tzinfo=None) > wall:
                high = middle
            else:
                low = middle
        return _Wall.NEVER, datetime.fromtimestamp(high, UTC), None


class IntervalTiming:
    """Ticks every ``every`` in real time, from midnight of 2000-01-01 in ``zone``."""

    def __init__(self, every: timedelta, zone: ZoneInfo) -> None:
        if not isinstance(every, timedelta) or every < timedelta(seconds=1) or every.microseconds:
            raise ConfigurationError("every= must be a timedelta of whole seconds, at least one second")
        self.every = every
        self.zone = zone
        self.anchor = datetime(2000, 1, 1, tzinfo=zone).astimezone(UTC)

    def describe(self) -> str:
        return f"every {int(self.every.total_seconds())}s {self.zone.key}"

    def after(self, instant: datetime) -> Iterator[datetime]:
        step = int(self.every.total_seconds())
        elapsed = (instant.astimezone(UTC) - self.anchor) // timedelta(seconds=1)  # whole seconds, floored
        tick = self.anchor + timedelta(seconds=(elapsed // step + 1) * step)
        while True:
            yield tick
            tick += self.every


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; a clear error when there is no such zone."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError, OSError):
        raise ConfigurationError(f"unknown time zone {name!r} (an IANA name such as 'Europe/Berlin')") from None


def check_fires(timing: Timing, now: datetime) -> None:
    """Refuse a schedule that never fires again after ``now``."""
    try:
        tick = first_after(timing, now)
    except (CroniterError, OverflowError):
        tick = None
    if tick is None or tick - now > timedelta(days=366 * NEVER_FIRES_AFTER_YEARS):
        raise ConfigurationError(f"{timing.describe()} never fires (no tick within {NEVER_FIRES_AFTER_YEARS} years)")
