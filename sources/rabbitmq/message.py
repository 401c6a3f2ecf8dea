"""The RabbitMQ message reader: an AMQP delivery as aiormq hands it over (:class:`Received`) becomes a
:class:`~consumer_kit.delivery.Delivery` (:func:`to_delivery`), and the copies the source publishes
(to a retry or dead-letter queue, or a parked delivery put back) carry what it reads back.

The key is the AMQP ``message_id`` only; the attempt number comes from the copy's
``x-consumer-kit-attempt`` header plus ``x-delivery-count`` (quorum queues) or the redelivered flag.
A requeued parked message is the delivery its signed ``x-consumer-kit-replay`` header carries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aio_pika
from aiormq.abc import DeliveredMessage

from consumer_kit.delivery import Delivery, Replayed
from consumer_kit.keys import KeyDigester
from consumer_kit.replay import REPLAY_HEADER, unseal

REASON_HEADER = "x-consumer-kit-reason"
ATTEMPT_HEADER = "x-consumer-kit-attempt"
SOURCE_QUEUE_HEADER = "x-consumer-kit-queue"
NO_ID_HEADER = "x-consumer-kit-no-message-id"
"""Set on a copy of a message that had no ``message_id``: aiormq gives every message it publishes a
random id, and a copy must never be keyed by that."""
UNREADABLE = "unreadable"
"""The reason on the dead-letter copy of a message the source could not turn into a delivery."""
BOOKKEEPING = (ATTEMPT_HEADER, REASON_HEADER, SOURCE_QUEUE_HEADER, NO_ID_HEADER, REPLAY_HEADER)
"""The headers the source writes on its copies: not the message's own, so a replayed copy drops them."""


class Received:
    """A delivery as aiormq hands it over, read the way aio-pika's ``IncomingMessage`` reads it (AMQP's
    ``type`` property is pamqp's ``message_type``), for the fields the source uses, and no more."""

    __slots__ = ("app_id", "body", "channel", "content_encoding", "content_type", "correlation_id",
                 "delivery_tag", "headers", "message_id", "priority", "redelivered", "timestamp", "type")

    def __init__(self, delivered: DeliveredMessage) -> None:
        self.body: bytes = delivered.body
        self.channel: Any = delivered.channel  # aiormq's
        self.delivery_tag: int | None = delivered.delivery_tag
        self.redelivered = bool(delivered.redelivered)
        properties = delivered.header.properties
        self.headers: dict[str, Any] = properties.headers or {}
        self.message_id: str | None = properties.message_id
        self.type: str | None = properties.message_type
        self.timestamp: datetime | None = properties.timestamp
        self.content_type: str | None = properties.content_type
        self.content_encoding: str | None = properties.content_encoding
        self.correlation_id: str | None = properties.correlation_id
        self.app_id: str | None = properties.app_id
        self.priority: int | None = properties.priority


def to_delivery(message: Received, replays: KeyDigester | None = None) -> Delivery:
    """The :class:`Delivery` of an AMQP message: id from ``message_id`` only, attempt from headers. A
    requeued parked message (its replay header verified with ``replays``) is the delivery it carries."""
    raw = dict(message.headers or {})
    raw.pop("x-death", None)  # the broker's dead-lettering history: bulky, and not the message's
    attempt = _int(raw.get(ATTEMPT_HEADER), 1)
    delivery_count = raw.get("x-delivery-count")
    if delivery_count is not None:
        attempt += _int(delivery_count, 0)
    elif message.redelivered:
        attempt += 1
    attributes = {"type": message.type} if message.type else {}
    message_id = None if raw.get(NO_ID_HEADER) else message.message_id
    sent_at = message.timestamp  # the publisher's own clock, when it set one
    if sent_at is not None and sent_at.tzinfo is None:
        sent_at = sent_at.replace(tzinfo=UTC)  # AMQP timestamps are seconds since the epoch: UTC
    if replays is not None and REPLAY_HEADER in raw:
        return unseal(_text(raw[REPLAY_HEADER]), message.body, replays, attempt=attempt, sent_at=sent_at)
    return Delivery(
        id=message_id, body=message.body,
        headers={k: _text(v) for k, v in raw.items()}, attributes=attributes, attempt=attempt, sent_at=sent_at,
    )


def _int(value: Any, default: int) -> int:
    if value is None:  # the usual case (no such header), and cheaper than a caught TypeError
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def copy_of(message: Received, extra: Mapping[str, Any]) -> aio_pika.Message:
    """A persistent copy of ``message`` for another queue (retry, dead letter): its body and properties,
    its headers without the broker's per-delivery bookkeeping, plus ``extra``."""
    dropped = ("x-death", "x-delivery-count")  # the broker's per-delivery bookkeeping
    headers = {k: v for k, v in (message.headers or {}).items() if k not in dropped}
    headers.update(extra)
    if not message.message_id:
        headers[NO_ID_HEADER] = 1
    return aio_pika.Message(
        body=message.body, headers=headers, message_id=message.message_id,
        content_type=message.content_type, content_encoding=message.content_encoding,
        correlation_id=message.correlation_id, type=message.type, app_id=message.app_id,
        timestamp=message.timestamp, priority=message.priority,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


def replay_copy(delivery: Replayed, sealed: str) -> aio_pika.Message:
    """A parked delivery put back on its queue: its headers (without our bookkeeping) and ``message_id``
    as they were, so it keys the same, and the delivery itself ``sealed`` in the replay header."""
    headers: dict[str, Any] = {k: v for k, v in delivery.headers.items() if k not in BOOKKEEPING}
    headers[REPLAY_HEADER] = sealed
    return aio_pika.Message(
        body=delivery.body, headers=headers, message_id=delivery.id, type=delivery.attributes.get("type"),
        content_type=delivery.headers.get("content-type"), timestamp=datetime.now(UTC),
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
