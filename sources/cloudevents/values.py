"""The CloudEvents (v1.0.2) type system and the encodings around it, checked as the specification
writes them; every check raises :class:`ValueError` with the rule broken (never the value).

- String (spec §Type System): no control characters (U+0000-U+001F, U+007F-U+009F), no
  noncharacters, no unpaired surrogates.
- Integer: 32-bit signed. Timestamp: RFC 3339 ``date-time``. URI / URI-reference: RFC 3986.
- ``datacontenttype``: an RFC 2046 media type (``type/subtype`` and ``;name=value`` parameters).
- HTTP binary-mode header values (HTTP binding §3.1.3.2): a double-quoted string is unescaped first,
  then one round of percent-decoding, whose bytes must be UTF-8.

Written here rather than taken from the ``cloudevents`` SDK on purpose: its HTTP binding decodes
headers with ``urllib.parse.unquote`` (invalid UTF-8 becomes U+FFFD, so ``%FF`` and ``%FE`` decode
to the same id), parses ``time`` with ``dateutil``'s ``isoparse`` (which accepts minute-only times
and hour-only offsets), and checks neither media types nor extension values.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import UTC, datetime, timedelta
from urllib.parse import unquote_to_bytes

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

_NONCHARACTERS = "".join(f"\\U{plane * 0x10000 + low:08x}" for plane in range(17) for low in (0xFFFE, 0xFFFF))
_FORBIDDEN = re.compile(f"[\\x00-\\x1f\\x7f-\\x9f\\ud800-\\udfff\\ufdd0-\\ufdef{_NONCHARACTERS}]")


def check_string(value: str) -> None:
    """A String's characters (json.loads leaves an unpaired ``\\uDEAD`` escape as a lone surrogate)."""
    if _FORBIDDEN.search(value):
        raise ValueError("holds a character the String type forbids")


def check_integer(value: int) -> None:
    """An Integer's range."""
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError("is an Integer outside the 32-bit range")


# --- Timestamp (RFC 3339 section 5.6; "T" and "Z" may be lower case, section 5.6 NOTE) -----------

_TIMESTAMP = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]+))?"
    r"(?:[Zz]|([+-])([0-9]{2}):([0-9]{2}))"
)
_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def canonical_timestamp(value: str) -> str:
    """The UTC instant of an RFC 3339 timestamp, as ``YYYY-MM-DDTHH:MM:SS[.fraction]Z`` with the
    fraction's trailing zeros dropped: two spellings of one instant (an offset, more digits) are
    the same value, as the conformance suite compares them. ValueError when not RFC 3339."""
    match = _TIMESTAMP.fullmatch(value)
    if match is None:
        raise ValueError("is not an RFC 3339 timestamp")
    year, month, day, hour, minute, second = (int(match[i]) for i in range(1, 7))
    leap_year = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    if not 1 <= month <= 12 or not 1 <= day <= _DAYS[month - 1] + (month == 2 and leap_year):
        raise ValueError("is not an RFC 3339 timestamp (no such date)")
    if hour > 23 or minute > 59 or second > 60:  # 60: a leap second
        raise ValueError("is not an RFC 3339 timestamp (no such time)")
    offset = 0
    if match[8]:
        offset_hours, offset_minutes = int(match[9]), int(match[10])
        if offset_hours > 23 or offset_minutes > 59:
            raise ValueError("is not an RFC 3339 timestamp (no such offset)")
        offset = (offset_hours * 60 + offset_minutes) * (1 if match[8] == "+" else -1)
    fraction = (match[7] or "").rstrip("0")
    try:
        moment = datetime(year, month, day, hour, minute, min(second, 59), tzinfo=UTC)
        moment -= timedelta(minutes=offset)
    except (ValueError, OverflowError):  # year 0000, or an offset past the years datetime covers
        return value.upper()
    return (f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T{moment.hour:02d}:"
            f"{moment.minute:02d}:{second if second == 60 else moment.second:02d}"
            f"{'.' + fraction if fraction else ''}Z")


# --- Media types (RFC 2045 section 5.1, which RFC 2046 uses) ------------------------------------

_TOKEN = r"[!#$%&'*+\-.^_`{|}~0-9A-Za-z]+"  # any ASCII character but space, controls and tspecials
_QUOTED = r'"(?:[\t \x21\x23-\x5b\x5d-\x7e]|\\[\t \x21-\x7e])*"'
_PARAMETER = re.compile(rf"[ \t]*;[ \t]*({_TOKEN})=({_TOKEN}|{_QUOTED})")
_MEDIA_TYPE = re.compile(rf"({_TOKEN})/({_TOKEN})((?:[ \t]*;[ \t]*{_TOKEN}=(?:{_TOKEN}|{_QUOTED}))*)[ \t]*")
_QUOTED_PAIR = re.compile(r"\\(.)", re.DOTALL)


def canonical_media_type(value: str) -> str:
    """An RFC 2046 media type in one spelling: type, subtype and parameter names (and a charset,
    whose names are case-insensitive) lower-cased, quoted values unquoted. ValueError otherwise."""
    match = _MEDIA_TYPE.fullmatch(value)
    if match is None:
        raise ValueError("is not an RFC 2046 media type")
    parts = [f"{match[1]}/{match[2]}".lower()]
    for name, raw in _PARAMETER.findall(match[3]):
        text = _QUOTED_PAIR.sub(r"\1", raw[1:-1]) if raw.startswith('"') else raw
        name = name.lower()
        parts.append(f"{name}={text.lower() if name == 'charset' else text}")
    return ";".join(parts)


def is_json_media_type(canonical: str) -> bool:
    """Whether a canonical media type declares JSON: ``*/json`` or ``*/*+json`` (JSON format §3.1.1)."""
    subtype = canonical.split(";", 1)[0].split("/", 1)[1]
    return subtype == "json" or subtype.endswith("+json")


# --- URIs (RFC 3986 appendix A) -----------------------------------------------------------------

_PCT = r"%[0-9A-Fa-f]{2}"
_PCHAR = rf"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|{_PCT})"
_QUERY = rf"(?:{_PCHAR}|[/?])*"  # the fragment has the same grammar
_SCHEME = r"[A-Za-z][A-Za-z0-9+\-.]*"
_USERINFO = rf"(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|{_PCT})*"
_REG_NAME = rf"(?:[A-Za-z0-9\-._~!$&'()*+,;=]|{_PCT})*"
_IP_LITERAL = r"\[[^\]\[/?#@]*\]"  # its inside is checked by _check_ip_literals
_AUTHORITY = rf"(?:{_USERINFO}@)?(?:{_IP_LITERAL}|{_REG_NAME})(?::[0-9]*)?"
_SEGMENT_NZ_NC = rf"(?:[A-Za-z0-9\-._~!$&'()*+,;=@]|{_PCT})+"
_PATH_ABEMPTY = rf"(?:/{_PCHAR}*)*"
_PATH_ABSOLUTE = rf"/(?:{_PCHAR}+{_PATH_ABEMPTY})?"
_HIER_PART = rf"(?://{_AUTHORITY}{_PATH_ABEMPTY}|{_PATH_ABSOLUTE}|{_PCHAR}+{_PATH_ABEMPTY}|)"
_RELATIVE_PART = rf"(?://{_AUTHORITY}{_PATH_ABEMPTY}|{_PATH_ABSOLUTE}|{_SEGMENT_NZ_NC}{_PATH_ABEMPTY}|)"
_ABSOLUTE_URI = re.compile(rf"{_SCHEME}:{_HIER_PART}(?:\?{_QUERY})?")
_URI_REFERENCE = re.compile(
    rf"(?:{_SCHEME}:{_HIER_PART}|{_RELATIVE_PART})(?:\?{_QUERY})?(?:#{_QUERY})?"
)
_IP_FUTURE = re.compile(r"v[0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+")


def check_uri_reference(value: str) -> str:
    """An RFC 3986 ``URI-reference`` (``source``), returned as it is."""
    if _URI_REFERENCE.fullmatch(value) is None:
        raise ValueError("is not an RFC 3986 URI-reference")
    _check_ip_literals(value)
    return value


def check_absolute_uri(value: str) -> str:
    """An RFC 3986 ``absolute-URI`` (``dataschema``: a scheme, no fragment), returned as it is."""
    if _ABSOLUTE_URI.fullmatch(value) is None:
        raise ValueError("is not an RFC 3986 absolute URI")
    _check_ip_literals(value)
    return value


def _check_ip_literals(value: str) -> None:
    # "[" and "]" occur in a URI only around an IP literal, so every bracketed part is one.
    for inside in re.findall(r"\[([^\]]*)\]", value):
        if _IP_FUTURE.fullmatch(inside):
            continue
        try:
            ipaddress.IPv6Address(inside if "%" not in inside else "-")  # no zone ids in RFC 3986
        except ValueError:
            raise ValueError("holds an invalid IP literal") from None


# --- HTTP header values (HTTP binding §3.1.3.2) --------------------------------------------------

_NOT_PRINTABLE_ASCII = re.compile(r"[^\t\x20-\x7e]")
_QUOTED_STRING = re.compile(_QUOTED)
_BROKEN_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


def decode_header_value(raw: str) -> str:
    """An attribute's value from its binary-mode header (``raw``: the header as latin-1 text).

    Header values are printable US-ASCII; a value in double quotes is an RFC 7230 quoted string
    whose quotes and backslash escapes are not part of the value; then exactly one round of
    percent-decoding, whose bytes must be UTF-8 (an overlong ``%C0%A0``, a lone ``%FF``: refused,
    never replaced by U+FFFD). A ``%`` not followed by two hex digits is refused too: a sender must
    encode ``%`` itself.
    """
    if _NOT_PRINTABLE_ASCII.search(raw):
        raise ValueError("is not printable US-ASCII")
    if raw.startswith('"'):
        if _QUOTED_STRING.fullmatch(raw) is None:
            raise ValueError("is a malformed quoted string")
        raw = _QUOTED_PAIR.sub(r"\1", raw[1:-1])
    elif '"' in raw:
        raise ValueError("holds a double quote outside a quoted string")
    if _BROKEN_PERCENT.search(raw):
        raise ValueError("holds a % that is not percent-encoding")
    try:
        return unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("is not percent-encoded UTF-8") from None
