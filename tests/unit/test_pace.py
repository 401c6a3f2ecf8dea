"""A sweep's pace (``consumer_kit.store.pace``): a pause after each batch in proportion to its work, only
within the paced part of the sweep, and none at a share of 1."""

from __future__ import annotations

import asyncio

import pytest

from consumer_kit.store.pace import Pace


class Recorded:
    """``asyncio.sleep`` as a pace calls it, recorded (and slept, so that the loop's clock moves)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.pauses.append(seconds)
        await asyncio.sleep(seconds)


async def test_each_pause_is_in_proportion_to_the_batch_before_it() -> None:
    sleep = Recorded()
    pace = Pace(0.25, within=60, sleep=sleep)
    for work in (0.02, 0.04):
        await asyncio.sleep(work)  # a batch's work
        await pace.step()
    assert len(sleep.pauses) == 2
    for work, pause in zip((0.02, 0.04), sleep.pauses, strict=True):
        assert 3 * work <= pause < 3 * work + 0.05  # (1 / 0.25 - 1) times the batch, from its own start


async def test_past_its_paced_part_a_sweep_goes_on_at_full_speed() -> None:
    sleep = Recorded()
    pace = Pace(0.1, within=0.05, sleep=sleep)
    await asyncio.sleep(0.02)
    await pace.step()  # 9 x 0.02 s would pass the paced part: cut to what is left of it
    assert len(sleep.pauses) == 1 and sleep.pauses[0] <= 0.05
    await asyncio.sleep(0.02)
    await pace.step()
    assert len(sleep.pauses) == 1  # past it: no pause


async def test_a_share_of_one_never_pauses_and_a_share_out_of_range_is_refused() -> None:
    sleep = Recorded()
    pace = Pace(1.0, within=60, sleep=sleep)
    await asyncio.sleep(0.01)
    await pace.step()
    assert sleep.pauses == []
    for share in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="share of time"):
            Pace(share)
