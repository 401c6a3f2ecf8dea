"""The key of a CloudEvent carried by a queue message (RabbitMQ, SQS) rather than posted over HTTP."""

from __future__ import annotations

from consumer_kit.delivery import Delivery
from consumer_kit.sources.cloudevents.message import key_id
from consumer_kit.untrusted import loads_json

_TRANSPORT_PREFIXES = ("cloudevents_", "cloudevents:", "ce_", "ce-")


def cloudevent_key_mapper(delivery: Delivery) -> str | None:
    """A :data:`~consumer_kit.delivery.KeyMapper` for CloudEvents carried by a queue: ``source`` + ``id``
    from ``cloudEvents_*`` / ``cloudEvents:*`` (AMQP binding) or ``ce_*`` / ``ce-*`` headers or message
    attributes, else from a structured (JSON) body; ``None`` when the message carries no CloudEvent id
    (the delivery is then parked as ``missing_stable_id``).

    Pass it as ``key_mapper=`` to a RabbitMQ or SQS source: the key is the event's, not the transport's.
    """
    found: dict[str, str] = {}
    for mapping in (delivery.headers, delivery.attributes):
        for name, value in mapping.items():
            lowered = name.lower()
            for prefix in _TRANSPORT_PREFIXES:
                if lowered.startswith(prefix) and isinstance(value, str):
                    found.setdefault(lowered[len(prefix):], value)
    if not (found.get("id") and found.get("source")):
        try:
            document = loads_json(delivery.body)  # bounded nesting: a hostile body parks, never loops
        except ValueError:
            return None
        if not isinstance(document, dict):
            return None
        found = {k: v for k, v in document.items() if k in ("id", "source") and isinstance(v, str)}
    if not (found.get("id") and found.get("source")):
        return None
    return key_id(found["source"], found["id"])
