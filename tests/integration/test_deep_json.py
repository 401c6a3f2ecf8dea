"""JSON nested 100,000 levels deep (200 KB of brackets), validly signed or authorised, at every entry
point of untrusted JSON that has a server or a broker in front of it: answered and parked like any body
that cannot be parsed, never a 500 with a traceback, never delivered again and again.

- webhooks (each verifier) and a CloudEvents sink (every mode) through a worker's real HTTP server,
  with its request bounds;
- the coordinator's server, which answers a request it cannot read 400 ``invalid_request``, and its
  client, for which such an answer is the coordinator's failure (retryable), not the delivery's;
- a RabbitMQ message, and an SQS one (moto), whose handler reads ``ctx.delivery.json()``: parked
  ``unparseable`` at its first delivery, where it used to fail with ``RecursionError`` until its
  deliveries ran out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from consumer_kit import ConsumerApp, Context
from consumer_kit.coordinator import (
    CoordinatorRejected,
    CoordinatorUnavailable,
    DelegationRequest,
    HttpCoordinator,
    SessionRequest,
)
from consumer_kit.retry import RetryPolicy
from consumer_kit.sources.rabbitmq import RabbitMQSource
from consumer_kit.sources.sqs import REASON_ATTRIBUTE, SQSSource
from consumer_kit.sources.webhooks import (
    GitHubVerifier,
    HmacVerifier,
    StandardWebhooksVerifier,
    StripeVerifier,
    WebhookSource,
)
from consumer_kit.testing.server import served_asgi, served_coordinator
from tests.conftest import make_settings
from tests.integration.cloudevents_sink import BATCH, STRUCTURED, TOKEN, Sink
from tests.integration.rabbit import AMQP_URL, delete_queues, depth, drain, publish, wait_until
from tests.integration.sqs_env import Moto
from tests.signing import github_headers, standard_headers, stripe_signature

LEVELS = 100_000
DEEP = b"[" * LEVELS + b"]" * LEVELS
DEEP_OBJECT = b'{"a":' * 40_000 + b"1" + b"}" * 40_000  # five bytes a level: 40,000 fit the 256 KiB cap
SW_SECRET = "whsec_" + base64.b64encode(b"standard-webhooks-secret-0123456").decode()
STRIPE_SECRET = "whsec_stripe_deep_test"
GITHUB_SECRET = "github-deep-secret"
SHOP_SECRET = b"shop-deep-secret"


def hostile_requests() -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers): every verifier's deep body, each validly signed."""
    form_json = b"[" * 40_000 + b"]" * 40_000  # URL-encoded, three bytes a bracket: under the 256 KiB cap
    form = b"payload=" + quote(form_json).encode()
    shop = base64.b64encode(hmac.new(SHOP_SECRET, DEEP_OBJECT, hashlib.sha256).digest()).decode()
    return [
        ("/hooks/standard", DEEP, standard_headers(SW_SECRET, "msg_deep_1", DEEP)),
        ("/hooks/stripe", DEEP, {"stripe-signature": stripe_signature(STRIPE_SECRET, DEEP)}),
        ("/hooks/stripe", DEEP_OBJECT, {"stripe-signature": stripe_signature(STRIPE_SECRET, DEEP_OBJECT)}),
        ("/hooks/github", DEEP, github_headers(GITHUB_SECRET, DEEP, hook_id="9", delivery="d-1")),
        ("/hooks/github", form, {**github_headers(GITHUB_SECRET, form, hook_id="9", delivery="d-2"),
                                 "content-type": "application/x-www-form-urlencoded"}),
        ("/hooks/hmac", DEEP_OBJECT, {"x-shop-signature": shop}),
    ]


def webhook_app(database_url: str) -> tuple[ConsumerApp, list[str]]:
    app = ConsumerApp(make_settings(database_url))
    runs: list[str] = []
    sources = [
        WebhookSource(path="/hooks/standard", namespace="deep-standard", version=1,
                      verifier=StandardWebhooksVerifier(SW_SECRET)),
        WebhookSource(path="/hooks/stripe", namespace="deep-stripe", version=1, verifier=StripeVerifier(STRIPE_SECRET)),
        WebhookSource(path="/hooks/github", namespace="deep-github", version=1, verifier=GitHubVerifier(GITHUB_SECRET)),
        WebhookSource(path="/hooks/hmac", namespace="deep-shop", version=1,
                      verifier=HmacVerifier(SHOP_SECRET, header="X-Shop-Signature", encoding="base64",
                                            id_field="event.id")),
    ]
    for source in sources:
        @app.handler(source, name=source.namespace)
        async def handle(ctx: Context) -> None:
            runs.append(str(ctx.delivery.json()["id"]))

    return app, runs


async def test_a_signed_webhook_nested_100000_deep_is_answered_and_parked(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app, runs = webhook_app(database_url)
    hostile = hostile_requests()
    caplog.set_level(logging.INFO)
    async with served_asgi(app.asgi(), settings=app.settings) as base, httpx.AsyncClient(base_url=base) as client:
        answers = [await client.post(path, content=body, headers=headers) for path, body, headers in hostile]
        fine = b'{"id": "evt_fine", "n": 1}'
        after = await client.post("/hooks/stripe", content=fine,
                                  headers={"stripe-signature": stripe_signature(STRIPE_SECRET, fine)})
        health = await client.get("/healthz")
        parked = await app.dead_letters.list(limit=len(hostile) + 1)
    # Like every verified body that cannot be read: 400, parked with its reason, the handler not run.
    assert [(a.status_code, a.json().get("reason"), a.json().get("parked")) for a in answers] == \
        [(400, "unparseable", True)] * len(hostile)
    assert sorted((p.reason, p.body) for p in parked) == sorted(("unparseable", body) for _, body, _ in hostile)
    assert all("nested deeper than 128 levels" in p.detail for p in parked)
    # And the server goes on: the next delivery is processed, the health check answers.
    assert (after.status_code, after.json()["outcome"], health.status_code) == (200, "processed", 200)
    assert runs == ["evt_fine"]
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()
                or "RecursionError" in r.getMessage()]


async def test_a_cloudevent_nested_100000_deep_is_answered_and_parked(sqlite_url: str) -> None:
    sink = Sink(sqlite_url)
    event = b'{"specversion": "1.0", "type": "t", "source": "/s", "id": "%s", "data": %s}'
    hostile = [(DEEP, STRUCTURED), (event % (b"deep-data", DEEP), STRUCTURED), (b"[" + DEEP + b"]", BATCH),
               (DEEP, {"content-type": "application/json", "ce-specversion": "1.0", "ce-type": "t",
                       "ce-source": "/s", "ce-id": "deep-binary"})]
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with served_asgi(sink.app.asgi(), settings=sink.app.settings) as base, \
            httpx.AsyncClient(base_url=base, headers=auth) as client:
        answers = [await client.post("/events", content=body, headers=headers) for body, headers in hostile]
        fine = await client.post("/events", content=event % (b"fine", b"1"), headers=STRUCTURED)
        parked = await sink.app.dead_letters.count(reason="unparseable")
    assert [(a.status_code, a.json()["reason"]) for a in answers] == [(400, "unparseable")] * len(hostile)
    assert parked == len(hostile)
    assert (fine.status_code, [d.headers["ce-id"] for d in sink.seen]) == (200, ["fine"])


@pytest.mark.postgres
async def test_the_coordinator_refuses_a_request_nested_100000_deep(pg_database: str) -> None:
    settings = make_settings(pg_database)
    tokens = {"deep-token": ("tenant-a", "app-a")}
    auth = {"authorization": "Bearer deep-token", "content-type": "application/json"}
    async with served_coordinator(settings, tokens) as base, httpx.AsyncClient(base_url=base) as client:
        refused = [await client.post("/v1/sessions", content=body, headers={**auth, "idempotency-key": f"deep:v1:{i}"})
                   for i, body in enumerate((DEEP, DEEP_OBJECT))]
        health = await client.get("/healthz")
        created = await client.post("/v1/sessions", json={"labels": ["deep"], "task": "after"},
                                    headers={**auth, "idempotency-key": "deep:v1:after"})
    assert [(r.status_code, r.json()) for r in refused] == [(400, {"error": "invalid_request"})] * 2
    assert health.status_code == 200
    assert created.status_code == 201


async def test_a_coordinator_answer_nested_100000_deep_is_its_failure_not_the_deliverys() -> None:
    # A coordinator (or whatever answers at its address) that sends such a body: a creation it answers
    # 201 so is CoordinatorUnavailable (retryable, never parked as the delivery's fault); a refusal keeps its
    # status and gets a code of the status alone.
    async def answer(request: Request) -> Response:
        status = 201 if request.url.path == "/v1/sessions" else 400
        return Response(DEEP, status_code=status, media_type="application/json")

    deep_server = Starlette(routes=[Route("/v1/sessions", answer, methods=["POST"]),
                                    Route("/v1/delegations", answer, methods=["POST"])])
    policy = RetryPolicy(attempts=1, total_seconds=5)
    async with served_asgi(deep_server) as base:
        coordinator = HttpCoordinator(base, token="t", policy=policy)
        try:
            with pytest.raises(CoordinatorUnavailable, match="unreadable body"):
                await coordinator.create_session(SessionRequest(labels=("deep",)), idempotency_key="deep:v1:1")
            with pytest.raises(CoordinatorRejected) as refused:
                await coordinator.create_delegation(DelegationRequest(from_session_id="s", to_subject="u"),
                                                    idempotency_key="deep:v1:2")
        finally:
            await coordinator.close()
    assert (refused.value.status, refused.value.code) == (400, "http_400")


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-deep-{secrets.token_hex(4)}"
    yield name
    await delete_queues(name)


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_a_rabbitmq_message_nested_100000_deep_is_parked_at_once(pg_database: str, queue: str) -> None:
    app = ConsumerApp(make_settings(pg_database, max_deliveries=5))
    source = RabbitMQSource(queue=queue, namespace="deep-orders", version=1, url=AMQP_URL,
                            retry_delays=(0.1, 0.1, 0.1, 0.1))
    attempts: list[int] = []

    @app.handler(source, name="deep-orders")
    async def handle(ctx: Context) -> None:
        attempts.append(ctx.attempt)
        ctx.delivery.json()  # the handler reads its body as JSON, as most do

    async with app.running():
        await publish(queue, [("deep-1", DEEP), ("fine-1", b'{"n": 1}')])

        async def settled() -> bool:
            return await depth(f"{queue}.dlq") == 1 and await depth(queue) == 0 and len(attempts) >= 2

        await wait_until(settled, 30, "the deep message parked")
        [parked] = await app.dead_letters.list(reason="unparseable")
    assert parked.body == DEEP
    assert attempts == [1, 1]  # each message was handled once: the deep one was not tried again
    [copy] = await drain(f"{queue}.dlq")
    assert copy.message_id == "deep-1"


@pytest.mark.sqs
async def test_an_sqs_message_nested_100000_deep_is_parked_at_once(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue()
    app = ConsumerApp(moto.settings(sqlite_url, max_deliveries=5))
    source = SQSSource(queue_url=url, namespace="deep-sqs", version=1, dead_letter_queue_url=dlq)
    attempts: list[int] = []

    @app.handler(source, name="deep-sqs")
    async def handle(ctx: Context) -> None:
        attempts.append(ctx.attempt)
        ctx.delivery.json()

    async with app.running():
        await moto.send(url, [{"MessageBody": DEEP.decode()}, {"MessageBody": '{"n": 1}'}])

        async def settled() -> bool:
            return await moto.depth(dlq) == 1 and await moto.depth(url) == 0 and len(attempts) >= 2

        await wait_until(settled, 30, "the deep message parked")
        [parked] = await app.dead_letters.list(reason="unparseable")
    assert parked.body == DEEP
    assert attempts == [1, 1]
    [copy] = await moto.drain(dlq)
    assert copy["MessageAttributes"][REASON_ATTRIBUTE]["StringValue"] == "unparseable"
