"""CloudEvents: an HTTP sink (binary, structured and batched mode) and a key mapper for CloudEvents
carried inside RabbitMQ and SQS messages. Needs the ``cloudevents`` extra.

The key is ``source`` + ``id`` (CloudEvents 1.0: "producers MUST ensure that source + id is unique
for each distinct event"), never a transport's message id. The required attributes are checked
before the cloudevents SDK sees the event: its core fills a missing ``id`` with a random UUID, which
would make every redelivery a new event.

Every accepted event reaches the pipeline in binary form: its attributes as ``ce-<name>`` headers
(decoded), ``content-type`` = ``datacontenttype``, and the event data as the body; the
security-relevant attributes go into :attr:`Delivery.attributes`, so a changed event under a known
``source`` + ``id`` is a conflict. An event that cannot be parsed is handed over in its raw form and
parked by the pipeline (400), never dropped.

HTTP answers: 415 for a content type that is not a CloudEvents format (or a batch when batches are
off), 400 for repeated ``ce-`` headers, 401 for a wrong bearer when ``bearer_tokens`` are set, and
otherwise the verdicts of :func:`consumer_kit.http.answer_for`. ``OPTIONS`` with
``WebHook-Request-Origin`` is the CloudEvents webhook abuse-protection handshake, granted to the
origins in ``allowed_origins``.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import quote, unquote

try:
    from cloudevents.core.exceptions import BaseCloudEventException
    from cloudevents.core.v1.event import CloudEvent
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "sources.cloudevents needs the cloudevents extra: pip install 'consumer-kit[cloudevents]'"
    ) from exc

from consumer_kit.delivery import CallIntake, Delivery, Result, Settlement
from consumer_kit.errors import MissingStableId, UnparseableDelivery
from consumer_kit.http import (
    DEFAULT_BODY_LIMIT,
    MalformedRequest,
    RequestRejected,
    Unauthenticated,
    UnsupportedMediaType,
    answer_for,
)
from consumer_kit.http_intake import read_body, reject, respond, unavailable
from consumer_kit.keys import OperationKey

STRUCTURED = "application/cloudevents+json"
BATCH = "application/cloudevents-batch+json"
SECURITY_ATTRIBUTES = ("specversion", "id", "source", "type", "subject", "datacontenttype", "dataschema")
"""Attributes a redelivery must repeat exactly; ``time`` and tracing extensions may change per hop."""

_JSON_TYPE = re.compile(r"^(application|text)/([a-zA-Z0-9\-.]+\+)?json(;.*)?$")
_TRANSPORT_PREFIXES = ("cloudevents_", "cloudevents:", "ce_", "ce-")


def _key_id(source: str, event_id: str) -> str:
    # '#' and '%' are escaped in the source, so the first '#' always separates it from the id.
    return f"{quote(source, safe=':/@!$&()*+,;=._~-')}#{event_id}"


def event_key(headers: Mapping[str, str], body: bytes) -> str:
    """The stable id (``source`` + ``id``) of an event in binary form, after checking the required
    attributes and letting the SDK validate the rest. Raises MissingStableId or UnparseableDelivery."""
    attributes = {name[3:]: value for name, value in headers.items() if name.startswith("ce-")}
    if "specversion" not in attributes:
        raise UnparseableDelivery("not a CloudEvent")
    if not attributes.get("id") or not attributes.get("source"):
        raise MissingStableId("the CloudEvent has no id or no source")
    if attributes["specversion"] != "1.0" or not attributes.get("type"):
        raise UnparseableDelivery("unsupported specversion or no type")
    if "content-type" in headers:
        attributes["datacontenttype"] = headers["content-type"]
    checked: dict[str, Any] = dict(attributes)
    try:
        if "time" in checked:
            checked["time"] = datetime.fromisoformat(checked["time"])
        CloudEvent(checked, None)
    except (BaseCloudEventException, ValueError, TypeError, OverflowError):
        raise UnparseableDelivery("the CloudEvent's attributes are invalid") from None
    return _key_id(attributes["source"], attributes["id"])


def cloudevent_key_mapper(delivery: Delivery) -> str | None:
    """A :data:`~consumer_kit.delivery.KeyMapper` for CloudEvents carried by a queue: ``source`` + ``id``
    from ``cloudEvents_*`` / ``cloudEvents:*`` (AMQP binding) or ``ce_*`` / ``ce-*`` headers or message
    attributes, else from a structured (JSON) body; ``None`` when the message carries no CloudEvent id.

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
            document = json.loads(delivery.body)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(document, dict):
            return None
        found = {k: v for k, v in document.items() if k in ("id", "source") and isinstance(v, str)}
    if not (found.get("id") and found.get("source")):
        return None
    return _key_id(found["source"], found["id"])


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int):
        return str(value)
    raise UnparseableDelivery("an attribute is not a scalar")


def _from_structured(event: Any, raw: bytes, content_type: str) -> Delivery:
    """One structured event in binary form, or its raw form (parked as unparseable) when it is not an
    object with scalar attributes and decodable data."""
    raw_form = Delivery(id=None, body=raw, headers={"content-type": content_type})
    if not isinstance(event, dict):
        return raw_form
    headers: dict[str, str] = {}
    try:
        for name, value in event.items():
            if name not in ("data", "data_base64"):
                headers["ce-" + name] = _scalar(value)
        datacontenttype = headers.pop("ce-datacontenttype", None)
        if "data_base64" in event:
            body = base64.b64decode(event["data_base64"], validate=True)
        elif "data" not in event:
            body = b""
        elif _JSON_TYPE.match(datacontenttype or "application/json"):
            body = json.dumps(event["data"], separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        elif isinstance(event["data"], str):
            body = event["data"].encode("utf-8")
        else:
            return raw_form
    except (UnparseableDelivery, binascii.Error, TypeError, ValueError):
        return raw_form
    if datacontenttype is not None:
        headers["content-type"] = datacontenttype
    return _binary_delivery(headers, body)


def _binary_delivery(headers: dict[str, str], body: bytes) -> Delivery:
    try:
        stable_id: str | None = event_key(headers, body)
    except (MissingStableId, UnparseableDelivery):
        stable_id = None
    attributes = {name: headers[f"ce-{name}"] for name in SECURITY_ATTRIBUTES if f"ce-{name}" in headers}
    if "content-type" in headers:
        attributes["datacontenttype"] = headers["content-type"]
    return Delivery(id=stable_id, body=body, headers=headers, attributes=attributes)


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


class CloudEventsSource(CallIntake):
    """CloudEvents POSTed to ``path`` (binary or structured mode; batched mode with ``batch=True``),
    keyed ``namespace:v<version>:<source>#<id>``.

    ``bearer_tokens`` (optional) are the accepted ``Authorization: Bearer`` tokens; ``allowed_origins``
    the origins granted by the abuse-protection handshake, at ``allowed_rate`` requests per minute
    (``None``: unlimited, ``*``).
    """

    methods: tuple[str, ...] = ("POST", "OPTIONS")

    def __init__(self, *, path: str, namespace: str, version: int, name: str | None = None,
                 batch: bool = False, bearer_tokens: str | Sequence[str] = (),
                 allowed_origins: Sequence[str] = (), allowed_rate: int | None = None,
                 body_limit: int = DEFAULT_BODY_LIMIT) -> None:
        if not path.startswith("/"):
            raise ValueError("a CloudEvents path starts with '/'")
        OperationKey(namespace, version, "probe")
        self.path = path
        self.namespace = namespace
        self.version = version
        self.name = name or f"cloudevents:{namespace}"
        self.batch = batch
        tokens = [bearer_tokens] if isinstance(bearer_tokens, str) else list(bearer_tokens)
        self._tokens = [token.encode("utf-8") for token in tokens if token]
        self.allowed_origins = frozenset(allowed_origins)
        self.allowed_rate = allowed_rate
        self.body_limit = body_limit

    def key(self, delivery: Delivery) -> OperationKey:
        """``namespace:v<version>:<source>#<id>``; raises MissingStableId or UnparseableDelivery."""
        return OperationKey(self.namespace, self.version, event_key(delivery.headers, delivery.body))




    async def handle(self, request: Request) -> Response:
        """The handshake (OPTIONS) or one delivery request (POST)."""
        if request.method == "OPTIONS":
            return self._handshake(request)
        dispatch = self._dispatch
        if dispatch is None:
            return unavailable()
        try:
            self._authenticate(request)
            headers = self._headers(request)
            body = await read_body(request, self.body_limit)
            deliveries = self._deliveries(headers, body)
        except RequestRejected as exc:
            return reject(self.name, exc)
        if len(deliveries) == 1 and not self._is_batch(headers):
            return respond(await dispatch(deliveries[0]))
        return _batch_response([await dispatch(delivery) for delivery in deliveries])

    def _handshake(self, request: Request) -> Response:
        origins = request.headers.getlist("webhook-request-origin")
        if len(origins) != 1 or not origins[0].strip():
            return reject(self.name, MalformedRequest("missing_request_origin"))
        origin = origins[0].strip()
        if origin not in self.allowed_origins and "*" not in self.allowed_origins:
            return JSONResponse({"error": "origin_not_allowed"}, status_code=403)
        rate = "*" if self.allowed_rate is None else str(self.allowed_rate)
        return Response(status_code=200, headers={
            "WebHook-Allowed-Origin": origin, "WebHook-Allowed-Rate": rate, "Allow": "POST, OPTIONS"})

    def _authenticate(self, request: Request) -> None:
        if not self._tokens:
            return
        values = request.headers.getlist("authorization")
        scheme, _, token = (values[0] if len(values) == 1 else "").partition(" ")
        given = token.strip().encode("utf-8", "surrogatepass")
        matched = False
        for expected in self._tokens:
            matched |= hmac.compare_digest(expected, given)
        if scheme.lower() != "bearer" or not matched:
            raise Unauthenticated(challenge="Bearer")

    @staticmethod
    def _headers(request: Request) -> dict[str, str]:
        headers: dict[str, str] = {}
        for raw_name, raw_value in request.scope["headers"]:
            name = raw_name.decode("latin-1").lower()
            if name in headers and (name.startswith("ce-") or name == "content-type"):
                raise MalformedRequest("repeated_header")
            if name not in ("authorization", "cookie", "proxy-authorization"):
                headers[name] = raw_value.decode("latin-1")
        return headers

    def _is_batch(self, headers: Mapping[str, str]) -> bool:
        return _media_type(headers.get("content-type", "")) == BATCH

    def _deliveries(self, headers: Mapping[str, str], body: bytes) -> list[Delivery]:
        content_type = headers.get("content-type", "")
        media = _media_type(content_type)
        if media == BATCH:
            if not self.batch:
                raise UnsupportedMediaType()
            try:
                events = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                events = None
            if not isinstance(events, list):
                return [Delivery(id=None, body=body, headers={"content-type": content_type})]
            return [_from_structured(event, json.dumps(event).encode("utf-8"), STRUCTURED)
                    for event in events]
        if media == STRUCTURED:
            try:
                event = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                event = None
            return [_from_structured(event, body, content_type)]
        if media.startswith("application/cloudevents"):
            raise UnsupportedMediaType()  # another event format (XML, Avro, Protobuf ...)
        ce_headers = {name: unquote(value) for name, value in headers.items() if name.startswith("ce-")}
        if not ce_headers:
            raise UnsupportedMediaType()
        if content_type:
            ce_headers["content-type"] = content_type
        return [_binary_delivery(ce_headers, body)]


def _batch_response(results: list[Result]) -> Response:
    """One answer for a batch: 503 if any event is to be retried (the others are deduplicated then),
    400 if any was unparseable, 202 if any was parked, else 200; with every event's verdict."""
    answers = [answer_for(result) for result in results]
    status, headers = 200, {}
    if any(result.settlement is Settlement.RETRY_LATER for result in results):
        status = 503
        headers = {"Retry-After": str(max(int(a.headers.get("Retry-After", "1")) for a in answers))}
    elif answers and max(a.status for a in answers) >= 400:
        status = 400
    elif any(a.status == 202 for a in answers):
        status = 202
    return JSONResponse({"results": [a.body for a in answers]}, status_code=status, headers=headers)
