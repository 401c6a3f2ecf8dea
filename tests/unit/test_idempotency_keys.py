"""The request side of idempotent endpoints, without a server: the ``Idempotency-Key`` header as the
draft defines it (an RFC 8941 sf-string) and the fingerprint that says whether two requests are the
same one."""

from __future__ import annotations

import json
from typing import Any

import pytest
from http_sfv.item import Item
from hypothesis import given
from hypothesis import strategies as st

from consumer_kit.errors import InvalidKey
from consumer_kit.http.idempotency import fingerprint, header_key
from consumer_kit.http.idempotency.keys import KeyRefused
from consumer_kit.keys import validate_key

JSON = "application/json"


def key_of(*values: bytes, bare: bool = False) -> str | None:
    return header_key([(b"content-type", b"application/json"), *((b"Idempotency-Key", v) for v in values)],
                      bare=bare)


def refused(*values: bytes, bare: bool = False) -> str:
    with pytest.raises(KeyRefused) as caught:
        key_of(*values, bare=bare)
    assert str(caught.value) == caught.value.code  # the message is the code, never the key
    return caught.value.code


# --- the header -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "key"), [
    (b'"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    (b'"a b"', "a b"),  # an inner space is part of the key
    (b'"say \\"hi\\" \\\\o/"', 'say "hi" \\o/'),  # the sf-string's two escapes
    (b'"k";v=1', "k"),  # parameters are not part of the key
    (b'"k"; a=1; b="x";c', "k"),
    (b'  "k"', "k"),  # leading spaces are not part of the field value
])
def test_an_sf_string_is_the_key(raw: bytes, key: str) -> None:
    assert key_of(raw) == key
    assert key_of(raw, bare=True) == key  # accepting bare keys changes nothing for a quoted one


def test_no_header_is_no_key() -> None:
    assert header_key([(b"content-type", b"text/plain")]) is None
    assert header_key([]) is None


def test_the_header_name_is_case_insensitive() -> None:
    assert header_key([(b"IDEMPOTENCY-KEY", b'"k"')]) == "k"
    assert header_key([(b"idempotency-key", b'"k"')]) == "k"


@pytest.mark.parametrize("raw", [b"abc", b"8e03978e-40d5", b"123", b"?1", b"a1:b2"])
def test_a_bare_token_is_refused_unless_bare_keys(raw: bytes) -> None:
    assert refused(raw) == "idempotency_key_malformed"
    assert key_of(raw, bare=True) == raw.decode()


def test_a_bare_key_is_held_to_the_key_rules_too() -> None:
    assert refused(b"a\x01b", bare=True) == "idempotency_key_malformed"  # control character
    assert refused("cl\u00e9".encode("latin-1"), bare=True) == "idempotency_key_malformed"  # not ASCII
    assert refused(b"x" * 256, bare=True) == "idempotency_key_malformed"
    assert key_of(b"x" * 255, bare=True) == "x" * 255


def test_a_header_sent_twice_is_repeated() -> None:
    assert refused(b'"a"', b'"b"') == "idempotency_key_repeated"
    assert refused(b'"a"', b'"a"') == "idempotency_key_repeated"  # even the same value twice
    assert refused(b"a", b'"a"', bare=True) == "idempotency_key_repeated"


def test_at_most_255_bytes() -> None:
    assert key_of(b'"' + b"k" * 255 + b'"') == "k" * 255
    assert refused(b'"' + b"k" * 256 + b'"') == "idempotency_key_malformed"


@pytest.mark.parametrize("raw", [
    b'"a\tb"',  # no control character in an sf-string
    b'"a\x00b"',
    b'"a\x7fb"',
    b'"\x1b[31m"',
    '"cl\u00e9"'.encode(),  # an sf-string is ASCII
    b'""',  # an empty key
    b'" k"',  # surrounding whitespace inside the quotes
    b'"k "',
    b'"k',  # unterminated
    b'"k" x',  # trailing text
    b'"k", "l"',  # a list, not an item
    b'"a\\nb"',  # an escape the grammar does not have
    b"",
])
def test_a_malformed_header_is_refused(raw: bytes) -> None:
    assert refused(raw) == "idempotency_key_malformed"


# --- the fingerprint --------------------------------------------------------------------------------


def fp(method: str = "POST", path: str = "/labels", query: bytes = b"", body: bytes = b'{"a": 1}',
       content_type: str | None = JSON, headers: list[tuple[str, str]] | None = None) -> str:
    return fingerprint(method, path, query, body, content_type, headers or [])


ORDER: dict[str, Any] = {"order": "o-1", "lines": [{"sku": "a", "qty": 2}, {"sku": "b", "qty": 1}], "note": "caf\u00e9",
         "gift": None, "total": 12.5}


def test_a_fingerprint_is_what_earlier_versions_stored() -> None:
    # Stored records carry these: a retry after an upgrade must still be the same request.
    assert fingerprint("POST", "/labels", b"b=2&a=1&a=", json.dumps(ORDER).encode(), JSON,
                       [("X-Account", "acct-1"), ("b", "2")]) == \
        "d324e872af812f0716c1819d873616507474a9d0d6551ba69414b94891ba538b"
    assert fingerprint("PUT", "/l\u00e9", b"", b"not json", "text/plain") == \
        "3dc74e6fcc0e8e1915d5195f0fd0202c3964162824a02bac9feef87af296bcce"
    assert fingerprint("post", "/labels", b"", b"", None) == \
        "a520b25cf4e82ec44b20b7f71c9db33f1a23c1a726e7296374bf09ef2d8ad45c"


def test_the_same_json_serialised_another_way_is_the_same_request() -> None:
    compact = json.dumps(ORDER, separators=(",", ":")).encode()
    reordered = json.dumps(dict(reversed(list(ORDER.items()))), indent=4).encode()
    unicode_escaped = json.dumps(ORDER, ensure_ascii=True).encode()  # "caf\u00e9" written as an escape
    assert b"\\u00e9" in unicode_escaped and compact != reordered
    assert fp(body=compact) == fp(body=reordered) == fp(body=unicode_escaped)
    # the media type's parameters and the +json suffix are JSON too
    assert fp(body=compact) == fp(body=reordered, content_type="application/json; charset=utf-8")
    assert fp(body=compact, content_type="application/merge-patch+json") == fp(
        body=reordered, content_type="Application/Merge-Patch+JSON")


def test_a_different_json_value_is_a_different_request() -> None:
    base = fp(body=json.dumps(ORDER).encode())
    for changed in ({**ORDER, "total": 12.6}, {**ORDER, "gift": False}, {**ORDER, "extra": 1},
                    {k: v for k, v in ORDER.items() if k != "gift"},
                    {**ORDER, "lines": list(reversed(ORDER["lines"]))}):  # a list's order is the value's
        assert fp(body=json.dumps(changed).encode()) != base


def test_a_body_that_is_not_json_counts_byte_for_byte() -> None:
    assert fp(body=b'{"a": 1}', content_type="text/plain") != fp(body=b'{"a":1}', content_type="text/plain")
    assert fp(body=b"a=1&b=2", content_type="application/x-www-form-urlencoded") != fp(
        body=b"b=2&a=1", content_type="application/x-www-form-urlencoded")
    assert fp(body=b"{not json", content_type=JSON) == fp(body=b"{not json", content_type=JSON)
    assert fp(body=b"{not json", content_type=JSON) != fp(body=b"{not json ", content_type=JSON)
    assert fp(body=b"") == fp(body=b"", content_type=None)


def test_the_order_of_the_query_does_not_matter_but_its_pairs_do() -> None:
    assert fp(query=b"a=1&b=2") == fp(query=b"b=2&a=1")
    assert fp(query=b"a=1&a=2") == fp(query=b"a=2&a=1")
    assert fp(query=b"a=1&b=2") != fp(query=b"a=1&b=3")
    assert fp(query=b"a=1") != fp(query=b"a=1&a=1")
    assert fp(query=b"a=1") != fp(query=b"")
    assert fp(query=b"a=") != fp(query=b"")  # a blank value is still a pair
    assert fp(query=b"a=%20") == fp(query=b"a=+")  # the same decoded value


def test_the_method_the_path_and_the_body_are_the_request() -> None:
    base = fp()
    assert fp(method="post") == base
    assert fp(method="PUT") != base
    assert fp(path="/labels/") != base
    assert fp(path="/Labels") != base
    assert fp(body=b'{"a": 2}') != base
    assert fp(body=b"") != base


def test_named_headers_are_part_of_the_request() -> None:
    base = fp(headers=[("X-Account", "acct-1")])
    assert fp(headers=[("x-account", "acct-1")]) == base  # a header's name is case-insensitive
    assert fp(headers=[("X-Account", "acct-2")]) != base
    assert fp(headers=[]) != base
    two = fp(headers=[("a", "1"), ("b", "2")])
    assert fp(headers=[("b", "2"), ("a", "1")]) == two


def test_the_parts_cannot_run_into_each_other() -> None:
    # each part is length-prefixed: moving bytes from one part to the next is another request
    assert fp(path="/ab", body=b"c", content_type=None) != fp(path="/a", body=b"bc", content_type=None)
    assert fp(query=b"ab=c") != fp(query=b"a=bc")
    assert fp(headers=[("ab", "c")]) != fp(headers=[("a", "bc")])
    assert fp(method="POS", path="T/x") != fp(method="POST", path="/x")


@given(st.text(st.characters(min_codepoint=0, max_codepoint=0xFF), max_size=20),
       st.sampled_from(['"{}"', "{}", ' "{}"', '"{}";a=1', '"{}" ', '"{}"x']))
def test_the_plain_strings_pattern_reads_what_http_sfv_reads(inner: str, form: str) -> None:
    raw = form.format(inner).encode("latin-1")
    item = Item()
    try:
        item.parse(raw)
        expected: object = item.value
    except ValueError:
        expected = None
    try:
        got: object = header_key([(b"idempotency-key", raw)], bare=False)
    except KeyRefused:
        got = None
    if type(expected) is str:
        try:
            assert got == validate_key(expected)
        except InvalidKey:
            assert got is None
    else:
        assert got is None
