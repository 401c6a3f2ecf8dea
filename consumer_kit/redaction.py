"""Exceptions and text as they may be logged, stored or put on a span: with the raw key taken out.

User code may put a delivery's key (or its id) in an exception's message; a log line, a parked
delivery's detail or a span's status must carry ``<key>`` instead. Every layer uses these, so they
import nothing of the framework but the key's type.
"""

from __future__ import annotations

import json
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from consumer_kit.keys import OperationKey

SHORTEST_SECRET_ID = 6
"""A key id shorter than this (say "42") is no secret and replacing it would garble the text."""


def redact(text: str, key: OperationKey | None) -> str:
    """``text`` with the raw key and its id replaced by ``<key>``, as written and as a ``repr``, ``ascii``
    or JSON string would escape them (a ``KeyError``'s message is the ``repr`` of its argument, so a key
    with a backslash, both quotes or an invisible character is not in it as written)."""
    if key is None:
        return text
    secrets = [str(key)] + ([key.id] if len(key.id) >= SHORTEST_SECRET_ID else [])
    for form in sorted({form for secret in secrets for form in _written(secret)}, key=len, reverse=True):
        text = text.replace(form, "<key>")
    return text


def _written(secret: str) -> set[str]:
    """The ways ``secret`` can appear in a message: as is, and inside the quotes of its escaped forms."""
    return {secret, repr(secret)[1:-1], ascii(secret)[1:-1], json.dumps(secret)[1:-1],
            json.dumps(secret, ensure_ascii=False)[1:-1]}


def describe(exc: BaseException, key: OperationKey | None) -> str:
    """``Type: message`` of an exception, with the raw key redacted, at most 500 characters."""
    return redact(f"{type(exc).__name__}: {exc}", key)[:500]


def format_exception(exc: BaseException, key: OperationKey | None) -> str:
    """A traceback with the raw key redacted."""
    return redact("".join(traceback.format_exception(exc)), key)
