"""The CloudEvents sink through ``app.asgi()``, on SQLite and the real PostgreSQL server; and the key
mapper for CloudEvents carried by queues."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from consumer_kit import ConsumerApp, Context, Delivery, Outcome
from consumer_kit.sources.cloudevents import cloudevent_key_mapper
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings
from tests.integration.cloudevents_sink import BATCH, STRUCTURED, Sink, serving


@pytest.fixture
async def sink(database_url: str) -> AsyncIterator[tuple[Sink, httpx.AsyncClient]]:
    async with serving(database_url) as running:
        yield running


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
    sent = binary(**{"ce-time": "2026-01-01T00:00:00Z"})
    first = await client.post("/events", content=b'{"order": 1}', headers=sent)
    # A redelivery: the same event, the trace context of its new hop (volatile by default).
    again = await client.post("/events", content=b'{"order": 1}', headers={**sent, "ce-traceparent": "00-x"})
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.json()["outcome"] == "duplicate"
    assert harness.events == [("com.example.order.created", {"order": 1})]


async def test_structured_and_binary_of_one_event_are_one_delivery(
    sink: tuple[Sink, httpx.AsyncClient],
) -> None:
    harness, client = sink
    first = await client.post("/events", content=json.dumps(structured("same-1")), headers=STRUCTURED)
    # The same event in binary mode, its data spelled with other whitespace: JSON data is compared
    # as a JSON value, not as the transport's bytes.
    second = await client.post("/events", content=b'{ "order" : 1 }\n', headers=binary("same-1"))
    third = await client.post("/events", content=json.dumps(structured("same-1")), headers=STRUCTURED)
    assert [a.status_code for a in (first, second, third)] == [200, 200, 200]
    assert [a.json()["outcome"] for a in (first, second, third)] == ["processed", "duplicate", "duplicate"]
    assert len(harness.seen) == 1


CHANGES = {  # change -> (headers replaced in the second copy, its body)
    "type": ({"ce-type": "com.example.order.deleted"}, b'{"order": 1}'),
    "time": ({"ce-time": "2026-01-01T00:00:05Z"}, b'{"order": 1}'),
    "extension": ({"ce-tenant": "b"}, b'{"order": 1}'),
    "subject": ({"ce-subject": "other"}, b'{"order": 1}'),
    "datacontenttype": ({"content-type": "application/json; charset=utf-8"}, b'{"order": 1}'),
    "data": ({}, b'{"order": 2}'),
    "data-type-of-a-number": ({}, b'{"order": "1"}'),
}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("first_mode", ["binary", "structured"])
async def test_any_real_change_under_the_same_id_is_a_conflict(
    sink: tuple[Sink, httpx.AsyncClient], change: str, first_mode: str
) -> None:
    harness, client = sink
    headers, content = CHANGES[change]
    sent = binary("c-1", **{"ce-time": "2026-01-01T00:00:00Z", "ce-subject": "order-1", "ce-tenant": "a"})
    if first_mode == "binary":
        first = await client.post("/events", content=b'{"order": 1}', headers=sent)
    else:
        event = structured("c-1", time="2026-01-01T00:00:00Z", subject="order-1", tenant="a")
        first = await client.post("/events", content=json.dumps(event), headers=STRUCTURED)
    changed = await client.post("/events", content=content, headers={**sent, **headers})
    assert first.json()["outcome"] == "processed"
    assert changed.status_code == 202 and changed.json()["outcome"] == "conflict", change
    assert len(harness.seen) == 1
    assert await harness.app.dead_letters.count(reason="conflict") == 1


async def test_a_parked_event_keys_again_to_its_own_key(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    # What an operator replays is the parked binary form (values decoded): it keys as the event did.
    harness, client = sink
    sent = binary("k 1%25", **{"ce-subject": "%E2%82%AC"})
    await client.post("/events", content=b'{"order": 1}', headers=sent)
    await client.post("/events", content=b'{"order": 2}', headers=sent)
    [parked] = await harness.app.dead_letters.list(reason="conflict")
    assert parked.headers["ce-id"] == "k 1%" and parked.headers["ce-subject"] == "€"
    replayed = Delivery(id=None, body=parked.body, headers=parked.headers)
    assert harness.source.key(replayed) == harness.source.key(harness.seen[0])


async def test_the_same_instant_spelled_otherwise_is_the_same_event(
    sink: tuple[Sink, httpx.AsyncClient],
) -> None:
    harness, client = sink
    first = await client.post(
        "/events", content=b'{"order": 1}', headers=binary("t-1", **{"ce-time": "2026-01-01T01:00:00+01:00"}))
    again = await client.post(
        "/events", content=b'{"order": 1}', headers=binary("t-1", **{"ce-time": "2026-01-01T00:00:00.000Z"}))
    assert (first.json()["outcome"], again.json()["outcome"]) == ("processed", "duplicate")
    assert harness.seen[0].attributes["time"] == "2026-01-01T00:00:00Z"


async def test_ids_that_differ_only_in_invalid_utf8_are_both_refused(
    sink: tuple[Sink, httpx.AsyncClient],
) -> None:
    harness, client = sink
    answers = [await client.post("/events", content=b'{"order": 1}', headers=binary(raw))
               for raw in ("%FF", "%FE", "%C0%A0")]
    assert [a.status_code for a in answers] == [400, 400, 400]
    assert {a.json()["outcome"] for a in answers} == {"invalid"}
    assert harness.seen == []
    parked = await harness.app.dead_letters.list(reason="unparseable")
    assert sorted(p.headers["ce-id"] for p in parked) == ["%C0%A0", "%FE", "%FF"]  # as they arrived
    assert all(p.key_digest is None for p in parked)


async def test_a_quoted_header_value_is_the_value_without_its_quotes(
    sink: tuple[Sink, httpx.AsyncClient],
) -> None:
    harness, client = sink
    quoted = await client.post("/events", content=b'{"order": 1}', headers=binary('"q-1"'))
    plain = await client.post("/events", content=b'{"order": 1}', headers=binary("q-1"))
    assert (quoted.json()["outcome"], plain.json()["outcome"]) == ("processed", "duplicate")
    assert harness.seen[0].headers["ce-id"] == "q-1"


async def test_null_attributes_are_unset(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    harness, client = sink
    nulls = structured("n-1", subject=None, time=None, dataschema=None, tenant=None)
    first = await client.post("/events", content=json.dumps(nulls), headers=STRUCTURED)
    again = await client.post("/events", content=b'{"order": 1}', headers=binary("n-1"))
    assert (first.status_code, first.json()["outcome"]) == (200, "processed")
    assert again.json()["outcome"] == "duplicate"
    assert "ce-subject" not in harness.seen[0].headers and "subject" not in harness.seen[0].attributes


async def test_batch_mode(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    harness, client = sink
    batch = [structured("b-1"), structured("b-2"), structured("b-1")]
    answer = await client.post("/events", content=json.dumps(batch), headers=BATCH)
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
    answer = await client.post("/events", content=json.dumps(event), headers=STRUCTURED)
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
        (b"[" * 1000 + b"]" * 1000, {"content-type": "application/cloudevents+json"}, 400),
        (b"[" * 1000 + b"]" * 1000, binary(), 400),
        (b'{"specversion": "1.0", "type": "t", "source": "/s", "id": "a", "id": "b"}',
         {"content-type": "application/cloudevents+json"}, 400),
        (b"<xml/>", {"content-type": "application/cloudevents+xml"}, 415),
        (b"{}", {"content-type": "application/json"}, 415),
    ],
    ids=["broken-json", "bad-time", "bad-specversion", "deeply-nested-structured", "deeply-nested-json-data",
         "repeated-member-name", "xml-format", "not-a-cloudevent"],
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


async def test_a_batch_over_the_cap_is_parked_once(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 10: one unauthenticated 60 KB request of 20,000 empty objects parked 20,000 rows.
    body = b"[" + b",".join([b"{}"] * 20_000) + b"]"
    async with serving(database_url) as (harness, client):
        with caplog.at_level(logging.WARNING):
            answer = await client.post("/events", content=body, headers=BATCH)
        assert answer.status_code == 400
        assert answer.json() == {"outcome": "invalid", "reason": "too_many_events", "parked": True}
        [parked] = await harness.app.dead_letters.list()
        assert (parked.reason, parked.body, parked.key_digest) == ("too_many_events", body, None)
        parked_warnings = [r for r in caplog.records
                           if r.levelno == logging.WARNING and "delivery parked" in r.getMessage()]
        assert len(parked_warnings) == 1
        assert harness.seen == []


async def test_the_batch_cap_is_a_setting(database_url: str) -> None:
    async with serving(database_url, cloudevents_max_batch_events=2) as (harness, client):
        over = await client.post("/events", content=json.dumps([structured(f"cap-{i}") for i in range(3)]),
                                 headers=BATCH)
        assert over.status_code == 400 and over.json()["reason"] == "too_many_events"
        assert harness.seen == []
        # At the cap, a batch is judged member by member: the invalid member is parked on its own.
        within = await client.post("/events", content=json.dumps([structured("cap-0"), {}]), headers=BATCH)
        assert within.status_code == 400
        assert [r["outcome"] for r in within.json()["results"]] == ["processed", "invalid"]
        assert len(harness.seen) == 1
        assert await harness.app.dead_letters.count() == 2


async def test_repeated_ce_header_and_bearer(sink: tuple[Sink, httpx.AsyncClient]) -> None:
    harness, client = sink
    headers = [*binary("r-1").items(), ("ce-id", "r-2")]
    assert (await client.post("/events", content=b"{}", headers=headers)).status_code == 400
    wrong = await client.post(
        "/events", content=b"{}", headers={**binary("r-3"), "authorization": "Bearer nope"}
    )
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    harness.source.batch = False
    batch = await client.post("/events", content=b"[]", headers=BATCH)
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
