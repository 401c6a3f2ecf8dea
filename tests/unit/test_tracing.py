"""Tracing on the in-memory source and SQLite: the spans of each path, what they carry (the key's
digest, never the key), context in and out, and that with no tracer provider nothing happens at all."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, StatusCode

from consumer_kit import ConsumerApp, Context, OperationKey, Settings, TerminalError
from consumer_kit.coordinator import HttpCoordinator
from consumer_kit.logs import JsonFormatter, TextFormatter
from consumer_kit.pipeline import Batch
from consumer_kit.testing import InMemorySource
from consumer_kit.testing.server import served_coordinator
from consumer_kit.tracing import current_headers, start
from consumer_kit.tracing.spans import incoming
from tests.conftest import SPANS, Spans, hex_span, make_settings

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def settings(sqlite_url: str) -> Settings:
    return make_settings(sqlite_url)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_delivery_continues_its_trace_with_a_child_span_per_step(settings: Settings, spans: Spans) -> None:
    app = ConsumerApp(settings, tracer_provider=spans.provider)
    source = InMemorySource(namespace="orders", version=1)
    records = Records()
    logging.getLogger("tests.handler").addHandler(records)
    own = f"00-{'1' * 32}-{'2' * 16}-01"
    ids: list[str] = []

    @app.handler(source, labels=["agent"])
    async def handle(ctx: Context) -> None:
        logging.getLogger("tests.handler").warning("handling")
        ids.append(ctx.outbox.publish("shipments", b"{}"))
        ids.append(ctx.outbox.publish("audit", b"{}", headers={"traceparent": own}))

    try:
        async with app.running():
            result = await source.deliver(id="order-000123", body=b"{}", headers={"traceparent": TRACEPARENT})
            assert result.outcome.value == "processed"
            rows = [await app.outbox.get(i) for i in ids]
    finally:
        logging.getLogger("tests.handler").removeHandler(records)
    delivery = spans.one("process memory:orders")
    assert delivery.kind is SpanKind.INTERNAL  # a source that declares no shape
    assert delivery.parent is not None and format(delivery.parent.span_id, "016x") == PARENT_ID
    assert format(delivery.context.trace_id, "032x") == TRACE_ID
    attributes = dict(delivery.attributes or {})
    assert attributes["consumer_kit.key.digest"] == result.key_digest
    assert attributes["consumer_kit.key.namespace"] == "orders" and attributes["consumer_kit.key.version"] == 1
    assert attributes["consumer_kit.outcome"] == "processed" and attributes["consumer_kit.settlement"] == "ack"
    assert "messaging.message.id" not in attributes  # the message id is the key's id here: not shown
    assert sorted(s.name for s in spans.children(delivery)) == ["claim", "commit", "coordinator.session", "handler"]
    handler = spans.one("handler")
    trace_id, span_id = hex_span(handler)
    # The handler's context went with the outbox row; a traceparent the handler set itself won.
    assert rows[0] is not None and rows[0]["headers"]["traceparent"] == f"00-{trace_id}-{span_id}-01"
    assert rows[1] is not None and rows[1]["headers"]["traceparent"] == own
    # Log records made inside the handler carry its span.
    assert (records.records[0].__dict__["trace_id"], records.records[0].__dict__["span_id"]) == (trace_id, span_id)


async def test_a_failing_handler_is_recorded_with_the_key_redacted(settings: Settings, spans: Spans) -> None:
    app = ConsumerApp(settings, tracer_provider=spans.provider)
    source = InMemorySource(namespace="orders", version=1)

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        raise TerminalError(f"no such customer in {ctx.key} ({ctx.key.id})", reason="unknown_customer")

    async with app.running():
        result = await source.deliver(id="order-000777", body=b"{}")
    assert result.reason == "unknown_customer"
    delivery = spans.one("process memory:orders")
    assert delivery.parent is None  # nothing carried: a trace of its own
    assert delivery.status.status_code is StatusCode.ERROR and delivery.status.description == "unknown_customer"
    handler = spans.one("handler")
    assert handler.status.status_code is StatusCode.ERROR
    (event,) = handler.events
    attributes = dict(event.attributes or {})
    assert event.name == "exception" and attributes["exception.type"] == "consumer_kit.errors.TerminalError"
    assert attributes["exception.message"] == "no such customer in <key> (<key>)"
    raw = str(OperationKey("orders", 1, "order-000777"))
    assert raw not in str(attributes["exception.stacktrace"]) and "order-000777" not in str(handler.status.description)
    assert not spans.named("commit")  # the transaction never got that far


async def test_duplicates_and_the_single_transaction_path(settings: Settings, spans: Spans) -> None:
    app = ConsumerApp(settings, tracer_provider=spans.provider)
    source = InMemorySource(namespace="orders", version=1)

    @app.handler(source, single_transaction=True)
    async def handle(ctx: Context) -> None:
        return None

    async with app.running():
        await source.deliver(id="order-000001", body=b"{}")
        duplicate = await source.deliver(id="order-000001", body=b"{}")
    assert duplicate.outcome.value == "duplicate"
    first, second = spans.named("process memory:orders")
    # SQLite: a read before the claim, which the transaction then makes (both are the claim's).
    assert sorted(s.name for s in spans.children(first)) == ["claim", "claim", "commit", "handler"]
    assert [s.name for s in spans.children(second)] == ["claim"]  # found done: nothing else ran
    assert dict(second.attributes or {})["consumer_kit.outcome"] == "duplicate"
    assert second.status.status_code is StatusCode.UNSET


async def test_a_batch_is_a_trace_of_its_own_linked_to_each_delivery(settings: Settings, spans: Spans) -> None:
    app = ConsumerApp(settings, tracer_provider=spans.provider)
    source = InMemorySource(namespace="orders", version=1)

    @app.handler(source, single_transaction=True, batch=Batch(max_size=3, max_wait_ms=1000))
    async def handle(ctx: Context) -> None:
        return None

    parents = [f"00-{format(i + 1, '032x')}-{format(i + 1, '016x')}-01" for i in range(3)]
    async with app.running():
        results = await asyncio.gather(*(source.deliver(id=f"order-00000{i}", body=b"{}",
                                                        headers={"traceparent": parents[i]}) for i in range(3)))
    assert {r.outcome.value for r in results} == {"processed"}
    batch = spans.one("batch memory:orders")
    assert batch.parent is None and dict(batch.attributes or {})["consumer_kit.batch.size"] == 3
    deliveries = spans.named("process memory:orders")
    assert {link.context.span_id for link in batch.links} == {d.context.span_id for d in deliveries}
    assert sorted(s.name for s in spans.children(batch)) == ["claim", "commit"]
    for delivery in deliveries:  # each handler its delivery's child, linked to the batch
        (handler,) = spans.children(delivery)
        assert handler.name == "handler" and [link.context.span_id for link in handler.links] == [batch.context.span_id]
    assert {d.parent.span_id for d in deliveries if d.parent is not None} == {1, 2, 3}  # each its own producer's


async def test_with_no_tracer_provider_nothing_is_traced(settings: Settings) -> None:
    # OpenTelemetry's defaults: the global provider before any is set, the no-op one, a disabled SDK.
    assert start(trace.ProxyTracerProvider()) is None
    assert start(trace.NoOpTracerProvider()) is None
    os.environ["OTEL_SDK_DISABLED"] = "true"
    try:
        assert start(TracerProvider()) is None
    finally:
        del os.environ["OTEL_SDK_DISABLED"]
    app = ConsumerApp(settings, tracer_provider=trace.NoOpTracerProvider())
    source = InMemorySource(namespace="orders", version=1)
    ids: list[str] = []

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        ids.append(ctx.outbox.publish("shipments", b"{}"))

    SPANS.clear()
    async with app.running():
        assert app.pipeline.tracer is None and app.pipeline.batched.tracer is None
        await source.deliver(id="order-000123", body=b"{}", headers={"traceparent": TRACEPARENT})
        row = await app.outbox.get(ids[0])
    assert row is not None and row["headers"] == {}
    assert not SPANS.get_finished_spans()


BLOCKED = """
import asyncio, sys
from importlib.abc import MetaPathFinder

class NoOpenTelemetry(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoOpenTelemetry())
from consumer_kit import ConsumerApp, Context
from consumer_kit.testing import InMemorySource
from consumer_kit import Settings

async def main():
    app = ConsumerApp(Settings(database_url=sys.argv[1], idempotency_hmac_key="test-hmac-key-0123456789abcdef"))
    source = InMemorySource(namespace="orders", version=1)
    ids = []

    @app.handler(source, labels=["agent"])
    async def handle(ctx: Context) -> None:
        ids.append(ctx.outbox.publish("shipments", b"{}"))

    async with app.running():
        result = await source.deliver(id="order-000123", body=b"{}", headers={"traceparent": sys.argv[2]})
        row = await app.outbox.get(ids[0])
        async with app.engine.begin() as conn:
            await app.outbox.enqueue(conn, "shipments", b"{}")
    loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
    print(result.outcome.value, row["headers"], loaded)

asyncio.run(main())
"""


def test_without_the_api_installed_nothing_changes(sqlite_url: str) -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKED, sqlite_url, TRACEPARENT], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "processed {} []"


def test_the_context_a_delivery_carries() -> None:
    def parent(headers: dict[str, str]) -> tuple[str, str] | None:
        context, _links = incoming(headers)
        found = trace.get_current_span(context).get_span_context()
        return (format(found.trace_id, "032x"), format(found.span_id, "016x")) if found.is_valid else None

    assert parent({"traceparent": TRACEPARENT}) == (TRACE_ID, PARENT_ID)
    assert parent({"Traceparent": TRACEPARENT}) == (TRACE_ID, PARENT_ID)  # AMQP and SQS keep the sender's case
    assert parent({"traceparent": "00-not-a-trace-01"}) is None
    assert parent({}) is None
    xray = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"
    assert parent({"x-amzn-trace-id": xray}) == ("5759e988bd862e3fe1be46a994272793", "53995c3f42cd8ad8")
    assert parent({"x-amzn-trace-id": "Root=1-5759e988-bd86;Parent=53995c3f42cd8ad8"}) is None
    assert parent({"traceparent": TRACEPARENT, "x-amzn-trace-id": xray}) == (TRACE_ID, PARENT_ID)
    # CloudEvents' distributed-tracing extension: the parent without a transport context, else a link.
    event = f"00-{'a' * 32}-{'b' * 16}-01"
    assert parent({"ce-traceparent": event}) == ("a" * 32, "b" * 16)
    context, links = incoming({"traceparent": TRACEPARENT, "ce-traceparent": event})
    assert format(trace.get_current_span(context).get_span_context().span_id, "016x") == PARENT_ID
    assert [format(link.context.span_id, "016x") for link in links] == ["b" * 16]


async def test_http_calls_and_the_coordinator_carry_the_trace(settings: Settings, spans: Spans) -> None:
    seen: dict[str, dict[str, str]] = {}
    tokens = {"secret-token": ("tenant", "worker")}

    async with served_coordinator(make_settings(settings.database_url.replace(".db", "-c.db")), tokens) as url:
        async def record(request: httpx.Request) -> None:
            seen[str(request.url)] = dict(request.headers)

        # A client of the caller's own goes through httpx's event hooks: they see what is sent.
        client = httpx.AsyncClient(event_hooks={"request": [record]})
        coordinator = HttpCoordinator(url, token="secret-token", client=client)
        app = ConsumerApp(settings, coordinator=coordinator, tracer_provider=spans.provider)
        source = InMemorySource(namespace="orders", version=1)

        @app.handler(source, labels=["agent"])
        async def handle(ctx: Context) -> None:
            assert ctx.http is not None
            response = await ctx.http.get(f"{url}/healthz")
            seen["ctx.http"] = dict(response.request.headers)

        async with app.running():
            result = await source.deliver(id="order-000123", body=b"{}", headers={"traceparent": TRACEPARENT})
        await client.aclose()
    assert result.outcome.value == "processed", result
    session = spans.one("coordinator.session")
    trace_id, span_id = hex_span(session)
    assert seen[f"{url}/v1/sessions"]["traceparent"] == f"00-{trace_id}-{span_id}-01"
    handler_trace, handler_span = hex_span(spans.one("handler"))
    assert seen["ctx.http"]["traceparent"] == f"00-{handler_trace}-{handler_span}-01"
    assert trace_id == handler_trace == TRACE_ID


def test_log_lines_name_the_delivery_and_its_trace() -> None:
    record = logging.LogRecord("consumer_kit.pipeline", logging.WARNING, __file__, 1, "delivery parked: %s",
                               ("conflict",), None)
    record.__dict__.update(namespace="orders", key_digest="9c9657ed4b02c0ec", trace_id=TRACE_ID,
                           span_id=PARENT_ID)
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "delivery parked: conflict" and parsed["level"] == "WARNING"
    assert (parsed["namespace"], parsed["key_digest"], parsed["trace_id"], parsed["span_id"]) == \
        ("orders", "9c9657ed4b02c0ec", TRACE_ID, PARENT_ID)
    assert TextFormatter().format(record).endswith(f"delivery parked: conflict trace_id={TRACE_ID} span_id={PARENT_ID}")
    assert current_headers() == {}  # no span is current here


async def test_a_cloudevent_continues_its_request_and_links_its_own_trace(settings: Settings, spans: Spans) -> None:
    from consumer_kit.sources.cloudevents import CloudEventsSource

    app = ConsumerApp(settings, tracer_provider=spans.provider)

    @app.handler(CloudEventsSource(path="/events", namespace="shop", version=1, batch=True))
    async def handle(ctx: Context) -> None:
        return None

    event_context = f"00-{'a' * 32}-{'b' * 16}-01"
    binary = {"ce-specversion": "1.0", "ce-type": "order.created", "ce-source": "/shop", "ce-id": "E-1",
              "content-type": "application/json", "ce-traceparent": event_context, "traceparent": TRACEPARENT}
    batch = [{"specversion": "1.0", "type": "order.created", "source": "/shop", "id": "E-2", "data": {},
              "traceparent": event_context}]
    async with app.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app.asgi()),
                                                base_url="http://sink") as client:
        assert (await client.post("/events", content=b"{}", headers=binary)).status_code == 200
        # A batch without a request context: the event's own is the parent.
        assert (await client.post("/events", json=batch,
                                  headers={"content-type": "application/cloudevents-batch+json"})).status_code == 200
    carried, own = spans.named("process cloudevents:shop")
    assert carried.kind is SpanKind.SERVER and dict(carried.attributes or {})["http.route"] == "/events"
    assert carried.parent is not None and format(carried.parent.span_id, "016x") == PARENT_ID
    assert [format(link.context.span_id, "016x") for link in carried.links] == ["b" * 16]
    assert own.parent is not None and format(own.parent.span_id, "016x") == "b" * 16 and not own.links
