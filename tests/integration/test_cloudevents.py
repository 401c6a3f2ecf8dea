"""The CloudEvents sink through ``app.asgi()``, on SQLite and the real PostgreSQL server; and the key
mapper for CloudEvents carried by queues."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from consumer_kit import ConsumerApp, Context, Delivery, Outcome
from consumer_kit.testing import InMemorySource
from sources.cloudevents import CloudEventsSource, cloudevent_key_mapper
from tests.conftest import make_settings

TOKEN = "ce-bearer-token-for-tests"


class Sink:
    def __init__(self, database_url: str) -> None:
        self.app = ConsumerApp(make_settings(database_url))
        self.source = CloudEventsSource(
            path="/events",
            namespace="orders",
            version=1,
            batch=True,
            bearer_tokens=[TOKEN],
            allowed_origins=["https://sender.example"],
            allowed_rate=120,
        )
        self.seen: list[tuple[str, object]] = []

        @self.app.handler(self.source)
        async def on_event(ctx: Context) -> None:
            self.seen.append((ctx.delivery.headers["ce-type"], ctx.delivery.json()))


@pytest.fixture
async def sink(database_url: str) -> AsyncIterator[tuple[Sink, httpx.AsyncClient]]:
    sink = Sink(database_url)
    async with sink.app.running():
        transport = httpx.ASGITransport(app=sink.app.asgi())
        async with httpx.AsyncClient(
            transport=transport, base_url="http://testserver", headers={"authorization": f"Bearer {TOKEN}"}
        ) as client:
            yield sink, client


def binary(event_id: str = "A234-1234-1234", **extra: str) -> dict[str, str]:
    return {
        "ce-specversion": "1.0",
        "ce-type": "com.example.order.created",
        "ce-source": "/shop/eu",
        "ce-id": event_id,
        "content-type": "application/json",
        **extra,
    }


def structured(event_id: str = "S-1", **extra: object) -> dict[str, object]:
    return {
        "specversion": "1.0",
        "type": "com.example.order.created",
        "source": "/shop/eu",
        "id": event_id,
        "datacontenttype": "application/json",
        "data": {"order": 1},
        **extra,
    }


async def test_binary_event_processed_once(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    harness, client = sink
    first = await client.post(
        "/events", content=b'{"order": 1}', headers=binary(**{"ce-time": "2026-01-01T00:00:00Z"})
    )
    again = await client.post(
        "/events",
        content=b'{"order": 1}',
        headers=binary(**{"ce-time": "2026-01-01T00:00:05Z", "ce-traceparent": "00-x"}),
    )
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.json()["outcome"] == "duplicate"
    assert harness.seen == [("com.example.order.created", {"order": 1})]


async def test_structured_and_binary_of_one_event_are_one_delivery(
    sink: tuple[Sink, httpx.AsyncClient],
) -> None:
    harness, client = sink
    body = json.dumps(structured("same-1")).encode()
    first = await client.post(
        "/events", content=body, headers={"content-type": "application/cloudevents+json"}
    )
    # Structured JSON data reaches the handler compactly serialised; the same bytes in binary mode
    # are the same event (other bytes would be a changed event: a conflict).
    second = await client.post("/events", content=b'{"order":1}', headers=binary("same-1"))
    assert first.json()["outcome"] == "processed" and second.json()["outcome"] == "duplicate"
    assert len(harness.seen) == 1


async def test_changed_type_under_the_same_id_is_a_conflict(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    harness, client = sink
    await client.post("/events", content=b'{"order": 1}', headers=binary("c-1"))
    changed = await client.post(
        "/events", content=b'{"order": 1}', headers=binary("c-1", **{"ce-type": "com.example.order.deleted"})
    )
    assert changed.status_code == 202 and changed.json()["outcome"] == "conflict"
    assert len(harness.seen) == 1
    assert await harness.app.dead_letters.count(reason="conflict") == 1


async def test_batch_mode(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    harness, client = sink
    batch = [structured("b-1"), structured("b-2"), structured("b-1")]
    answer = await client.post(
        "/events", content=json.dumps(batch), headers={"content-type": "application/cloudevents-batch+json"}
    )
    assert answer.status_code == 200
    assert [r["outcome"] for r in answer.json()["results"]] == ["processed", "processed", "duplicate"]
    assert len(harness.seen) == 2


async def test_missing_id_is_parked_not_given_a_random_one(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    harness, client = sink
    headers = binary()
    del headers["ce-id"]
    for _ in range(2):
        answer = await client.post("/events", content=b"{}", headers=headers)
        assert answer.status_code == 400 and answer.json()["reason"] == "missing_stable_id"
    event = structured()
    del event["id"]
    answer = await client.post(
        "/events", content=json.dumps(event), headers={"content-type": "application/cloudevents+json"}
    )
    assert answer.status_code == 400
    assert await harness.app.dead_letters.count(reason="missing_stable_id") == 3
    assert harness.seen == []


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b"{not json", {"content-type": "application/cloudevents+json"}, 400),
        (
            json.dumps(structured(time="not a time")).encode(),
            {"content-type": "application/cloudevents+json"},
            400,
        ),
        (b"{}", binary(**{"ce-specversion": "0.9"}), 400),
        (b"<xml/>", {"content-type": "application/cloudevents+xml"}, 415),
        (b"{}", {"content-type": "application/json"}, 415),
    ],
    ids=["broken-json", "bad-time", "bad-specversion", "xml-format", "not-a-cloudevent"],
)
async def test_bad_events(
    sink: tuple[Sink, httpx.AsyncClient], content: bytes, headers: dict[str, str], status: int
) -> None:
    harness, client = sink
    answer = await client.post("/events", content=content, headers=headers)
    assert answer.status_code == status
    assert harness.seen == []
    if status == 400:  # accepted (authenticated) but unparseable: parked, never lost
        [parked] = await harness.app.dead_letters.list()
        assert parked.reason == "unparseable"


async def test_repeated_ce_header_and_bearer(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    harness, client = sink
    headers = [*binary("r-1").items(), ("ce-id", "r-2")]
    assert (await client.post("/events", content=b"{}", headers=headers)).status_code == 400
    wrong = await client.post(
        "/events", content=b"{}", headers={**binary("r-3"), "authorization": "Bearer nope"}
    )
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    harness.source.batch = False
    batch = await client.post(
        "/events", content=b"[]", headers={"content-type": "application/cloudevents-batch+json"}
    )
    assert batch.status_code == 415
    assert harness.seen == []


async def test_abuse_protection_handshake(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    _harness, client = sink
    granted = await client.options("/events", headers={"webhook-request-origin": "https://sender.example"})
    assert granted.status_code == 200
    assert granted.headers["webhook-allowed-origin"] == "https://sender.example"
    assert granted.headers["webhook-allowed-rate"] == "120"
    refused = await client.options("/events", headers={"webhook-request-origin": "https://evil.example"})
    assert refused.status_code == 403 and "webhook-allowed-origin" not in refused.headers
    assert (await client.options("/events")).status_code == 400


@pytest.mark.parametrize(
    "headers",
    [
        {"cloudEvents_id": "q-1", "cloudEvents_source": "/queue/src", "message-id": "amqp-1"},
        {"cloudEvents:id": "q-1", "cloudEvents:source": "/queue/src", "message-id": "amqp-2"},
        {"ce-id": "q-1", "ce-source": "/queue/src"},
    ],
    ids=["amqp-underscore", "amqp-colon", "sqs-attributes"],
)
async def test_queue_key_mapper_uses_source_and_id(sqlite_url: str, headers: dict[str, str]) -> None:
    app = ConsumerApp(make_settings(sqlite_url))
    source = InMemorySource(namespace="queue-events", version=1, key_mapper=cloudevent_key_mapper)
    runs: list[str] = []

    @app.handler(source)
    async def handle(ctx: Context) -> None:
        runs.append(ctx.key_digest)

    async with app.running():
        first = await source.deliver(id="transport-1", body=b"{}", headers=headers)
        second = await source.deliver(id="transport-2", body=b"{}", headers=headers)
        assert (first.outcome, second.outcome) == (Outcome.PROCESSED, Outcome.DUPLICATE)
        missing = await source.deliver(id="transport-3", body=b"{}", headers={"cloudEvents_id": "x"})
        assert missing.reason == "missing_stable_id"
    assert len(runs) == 1


def test_key_mapper_structured_body_and_ambiguity() -> None:
    body = json.dumps({"specversion": "1.0", "id": "e1", "source": "a#b", "type": "t"}).encode()
    assert cloudevent_key_mapper(Delivery(id="m", body=body)) == "a%23b#e1"
    assert cloudevent_key_mapper(Delivery(id="m", body=b"[]")) is None
    one = cloudevent_key_mapper(Delivery(id=None, body=b"", headers={"ce-source": "a", "ce-id": "b#c"}))
    two = cloudevent_key_mapper(Delivery(id=None, body=b"", headers={"ce-source": "a#b", "ce-id": "c"}))
    assert one != two
