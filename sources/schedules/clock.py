"""The clock a schedule judges due-ness by: the database's by default, a manual one in tests.

Every replica reads the same database clock, so replicas whose own clocks disagree still agree on
which ticks are due. Waiting is measured on the local monotonic clock from the last reading, which
runs at the same rate whatever the offset between the two.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable

from consumer_kit.source_store import ScheduleStore


@runtime_checkable
class ScheduleClock(Protocol):
    """What a schedule asks the time, and how it waits for an instant."""

    async def now(self) -> datetime:
        """The current instant, aware, in UTC."""
        ...

    async def sleep_until(self, instant: datetime) -> None:
        """Return at ``instant`` or soon after (never before, as far as this clock can tell)."""
        ...


class DatabaseClock:
    """The database's clock (``clock_timestamp()`` on PostgreSQL; the host's on SQLite, which is local),
    read through the schedules' store the app hands over (:class:`~consumer_kit.source_store.SourceStore`)."""

    def __init__(self, schedules: ScheduleStore) -> None:
        self._store = schedules
        self._read: tuple[datetime, float] | None = None  # the last reading, and the monotonic time of it

    async def now(self) -> datetime:
        """Ask the database."""
        async with self._store.database.connect() as ex:
            now = await self._store.now(ex)
        self._read = (now, time.monotonic())
        return now

    async def sleep_until(self, instant: datetime) -> None:
        """Sleep as long as the last reading says is left (a fresh reading follows the wake-up)."""
        if self._read is None:
            await self.now()
        assert self._read is not None
        read, at = self._read
        left = (instant - read).total_seconds() - (time.monotonic() - at)
        if left > 0:
            await asyncio.sleep(left)


class ManualClock:
    """A clock that moves only when told (:meth:`advance`, :meth:`set`): for tests of schedules, and
    for several in-process replicas that must share one notion of now."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = _aware(start or datetime(2026, 1, 1, tzinfo=UTC))
        self._sleepers: list[asyncio.Future[None]] = []

    @property
    def time(self) -> datetime:
        """The clock's current instant (without awaiting)."""
        return self._now

    async def now(self) -> datetime:
        """The clock's current instant."""
        return self._now

    def set(self, instant: datetime) -> None:
        """Move the clock to ``instant`` (forward only) and wake whoever waits for it."""
        instant = _aware(instant)
        if instant < self._now:
            raise ValueError("a ManualClock moves forward only")
        self._now = instant
        sleepers, self._sleepers = self._sleepers, []
        for sleeper in sleepers:
            if not sleeper.done():
                sleeper.set_result(None)

    def advance(self, delta: timedelta) -> datetime:
        """Move the clock forward by ``delta``; the new instant."""
        self.set(self._now + delta)
        return self._now

    async def sleep_until(self, instant: datetime) -> None:
        """Wait until the clock has been moved to ``instant`` or past it."""
        while self._now < instant:
            sleeper = asyncio.get_running_loop().create_future()
            self._sleepers.append(sleeper)
            await sleeper


def _aware(instant: datetime) -> datetime:
    if instant.tzinfo is None:
        raise ValueError("a ManualClock needs aware datetimes (tzinfo=UTC): a naive one would be read as local time")
    return instant.astimezone(UTC)
