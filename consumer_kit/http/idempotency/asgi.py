"""The web side of idempotent endpoints: :class:`IdempotencyKey` (a FastAPI dependency, a Starlette
endpoint decorator, a status endpoint) and :class:`IdempotencyMiddleware` (plain ASGI).

The middleware is what holds a route's response back until it is stored: it sees the answer the app
sends, keeps it, commits it with the route's writes (:meth:`Operation.finish`) and only then sends it.
Which requests are idempotent is the user's choice, in one of two ways:

- per route: the route depends on an :class:`IdempotencyKey` (``ctx = Depends(labels)``); the
  dependency claims the key when FastAPI resolves it, and a request answered without running the route
  (a replay, a 409, a 422, a 400) is answered by the middleware in place of whatever the framework
  renders for the dependency's refusal;
- for a prefix: ``IdempotencyMiddleware(app, keys=..., prefix="/payments")`` claims the key of every
  request under the prefix with one of ``methods`` before the app sees it; the route reads its context
  with :func:`idempotency_context`.

A plain Starlette route can use :meth:`IdempotencyKey.endpoint` instead, which needs no middleware.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from consumer_kit.http import RequestRejected
from consumer_kit.http.idempotency.keys import KeyRefused, header_key
from consumer_kit.http.idempotency.operation import PASS, IdempotentContext, KeyRules, Operation
from consumer_kit.http.idempotency.replies import Reply, RequestFacts, refusal
from consumer_kit.http.intake import read_body

SCOPE_KEY = "consumer_kit.idempotency"
"""Where the middleware leaves a request's :class:`_Exchange` in the ASGI scope."""

Caller = Callable[[Request], "str | Awaitable[str | None] | None"]


class IdempotencyKey(KeyRules):
    """An idempotent endpoint's rules (see :class:`~consumer_kit.http.idempotency.operation.KeyRules`
    for every option) and its adapters. ``caller(request)`` names the principal or tenant a key belongs
    to (say from a verified token: two callers sending the same key are two operations); without it,
    keys are one space for everyone.

    As a FastAPI dependency (with :class:`IdempotencyMiddleware` on the app)::

        labels = IdempotencyKey(app, namespace="labels", version=1, caller=tenant)

        @api.post("/labels", status_code=201)
        async def create_label(order: Order, ctx: IdempotentContext = Depends(labels)) -> Label: ...
    """

    def __init__(self, app: Any, *, namespace: str, version: int, caller: Caller | None = None,
                 **options: Any) -> None:
        super().__init__(app, namespace=namespace, version=version, **options)
        self.caller = caller

    async def facts(self, request: Request | Scope, body: bytes) -> RequestFacts:
        """What the rules read of ``request`` (a Starlette request, or its ASGI scope: a request is made
        of it only for the endpoint's ``caller``, which is asked here)."""
        scope = request.scope if isinstance(request, Request) else request
        caller = None
        if self.caller is not None:
            named = self.caller(request if isinstance(request, Request) else Request(scope))
            caller = await named if inspect.isawaitable(named) else named
        return RequestFacts(scope["method"], scope["path"], scope.get("query_string", b""), scope["headers"], body,
                            caller)

    async def __call__(self, request: Request) -> AsyncIterator[IdempotentContext | None]:
        """The FastAPI dependency: claim the request's key and give the route its context (``None``
        for a request without a key when the endpoint does not require one). A request answered
        without running the route raises an ``HTTPException`` that stops it; the middleware sends the
        real answer. It yields (a dependency with ``yield``) to hear of a request that FastAPI found
        invalid after the key was claimed (its ``RequestValidationError`` is thrown in here): that
        request's claim is withdrawn rather than its 422 stored, as a request that fails validation
        leaves no record, and the corrected request may come under the same key."""
        exchange = request.scope.get(SCOPE_KEY)
        context = await self._claim(request, exchange)
        try:
            yield context
        except Exception as exc:
            if isinstance(exchange, _Exchange) and _invalid_request(exc):
                exchange.invalid = True
            raise

    async def _claim(self, request: Request, exchange: object) -> IdempotentContext | None:
        if not isinstance(exchange, _Exchange):
            raise RuntimeError("an IdempotencyKey dependency needs IdempotencyMiddleware on the app "
                               "(app.add_middleware(IdempotencyMiddleware)): it is what stores the response")
        if exchange.operation is not None:
            if exchange.operation.keys is not self:
                raise RuntimeError("this request's key was claimed by another IdempotencyKey (a prefix's)")
            return exchange.operation.context
        try:
            body = await request.body()
        except ClientDisconnect:
            exchange.reply = exchange.reply or self.counted(refusal(400, "client_disconnected",
                                                                     outcome="key_missing"))
            raise HTTPException(400) from None
        begun = await self.begin(await self.facts(request, body))
        if isinstance(begun, Reply):
            exchange.reply = begun
            raise HTTPException(begun.status)
        if begun is PASS:
            return None
        assert isinstance(begun, Operation)
        exchange.began(begun)
        return begun.context

    def counted(self, reply: Reply) -> Reply:
        """``reply``, counted as its outcome."""
        self.count(reply.outcome)
        return reply

    def endpoint(self, func: Callable[[Request, IdempotentContext | None], Awaitable[Response]]
                 ) -> Callable[[Request], Awaitable[Response]]:
        """Wrap a Starlette endpoint ``func(request, ctx)`` (no middleware needed): it runs once per
        key; it must return a response with a body (not a streaming one), which is stored for replays."""

        @functools.wraps(func)
        async def run(request: Request) -> Response:
            try:
                body = await read_body(request, self.body_limit)
            except RequestRejected as exc:
                return response(self.counted(refusal(exc.status, exc.code, outcome="too_large")))
            begun = await self.begin(await self.facts(request, body))
            if isinstance(begun, Reply):
                return response(begun)
            # The body is read already: the function gets a request that hands it over again, so that
            # it can read it as any Starlette endpoint does (``await request.json()``).
            again = Request(request.scope, _replaying(body, request.receive))
            if begun is PASS:
                return await func(again, None)
            assert isinstance(begun, Operation)
            try:
                async with asyncio.timeout(self.timeout_seconds) as timer:
                    answer = await func(again, begun.context)
            except TimeoutError:
                if not timer.expired():
                    await begun.abort(None)
                    raise
                await begun.abort(None, "timed_out")
                return response(timed_out())
            except BaseException as exc:
                await begun.abort(exc)
                raise
            stored = getattr(answer, "body", None)
            if not isinstance(stored, bytes):
                await begun.abort(None)
                raise TypeError("an idempotent endpoint must return a Response with a body, not a streaming one")
            return response(await begun.finish(Reply(answer.status_code, _without_length(answer.raw_headers),
                                                     stored)))

        return run

    async def status(self, request: Request) -> Response:
        """A Starlette endpoint (``GET``) that says what became of the operation named by the request's
        ``Idempotency-Key`` for its caller: ``completed`` (with the stored status), ``in_progress``
        (with ``retry_after``), ``expired`` (its record swept) or ``unknown`` (404). Another caller's
        operation with the same key is not found."""
        try:
            stable_id = header_key(request.scope["headers"], bare=self.bare_keys)
        except KeyRefused as exc:
            return JSONResponse({"error": exc.code}, status_code=400)
        if stable_id is None:
            return JSONResponse({"error": "idempotency_key_missing"}, status_code=400)
        facts = await self.facts(request, b"")
        try:
            key = self.operation_key(stable_id, facts.caller)
            database, inbox, digests = self.app.database, self.app.inbox, self.app.pipeline.digester.candidates(key)
        except RuntimeError:
            return JSONResponse({"error": "not_accepting"}, status_code=503, headers={"Retry-After": "1"})
        except ValueError:
            return JSONResponse({"error": "idempotency_key_malformed"}, status_code=400)
        async with database.connect() as ex:
            row = await inbox.lookup(ex, self.consumer, digests)
            swept = row is None and await inbox.swept(ex, self.consumer, digests)
        if row is None:
            return JSONResponse({"state": "expired" if swept else "unknown"}, status_code=200 if swept else 404)
        answer: dict[str, Any] = {"state": row["state"], "created_at": row["created_at"].isoformat(),
                                  "expires_at": row["expires_at"].isoformat()}
        if row["state"] == "completed" and isinstance(row["result"], dict):
            answer["status"] = row["result"].get("status")
        elif row["state"] == "started":
            locked = row["locked_until"]
            answer["state"] = "in_progress" if locked is not None and locked > self.app.clock() else "released"
            if answer["state"] == "in_progress":
                answer["retry_after"] = max(1, math.ceil((locked - self.app.clock()).total_seconds()))
        return JSONResponse(answer)


def _invalid_request(exc: Exception) -> bool:
    """Whether ``exc`` is FastAPI's refusal of a request that does not validate (FastAPI is imported
    only when it is installed: it is what raised it then)."""
    try:
        from fastapi.exceptions import RequestValidationError
    except ImportError:
        return False
    return isinstance(exc, RequestValidationError)


async def idempotency_context(request: Request) -> IdempotentContext:
    """The context of a request whose key :class:`IdempotencyMiddleware` claimed for a prefix, as a
    FastAPI dependency: ``ctx: IdempotentContext = Depends(idempotency_context)``. (A coroutine function:
    FastAPI runs a plain function's dependency in a worker thread, a thread switch each request.)"""
    return context_of(request)


def context_of(request: Request) -> IdempotentContext:
    """:func:`idempotency_context` without a dependency, for a route that takes the ``request``: FastAPI
    solves a dependency on every request, which costs an endpoint that answers in a millisecond a few
    percent of its time."""
    exchange = request.scope.get(SCOPE_KEY)
    if not isinstance(exchange, _Exchange) or exchange.operation is None:
        raise RuntimeError("no idempotent operation for this request: is it under IdempotencyMiddleware's "
                           "prefix and methods, with a key?")
    return exchange.operation.context


class _Exchange:
    """One request through the middleware: the operation begun for it (by the middleware, or by a
    route's dependency), or the reply to send instead of the app's."""

    __slots__ = ("invalid", "operation", "reply", "timer")

    def __init__(self) -> None:
        self.operation: Operation | None = None
        self.reply: Reply | None = None
        self.timer: asyncio.Timeout | None = None
        self.invalid = False  # the framework refused the request (validation) after its key was claimed

    def began(self, operation: Operation) -> None:
        """``operation`` holds the request's key: the route's time limit starts now."""
        self.operation = operation
        if self.timer is not None:
            self.timer.reschedule(asyncio.get_running_loop().time() + operation.keys.timeout_seconds)


class IdempotencyMiddleware:
    """Plain ASGI middleware that stores idempotent routes' responses (see the module docstring).
    ``keys``: claim, for every request under ``prefix`` with one of ``methods``, its key by these rules
    before the app runs; without it, only routes that depend on an :class:`IdempotencyKey` are idempotent.
    ``body_limit`` caps the body of a request that carries a key (413)."""

    def __init__(self, app: ASGIApp, *, keys: IdempotencyKey | None = None, prefix: str = "/",
                 methods: Sequence[str] = ("POST", "PATCH"), body_limit: int | None = None) -> None:
        self.app = app
        self.keys = keys
        self.prefix = prefix.rstrip("/")
        self.methods = frozenset(m.upper() for m in methods)
        self.body_limit = body_limit if body_limit is not None else (keys.body_limit if keys else None)

    def _covers(self, scope: Scope) -> bool:
        path: str = scope["path"]
        return scope["method"] in self.methods and (
            not self.prefix or path == self.prefix or path.startswith(self.prefix + "/"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Under another IdempotencyMiddleware (one a prefix), this one claims into the outer's exchange,
        # and the outer, which holds the response, stores it.
        outer = scope.get(SCOPE_KEY)
        exchange = outer if isinstance(outer, _Exchange) else _Exchange()
        if exchange is not outer:
            scope = {**scope, SCOPE_KEY: exchange}
        keys = self.keys
        if keys is not None and exchange.operation is None and self._covers(scope):
            body = await _read(receive, keys.body_limit)
            if body is None:
                await send_reply(send, keys.counted(refusal(413, "payload_too_large", outcome="too_large")))
                return
            begun = await keys.begin(await keys.facts(scope, body))
            if isinstance(begun, Reply):
                await send_reply(send, begun)
                return
            if isinstance(begun, Operation):
                exchange.operation = begun
                if exchange is outer:  # its time limit starts now
                    exchange.began(begun)
            receive = _replaying(body, receive)
        elif exchange is not outer and self.body_limit is not None and any(
                n.lower() == b"idempotency-key" for n, _ in scope["headers"]):
            receive = _capped(receive, self.body_limit, exchange)
        if exchange is outer:
            await self.app(scope, receive, send)
            return
        await self._run(scope, receive, send, exchange)

    async def _run(self, scope: Scope, receive: Receive, send: Send, exchange: _Exchange) -> None:
        capture = _Capture(exchange, send)
        timer = asyncio.timeout(None)
        exchange.timer = timer
        try:
            async with timer:
                if exchange.operation is not None:  # claimed for the prefix: its time limit starts now
                    exchange.began(exchange.operation)
                await self.app(scope, receive, capture)
        except TimeoutError:
            operation = exchange.operation
            if operation is None or not timer.expired():
                raise
            await operation.abort(None, "timed_out")
            await send_reply(send, timed_out())
            return
        except BaseException as exc:
            if exchange.operation is not None:
                await exchange.operation.abort(exc)
            if exchange.reply is not None and isinstance(exc, Exception) and not capture.passed:
                await send_reply(send, exchange.reply)  # a refusal no framework turned into a response
                return
            raise
        if exchange.reply is not None:
            await send_reply(send, exchange.reply)
            return
        operation = exchange.operation
        if operation is None:
            return
        if capture.status is None:
            await operation.abort(None)
            raise RuntimeError("the idempotent route sent no response")
        if exchange.invalid:  # the framework's own 422: not the route's answer, and not kept
            await operation.withdraw()
            await send_reply(send, capture.reply())
            return
        await send_reply(send, await operation.finish(capture.reply()))


class _Capture:
    """The app's ``send``: passes a response straight through when no key was claimed by the time it
    starts; otherwise keeps it (the body up to one byte over the response limit) to be stored first."""

    def __init__(self, exchange: _Exchange, send: Send) -> None:
        self.exchange = exchange
        self.send = send
        self.passed = False
        self.held = False
        self.status: int | None = None
        self.headers: tuple[tuple[bytes, bytes], ...] = ()
        self.chunks: list[bytes] = []
        self.size = 0
        self.cap = 0

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if not self.held and not self.passed and kind == "http.response.start":
            exchange = self.exchange
            self.held = exchange.operation is not None or exchange.reply is not None
            self.passed = not self.held
            if exchange.operation is not None:
                keys = exchange.operation.keys
                self.cap = (keys.response_limit or keys.app.settings.idempotent_response_limit_bytes) + 1
        if not self.held:
            await self.send(message)
            return
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = _without_length(message.get("headers", ()))
        elif kind == "http.response.body":
            body = message.get("body", b"")
            room = self.cap - self.size
            if room > 0 and body:
                self.chunks.append(body[:room])
                self.size += min(len(body), room)

    def reply(self) -> Reply:
        assert self.status is not None
        return Reply(self.status, self.headers, b"".join(self.chunks))


def _without_length(headers: Any) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((bytes(n), bytes(v)) for n, v in headers if bytes(n).lower() != b"content-length")


async def _read(receive: Receive, limit: int) -> bytes | None:
    """The request body, or ``None`` once it is over ``limit`` (a client that hung up: empty)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            return None
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then what the client sends next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _capped(receive: Receive, limit: int, exchange: _Exchange) -> Receive:
    """A ``receive`` that ends a body over ``limit`` as a hung-up client would, and has the middleware
    answer 413."""
    size = 0

    async def capped() -> Message:
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                exchange.reply = refusal(413, "payload_too_large", outcome="too_large")
                return {"type": "http.disconnect"}
        return message

    return capped


def timed_out() -> Reply:
    """The answer to a route that ran past its time limit (its writes rolled back, the key released)."""
    return refusal(503, "request_timed_out", (b"retry-after", b"1"), outcome="timed_out")


async def send_reply(send: Send, reply: Reply) -> None:
    headers = [*reply.headers, (b"content-length", str(len(reply.body)).encode())]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


def response(reply: Reply) -> Response:
    """``reply`` as a Starlette response."""
    answer = Response(reply.body, status_code=reply.status)
    answer.raw_headers = [*reply.headers, (b"content-length", str(len(reply.body)).encode())]
    return answer


