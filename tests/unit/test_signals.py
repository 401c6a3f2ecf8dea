"""signals.unless_stopped: a start-up is cancelled by a stop, and only by a stop."""

from __future__ import annotations

import asyncio

import pytest

from consumer_kit.signals import StopRequested, unless_stopped


async def test_a_stop_cancels_the_start_up_and_lets_it_unwind() -> None:
    stop = asyncio.Event()
    unwound: list[str] = []

    async def start_up() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            unwound.append("closed what it opened")

    asyncio.get_running_loop().call_later(0.01, stop.set)
    with pytest.raises(StopRequested):
        await unless_stopped(start_up(), stop)
    assert unwound == ["closed what it opened"]


async def test_a_finished_start_up_returns_its_result_and_its_errors() -> None:
    stop = asyncio.Event()

    async def ready() -> str:
        return "started"

    async def broken() -> None:
        raise LookupError("no broker")

    assert await unless_stopped(ready(), stop) == "started"
    with pytest.raises(LookupError):
        await unless_stopped(broken(), stop)


async def test_a_stop_that_came_first_starts_nothing() -> None:
    stop = asyncio.Event()
    stop.set()
    ran: list[str] = []

    async def start_up() -> None:
        ran.append("ran")

    with pytest.raises(StopRequested):
        await unless_stopped(start_up(), stop)
    assert ran == []


async def test_cancelling_the_caller_cancels_the_start_up_too() -> None:
    stop = asyncio.Event()
    started = asyncio.Event()
    cancelled: list[str] = []

    async def start_up() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("cancelled")
            raise

    caller = asyncio.create_task(unless_stopped(start_up(), stop))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0)
    assert cancelled == ["cancelled"]
