"""RabbitMQ: a consuming source and the outbox publisher, on aio-pika. Needs the ``rabbitmq`` extra:
``pip install 'consumer-kit[rabbitmq]'``.

``RabbitMQSource(queue=..., namespace=..., version=...)`` consumes a queue over a robust connection
(it reconnects and consumes again after a broker restart or a dropped connection) and settles each
delivery only after the pipeline decided, that is after the inbox and the effect committed:

============  ==========================================================================================
ACK           ``basic.ack``
RETRY_LATER   a copy to the retry queue whose TTL is the smallest configured delay that covers both the
              pipeline's ``Result.delay`` and this attempt's backoff step (it dead-letters back into the
              queue when the TTL runs out), then ack; ``retry_delays=()`` requeues instead
DEAD_LETTER   a copy to ``<queue>.dlq`` with the reason in ``x-consumer-kit-reason``, then ack;
              ``dead_letter=False`` rejects without requeue (the queue's own dead-letter exchange)
============  ==========================================================================================

The copy is confirmed by the broker before the original is acked, so a crash in between delivers the
message twice, never zero times; the inbox absorbs the repeat. The key is the AMQP ``message_id``
property, or ``key=``: a header name or a callable that picks an immutable business id (aio-pika and
aiormq give every message published without a ``message_id`` a random one, so a publisher that
re-sends after a lost confirm makes a new ``message_id``; key by the business id then). A message
without its id is parked "missing_stable_id" and dead-lettered, never keyed by delivery tag or body.
``envelope="cloudevents"`` keys by the CloudEvent's ``source`` + ``id`` (AMQP binding: structured
mode, or binary mode with ``cloudEvents_*`` / ``cloudEvents:*`` application properties) and hands the
handler the event's data. The attempt number comes from the copy's ``x-consumer-kit-attempt`` header
plus ``x-delivery-count`` (quorum queues) or the redelivered flag.

A parked message goes back on its queue with ``consumer-kit parked replay`` (:meth:`RabbitMQSource.requeuer`):
the copy carries the delivery as the pipeline saw it in a signed ``x-consumer-kit-replay`` header (see
:mod:`consumer_kit.replay`), its ``message_id`` and headers as they were, so it keys the same.

``AmqpPublisher`` implements :class:`consumer_kit.outbox.Publisher`: it publishes outbox rows with
publisher confirms, ``message_id`` = the row id, persistent, and mandatory (an unroutable destination
is a failure, so the row stays pending).

A broker that cannot be reached, or refuses the user or the virtual host, is a
:class:`~consumer_kit.errors.ConfigurationError` whose one line says which (:func:`unreachable`); the
URL in it never shows the password.

The parts, as every source has them: the source (:mod:`.source`), the message reader (:mod:`.message`),
the settlement policy and the order of acks (:mod:`.settlement`), the outbox publisher
(:mod:`.publisher`), and the connection text (:mod:`.connection`).
"""

try:
    import aio_pika  # noqa: F401
    import aiormq  # noqa: F401
    import yarl  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    from consumer_kit.extras import missing_extra

    raise missing_extra("rabbitmq", "consumer_kit.sources.rabbitmq", exc) from exc

from consumer_kit.sources.rabbitmq.connection import CONNECT_TIMEOUT_SECONDS, unreachable
from consumer_kit.sources.rabbitmq.message import (
    ATTEMPT_HEADER,
    NO_ID_HEADER,
    REASON_HEADER,
    SOURCE_QUEUE_HEADER,
    UNREADABLE,
    to_delivery,
)
from consumer_kit.sources.rabbitmq.publisher import AmqpPublisher
from consumer_kit.sources.rabbitmq.source import DEFAULT_RETRY_DELAYS, RabbitMQSource

__all__ = [
    "ATTEMPT_HEADER",
    "CONNECT_TIMEOUT_SECONDS",
    "DEFAULT_RETRY_DELAYS",
    "NO_ID_HEADER",
    "REASON_HEADER",
    "SOURCE_QUEUE_HEADER",
    "UNREADABLE",
    "AmqpPublisher",
    "RabbitMQSource",
    "to_delivery",
    "unreachable",
]
