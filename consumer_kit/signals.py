"""SIGTERM and SIGINT for the long-running commands (``consumer-kit run``, ``consumer-kit coordinator
serve``), from the command's first moment to its exit.

A supervisor may stop a service at any moment, also while it is still starting (importing the app,
opening the database, connecting to a broker, a source's start waiting for its broker). Whenever the
signal comes, the command exits 0 and leaves nothing half-open:

1. before anything is opened (imports, loading the app), the handler raises :class:`StopRequested`,
   as Python's own SIGINT handler raises ``KeyboardInterrupt``: the command returns at once;
2. while starting, the start-up is cancelled (:func:`unless_stopped`) and what it opened is closed;
3. while serving, the service stops gracefully (stop intake, drain, close).

Python's default SIGTERM action kills the process outright, and uvicorn's handlers only exist while
its server runs; hence handlers of our own from the first statement of the command.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    pass

T = TypeVar("T")
log = logging.getLogger("consumer_kit.signals")

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """A stop signal ended the command before it was serving; the command exits 0.

    A ``BaseException``, as ``KeyboardInterrupt`` is, so that ``except Exception`` in the code it
    interrupts (an app module being imported, say) does not swallow it."""


class StopSignals:
    """SIGTERM and SIGINT for one command: raised as :class:`StopRequested` until :meth:`defer`, then
    recorded, and inside the event loop delivered to the event :meth:`event` returns."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._raising = True

    def install(self) -> StopSignals:
        """Take SIGTERM and SIGINT (call it first thing in the command)."""
        for sig in HANDLED:
            signal.signal(sig, self._handle)
        return self

    def defer(self) -> None:
        """From now on a signal is only recorded (call it before opening anything)."""
        self._raising = False

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self._raising:
            self._raising = False  # a second signal must not interrupt the unwinding of the first
            raise StopRequested(signum)

    def event(self) -> asyncio.Event:
        """An event of the running loop, set by SIGTERM or SIGINT (at once if one came already)."""
        stop = stop_event()
        if self.received is not None:
            stop.set()
        return stop


def stop_event() -> asyncio.Event:
    """An event set when the process gets SIGTERM or SIGINT (handlers on the running loop). Outside the
    main thread, or where the loop takes no signal handlers (Windows), it is only set by its owner."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        for sig in HANDLED:
            loop.add_signal_handler(sig, stop.set)
    except (ValueError, RuntimeError, NotImplementedError):
        pass  # signals go to the main thread's loop; uvicorn, when it serves, takes them itself
    return stop


async def unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T:
    """Await ``work`` (a start-up) unless ``stop`` is set first: then cancel it, let it unwind, and
    raise :class:`StopRequested` (without starting it at all if ``stop`` is set already). What ``work``
    raises propagates; if both finish together, ``work`` wins (the caller then sees ``stop`` set and
    stops gracefully)."""
    if stop.is_set():
        work.close()
        raise StopRequested(0)
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        result = await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # we were cancelled ourselves, not only the start-up
        raise StopRequested(0) from None
    return result  # the start-up finished despite the cancellation


class Startable(Protocol):
    """What :func:`run_app` runs: a :class:`~consumer_kit.ConsumerApp`."""

    async def start(self) -> None: ...

    async def stop(self, grace: float | None = None) -> None: ...


async def run_app(app: Startable, stop: asyncio.Event,
                  serving: Callable[[], Awaitable[None]] | None = None) -> None:
    """Start ``app``, then run ``serving()`` (by default: wait for ``stop``), then drain and close the app.
    A stop during the start-up cancels it and closes what it had opened. A deployment error the app
    meets while serving (a missing table: ``app.failure``) stops it too, and is raised afterwards."""
    try:
        await unless_stopped(app.start(), stop)
    except StopRequested:
        await app.stop(grace=0)
        log.info("stop signal during start-up: stopped before serving")
        return
    watch = getattr(app, "stop_on_failure", None)
    if watch is not None:
        watch(stop)
    try:
        if serving is not None:
            await serving()
        else:
            await stop.wait()
            log.info("signal received: draining")
    finally:
        await app.stop()
    failure = getattr(app, "failure", None)
    if isinstance(failure, BaseException):
        raise failure
