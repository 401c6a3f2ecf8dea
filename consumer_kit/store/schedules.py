"""Schedule state (:mod:`consumer_kit.sources.schedules`): one method per database operation, each on the
connection (and in the transaction) the caller hands it.

For each schedule (scoped by consumer, name and version) the store keeps ``decided_until``: every tick
at or before it has been decided, either to run or to be skipped. Moving that mark is a compare-and-
set, so when several replicas decide the same ticks at once exactly one records them. Each decided
tick has a row: ``pending`` until its delivery settles (then ``done`` or ``parked``), or ``skipped``
with its reason. A pending row outlives any process: whichever replica looks next dispatches it, and
the inbox admits one run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from consumer_kit.store import sql
from consumer_kit.store.connections import Database
from consumer_kit.store.executor import Executor


@dataclass(frozen=True, slots=True)
class ScheduleId:
    """Which schedule: the handler's inbox scope (``consumer``), the schedule's name and version."""

    consumer: str
    schedule: str
    version: int

    @property
    def params(self) -> dict[str, Any]:
        """The statements' parameters naming this schedule."""
        return {"consumer": self.consumer, "schedule": self.schedule, "version": self.version}


@dataclass(frozen=True, slots=True)
class PendingTick:
    """A tick decided to run whose delivery has not settled; ``not_before`` after a failed attempt."""

    tick: datetime
    not_before: datetime | None


@dataclass(frozen=True, slots=True)
class TickRecord:
    """A decided tick as stored: ``state`` pending | done | parked | skipped, and why (skipped, parked)."""

    tick: datetime
    state: str
    reason: str | None


class ScheduleStore:
    """Read and move schedules' marks; record, settle, defer and sweep their ticks."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def now(self, ex: Executor) -> datetime:
        """The database's clock."""
        row = await ex.fetch_one(sql.DATABASE_NOW, {})
        assert row is not None
        now: datetime = row["now"]
        return now

    async def decided_until(self, ex: Executor, sid: ScheduleId) -> datetime | None:
        """The schedule's mark, or ``None`` when the schedule was never seen."""
        row = await ex.fetch_one(sql.GET_SCHEDULE, sid.params)
        return None if row is None else row["decided_until"]

    async def create(self, ex: Executor, sid: ScheduleId, *, decided_until: datetime, now: datetime) -> None:
        """Record a schedule seen for the first time (nothing if another replica did it first)."""
        await ex.execute(sql.INSERT_SCHEDULE, {**sid.params, "decided_until": decided_until, "now": now})

    async def advance(self, ex: Executor, sid: ScheduleId, *, decided_from: datetime, decided_until: datetime,
                      now: datetime) -> bool:
        """Move the mark from ``decided_from`` to ``decided_until``; ``False`` when it was no longer at
        ``decided_from`` (another replica decided these ticks)."""
        return await ex.execute(sql.ADVANCE_SCHEDULE, {**sid.params, "decided_from": decided_from,
                                                       "decided_until": decided_until, "now": now}) == 1

    async def record(self, ex: Executor, sid: ScheduleId, tick: datetime, *, state: str, reason: str | None,
                     now: datetime) -> bool:
        """Record a decided tick; ``False`` when it was already recorded (by ``consumer-kit schedule run``)."""
        return await ex.execute(sql.INSERT_TICK, {**sid.params, "tick": tick, "state": state, "reason": reason,
                                                  "now": now}) == 1

    async def unskip(self, ex: Executor, sid: ScheduleId, tick: datetime, *, now: datetime) -> bool:
        """Make a skipped tick pending again: it is being run on purpose."""
        return await ex.execute(sql.UNSKIP_TICK, {**sid.params, "tick": tick, "now": now}) == 1

    async def unpark(self, ex: Executor, sid: ScheduleId, tick: datetime, *, now: datetime) -> bool:
        """Make a parked tick pending again: it is being replayed."""
        return await ex.execute(sql.UNPARK_TICK, {**sid.params, "tick": tick, "now": now}) == 1

    async def pending(self, ex: Executor, sid: ScheduleId, *, limit: int) -> list[PendingTick]:
        """The oldest ``limit`` ticks decided to run whose deliveries have not settled."""
        rows = await ex.fetch_all(sql.PENDING_TICKS, {**sid.params, "limit": limit})
        return [PendingTick(row["tick"], row["not_before"]) for row in rows]

    async def settle(self, ex: Executor, sid: ScheduleId, tick: datetime, *, state: str, reason: str | None,
                     now: datetime) -> bool:
        """A pending tick's delivery settled: ``done`` or ``parked``; ``False`` if it was settled already."""
        return await ex.execute(sql.SETTLE_TICK, {**sid.params, "tick": tick, "state": state, "reason": reason,
                                                  "now": now}) == 1

    async def defer(self, ex: Executor, sid: ScheduleId, tick: datetime, *, not_before: datetime,
                    now: datetime) -> bool:
        """A pending tick's attempt failed: no replica dispatches it again before ``not_before``."""
        return await ex.execute(sql.DEFER_TICK, {**sid.params, "tick": tick, "not_before": not_before,
                                                 "now": now}) == 1

    async def get(self, ex: Executor, sid: ScheduleId, tick: datetime) -> TickRecord | None:
        """One tick's record, if it was decided."""
        return _record(await ex.fetch_one(sql.GET_TICK, {**sid.params, "tick": tick}))

    async def last_run(self, ex: Executor, sid: ScheduleId) -> TickRecord | None:
        """The newest tick decided to run (pending, done or parked)."""
        return _record(await ex.fetch_one(sql.LAST_RUN, sid.params))

    async def recent_skips(self, ex: Executor, sid: ScheduleId, *, limit: int) -> list[TickRecord]:
        """The newest skipped ticks, newest first."""
        rows = await ex.fetch_all(sql.RECENT_SKIPS, {**sid.params, "limit": limit})
        return [TickRecord(row["tick"], "skipped", row["reason"]) for row in rows]

    async def skip_counts(self, ex: Executor, sid: ScheduleId) -> dict[str, int]:
        """How many recorded ticks were skipped, by reason."""
        rows = await ex.fetch_all(sql.SKIP_COUNTS, sid.params)
        return {row["reason"]: int(row["skipped"]) for row in rows}

    async def sweep(self, sid: ScheduleId, *, before: datetime, batch_size: int = 500) -> int:
        """Delete the schedule's decided ticks older than ``before`` in batches, each its own short
        transaction; pending ticks are kept whatever their age."""
        total = 0
        while True:
            async with self.database.connect() as ex:
                deleted = await ex.execute(sql.SWEEP_TICKS, {**sid.params, "before": before, "limit": batch_size})
            total += deleted
            if deleted < batch_size:
                return total


def _record(row: Mapping[str, Any] | None) -> TickRecord | None:
    return None if row is None else TickRecord(row["tick"], row["state"], row["reason"])
