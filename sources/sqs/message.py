"""The SQS message reader: a received message (:class:`~consumer_kit.sources.sqs.held.HeldMessage`)
becomes its deliveries (:func:`to_deliveries`: one, or one per record of an S3 event), and a parked
delivery put back on the queue becomes a new message (:func:`replay_message`).

The attempt number is SQS's ``ApproximateReceiveCount``; ``sent_at`` its ``SentTimestamp``. The stable
id depends on the envelope (see :mod:`consumer_kit.sources.envelopes`); a requeued parked message is
the delivery its signed replay attribute carries (see :mod:`consumer_kit.replay`).
"""

from __future__ import annotations

import base64
import binascii
import secrets
from datetime import UTC, datetime
from typing import Any

from consumer_kit.delivery import Delivery, RefusedReplay, Replayed
from consumer_kit.keys import KeyDigester
from consumer_kit.replay import REPLAY_HEADER, unseal
from consumer_kit.sources.envelopes import unwrap
from consumer_kit.sources.sqs.held import MAX_ATTRIBUTES, HeldMessage
from consumer_kit.sources.sqs.settlement import KEY_DIGEST_ATTRIBUTE, REASON_ATTRIBUTE, SOURCE_QUEUE_ATTRIBUTE

REPLAY_BODY_ATTRIBUTE = "x-consumer-kit-replay-body"
"""``base64`` on a requeued parked delivery whose body is not UTF-8 text (an SQS body must be text)."""
_NOT_ATTRIBUTES = ("sqs-message-id", "sqs-message-group-id", REASON_ATTRIBUTE, KEY_DIGEST_ATTRIBUTE,
                   SOURCE_QUEUE_ATTRIBUTE, REPLAY_HEADER, REPLAY_BODY_ATTRIBUTE)


def to_deliveries(message: HeldMessage, envelope: str, replays: KeyDigester | None) -> list[Delivery]:
    """The deliveries in ``message`` as ``envelope`` wraps them; a requeued parked message's replay
    attribute is verified with ``replays`` (``None``: not read)."""
    system = message.raw.get("Attributes", {})
    attempt = int(system.get("ApproximateReceiveCount", 1))
    sent = system.get("SentTimestamp")  # milliseconds since the epoch, by SQS's clock
    sent_at = datetime.fromtimestamp(int(sent) / 1000, UTC) if sent and str(sent).isdigit() else None
    headers, body = message.headers(), message.raw["Body"].encode("utf-8")
    if replays is not None and REPLAY_HEADER in headers:
        return [_replayed(headers, body, attempt, sent_at, replays)]
    return unwrap(envelope, message_id=message.id, body=body, headers=headers, attempt=attempt, sent_at=sent_at)


def _replayed(headers: dict[str, str], body: bytes, attempt: int, sent_at: datetime | None,
              replays: KeyDigester) -> Replayed | RefusedReplay:
    if headers.get(REPLAY_BODY_ATTRIBUTE) == "base64":
        try:
            body = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            return RefusedReplay(id=None, body=body, attempt=attempt, sent_at=sent_at,
                                 why="the replayed body is not base64")
    return unseal(headers[REPLAY_HEADER], body, replays, attempt=attempt, sent_at=sent_at)


def replay_message(delivery: Replayed, sealed: str, *, queue_url: str, fifo: bool) -> dict[str, Any]:
    """SendMessage parameters that put a parked delivery back on its queue as a new message (SQS mints
    its ``MessageId``): the replay attribute carries the delivery ``sealed``, so it keys as before; its
    original attributes go along as far as SQS allows (ten in all). On a FIFO queue it joins its
    original message group."""
    attributes = {REPLAY_HEADER: sealed}
    try:
        body = delivery.body.decode("utf-8")
    except UnicodeDecodeError:
        body = base64.b64encode(delivery.body).decode("ascii")
        attributes[REPLAY_BODY_ATTRIBUTE] = "base64"
    for name, value in delivery.headers.items():
        if len(attributes) < MAX_ATTRIBUTES and name not in _NOT_ATTRIBUTES and value:
            attributes[name] = value
    params: dict[str, Any] = dict(QueueUrl=queue_url, MessageBody=body, MessageAttributes={
        name: {"DataType": "String", "StringValue": value} for name, value in attributes.items()})
    if fifo:
        params["MessageGroupId"] = delivery.headers.get("sqs-message-group-id") or "consumer-kit-replay"
        params["MessageDeduplicationId"] = secrets.token_hex(16)  # each replay is a send of its own
    return params
