"""Tracing with OpenTelemetry: a span per delivery, its trace carried through the outbox.

Needs the ``otel`` extra (``opentelemetry-api``) and a tracer provider the user configures (the SDK and
an exporter). Whether tracing is on is decided once, when the app (or a relay) starts: without the
API installed, or with OpenTelemetry's default provider (no SDK configured, or ``OTEL_SDK_DISABLED``),
:func:`start` answers ``None`` and the pipeline makes no span and reads no header; nothing of
OpenTelemetry is even imported. Configure the SDK before ``app.start()``.

What a traced delivery looks like (:mod:`consumer_kit.tracing.spans`)::

    process <source name>      CONSUMER (queues), SERVER (HTTP sources), INTERNAL (schedules, tests)
    │                          messaging.system, messaging.destination.name, messaging.operation,
    │                          consumer_kit.key.digest (never the key), outcome, settlement, reason
    ├── claim                  the inbox claim (or the read before it)
    ├── coordinator.session    the coordinator call (two-transaction handlers with labels or task)
    ├── handler                the handler and its writes; one per attempt; exceptions recorded redacted
    └── commit                 the inbox completion and the COMMIT

    batch <source name>        batched handlers: a trace of its own, linked to every delivery span;
    ├── claim, commit          the batch's one claim statement and one commit
                               (each delivery's handler span is its delivery span's child)

Context in: the delivery's headers, through the global propagator (W3C ``traceparent``/``tracestate``
by default): AMQP headers, SQS message attributes, HTTP headers; else SQS's ``AWSTraceHeader`` (or an
HTTP ``X-Amzn-Trace-Id``); the CloudEvents distributed-tracing extension (``ce-traceparent``) is the
parent when the transport carries none, and a link when it does. Context out: each outbox row a
handler writes carries the handler span's context in its headers (:func:`current_headers`); the
relay publishes it (inside a ``send`` span of its own when the relay traces too), so the next
consumer continues the trace. ``ctx.http`` and :class:`~consumer_kit.coordinator.HttpCoordinator`
requests carry it too.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from consumer_kit.tracing.shape import INTERNAL, SpanShape

if TYPE_CHECKING:
    import httpx

    from consumer_kit.tracing.spans import DeliveryTracer

__all__ = ["INTERNAL", "TRACE_HEADERS", "SpanShape", "current_headers", "inject_request", "start"]

TRACER_NAME = "consumer_kit"
TRACE_HEADERS = ("traceparent", "tracestate", "baggage", "x-amzn-trace-id")
"""The HTTP headers that carry a request's trace context (W3C, and AWS X-Ray's): an HTTP source whose
deliveries keep only some of the request's headers (a CloudEvent's) hands these on."""




def start(provider: Any = None) -> DeliveryTracer | None:
    """The tracer a starting app (or relay) uses, or ``None`` when tracing is off: the API is not
    installed, or ``provider`` (default: the global one) is OpenTelemetry's no-op default, or the SDK
    is disabled. Called once per start, so that every delivery after it pays for nothing when off."""
    if not _api_installed():
        return None
    from opentelemetry import trace

    if provider is None:
        provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    tracer = provider.get_tracer(TRACER_NAME, _version())
    if isinstance(tracer, (trace.NoOpTracer, trace.ProxyTracer)):
        return None
    from consumer_kit.tracing.spans import DeliveryTracer, install_log_ids

    install_log_ids()
    return DeliveryTracer(tracer)


def current_headers() -> dict[str, str]:
    """The current span's context as headers to send on (``traceparent`` and ``tracestate`` with the
    default propagator); empty when the API is not installed or no span is current."""
    if not _api_installed():
        return {}
    from opentelemetry import propagate, trace

    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@functools.cache
def _api_installed() -> bool:
    # Asked once: a failed import searches the whole path again every time it is tried.
    try:
        import opentelemetry.propagate
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return False
    return True


async def inject_request(request: httpx.Request) -> None:
    """An httpx ``request`` event hook: the current span's context goes with the request (a header
    the caller set, or a client instrumentation's, is left as it is)."""
    for name, value in current_headers().items():
        request.headers.setdefault(name, value)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("consumer-kit")
    except PackageNotFoundError:  # pragma: no cover - a source checkout that is not installed
        return "0"
