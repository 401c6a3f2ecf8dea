"""The raw key and its id are taken out of text however a message wrote them: as is, or escaped as a
``repr`` (a ``KeyError``'s message), ``ascii`` or a JSON string would escape them."""

from __future__ import annotations

import json

import pytest

from consumer_kit.keys import OperationKey
from consumer_kit.redaction import describe, format_exception, redact

IDS = [
    "order-1234567",                # plain
    "C:\\orders\\42-abc",           # backslashes: repr and JSON double them
    "it's \"quoted\" 99",           # both quotes: repr escapes one of them
    "zero\u200bwidth-123",          # an invisible character: repr writes \u200b
    "café-créme-77",                # non-ASCII: ascii() and JSON escape it
]


@pytest.mark.parametrize("delivery_id", IDS)
def test_every_written_form_of_the_id_and_key_is_redacted(delivery_id: str) -> None:
    key = OperationKey("orders", 1, delivery_id)
    for secret in (delivery_id, str(key)):
        for form in (secret, repr(secret), ascii(secret), json.dumps(secret), json.dumps(secret, ensure_ascii=False)):
            text = redact(f"failed on {form} here", key)
            assert delivery_id not in text and form.strip("'\"") not in text, (form, text)
            assert "<key>" in text


@pytest.mark.parametrize("delivery_id", IDS)
def test_a_key_error_on_the_id_keeps_no_trace_of_it(delivery_id: str) -> None:
    key = OperationKey("orders", 1, delivery_id)
    try:
        {}[delivery_id]
    except KeyError as exc:
        assert repr(delivery_id)[1:-1] in str(exc)  # what KeyError's message holds: the id's repr
        shown = describe(exc, key) + format_exception(exc, key)
    for form in (delivery_id, repr(delivery_id)[1:-1], ascii(delivery_id)[1:-1]):
        assert form not in shown, shown
    assert "KeyError: '<key>'" in shown or 'KeyError: "<key>"' in shown, shown


def test_a_short_id_is_left_alone_but_the_whole_key_is_not() -> None:
    key = OperationKey("orders", 1, "42")
    assert redact("order 42 of orders:v1:42", key) == "order 42 of <key>"
