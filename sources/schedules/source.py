"""``Schedule``: a source whose deliveries are the ticks of a cron expression or of an interval, keyed
by the tick's intended instant (see :mod:`.runner` for the loop each replica runs)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar, get_args

from consumer_kit.delivery import Delivery, Dispatch, Outcome, Result
from consumer_kit.errors import ConfigurationError, InvalidKey, MissingStableId
from consumer_kit.keys import OperationKey
from consumer_kit.settings import Settings
from consumer_kit.source_store import Inbox, PendingTick, ScheduleId, ScheduleStore, SourceStore, TickRecord
from consumer_kit.sources.schedules import timing
from consumer_kit.sources.schedules.catchup import CatchUp, Overlap, SkipReason
from consumer_kit.sources.schedules.clock import DatabaseClock, ScheduleClock
from consumer_kit.sources.schedules.message import ScheduleDelivery, tick_delivery, tick_of
from consumer_kit.sources.schedules.metrics import SKIPPED
from consumer_kit.sources.schedules.runner import Runner
from consumer_kit.tracing import SpanShape

T = TypeVar("T")
IN_PROGRESS_POLL_SECONDS = 0.25  # fire(): how often to look again at a tick another process holds


@dataclass(frozen=True, slots=True)
class Fired:
    """What :meth:`Schedule.fire` did: the tick it ran, and the pipeline's result."""

    tick: datetime
    result: Result


@dataclass(frozen=True, slots=True)
class ScheduleStatus:
    """A schedule as the store knows it (``consumer-kit schedule list``)."""

    name: str
    version: int
    timing: str
    decided_until: datetime | None  # every tick at or before it has been decided; None: never run
    last_fired: TickRecord | None  # the newest tick that ran (or runs, or was parked)
    next_fire: datetime | None
    pending: list[PendingTick]
    recent_skips: list[TickRecord]  # newest first
    skipped: dict[str, int]  # skipped ticks still on record, by reason


class Schedule:
    """Ticks of ``cron=`` (on the wall clock of ``timezone``) or ``every=``, delivered keyed
    ``<name>:v<version>:<tick as UTC ISO 8601 Z>`` and run once across all replicas.

    ``catch_up`` decides what runs after a backlog: ``"latest"`` (the newest tick), ``"all"`` (up to
    ``max_catch_up``, oldest first) or ``"none"``; ``misfire_grace_seconds`` skips ticks later than
    that; ``overlap="forbid"`` skips a tick while an earlier one is unfinished. Skipped ticks are
    recorded with their reason and counted. ``clock`` (default: the database's) is what due-ness is
    judged by. Invalid arguments raise :class:`~consumer_kit.ConfigurationError` here, that is at
    ``@app.handler(Schedule(...))``.
    """

    def __init__(self, name: str, *, cron: str | None = None, every: timedelta | None = None,
                 timezone: str = "UTC", version: int = 1, catch_up: CatchUp = "latest",
                 misfire_grace_seconds: float | None = None, max_catch_up: int = 100, overlap: Overlap = "allow",
                 clock: ScheduleClock | None = None) -> None:
        try:
            OperationKey(name, version, "probe")
        except InvalidKey as exc:
            raise ConfigurationError(f"schedule name {name!r} and version {version!r} cannot key ticks: {exc}") \
                from None
        if (cron is None) == (every is None):
            raise ConfigurationError(f"schedule {name!r}: give exactly one of cron= and every=")
        if catch_up not in ("latest", "all", "none"):
            raise ConfigurationError(f"schedule {name!r}: catch_up must be 'latest', 'all' or 'none'")
        if overlap not in ("allow", "forbid"):
            raise ConfigurationError(f"schedule {name!r}: overlap must be 'allow' or 'forbid'")
        if isinstance(max_catch_up, bool) or not isinstance(max_catch_up, int) or max_catch_up < 1:
            raise ConfigurationError(f"schedule {name!r}: max_catch_up must be a positive integer")
        if misfire_grace_seconds is not None and not misfire_grace_seconds > 0:
            raise ConfigurationError(f"schedule {name!r}: misfire_grace_seconds must be positive (or None)")
        zone = timing.zone(timezone)
        self.timing: timing.Timing = timing.CronTiming(cron, zone) if cron is not None \
            else timing.IntervalTiming(every, zone)  # type: ignore[arg-type]
        timing.check_fires(self.timing, datetime.now(UTC))
        self.name = self.namespace = name
        self.version = version
        self.span_shape = SpanShape("internal", attributes={"consumer_kit.schedule": name})
        self.catch_up: CatchUp = catch_up
        self.overlap: Overlap = overlap
        self.max_catch_up = max_catch_up
        self.misfire_grace_seconds = misfire_grace_seconds
        self._given_clock = clock
        self._clock: ScheduleClock | None = clock
        self._store: SourceStore | None = None
        self._sid: ScheduleId | None = None
        self._settings: Settings | None = None
        self._runner: Runner | None = None

    def declare_metrics(self) -> None:
        """This schedule's skipped ticks, by every reason, at zero until counted (see consumer_kit.metrics)."""
        for reason in get_args(SkipReason):
            SKIPPED.labels(self.name, reason)

    def key(self, delivery: Delivery) -> OperationKey:
        """``<name>:v<version>:<tick>``: the intended fire instant, never the time it ran."""
        if delivery.id is None:
            raise MissingStableId()
        return OperationKey(self.name, self.version, delivery.id)

    def delivery(self, tick: datetime, now: datetime) -> ScheduleDelivery:
        """The delivery of ``tick``, dispatched at ``now``."""
        return tick_delivery(self.name, self.version, tick, now)

    def use_store(self, store: SourceStore) -> None:
        """Called by the app when it starts, before :meth:`start`: the schedule keeps its state in
        ``store.schedules`` under ``store.consumer`` (its handler's inbox scope), looks its ticks up in
        the app's inbox and, by default, reads the database's clock."""
        self._store = store
        self._sid = ScheduleId(store.consumer, self.name, self.version)
        self._settings = store.settings
        self._clock = self._given_clock or DatabaseClock(store.schedules)

    @property
    def sid(self) -> ScheduleId:
        """Which schedule, in the store."""
        return self._bound(self._sid)

    @property
    def store(self) -> ScheduleStore:
        """The schedule's state in the store."""
        return self._bound(self._store).schedules

    @property
    def inbox(self) -> Inbox:
        """The app's inbox, where each tick's run is recorded."""
        return self._bound(self._store).inbox

    @property
    def clock(self) -> ScheduleClock:
        """The clock due-ness is judged by."""
        return self._bound(self._clock)

    @property
    def settings(self) -> Settings:
        """The app's settings."""
        return self._bound(self._settings)

    def _bound(self, value: T | None) -> T:
        """``value``, which the app hands over when it starts (:meth:`use_store`)."""
        if value is None:
            raise RuntimeError(f"schedule {self.name!r} is not registered with a started app")
        return value

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        """Begin firing: this replica's loop (:class:`~consumer_kit.sources.schedules.runner.Runner`)."""
        self._settings = settings
        self._runner = Runner(self, dispatch, settings)
        self._runner.start()

    async def stop(self) -> None:
        """Stop deciding and dispatching ticks; those already dispatched go on."""
        if self._runner is not None:
            await self._runner.stop()

    async def close(self) -> None:
        """Wait (bounded) for settlements under way; an unsettled tick stays pending for the next look."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.close()

    async def fire(self, at: datetime | None = None, *, dispatch: Dispatch | None = None,
                   wait_seconds: float | None = None) -> Fired:
        """Run the tick due now (the newest at or before the clock's now), or the tick ``at``, through
        the inbox: what ``consumer-kit schedule run`` does. A tick another process holds is waited for
        up to ``wait_seconds`` (default: two leases) and reported as it ended then. ``dispatch``
        defaults to the app's, while the schedule runs."""
        runner = self._runner if dispatch is None else Runner(self, dispatch, self.settings)
        if runner is None:
            raise RuntimeError(f"schedule {self.name!r} is not running: give dispatch=")
        if at is not None and at.tzinfo is None:
            raise ConfigurationError(f"the tick to fire must be an aware datetime, not {at.isoformat()} (naive)")
        now = await self.clock.now()
        tick = timing.latest(self.timing, now) if at is None else at.astimezone(UTC)
        if tick is None:
            raise ConfigurationError(f"schedule {self.name!r} has no tick at or before {timing.key_id(now)}")
        if at is not None and not timing.is_tick(self.timing, tick):
            raise ConfigurationError(f"{timing.key_id(tick)} is not a tick of schedule {self.name!r} "
                                     f"({self.timing.describe()})")
        if tick > now:
            raise ConfigurationError(f"tick {timing.key_id(tick)} of schedule {self.name!r} is not due yet")
        async with self.store.database.connect() as ex:
            if not await self.store.record(ex, self.sid, tick, state="pending", reason=None, now=now):
                await self.store.unskip(ex, self.sid, tick, now=now)
        wait = 2 * self.settings.inbox_lease_seconds if wait_seconds is None else wait_seconds
        deadline = time.monotonic() + wait
        while True:
            result = await runner.dispatch(self.delivery(tick, await self.clock.now()))
            if result.outcome is not Outcome.IN_PROGRESS or time.monotonic() >= deadline:
                break
            await asyncio.sleep(IN_PROGRESS_POLL_SECONDS)
        await runner.settle(tick, result)
        return Fired(tick, result)

    async def replay(self, delivery: Delivery, dispatch: Dispatch) -> Result:
        """Run a parked tick again (``consumer-kit parked replay``): its row goes back to pending, then
        the tick runs through the inbox as :meth:`fire` runs one, and its row records how it settled."""
        tick = tick_of(delivery)
        async with self.store.database.connect() as ex:
            await self.store.unpark(ex, self.sid, tick, now=await self.clock.now())
        return (await self.fire(tick, dispatch=dispatch, wait_seconds=0)).result

    async def status(self, *, recent: int = 20) -> ScheduleStatus:
        """The schedule's state: last and next fire, pending ticks, and the skipped ticks on record."""
        store, sid = self.store, self.sid
        now = await self.clock.now()
        async with store.database.connect() as ex:
            mark = await store.decided_until(ex, sid)
            last = await store.last_run(ex, sid)
            pending = await store.pending(ex, sid, limit=recent)
            skips = await store.recent_skips(ex, sid, limit=recent)
            counts = await store.skip_counts(ex, sid)
        return ScheduleStatus(
            name=self.name, version=self.version, timing=self.timing.describe(), decided_until=mark,
            last_fired=last, next_fire=timing.first_after(self.timing, max(mark or now, now)),
            pending=pending, recent_skips=skips, skipped=counts,
        )
