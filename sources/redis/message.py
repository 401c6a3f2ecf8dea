"""The Redis Streams message reader: a stream entry (:class:`Entry`: its id, its fields, how many
times the group delivered it) becomes a :class:`~consumer_kit.delivery.Delivery` (:func:`to_delivery`),
and the copies the source writes (to the dead-letter stream, or a parked delivery put back) carry what
it reads back.

The stable id is ``<stream>:<entry id>``: an entry keeps its id for as long as it is pending, and the
group hands out the same id again after a crash. The body is the ``body_field`` field; an entry without
it has the JSON object of all its fields as its body. The other fields are the delivery's headers,
decoded as UTF-8 text (an invalid byte becomes U+FFFD). ``sent_at`` is the millisecond timestamp of the
entry id (the server's clock when it was added).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from consumer_kit.delivery import Delivery, Replayed
from consumer_kit.keys import KeyDigester
from consumer_kit.replay import REPLAY_HEADER, unseal

MESSAGE_ID_FIELD = "message-id"
"""The field the outbox publisher writes the row id in; ``RedisStreamSource(key="message-id")`` keys by it."""
REASON_FIELD = "x-consumer-kit-reason"
SOURCE_STREAM_FIELD = "x-consumer-kit-stream"
ENTRY_ID_FIELD = "x-consumer-kit-entry-id"
KEY_DIGEST_FIELD = "x-consumer-kit-key-digest"
BOOKKEEPING = (REASON_FIELD, SOURCE_STREAM_FIELD, ENTRY_ID_FIELD, KEY_DIGEST_FIELD, REPLAY_HEADER)
"""The fields the source writes on its copies: not the message's own, so a copy of a copy drops them."""

Fields = dict[bytes, bytes]


@dataclass(eq=False, slots=True)
class Entry:
    """A stream entry this consumer holds: ``attempt`` is the group's delivery count for it (1 for a
    new entry), ``refreshed`` the monotonic time its idle time was last reset (read, claimed or
    heartbeat), ``lost`` whether another consumer has claimed it since."""

    id: str
    fields: Fields
    attempt: int = 1
    refreshed: float = 0.0
    lost: bool = field(default=False)


def entry_order(entry_id: str) -> tuple[int, int]:
    """An entry id as the pair Redis orders ids by (milliseconds, sequence)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def sent_at(entry_id: str) -> datetime | None:
    """When the entry was added: the milliseconds of its id (the server's clock, or the producer's own
    for an id it chose)."""
    try:
        return datetime.fromtimestamp(entry_order(entry_id)[0] / 1000, UTC)
    except (ValueError, OverflowError, OSError):
        return None


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


def to_delivery(entry: Entry, stream: str, body_field: bytes, replays: KeyDigester | None = None) -> Delivery:
    """The :class:`Delivery` of a stream entry (see the module docstring). A parked delivery put back
    (its replay field verified with ``replays``) is the delivery it carries."""
    headers = {_text(name): _text(value) for name, value in entry.fields.items() if name != body_field}
    body = entry.fields.get(body_field)
    if body is None:
        body = json.dumps(headers, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    at = sent_at(entry.id)
    if replays is not None and REPLAY_HEADER in headers:
        return unseal(headers[REPLAY_HEADER], body, replays, attempt=entry.attempt, sent_at=at)
    return Delivery(id=f"{stream}:{entry.id}", body=body, headers=headers, attempt=entry.attempt, sent_at=at)


def dead_letter_copy(entry: Entry, stream: str, reason: str, key_digest: str | None) -> dict[bytes, bytes]:
    """The fields of an entry's copy for the dead-letter stream: its own fields as they were (without an
    earlier copy's bookkeeping) and why, from where, which entry; the key's digest, never the key."""
    fields = {name: value for name, value in entry.fields.items() if _text(name) not in BOOKKEEPING}
    fields[REASON_FIELD.encode()] = reason.encode("utf-8")
    fields[SOURCE_STREAM_FIELD.encode()] = stream.encode("utf-8")
    fields[ENTRY_ID_FIELD.encode()] = entry.id.encode()
    if key_digest:
        fields[KEY_DIGEST_FIELD.encode()] = key_digest.encode()
    return fields


def replay_copy(delivery: Replayed, sealed: str, body_field: str) -> Mapping[str, str | bytes]:
    """A parked delivery put back on its stream: its headers as they were (without our bookkeeping), so
    that a ``key=`` field keys it the same, its body, and the delivery itself ``sealed`` in the replay
    field (which keys it by the original entry's id otherwise)."""
    fields: dict[str, str | bytes] = {body_field: delivery.body}
    fields.update({name: value for name, value in delivery.headers.items()
                   if name not in BOOKKEEPING and name != body_field})
    fields[REPLAY_HEADER] = sealed
    return fields
