"""The suite-wide guard against raw keys in logs, metric labels and spans must be able to fail."""

from __future__ import annotations

import logging

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter

from consumer_kit import OperationKey
from tests.conftest import _Capture, raw_keys_in, span_texts


def test_guard_sees_a_logged_key(no_raw_keys_in_logs_or_metrics: _Capture) -> None:
    key = OperationKey("guard", 1, "guard-secret-id-0001")
    logging.getLogger("consumer_kit.test").info("oops %s", key)
    assert raw_keys_in(no_raw_keys_in_logs_or_metrics.texts) == [str(key)]
    no_raw_keys_in_logs_or_metrics.texts.clear()  # or the guard fails this test, as it should


def test_guard_sees_a_derived_key_in_a_label() -> None:
    key = OperationKey("guard", 1, "guard-secret-id-0002")
    derived = key.derive("carrier")
    registry = CollectorRegistry()
    Counter("guard_total", "test", ["k"], registry=registry).labels(derived).inc()
    values = [v for f in registry.collect() for s in f.samples for v in s.labels.values()]
    assert raw_keys_in(values) == sorted([derived, str(key)])  # the derived key contains the key


def test_guard_sees_a_key_in_any_part_of_a_span() -> None:
    key = OperationKey("guard", 1, "guard-secret-id-0003")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("guard")
    where = ["name", "attribute", "event", "link", "status"]
    for part in where:
        span = tracer.start_span(str(key) if part == "name" else "process",
                                 attributes={"k": str(key)} if part == "attribute" else None,
                                 links=[Link(SpanContext(1, 1, False), {"k": str(key)})] if part == "link" else None)
        if part == "event":
            span.add_event("exception", {"exception.message": f"boom {key}"})
        if part == "status":
            span.set_status(Status(StatusCode.ERROR, f"boom {key}"))
        span.end()
    spans = exporter.get_finished_spans()
    assert [raw_keys_in(span_texts([span])) for span in spans] == [[str(key)]] * len(where)
