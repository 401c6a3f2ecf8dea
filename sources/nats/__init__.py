"""NATS JetStream: a consuming source and the outbox publisher, on nats-py. Needs the ``nats`` extra:
``pip install 'consumer-kit[nats]'``.

``NatsSource(stream=..., subject=..., namespace=..., version=...)`` pulls from a durable JetStream
consumer (a pull consumer: the source asks for as many messages as it has room for) over a connection
that reconnects by itself, and settles each message only after the pipeline decided, that is after the
inbox and the effect committed:

============  ==========================================================================================
ACK           ``ack`` (``double_ack=True``: ``ack_sync``, which waits for the server to confirm it)
RETRY_LATER   ``nak`` with a delay: the larger of the pipeline's ``Result.delay`` and this attempt's step
              of ``retry_delays``; JetStream redelivers it then, counting the delivery
DEAD_LETTER   a copy to the dead-letter subject (default ``consumer-kit.dead-letter.<stream>``, captured by
              the stream ``<stream>_DEAD_LETTER``) with the reason in ``x-consumer-kit-reason``, acknowledged
              by that stream, then ``term`` (never delivered again); ``dead_letter_subject=None``: ``term``
              only (JetStream publishes its own advisory)
============  ==========================================================================================

While a handler runs longer than half the consumer's ``ack_wait``, the source sends ``in_progress``
for it, so JetStream does not hand it to another consumer; a message pulled as the source stops, or
whose handler was cancelled by the shutdown, is ``nak``-ed for another consumer a second later (past
the stopping source's last pull, which would take it back and spend a delivery on nothing). The attempt
number is JetStream's delivery count (``num_delivered``), which is what ``MAX_DELIVERIES`` counts: the
consumer's ``max_deliver`` must leave room for it (checked at start).

The key is chosen by ``stable_id``: ``"msg-id"`` (the default) keys by the publisher's ``Nats-Msg-Id``
header, which JetStream also deduplicates within the stream's duplicate window, and consumer-kit after
it; ``"sequence"`` by the stream name and stream sequence, which a stored message keeps through every
redelivery (but a message published twice is two messages). ``key=`` (a header name or a callable)
keys by a business id instead. A message without its id is parked "missing_stable_id", never keyed by
anything else. ``envelope="cloudevents"`` keys by the CloudEvent's ``source`` + ``id`` (the NATS
binding: structured mode, the body is the event; binary mode, ``ce-`` headers) and hands the handler
the event's data.

A parked message goes back on its subject with ``consumer-kit parked replay``
(:meth:`NatsSource.requeuer`): the copy carries the delivery as the pipeline saw it in a signed
``x-consumer-kit-replay`` header, so it keys the same.

``NatsPublisher`` implements :class:`consumer_kit.outbox.Publisher`: it publishes outbox rows through
JetStream with ``Nats-Msg-Id`` = the row id and waits for the stream's ``PubAck``.

A server that cannot be reached, or refuses the login, is a :class:`~consumer_kit.errors.ConfigurationError`
whose one line says which; the URL in it never shows a password or token.

The parts, as every source has them: the source (:mod:`.source`, on
:class:`~consumer_kit.sources.pulling.PullingSource`), the message reader (:mod:`.message`), the
settlement policy (:mod:`.settlement`), the outbox publisher (:mod:`.publisher`), and the connection
(:mod:`.connection`).
"""

try:
    import nats  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    from consumer_kit.extras import missing_extra

    raise missing_extra("nats", "consumer_kit.sources.nats", exc) from exc

from consumer_kit.sources.nats.connection import CONNECT_TIMEOUT_SECONDS, unreachable
from consumer_kit.sources.nats.message import (
    KEY_DIGEST_HEADER,
    MSG_ID_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    REASON_HEADER,
    SOURCE_SEQUENCE_HEADER,
    SOURCE_STREAM_HEADER,
    SOURCE_SUBJECT_HEADER,
    to_delivery,
)
from consumer_kit.sources.nats.publisher import NatsPublisher
from consumer_kit.sources.nats.source import DEFAULT_DEAD_LETTER_SUBJECT, DEFAULT_RETRY_DELAYS, NatsSource

__all__ = [
    "CONNECT_TIMEOUT_SECONDS",
    "DEFAULT_DEAD_LETTER_SUBJECT",
    "DEFAULT_RETRY_DELAYS",
    "KEY_DIGEST_HEADER",
    "MSG_ID_HEADER",
    "ORIGINAL_MSG_ID_HEADER",
    "REASON_HEADER",
    "SOURCE_SEQUENCE_HEADER",
    "SOURCE_STREAM_HEADER",
    "SOURCE_SUBJECT_HEADER",
    "NatsPublisher",
    "NatsSource",
    "to_delivery",
    "unreachable",
]
