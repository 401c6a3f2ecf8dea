"""How a sweep spreads its deletes over time (:class:`Pace`), so that they do not take the database's
cores in one burst while deliveries claim keys beside them.

A sweep deletes in batches, each its own short transaction. Back to back, a minute's expired rows at a
thousand keys a second go in about a second and a half of one core, and the claims made in that second
and a half are the minute's slowest. Paced, each batch is followed by a pause in proportion to how long
it took: at ``share=0.25`` the sweep works a quarter of the time. It pauses only until ``within``
seconds have passed since it began (half the sweep interval, from the worker); after that it goes on
at full speed, so that a paced sweep keeps up with whatever an unpaced one would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class Pace:
    """One sweep's pauses: ``await pace.step()`` after each batch pauses in proportion to the time since
    the last step (or since the pace was made), while within the paced part."""

    __slots__ = ("_last", "_loop", "_pause", "_sleep", "_until")

    def __init__(self, share: float = 1.0, within: float | None = None, *,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a sweep's share of time is in (0, 1], not {share}")
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._pause = 1 / share - 1  # the pause for each second of work
        self._until = self._last + within if within is not None and self._pause else None
        self._sleep = sleep

    async def step(self) -> None:
        """A batch is done: pause ``(1 / share - 1)`` times as long as it took, until ``within`` is up."""
        now = self._loop.time()
        if self._until is not None and now < self._until:
            await self._sleep(min((now - self._last) * self._pause, self._until - now))
        self._last = self._loop.time()
