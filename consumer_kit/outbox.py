"""The outbox's public side: the relay that publishes committed outbox rows, each with its row id as
the dedup id, the :class:`Publisher` seam it drives, and :class:`OutboxMessage`, the row a publisher
is handed (a source's publisher imports both from here, never from the store).

The relay knows no broker. It drives a :class:`Publisher`, a one-method seam that a source package
implements (``consumer_kit.sources.rabbitmq.AmqpPublisher`` publishes with publisher confirms); tests
and other transports bring their own.

::

    loop:  claim due rows (FOR UPDATE SKIP LOCKED on PostgreSQL)
           publish them concurrently, each awaiting the destination's confirmation
           mark the confirmed published, the rest failed with a growing per-row delay
           wait for NOTIFY (PostgreSQL), the poll interval, or a backoff after failures

A relay that dies between a confirm and its commit leaves the rows unpublished; they go out again with
the same id, which the consumer's inbox (or the destination's dedup) absorbs. Published rows are swept
after ``OUTBOX_RETENTION_SECONDS``.

A destination that cannot be reached is said at once and again at every try, with the delay before the
next: a publisher with an ``async check()`` (``AmqpPublisher``) is connected before the first round, and
every round whose publishes all failed logs why and when the relay tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, Protocol, runtime_checkable

from consumer_kit import metrics, tracing
from consumer_kit.errors import ConsumerKitError
from consumer_kit.settings import Settings
from consumer_kit.store.diagnosis import unavailable_because
from consumer_kit.store.outbox import Outbox, OutboxBatch, OutboxMessage, OutboxStats

__all__ = ["OutboxMessage", "OutboxRelay", "Publisher"]

log = logging.getLogger("consumer_kit.outbox")


@runtime_checkable
class Publisher(Protocol):
    """Sends outbox messages to their destination. A publisher may name its ``messaging_system``
    (``"rabbitmq"``): traced publishes carry it as ``messaging.system``."""

    async def publish(self, message: OutboxMessage) -> None:
        """Return once the destination has confirmed ``message`` (published with ``message.id`` as its
        dedup id); raise on any failure, which the relay retries later."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class OutboxRelay:
    """Moves outbox rows to a :class:`Publisher`; run several at once on PostgreSQL, one on SQLite."""

    def __init__(self, outbox: Outbox, publisher: Publisher, settings: Settings,
                 *, sweep_interval_seconds: float | None = None, tracer_provider: Any = None) -> None:
        self.outbox = outbox
        self.publisher = publisher
        self.settings = settings
        # Traced (see consumer_kit.tracing): each publish is a PRODUCER span, a child of the context
        # its row was written in. Untraced, rows go out with the headers they were written with, so
        # a consumer still continues the writer's trace.
        self._tracer = tracing.start(tracer_provider)
        self._system: str | None = getattr(publisher, "messaging_system", None)
        self.sweep_interval = sweep_interval_seconds or settings.sweep_interval_seconds
        self._wake = asyncio.Event()
        self.last_failure: str | None = None  # why the last round's publishes failed

    def wake(self) -> None:
        """Look for due rows now instead of at the next poll."""
        self._wake.set()

    async def run_once(self) -> tuple[int, int]:
        """One round: claim a batch, publish it, record the outcome. Returns ``(published, failed)``."""
        async with self.outbox.claim(self.settings.outbox_batch_size) as batch:
            if batch.messages:
                await self._publish(batch)
        if batch.published:
            metrics.OUTBOX_PUBLISHED.inc(len(batch.published))
        if batch.failed:
            metrics.OUTBOX_FAILURES.inc(len(batch.failed))
        return len(batch.published), len(batch.failed)

    async def drain(self) -> int:
        """Publish rounds until no row is due; returns how many were published (for tests and bursts)."""
        total = 0
        while True:
            published, failed = await self.run_once()
            total += published
            if published + failed < self.settings.outbox_batch_size or failed:
                return total

    async def _publish(self, batch: OutboxBatch) -> None:
        timeout = self.settings.outbox_publish_timeout_seconds

        async def one(message: OutboxMessage) -> None:
            span = None
            if self._tracer is not None:
                span, headers = self._tracer.send(message, self._system)
                message = dataclasses.replace(message, headers=headers)
            try:
                await asyncio.wait_for(self.publisher.publish(message), timeout)
            except Exception as exc:
                delay = min(self.settings.outbox_backoff_max_seconds,
                            self.settings.outbox_backoff_seconds * 2 ** message.attempts)
                batch.mark_failed(message.id, f"{type(exc).__name__}: {exc}", delay)
                if span is not None:
                    from consumer_kit.tracing.spans import record

                    record(span, exc, None)
            else:
                batch.mark_published(message.id)
            finally:
                if span is not None:
                    span.end()

        # Confirms are pipelined on one channel: publishing the batch concurrently costs one round trip.
        await asyncio.gather(*(one(m) for m in batch.messages))
        if batch.failed:
            error = next(iter(batch.failed.values()))[0]
            self.last_failure = f"{len(batch.failed)} of {len(batch.messages)} publishes failed ({error})"

    async def update_metrics(self) -> OutboxStats:
        """Refresh the pending-count and oldest-age gauges."""
        stats = await self.outbox.stats()
        metrics.OUTBOX_PENDING.set(stats.pending)
        metrics.OUTBOX_OLDEST_AGE.set(stats.oldest_age_seconds)
        return stats

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set: woken by NOTIFY on PostgreSQL, polling as a fallback."""
        async with contextlib.AsyncExitStack() as stack:
            try:
                listening = await stack.enter_async_context(self.outbox.listen(self.wake))
            except Exception as exc:
                listening = False
                log.warning("outbox: LISTEN failed (%s); polling only", type(exc).__name__)
            log.info("outbox relay running (%s)", "LISTEN/NOTIFY and polling" if listening else "polling")
            await self._reach(stop)
            await self._loop(stop)

    async def _reach(self, stop: asyncio.Event) -> None:
        """Connect the publisher before the first round (when it can: ``check()``), saying at once when
        it cannot, then trying again with a growing delay, each try logged, until it can or ``stop``."""
        check = getattr(self.publisher, "check", None)
        failures = 0
        while check is not None and not stop.is_set():
            try:
                await asyncio.wait_for(check(), self.settings.outbox_publish_timeout_seconds)
            except Exception as exc:
                failures += 1
                delay = self._backoff(failures)
                log.warning("outbox relay: cannot publish (%s); trying again in %.1f s", _said(exc), delay)
                await _first(stop, seconds=delay)
                continue
            if failures:
                log.info("outbox relay: the destination answers again after %d failed tries", failures)
            return

    def _backoff(self, failures: int) -> float:
        return float(min(self.settings.outbox_backoff_max_seconds,
                   self.settings.outbox_backoff_seconds * 2 ** (failures - 1)))

    async def _loop(self, stop: asyncio.Event) -> None:
        failures = 0
        next_sweep = time.monotonic() + self.sweep_interval
        next_stats = 0.0
        while not stop.is_set():
            self._wake.clear()
            published = failed = 0
            error: str | None = None
            try:
                published, failed = await self.run_once()
                failures = failures + 1 if failed and not published else 0
                error = self.last_failure if failed else None
            except Exception as exc:  # the database is unreachable: back off like a failed publish
                failures += 1
                error = f"the round failed: {_said(exc)}"
            now = time.monotonic()
            with contextlib.suppress(Exception):
                if now >= next_stats:
                    next_stats = now + self.settings.outbox_poll_seconds
                    await self.update_metrics()
                if now >= next_sweep:
                    next_sweep = now + self.sweep_interval
                    await self.outbox.sweep(self.settings.outbox_retention_seconds,
                                            batch_size=self.settings.sweep_batch_size)
            if published + failed >= self.settings.outbox_batch_size and not failed:
                continue  # a full batch: more rows are probably due
            delay = self._backoff(failures) if failures else self.settings.outbox_poll_seconds
            if error is not None:
                log.warning("outbox relay: %s; next round in %.1f s", error, delay)
            await _first(stop, self._wake, seconds=delay)


def _said(exc: BaseException) -> str:
    """An error as the relay logs it: ours (ConfigurationError) say it all; for others the type, and
    the message of those known not to quote a URL."""
    if isinstance(exc, ConsumerKitError):
        return str(exc)
    database = unavailable_because(exc)
    if database is not None:
        return f"the database: {database}"
    return type(exc).__name__


async def _first(*events: asyncio.Event, seconds: float) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
