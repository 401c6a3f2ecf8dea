"""JSON from outside the process (request and message bodies, envelopes, a coordinator's answers), parsed
in one place: :func:`loads_json`.

Every way such a text can fail to be JSON raises the same error, :class:`UnparseableJson`: not JSON,
not UTF-8, ``NaN`` where it is refused, and nested deeper than ``max_depth``. The standard parser
recurses once per level of arrays and objects, so a small body of brackets (100,000 levels are 200 KB)
would raise ``RecursionError`` from deep inside it, or from whatever walks the result next; such a body
is refused before the parser sees it. A ``MemoryError`` is not caught: it says the process is short of
memory, not that the text is bad, and the same text may parse on a later attempt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from consumer_kit.errors import UnparseableDelivery

MAX_JSON_DEPTH = 128
"""How deeply untrusted JSON may nest (arrays and objects): far more than any event or request
needs, and far less than the interpreter's recursion limit, which a deeper document would reach."""


class UnparseableJson(UnparseableDelivery, ValueError):
    """A text that is not the JSON it should be. A :class:`~consumer_kit.UnparseableDelivery` (a body
    that cannot be read parks ``unparseable``, as no retry can parse it) and a ``ValueError`` (what
    ``json.loads`` raises, so code that catches that goes on catching it)."""

    def __init__(self, message: str = "the body is not JSON") -> None:
        super().__init__(message)


_JSON_STRUCTURE = re.compile(r'[\[\]{}"\\]')


def loads_json(
    text: str | bytes,
    *,
    max_depth: int = MAX_JSON_DEPTH,
    strict: bool = True,
    parse_float: Callable[[str], Any] | None = None,
    parse_int: Callable[[str], Any] | None = None,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """``json.loads`` for untrusted input, nested at most ``max_depth`` levels; every refusal is an
    :class:`UnparseableJson` (a ``ValueError``).

    ``strict`` (RFC 8259): bytes must be UTF-8, and ``NaN`` and ``Infinity`` are refused (they are
    not JSON). Not strict, the text is what ``json.loads`` accepts (UTF-16 and UTF-32 bytes too, and
    those constants), only bounded."""
    try:
        if isinstance(text, bytes | bytearray):
            text = text.decode("utf-8") if strict else text.decode(json.detect_encoding(text), "surrogatepass")
        if text.count("[") + text.count("{") > max_depth:
            _check_depth(text, max_depth)
        return json.loads(text, parse_float=parse_float, parse_int=parse_int,
                          parse_constant=_refuse_constant if strict else None, object_pairs_hook=object_pairs_hook)
    except UnparseableJson:
        raise
    except RecursionError:  # the depth is checked; a call stack already deep may still run out
        raise UnparseableJson(f"the body is not JSON: nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
        raise UnparseableJson(f"the body is not JSON: {_said(exc)}") from None


def _said(exc: ValueError) -> str:
    # The parser's and the codec's messages name a position, never the text; others are not shown.
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at character {exc.pos}"
    if isinstance(exc, UnicodeDecodeError):
        return f"not {exc.encoding.upper()} at byte {exc.start}"
    return type(exc).__name__


def _check_depth(text: str, limit: int) -> None:
    # Only brackets, quotes and backslashes matter; a linear pass over them, skipping string contents.
    depth = 0
    in_string = False
    escaped_at = -1
    for match in _JSON_STRUCTURE.finditer(text):
        char, at = match.group(), match.start()
        if in_string:
            if at == escaped_at:
                continue
            if char == "\\":
                escaped_at = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                raise UnparseableJson(f"the body is not JSON: nested deeper than {limit} levels")
        elif char in "]}":
            depth -= 1


def _refuse_constant(name: str) -> Any:
    raise UnparseableJson(f"the body is not JSON: {name} is not a JSON value")
