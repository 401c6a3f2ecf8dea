"""The two-transaction path's lease upkeep (:class:`~consumer_kit.pipeline.leased.Heartbeats`): one timer
for every delivery in flight, a renewal task only for those that outlast half an interval."""

from __future__ import annotations

import asyncio
from typing import Any

from consumer_kit.pipeline.leased import Heartbeats


async def test_renewals_start_within_one_interval_only_for_long_deliveries_and_stop_with_them() -> None:
    loop = asyncio.get_running_loop()
    interval = 0.2
    started: dict[str, float] = {}
    stopped: list[str] = []

    async def beat(work: Any) -> None:
        started[work.name] = loop.time()
        try:
            await asyncio.Event().wait()  # renews until the delivery ends
        except asyncio.CancelledError:
            stopped.append(work.name)
            raise

    class Delivery:
        def __init__(self, name: str) -> None:
            self.name = name

    heartbeats = Heartbeats(interval, beat)
    short, long_, later = Delivery("short"), Delivery("long"), Delivery("later")
    t0 = loop.time()
    heartbeats.add(short)  # type: ignore[arg-type]
    heartbeats.add(long_)  # type: ignore[arg-type]
    await asyncio.sleep(interval / 4)
    heartbeats.remove(short)  # type: ignore[arg-type]
    t1 = loop.time()
    heartbeats.add(later)  # type: ignore[arg-type]
    while "later" not in started:
        await asyncio.sleep(interval / 10)
        assert loop.time() - t0 < 10 * interval, "no renewal started"
    assert set(started) == {"long", "later"}
    # Never before half an interval, and (for the one added before the timer ran) by one interval;
    # the upper bound gets slack for a slow machine.
    assert interval / 2 <= started["long"] - t0 <= interval + 0.5
    assert interval / 2 <= started["later"] - t1 <= interval + 0.5
    heartbeats.remove(long_)  # type: ignore[arg-type]
    heartbeats.remove(later)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sorted(stopped) == ["later", "long"]
    # After an idle spell (no delivery in flight for a tick), a delivery added gets its renewal again.
    again = Delivery("again")
    heartbeats.add(again)  # type: ignore[arg-type]
    await asyncio.sleep(interval * 1.5)
    assert "again" in started
    heartbeats.remove(again)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert "again" in stopped
