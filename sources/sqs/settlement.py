"""The SQS settlement policy: how the pipeline's :class:`~consumer_kit.delivery.Result` of each delivery
in a message becomes one action on the message (:class:`SettlementPolicy`, the table in the package
docstring), and the copy a parked message leaves in the dead-letter queue (:func:`dead_letter_copy`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from consumer_kit.delivery import Delivery, Result, Settlement
from consumer_kit.sources.pulling import retry_delay
from consumer_kit.sources.sqs.client import log
from consumer_kit.sources.sqs.held import MAX_ATTRIBUTES, HeldMessage

REASON_ATTRIBUTE = "x-consumer-kit-reason"
KEY_DIGEST_ATTRIBUTE = "x-consumer-kit-key-digest"
SOURCE_QUEUE_ATTRIBUTE = "x-consumer-kit-queue"


class Act(enum.Enum):
    """What becomes of a message once every delivery in it is decided."""

    RETRY = "retry"  # visible again after the action's delay
    REDRIVE = "redrive"  # visible again at once, for the queue's redrive policy to move
    DELETE = "delete"  # deleted, after a copy to the dead-letter queue when the action has one


@dataclass(frozen=True, slots=True)
class Action:
    """One message's settlement: ``delay`` for RETRY; ``dead_letter`` (the parked result) for DELETE."""

    act: Act
    delay: float = 0.0
    dead_letter: Result | None = None


@dataclass(frozen=True, slots=True)
class SettlementPolicy:
    """A retry waits the larger of the pipeline's delay and this attempt's step of ``retry_delays``; a
    parked message is copied to ``dead_letter_queue_url`` and deleted, or without one left visible for
    the queue's redrive policy. A message of several deliveries (an S3 event's records) is deleted only
    when none of them is to be retried."""

    retry_delays: tuple[float, ...]
    dead_letter_queue_url: str | None

    def retry_delay(self, attempt: int, wanted: float) -> float:
        """The visibility delay of a retry: at least the pipeline's and at least this attempt's step."""
        return retry_delay(self.retry_delays, attempt, wanted)

    def action(self, deliveries: Sequence[Delivery], results: Sequence[Result]) -> Action:
        """The one action on a message whose ``deliveries`` the pipeline decided as ``results``."""
        retry = [r for r in results if r.settlement is Settlement.RETRY_LATER]
        dead = [r for r in results if r.settlement is Settlement.DEAD_LETTER]
        if retry:
            attempt = max((d.attempt for d in deliveries), default=1)
            return Action(Act.RETRY, delay=self.retry_delay(attempt, max(r.delay or 0.0 for r in retry)))
        if self.dead_letter_queue_url is None and (dead or any(r.reason == "already_dead_lettered" for r in results)):
            return Action(Act.REDRIVE)
        return Action(Act.DELETE, dead_letter=dead[0] if dead else None)


def dead_letter_copy(message: HeldMessage, result: Result, *, queue_url: str, dead_letter_queue_url: str,
                     fifo: bool, source: str) -> dict[str, Any]:
    """SendMessage parameters for the copy of a parked message: its body as received, the reason, the
    key digest (never the key) and the queue as attributes, then as many of its own as SQS allows."""
    ours = {REASON_ATTRIBUTE: result.reason or "dead_letter", SOURCE_QUEUE_ATTRIBUTE: queue_url}
    if result.key_digest:
        ours[KEY_DIGEST_ATTRIBUTE] = result.key_digest
    attributes = {name: {"DataType": "String", "StringValue": value} for name, value in ours.items()}
    originals = message.raw.get("MessageAttributes") or {}
    room = MAX_ATTRIBUTES - len(attributes)
    for name, value in list(originals.items())[:room]:
        attributes[name] = {k: v for k, v in value.items() if k in ("DataType", "StringValue", "BinaryValue")}
    if len(originals) > room:
        log.warning("%s: the dead-letter copy keeps %d of the message's %d attributes (SQS allows %d); the "
                    "parked record in the database has them all", source, room, len(originals), MAX_ATTRIBUTES)
    params: dict[str, Any] = dict(QueueUrl=dead_letter_queue_url, MessageBody=message.raw["Body"],
                                  MessageAttributes=attributes)
    if fifo:
        params["MessageGroupId"] = message.group or "consumer-kit"
        params["MessageDeduplicationId"] = message.id  # a repeated copy is dropped by SQS
    return params
