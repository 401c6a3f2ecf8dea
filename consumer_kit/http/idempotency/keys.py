"""The request side of an idempotent endpoint: the ``Idempotency-Key`` header, the caller's scope and the
request's fingerprint (what "the same request" means).

The header is a Structured Field Item whose value is a String (RFC 8941 section 3.3.3, as the IETF draft
``draft-ietf-httpapi-idempotency-key-header`` says): ``Idempotency-Key: "8e03978e-40d5-43e8"``. It is
parsed with ``http-sfv`` rather than by hand, since the grammar (escapes, parameters, trailing text) is
easy to get subtly wrong; only the form nearly every client sends, a quoted string with nothing to
unescape and nothing after it, is read by a pattern first (the same value, tested against http-sfv).
A client that sends the key bare (``Idempotency-Key: 8e03978e``, as many SDKs do) is refused unless the
endpoint accepts ``bare_keys``; either way the key is then held to the rules every operation key follows
(:func:`consumer_kit.keys.validate_key`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Container, Iterable, Sequence
from urllib.parse import parse_qsl

from http_sfv.item import Item

from consumer_kit.errors import InvalidKey
from consumer_kit.keys import validate_key
from consumer_kit.untrusted import UnparseableJson, loads_json

HEADER = b"idempotency-key"
# An sf-string as nearly every client sends it: printable ASCII in quotes, no backslash or quote inside
# (RFC 8941's unescaped characters), nothing around it. Anything else goes to http-sfv.
_PLAIN_STRING = re.compile(rb'"([\x20\x21\x23-\x5b\x5d-\x7e]*)"')

__all__ = ["HEADER", "KeyRefused", "Sent", "fingerprint", "header_key", "key_of", "request_headers", "sent_form",
           "sent_size"]


class KeyRefused(Exception):
    """The request's key is missing, sent twice or malformed; ``code`` is the answer's error (a 400)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def header_key(raw_headers: Iterable[tuple[bytes, bytes]], *, bare: bool = False) -> str | None:
    """The key the request carries (``None``: no header). :class:`KeyRefused` for a header sent twice
    (``idempotency_key_repeated``), one that is not an sf-string or breaks the key rules
    (``idempotency_key_malformed``); the message never quotes the key."""
    return key_of([value for name, value in raw_headers if name.lower() == HEADER], bare=bare)


def request_headers(raw_headers: Iterable[tuple[bytes, bytes]], named: Container[bytes]
                    ) -> tuple[list[bytes], bytes | None, list[tuple[bytes, bytes]]]:
    """In one pass: the ``Idempotency-Key`` header's values, the first ``Content-Type`` and the headers
    whose lower-cased names are in ``named`` (lower-cased), as the request sent them."""
    values: list[bytes] = []
    content_type: bytes | None = None
    kept: list[tuple[bytes, bytes]] = []
    for name, value in raw_headers:
        lowered = name.lower()
        if lowered == HEADER:
            values.append(value)
        elif lowered == b"content-type" and content_type is None:
            content_type = value
        if named and lowered in named:
            kept.append((lowered, value))
    return values, content_type, kept


def key_of(values: Sequence[bytes], *, bare: bool = False) -> str | None:
    """:func:`header_key` of the request's ``Idempotency-Key`` header values, found already."""
    if not values:
        return None
    if len(values) > 1:
        raise KeyRefused("idempotency_key_repeated")
    raw = values[0]
    value: object
    plain = _PLAIN_STRING.fullmatch(raw)
    if plain is not None:  # a quoted string with nothing to unescape and no parameters: what http-sfv reads too
        value = plain.group(1).decode("ascii")
    else:
        item = Item()
        try:
            item.parse(raw)
            value = item.value
        except ValueError:
            value = None
    if type(value) is not str:  # a Token or a number is not the draft's String
        if not bare:
            raise KeyRefused("idempotency_key_malformed")
        try:
            value = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise KeyRefused("idempotency_key_malformed") from None
    try:
        return validate_key(value)
    except InvalidKey:
        raise KeyRefused("idempotency_key_malformed") from None


def fingerprint(method: str, path: str, query: bytes, body: bytes, content_type: str | None,
                headers: Sequence[tuple[str, str]] = ()) -> str:
    """SHA-256 over the method, the path, the query's pairs in order of name, the body and the named
    ``headers``: the same request sent again has the same fingerprint. A JSON body is taken in a
    canonical form (keys sorted, no spaces), so that a client re-serialising the same object is not a
    different request; any other body byte for byte."""
    parts = [method.upper().encode(), path.encode("utf-8", "surrogateescape")]
    if query:
        for name, value in sorted(parse_qsl(query.decode("latin-1"), keep_blank_values=True)):
            parts += (name.encode("utf-8", "surrogateescape"), value.encode("utf-8", "surrogateescape"))
    parts.append(_canonical(body, content_type))
    for name, value in sorted((n.lower(), v) for n, v in headers):
        parts += (name.encode("latin-1"), value.encode("latin-1", "replace"))
    # Each part length-prefixed (8 bytes, big-endian), hashed as one text.
    return hashlib.sha256(b"".join(len(part).to_bytes(8, "big") + part for part in parts)).hexdigest()


Sent = tuple[str, str, bytes, bytes | None, bytes, tuple[tuple[bytes, bytes], ...]]
"""A request as sent (:func:`sent_form`)."""


def sent_form(method: str, path: str, query: bytes, body: bytes, content_type: bytes | None,
              headers: Sequence[tuple[bytes, bytes]] = ()) -> Sent:
    """Exactly what :func:`fingerprint` reads, as sent (the content type and the named ``headers`` raw):
    two requests with equal forms have the same fingerprint. Comparing two costs a comparison of the
    bytes, where the fingerprint parses a JSON body and writes it again and hashes it; a repeat whose
    form is known for its key is the stored request without that."""
    return method, path, query, content_type, body, tuple(headers)


def sent_size(sent: Sent) -> int:
    """What keeping ``sent`` costs, in bytes (its body and query, about)."""
    return len(sent[2]) + len(sent[4]) + sum(len(n) + len(v) for n, v in sent[5])


def _canonical(body: bytes, content_type: str | None) -> bytes:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if body and (media == "application/json" or media.endswith("+json")):
        try:
            parsed = loads_json(body, strict=False)
        except UnparseableJson:
            return b"raw:" + body
        return b"json:" + json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return b"raw:" + body
