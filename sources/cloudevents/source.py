"""CloudEventsSource: the HTTP protocol binding (v1.0.2) of CloudEvents, served by ``app.asgi()``.

The ``Content-Type`` chooses the mode (HTTP binding §3): ``application/cloudevents+json`` is
structured mode, ``application/cloudevents-batch+json`` batched mode (when ``batch=True``), another
``application/cloudevents...`` format is 415, and anything else with ``ce-`` headers is binary mode
(without them, 415: not a CloudEvent). Each event becomes one :class:`~.message.CloudEventDelivery`
(the message reader), keyed ``namespace:v<version>:<source>#<id>``.

Answers: those of :func:`consumer_kit.http.answer_for` for each event (an invalid event is parked and
answered 400); 400 without parking for a repeated ``ce-`` or ``Content-Type`` header; 401 for a wrong
bearer when ``bearer_tokens`` are set. A batch is judged member by member and answered once (see
:func:`~.settlement.batch_response`); a batch of more than ``CLOUDEVENTS_MAX_BATCH_EVENTS`` events is
parked whole, once, as ``too_many_events`` (400), so one request cannot park thousands of rows. ``OPTIONS``
with ``WebHook-Request-Origin`` is the CloudEvents webhook abuse-protection handshake.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from consumer_kit.delivery import Delivery, Dispatch, Result
from consumer_kit.errors import UnparseableDelivery
from consumer_kit.http import (
    DEFAULT_BODY_LIMIT,
    MAX_JSON_DEPTH,
    MalformedRequest,
    Unauthenticated,
    UnsupportedMediaType,
)
from consumer_kit.http.intake import HttpIntake, reject, respond, single_headers
from consumer_kit.keys import OperationKey
from consumer_kit.settings import Settings
from consumer_kit.sources.cloudevents.message import (
    CloudEventDelivery,
    InvalidEvent,
    dump_document,
    from_binary,
    from_structured,
    invalid,
    parse_document,
)
from consumer_kit.sources.cloudevents.settlement import batch_response
from consumer_kit.tracing import TRACE_HEADERS

STRUCTURED = "application/cloudevents+json"
BATCH = "application/cloudevents-batch+json"
NOT_JSON = f"the body is not JSON (UTF-8, nested at most {MAX_JSON_DEPTH} levels deep)"
TRACING_ATTRIBUTES = ("traceparent", "tracestate")
"""The distributed-tracing extension: middleware may add it to an event that had none, so by
default it is left out of the fingerprint (see ``volatile_attributes``)."""


class TooManyEvents(UnparseableDelivery):
    """A batch of more events than ``CLOUDEVENTS_MAX_BATCH_EVENTS``: parked whole, once."""

    reason = "too_many_events"


class CloudEventsSource(HttpIntake):
    """CloudEvents POSTed to ``path`` in binary or structured mode, and in batched mode with
    ``batch=True``; keyed ``namespace:v<version>:<source>#<id>``.

    ``bearer_tokens`` (optional) are the accepted ``Authorization: Bearer`` tokens; ``allowed_origins``
    the origins granted by the abuse-protection handshake, at ``allowed_rate`` requests per minute
    (``None``: unlimited, ``*``). ``volatile_attributes`` are extension attributes that may differ
    between deliveries of one event (intermediaries add them); they are left out of the fingerprint.
    """

    methods: tuple[str, ...] = ("POST", "OPTIONS")

    def __init__(self, *, path: str, namespace: str, version: int, name: str | None = None,
                 batch: bool = False, bearer_tokens: str | Sequence[str] = (),
                 allowed_origins: Sequence[str] = (), allowed_rate: int | None = None,
                 body_limit: int = DEFAULT_BODY_LIMIT,
                 volatile_attributes: Sequence[str] = TRACING_ATTRIBUTES) -> None:
        super().__init__(path=path, namespace=namespace, version=version,
                         name=name or f"cloudevents:{namespace}", body_limit=body_limit)
        core = {"id", "source", "specversion", "type", "datacontenttype", "dataschema", "subject", "time"}
        if core & set(volatile_attributes):
            raise ValueError("volatile_attributes may name extension attributes only")
        self.batch = batch
        tokens = [bearer_tokens] if isinstance(bearer_tokens, str) else list(bearer_tokens)
        self._tokens = [token.encode("utf-8") for token in tokens if token]
        self.allowed_origins = frozenset(allowed_origins)
        self.allowed_rate = allowed_rate
        self.volatile_attributes = frozenset(volatile_attributes)
        self.max_batch_events: int = Settings.model_fields["cloudevents_max_batch_events"].default

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        """Accept events; the batch cap is the app's ``CLOUDEVENTS_MAX_BATCH_EVENTS``."""
        self.max_batch_events = settings.cloudevents_max_batch_events
        await super().start(dispatch, settings)

    def key(self, delivery: Delivery) -> OperationKey:
        """``namespace:v<version>:<source>#<id>``; raises MissingStableId or UnparseableDelivery
        (an invalid event's problem). A plain Delivery is read as binary form with decoded values."""
        if not isinstance(delivery, CloudEventDelivery):
            delivery = from_binary(delivery.headers, delivery.body, percent_encoded=False)
        if delivery.problem is not None:
            raise delivery.problem
        assert delivery.id is not None  # a valid event always has source and id
        return OperationKey(self.namespace, self.version, delivery.id)

    async def handle(self, request: Request) -> Response:
        """The handshake (OPTIONS) or one delivery request (POST)."""
        if request.method == "OPTIONS":
            return self._handshake(request)
        return await super().handle(request)

    async def receive(self, request: Request, dispatch: Dispatch) -> Response:
        """Read one request's events (see the module docstring) and answer their verdicts."""
        self._authenticate(request)
        headers = single_headers(request, ("content-type",), single_prefix="ce-")
        body = await self.read_body(request)
        media = _media_type(headers)
        # An event's delivery keeps only its own attributes as headers; the request's trace context
        # goes along, so that the delivery continues the request's trace (consumer_kit.tracing).
        carried = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        if carried:
            dispatch = _carrying(dispatch, carried)
        if media == BATCH:
            if not self.batch:
                raise UnsupportedMediaType()
            return await self._receive_batch(body, headers["content-type"], dispatch)
        if media == STRUCTURED:
            try:
                document = parse_document(body)
            except ValueError:
                event = invalid(Delivery(id=None, body=body, headers=headers), InvalidEvent(NOT_JSON))
            else:
                event = from_structured(document, body, volatile=self.volatile_attributes)
            return respond(await dispatch(event))
        if media.startswith("application/cloudevents"):
            raise UnsupportedMediaType()  # another event format (XML, Avro, Protobuf ...)
        if not any(name.startswith("ce-") for name in headers):
            raise UnsupportedMediaType()
        return respond(await dispatch(from_binary(headers, body, volatile=self.volatile_attributes)))

    async def _receive_batch(self, body: bytes, content_type: str, dispatch: Dispatch) -> Response:
        raw = Delivery(id=None, body=body, headers={"content-type": content_type})
        try:
            events = parse_document(body)
        except ValueError:
            return respond(await dispatch(invalid(raw, InvalidEvent(NOT_JSON))))
        if not isinstance(events, list):
            return respond(await dispatch(invalid(raw, InvalidEvent("a batch is not a JSON array"))))
        if len(events) > self.max_batch_events:
            problem = TooManyEvents(f"a batch of {len(events)} events, over CLOUDEVENTS_MAX_BATCH_EVENTS "
                                    f"({self.max_batch_events})")
            return respond(await dispatch(invalid(raw, problem)))
        results = [await dispatch(from_structured(event, dump_document(event), volatile=self.volatile_attributes))
                   for event in events]
        return batch_response(results)

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


def _carrying(dispatch: Dispatch, carried: Mapping[str, str]) -> Dispatch:
    async def with_context(delivery: Delivery) -> Result:
        return await dispatch(replace(delivery, headers={**delivery.headers, **carried}))

    return with_context


def _media_type(headers: Mapping[str, str]) -> str:
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()
