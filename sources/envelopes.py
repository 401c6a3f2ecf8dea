"""Message envelopes and explicit keys for queue sources (SQS, RabbitMQ).

A queue message often carries another system's message inside it: an SNS notification, an
EventBridge event, S3 event records, a CloudEvent. Each of these has its own immutable id, which is the
one to key by: the queue's own message id is minted again whenever the inner message is sent again
(an SNS retry, a DLQ redrive, a publisher's re-send). ``unwrap`` takes the envelope off, keys by the
inner id, and hands the handler the inner message:

=============  ==============================  ==============================================================
envelope       stable id                       what the handler sees
=============  ==============================  ==============================================================
``sqs``        the SQS ``MessageId``           the body as sent; message attributes as headers
``sns``        ``TopicArn`` + SNS ``MessageId``  ``Message``; SNS message attributes as headers, plus
                                               ``sns-topic-arn``, ``sns-message-id``, ``sns-subject``,
                                               ``sns-timestamp``
``eventbridge``  ``source`` + ``id``           ``detail`` (JSON); ``eventbridge-source``, ``-detail-type``,
                                               ``-id``, ``-time``, ``-account``, ``-region``, ``-resources``
``s3``         bucket, key, version id and     one delivery per record: the record (JSON); ``s3-bucket``,
               ``sequencer`` of each record    ``s3-key`` (URL-decoded), ``s3-version-id``, ``s3-sequencer``,
                                               ``s3-event-name``
``cloudevents``  ``source`` + ``id``           the event's data; its attributes as ``ce-<name>`` headers and
                                               ``content-type`` (as the HTTP CloudEvents sink does)
=============  ==============================  ==============================================================

A message that is not the envelope the source expects (not JSON, an SNS ``SubscriptionConfirmation``,
an S3 record without bucket) becomes a delivery of the raw message that is parked
``envelope_mismatch``; an envelope without its id (an S3 record with no ``sequencer``) is parked
``missing_stable_id``. Neither is ever dropped.

``key=`` (on ``SQSSource`` and ``RabbitMQSource``) names a message attribute / header, or is a
callable ``(Delivery) -> str``, that holds an immutable business id; it replaces the envelope's id.
A missing value parks ``missing_stable_id``; keys are never made from a hash of the body.

The envelopes are parsed here rather than with a library's models (aws-lambda-powertools has pydantic
models for SNS, EventBridge and S3 events): those validate every field of an event, so an event from a
compatible producer (LocalStack, MinIO, a newer schema) that lacks a field we never read would be
parked, and validating whole models costs more CPU per message than reading the three fields we need.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import unquote_plus

from consumer_kit.delivery import Delivery, KeyedSource, KeyMapper
from consumer_kit.errors import ConfigurationError, InvalidKey, MissingStableId
from consumer_kit.keys import OperationKey
from consumer_kit.untrusted import loads_json

Envelope = Literal["sqs", "sns", "eventbridge", "s3", "cloudevents"]
ENVELOPES: tuple[str, ...] = ("sqs", "sns", "eventbridge", "s3", "cloudevents")

KeyFunction = Callable[[Delivery], "str | None"]
"""A ``key=`` callable: picks an immutable business id out of the (unwrapped) delivery."""

S3_TEST_EVENT = "s3:TestEvent"
# An S3 object key may be 1,024 bytes, more than a whole operation key may be (255): past this length
# the object key part of the id is replaced by its SHA-256, a fixed-size name of the same identifier.
_S3_READABLE_LIMIT = 160
_CLOUDEVENT_SECURITY_ATTRIBUTES = ("specversion", "id", "source", "type", "subject", "dataschema")
_JSON_MEDIA = re.compile(r"^(application|text)/([a-zA-Z0-9\-.]+\+)?json(;.*)?$")
_AMQP_CE_PREFIXES = ("cloudevents_", "cloudevents:")


class EnvelopeMismatch(MissingStableId):
    """The message is not the envelope its source was configured for (``envelope=``), so its stable
    id cannot be read: parked with the raw message under reason ``envelope_mismatch``."""

    reason = "envelope_mismatch"

    def __init__(self, message: str = "the message is not in the expected envelope") -> None:
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Unwrapped(Delivery):
    """A delivery taken out of its envelope.

    ``mismatch`` says why the message is not the expected envelope (the delivery then holds the raw
    message and is parked ``envelope_mismatch``); ``no_id`` why the envelope carries no stable id
    (parked ``missing_stable_id`` unless ``key=`` finds one).
    """

    mismatch: str | None = None
    no_id: str | None = None


def unwrap(envelope: str, *, message_id: str | None, body: bytes, headers: Mapping[str, str],
           attempt: int = 1, sent_at: datetime | None = None) -> list[Delivery]:
    """The deliveries inside one queue message (``s3``: one per record; none for ``s3:TestEvent``).

    ``message_id`` is the queue's own id (the ``sqs`` envelope's key) and ``headers`` its attributes.
    Never raises on bad input: a message that cannot be unwrapped comes back as one :class:`Unwrapped`
    delivery of the raw message with ``mismatch`` set. ``sent_at`` (the queue's send time) is each
    delivery's, unless the envelope carries an earlier one of its own (SNS's ``Timestamp``).
    """
    return [d if d.sent_at is not None else replace(d, sent_at=sent_at)
            for d in _unwrap(envelope, message_id=message_id, body=body, headers=headers, attempt=attempt)]


def _unwrap(envelope: str, *, message_id: str | None, body: bytes, headers: Mapping[str, str],
            attempt: int) -> list[Delivery]:
    if envelope == "sqs":
        return [Delivery(id=message_id, body=body, headers=headers, attempt=attempt)]
    if envelope not in ENVELOPES:
        raise ValueError(f"unknown envelope {envelope!r}; choose from {ENVELOPES}")
    try:
        document = _json(body)
        if envelope == "sns":
            return [_sns(document, body, headers, attempt)]
        if envelope == "eventbridge":
            return [_eventbridge(document, body, headers, attempt)]
        if envelope == "s3":
            return _s3(document, body, headers, attempt)
        return [structured_cloudevent(document, body, headers, attempt)]
    except Exception as exc:  # whatever a body built to break a reader may still find: parked, never retried
        return [_mismatch(body, headers, attempt, f"the message cannot be read ({type(exc).__name__})")]


def _json(body: bytes) -> Any:
    """``body`` parsed as JSON, or ``None`` when it is not JSON (or nested too deep to parse)."""
    try:
        return loads_json(body, strict=False)
    except ValueError:
        return None


def is_s3_test_event(body: bytes) -> bool:
    """Whether ``body`` is the ``s3:TestEvent`` S3 sends when a notification is configured."""
    if S3_TEST_EVENT.encode() not in body:
        return False
    document = _json(body)
    return isinstance(document, dict) and document.get("Event") == S3_TEST_EVENT


def _mismatch(body: bytes, headers: Mapping[str, str], attempt: int, why: str) -> Unwrapped:
    return Unwrapped(id=None, body=body, headers=dict(headers), attempt=attempt, mismatch=why)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _joined(*parts: str) -> str:
    """Parts of a stable id joined by ``#``; ``%`` and ``#`` inside the leading parts are escaped, so
    that different parts can never join to the same id."""
    escaped = [p.replace("%", "%25").replace("#", "%23") for p in parts[:-1]]
    return "#".join([*escaped, parts[-1]])


def _inner(parts: tuple[str | None, str | None], body: bytes, headers: dict[str, str], attributes: dict[str, str],
           attempt: int, *, missing: str, join: Callable[[str, str], str | None] = _joined) -> Delivery:
    """The unwrapped delivery, keyed by its two id parts joined; without either, one that parks
    ``missing_stable_id`` saying ``missing`` (unless ``key=`` finds an id)."""
    first, second = parts
    if first is None or second is None:
        return Unwrapped(id=None, body=body, headers=headers, attributes=attributes, attempt=attempt, no_id=missing)
    return Delivery(id=join(first, second), body=body, headers=headers, attributes=attributes, attempt=attempt)


def _sns(document: Any, body: bytes, headers: Mapping[str, str], attempt: int) -> Delivery:
    if not isinstance(document, dict) or document.get("Type") != "Notification":
        kind = document.get("Type") if isinstance(document, dict) else None
        return _mismatch(body, headers, attempt, f"not an SNS notification (Type {kind[:40]!r})"
                         if isinstance(kind, str) else "not an SNS notification")
    message = document.get("Message")
    if not isinstance(message, str):
        return _mismatch(body, headers, attempt, "the SNS notification has no Message")
    unwrapped = dict(headers)
    attributes = document.get("MessageAttributes")
    if isinstance(attributes, dict):
        for name, attribute in attributes.items():
            if isinstance(attribute, dict) and isinstance(attribute.get("Value"), str):
                unwrapped[name] = attribute["Value"]
    topic, sns_id = _text(document.get("TopicArn")), _text(document.get("MessageId"))
    for name, field in (("sns-topic-arn", topic), ("sns-message-id", sns_id),
                        ("sns-subject", _text(document.get("Subject"))),
                        ("sns-timestamp", _text(document.get("Timestamp")))):
        if field is not None:
            unwrapped[name] = field
    security = {"sns-topic-arn": topic or ""}
    if "sns-subject" in unwrapped:
        security["sns-subject"] = unwrapped["sns-subject"]
    inner = _inner((topic, sns_id), message.encode("utf-8"), unwrapped, security, attempt,
                   missing="the SNS notification has no TopicArn or MessageId")
    published = _instant(_text(document.get("Timestamp")))  # when SNS accepted it: the send time
    return replace(inner, sent_at=published) if published is not None else inner


def _instant(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        instant = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return instant if instant.tzinfo is not None else instant.replace(tzinfo=UTC)


def _eventbridge(document: Any, body: bytes, headers: Mapping[str, str], attempt: int) -> Delivery:
    if not isinstance(document, dict) or "detail-type" not in document or "detail" not in document:
        return _mismatch(body, headers, attempt, "not an EventBridge event (no detail-type or detail)")
    unwrapped = dict(headers)
    for name in ("source", "detail-type", "id", "time", "account", "region"):
        value = document.get(name)
        if isinstance(value, str):
            unwrapped[f"eventbridge-{name}"] = value
    if isinstance(document.get("resources"), list):
        unwrapped["eventbridge-resources"] = json.dumps(document["resources"], separators=(",", ":"))
    detail = json.dumps(document["detail"], separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    security = {"eventbridge-source": unwrapped.get("eventbridge-source", ""),
                "eventbridge-detail-type": unwrapped.get("eventbridge-detail-type", "")}
    return _inner((_text(document.get("source")), _text(document.get("id"))), detail, unwrapped, security, attempt,
                  missing="the EventBridge event has no source or id")


def _s3(document: Any, body: bytes, headers: Mapping[str, str], attempt: int) -> list[Delivery]:
    if isinstance(document, dict) and document.get("Event") == S3_TEST_EVENT:
        return []
    records = document.get("Records") if isinstance(document, dict) else None
    if not isinstance(records, list) or not records:
        return [_mismatch(body, headers, attempt, "not an S3 event notification (no Records)")]
    return [_s3_record(record, headers, attempt) for record in records]


def _s3_record(record: Any, headers: Mapping[str, str], attempt: int) -> Delivery:
    raw = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    s3 = record.get("s3") if isinstance(record, dict) else None
    bucket = s3.get("bucket") if isinstance(s3, dict) else None
    obj = s3.get("object") if isinstance(s3, dict) else None
    name = _text(bucket.get("name")) if isinstance(bucket, dict) else None
    key = _text(obj.get("key")) if isinstance(obj, dict) else None
    if name is None or key is None or not isinstance(obj, dict):
        return _mismatch(raw, headers, attempt, "the S3 record has no bucket name or object key")
    version, sequencer = _text(obj.get("versionId")) or "", _text(obj.get("sequencer"))
    unwrapped = dict(headers)
    # S3 sends the object key URL-encoded (spaces as '+'); the header holds it decoded, ready for
    # GetObject, while the id and the fingerprint keep the form S3 sent.
    unwrapped.update({"s3-bucket": name, "s3-key": unquote_plus(key),
                      "s3-event-name": str(record.get("eventName", ""))})
    if version:
        unwrapped["s3-version-id"] = version
    security = {"s3-bucket": name, "s3-key": key, "s3-version-id": version,
                "s3-event-name": unwrapped["s3-event-name"]}
    if sequencer is None:
        return Unwrapped(id=None, body=raw, headers=unwrapped, attributes=security, attempt=attempt,
                         no_id="the S3 record has no sequencer")
    unwrapped["s3-sequencer"] = security["s3-sequencer"] = sequencer
    if len(key.encode("utf-8")) > _S3_READABLE_LIMIT:
        key = "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()
    return Delivery(id=_joined(name, key, version, sequencer), body=raw, headers=unwrapped,
                    attributes=security, attempt=attempt)


def _scalar(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int):
        return str(value)
    return None


def structured_cloudevent(document: Any, body: bytes, headers: Mapping[str, str], attempt: int) -> Delivery:
    """A structured-mode CloudEvent (already parsed from ``body``) in binary form: its data as the
    body, its attributes as ``ce-<name>`` headers beside the transport's ``headers``."""
    if not isinstance(document, dict) or document.get("specversion") != "1.0" or not _text(document.get("type")):
        return _mismatch(body, headers, attempt, "not a CloudEvents 1.0 event in structured mode")
    attributes: dict[str, str] = {}
    for name, value in document.items():
        if name in ("data", "data_base64"):
            continue
        text = _scalar(value)
        if text is None:
            return _mismatch(body, headers, attempt, "a CloudEvent attribute is not a scalar")
        attributes[name] = text
    content_type = attributes.pop("datacontenttype", None)
    try:
        if "data_base64" in document:
            data = base64.b64decode(document["data_base64"], validate=True)
        elif "data" not in document:
            data = b""
        elif _JSON_MEDIA.match(content_type or "application/json"):
            data = json.dumps(document["data"], separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        elif isinstance(document["data"], str):
            data = document["data"].encode("utf-8")
        else:
            return _mismatch(body, headers, attempt, "the CloudEvent's data does not match its content type")
    except (binascii.Error, TypeError, ValueError):
        return _mismatch(body, headers, attempt, "the CloudEvent's data_base64 is not base64")
    return _binary_cloudevent(attributes, content_type, data, headers, attempt)


def amqp_cloudevent(delivery: Delivery, content_type: str | None) -> Delivery:
    """The CloudEvent in an AMQP message (the CloudEvents AMQP binding): structured mode when the
    content type is ``application/cloudevents+json``, binary mode when ``cloudEvents_*`` /
    ``cloudEvents:*`` application properties (headers) carry the attributes."""
    return header_cloudevent(delivery, content_type, _AMQP_CE_PREFIXES)


def header_cloudevent(delivery: Delivery, content_type: str | None, prefixes: tuple[str, ...], *,
                      structured_by_default: bool = False) -> Delivery:
    """The CloudEvent in a message whose headers carry its attributes under one of ``prefixes``
    (lower case; binary mode), or whose body is the event (structured mode: the content type is
    ``application/cloudevents+json``, or, with ``structured_by_default``, no attribute header is there:
    the NATS binding's first version knew only that mode and no content type)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    binary = any(name.lower().startswith(prefixes) for name in delivery.headers)
    if media == "application/cloudevents+json" or (structured_by_default and not binary and not media):
        try:
            return structured_cloudevent(_json(delivery.body), delivery.body, delivery.headers, delivery.attempt)
        except Exception as exc:  # as in unwrap(): a body built to break the parser is parked, not retried
            return _mismatch(delivery.body, delivery.headers, delivery.attempt,
                             f"the message cannot be read ({type(exc).__name__})")
    if media.startswith("application/cloudevents"):
        return _mismatch(delivery.body, delivery.headers, delivery.attempt,
                         f"a CloudEvents format this source does not read ({media})")
    attributes: dict[str, str] = {}
    others: dict[str, str] = {}
    for name, value in delivery.headers.items():
        lowered = name.lower()
        prefix = next((p for p in prefixes if lowered.startswith(p)), None)
        if prefix is None:
            others[name] = value
        else:
            attributes[lowered[len(prefix):]] = value
    if attributes.get("specversion") != "1.0" or not attributes.get("type"):
        return _mismatch(delivery.body, delivery.headers, delivery.attempt,
                         f"not a CloudEvents 1.0 event (no {prefixes[0]}specversion/type headers)")
    return _binary_cloudevent(attributes, content_type, delivery.body, others, delivery.attempt)


def _binary_cloudevent(attributes: dict[str, str], content_type: str | None, data: bytes,
                       headers: Mapping[str, str], attempt: int) -> Delivery:
    unwrapped = {k: v for k, v in headers.items() if not k.lower().startswith("ce-")}
    unwrapped.update({f"ce-{name}": value for name, value in attributes.items()})
    if content_type:
        unwrapped["content-type"] = content_type
    security = {name: attributes[name] for name in _CLOUDEVENT_SECURITY_ATTRIBUTES if name in attributes}
    if content_type:
        security["datacontenttype"] = content_type
    return _inner((_text(attributes.get("source")), _text(attributes.get("id"))), data, unwrapped, security,
                  attempt, missing="the CloudEvent has no id or no source", join=_cloudevent_id)


def _cloudevent_id(source: str, event_id: str) -> str | None:
    # The HTTP sink's id format, so that one event reaching a namespace over HTTP and over a queue
    # gets one key. Only the event's own two attributes are shown to the mapper: a transport header
    # such as ``ce_id`` must not stand in for them.
    from consumer_kit.sources.cloudevents import cloudevent_key_mapper

    return cloudevent_key_mapper(Delivery(id=None, body=b"", headers={"ce-id": event_id, "ce-source": source}))


def require_cloudevents() -> None:
    """Fail at construction, with the install hint, when the ``cloudevents`` envelope cannot work."""
    try:
        import consumer_kit.sources.cloudevents  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError(f"envelope='cloudevents' needs the cloudevents extra: {exc}") from exc


def explicit_key_mapper(key: str | KeyFunction) -> KeyMapper:
    """The :data:`~consumer_kit.delivery.KeyMapper` of a ``key=`` argument: a header / message
    attribute name, or a callable. An absent or empty value is ``None`` (parked ``missing_stable_id``);
    a callable that raises on a message parks it the same way instead of failing the delivery forever."""
    if isinstance(key, str):
        if not key:
            raise ConfigurationError("key= names a message attribute or header; it cannot be empty")
        name = key

        def by_name(delivery: Delivery) -> str | None:
            return delivery.headers.get(name) or None

        return by_name
    if not callable(key):
        raise ConfigurationError("key= is a message attribute / header name or a callable (Delivery) -> str")
    function = key

    def by_call(delivery: Delivery) -> str | None:
        try:
            return function(delivery) or None
        except (MissingStableId, InvalidKey):
            raise
        except Exception as exc:
            # Only the type: the message of a failed lookup may quote the value it was looking for.
            raise MissingStableId(f"the key= function raised {type(exc).__name__}") from None

    return by_call


class EnvelopedSource(KeyedSource):
    """The key mapping of the queue sources: ``key=`` (or ``key_mapper=``) if given, else the
    envelope's stable id; a delivery whose envelope could not be read is parked with why."""

    def __init__(self, *, namespace: str, version: int, key: str | KeyFunction | None = None,
                 key_mapper: KeyMapper | None = None) -> None:
        if key is not None and key_mapper is not None:
            raise ConfigurationError("pass key= or key_mapper=, not both")
        mapper = explicit_key_mapper(key) if key is not None else key_mapper
        super().__init__(namespace=namespace, version=version, key_mapper=mapper)

    def key(self, delivery: Delivery) -> OperationKey:
        """The operation key; raises EnvelopeMismatch, MissingStableId or InvalidKey (all park)."""
        if isinstance(delivery, Unwrapped) and delivery.mismatch is not None:
            raise EnvelopeMismatch(delivery.mismatch)
        stable_id = self.key_mapper(delivery) if self.key_mapper is not None else delivery.id
        if stable_id is None:
            if isinstance(delivery, Unwrapped) and delivery.no_id is not None and self.key_mapper is None:
                raise MissingStableId(delivery.no_id)
            raise MissingStableId()
        return OperationKey(self.namespace, self.version, stable_id)
