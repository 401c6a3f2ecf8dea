"""CloudEvents (specification v1.0.2): an HTTP sink for binary, structured and batched events, and a
key mapper for CloudEvents carried inside RabbitMQ and SQS messages. Needs the ``cloudevents`` extra:
``pip install 'consumer-kit[cloudevents]'``.

The key is ``source`` + ``id`` (spec: "producers MUST ensure that source + id is unique for each
distinct event"), never a transport's message id, and never a random id filled in for a missing one.

The parts, as every source has them where an HTTP sink has one: the source (:mod:`.source`), the
message reader (an event read and checked, :mod:`.message`, on the type system of :mod:`.values`), the
settlement (the HTTP answer, :mod:`.settlement`); the key of an event carried by a queue is
:mod:`.queues`. Nothing is published back, so there is no publisher.
"""

try:
    import starlette  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    from consumer_kit.extras import missing_extra

    raise missing_extra("cloudevents", "consumer_kit.sources.cloudevents", exc) from exc

from consumer_kit.sources.cloudevents.message import CloudEventDelivery, InvalidEvent, key_id
from consumer_kit.sources.cloudevents.queues import cloudevent_key_mapper
from consumer_kit.sources.cloudevents.source import BATCH, STRUCTURED, CloudEventsSource, TooManyEvents

__all__ = [
    "BATCH",
    "STRUCTURED",
    "CloudEventDelivery",
    "CloudEventsSource",
    "InvalidEvent",
    "TooManyEvents",
    "cloudevent_key_mapper",
    "key_id",
]
