"""The shape of a source that pulls from its broker (NATS JetStream pull consumers, Redis Streams
consumer groups): one poller that asks for as many messages as there are free in-flight slots, one task
per delivery (or the batch path), the settlement after the pipeline decided, a heartbeat that keeps a
held message from being handed to another consumer while its handler runs, and a bounded close.

A transport's source subclasses :class:`PullingSource` and supplies what only it knows:

================  ======================================================================================
``_open``         connect, check or declare what it consumes
``_pull(n)``      up to ``n`` messages, waiting about a second at most when there are none; raises when
                  the broker cannot be reached (the poller backs off and says so on ``/readyz``)
``_read(m)``      the :class:`~consumer_kit.delivery.Delivery` of a message (a malformed one becomes a
                  delivery the pipeline parks; an exception here dead-letters it as ``unreadable``)
``_settle``       carry out the pipeline's :class:`~consumer_kit.delivery.Result` on the broker
``_extend(ms)``   tell the broker these messages are still being worked on
``_give_back(m)`` a message pulled but not run (the source is stopping): redelivered soon
``_shut``         close the connection
================  ======================================================================================

Nothing here acknowledges anything on its own: a message is settled only by ``_settle``, after the
pipeline's commit, and one whose settlement is lost (a connection cut, a crash) is redelivered by the
broker, where the inbox acknowledges it as a duplicate.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from consumer_kit.delivery import Decided, Delivery, Dispatch, DispatchSoon, KeyMapper, Outcome, Result, Settlement
from consumer_kit.errors import ConfigurationError
from consumer_kit.keys import KeyDigester
from consumer_kit.settings import Settings
from consumer_kit.sources.envelopes import EnvelopedSource, KeyFunction

log = logging.getLogger("consumer_kit.sources")

M = TypeVar("M")

UNREADABLE = "unreadable"
"""The reason on the dead-letter copy of a message the source could not turn into a delivery."""
SETTLE_TIMEOUT_SECONDS = 10.0  # how long close() waits for deliveries and settlements under way
_BACKOFF_MAX_SECONDS = 30.0


def retry_delay(retry_delays: Sequence[float], attempt: int, wanted: float | None) -> float:
    """How long a retry waits: the larger of the pipeline's ``wanted`` delay and this attempt's step of
    ``retry_delays`` (the last step for every attempt past them; none: the pipeline's delay)."""
    step = retry_delays[min(max(attempt, 1), len(retry_delays)) - 1] if retry_delays else 0.0
    return max(step, wanted or 0.0)


@dataclass(eq=False, slots=True)
class Held(Generic[M]):
    """A message the source pulled and has not settled yet."""

    message: M
    beaten: float  # monotonic time of the pull or the last heartbeat
    settling: bool = False  # decided: the heartbeat leaves it alone


class PullingSource(EnvelopedSource, Generic[M], abc.ABC):
    """A source that pulls (see the module docstring); ``max_in_flight`` bounds the messages held at
    once, and so what the poller asks for."""

    name: str

    def __init__(self, *, namespace: str, version: int, key: str | KeyFunction | None, key_mapper: KeyMapper | None,
                 max_in_flight: int) -> None:
        super().__init__(namespace=namespace, version=version, key=key, key_mapper=key_mapper)
        if max_in_flight < 1:
            raise ConfigurationError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self._dispatch: Dispatch | None = None
        self._soon: Callable[[Delivery, Decided], bool] | None = None
        self._replays: KeyDigester | None = None  # verifies the replay header of a parked message put back
        self._held: set[Held[M]] = set()
        self._room = asyncio.Event()  # set when a slot frees
        self._tasks: set[asyncio.Task[Any]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._beater: asyncio.Task[None] | None = None
        self._stopping = True
        self._failing: str | None = None  # why the last pull failed, while pulls keep failing
        self._keys = OneAtATime()

    # ---------------------------------------------------------------------------------------------
    # what a transport supplies

    @abc.abstractmethod
    async def _open(self, settings: Settings) -> None: ...

    @abc.abstractmethod
    async def _pull(self, count: int) -> Sequence[M]: ...

    @abc.abstractmethod
    def _read(self, message: M) -> Delivery: ...

    @abc.abstractmethod
    async def _settle(self, message: M, delivery: Delivery, result: Result) -> None: ...

    @abc.abstractmethod
    async def _extend(self, messages: list[M]) -> None: ...

    @abc.abstractmethod
    async def _give_back(self, message: M) -> None: ...

    @abc.abstractmethod
    async def _shut(self) -> None: ...

    def _heartbeat_seconds(self) -> float | None:
        """How long a held message may go without a heartbeat (``None``: it needs none)."""
        return None

    # ---------------------------------------------------------------------------------------------
    # start and stop

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        """Connect (and declare or check what it consumes), then begin pulling."""
        self._replays = settings.digester()
        await self._open(settings)
        self._dispatch = dispatch
        self._soon = dispatch.soon if isinstance(dispatch, DispatchSoon) else None
        self._stopping = False
        self._poller = asyncio.create_task(self._poll(), name=f"{self.name}-poller")
        every = self._heartbeat_seconds()
        if every is not None:
            self._beater = asyncio.create_task(self._beat(every), name=f"{self.name}-heartbeat")

    async def stop(self) -> None:
        """Stop pulling (a pull under way ends within about a second, and gives back what it brought);
        deliveries already dispatched go on."""
        self._stopping = True
        self._room.set()

    async def close(self) -> None:
        """Wait (bounded) for the poller, the deliveries and their settlements, then close the connection;
        whatever is still unsettled the broker hands out again."""
        await self.stop()
        deadline = time.monotonic() + SETTLE_TIMEOUT_SECONDS
        if self._poller is not None:
            _, pending = await asyncio.wait([self._poller], timeout=SETTLE_TIMEOUT_SECONDS)
            for task in pending:
                task.cancel()
            self._poller = None
        while self._tasks and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)
        if self._beater is not None:
            self._beater.cancel()
            await asyncio.gather(self._beater, return_exceptions=True)
            self._beater = None
        await self._shut()
        self._dispatch = self._soon = None

    def unready_reason(self) -> str | None:
        """``broker_unreachable`` while pulls keep failing (``/readyz``); a transport adds its own."""
        return "broker_unreachable" if self._failing is not None else None

    @property
    def held(self) -> int:
        """Messages pulled and not settled yet."""
        return len(self._held)

    # ---------------------------------------------------------------------------------------------
    # pulling

    async def _poll(self) -> None:
        failures = 0
        while not self._stopping:
            free = self.max_in_flight - len(self._held)
            if free <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                messages = await self._pull(free)
            except Exception as exc:
                failures += 1
                self._failing = type(exc).__name__
                delay = random.uniform(0.5, 1.0) * min(_BACKOFF_MAX_SECONDS, 0.25 * 2 ** min(failures, 8))
                if failures == 1 or failures % 10 == 0:
                    log.warning("%s: pulling failed %d time(s) in a row (%s); trying again in %.1f s", self.name,
                                failures, self._failing, delay)
                await asyncio.sleep(delay)
                continue
            if failures:
                log.info("%s: pulling again after %d failure(s)", self.name, failures)
                failures, self._failing = 0, None
            for message in messages:
                self._accept(message)

    def _accept(self, message: M) -> None:
        held = Held(message, time.monotonic())
        self._held.add(held)
        if self._stopping:
            self._track(self._given_back(held))
            return
        delivery: Delivery | None = None
        if self._soon is not None:
            with contextlib.suppress(Exception):  # the task below meets the same error and says what it was
                delivery = self._read(message)
            if delivery is not None and self._soon(delivery, functools.partial(self._decided, held, delivery)):
                return  # a batched handler's: its batch runs in a task of its own, and tells _decided
        self._track(self._deliver(held, delivery))

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _decided(self, held: Held[M], delivery: Delivery, result: Result | None) -> None:
        if result is None:  # nothing decided (the app is stopping): back to the broker, unprocessed
            self._track(self._given_back(held))
        else:
            self._track(self._settled(held, delivery, result))

    async def _deliver(self, held: Held[M], delivery: Delivery | None) -> None:
        assert self._dispatch is not None
        if delivery is None:
            try:
                delivery = self._read(held.message)
            except Exception as exc:
                # Reading failed where it never should (every malformed field we know of becomes a
                # delivery the pipeline parks): left unsettled, it would come back and fail for ever.
                log.warning("%s: a message could not be read (%s); dead-lettered as unreadable", self.name,
                            type(exc).__name__)
                unread = Delivery(id=None, body=b"", attempt=1)
                await self._settled(held, unread, Result(Outcome.INVALID, Settlement.DEAD_LETTER, UNREADABLE))
                return
        try:
            result = await self._keys.run(self._key_text(delivery), functools.partial(self._dispatch, delivery))
        except asyncio.CancelledError:
            # Stopped past its grace: the pipeline rolled back and gave the lease up; the broker may
            # hand the message out again at once rather than after its ack deadline.
            self._track(self._given_back(held))
            raise
        await self._settled(held, delivery, result)

    def _key_text(self, delivery: Delivery) -> str | None:
        try:
            return str(self.key(delivery))
        except Exception:
            return None  # it cannot be keyed: the pipeline parks it

    async def _settled(self, held: Held[M], delivery: Delivery, result: Result) -> None:
        held.settling = True
        try:
            await self._settle(held.message, delivery, result)
        except Exception as exc:
            # Usually the connection dropped after the commit: the broker hands the message out
            # again, and the inbox acknowledges the repeat as a duplicate.
            log.warning("%s: settlement (%s) not carried out (%s); the broker will deliver the message again",
                        self.name, result.settlement, type(exc).__name__)
        finally:
            self._forget(held)

    async def _given_back(self, held: Held[M]) -> None:
        held.settling = True
        try:
            await self._give_back(held.message)
        except Exception as exc:
            log.info("%s: a message not run could not be given back (%s); the broker hands it out again after "
                     "its deadline", self.name, type(exc).__name__)
        finally:
            self._forget(held)

    def _forget(self, held: Held[M]) -> None:
        self._held.discard(held)
        self._room.set()

    # ---------------------------------------------------------------------------------------------
    # heartbeat

    async def _beat(self, every: float) -> None:
        """Every half interval, tell the broker about the held messages whose last heartbeat is an
        interval old: a message never reaches its deadline while its handler runs."""
        while True:
            await asyncio.sleep(every / 2)
            now = time.monotonic()
            due = [held for held in self._held if not held.settling and now - held.beaten >= every]
            if not due:
                continue
            try:
                await self._extend([held.message for held in due])
            except Exception as exc:
                log.warning("%s: the heartbeat of %d held message(s) failed (%s); the broker may hand them out "
                            "again, and the inbox's lease fences a second run", self.name, len(due),
                            type(exc).__name__)
                continue
            for held in due:
                held.beaten = now


class OneAtATime:
    """Runs the deliveries of one key one after another: a re-sent copy pulled in the same batch as its
    original then meets a completed inbox row (acknowledged as a duplicate) instead of a live lease
    (sent back to the broker until the lease runs out)."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Future[None]] = {}

    async def run(self, key: str | None, call: Callable[[], Awaitable[Result]]) -> Result:
        """``call()``, after any call of the same ``key`` under way has finished (``None``: at once)."""
        if key is None:
            return await call()
        while (running := self._running.get(key)) is not None:
            await asyncio.wait([running])
        self._running[key] = done = asyncio.get_running_loop().create_future()
        try:
            return await call()
        finally:
            del self._running[key]
            done.set_result(None)
