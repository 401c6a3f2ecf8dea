"""The Starlette side of the HTTP sources: the base class they share and the request helpers.

:class:`HttpIntake` is what a webhook receiver and a CloudEvents sink have in common: a ``path`` and
its ``methods``, the app's dispatch held while the app runs (503 before start and after stop), a cap
on the body, and one mapping of refusals and verdicts to responses. A subclass reads one request in
:meth:`HttpIntake.receive` and answers it; a :class:`~consumer_kit.http.RequestRejected` it raises
becomes the refusal's response, counted in ``consumer_kit_http_rejected_total``.

Needs Starlette (the ``webhooks`` or ``cloudevents`` extra); the framework-free half of the HTTP
contract (:class:`~consumer_kit.http.HttpSource`, the refusals, :func:`~consumer_kit.http.answer_for`)
is :mod:`consumer_kit.http`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from consumer_kit import metrics
from consumer_kit.delivery import CallIntake, Dispatch, Result
from consumer_kit.http import (
    DEFAULT_BODY_LIMIT,
    MalformedRequest,
    PayloadTooLarge,
    RequestRejected,
    answer_for,
)
from consumer_kit.keys import OperationKey
from consumer_kit.tracing import SpanShape

_PRIVATE_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})


class HttpIntake(CallIntake, ABC):
    """Base of the sources fed by HTTP requests (an :class:`~consumer_kit.http.HttpSource`).

    ``app.asgi()`` routes ``methods`` on ``path`` to :meth:`handle`, which answers 503 unless the app
    is running and otherwise hands the request to :meth:`receive` with the app's dispatch.
    ``body_limit`` caps the raw body (:meth:`read_body`).
    """

    methods: tuple[str, ...] = ("POST",)

    def __init__(self, *, path: str, namespace: str, version: int, name: str,
                 body_limit: int = DEFAULT_BODY_LIMIT) -> None:
        if not path.startswith("/"):
            raise ValueError(f"the path of {name} must start with '/'")
        OperationKey(namespace, version, "probe")  # fail at construction on a bad namespace or version
        self.path = path
        self.namespace = namespace
        self.version = version
        self.name = name
        self.body_limit = body_limit
        self.span_shape = SpanShape("server", attributes={"http.route": path})

    async def handle(self, request: Request) -> Response:
        """Answer one request: 503 while not running, else :meth:`receive`'s answer or the refusal."""
        dispatch = self._dispatch
        if dispatch is None:
            return unavailable()
        try:
            return await self.receive(request, dispatch)
        except RequestRejected as exc:
            return reject(self.name, exc)

    @abstractmethod
    async def receive(self, request: Request, dispatch: Dispatch) -> Response:
        """Turn the request into deliveries, dispatch them and answer; raise RequestRejected to refuse."""

    async def read_body(self, request: Request) -> bytes:
        """The raw body under this source's cap (see :func:`read_body`)."""
        return await read_body(request, self.body_limit)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, at most ``limit`` bytes; :class:`PayloadTooLarge` before anything is hashed.

    A declared ``Content-Length`` over the limit is refused before reading; the stream is counted as
    it arrives as well, so a lying (or absent) ``Content-Length`` cannot get more than ``limit`` in.
    """
    declared = request.headers.getlist("content-length")
    if len(declared) > 1:
        raise MalformedRequest("repeated_content_length")
    if declared:
        try:
            length = int(declared[0])
        except ValueError:
            raise MalformedRequest("malformed_content_length") from None
        if length > limit:
            raise PayloadTooLarge()
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge()
            chunks.append(chunk)
    except ClientDisconnect:
        raise MalformedRequest("client_disconnected") from None
    return b"".join(chunks)


def single_headers(request: Request, required_single: Iterable[str] = (), *,
                   single_prefix: str | None = None) -> dict[str, str]:
    """The request's headers, lower-cased, one value each (latin-1, as they arrived); credentials
    (``Authorization``, ``Cookie``) left out, since the result is stored with a parked delivery.

    A header named in ``required_single``, or starting with ``single_prefix``, that arrives more than
    once is :class:`MalformedRequest`: a verifier must never have to guess which of two signatures
    or ids was meant.
    """
    names = set(required_single)
    headers: dict[str, str] = {}
    for raw_name, raw_value in request.scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        if name in headers and (name in names or (single_prefix and name.startswith(single_prefix))):
            raise MalformedRequest("repeated_header")
        if name not in _PRIVATE_HEADERS:
            headers[name] = raw_value.decode("latin-1")
    return headers


def respond(result: Result) -> Response:
    """The response to a pipeline verdict (see :func:`consumer_kit.http.answer_for`)."""
    answer = answer_for(result)
    return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers)


def reject(source: str, exc: RequestRejected) -> Response:
    """The response to a refused request, counted by reason (never a key, a secret or a detail)."""
    metrics.HTTP_REJECTED.labels(source, exc.code if exc.status != 401 else "unauthenticated").inc()
    body = {"error": "unauthenticated" if exc.status == 401 else exc.code}
    challenge = getattr(exc, "challenge", None)
    headers = {"WWW-Authenticate": challenge} if challenge else None
    return JSONResponse(body, status_code=exc.status, headers=headers)


def unavailable() -> Response:
    """503 for a source that is not (or no longer) accepting deliveries."""
    return JSONResponse({"error": "not_accepting"}, status_code=503, headers={"Retry-After": "1"})
