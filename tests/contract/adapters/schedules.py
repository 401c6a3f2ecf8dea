"""The contract's adapter for :class:`~consumer_kit.sources.schedules.Schedule` on a
:class:`~consumer_kit.sources.schedules.ManualClock`: a delivery is a tick, sent by moving the clock
past it; its stable id is the instant it was meant to fire, so every tick has one (no UNKEYABLE), and
a schedule has no connection to cut nor trace context to carry. A redelivery is the same tick fired
again (:meth:`Schedule.fire`, what ``consumer-kit schedule run`` and other replicas do); what the
transport shows is the schedule's own record of its ticks (:meth:`Schedule.status`)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timedelta

from opentelemetry.trace import SpanKind

from consumer_kit import ConsumerApp, Settings, Settlement, Source
from consumer_kit.sources.schedules import Fired, ManualClock, Schedule
from tests.conftest import make_settings
from tests.contract.base import EVERY_SOURCE, Sent, SourceAdapter
from tests.integration.schedules import START, wait_until

MINUTE = timedelta(minutes=1)
RETRY_LATER_SECONDS = 1


def key_id(tick: datetime) -> str:
    return tick.strftime("%Y-%m-%dT%H:%M:%SZ")


class ScheduleAdapter(SourceAdapter):
    id = "schedules"
    capabilities = EVERY_SOURCE
    span_kind = SpanKind.INTERNAL

    def __init__(self) -> None:
        super().__init__()
        self.name = f"contract-{secrets.token_hex(4)}"
        self.clock = ManualClock(START)

    def settings(self, database_url: str, **overrides: object) -> Settings:
        values: dict[str, object] = {"retry_attempts": 1, "retry_later_seconds": RETRY_LATER_SECONDS,
                                     "schedule_poll_seconds": 0.2}
        values.update(overrides)
        return make_settings(database_url, **values)

    def make_source(self) -> Source:
        return Schedule(self.name, every=MINUTE, catch_up="all", clock=self.clock)

    @property
    def schedule(self) -> Schedule:
        schedule: Schedule = self.current
        return schedule

    @contextlib.asynccontextmanager
    async def serving(self, app: ConsumerApp) -> AsyncIterator[None]:
        async with app.running():
            # Seen for the first time, a schedule starts then (never backfills): let it look once
            # before the clock moves.
            async def looked() -> bool:
                return (await self.schedule.status()).decided_until is not None

            await wait_until(looked, what="the schedule's first look")
            yield

    def _next_ticks(self, count: int) -> list[datetime]:
        now = self.clock.time
        first = now.replace(second=0, microsecond=0) + MINUTE
        return [first + i * MINUTE for i in range(count)]

    async def send(self, stable_id: str, *, traceparent: str | None = None) -> Sent:
        assert traceparent is None, "a schedule carries no trace context"
        return (await self.send_in_order([stable_id]))[0]

    async def send_in_order(self, stable_ids: Sequence[str]) -> list[Sent]:
        ticks = self._next_ticks(len(stable_ids))
        self.clock.set(ticks[-1] + timedelta(seconds=1))  # all of them due: a backlog, run oldest first
        return [Sent(key_id(tick), detail=tick) for tick in ticks]

    async def send_again(self, sent: Sent) -> Sent:
        again = Sent(sent.key_id, detail=sent.detail)
        again.attempts.append(asyncio.create_task(self.schedule.fire(sent.detail)))
        return again

    async def _record(self, sent: Sent) -> tuple[str, str | None] | None:
        """The tick's state and reason as the schedule records it: fired by hand, the answer; else
        the newest tick run, once it is this one and no longer pending."""
        if sent.attempts:
            fired = sent.answer
            if not isinstance(fired, Fired):
                return None
            result = fired.result
            return {Settlement.ACK: "done", Settlement.DEAD_LETTER: "parked"}.get(result.settlement, "pending"), \
                result.reason
        status = await self.schedule.status()
        last = status.last_fired
        if last is None or last.tick != sent.detail or any(p.tick == sent.detail for p in status.pending):
            return None
        return last.state, last.reason

    async def acked(self, sent: Sent) -> bool:
        record = await self._record(sent)
        return record is not None and record[0] == "done"

    async def dead_lettered(self, sent: Sent, reason: str) -> bool:
        return await self._record(sent) == ("parked", reason)

    async def retry_as_told(self, sent: Sent) -> None:
        async def deferred() -> bool:
            pending = (await self.schedule.status()).pending
            return any(p.tick == sent.detail and p.not_before is not None and p.not_before > self.clock.time
                       for p in pending)

        await wait_until(deferred, what="the failed tick to be put off")
        self.clock.advance(timedelta(seconds=RETRY_LATER_SECONDS + 1))
