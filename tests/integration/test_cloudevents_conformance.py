"""The CloudEvents sink against the specification's own cases (tests/data/cloudevents, each case citing
the conformance suite file or the spec section it was rewritten from), through ``app.asgi()``.

Validation does not depend on the database, so these run on SQLite; the same rules on PostgreSQL are
covered by test_cloudevents.py.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.integration.cloudevents_sink import BATCH, STRUCTURED, Sink, data_file, serving

JSON_FORMAT = data_file("json_format.json")
HTTP_BINDING = data_file("http_binding.json")
BINDING_CASES = {case["case"]: case for case in HTTP_BINDING["cases"]}


@pytest.fixture
async def sink(sqlite_url: str) -> AsyncIterator[tuple[Sink, httpx.AsyncClient]]:
    async with serving(sqlite_url) as running:
        yield running


def cases(section: list[dict[str, Any]]) -> Any:
    return pytest.mark.parametrize("case", section, ids=[case["case"] for case in section])


def expected_attributes(case: dict[str, Any]) -> dict[str, str]:
    # The JSON format implies application/json when no datacontenttype is sent (§3.1.2).
    return {"datacontenttype": "application/json", **case["attributes"]}


async def post(client: httpx.AsyncClient, case: dict[str, Any]) -> httpx.Response:
    """POST a case given as headers and a body (text, or Base64 for bytes)."""
    body = base64.b64decode(case["body_base64"]) if "body_base64" in case else case["body"].encode()
    return await client.post("/events", content=body, headers=case["headers"])


async def assert_parked(sink: Sink, answer: httpx.Response, reason: str) -> None:
    assert answer.status_code == 400, answer.text
    assert answer.json() == {"outcome": "invalid", "reason": reason, "parked": True}
    assert sink.seen == []
    [parked] = await sink.app.dead_letters.list()
    assert parked.reason == reason and parked.key_digest is None


@cases(JSON_FORMAT["valid_events"])
async def test_valid_event(sink: tuple[Sink, httpx.AsyncClient], case: dict[str, Any]) -> None:
    harness, client = sink
    answer = await client.post("/events", content=json.dumps(case["event"]), headers=STRUCTURED)
    assert (answer.status_code, answer.json()["outcome"]) == (200, "processed"), answer.text
    [delivery] = harness.seen
    assert dict(delivery.attributes) == expected_attributes(case)
    if "data" in case:
        assert delivery.text() == case["data"]


@cases(JSON_FORMAT["invalid_events"])
async def test_invalid_event(sink: tuple[Sink, httpx.AsyncClient], case: dict[str, Any]) -> None:
    harness, client = sink
    raw = json.dumps(case["event"]).encode()
    answer = await client.post("/events", content=raw, headers=STRUCTURED)
    await assert_parked(harness, answer, case["reason"])
    assert (await harness.app.dead_letters.list())[0].body == raw  # parked as it arrived


@cases(JSON_FORMAT["batches"])
async def test_batch(sink: tuple[Sink, httpx.AsyncClient], case: dict[str, Any]) -> None:
    harness, client = sink
    answer = await client.post("/events", content=json.dumps(case["batch"]), headers=BATCH)
    assert answer.status_code == case["status"], answer.text
    assert [result["outcome"] for result in answer.json()["results"]] == case["outcomes"]
    assert len(harness.seen) == case["outcomes"].count("processed")
    assert await harness.app.dead_letters.count() == case["outcomes"].count("invalid")


@cases(JSON_FORMAT["same_event"])
async def test_spec_example_in_both_modes_is_one_event(
    sink: tuple[Sink, httpx.AsyncClient], case: dict[str, Any]
) -> None:
    harness, client = sink
    structured = await client.post("/events", content=json.dumps(case["structured"]), headers=STRUCTURED)
    binary = await post(client, case["binary"])
    assert (structured.status_code, binary.status_code) == (200, 200), binary.text
    assert (structured.json()["outcome"], binary.json()["outcome"]) == ("processed", "duplicate")
    assert len(harness.seen) == 1


@cases(HTTP_BINDING["cases"])
async def test_http_binding(sink: tuple[Sink, httpx.AsyncClient], case: dict[str, Any]) -> None:
    harness, client = sink
    answer = await post(client, case)
    if "reason" in case:
        await assert_parked(harness, answer, case["reason"])
        return
    assert (answer.status_code, answer.json()["outcome"]) == (200, "processed"), answer.text
    [delivery] = harness.seen
    assert dict(delivery.attributes).items() >= case["attributes"].items()
    for name, value in case["attributes"].items():
        if name not in ("datacontenttype", "time"):
            assert delivery.headers[f"ce-{name}"] == value  # the handler sees values decoded
    if "data_json" in case:
        assert delivery.json() == case["data_json"]


@pytest.mark.parametrize("pair", HTTP_BINDING["same_event"], ids="+".join)
async def test_http_binding_one_event_in_two_modes(
    sink: tuple[Sink, httpx.AsyncClient], pair: list[str]
) -> None:
    harness, client = sink
    first, second = [await post(client, BINDING_CASES[name]) for name in pair]
    assert (first.json()["outcome"], second.json()["outcome"]) == ("processed", "duplicate")
    assert len(harness.seen) == 1
