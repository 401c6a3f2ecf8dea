"""The NATS message reader: a JetStream message as nats-py hands it over becomes a
:class:`~consumer_kit.delivery.Delivery` (:func:`to_delivery`), and the copies the source publishes
(to the dead-letter subject, or a parked delivery put back) carry what it reads back.

The stable id is chosen per source: the publisher's ``Nats-Msg-Id`` header (what JetStream itself
deduplicates within the stream's duplicate window), or ``<stream>:<stream sequence>`` (immutable for a
stored message: a redelivery keeps it, a message published again gets a new one). The attempt number is
JetStream's delivery count (``num_delivered``); the subject is a security-relevant attribute (a repeat
on another subject is another request, a conflict); the headers are the message's, plus ``nats-subject``,
``nats-stream`` and ``nats-sequence``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from nats.aio.msg import Msg

from consumer_kit.delivery import Delivery, Replayed
from consumer_kit.keys import KeyDigester
from consumer_kit.replay import REPLAY_HEADER, unseal

StableId = Literal["msg-id", "sequence"]
STABLE_IDS: tuple[str, ...] = ("msg-id", "sequence")

MSG_ID_HEADER = "Nats-Msg-Id"
REASON_HEADER = "x-consumer-kit-reason"
ORIGINAL_MSG_ID_HEADER = "x-consumer-kit-msg-id"
SOURCE_STREAM_HEADER = "x-consumer-kit-stream"
SOURCE_SEQUENCE_HEADER = "x-consumer-kit-sequence"
SOURCE_SUBJECT_HEADER = "x-consumer-kit-subject"
KEY_DIGEST_HEADER = "x-consumer-kit-key-digest"
_OURS = ("nats-subject", "nats-stream", "nats-sequence")
BOOKKEEPING = (REASON_HEADER, ORIGINAL_MSG_ID_HEADER, SOURCE_STREAM_HEADER, SOURCE_SEQUENCE_HEADER,
               SOURCE_SUBJECT_HEADER, KEY_DIGEST_HEADER, REPLAY_HEADER, *_OURS)
"""The headers the source writes or adds: not the message's own, so a copy drops them."""


def to_delivery(message: Msg, stable_id: StableId, replays: KeyDigester | None = None) -> Delivery:
    """The :class:`Delivery` of a JetStream message (see the module docstring). A parked delivery put
    back (its replay header verified with ``replays``) is the delivery it carries."""
    metadata = message.metadata
    raw: Mapping[str, Any] = message.headers or {}
    headers = {str(name): str(value) for name, value in raw.items()}
    attempt = max(1, metadata.num_delivered or 1)
    sent_at = metadata.timestamp  # when the stream stored it (the server's clock)
    if replays is not None and REPLAY_HEADER in headers:
        return unseal(headers[REPLAY_HEADER], message.data, replays, attempt=attempt, sent_at=sent_at)
    sequence = metadata.sequence.stream
    headers.update({"nats-subject": message.subject, "nats-stream": metadata.stream,
                    "nats-sequence": str(sequence)})
    delivery_id = (headers.get(MSG_ID_HEADER) or None) if stable_id == "msg-id" else f"{metadata.stream}:{sequence}"
    return Delivery(id=delivery_id, body=message.data, headers=headers, attributes={"subject": message.subject},
                    attempt=attempt, sent_at=sent_at)


def dead_letter_headers(message: Msg, reason: str, key_digest: str | None) -> dict[str, str]:
    """The headers of a parked message's copy: its own (its ``Nats-Msg-Id`` kept as
    ``x-consumer-kit-msg-id``), the reason, where it came from, the key's digest (never the key). The
    copy's own ``Nats-Msg-Id`` is ``<stream>:<sequence>``, so a copy published twice (a crash between the
    copy and the ``term``) is dropped by the dead-letter stream within its duplicate window."""
    metadata = message.metadata
    headers = {str(k): str(v) for k, v in (message.headers or {}).items() if k not in BOOKKEEPING}
    original = headers.pop(MSG_ID_HEADER, None)
    if original is not None:
        headers[ORIGINAL_MSG_ID_HEADER] = original
    headers.update({REASON_HEADER: reason, SOURCE_STREAM_HEADER: metadata.stream,
                    SOURCE_SEQUENCE_HEADER: str(metadata.sequence.stream), SOURCE_SUBJECT_HEADER: message.subject,
                    MSG_ID_HEADER: f"{metadata.stream}:{metadata.sequence.stream}"})
    if key_digest:
        headers[KEY_DIGEST_HEADER] = key_digest
    return headers


def replay_headers(delivery: Replayed, sealed: str) -> dict[str, str]:
    """A parked delivery put back on its subject: its headers as they were (without our bookkeeping,
    and without ``Nats-Msg-Id``, which the stream would drop as a repeat inside its duplicate window;
    the delivery keys as before from the sealed header)."""
    headers = {k: v for k, v in delivery.headers.items() if k not in BOOKKEEPING and k != MSG_ID_HEADER}
    headers[REPLAY_HEADER] = sealed
    return headers
