"""The CloudEvents message reader: one event, read from either HTTP content mode, checked against the
specification (v1.0.2: core attributes, the HTTP protocol binding, the JSON event format), and handed
to the pipeline as a :class:`CloudEventDelivery` in binary form.

**Binary form** (what a handler sees in either mode): every attribute as a ``ce-<name>`` header, its
value decoded (Booleans ``true``/``false``, Integers in decimal), ``datacontenttype`` as
``content-type``, and the data as the body: binary mode's body as it arrived; in structured mode JSON
data serialised compactly (numbers exactly as sent), a string under another media type as UTF-8,
``data_base64`` decoded.

**One event, one fingerprint.** The fingerprint covers the event's canonical form, not the bytes of
the transport: every context attribute (``time`` as its UTC instant, ``datacontenttype`` as one
spelling of its media type, ``application/json`` when absent, as the JSON format implies) except the
source's ``volatile_attributes``, and the data: JSON data as a JSON value (member order, whitespace
and the spelling of numbers do not count), any other data as bytes; a string and its UTF-8 bytes are
one value, as are empty data and none (binary mode cannot tell them apart). So the same event sent
in binary and in structured mode is a duplicate, and a changed attribute or changed data under a
known ``source`` + ``id`` is a conflict.

**Invalid events** (everything the specification calls invalid, listed in the docs' CloudEvents page) are handed
over in their raw form with :attr:`CloudEventDelivery.problem` set; the pipeline parks them (400)
and never runs the handler. A missing or empty ``id`` or ``source`` is ``missing_stable_id``;
every other rule is ``unparseable``, with the rule broken as the detail.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import quote

from consumer_kit.delivery import Delivery
from consumer_kit.errors import MissingStableId, TerminalError, UnparseableDelivery
from consumer_kit.sources.cloudevents import values
from consumer_kit.untrusted import loads_json

DEFAULT_DATACONTENTTYPE = "application/json"
_NAME = re.compile(r"[a-z0-9]+")
_STRING_ATTRIBUTES = ("id", "source", "specversion", "type", "datacontenttype", "dataschema", "subject",
                      "time")
"""The core attributes, all String-typed in the JSON format (URI-reference, URI and Timestamp too)."""


class InvalidEvent(UnparseableDelivery):
    """A request that is not a valid CloudEvent: parked as ``unparseable``, its handler never run.
    The message names the rule broken, never an attribute's value."""


@dataclass(frozen=True, slots=True)
class CloudEventDelivery(Delivery):
    """A :class:`~consumer_kit.Delivery` of one CloudEvent in binary form (see the module docstring).

    ``attributes`` are the event's canonical context attributes (those the fingerprint covers);
    ``canonical_data`` is its data in canonical form; ``problem`` is why the event is invalid (the
    delivery then holds the request's raw form, and keying it raises ``problem``).
    """

    canonical_data: bytes = b""
    problem: TerminalError | None = None

    def fingerprint(self) -> str:
        """The fingerprint of the event's canonical form: the same in binary and structured mode."""
        return Delivery(id=None, body=self.canonical_data, attributes=self.attributes).fingerprint()


def key_id(source: str, event_id: str) -> str:
    """The stable id of an event: ``source`` + ``id`` (spec: "producers MUST ensure that source + id
    is unique for each distinct event"), with ``#`` and ``%`` escaped in the source, so the first
    ``#`` always separates it from the id."""
    return f"{quote(source, safe=':/@!$&()*+,;=._~-')}#{event_id}"


def invalid(raw: Delivery, problem: TerminalError) -> CloudEventDelivery:
    """An invalid event's raw form, parked with ``problem`` as its reason."""
    return CloudEventDelivery(id=None, body=raw.body, headers=raw.headers, problem=problem)


def from_binary(headers: Mapping[str, str], body: bytes, *, percent_encoded: bool = True,
                volatile: Collection[str] = ()) -> CloudEventDelivery:
    """The event of a binary-mode request (``headers`` lower-cased; ``percent_encoded``: values as
    sent, else already decoded, as in a :class:`CloudEventDelivery`'s own headers)."""
    raw = {name: value for name, value in headers.items() if name.startswith("ce-") or name == "content-type"}
    try:
        if "ce-datacontenttype" in raw:
            raise InvalidEvent("ce-datacontenttype is sent: binary mode carries it as Content-Type")
        attributes: dict[str, str] = {}
        for name, value in raw.items():
            if name.startswith("ce-"):
                attributes[_named(name[3:])] = _decoded(name, value) if percent_encoded else value
        if "content-type" in raw:
            attributes["datacontenttype"] = raw["content-type"]
        if "data" in attributes:
            raise InvalidEvent("an attribute is named data")
        context = _checked(attributes)
        # A declared JSON media type must hold JSON (JSON format §3.2: unquoted text under
        # application/json "would have been an invalid event"); with none declared, it may.
        canonical = _canonical_bytes(body, values.is_json_media_type(context["datacontenttype"]),
                                     declared="datacontenttype" in attributes)
    except TerminalError as problem:
        return invalid(Delivery(id=None, body=body, headers=raw), problem)
    return _delivery(attributes, context, body, canonical, volatile)


def from_structured(event: Any, raw: bytes, *, volatile: Collection[str] = ()) -> CloudEventDelivery:
    """The event of a JSON-format document (``event``: the parsed JSON value, ``raw``: its text)."""
    raw_form = Delivery(id=None, body=raw, headers={"content-type": "application/cloudevents+json"})
    try:
        if not isinstance(event, dict):
            raise InvalidEvent("a structured event is not a JSON object")
        if getattr(event, "repeated", False):
            raise InvalidEvent("a member name repeats")
        attributes = {name: _attribute(name, value) for name, value in event.items()
                      if name not in ("data", "data_base64") and value is not None}  # null: unset
        context = _checked(attributes)
        body, canonical = _structured_data(event, context["datacontenttype"])
    except TerminalError as problem:
        return invalid(raw_form, problem)
    return _delivery(attributes, context, body, canonical, volatile)


def parse_document(raw: bytes) -> Any:
    """A structured event or batch: UTF-8 JSON, nesting bounded, numbers exact, repeated member
    names remembered. ValueError when it is not that."""
    return _loads_exact(raw)


def dump_document(value: Any) -> bytes:
    """A parsed JSON value written back (a batch member's raw form)."""
    return _json_bytes(value)


# ------------------------------------------------------------------------------------------------


def _decoded(header: str, value: str) -> str:
    try:
        return values.decode_header_value(value)
    except ValueError as exc:
        raise InvalidEvent(f"{header} {exc}") from None


def _named(name: str) -> str:
    if _NAME.fullmatch(name) is None:  # checked first: a message may then name the attribute
        raise InvalidEvent("an attribute name is not lower-case ASCII letters and digits")
    return name


def _attribute(name: str, value: Any) -> str:
    """A structured attribute's value in its canonical string encoding (JSON format §2.2)."""
    _named(name)
    if isinstance(value, str):
        return value
    if name in _STRING_ATTRIBUTES:
        raise InvalidEvent(f"attribute {name} is not a JSON string")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        try:
            values.check_integer(value)
        except ValueError as exc:
            raise InvalidEvent(f"attribute {name} {exc}") from None
        return str(value)
    raise InvalidEvent(f"attribute {name} is not a string, a Boolean or an Integer")


def _checked(attributes: Mapping[str, str]) -> dict[str, str]:
    """The context attributes checked against the specification, in canonical form."""
    for name, value in attributes.items():
        try:
            values.check_string(value)
        except ValueError as exc:
            raise InvalidEvent(f"attribute {name} {exc}") from None
    if "specversion" not in attributes:
        raise InvalidEvent("not a CloudEvent: no specversion")
    if not attributes.get("id") or not attributes.get("source"):
        raise MissingStableId("the CloudEvent has no id or no source")
    if attributes["specversion"] != "1.0":
        raise InvalidEvent("specversion is not 1.0")
    if not attributes.get("type"):
        raise InvalidEvent("attribute type is missing or empty")
    for name in ("subject", "dataschema"):
        if attributes.get(name) == "":
            raise InvalidEvent(f"attribute {name} is empty")
    canonical = dict(attributes)
    checks: list[tuple[str, Callable[[str], str]]] = [
        ("source", values.check_uri_reference), ("dataschema", values.check_absolute_uri),
        ("time", values.canonical_timestamp), ("datacontenttype", values.canonical_media_type)]
    for name, check in checks:
        try:
            if name in attributes:
                canonical[name] = check(attributes[name])
        except ValueError as exc:
            raise InvalidEvent(f"attribute {name} {exc}") from None
    canonical.setdefault("datacontenttype", DEFAULT_DATACONTENTTYPE)
    return canonical


def _structured_data(event: Mapping[str, Any], data_type: str) -> tuple[bytes, bytes]:
    """The body a handler gets and the canonical data of a JSON-format event (JSON format §3.1)."""
    encoded = event.get("data_base64")
    if "data" in event and encoded is not None:
        raise InvalidEvent("data and data_base64 are both present")
    json_typed = values.is_json_media_type(data_type)
    if encoded is not None:
        if not isinstance(encoded, str):
            raise InvalidEvent("data_base64 is not a string")
        try:
            body = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidEvent("data_base64 is not Base64") from None
        return body, _canonical_bytes(body, json_typed, declared=False)
    if "data" not in event:
        return b"", b""
    data = event["data"]
    if json_typed:
        return _json_bytes(data), _canonical_value(data)
    if not isinstance(data, str):
        raise InvalidEvent("data of a non-JSON datacontenttype is not a string")
    try:
        body = data.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidEvent("data is not valid Unicode text") from None
    return body, _canonical_value(data)


def _delivery(attributes: Mapping[str, str], context: Mapping[str, str], body: bytes, canonical: bytes,
              volatile: Collection[str]) -> CloudEventDelivery:
    headers = {f"ce-{name}": value for name, value in attributes.items() if name != "datacontenttype"}
    if "datacontenttype" in attributes:
        headers["content-type"] = attributes["datacontenttype"]
    fingerprinted = {name: value for name, value in context.items() if name not in volatile}
    return CloudEventDelivery(id=key_id(context["source"], context["id"]), body=body, headers=headers,
                              attributes=fingerprinted, canonical_data=canonical)


# --- JSON: exact numbers, repeated names, and the canonical form ---------------------------------


class _Object(dict[str, Any]):
    """A parsed JSON object that remembers whether a member name repeated (the last one wins in
    Python's parser; another reader may take the first, so a repeated attribute is ambiguous)."""

    repeated = False


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    result = _Object(pairs)
    if len(result) != len(pairs):
        result.repeated = True
    return result


def _loads_exact(raw: bytes) -> Any:
    # Decimal keeps every digit of a fraction: data is compared, and handed on, exactly as sent.
    return loads_json(raw, parse_float=Decimal, object_pairs_hook=_object)


def _canonical_bytes(raw: bytes, json_typed: bool, *, declared: bool) -> bytes:
    """Data bytes in canonical form: under a JSON media type, the JSON value they hold. Bytes that
    are not JSON are refused when the type was ``declared`` (binary mode), else stay bytes (no type
    sent, or data_base64, which the JSON format lets carry anything)."""
    if raw and json_typed:
        try:
            return _canonical_value(_loads_exact(raw))
        except ValueError:
            if declared:
                raise InvalidEvent("the data is not the JSON its datacontenttype declares") from None
    return b"B" + raw if raw else b""


def _canonical_value(value: Any) -> bytes:
    if isinstance(value, str):  # a string is its text: one value with the same bytes in binary mode
        return b"B" + value.encode("utf-8", "surrogatepass") if value else b""
    return b"J" + _json_text(value, canonical=True).encode("ascii")


def _json_bytes(value: Any) -> bytes:
    try:
        return _json_text(value, canonical=False, ascii_only=False).encode("utf-8")
    except UnicodeEncodeError:  # an unpaired surrogate escape: keep it escaped
        return _json_text(value, canonical=False, ascii_only=True).encode("ascii")


def _json_text(value: Any, *, canonical: bool, ascii_only: bool = True) -> str:
    """JSON text of a parsed value. Canonical: ASCII, members sorted, numbers normalised (``1.0``,
    ``1`` and ``1e0`` are one number); else compact, members in order, numbers as sent. Written here
    because the standard encoder cannot write a Decimal as a number. Depth is bounded by the parser."""
    if isinstance(value, dict):
        items = sorted(value.items()) if canonical else value.items()
        return "{" + ",".join(json.dumps(name, ensure_ascii=ascii_only) + ":" +
                              _json_text(item, canonical=canonical, ascii_only=ascii_only)
                              for name, item in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_json_text(item, canonical=canonical, ascii_only=ascii_only)
                              for item in value) + "]"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value, ensure_ascii=ascii_only)
    return _number(value) if canonical else str(value)


def _number(value: int | Decimal) -> str:
    sign, digits, exponent = Decimal(value).as_tuple()
    text = "".join(map(str, digits)).rstrip("0")
    if not text:
        return "0"
    assert isinstance(exponent, int)  # NaN and Infinity are refused by the parser
    return f"{'-' if sign else ''}{text}e{exponent + len(digits) - len(text)}"
