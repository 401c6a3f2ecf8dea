"""The RabbitMQ settlement policy: how the pipeline's :class:`~consumer_kit.delivery.Result` becomes
AMQP actions (:class:`SettlementPolicy`, the table in the package docstring), and the order they reach
the broker in (:class:`Settlements`: one sender a channel, acks coalesced).

A copy (to the retry or the dead-letter queue) is confirmed by the broker before the original is
acked, so a crash in between delivers the message twice, never zero times; the inbox absorbs the
repeat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from consumer_kit.delivery import Result, Settlement
from consumer_kit.sources.rabbitmq.message import ATTEMPT_HEADER, REASON_HEADER, SOURCE_QUEUE_HEADER, Received

log = logging.getLogger("consumer_kit.sources.rabbitmq")

Republish = Callable[[Received, str, Mapping[str, Any]], Awaitable[None]]
"""Publishes a confirmed copy of a message to a queue, with extra headers (the source's channel)."""


@dataclass(frozen=True, slots=True)
class SettlementPolicy:
    """What each settlement of a delivery from ``queue`` does: ``dead_letter_queue`` takes a copy of a
    parked message (``None``: it is rejected without requeue, for the queue's own dead-letter exchange);
    a retry goes through the retry queue of the smallest of ``retry_delays`` that covers both the
    pipeline's delay and the attempt's backoff step (none: it is requeued after a short pause)."""

    queue: str
    dead_letter_queue: str | None
    retry_delays: tuple[float, ...]

    def retry_queue(self, delay: float) -> str:
        """The name of the retry queue for ``delay`` seconds."""
        return f"{self.queue}.retry.{round(delay * 1000)}ms"

    def retry_delay(self, attempt: int, wanted: float | None) -> float:
        """The configured delay for this retry: at least the pipeline's and at least this attempt's step."""
        step = self.retry_delays[min(attempt - 1, len(self.retry_delays) - 1)]
        floor = max(step, wanted or 0.0)
        return next((d for d in self.retry_delays if d >= floor), self.retry_delays[-1])

    async def settle(self, message: Received, attempt: int, result: Result, settlements: Settlements,
                     republish: Republish) -> None:
        """Carry out ``result`` for ``message`` (delivered for the ``attempt``-th time)."""
        if result.settlement is Settlement.ACK:
            settlements.ack(message)
        elif result.settlement is Settlement.DEAD_LETTER:
            if self.dead_letter_queue is None:
                settlements.reject(message, requeue=False)
                return
            headers = {REASON_HEADER: result.reason or "dead_letter", SOURCE_QUEUE_HEADER: self.queue}
            await republish(message, self.dead_letter_queue, headers)
            settlements.ack(message)
        elif not self.retry_delays:
            # No retry queue: give the broker the message back after a short pause, so that a key
            # in progress elsewhere is not spun on at network speed.
            await asyncio.sleep(min(result.delay or 0.0, 1.0))
            settlements.nack(message, requeue=True)
        else:
            delay = self.retry_delay(attempt, result.delay)
            await republish(message, self.retry_queue(delay), {ATTEMPT_HEADER: attempt + 1})
            settlements.ack(message)


class Settlements:
    """Every settlement of a channel's deliveries (ack, nack, reject), sent in order by one task per
    channel, with acks that are ready together coalesced into one ``basic.ack(multiple=True)``.

    Why one sender: aiormq queues outgoing frames in a bounded queue, and a frame whose ``put`` waits
    for room can be overtaken by a later one. A multiple ack that overtook a single ack, a nack or a
    reject of a lower delivery tag would settle that delivery itself (a nack meant to requeue becomes
    an ack: the message is lost) and the late frame would then close the channel with
    PRECONDITION_FAILED "unknown delivery tag". Sent one at a time, frames cannot overtake each other,
    and what becomes ready while one is on its way is coalesced into the next.

    A multiple ack covers only the longest run of the channel's oldest unsettled deliveries that are
    all ready to be acked; any other settlement is sent on its own, never waiting behind a slow
    neighbour. A delivery that was never settled (cancelled: the broker takes it back when the channel
    closes) stays in the run's way, so a multiple ack never covers it."""

    def __init__(self) -> None:
        # Per channel (aiormq's, by identity): the deliveries not yet settled, in the order the broker
        # sent them (delivery tags ascending); the settlements asked for and not yet sent; the sender.
        self._unsettled: dict[object, dict[int, Received]] = {}
        self._asked: dict[object, dict[int, _Settlement]] = {}
        self._senders: dict[object, asyncio.Task[None]] = {}

    def received(self, message: Received) -> None:
        """A delivery arrived: it is unsettled until it is acked, rejected or nacked."""
        tag, channel = message.delivery_tag, _channel(message)
        if tag is None or channel is None:
            return
        if channel not in self._unsettled:  # a new channel (a reconnect): forget the closed ones
            for old in [c for c in self._unsettled if getattr(c, "is_closed", True)]:
                del self._unsettled[old]
                self._asked.pop(old, None)
        self._unsettled.setdefault(channel, {})[tag] = message

    def ack(self, message: Received) -> None:
        """Ask for ``message`` to be acked; it is sent in order, by the channel's sender."""
        self._ask(message, "ack", requeue=False)

    def nack(self, message: Received, *, requeue: bool) -> None:
        """Ask for ``message`` to be nacked (``requeue``: given back to the queue)."""
        self._ask(message, "nack", requeue=requeue)

    def reject(self, message: Received, *, requeue: bool) -> None:
        """Ask for ``message`` to be rejected (``requeue``: given back to the queue)."""
        self._ask(message, "reject", requeue=requeue)

    async def drained(self) -> None:
        """Wait until every settlement asked for has been sent (cancelling the wait stops no sender)."""
        senders = [s for s in self._senders.values() if not s.done()]
        if senders:
            await asyncio.wait(senders)

    def _ask(self, message: Received, action: str, *, requeue: bool) -> None:
        # Nobody waits for the frame to go out: it is sent in its order by the channel's sender, and
        # one that never reaches the broker (the channel closed) only means a redelivery, which the
        # inbox acknowledges as a duplicate. Waiting would cost every delivery a future and another
        # trip through the event loop, for an error it could do nothing about.
        tag, channel = message.delivery_tag, _channel(message)
        if tag is None or channel is None or tag not in self._unsettled.get(channel, {}):
            # Not one of this channel's unsettled deliveries: its channel closed (the broker takes the
            # delivery back), or it was settled already.
            log.warning("%s of delivery %s not sent: its channel closed or it was settled already; the broker "
                        "redelivers what was not settled", action, tag)
            return
        self._asked.setdefault(channel, {})[tag] = _Settlement(message, action, requeue)
        sender = self._senders.get(channel)
        if sender is None or sender.done():
            self._senders[channel] = asyncio.ensure_future(self._send(channel))

    async def _send(self, channel: object) -> None:
        unsettled = self._unsettled.get(channel, {})
        try:
            while asked := self._asked.pop(channel, {}):
                run: list[int] = []
                for tag in unsettled:  # oldest first
                    if tag not in asked or asked[tag].action != "ack":
                        break
                    run.append(tag)
                if len(run) > 1:
                    last = asked[run[-1]]
                    for tag in run:
                        del asked[tag], unsettled[tag]
                    await last.send(multiple=len(run))
                for tag in sorted(asked):
                    unsettled.pop(tag, None)
                    await asked[tag].send()
        finally:
            self._senders.pop(channel, None)


class _Settlement:
    __slots__ = ("action", "message", "requeue")

    def __init__(self, message: Received, action: str, requeue: bool) -> None:
        self.message, self.action, self.requeue = message, action, requeue

    async def send(self, *, multiple: int = 0) -> None:
        """Send it (``multiple``: an ack of that many deliveries, this one the newest)."""
        try:
            # aiormq's channel (aio-pika's public ``message.channel``), with ``wait=False``: the frame
            # is queued in order and the next one follows at once, instead of each waiting until the
            # socket drained. Nothing is lost by it: an ack that never reaches the broker redelivers
            # the message, and the inbox acknowledges the repeat.
            channel, tag = self.message.channel, self.message.delivery_tag
            assert tag is not None
            if self.action == "ack":
                await channel.basic_ack(delivery_tag=tag, multiple=multiple > 1, wait=False)
            elif self.action == "nack":
                await channel.basic_nack(delivery_tag=tag, requeue=self.requeue, wait=False)
            else:
                await channel.basic_reject(delivery_tag=tag, requeue=self.requeue, wait=False)
        except Exception as exc:
            # Usually the connection dropped after the commit: the redeliveries are acked as duplicates.
            log.warning("%s of %d deliveries not sent to the broker (%s); it will redeliver them",
                        self.action, max(multiple, 1), type(exc).__name__)


def _channel(message: Received) -> object | None:
    """The open channel ``message`` came on, or None when it closed (nothing can be settled on it)."""
    try:
        channel = message.channel
    except Exception:  # an aio-pika message (the tests settle those too) raises for a closed channel
        return None
    return None if channel.is_closed else channel

