"""Properties of the CloudEvents reader: any event the official SDK writes in binary mode and in
structured mode reads back as one event (same key, same fingerprint), a change to an attribute or the
data changes the fingerprint, and the bounded JSON parser agrees with the standard one within its
depth and refuses beyond it."""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
from cloudevents.core.bindings.http import HTTPMessage, to_binary, to_structured
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer_kit.http import loads_json
from consumer_kit.sources.cloudevents.message import CloudEventDelivery, from_binary, from_structured, parse_document

# String attribute values: any Unicode the String type allows (no controls, surrogates, noncharacters).
# The 66 noncharacters: U+FDD0..U+FDEF, and the last two code points of each of the 17 planes.
allowed = st.characters(blacklist_categories=("Cc", "Cs")).filter(
    lambda c: not (0xFDD0 <= ord(c) <= 0xFDEF or ord(c) & 0xFFFE == 0xFFFE))
texts = st.text(allowed, min_size=1, max_size=30)
names = st.text(string.ascii_lowercase + string.digits, min_size=1, max_size=12).filter(
    lambda n: n not in {"id", "source", "specversion", "type", "datacontenttype", "dataschema", "subject",
                        "time", "data", "traceparent", "tracestate"})
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20,
)
# (datacontenttype, data): the SDK writes a dict as JSON, text as text and bytes as bytes.
payloads = st.one_of(
    st.tuples(st.sampled_from(["application/json", "application/cloudevents+json; charset=utf-8"]),
              st.dictionaries(texts, json_values, max_size=5)),
    st.tuples(st.just(None), st.dictionaries(texts, json_values, min_size=1, max_size=5)),
    st.tuples(st.sampled_from(["text/plain", "application/xml; charset=utf-8"]), texts),
    st.tuples(st.sampled_from(["application/octet-stream", "image/png"]), st.binary(max_size=40)),
    st.tuples(st.just(None), st.none()),
)
events = st.fixed_dictionaries(
    {"id": texts, "type": texts, "subject": texts,
     "source": st.sampled_from(["https://shop.example/orders", "/eu/orders", "urn:uuid:6e8bc430", "#x"]),
     "extensions": st.dictionaries(names, texts | st.integers(-(2**31), 2**31 - 1), max_size=3)},
)


def build(event: dict[str, Any], payload: tuple[str | None, Any]) -> CloudEvent:
    attributes = {"id": event["id"], "type": event["type"], "subject": event["subject"],
                  "source": event["source"], **event["extensions"]}
    if payload[0]:
        attributes["datacontenttype"] = payload[0]
    return CloudEvent(attributes, payload[1])


def read(message: HTTPMessage) -> CloudEventDelivery:
    headers = {name.lower(): value for name, value in message.headers.items()}
    if headers.get("content-type") == "application/cloudevents+json":
        return from_structured(parse_document(message.body), message.body)
    return from_binary(headers, message.body)


@settings(max_examples=150, deadline=None)
@given(event=events, payload=payloads)
def test_one_sdk_event_reads_as_one_event_in_both_modes(event: dict[str, Any],
                                                        payload: tuple[str | None, Any]) -> None:
    sdk_event = build(event, payload)
    binary, structured = read(to_binary(sdk_event, JSONFormat())), read(to_structured(sdk_event, JSONFormat()))
    assert binary.problem is None and structured.problem is None, (binary.problem, structured.problem)
    assert binary.id == structured.id
    assert binary.fingerprint() == structured.fingerprint()
    assert binary.headers["ce-id"] == structured.headers["ce-id"] == event["id"]


@settings(max_examples=100, deadline=None)
@given(event=events, payload=payloads, other=texts)
def test_a_changed_attribute_or_data_changes_the_fingerprint(
    event: dict[str, Any], payload: tuple[str | None, Any], other: str
) -> None:
    first = read(to_binary(build(event, payload), JSONFormat()))
    subject = {**event, "subject": event["subject"] + other}
    assert read(to_structured(build(subject, payload), JSONFormat())).fingerprint() != first.fingerprint()
    content_type, data = payload
    changed: Any
    if isinstance(data, dict):
        changed = {"changed": data}
    elif isinstance(data, bytes):
        changed = data + other.encode()
    else:
        changed = (data or "") + other
    assert read(to_structured(build(event, (content_type, changed)), JSONFormat())).fingerprint() \
        != first.fingerprint()


@settings(max_examples=200, deadline=None)
@given(value=json_values)
def test_bounded_json_agrees_with_the_standard_parser(value: Any) -> None:
    text = json.dumps(value)
    assert loads_json(text.encode()) == json.loads(text)


@pytest.mark.parametrize("depth", [1, 2, 64, 128])
def test_depth_limit_counts_only_structure(depth: int) -> None:
    # Brackets, quotes and backslashes inside strings do not count; nesting does, up to the limit.
    tricky = json.dumps(['[{"\\', "]]]}}"] * 200)
    nested = "[" * (depth - 1) + tricky + "]" * (depth - 1)
    assert loads_json(nested, max_depth=depth) == json.loads(nested)
    with pytest.raises(ValueError, match="nested deeper"):
        loads_json("[" + nested + "]", max_depth=depth)


def test_what_is_not_json_is_refused() -> None:
    for text in (b"NaN", b"[Infinity]", b'{"a": -Infinity}', b"\xff", b"\xef\xbb\xbf{}"):
        with pytest.raises(ValueError):
            loads_json(text)
