"""Webhook signature verifiers: Standard Webhooks (Svix), Stripe, GitHub and a generic HMAC.

A verifier checks the raw body bytes as they arrived (never a re-serialised body) against one of its
secrets (several during a rotation), comparing in constant time, and names the provider's stable id
for the delivery. It raises :class:`~consumer_kit.http.MalformedRequest` (400) when a header it needs
is missing or malformed, and :class:`~consumer_kit.http.Unauthenticated` (401) for a wrong signature
or a timestamp outside the tolerance, with one code for all of these so a prober learns nothing.
:meth:`Verifier.stable_id` runs only on verified requests: an unparseable body raises
:class:`~consumer_kit.UnparseableDelivery`, a parseable one without an id
:class:`~consumer_kit.MissingStableId`; the pipeline parks both with the raw body.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, Protocol
from urllib.parse import parse_qs

from standardwebhooks.webhooks import EmptyWebhookSecretError, Webhook

from consumer_kit.errors import ConfigurationError, MissingStableId, UnparseableDelivery
from consumer_kit.http import MalformedRequest, Unauthenticated
from consumer_kit.untrusted import loads_json

Secrets = str | bytes | Sequence[str | bytes]
"""A secret, or several while one is rotated out: every one is tried."""

Clock = Callable[[], float]

_TIMESTAMP = re.compile(r"[0-9]{1,12}")


class Verifier(Protocol):
    """Authenticates a webhook request and names its stable id."""

    header_names: frozenset[str]
    """Lower-case headers the verifier reads; a request repeating one of them is malformed."""

    def verify(self, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        """Authenticate the request (headers lower-cased); return the security-relevant attributes
        that a redelivery must repeat (for the fingerprint). Raises MalformedRequest/Unauthenticated."""
        ...

    def stable_id(self, headers: Mapping[str, str], body: bytes) -> str:
        """The provider's immutable id of a verified delivery; raises MissingStableId or
        UnparseableDelivery."""
        ...


def _secret_list(secrets: Secrets) -> list[str | bytes]:
    items: list[str | bytes] = [secrets] if isinstance(secrets, str | bytes) else list(secrets)
    if not items or any(not item for item in items):
        raise ConfigurationError("a webhook verifier needs at least one non-empty secret")
    return items


def _as_bytes(secret: str | bytes) -> bytes:
    return secret.encode("utf-8") if isinstance(secret, str) else secret


def _required(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None or not value.strip():
        raise MalformedRequest("missing_header")
    return value.strip()


def _check_timestamp(raw: str, tolerance: float, clock: Clock) -> int:
    if not _TIMESTAMP.fullmatch(raw):
        raise MalformedRequest("malformed_timestamp")
    stamp = int(raw)
    if abs(clock() - stamp) > tolerance:  # stale or from the future: both replay windows
        raise Unauthenticated()
    return stamp


def _any_match(expected: Sequence[bytes], given: Sequence[bytes]) -> bool:
    matched = False
    for want in expected:
        for got in given:
            # Every pair is compared (no early exit), each in constant time.
            matched |= hmac.compare_digest(want, got)
    return matched


def _json_object(body: bytes) -> dict[str, Any]:
    # Not strict: what json.loads accepts, bounded; anything else (nesting 100,000 deep too) is an
    # UnparseableJson, which parks as unparseable like any body that cannot be read.
    parsed = loads_json(body, strict=False)
    if not isinstance(parsed, dict):
        raise UnparseableDelivery("the body is not a JSON object")
    return parsed


def _field(document: Mapping[str, Any], path: str) -> str:
    value: Any = document
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise MissingStableId(f"the body has no {path!r} field")
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise MissingStableId(f"the body's {path!r} field is not a string")
    return str(value)


class StandardWebhooksVerifier:
    """Standard Webhooks (and Svix): ``webhook-id``, ``webhook-timestamp``, ``webhook-signature``
    (or the same ``svix-*`` headers); HMAC-SHA256 over ``{id}.{timestamp}.{body}``, base64, in a
    space-separated list of ``v1,<signature>``. ``whsec_`` secrets are base64-decoded, as the
    ``standardwebhooks`` library does. The key is the message id, which the provider keeps on retries.
    """

    header_names = frozenset({
        "webhook-id", "webhook-timestamp", "webhook-signature", "svix-id", "svix-timestamp", "svix-signature",
    })

    def __init__(self, secrets: Secrets, *, tolerance: float = 300.0, require_json: bool = True,
                 clock: Clock = time.time) -> None:
        self._signers: list[Webhook] = []
        for secret in _secret_list(secrets):
            try:
                self._signers.append(Webhook(secret))
            except (ValueError, EmptyWebhookSecretError) as exc:  # binascii.Error is a ValueError
                raise ConfigurationError("a Standard Webhooks secret is not valid base64") from exc
        self.tolerance = tolerance
        self.require_json = require_json
        self.clock = clock

    @staticmethod
    def _prefix(headers: Mapping[str, str]) -> str:
        return "svix" if "webhook-id" not in headers and "svix-id" in headers else "webhook"

    def verify(self, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        """See :class:`Verifier`."""
        prefix = self._prefix(headers)
        msg_id = _required(headers, f"{prefix}-id")
        raw_stamp = _required(headers, f"{prefix}-timestamp")
        given: list[bytes] = []
        for entry in _required(headers, f"{prefix}-signature").split(" "):
            version, _, signature = entry.partition(",")
            if version != "v1" or not signature:
                continue  # other schemes (v1a) and noise are not ours to judge
            try:
                given.append(base64.b64decode(signature, validate=True))
            except (binascii.Error, ValueError):
                continue
        if not given:
            raise MalformedRequest("malformed_signature")
        stamp = _check_timestamp(raw_stamp, self.tolerance, self.clock)
        try:
            text = body.decode("utf-8")  # the library signs str; strict UTF-8 round-trips byte for byte
        except UnicodeDecodeError:
            raise Unauthenticated() from None
        moment = datetime.fromtimestamp(stamp, UTC)
        try:
            expected = [base64.b64decode(signer.sign(msg_id, moment, text).split(",", 1)[1])
                        for signer in self._signers]
        except (ValueError, UnicodeError):  # the library's raw errors on odd ids (lone surrogates)
            raise Unauthenticated() from None
        if not _any_match(expected, given):
            raise Unauthenticated()
        return {}

    def stable_id(self, headers: Mapping[str, str], body: bytes) -> str:
        """The ``webhook-id`` (or ``svix-id``); the body must be JSON unless ``require_json=False``."""
        if self.require_json:
            loads_json(body, strict=False)  # UnparseableJson when it is not (see _json_object)
        return headers[f"{self._prefix(headers)}-id"].strip()


class StripeVerifier:
    """Stripe: ``Stripe-Signature: t=<unix time>,v1=<hex>[,v1=<hex>...]`` (several ``v1`` while a
    secret rolls), HMAC-SHA256 over ``{t}.{body}``; the ``whsec_...`` secret is used as it is.
    Unlike stripe-python, timestamps too far in the future are refused as well as stale ones.
    The key is the event id (``evt_...``) from the body; Stripe keeps it on every retry.
    """

    header_names = frozenset({"stripe-signature"})

    def __init__(self, secrets: Secrets, *, tolerance: float = 300.0, clock: Clock = time.time) -> None:
        self._secrets = [_as_bytes(secret) for secret in _secret_list(secrets)]
        self.tolerance = tolerance
        self.clock = clock

    def verify(self, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        """See :class:`Verifier`."""
        stamps: list[str] = []
        given: list[bytes] = []
        for item in _required(headers, "stripe-signature").split(","):
            name, _, value = item.strip().partition("=")
            if name == "t":
                stamps.append(value)
            elif name == "v1" and value:
                given.append(value.encode("utf-8", "surrogatepass"))
        if len(stamps) != 1 or not given:
            raise MalformedRequest("malformed_signature")
        stamp = _check_timestamp(stamps[0], self.tolerance, self.clock)
        signed = str(stamp).encode("ascii") + b"." + body
        expected = [hmac.new(secret, signed, hashlib.sha256).hexdigest().encode("ascii")
                    for secret in self._secrets]
        if not _any_match(expected, given):
            raise Unauthenticated()
        return {}

    def stable_id(self, headers: Mapping[str, str], body: bytes) -> str:
        """The event's ``id``."""
        return _field(_json_object(body), "id")


class GitHubVerifier:
    """GitHub: ``X-Hub-Signature-256: sha256=<hex>`` over the body.

    The key is ``<X-GitHub-Hook-ID>/<X-GitHub-Delivery>``: GitHub sends the same delivery GUID to
    every hook subscribed to an event (and keeps it on a manual redelivery), so the GUID alone would
    make the second hook's delivery look like a duplicate of the first's. ``X-GitHub-Event`` is a
    security-relevant attribute. The body is JSON, or a form whose ``payload`` field is JSON.
    """

    header_names = frozenset(
        {"x-hub-signature-256", "x-github-hook-id", "x-github-delivery", "x-github-event"}
    )

    def __init__(self, secrets: Secrets) -> None:
        self._secrets = [_as_bytes(secret) for secret in _secret_list(secrets)]

    def verify(self, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        """See :class:`Verifier`."""
        signature = _required(headers, "x-hub-signature-256")
        event = _required(headers, "x-github-event")
        _required(headers, "x-github-hook-id")
        _required(headers, "x-github-delivery")
        scheme, _, digest = signature.partition("=")
        if scheme != "sha256" or not digest:
            raise MalformedRequest("malformed_signature")
        expected = [hmac.new(secret, body, hashlib.sha256).hexdigest().encode("ascii")
                    for secret in self._secrets]
        if not _any_match(expected, [digest.encode("utf-8", "surrogatepass")]):
            raise Unauthenticated()
        return {"event": event}

    def stable_id(self, headers: Mapping[str, str], body: bytes) -> str:
        """``<hook id>/<delivery GUID>``."""
        if headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
            try:
                payload = parse_qs(body.decode("utf-8"), strict_parsing=True).get("payload", [])
            except (ValueError, UnicodeDecodeError):
                raise UnparseableDelivery("the form body cannot be parsed") from None
            if len(payload) != 1:
                raise UnparseableDelivery("the form body has no single payload field")
            body = payload[0].encode("utf-8")
        _json_object(body)
        return f"{headers['x-github-hook-id'].strip()}/{headers['x-github-delivery'].strip()}"


class HmacVerifier:
    """Any provider that signs the raw body with an HMAC: ``header`` carries the signature (after an
    optional ``prefix`` such as ``sha256=``), ``algorithm`` is a hashlib name, ``encoding`` hex or
    base64. The key comes from ``id_header`` or from ``id_field`` (a dotted path) of a JSON body.
    """

    def __init__(
        self,
        secrets: Secrets,
        *,
        header: str,
        algorithm: str = "sha256",
        encoding: Literal["hex", "base64"] = "hex",
        prefix: str = "",
        id_header: str | None = None,
        id_field: str | None = None,
    ) -> None:
        if (id_header is None) == (id_field is None):
            raise ConfigurationError("HmacVerifier needs exactly one of id_header and id_field")
        if algorithm not in hashlib.algorithms_guaranteed or algorithm.startswith("shake"):
            raise ConfigurationError(f"unsupported HMAC algorithm {algorithm!r}")
        if encoding not in ("hex", "base64"):
            raise ConfigurationError("encoding must be 'hex' or 'base64'")
        self._secrets = [_as_bytes(secret) for secret in _secret_list(secrets)]
        self.header = header.lower()
        self.algorithm = algorithm
        self.encoding = encoding
        self.prefix = prefix
        self.id_header = id_header.lower() if id_header else None
        self.id_field = id_field
        self.header_names = frozenset({self.header} | ({self.id_header} if self.id_header else set()))

    def verify(self, headers: Mapping[str, str], body: bytes) -> dict[str, str]:
        """See :class:`Verifier`."""
        raw = _required(headers, self.header)
        if self.id_header is not None:
            _required(headers, self.id_header)
        if not raw.startswith(self.prefix) or len(raw) == len(self.prefix):
            raise MalformedRequest("malformed_signature")
        signature = raw[len(self.prefix):]
        digests = [hmac.new(secret, body, self.algorithm).digest() for secret in self._secrets]
        if self.encoding == "hex":
            expected = [d.hex().encode("ascii") for d in digests]
            given = signature.lower().encode("utf-8", "surrogatepass")
        else:
            expected = digests
            try:
                given = base64.b64decode(signature, validate=True)
            except (binascii.Error, ValueError):
                raise Unauthenticated() from None
        if not _any_match(expected, [given]):
            raise Unauthenticated()
        return {}

    def stable_id(self, headers: Mapping[str, str], body: bytes) -> str:
        """The id header's value, or the id field of the JSON body."""
        if self.id_header is not None:
            return headers[self.id_header].strip()
        assert self.id_field is not None
        return _field(_json_object(body), self.id_field)
