"""One trace through every hop, on the real services: a message (a RabbitMQ message, a webhook request, an
SQS message) published with a ``traceparent`` → its delivery span is that span's child → the outbox row its
handler wrote is published by ``consumer-kit outbox relay`` in another process, with a ``traceparent`` of
that trace → the next consumer's delivery span joins the same trace."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.rabbitmq import AmqpPublisher, RabbitMQSource
from consumer_kit.sources.webhooks import StandardWebhooksVerifier, WebhookSource
from consumer_kit.testing.server import served_asgi
from tests.conftest import TEST_HMAC_KEY, Spans, make_settings
from tests.integration.rabbit import AMQP_URL, declare, delete_queues, publish, wait_until
from tests.signing import standard_headers

pytestmark = [pytest.mark.postgres]

SECRET = "whsec_" + base64.b64encode(b"tracing-webhook-secret-01234567").decode()


def relay_process(env: dict[str, str], log: Path, app: str | None = None) -> subprocess.Popen[bytes]:
    """``consumer-kit outbox relay`` in a process of its own, logging JSON lines to ``log``. It has no
    tracer provider: the context a row was written with goes out as it was stored."""
    command = [str(Path(sys.executable).with_name("consumer-kit")), "outbox", "relay", *(["--app", app] if app else [])]
    with log.open("wb") as output:
        return subprocess.Popen(command, env=dict(env, LOG_FORMAT="json", OUTBOX_POLL_SECONDS="0.2"),
                                stdout=output, stderr=output, cwd=Path(__file__).parents[2])


@pytest.fixture
def relay_env(pg_database: str) -> dict[str, str]:
    return dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY, RABBITMQ_URL=AMQP_URL)


async def stop(relay: subprocess.Popen[bytes], log: Path) -> None:
    relay.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(relay.wait, 20)
    text = await asyncio.to_thread(log.read_text)
    assert code == 0, text
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert any(line["logger"] == "consumer_kit.outbox" for line in lines)  # LOG_FORMAT=json: a JSON object a line


@pytest.fixture
async def queues() -> AsyncIterator[tuple[str, str]]:
    names = (f"ck-trace-in-{secrets.token_hex(3)}", f"ck-trace-out-{secrets.token_hex(3)}")
    for name in names:
        await declare(name)
    yield names
    for name in names:
        await delete_queues(name)


def producer(spans: Spans, name: str, kind: SpanKind = SpanKind.PRODUCER) -> tuple[ReadableSpan | Any, dict[str, str]]:
    """A span of the sending side (ended at once), and the headers that carry it."""
    span = spans.provider.get_tracer("tests").start_span(name, kind=kind)
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(span))
    span.end()
    return span, headers


class Onward:
    """The second consumer: the queue the first handler's outbox row goes to."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    def attach(self, app: ConsumerApp, source: Any) -> None:
        @app.handler(source, name="onward")
        async def onward(ctx: Context) -> None:
            self.done.set()


def assert_joined(spans: Spans, first: str, onward: str, origin: Any, kind: SpanKind) -> None:
    """``first`` (the delivery span) is ``origin``'s child; ``onward``'s is the child of ``first``'s handler
    span, in the same trace."""
    delivery = spans.one(first)
    assert delivery.kind is kind
    assert delivery.parent is not None and delivery.parent.span_id == origin.context.span_id
    assert delivery.context.trace_id == origin.context.trace_id
    (handler,) = [s for s in spans.named("handler") if s.parent and s.parent.span_id == delivery.context.span_id]
    joined = spans.one(onward)
    assert joined.context.trace_id == origin.context.trace_id
    assert joined.parent is not None and joined.parent.span_id == handler.context.span_id
    assert dict(joined.attributes or {})["consumer_kit.outcome"] == "processed"


@pytest.mark.rabbitmq
async def test_a_rabbitmq_message_and_the_message_its_handler_wrote_are_one_trace(
        pg_database: str, queues: tuple[str, str], relay_env: dict[str, str], spans: Spans, tmp_path: Path) -> None:
    inbound, outbound = queues
    app = ConsumerApp(make_settings(pg_database, rabbitmq_url=AMQP_URL), tracer_provider=spans.provider)

    @app.handler(RabbitMQSource(queue=inbound, namespace="orders", version=1))
    async def handle(ctx: Context) -> None:
        ctx.outbox.publish(outbound, b'{"shipment": 1}')

    onward = Onward()
    onward.attach(app, RabbitMQSource(queue=outbound, namespace="shipments", version=1))
    log = tmp_path / "relay.log"
    relay = relay_process(relay_env, log)
    try:
        async with app.running():
            origin, headers = producer(spans, f"send {inbound}")
            await publish(inbound, [("order-000001", b"{}")], headers=headers)
            await asyncio.wait_for(onward.done.wait(), 30)
    finally:
        await stop(relay, log)
    assert_joined(spans, f"process rabbitmq:{inbound}", f"process rabbitmq:{outbound}", origin, SpanKind.CONSUMER)
    attributes = dict(spans.one(f"process rabbitmq:{inbound}").attributes or {})
    assert (attributes["messaging.system"], attributes["messaging.destination.name"],
            attributes["messaging.operation"]) == ("rabbitmq", inbound, "process")


@pytest.mark.rabbitmq
async def test_a_traced_relay_sends_in_a_producer_span_of_the_trace(
        pg_database: str, queues: tuple[str, str], spans: Spans) -> None:
    inbound, outbound = queues
    settings = make_settings(pg_database, rabbitmq_url=AMQP_URL, outbox_poll_seconds=0.1)
    app = ConsumerApp(settings, tracer_provider=spans.provider)
    app.relay_outbox(AmqpPublisher(settings=settings))

    @app.handler(RabbitMQSource(queue=inbound, namespace="orders", version=1))
    async def handle(ctx: Context) -> None:
        ctx.outbox.publish(outbound, b'{"shipment": 1}')

    onward = Onward()
    onward.attach(app, RabbitMQSource(queue=outbound, namespace="shipments", version=1))
    async with app.running():
        origin, headers = producer(spans, f"send {inbound}")
        await publish(inbound, [("order-000002", b"{}")], headers=headers)
        await asyncio.wait_for(onward.done.wait(), 30)
    (handler,) = [s for s in spans.named("handler") if s.context.trace_id == origin.context.trace_id
                  and s.parent and s.parent.span_id == spans.one(f"process rabbitmq:{inbound}").context.span_id]
    send = spans.one(f"send {outbound}")
    assert send.kind is SpanKind.PRODUCER and send.parent is not None and send.parent.span_id == handler.context.span_id
    assert dict(send.attributes or {})["messaging.system"] == "rabbitmq"
    joined = spans.one(f"process rabbitmq:{outbound}")
    assert joined.parent is not None and joined.parent.span_id == send.context.span_id
    assert joined.context.trace_id == origin.context.trace_id


@pytest.mark.rabbitmq
async def test_a_webhook_request_and_the_message_its_handler_wrote_are_one_trace(
        pg_database: str, queues: tuple[str, str], relay_env: dict[str, str], spans: Spans, tmp_path: Path) -> None:
    _, outbound = queues
    app = ConsumerApp(make_settings(pg_database, rabbitmq_url=AMQP_URL), tracer_provider=spans.provider)

    @app.handler(WebhookSource(path="/hooks/orders", verifier=StandardWebhooksVerifier(SECRET),
                               namespace="order-hooks", version=1))
    async def handle(ctx: Context) -> None:
        ctx.outbox.publish(outbound, b'{"shipment": 2}')

    onward = Onward()
    onward.attach(app, RabbitMQSource(queue=outbound, namespace="shipments", version=1))
    log = tmp_path / "relay.log"
    relay = relay_process(relay_env, log)
    try:
        async with served_asgi(app.asgi()) as url, httpx.AsyncClient(base_url=url) as client:
            origin, headers = producer(spans, "POST /hooks/orders", SpanKind.CLIENT)
            body = b'{"order": 3}'
            response = await client.post("/hooks/orders", content=body,
                                         headers={**standard_headers(SECRET, "msg_trace_0001", body), **headers})
            assert response.status_code == 200, response.text
            await asyncio.wait_for(onward.done.wait(), 30)
    finally:
        await stop(relay, log)
    assert_joined(spans, "process webhook:order-hooks", f"process rabbitmq:{outbound}", origin, SpanKind.SERVER)
    assert dict(spans.one("process webhook:order-hooks").attributes or {})["http.route"] == "/hooks/orders"


@pytest.mark.sqs
async def test_an_sqs_message_and_the_message_its_handler_wrote_are_one_trace(
        pg_database: str, moto_endpoint: str, relay_env: dict[str, str], spans: Spans, tmp_path: Path) -> None:
    from consumer_kit.sources.sqs import MESSAGE_ID_ATTRIBUTE, SQSSource
    from tests.integration.sqs_env import REGION, Moto

    moto = Moto(moto_endpoint)
    inbound, inbound_dlq = await moto.queue()
    outbound, outbound_dlq = await moto.queue()
    settings: Settings = moto.settings(pg_database)
    app = ConsumerApp(settings, tracer_provider=spans.provider)

    @app.handler(SQSSource(queue_url=inbound, namespace="sqs-orders", version=1,
                                   dead_letter_queue_url=inbound_dlq))
    async def handle(ctx: Context) -> None:
        if ctx.delivery.json() == {}:
            ctx.outbox.publish(outbound, b'{"shipment": 3}')

    onward = Onward()
    onward.attach(app, SQSSource(queue_url=outbound, namespace="sqs-shipments", version=1, key=MESSAGE_ID_ATTRIBUTE,
                                 dead_letter_queue_url=outbound_dlq))
    log = tmp_path / "relay.log"
    env = dict(relay_env, SQS_ENDPOINT_URL=moto_endpoint, SQS_REGION=REGION)
    relay = relay_process(env, log, app="tests.integration.sqs_relay_app:app")
    xray_root = secrets.token_hex(16)
    try:
        async with app.running():
            origin, headers = producer(spans, "send inbound")
            await moto.send(inbound, [{"MessageBody": "{}", "MessageAttributes": {
                name: {"DataType": "String", "StringValue": value} for name, value in headers.items()}}])
            await asyncio.wait_for(onward.done.wait(), 30)
            # SQS's own trace header (AWSTraceHeader, X-Ray's format) is read when no traceparent came.
            # (SendMessage: moto keeps system attributes of single sends only.)
            await asyncio.to_thread(moto.sqs.send_message, QueueUrl=inbound, MessageBody='{"n": 2}',
                                    MessageSystemAttributes={"AWSTraceHeader": {"DataType": "String", "StringValue":
                                    f"Root=1-{xray_root[:8]}-{xray_root[8:]};Parent=53995c3f42cd8ad8;Sampled=1"}})

            async def both() -> bool:
                return len(spans.named(f"process sqs:{inbound.rsplit('/', 1)[-1]}")) == 2

            await wait_until(both, 30, "the second message")
    finally:
        await stop(relay, log)
    name = inbound.rsplit("/", 1)[-1]
    first = [s for s in spans.named(f"process sqs:{name}") if s.context.trace_id == origin.context.trace_id]
    assert len(first) == 1
    joined = spans.one(f"process sqs:{outbound.rsplit('/', 1)[-1]}")
    (handler,) = [s for s in spans.named("handler") if s.parent and s.parent.span_id == first[0].context.span_id]
    assert first[0].kind is SpanKind.CONSUMER and first[0].parent is not None
    assert first[0].parent.span_id == origin.context.span_id
    assert joined.context.trace_id == origin.context.trace_id
    assert joined.parent is not None and joined.parent.span_id == handler.context.span_id
    attributes = dict(joined.attributes or {})
    assert attributes["messaging.system"] == "aws_sqs" and "messaging.message.id" in attributes  # keyed by the row id
    (xray,) = [s for s in spans.named(f"process sqs:{name}") if s.context.trace_id != origin.context.trace_id]
    assert format(xray.context.trace_id, "032x") == xray_root
    assert xray.parent is not None and format(xray.parent.span_id, "016x") == "53995c3f42cd8ad8"
