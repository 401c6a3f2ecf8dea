"""Untrusted JSON nested far past the interpreter's recursion limit, at each place consumer-kit parses
it: refused as unparseable (one error, :class:`UnparseableJson`), never a ``RecursionError``.

The entry points with a server or a broker in front are also run end to end in
``tests/integration/test_deep_json.py``."""

from __future__ import annotations

import base64
import hashlib
import hmac
import inspect
import json
import sys
from collections.abc import Callable
from typing import Any

import pytest

from consumer_kit import Delivery, MissingStableId, UnparseableDelivery
from consumer_kit.delivery import RefusedReplay
from consumer_kit.keys import KeyDigester
from consumer_kit.replay import unseal
from consumer_kit.sources.cloudevents import cloudevent_key_mapper
from consumer_kit.sources.envelopes import (
    EnvelopedSource,
    EnvelopeMismatch,
    Unwrapped,
    amqp_cloudevent,
    is_s3_test_event,
    unwrap,
)
from consumer_kit.sources.webhooks import GitHubVerifier, HmacVerifier, StandardWebhooksVerifier, StripeVerifier
from consumer_kit.sources.webhooks.message import to_delivery
from consumer_kit.untrusted import MAX_JSON_DEPTH, UnparseableJson, loads_json
from tests.signing import github_headers, standard_headers, stripe_signature

LEVELS = 100_000
DEEP = b"[" * LEVELS + b"]" * LEVELS
DEEP_OBJECT = b'{"a":' * LEVELS + b"1" + b"}" * LEVELS


@pytest.mark.parametrize("body", [DEEP, DEEP_OBJECT, b'{"x": ' + DEEP + b"}"], ids=["array", "object", "inside"])
@pytest.mark.parametrize("strict", [True, False])
def test_deep_json_is_unparseable_not_a_recursion_error(body: bytes, strict: bool) -> None:
    with pytest.raises(UnparseableJson, match=f"nested deeper than {MAX_JSON_DEPTH} levels") as caught:
        loads_json(body, strict=strict)
    # The one error: what json.loads raises (a ValueError), and a delivery that parks as unparseable.
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, UnparseableDelivery)
    assert caught.value.reason == "unparseable"
    with pytest.raises(RecursionError):
        json.loads(body)  # what it would have been


def test_brackets_inside_strings_are_not_nesting() -> None:
    text = json.dumps({"s": "[" * LEVELS, "t": '{"' * 1000})
    assert loads_json(text) == json.loads(text)


def test_a_stack_already_deep_is_unparseable_too() -> None:
    # Within the depth limit, but called with the stack nearly full: the parser's own RecursionError.
    limit = sys.getrecursionlimit()

    def down(n: int) -> Any:
        return loads_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) if n == 0 else down(n - 1)

    stack = len(inspect.stack(0))
    with pytest.raises(UnparseableJson):
        down(limit - stack - MAX_JSON_DEPTH // 2)


def test_strict_is_rfc_8259_and_not_strict_is_what_json_loads_takes() -> None:
    utf16 = '[1, "é"]'.encode("utf-16")
    nan = loads_json(b"[NaN]", strict=False)[0]
    assert nan != nan
    assert loads_json(utf16, strict=False) == json.loads(utf16) == [1, "é"]
    for text, strict in ((b"[NaN]", True), (utf16, True), (b"\xff", False), (b"{", False)):
        with pytest.raises(UnparseableJson):
            loads_json(text, strict=strict)


def test_the_message_never_quotes_the_text() -> None:
    secret = "orders:v1:do-not-echo-this-id"
    for text in (f'{{"id": "{secret}" nope', f'["{secret}", \xff]', f'"{secret}'):
        with pytest.raises(UnparseableJson) as caught:
            loads_json(text.encode("latin-1") if "\xff" in text else text.encode())
        assert secret not in str(caught.value)


def test_a_handler_reading_a_deep_body_parks_it() -> None:
    # ctx.delivery.json(): an UnparseableJson is a TerminalError, so the pipeline parks at once.
    with pytest.raises(UnparseableJson):
        Delivery(id="m-1", body=DEEP).json()
    assert Delivery(id="m-1", body=b'{"n": NaN}').json()["n"] != 0  # as json.loads: NaN is taken


SW_SECRET = "whsec_" + base64.b64encode(b"standard-webhooks-secret-0123456").decode()


def _shop(body: bytes) -> dict[str, str]:
    return {"x-shop-signature": base64.b64encode(hmac.new(b"shop", body, hashlib.sha256).digest()).decode()}


VERIFIERS: list[tuple[str, Any, Callable[[bytes], dict[str, str]]]] = [
    ("standard", StandardWebhooksVerifier(SW_SECRET), lambda b: standard_headers(SW_SECRET, "msg_1", b)),
    ("stripe", StripeVerifier("whsec_s"), lambda b: {"stripe-signature": stripe_signature("whsec_s", b)}),
    ("github", GitHubVerifier("gh"), lambda b: github_headers("gh", b, hook_id="1", delivery="d-1")),
    ("hmac", HmacVerifier(b"shop", header="X-Shop-Signature", encoding="base64", id_field="event.id"), _shop),
]


@pytest.mark.parametrize(("verifier", "sign"), [(v, s) for _, v, s in VERIFIERS], ids=[n for n, _, _ in VERIFIERS])
@pytest.mark.parametrize("body", [DEEP, DEEP_OBJECT], ids=["array", "object"])
def test_every_webhook_verifier_calls_a_deep_body_unparseable(verifier: Any, sign: Callable[[bytes], dict[str, str]],
                                                              body: bytes) -> None:
    headers = sign(body)
    with pytest.raises(UnparseableDelivery):
        verifier.stable_id(headers, body)
    delivery = to_delivery(verifier, headers, body)  # verified, without an id: parked by the pipeline
    assert (delivery.id, delivery.body) == (None, body)


def test_a_github_form_with_a_deep_payload_is_unparseable() -> None:
    from urllib.parse import quote

    body = b"payload=" + quote(b"[" * 5000 + b"]" * 5000).encode()
    headers = {**github_headers("gh", body, hook_id="1", delivery="d-1"),
               "content-type": "application/x-www-form-urlencoded"}
    with pytest.raises(UnparseableDelivery):
        GitHubVerifier("gh").stable_id(headers, body)


@pytest.mark.parametrize("envelope", ["sns", "eventbridge", "s3", "cloudevents"])
def test_every_envelope_parks_a_deep_message_as_a_mismatch(envelope: str) -> None:
    [delivery] = unwrap(envelope, message_id="sqs-1", body=DEEP, headers={})
    assert isinstance(delivery, Unwrapped) and delivery.mismatch is not None and delivery.body == DEEP
    with pytest.raises(EnvelopeMismatch):
        EnvelopedSource(namespace="orders", version=1).key(delivery)


def test_an_sns_message_that_is_deep_inside_reaches_the_handler_as_unparseable() -> None:
    notification = {"Type": "Notification", "MessageId": "m-1", "TopicArn": "arn:aws:sns:eu-west-1:1:t",
                    "Message": DEEP.decode()}
    [delivery] = unwrap("sns", message_id="sqs-1", body=json.dumps(notification).encode(), headers={})
    assert delivery.id is not None
    with pytest.raises(UnparseableJson):
        delivery.json()


def test_the_amqp_cloudevents_binding_and_the_s3_test_event_check() -> None:
    delivery = amqp_cloudevent(Delivery(id="m-1", body=DEEP), "application/cloudevents+json")
    assert isinstance(delivery, Unwrapped) and delivery.mismatch is not None
    assert not is_s3_test_event(b'{"Event": "s3:TestEvent", "x": ' + DEEP + b"}")


def test_a_key_function_that_reads_a_deep_body_parks_it_unparseable() -> None:
    source = EnvelopedSource(namespace="orders", version=1, key=lambda d: d.json()["order"])
    with pytest.raises(MissingStableId) as caught:
        source.key(Delivery(id="m-1", body=DEEP))
    assert caught.value.reason == "unparseable"


def test_the_cloudevent_key_of_a_deep_queue_message_is_none() -> None:
    assert cloudevent_key_mapper(Delivery(id="m-1", body=DEEP)) is None


def test_a_deep_replay_header_is_refused_not_a_crash() -> None:
    refused = unseal(DEEP, b"body", KeyDigester(b"k" * 32))
    assert isinstance(refused, RefusedReplay) and refused.why.endswith("malformed")


def test_a_deep_redrive_policy_is_no_policy() -> None:
    from consumer_kit.sources.sqs.queue import _redrive_policy

    assert _redrive_policy({"RedrivePolicy": DEEP.decode()}) is None
