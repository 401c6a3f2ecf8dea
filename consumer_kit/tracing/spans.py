"""The spans themselves (see :mod:`consumer_kit.tracing`); imported only once tracing is on."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from consumer_kit.delivery import Delivery, Outcome, Result, Settlement
from consumer_kit.keys import OperationKey
from consumer_kit.redaction import SHORTEST_SECRET_ID, describe, format_exception, redact
from consumer_kit.tracing.shape import INTERNAL, SpanShape

if TYPE_CHECKING:
    from consumer_kit.outbox import OutboxMessage
    from consumer_kit.pipeline.spec import HandlerSpec
    from consumer_kit.pipeline.work import Work

_KINDS = {"consumer": SpanKind.CONSUMER, "server": SpanKind.SERVER, "internal": SpanKind.INTERNAL}
_FAILED = frozenset({Outcome.RETRY, Outcome.LEASE_LOST})
XRAY_HEADER = "x-amzn-trace-id"
"""AWS X-Ray's trace header (HTTP); the SQS source hands SQS's ``AWSTraceHeader`` on under this name."""


class _Headers(Getter[Mapping[str, str]]):
    """Reads propagation fields from delivery headers, whatever their case (HTTP lower-cases them;
    AMQP and SQS keep what the producer wrote), optionally under a prefix (CloudEvents' ``ce-``)."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        name = self.prefix + key
        value = carrier.get(name)
        if value is None:
            lowered = name.lower()
            value = next((v for k, v in carrier.items() if k.lower() == lowered), None)
        return None if value is None else [value]

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return [k[len(self.prefix):] for k in carrier if k.lower().startswith(self.prefix)]


_TRANSPORT = _Headers()
_CLOUDEVENT = _Headers("ce-")


def incoming(headers: Mapping[str, str]) -> tuple[Context, list[Link]]:
    """The context a delivery continues, and the links it carries besides: the transport's
    propagation headers; else AWS X-Ray's; the CloudEvents extension (``ce-traceparent``) as the parent
    when the transport carried none, else as a link (the event's creation, behind its transport)."""
    links: list[Link] = []
    if not headers:
        return Context(), links
    parent = propagate.extract(headers, context=Context(), getter=_TRANSPORT)
    transport = trace.get_current_span(parent).get_span_context()
    if not transport.is_valid:
        xray = _xray(_TRANSPORT.get(headers, XRAY_HEADER))
        if xray is not None:
            parent, transport = trace.set_span_in_context(NonRecordingSpan(xray), parent), xray
    event_context = propagate.extract(headers, context=Context(), getter=_CLOUDEVENT)
    event = trace.get_current_span(event_context).get_span_context()
    if event.is_valid:
        if not transport.is_valid:
            return event_context, links
        if (event.trace_id, event.span_id) != (transport.trace_id, transport.span_id):
            links.append(Link(event, {"consumer_kit.link": "cloudevent"}))
    return parent, links


_XRAY_ROOT = re.compile(r"^1-([0-9a-fA-F]{8})-([0-9a-fA-F]{24})$")
_XRAY_PARENT = re.compile(r"^[0-9a-fA-F]{16}$")


def _xray(values: list[str] | None) -> SpanContext | None:
    """An X-Ray trace header (``Root=1-<8 hex>-<24 hex>;Parent=<16 hex>;Sampled=1``) as a span context.
    Hand-written: the ``otel`` extra is the API alone, and the format is these three fields."""
    if not values:
        return None
    fields = dict(part.strip().partition("=")[::2] for part in values[0].split(";"))
    root, parent = _XRAY_ROOT.match(fields.get("Root", "")), fields.get("Parent", "")
    if root is None or not _XRAY_PARENT.match(parent):
        return None
    span = SpanContext(int(root.group(1) + root.group(2), 16), int(parent, 16), is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED if fields.get("Sampled") == "1" else 0))
    return span if span.is_valid else None


def record(span: Span, exc: BaseException, key: OperationKey | None) -> None:
    """Mark ``span`` failed by ``exc``, as an ``exception`` event whose message and stack trace have
    the raw key redacted (OpenTelemetry's own ``record_exception`` would copy them as they are)."""
    if isinstance(exc, asyncio.CancelledError):
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
        return
    span.add_event("exception", {
        "exception.type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "exception.message": redact(str(exc), key)[:1000],
        "exception.stacktrace": format_exception(exc, key),
    })
    span.set_status(Status(StatusCode.ERROR, describe(exc, key)))


class Child:
    """A child span of a delivery (or a batch), current while the block runs; an exception leaving the
    block is recorded redacted, then passed on."""

    __slots__ = ("_attributes", "_key", "_links", "_name", "_parent", "_span", "_token", "_tracer")

    def __init__(self, tracer: trace.Tracer, name: str, parent: Context, key: OperationKey | None,
                 attributes: Mapping[str, Any] | None = None, links: Sequence[Link] | None = None) -> None:
        self._tracer, self._name, self._parent, self._key = tracer, name, parent, key
        self._attributes, self._links = attributes, links
        self._span: Span | None = None
        self._token: object = None

    def __enter__(self) -> Span:
        self._span = span = self._tracer.start_span(self._name, context=self._parent, attributes=self._attributes,
                                                    links=self._links)
        self._token = otel_context.attach(trace.set_span_in_context(span, self._parent))
        return span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self._span is not None
        otel_context.detach(self._token)  # type: ignore[arg-type]
        if exc is not None:
            record(self._span, exc, self._key)
        self._span.end()


class Commit:
    """The ``commit`` span of a transaction: started by calling it (after the handler), ended when the
    block around the transaction is left, so that it covers the completion and the COMMIT."""

    __slots__ = ("_child", "_make")

    def __init__(self, make: Any) -> None:
        self._make = make
        self._child: Child | None = None

    def __call__(self) -> None:
        self._child = self._make()
        self._child.__enter__()

    def __enter__(self) -> Commit:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._child is not None:
            self._child.__exit__(kind, exc, tb)


class DeliveryTrace:
    """The span of one delivery, current from :meth:`DeliveryTracer.delivery` to :meth:`end`."""

    __slots__ = ("_token", "context", "key", "span", "tracer")

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        self.context = trace.set_span_in_context(span)
        self.key: OperationKey | None = None
        self._token = otel_context.attach(self.context)

    def keyed(self, delivery: Delivery, key: OperationKey, digest: str) -> None:
        """Name the key by its digest (and namespace and version, which are no secret). The message id
        is added only when it is not the key's id: otherwise it would be the raw key by another name."""
        self.key = key
        self.span.set_attributes({"consumer_kit.key.namespace": key.namespace,
                                  "consumer_kit.key.version": key.version, "consumer_kit.key.digest": digest})
        # (A short id is no secret, as in redact(); a longer one inside the message id would be the key.)
        if delivery.id is not None and delivery.id != key.id and not (
                len(key.id) >= SHORTEST_SECRET_ID and key.id in delivery.id):
            self.span.set_attribute("messaging.message.id", delivery.id)

    def child(self, name: str, *, attributes: Mapping[str, Any] | None = None,
              links: Sequence[Link] | None = None) -> Child:
        """A child span (see :class:`Child`)."""
        return Child(self.tracer, name, self.context, self.key, attributes, links)

    def commit(self) -> Commit:
        """The ``commit`` span (see :class:`Commit`)."""
        return Commit(lambda: self.child("commit"))

    def end(self, result: Result | None, exc: BaseException | None = None) -> None:
        """End the span with the pipeline's verdict (or the exception no verdict came of)."""
        span = self.span
        try:
            if result is not None:
                span.set_attribute("consumer_kit.outcome", result.outcome.value)
                span.set_attribute("consumer_kit.settlement", result.settlement.value)
                if result.reason:
                    span.set_attribute("consumer_kit.reason", result.reason)
                if result.settlement is Settlement.DEAD_LETTER or result.outcome in _FAILED:
                    span.set_status(Status(StatusCode.ERROR, result.reason or result.outcome.value))
            if exc is not None:
                record(span, exc, self.key)
            span.end()
        finally:
            otel_context.detach(self._token)


class BatchTrace:
    """The span of one batch (its transactions, its retries): a trace of its own, linked to each
    delivery's span; current inside ``with``, and ended when the block is left."""

    __slots__ = ("_token", "context", "link", "span", "tracer")

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        self.context = trace.set_span_in_context(span, Context())
        self.link = [Link(span.get_span_context(), {"consumer_kit.link": "batch"})]
        self._token: object = None

    def child(self, name: str) -> Child:
        """A child span of the batch (its claim, its commit)."""
        return Child(self.tracer, name, self.context, None)

    def commit(self) -> Commit:
        """The batch's ``commit`` span (see :class:`Commit`)."""
        return Commit(lambda: self.child("commit"))

    def __enter__(self) -> BatchTrace:
        self._token = otel_context.attach(self.context)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        otel_context.detach(self._token)  # type: ignore[arg-type]
        if exc is not None:
            record(self.span, exc, None)
        self.span.end()


class DeliveryTracer:
    """Makes the spans of deliveries, batches and relayed messages with one OpenTelemetry tracer."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        # Per source (by identity; the source is kept alive here): span name, kind, fixed attributes.
        self._shapes: dict[int, tuple[object, str, SpanShape, dict[str, Any]]] = {}

    def _shape(self, spec: HandlerSpec) -> tuple[str, SpanShape, dict[str, Any]]:
        found = self._shapes.get(id(spec.source))
        if found is None:
            source = spec.source
            shape = getattr(source, "span_shape", None)
            shape = shape if isinstance(shape, SpanShape) else INTERNAL
            attributes: dict[str, Any] = {"consumer_kit.source": source.name, "consumer_kit.consumer": spec.consumer}
            if shape.system is not None:
                attributes["messaging.system"] = shape.system
            if shape.destination is not None:
                attributes["messaging.destination.name"] = shape.destination
            if shape.kind == "consumer":
                attributes["messaging.operation"] = attributes["messaging.operation.type"] = "process"
            attributes.update(shape.attributes)
            found = self._shapes[id(source)] = (source, f"process {source.name}", shape, attributes)
        return found[1], found[2], found[3]

    def delivery(self, spec: HandlerSpec, delivery: Delivery) -> DeliveryTrace:
        """Start (and make current) the span of one delivery, continuing the context it carries. An
        HTTP source's delivery inside a span already current (a server instrumentation's) is that
        span's child, of kind internal, linked to the request's context."""
        name, shape, fixed = self._shape(spec)
        parent, links = incoming(delivery.headers)
        kind = _KINDS[shape.kind]
        if shape.kind == "server":
            ambient = trace.get_current_span().get_span_context()
            if ambient.is_valid:
                carried = trace.get_current_span(parent).get_span_context()
                if carried.is_valid and carried.span_id != ambient.span_id:
                    links.append(Link(carried, {"consumer_kit.link": "request"}))
                parent, kind = otel_context.get_current(), SpanKind.INTERNAL
        attributes = dict(fixed)
        attributes["consumer_kit.attempt"] = delivery.attempt
        span = self.tracer.start_span(name, context=parent, kind=kind, attributes=attributes, links=links)
        return DeliveryTrace(self.tracer, span)

    def request(self, name: str, attributes: Mapping[str, Any], headers: Mapping[str, str]) -> Span:
        """The SERVER span of one request to an idempotent endpoint, continuing the context its headers
        carry (inside a server instrumentation's span: that span's child, internal). It is not made
        current: the request's steps may run in other tasks than the one that ends it; the caller ends
        it (:func:`end_request`)."""
        parent, links = incoming(headers)
        kind = SpanKind.SERVER
        if trace.get_current_span().get_span_context().is_valid:
            parent, kind = otel_context.get_current(), SpanKind.INTERNAL
        return self.tracer.start_span(name, context=parent, kind=kind, attributes=dict(attributes), links=links)

    def batch(self, works: Iterable[Work]) -> BatchTrace:
        """Start the span of a batch transaction, linked to the span of each delivery in it."""
        works = list(works)
        links = [Link(w.trace.span.get_span_context()) for w in works if w.trace is not None]
        _name, _shape, fixed = self._shape(works[0].spec)
        attributes = {k: v for k, v in fixed.items() if not k.startswith("messaging.operation")}
        attributes["consumer_kit.batch.size"] = len(works)
        span = self.tracer.start_span(f"batch {works[0].spec.source.name}", context=Context(), links=links,
                                      attributes=attributes)
        return BatchTrace(self.tracer, span)

    def send(self, message: OutboxMessage, system: str | None) -> tuple[Span, dict[str, str]]:
        """The relay's ``send`` span of one outbox row (a child of the context the row was written
        in), and the row's headers carrying that span's context instead."""
        parent, _links = incoming(message.headers)
        attributes: dict[str, Any] = {"messaging.operation": "send", "messaging.operation.type": "send",
                                      "messaging.destination.name": message.destination,
                                      "messaging.message.id": message.id}
        if system is not None:
            attributes["messaging.system"] = system
        span = self.tracer.start_span(f"send {message.destination}", context=parent, kind=SpanKind.PRODUCER,
                                      attributes=attributes)
        fields = {name.lower() for name in propagate.get_global_textmap().fields}
        headers = {k: v for k, v in message.headers.items() if k.lower() not in fields}
        propagate.inject(headers, context=trace.set_span_in_context(span, parent))
        return span, headers


_LOG_IDS_INSTALLED = False


def install_log_ids() -> None:
    """From now on every log record made while a span is current carries ``trace_id`` and
    ``span_id`` (hex, as exporters show them), whatever handler formats it (once per process)."""
    global _LOG_IDS_INSTALLED
    if _LOG_IDS_INSTALLED:
        return
    _LOG_IDS_INSTALLED = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made = previous(*args, **kwargs)
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            made.trace_id = format(span.trace_id, "032x")
            made.span_id = format(span.span_id, "016x")
        return made

    logging.setLogRecordFactory(factory)


def end_request(span: Span, status: int, outcome: str, exc: BaseException | None = None,
                key: OperationKey | None = None) -> None:
    """End an idempotent request's span (:meth:`DeliveryTracer.request`) with its answer."""
    span.set_attribute("http.response.status_code", status)
    span.set_attribute("consumer_kit.outcome", outcome)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, outcome))
    if exc is not None:
        record(span, exc, key)
    span.end()
