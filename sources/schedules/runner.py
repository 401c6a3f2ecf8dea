"""One replica's loop for one schedule.

Each round: read the clock (the database's), decide the ticks that came due since the schedule's
mark (:mod:`.catchup`; a compare-and-set on the mark makes exactly one replica record them), then
dispatch a pending tick if one may start. Every replica dispatches what it sees pending; the inbox
admits one run of each tick, and the others see it done (``duplicate``) or held (``in_progress``, then
they look again when its lease runs out). A tick's row stays pending until its delivery settles, so a
tick whose process died is dispatched again by another replica.

On one replica, a run holds the next pending tick back until it settles, so a backlog runs oldest
first, one at a time; with ``overlap="allow"`` a run holds back only until the schedule's next tick
after its start comes due, so a long run never delays a tick that is due on time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from consumer_kit.delivery import Dispatch, Result
from consumer_kit.settings import Settings
from consumer_kit.source_store import PendingTick
from consumer_kit.sources.schedules import catchup, settlement, timing
from consumer_kit.sources.schedules.catchup import Decision
from consumer_kit.sources.schedules.metrics import SKIPPED

if TYPE_CHECKING:
    from consumer_kit.sources.schedules.source import Schedule

log = logging.getLogger("consumer_kit.sources.schedules")

PENDING_LOOK = 100  # pending ticks looked at per round
SWEEP_EVERY_SECONDS = 3600.0
SETTLE_TIMEOUT_SECONDS = 10.0  # how long close() waits for settlements under way


@dataclass(slots=True)
class _Run:
    task: asyncio.Task[None]
    holds_until: datetime | None  # None: until it settles


class Runner:
    """The loop of ``schedule`` on this replica; ``dispatch`` runs a tick through the pipeline."""

    def __init__(self, schedule: Schedule, dispatch: Dispatch, settings: Settings) -> None:
        self.schedule = schedule
        self.dispatch = dispatch
        self.settings = settings
        self.sid = schedule.sid
        self.store = schedule.store
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._runs: dict[datetime, _Run] = {}
        self._deferred: dict[datetime, datetime] = {}  # tick -> not before, as this replica learnt it
        self._swept_at: float | None = None
        self._stopping = False

    def start(self) -> None:
        """Run the loop in a task of its own."""
        self._task = asyncio.create_task(self._forever(), name=f"consumer-kit-schedule-{self.schedule.name}")

    async def stop(self) -> None:
        """Stop deciding and dispatching; runs already dispatched go on."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        """Wait (bounded) for settlements under way; a tick left unsettled stays pending."""
        running = [run.task for run in self._runs.values()]
        if running:
            await asyncio.wait(running, timeout=SETTLE_TIMEOUT_SECONDS)

    async def _forever(self) -> None:
        failures = 0
        while not self._stopping:
            self._wakeup.clear()
            try:
                wake: datetime | None = await self._round()
                failures = 0
            except Exception as exc:  # the database is away: look again, backing off to the poll interval
                failures += 1
                wake = None
                log.error("schedule %s: round failed (%s); trying again", self.schedule.name, type(exc).__name__)
            await self._sleep(wake, failures)

    async def _sleep(self, wake: datetime | None, failures: int) -> None:
        waits: set[asyncio.Future[object]] = {asyncio.ensure_future(self._wakeup.wait())}
        if wake is not None:
            waits.add(asyncio.ensure_future(self.schedule.clock.sleep_until(wake)))
        else:
            poll = self.settings.schedule_poll_seconds
            waits.add(asyncio.ensure_future(asyncio.sleep(min(0.5 * 2 ** failures, poll))))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _round(self) -> datetime:
        """Decide what came due, dispatch what may start; the instant to look again."""
        now = await self.schedule.clock.now()
        mark = await self._decide(now)
        async with self.store.database.connect() as ex:
            pending = await self.store.pending(ex, self.sid, limit=PENDING_LOOK)
        still = {p.tick for p in pending}
        self._deferred = {tick: until for tick, until in self._deferred.items() if tick in still}
        self._launch(pending, now)
        await self._sweep(now)
        wakes = [now + timedelta(seconds=self.settings.schedule_poll_seconds)]
        upcoming = timing.first_after(self.schedule.timing, max(mark, now))
        wakes += [upcoming] if upcoming is not None else []
        wakes += [p.not_before for p in pending if p.not_before is not None]
        wakes += list(self._deferred.values())
        wakes += [run.holds_until for run in self._runs.values() if run.holds_until is not None]
        return min(w for w in wakes if w > now)

    async def _decide(self, now: datetime) -> datetime:
        """Decide every tick due by ``now``, a chunk per transaction; the schedule's mark afterwards."""
        schedule, store, sid = self.schedule, self.store, self.sid
        async with store.database.connect() as ex:
            mark = await store.decided_until(ex, sid)
            if mark is None:  # seen for the first time: it starts now, with nothing to catch up
                await store.create(ex, sid, decided_until=now, now=now)
                mark = await store.decided_until(ex, sid)
                assert mark is not None
        ahead = catchup.look_ahead(schedule.catch_up, schedule.max_catch_up)
        while mark < now:
            window = timing.between(schedule.timing, mark, now, limit=catchup.CHUNK + ahead)
            if not window:
                break
            complete = len(window) < catchup.CHUNK + ahead
            decisions = catchup.decide(window, now=now, complete=complete, catch_up=schedule.catch_up,
                                       max_catch_up=schedule.max_catch_up,
                                       misfire_grace_seconds=schedule.misfire_grace_seconds)
            until = now if complete else decisions[-1].tick
            if await self._record(mark, until, decisions, now):
                mark = until
            else:  # another replica decided these ticks first
                async with store.database.connect() as ex:
                    mark = await store.decided_until(ex, sid) or mark
        return mark

    async def _record(self, mark: datetime, until: datetime, decisions: list[Decision], now: datetime) -> bool:
        """Move the mark and record the decided ticks in one transaction; ``False`` if another replica
        moved the mark first. With ``overlap="forbid"``, ticks to run are skipped ``overlap`` while an
        earlier tick of the schedule is unfinished."""
        store, sid = self.store, self.sid
        forbid = self.schedule.overlap == "forbid" and any(d.runs for d in decisions)
        if forbid:
            await self._reconcile()
        recorded: list[Decision] = []
        async with store.database.transaction() as ex:
            if not await store.advance(ex, sid, decided_from=mark, decided_until=until, now=now):
                return False
            if forbid and await store.pending(ex, sid, limit=1):
                decisions = [d if not d.runs else Decision(d.tick, "overlap") for d in decisions]
            for decision in decisions:
                if await store.record(ex, sid, decision.tick, state="pending" if decision.runs else "skipped",
                                      reason=decision.reason, now=now):
                    recorded.append(decision)
        self._report(recorded)
        return True

    def _report(self, recorded: Sequence[Decision]) -> None:
        skipped: dict[str, list[datetime]] = {}
        for decision in recorded:
            if decision.reason is not None:
                skipped.setdefault(decision.reason, []).append(decision.tick)
        for reason, ticks in skipped.items():
            SKIPPED.labels(self.schedule.name, reason).inc(len(ticks))
            log.warning("schedule %s: %d tick(s) skipped (%s), %s to %s", self.schedule.name, len(ticks), reason,
                        timing.key_id(ticks[0]), timing.key_id(ticks[-1]))

    async def _reconcile(self) -> None:
        """Settle pending ticks the inbox has finished (a process died between the two), so that
        ``overlap="forbid"`` counts only ticks that are really unfinished."""
        store, sid, inbox = self.store, self.sid, self.schedule.inbox
        digester = self.settings.digester()
        async with store.database.connect() as ex:
            for pending in await store.pending(ex, sid, limit=PENDING_LOOK):
                if pending.tick in self._runs:
                    continue
                key = self.schedule.key(self.schedule.delivery(pending.tick, pending.tick))
                row = await inbox.lookup(ex, sid.consumer, digester.candidates(key))
                if row is not None and row["state"] in ("completed", "dead"):
                    dead = row["state"] == "dead"
                    await store.settle(ex, sid, pending.tick, state="parked" if dead else "done",
                                       reason=row["outcome"] if dead else None, now=await self.schedule.clock.now())

    def _launch(self, pending: list[PendingTick], now: datetime) -> None:
        """Start the oldest pending tick that may start now: with ``overlap="forbid"`` only the oldest of
        all, and only while nothing runs here; with ``"allow"`` once no run here holds it back."""
        if self._stopping or not pending:
            return
        if self.schedule.overlap == "forbid":
            candidates = pending[:1] if not self._runs else []
        elif any(run.holds_until is None or run.holds_until > now for run in self._runs.values()):
            candidates = []
        else:
            candidates = pending
        for tick in candidates:
            if tick.tick in self._runs or (tick.not_before is not None and tick.not_before > now) \
                    or self._deferred.get(tick.tick, tick.tick) > now:
                continue
            holds = timing.first_after(self.schedule.timing, now) if self.schedule.overlap == "allow" else None
            task = asyncio.create_task(self._deliver(tick.tick, now), name=f"consumer-kit-tick-{self.schedule.name}")
            self._runs[tick.tick] = _Run(task, holds)
            return

    async def _deliver(self, tick: datetime, now: datetime) -> None:
        try:
            result = await self.dispatch(self.schedule.delivery(tick, now))
            await self.settle(tick, result)
        except asyncio.CancelledError:
            raise  # unsettled: the tick stays pending, and the next look dispatches it again
        except Exception as exc:
            log.warning("schedule %s: recording how tick %s settled failed (%s); it stays pending",
                        self.schedule.name, timing.key_id(tick), type(exc).__name__)
        finally:
            self._runs.pop(tick, None)
            self._wakeup.set()

    async def settle(self, tick: datetime, result: Result) -> None:
        """Record what the pipeline decided: done, parked, or to be tried again after ``result.delay``
        (see :mod:`.settlement`); this replica waits the delay in any case."""
        now = await self.schedule.clock.now()
        retry = settlement.retry_at(result, now, self.settings.retry_later_seconds)
        if retry is not None:
            self._deferred[tick] = retry
        await settlement.record(self.store, self.sid, tick, result, now=now, retry=retry)

    async def _sweep(self, now: datetime) -> None:
        if self._swept_at is not None and time.monotonic() - self._swept_at < SWEEP_EVERY_SECONDS:
            return
        self._swept_at = time.monotonic()
        before = now - timedelta(seconds=self.settings.inbox_retention_seconds)
        await self.store.sweep(self.sid, before=before, batch_size=self.settings.sweep_batch_size)
