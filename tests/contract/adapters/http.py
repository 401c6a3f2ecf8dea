"""What the contract's adapters for the HTTP sources share: ``app.asgi()`` served by uvicorn on a
loopback port (:func:`consumer_kit.testing.server.served_asgi`), and a sender that, like a webhook
provider, sends again what got no 2xx answer."""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Receive, Scope, Send

from consumer_kit import ConsumerApp
from consumer_kit.testing.server import served_asgi
from tests.contract.base import EVERY_SOURCE, Capability, Sent, SourceAdapter

RESENDS = 100  # a sender's attempts at one request that keeps getting 503 or no answer
RESEND_PAUSE = 0.1  # seconds between them (a provider waits Retry-After; a test need not)

Request = tuple[bytes, dict[str, str]]


def routes_only(asgi: ASGIApp) -> ASGIApp:
    """``asgi`` without its lifespan: the test runs the app itself (``app.running()``), as
    ``consumer-kit run`` does before it listens, so that it can stop the app under a request."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await asgi(scope, receive, send)
            return
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    return app


class HttpAdapter(SourceAdapter):
    """POSTs to the source's path over a real connection; the response is the answer."""

    capabilities = EVERY_SOURCE | {Capability.UNKEYABLE, Capability.TRACE, Capability.CUT}
    span_kind = SpanKind.SERVER
    path = "/contract"

    def __init__(self) -> None:
        super().__init__()
        self.client: httpx.AsyncClient | None = None
        self._last: asyncio.Task[httpx.Response] | None = None

    @contextlib.asynccontextmanager
    async def serving(self, app: ConsumerApp) -> AsyncIterator[None]:
        # Stopped in this order: the app first (a handler that outlives the grace is cancelled, its
        # request ends), then the server, which waits for the requests under way.
        async with served_asgi(routes_only(app.asgi())) as base, httpx.AsyncClient(base_url=base) as client:
            async with app.running():
                self.client = client
                try:
                    yield
                finally:
                    self.client = None

    @abc.abstractmethod
    def request(self, stable_id: str | None, *, again: bool = False) -> Request:
        """The body and headers that send ``stable_id`` (``None``: without one); ``again``: as the
        provider sends it the next time (a new signature, say)."""

    def _post(self, sent: Sent, request: Request) -> asyncio.Task[httpx.Response]:
        assert self.client is not None, "not serving"
        body, headers = request
        task = asyncio.create_task(self.client.post(self.path, content=body, headers=headers))
        sent.attempts.append(task)
        self._last = task
        return task

    async def send(self, stable_id: str, *, traceparent: str | None = None) -> Sent:
        body, headers = self.request(stable_id)
        if traceparent is not None:
            headers["traceparent"] = traceparent
        sent = Sent(self.key_id(stable_id), detail=stable_id)
        self._post(sent, (body, headers))
        return sent

    def key_id(self, stable_id: str) -> str:
        return stable_id

    async def send_again(self, sent: Sent) -> Sent:
        again = Sent(sent.key_id, detail=sent.detail)
        self._post(again, self.request(sent.detail, again=True))
        return again

    async def send_unkeyed(self) -> Sent:
        sent = Sent(None)
        self._post(sent, self.request(None))
        return sent

    def _status(self, sent: Sent) -> tuple[int, dict[str, Any]] | None:
        answer = sent.answer
        if not isinstance(answer, httpx.Response):
            return None
        return answer.status_code, answer.json() if answer.headers.get("content-type") == "application/json" else {}

    async def acked(self, sent: Sent) -> bool:
        status = self._status(sent)
        return status is not None and status[0] == 200

    async def dead_lettered(self, sent: Sent, reason: str) -> bool:
        status = self._status(sent)
        return status is not None and status[0] in (202, 400) and status[1].get("parked") is True \
            and status[1].get("reason") == reason

    async def retry_as_told(self, sent: Sent) -> None:
        await asyncio.wait([sent.attempts[-1]])
        status = self._status(sent)
        assert status is not None and status[0] == 503, status
        self._post(sent, self.request(sent.detail, again=True))

    async def resend_unsettled(self, sent: Sent) -> None:
        await asyncio.wait([sent.attempts[-1]])
        if await self.acked(sent):
            return
        # Sent in a task, again and again while the answer is 503 (the key may still be held by the
        # attempt whose client hung up) or none came.
        sent.attempts.append(asyncio.create_task(self._until_answered(sent)))

    async def _until_answered(self, sent: Sent) -> httpx.Response:
        for _ in range(RESENDS):
            try:
                response = await self._post(Sent(sent.key_id), self.request(sent.detail, again=True))
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code != 503:
                return response
            await asyncio.sleep(RESEND_PAUSE)
        raise AssertionError(f"no answer but 503 after {RESENDS} sends")

    async def cut(self) -> None:
        # The client hangs up while its request is being handled: the connection closes under it.
        request = self._last
        assert request is not None and not request.done(), "no request under way to hang up on"
        request.cancel()
        await asyncio.wait([request])
