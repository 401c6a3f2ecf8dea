"""Every HTTP mode round-tripped through the official CloudEvents SDK (``cloudevents`` 2.x): one event,
sent as the SDK writes it in binary mode, in structured mode and inside a batch, is one event (handled
once, every later copy a duplicate), and the handler gets back what the SDK sent.

The SDK has two HTTP APIs: ``cloudevents.core.bindings.http`` (``to_binary``/``to_structured`` with
a ``JSONFormat``) and the 1.x API kept as ``cloudevents.v1`` (``conversion.to_binary``/``to_structured``
of a ``v1.http.CloudEvent``). Neither has a batch helper, so a batch is built as the JSON batch format
defines it (JSON format §4): an array of what ``JSONFormat().write`` makes of each event.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from cloudevents.core.bindings.http import to_binary, to_structured
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from cloudevents.v1 import conversion as v1_conversion
from cloudevents.v1.http import CloudEvent as V1CloudEvent

from consumer_kit import Delivery
from tests.integration.cloudevents_sink import BATCH, serving

# (name, datacontenttype or None, data). JSON data is an object: the SDK's binary writer serialises
# only a dict as JSON (a list becomes Python's repr, which is rightly refused as not JSON). Boolean
# extensions are left out: its to_binary writes Python's "True" where the spec says "true".
KINDS: list[tuple[str, str | None, Any]] = [
    ("json-object", "application/json", {"order": 7, "price": 10.50, "name": "Zoë", "tags": ["a", None]}),
    ("json-implied", None, {"order": 8}),
    ("json-subtype", "application/vnd.shop+json; charset=utf-8", {"lines": [1, 2.25, {"deep": True}]}),
    ("text", "text/plain", "hello € world"),
    ("string-implied", None, "just a string"),
    ("xml", "application/xml", '<order id="9"/>'),
    ("bytes", "application/octet-stream", b"\x00\xff\x10binary"),
    ("bytes-untyped", None, b"raw bytes"),
    ("no-data", None, None),
]


def sdk_event(kind: str, datacontenttype: str | None, data: Any) -> CloudEvent:
    attributes: dict[str, Any] = {
        "type": "com.example.order.created",
        "source": "https://shop.example/orders",
        # Space, quote, percent and non-ASCII: the SDK percent-encodes them in binary mode.
        "id": f'ord {kind} 100% "Zoë"',
        "time": datetime(2026, 3, 1, 12, 30, 15, 123456, tzinfo=timezone(timedelta(hours=2))),
        "subject": "orders/9",
        "dataschema": "https://shop.example/schemas/order",
        "shopregion": "eu",
        "shopattempt": 3,
    }
    if datacontenttype:
        attributes["datacontenttype"] = datacontenttype
    return CloudEvent(attributes, data)


def data_as_sdk_reads_it(delivery: Delivery) -> Any:
    """What the SDK's own reader makes of the data a handler got (binary form)."""
    return JSONFormat().read_data(delivery.body, delivery.headers.get("content-type"))


def same_data(sent: Any, read: Any) -> bool:
    # The SDK reads untyped bytes back as text when they are UTF-8; that is its reading, not ours.
    return bool(read == sent or (isinstance(sent, bytes) and read == sent.decode("utf-8", "replace")))


def check_handled(delivery: Delivery, event: CloudEvent) -> None:
    attributes = event.get_attributes()
    assert delivery.headers["ce-id"] == attributes["id"]
    assert delivery.headers["ce-source"] == attributes["source"]
    assert delivery.headers["ce-shopattempt"] == "3"
    assert delivery.attributes["time"] == "2026-03-01T10:30:15.123456Z"
    assert delivery.headers.get("content-type") == attributes.get("datacontenttype")
    assert same_data(event.get_data(), data_as_sdk_reads_it(delivery))


@pytest.mark.parametrize("first", ["binary", "structured"])
async def test_one_sdk_event_in_every_mode_is_one_event(database_url: str, first: str) -> None:
    fmt = JSONFormat()
    async with serving(database_url) as (sink, client):
        for kind, datacontenttype, data in KINDS:
            event = sdk_event(kind, datacontenttype, data)
            binary, structured = to_binary(event, fmt), to_structured(event, fmt)
            ordered = [binary, structured] if first == "binary" else [structured, binary]
            answers = [await client.post("/events", content=m.body, headers=m.headers) for m in ordered]
            batch = await client.post("/events", content=b"[" + fmt.write(event) + b"]", headers=BATCH)
            assert [a.status_code for a in answers] == [200, 200], (kind, answers[0].text, answers[1].text)
            assert [a.json()["outcome"] for a in answers] == ["processed", "duplicate"], kind
            assert batch.status_code == 200 and batch.json()["results"][0]["outcome"] == "duplicate", kind
            check_handled(sink.seen[-1], event)
        assert len(sink.seen) == len(KINDS)


async def test_an_sdk_batch_then_each_event_alone(database_url: str) -> None:
    fmt = JSONFormat()
    events = [sdk_event(kind, datacontenttype, data) for kind, datacontenttype, data in KINDS]
    async with serving(database_url) as (sink, client):
        batch = b"[" + b",".join(fmt.write(event) for event in events) + b"]"
        answer = await client.post("/events", content=batch, headers=BATCH)
        assert answer.status_code == 200
        assert [r["outcome"] for r in answer.json()["results"]] == ["processed"] * len(KINDS)
        for event in events:
            message = to_binary(event, fmt)
            again = await client.post("/events", content=message.body, headers=message.headers)
            assert again.json()["outcome"] == "duplicate"
        for delivery, event in zip(sink.seen, events, strict=True):
            check_handled(delivery, event)


async def test_the_sdk_1x_api(database_url: str) -> None:
    # The 1.x API does not percent-encode header values and JSON-quotes text in binary mode even
    # under text/plain, so it is round-tripped with JSON and binary data and plain ASCII attributes.
    async with serving(database_url) as (sink, client):
        for name, data in (("json", {"order": 1, "lines": [{"sku": "A", "n": 2}]}), ("bytes", b"\x01\x02")):
            event = V1CloudEvent({"type": "com.example.order.created", "source": "/shop/v1",
                                  "id": f"v1-{name}", "shopattempt": 3}, data)
            answers = []
            for headers, body in (v1_conversion.to_binary(event), v1_conversion.to_structured(event)):
                sent = {key: str(value) for key, value in headers.items()}
                answers.append(await client.post("/events", content=body, headers=sent))
            assert [a.json()["outcome"] for a in answers] == ["processed", "duplicate"], name
        assert [d.headers["ce-id"] for d in sink.seen] == ["v1-json", "v1-bytes"]
        assert sink.seen[0].json() == {"order": 1, "lines": [{"sku": "A", "n": 2}]}
        assert sink.seen[1].body == b"\x01\x02"


async def test_a_changed_sdk_event_is_a_conflict(database_url: str) -> None:
    fmt = JSONFormat()
    async with serving(database_url) as (sink, client):
        event = sdk_event("changed", "application/json", {"order": 1})
        first = to_binary(event, fmt)
        changed = to_structured(sdk_event("changed", "application/json", {"order": 2}), fmt)
        answers = [await client.post("/events", content=m.body, headers=m.headers) for m in (first, changed)]
        assert [a.json()["outcome"] for a in answers] == ["processed", "conflict"]
        assert len(sink.seen) == 1

