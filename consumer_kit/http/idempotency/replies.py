"""What an idempotent endpoint answers and reads: a :class:`Reply` (sent, stored, replayed) and the
:class:`RequestFacts` its rules look at. No web framework here either."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KEPT_HEADERS = frozenset({b"content-type", b"location", b"content-location"})
"""The response headers a replay repeats besides those an endpoint names (``replay_headers``)."""
REPLAYED = (b"idempotency-replayed", b"true")
JSON = (b"content-type", b"application/json")


@dataclass(frozen=True, slots=True)
class Reply:
    """An HTTP answer, as sent or stored: status, raw header pairs (no ``content-length``), body; and
    the outcome it is counted as (not sent)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    outcome: str = "processed"


def refusal(status: int, code: str, *headers: tuple[bytes, bytes], outcome: str) -> Reply:
    """A small JSON error answer (``{"error": code}``), counted as ``outcome``; never names the key."""
    return Reply(status, (JSON, *headers), json.dumps({"error": code}).encode(), outcome)


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the rules read of a request: its method, path, raw query, raw headers, body and caller
    (the principal or tenant the endpoint's ``caller`` function named; ``None``: not scoped)."""

    method: str
    path: str
    query: bytes
    headers: Sequence[tuple[bytes, bytes]]
    body: bytes
    caller: str | None = None


def replay(result: dict[str, Any]) -> Reply:
    """The stored answer, marked as a replay (``Idempotency-Replayed: true``, the coordinator's header)."""
    headers = tuple((str(n).encode("latin-1"), str(v).encode("latin-1")) for n, v in result.get("headers", ()))
    return Reply(int(result["status"]), (*headers, REPLAYED), base64.b64decode(result.get("body", "")), "replayed")
