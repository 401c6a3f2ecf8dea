"""Amazon SQS: a receiving source and the outbox publisher, on boto3. Needs the ``sqs`` extra.

``SQSSource(queue_url=... | queue_name=..., namespace=..., version=...)`` long-polls the queue on a
thread pool of its own (``pollers`` polls at once, each waiting for ten free in-flight slots, or all
of them when ``max_in_flight`` is smaller, and asking for that many) and settles each message after
the pipeline decided, that is after the inbox and the effect committed:

============  ==========================================================================================
ACK           ``DeleteMessageBatch`` (entries gathered ten at a time, for at most ``settle_linger`` seconds
              and only while other messages are still in the pipeline), with the newest receipt handle
RETRY_LATER   ``ChangeMessageVisibility`` to the larger of the pipeline's delay and this attempt's step
              of ``retry_delays``, within SQS's 12-hour limit
DEAD_LETTER   a copy to ``dead_letter_queue_url`` with ``x-consumer-kit-reason`` and
              ``x-consumer-kit-key-digest`` attributes, then delete; without a dead-letter queue, the
              message is made visible again so that the queue's redrive policy moves it
============  ==========================================================================================

The attempt number is SQS's ``ApproximateReceiveCount``. While a message is held (its handler runs,
or the pipeline backs off in process), a heartbeat extends its visibility every third of the timeout,
in batches. On a FIFO queue two messages of one ``MessageGroupId`` never run at once, and when one
goes back to the queue the later ones of its group go back too, so the group's order holds. At stop
the pollers end, messages received but not started are made visible again at once, and those running
finish within ``SHUTDOWN_GRACE_SECONDS``; one cancelled after that is made visible again, never
deleted.

``envelope=`` says where the stable id is (``sqs``, ``sns``, ``eventbridge``, ``s3``, ``cloudevents``;
see :mod:`consumer_kit.sources.envelopes`), and ``key=`` names an attribute (or a callable) holding a business id
instead.

``SqsPublisher`` implements :class:`consumer_kit.outbox.Publisher`: ``SendMessageBatch``, the outbox row
id in the ``x-consumer-kit-message-id`` attribute, and on FIFO queues also as the
``MessageDeduplicationId``.

The parts, as every source has them: the source (:mod:`.source`), the message reader (:mod:`.message`),
the settlement policy (:mod:`.settlement`), the outbox publisher (:mod:`.publisher`); besides them the
boto3 client on its threads (:mod:`.client`), what the source holds (:mod:`.held`) and the queue's
checks at start (:mod:`.queue`).
"""

try:
    import boto3  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    from consumer_kit.extras import missing_extra

    raise missing_extra("sqs", "consumer_kit.sources.sqs", exc) from exc

from consumer_kit.sources.envelopes import EnvelopeMismatch
from consumer_kit.sources.sqs.publisher import GROUP_HEADER, MESSAGE_ID_ATTRIBUTE, SqsPublisher
from consumer_kit.sources.sqs.settlement import KEY_DIGEST_ATTRIBUTE, REASON_ATTRIBUTE, SOURCE_QUEUE_ATTRIBUTE
from consumer_kit.sources.sqs.source import DEFAULT_RETRY_DELAYS, SQSSource

__all__ = [
    "DEFAULT_RETRY_DELAYS",
    "GROUP_HEADER",
    "KEY_DIGEST_ATTRIBUTE",
    "MESSAGE_ID_ATTRIBUTE",
    "REASON_ATTRIBUTE",
    "SOURCE_QUEUE_ATTRIBUTE",
    "EnvelopeMismatch",
    "SQSSource",
    "SqsPublisher",
]
