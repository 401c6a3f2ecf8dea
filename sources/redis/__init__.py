"""Redis Streams: a consuming source and the outbox publisher, on redis-py's asyncio client. Needs the
``redis`` extra: ``pip install 'consumer-kit[redis]'`` (Redis 6.2 or later; 7 or later tells trimmed
entries apart).

``RedisStreamSource(stream=..., group=..., namespace=..., version=...)`` reads a stream as one consumer
of a consumer group, and settles each entry only after the pipeline decided, that is after the inbox
and the effect committed:

============  ==========================================================================================
ACK           ``XACK``
RETRY_LATER   left in this consumer's pending list; after the larger of the pipeline's ``Result.delay``
              and this attempt's step of ``retry_delays`` it is claimed again (``XCLAIM``, delivery count
              + 1) and run. Meanwhile its idle time is kept fresh, so no other consumer takes it over
DEAD_LETTER   ``XADD`` of a copy to ``<stream>:dead-letter`` (its fields, plus ``x-consumer-kit-reason``,
              ``x-consumer-kit-stream``, ``x-consumer-kit-entry-id`` and the key's digest), and ``XACK``,
              in one ``MULTI``/``EXEC``: both or neither
============  ==========================================================================================

Reading: first this consumer's own pending entries (``XREADGROUP ... 0``: a worker restarted under
the same consumer name resumes them at once), then new ones (``XREADGROUP ... >``, waiting up to a
second), and every half ``claim_idle_seconds`` the entries that sat idle in any consumer's pending list
for ``claim_idle_seconds`` (``XAUTOCLAIM``): the takeover of a crashed or cut-off replica's work. An
entry a handler is running is kept fresh by a heartbeat, which claims only what this consumer still
holds (:mod:`.settlement`), so a replica never takes back an entry another one took over. An entry
trimmed away while pending is acknowledged and counted (``consumer_kit_redis_trimmed_total``): it can
never be delivered. The attempt number is the group's delivery count of the entry (``XPENDING``).

The stable id is ``<stream>:<entry id>``, which the group redelivers unchanged; ``key=`` keys by a field
(or a callable) instead, as a producer that may add the same work twice needs: the outbox publisher's
``message-id`` field (:data:`MESSAGE_ID_FIELD`). An entry without that field is parked
``missing_stable_id``. The body is the ``body`` field (``body_field=``); an entry without it has the
JSON object of all its fields as its body. The other fields are headers (a ``traceparent`` field is the
trace context). ``envelope="cloudevents"`` keys by the CloudEvent's ``source`` + ``id``: binary mode with
``ce_``-prefixed fields and the data in the body field (``content-type`` field), or structured mode,
the body being the JSON event.

A parked entry goes back on its stream with ``consumer-kit parked replay`` (:meth:`RedisStreamSource.requeuer`):
the copy carries the delivery in a signed ``x-consumer-kit-replay`` field (see :mod:`consumer_kit.replay`).

``RedisStreamPublisher`` implements :class:`consumer_kit.outbox.Publisher`: one ``XADD`` a row, with the
row id in the ``message-id`` field.

"Nothing lost" holds as far as the server keeps what it acknowledged: ``appendonly yes`` with
``appendfsync always`` (see the documentation's Redis Streams page).

A server that cannot be reached, or refuses the login, is a :class:`~consumer_kit.errors.ConfigurationError`
whose one line says which (:func:`unreachable`); the URL in it never shows the password.

The parts, as every source has them: the source (:mod:`.source`), the entry reader (:mod:`.message`),
the claims and the retry delay (:mod:`.settlement`), the outbox publisher (:mod:`.publisher`), and the
connection (:mod:`.connection`).
"""

try:
    import redis.asyncio  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    from consumer_kit.extras import missing_extra

    raise missing_extra("redis", "consumer_kit.sources.redis", exc) from exc

from consumer_kit.sources.redis.connection import CONNECT_TIMEOUT_SECONDS, unreachable
from consumer_kit.sources.redis.message import (
    ENTRY_ID_FIELD,
    KEY_DIGEST_FIELD,
    MESSAGE_ID_FIELD,
    REASON_FIELD,
    SOURCE_STREAM_FIELD,
    Entry,
    to_delivery,
)
from consumer_kit.sources.redis.publisher import RedisStreamPublisher
from consumer_kit.sources.redis.source import DEFAULT_RETRY_DELAYS, RedisStreamSource

__all__ = [
    "CONNECT_TIMEOUT_SECONDS",
    "DEFAULT_RETRY_DELAYS",
    "ENTRY_ID_FIELD",
    "KEY_DIGEST_FIELD",
    "MESSAGE_ID_FIELD",
    "REASON_FIELD",
    "SOURCE_STREAM_FIELD",
    "Entry",
    "RedisStreamPublisher",
    "RedisStreamSource",
    "to_delivery",
    "unreachable",
]
