"""What an HTTP source offers the core, and how a pipeline verdict becomes an HTTP answer.

The core knows no concrete source: a webhook receiver or a CloudEvents sink is an :class:`HttpSource`
(a :class:`~consumer_kit.delivery.Source` with a ``path``, its ``methods`` and a ``handle`` coroutine),
and :mod:`consumer_kit.http.asgi` routes requests to it. Requests refused before they become deliveries
raise a :class:`RequestRejected`::

    RequestRejected (ConsumerKitError)   refused before it became a delivery; nothing is parked
    ├── MalformedRequest        400      a required header is missing, repeated or malformed
    ├── Unauthenticated         401      signature, timestamp or bearer wrong; never says which
    ├── PayloadTooLarge         413      over the body limit, refused before any hashing
    └── UnsupportedMediaType    415      a content type the source does not speak

Unverified requests are not trusted input, so they are never parked; they are counted in
``consumer_kit_http_rejected_total``.

The Starlette side (reading a capped body, turning verdicts into responses, the base class of the
HTTP sources) is :mod:`consumer_kit.http.intake`; this module needs no web framework, so the core
and the CLI can import it on an installation without one. Request bodies are parsed as any untrusted
JSON is, by :func:`consumer_kit.untrusted.loads_json` (also importable from here): a body nested too
deep is refused as unparseable before the standard parser recurses into it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from consumer_kit.delivery import Outcome, Result, Settlement, Source
from consumer_kit.errors import ConsumerKitError
from consumer_kit.untrusted import MAX_JSON_DEPTH, UnparseableJson, loads_json

__all__ = [
    "DEFAULT_BODY_LIMIT", "MAX_JSON_DEPTH", "Answer", "HttpSource", "MalformedRequest", "PayloadTooLarge",
    "RequestRejected", "Unauthenticated", "UnparseableJson", "UnsupportedMediaType", "answer_for", "http_paths",
    "loads_json",
]

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

DEFAULT_BODY_LIMIT = 262_144
"""256 KiB: the default cap on a request body, as the coordinator's (``COORDINATOR_BODY_LIMIT_BYTES``)."""

class RequestRejected(ConsumerKitError):
    """An HTTP request refused before it became a delivery; ``status`` is the answer's code and
    ``code`` a short reason for the metric and the response body (never a key or a secret)."""

    status = 400
    code = "rejected"

    def __init__(self, code: str | None = None) -> None:
        super().__init__(code or self.code)
        if code is not None:
            self.code = code


class MalformedRequest(RequestRejected):
    """A required header is missing, repeated or malformed (400)."""

    status = 400
    code = "malformed_request"


class Unauthenticated(RequestRejected):
    """Bad signature, stale or future timestamp, or a wrong bearer (401). One code for all of them,
    so that a prober learns nothing about which check failed."""

    status = 401
    code = "unauthenticated"

    def __init__(self, code: str | None = None, *, challenge: str | None = None) -> None:
        super().__init__(code)
        self.challenge = challenge  # the WWW-Authenticate value, for schemes that have one (Bearer)


class PayloadTooLarge(RequestRejected):
    """The body is over the source's limit (413); it was not hashed."""

    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(RequestRejected):
    """The content type is not one the source accepts (415)."""

    status = 415
    code = "unsupported_media_type"


@runtime_checkable
class HttpSource(Source, Protocol):
    """A source fed by HTTP requests: ``app.asgi()`` routes ``methods`` on ``path`` to ``handle``.

    Like every source it is started with the app's dispatch (before which, and after ``stop``, it
    answers 503) and keys its deliveries itself.
    """

    path: str
    methods: tuple[str, ...]

    async def handle(self, request: Request) -> Response:
        """Answer one request."""
        ...


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer to a delivery: status, extra headers and a small JSON body."""

    status: int
    headers: dict[str, str]
    body: dict[str, object]


def answer_for(result: Result) -> Answer:
    """The HTTP answer to a pipeline verdict; the one place it is decided for every HTTP source.

    - processed, duplicate, or a repeat of a parked key: 200; the handler does not run again;
    - in progress, retry, lease lost (``RETRY_LATER``): 503 with ``Retry-After`` (whole seconds, >= 1);
    - no stable id, an invalid key, an unparseable body (``INVALID``): 400, and the delivery is parked;
    - conflict, inactive, terminal failure or retries exhausted (``DEAD_LETTER``): 202 with
      ``"parked": true``: the delivery is kept for an operator, and a 2xx stops the provider from
      sending it again and again.
    """
    body: dict[str, object] = {"outcome": result.outcome.value}
    if result.reason:
        body["reason"] = result.reason
    if result.settlement is Settlement.ACK:
        return Answer(200, {}, body)
    if result.settlement is Settlement.RETRY_LATER:
        seconds = max(1, math.ceil(result.delay or 0))
        return Answer(503, {"Retry-After": str(seconds)}, body)
    body["parked"] = True
    return Answer(400 if result.outcome is Outcome.INVALID else 202, {}, body)


def http_paths(sources: Iterable[object]) -> list[str]:
    """The paths of those of ``sources`` that are served over HTTP, in order."""
    return [source.path for source in sources if isinstance(source, HttpSource)]
