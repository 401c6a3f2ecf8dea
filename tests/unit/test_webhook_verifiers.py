"""The verifiers on their own: published vectors, agreement with the providers' libraries, rotation,
and property-based tests (arbitrary headers and bodies: only the two rejections, never success
without a valid signature)."""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks.webhooks import Webhook

from consumer_kit import ConfigurationError, MissingStableId, UnparseableDelivery
from consumer_kit.http import MalformedRequest, RequestRejected, Unauthenticated
from consumer_kit.sources.webhooks import (
    GitHubVerifier,
    HmacVerifier,
    StandardWebhooksVerifier,
    StripeVerifier,
    Verifier,
)
from tests.signing import github_headers, standard_headers, stripe_signature
from tests.webhook_headers import VERIFIER_HEADERS

SW_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the Standard Webhooks spec's example secret
NOW = 1_700_000_000


def clock() -> float:
    return float(NOW)


def test_github_documented_vector() -> None:
    # docs.github.com, "Validating webhook deliveries": testing the webhook payload validation.
    verifier = GitHubVerifier("It's a Secret to Everybody")
    headers = {
        "x-hub-signature-256": "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        "x-github-event": "ping",
        "x-github-hook-id": "1",
        "x-github-delivery": "guid",
    }
    assert verifier.verify(headers, b"Hello, World!") == {"event": "ping"}
    with pytest.raises(Unauthenticated):
        verifier.verify(headers, b"Hello, World?")


def test_github_key_is_hook_and_delivery() -> None:
    verifier = GitHubVerifier("s")
    body = b'{"zen": "Keep it logically awesome."}'
    one = github_headers("s", body, hook_id="1", delivery="g-1")
    two = github_headers("s", body, hook_id="2", delivery="g-1")
    assert verifier.stable_id(one, body) != verifier.stable_id(two, body)
    form = b"payload=%7B%22a%22%3A+1%7D"
    form_headers = {**one, "content-type": "application/x-www-form-urlencoded"}
    assert verifier.stable_id(form_headers, form) == "1/g-1"


def test_standard_webhooks_agrees_with_the_library() -> None:
    body = b'{"test": 2432232314}'
    now = int(time.time())
    headers = standard_headers(SW_SECRET, "msg_p5jXN8AQM9LWM0D4loKWxJek", body, timestamp=now)
    Webhook(SW_SECRET).verify(body, headers)  # the reference implementation accepts it ...
    StandardWebhooksVerifier(SW_SECRET).verify(headers, body)  # ... and so do we
    library_signed = Webhook(SW_SECRET).sign("msg_1", datetime.fromtimestamp(now, UTC), body.decode())
    StandardWebhooksVerifier(SW_SECRET).verify(
        {
            "webhook-id": "msg_1",
            "webhook-timestamp": str(now),
            "webhook-signature": f"v1a,xyz {library_signed}",
        },
        body,
    )


def test_standard_webhooks_tolerance_is_configurable_both_ways() -> None:
    body = b"{}"
    verifier = StandardWebhooksVerifier(SW_SECRET, tolerance=600, clock=clock)
    for offset in (-599, 599):
        verifier.verify(standard_headers(SW_SECRET, "m", body, timestamp=NOW + offset), body)
    for offset in (-601, 601):
        with pytest.raises(Unauthenticated):
            verifier.verify(standard_headers(SW_SECRET, "m", body, timestamp=NOW + offset), body)


def test_standard_webhooks_bad_secret_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        StandardWebhooksVerifier("whsec_!!!not base64!!!")
    with pytest.raises(ConfigurationError):
        StandardWebhooksVerifier([])


def test_stripe_several_v1_and_rotation() -> None:
    body = b'{"id": "evt_1", "object": "event"}'
    new, old = "whsec_new_secret", "whsec_old_secret"
    signed_old = stripe_signature(old, body, NOW)
    signed_new = stripe_signature(new, body, NOW)
    both = f"{signed_new},v1={signed_old.split('v1=')[1]}"
    StripeVerifier(new, clock=clock).verify({"stripe-signature": both}, body)
    StripeVerifier([new, old], clock=clock).verify({"stripe-signature": signed_old}, body)
    with pytest.raises(Unauthenticated):
        StripeVerifier(new, clock=clock).verify({"stripe-signature": signed_old}, body)
    with pytest.raises(Unauthenticated):  # stripe-python accepts future timestamps; we do not
        StripeVerifier(new, clock=clock).verify(
            {"stripe-signature": stripe_signature(new, body, NOW + 400)}, body
        )
    with pytest.raises(MalformedRequest):
        StripeVerifier(new, clock=clock).verify({"stripe-signature": "t=1"}, body)
    assert StripeVerifier(new).stable_id({}, body) == "evt_1"
    with pytest.raises(UnparseableDelivery):
        StripeVerifier(new).stable_id({}, b"[1, 2]")
    with pytest.raises(MissingStableId):
        StripeVerifier(new).stable_id({}, b'{"object": "event"}')


def test_hmac_verifier_configuration() -> None:
    with pytest.raises(ConfigurationError):
        HmacVerifier("s", header="x-sig")
    with pytest.raises(ConfigurationError):
        HmacVerifier("s", header="x-sig", id_header="x-id", algorithm="not-a-hash")
    verifier = HmacVerifier(["s1", "s2"], header="X-Sig", prefix="sha1=", algorithm="sha1", id_header="X-Id")
    import hashlib
    import hmac

    body = b"anything"
    signature = "sha1=" + hmac.new(b"s2", body, hashlib.sha1).hexdigest().upper()
    verifier.verify({"x-sig": signature, "x-id": "42"}, body)
    assert verifier.stable_id({"x-sig": signature, "x-id": "42"}, body) == "42"


# ---------------------------------------------------------------------------------------------------
# Property-based: arbitrary headers and bodies.

HEADER_NAMES = VERIFIER_HEADERS
header_values = st.one_of(
    st.text(max_size=80),
    st.from_regex(r"v1,[A-Za-z0-9+/=]{0,60}( v1,[A-Za-z0-9+/=]{0,60})?", fullmatch=True),
    st.from_regex(r"t=[0-9]{1,12}(,v1=[0-9a-f]{0,64}){0,3}", fullmatch=True),
    st.from_regex(r"sha256=[0-9a-f]{0,64}", fullmatch=True),
    st.integers(NOW - 1000, NOW + 1000).map(str),
)
headers_strategy = st.dictionaries(st.sampled_from(HEADER_NAMES), header_values, max_size=len(HEADER_NAMES))
bodies = st.one_of(st.binary(max_size=300), st.text(max_size=200).map(str.encode))

VERIFIERS: list[Verifier] = [
    StandardWebhooksVerifier(SW_SECRET, clock=clock),
    StripeVerifier("whsec_x", clock=clock),
    GitHubVerifier("gh"),
    HmacVerifier("h", header="x-sig", id_header="x-id"),
    HmacVerifier("h", header="x-sig", encoding="base64", id_field="id"),
]


@pytest.mark.parametrize("verifier", VERIFIERS, ids=lambda v: type(v).__name__)
@settings(max_examples=200, deadline=None)
@given(headers=headers_strategy, body=bodies)
def test_arbitrary_input_is_only_ever_rejected(
    verifier: Verifier, headers: Mapping[str, str], body: bytes
) -> None:
    try:
        verifier.verify(headers, body)
    except RequestRejected as exc:
        assert exc.status in (400, 401)
    else:  # pragma: no cover - only a forged signature would get here
        pytest.fail("an unsigned request was verified")


@settings(max_examples=200, deadline=None)
@given(
    msg_id=st.text(min_size=1, max_size=40).map(str.strip).filter(bool),
    body=bodies,
    flip=st.integers(0, 10_000),
)
def test_standard_webhooks_only_the_signed_bytes_verify(msg_id: str, body: bytes, flip: int) -> None:
    verifier = StandardWebhooksVerifier(SW_SECRET, clock=clock)
    headers = standard_headers(SW_SECRET, msg_id, body, timestamp=NOW)
    if "\x00" in msg_id or any(ord(c) > 255 for c in msg_id):
        return  # not a value an HTTP header can carry
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(Unauthenticated):
            verifier.verify(headers, body)
        return
    verifier.verify(headers, body)
    if body:
        tampered = bytearray(body)
        tampered[flip % len(body)] ^= 0x01
        with pytest.raises(Unauthenticated):
            verifier.verify(headers, bytes(tampered))
    assert base64.b64decode(headers["webhook-signature"][3:])
