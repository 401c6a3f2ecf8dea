"""A schedule's settlement policy: what the pipeline decided of a tick becomes the tick's row in the
store (``done``, ``parked``, or pending again after a delay).

========================  ==============================================================================
ACK                       ``done``; ``parked`` when the inbox says the tick was dead-lettered already
DEAD_LETTER               ``parked``, with the reason
RETRY_LATER               pending, not before the delay (``result.delay``, else ``RETRY_LATER_SECONDS``);
                          a tick held by another replica (``in_progress``) is left as it is in the store:
                          only this replica waits
========================  ==============================================================================
"""

from __future__ import annotations

from datetime import datetime, timedelta

from consumer_kit.delivery import Outcome, Result, Settlement
from consumer_kit.source_store import ScheduleId, ScheduleStore


def retry_at(result: Result, now: datetime, retry_later_seconds: float) -> datetime | None:
    """When a tick settled as ``result`` at ``now`` may run again; ``None`` unless it is to be retried."""
    if result.settlement is not Settlement.RETRY_LATER:
        return None
    delay = retry_later_seconds if result.delay is None else result.delay
    return now + timedelta(seconds=delay)


async def record(store: ScheduleStore, sid: ScheduleId, tick: datetime, result: Result, *, now: datetime,
                 retry: datetime | None) -> None:
    """Record in ``store`` how ``tick`` settled (``retry``: :func:`retry_at` of the result)."""
    async with store.database.connect() as ex:
        if result.settlement is Settlement.ACK:
            parked = result.reason == "already_dead_lettered"
            await store.settle(ex, sid, tick, state="parked" if parked else "done",
                               reason=result.reason if parked else None, now=now)
        elif result.settlement is Settlement.DEAD_LETTER:
            await store.settle(ex, sid, tick, state="parked", reason=result.reason, now=now)
        elif retry is not None and result.outcome is not Outcome.IN_PROGRESS:
            # it failed here: every replica waits the delay
            await store.defer(ex, sid, tick, not_before=retry, now=now)
