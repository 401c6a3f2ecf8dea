"""The NATS settlement policy: how the pipeline's :class:`~consumer_kit.delivery.Result` becomes
JetStream acknowledgements (the table in the package docstring).

A parked message's copy is acknowledged by the dead-letter stream (its ``PubAck``) before the original
is terminated, so a crash in between delivers it again, never zero times; the inbox absorbs the repeat.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.msg import Msg
from prometheus_client import Counter

from consumer_kit.delivery import Result, Settlement
from consumer_kit.sources.nats.message import dead_letter_headers
from consumer_kit.sources.pulling import retry_delay

ACK_SYNC_TIMEOUT_SECONDS = 5.0

SETTLEMENTS = Counter(
    "consumer_kit_nats_settlements_total",
    "JetStream acknowledgements the NATS source sent: ack (done, duplicate, or parked without a dead-letter "
    "subject), nak (a retry, after its delay), term (parked), dead_letter_copy (published and acknowledged by "
    "the dead-letter stream), in_progress (a heartbeat of a message still running).", ["source", "action"])
ACTIONS = ("ack", "nak", "term", "dead_letter_copy", "in_progress")

Copy = Callable[[str, bytes, dict[str, str]], Awaitable[None]]
"""Publishes a copy to a subject through JetStream and waits for its ``PubAck`` (the source's connection)."""


@dataclass(frozen=True, slots=True)
class SettlementPolicy:
    """What each settlement does for the source ``name``: a retry is ``nak`` with the larger of the
    pipeline's delay and the attempt's step of ``retry_delays``; a parked message is copied to
    ``dead_letter_subject`` (``None``: no copy) and terminated; ``double_ack`` waits for the server to
    confirm each ack (``ack_sync``) instead of sending it and going on."""

    name: str
    retry_delays: tuple[float, ...]
    dead_letter_subject: str | None
    double_ack: bool

    async def settle(self, message: Msg, attempt: int, result: Result, copy: Copy) -> None:
        """Carry out ``result`` for ``message`` (delivered for the ``attempt``-th time)."""
        if result.settlement is Settlement.ACK:
            if self.double_ack:
                await message.ack_sync(timeout=ACK_SYNC_TIMEOUT_SECONDS)
            else:
                await message.ack()
            SETTLEMENTS.labels(self.name, "ack").inc()
        elif result.settlement is Settlement.RETRY_LATER:
            await message.nak(delay=retry_delay(self.retry_delays, attempt, result.delay))
            SETTLEMENTS.labels(self.name, "nak").inc()
        else:
            if self.dead_letter_subject is not None:
                headers = dead_letter_headers(message, result.reason or "dead_letter", result.key_digest)
                await copy(self.dead_letter_subject, message.data, headers)
                SETTLEMENTS.labels(self.name, "dead_letter_copy").inc()
            await message.term()
            SETTLEMENTS.labels(self.name, "term").inc()
