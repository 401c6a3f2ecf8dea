"""Operation keys: the namespaced, versioned identity of one piece of delivered work.

A key is built explicitly from a source's immutable delivery id (``ticket-queue:v1:<message id>``).
There is deliberately no constructor that takes a payload hash, a timestamp, a trace id or a title:
none of those identifies a piece of work.

Keys are operational identifiers, not secrets, but they may carry provider ids that should not leak
into diagnostics; they are stored and logged only as HMAC-SHA-256 digests (:class:`KeyDigester`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from consumer_kit.errors import InvalidKey

MAX_KEY_BYTES = 255
# Unicode category Cc is exactly these 65 code points (C0, DEL, C1); a character class is much faster
# than asking unicodedata for every character, and keys are checked on every delivery.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def validate_key(value: object, *, part: str = "key") -> str:
    """Return ``value`` if it is a valid idempotency key (or key part); raise :class:`InvalidKey`.

    The rules: non-empty, at most 255 UTF-8 bytes, no control character (Unicode
    category Cc, so NUL, DEL and the C1 range too), no surrounding whitespace.
    """
    if not isinstance(value, str):
        raise InvalidKey("not_a_string", part)
    if not value:
        raise InvalidKey("empty", part)
    ascii_ = value.isascii()
    if _too_long(value, ascii_):
        raise InvalidKey("too_long", part)
    if _CONTROL.search(value):
        raise InvalidKey("control_character", part)
    if value[0].isspace() or value[-1].isspace():
        raise InvalidKey("surrounding_whitespace", part)
    if not ascii_:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKey("not_utf8", part) from None
    return value


def _too_long(value: str, ascii_: bool) -> bool:
    # ascii_: the common case, one byte per character and nothing to encode
    return (len(value) if ascii_ else len(value.encode("utf-8", "surrogatepass"))) > MAX_KEY_BYTES


@functools.lru_cache(maxsize=256, typed=True)  # typed: True is not 1 here
def _check_namespace(namespace: object, version: object) -> None:
    """The namespace and version rules; cached, since a source keys every delivery with the same pair
    (only a pair that passed is cached: a failure raises)."""
    validate_key(namespace, part="namespace")
    if ":" in namespace:  # type: ignore[operator]  # validate_key proved it a str
        raise InvalidKey("contains_colon", "namespace")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidKey("not_a_positive_integer", "version")


@dataclass(frozen=True, slots=True)
class OperationKey:
    """``namespace:v<version>:<id>``: one operation on one delivered piece of work.

    ``namespace`` names the integration (``ticket-queue``), ``version`` is bumped only to define a
    different operation on purpose, and ``id`` is the source's immutable delivery id.
    ``str(key)`` is the key; ``repr(key)`` hides the id so that a stray ``%r`` cannot leak it.
    """

    namespace: str
    version: int
    id: str
    _text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            _check_namespace(self.namespace, self.version)
        except TypeError:  # an unhashable part cannot be cached: check it uncached for the right reason
            _check_namespace.__wrapped__(self.namespace, self.version)
        validate_key(self.id, part="id")
        # With both parts valid, only the whole key's length can still fail.
        text = f"{self.namespace}:v{self.version}:{self.id}"
        if _too_long(text, text.isascii()):
            raise InvalidKey("too_long", "key")
        object.__setattr__(self, "_text", text)

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"OperationKey(namespace={self.namespace!r}, version={self.version}, id=<redacted>)"

    def derive(self, prefix: str) -> str:
        """The key for a downstream call: ``<prefix>:<this key>``, validated.

        Pass it as the destination's ``Idempotency-Key`` (or the coordinator's key) so that every hop
        deduplicates its own repeats.
        """
        validate_key(prefix, part="prefix")
        if ":" in prefix:
            raise InvalidKey("contains_colon", "prefix")
        return validate_key(f"{prefix}:{self}")


class KeyDigester:
    """Keyed digests of idempotency keys, for storage and logs.

    ``digest`` uses the current HMAC key; ``candidates`` also yields the digest under the previous key
    so that records written before a rotation are still found (keep the previous key for one
    full retention window, then remove it).
    """

    __slots__ = ("_keys",)

    def __init__(self, current: bytes, previous: bytes | None = None) -> None:
        if len(current) < 16:
            raise ValueError("the HMAC key must be at least 16 bytes")
        # One keyed HMAC state per secret, copied per digest: copying skips the key schedule and
        # OpenSSL's digest lookup, which a one-shot ``hmac.digest`` pays on every call.
        self._keys = tuple(hmac.new(k, digestmod=hashlib.sha256) for k in ((current, previous) if previous
                                                                             else (current,)))

    def digest(self, key: OperationKey | str) -> str:
        """Hex HMAC-SHA-256 of the key under the current HMAC key."""
        return _hmac_hex(self._keys[0], str(key))

    def candidates(self, key: OperationKey | str) -> Sequence[str]:
        """The digests to look a stored record up by: current key first, then the previous one."""
        raw = str(key)
        return [_hmac_hex(k, raw) for k in self._keys]


def _hmac_hex(keyed: hmac.HMAC, value: str) -> str:
    state = keyed.copy()
    state.update(value.encode("utf-8"))
    return state.hexdigest()


def short(digest: str) -> str:
    """The first 16 hex digits of a digest: enough to correlate log lines, useless to reverse."""
    return digest[:16]
