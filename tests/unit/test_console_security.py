"""The console's sign-in and CSRF tokens (consumer_kit.console.security): a token is bound to whom it was
made for, a session ends with its token, a tampered one is nobody's, and a form from another site is
refused."""

from __future__ import annotations

import json

from starlette.requests import Request

from consumer_kit.console.security import SESSION_COOKIE, Gate, Principal, Role, same_origin
from tests.conftest import make_settings

ANN = "ann-token-0123456789abcdef"


def gate(tokens: dict[str, str]) -> Gate:
    return Gate(make_settings("sqlite+aiosqlite:///unused.db", console_tokens=json.dumps(tokens)))


def request_with(cookie: str) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/", "headers": [
        (b"cookie", f"{SESSION_COOKIE}={cookie}".encode())]})


async def test_a_session_is_its_tokens_and_ends_with_it() -> None:
    signed = gate({ANN: "ann:operator"}).sign_in(ANN)
    assert signed is not None
    principal, cookie = signed
    assert principal == Principal("ann", Role.OPERATOR) and ANN not in cookie
    assert await gate({ANN: "ann:operator"}).principal(request_with(cookie)) == principal
    assert await gate({ANN: "ann:viewer"}).principal(request_with(cookie)) is None  # its role changed
    assert await gate({"other-token-0123456789": "ann:operator"}).principal(request_with(cookie)) is None
    assert await gate({ANN: "ann:operator"}).principal(request_with(cookie[:-2] + "xx")) is None
    assert gate({ANN: "ann:operator"}).sign_in("not-a-token-of-ours") is None


def test_a_csrf_token_is_good_for_whom_it_was_made_for_only() -> None:
    made = gate({ANN: "ann:operator"})
    ann, vic = Principal("ann", Role.OPERATOR), Principal("vic", Role.VIEWER)
    token = made.csrf(ann)
    assert made.csrf_ok(token, ann)
    assert not made.csrf_ok(token, vic) and not made.csrf_ok(None, ann) and not made.csrf_ok("", ann)
    assert not made.csrf_ok(token + "x", ann)
    before = made.csrf(None, "nonce-1")
    assert made.csrf_ok(before, None, "nonce-1") and not made.csrf_ok(before, None, "nonce-2")
    assert not made.csrf_ok(before, None, None)


def test_a_form_from_another_site_is_refused() -> None:
    assert same_origin({"origin": "http://127.0.0.1:8000"}, "127.0.0.1:8000")
    assert same_origin({}, "127.0.0.1:8000")  # no Origin: the CSRF token still decides
    assert not same_origin({"origin": "https://evil.example"}, "127.0.0.1:8000")
    assert not same_origin({"origin": "null"}, "127.0.0.1:8000")
