"""What an SQS source holds: the messages it received and has not settled, the in-flight slots that
bound them, and the SQS entries that settle them (what each settlement is: :mod:`.settlement`)."""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from consumer_kit.sources.sqs.client import MAX_VISIBILITY_SECONDS

MAX_ATTRIBUTES = 10  # SQS: message attributes per message
XRAY_HEADER = "x-amzn-trace-id"


@dataclass(eq=False)
class HeldMessage:
    """One received message while the source holds it."""

    id: str
    receipt: str  # the newest receipt handle
    raw: dict[str, Any]
    group: str | None
    sent_at: float  # epoch seconds, for SQS's 12-hour visibility limit
    extended: float  # monotonic time of the last receive or extension
    settling: bool = False  # decided: the heartbeat leaves it alone
    went_back: bool = False  # returned to the queue unprocessed: later ones of its FIFO group must too
    beat: asyncio.Future[Any] | None = None  # a heartbeat extension under way
    slot_freed: bool = False
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @classmethod
    def received(cls, raw: dict[str, Any]) -> HeldMessage:
        """A message as ReceiveMessage returned it."""
        attributes = raw.get("Attributes", {})
        return cls(id=raw["MessageId"], receipt=raw["ReceiptHandle"], raw=raw, group=attributes.get("MessageGroupId"),
                   sent_at=int(attributes.get("SentTimestamp", 0)) / 1000 or time.time(), extended=time.monotonic())

    def headers(self) -> dict[str, str]:
        """Its message attributes as headers (string and number values as sent, binary ones base64),
        with ``sqs-message-id``, on FIFO queues ``sqs-message-group-id``, and SQS's ``AWSTraceHeader``
        (when the sender set one) as ``x-amzn-trace-id``."""
        headers: dict[str, str] = {}
        for name, value in (self.raw.get("MessageAttributes") or {}).items():
            if "StringValue" in value:
                headers[name] = value["StringValue"]
            elif "BinaryValue" in value:
                headers[name] = base64.b64encode(value["BinaryValue"]).decode("ascii")
        headers["sqs-message-id"] = self.id
        if self.group is not None:
            headers["sqs-message-group-id"] = self.group
        xray = self.raw.get("Attributes", {}).get("AWSTraceHeader")
        if xray:  # under X-Ray's HTTP header name, where tracing looks for it (consumer_kit.tracing)
            headers[XRAY_HEADER] = xray
        return headers

    def visibility(self, seconds: float) -> Callable[[], dict[str, Any]]:
        """The ChangeMessageVisibilityBatch entry (made when sent, so with the newest receipt handle),
        ``seconds`` clamped to what SQS allows: 12 hours of visibility since the message was sent."""
        left = MAX_VISIBILITY_SECONDS - (time.time() - self.sent_at) - 5
        timeout = max(0, min(math.ceil(seconds), MAX_VISIBILITY_SECONDS, int(left)))
        return lambda: {"ReceiptHandle": self.receipt, "VisibilityTimeout": timeout}

    def deletion(self) -> dict[str, Any]:
        """The DeleteMessageBatch entry, with the newest receipt handle."""
        return {"ReceiptHandle": self.receipt}

    def beaten(self, at: float, beat: asyncio.Future[Any]) -> None:
        """A heartbeat extension sent at ``at`` has been answered."""
        self.beat = None
        if not beat.cancelled() and beat.exception() is None:
            self.extended = at


class Slots:
    """The free in-flight slots; pollers take some before each receive and never ask SQS for more."""

    def __init__(self, total: int) -> None:
        self.total = self.free = total
        self.closed = False
        self._changed = asyncio.Event()

    async def take(self, most: int) -> int:
        """``most`` slots (all of them, if there are fewer in all), waiting until they are free; 0 once
        closed. A receive for fewer messages costs SQS (and the bill) as much as one for ten."""
        need = min(most, self.total)
        while self.free < need and not self.closed:
            self._changed.clear()
            await self._changed.wait()
        if self.closed:
            return 0
        taken = min(most, self.free)
        self.free -= taken
        return taken

    def give(self, count: int) -> None:
        """Slots back (a settled message, or a receive that got fewer than it asked for)."""
        self.free += count
        self._changed.set()

    def close(self) -> None:
        """Wake every waiting poller with nothing: the source stops."""
        self.closed = True
        self._changed.set()
