"""HttpCoordinator: the coordinator's wire protocol (DESIGN.md) spoken with httpx, retried safely.

One logical call has one idempotency key: the caller's, validated before anything is sent, or 128
random bits generated before the first attempt. Every retry, including the one after a bearer
refresh, sends that same key, so a creation the server committed before the connection dropped is
replayed rather than made twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx

from consumer_kit.coordinator.protocol import (
    DelegationReceipt,
    DelegationRequest,
    SessionReceipt,
    SessionRequest,
    SessionScope,
    generate_key,
)
from consumer_kit.coordinator.transport import Answer, KeepAliveTransport
from consumer_kit.errors import (
    CoordinatorRejected,
    CoordinatorUnavailable,
    IdempotencyKeyConflict,
    IdempotencyResultInactive,
    ReceiptLimitExceeded,
)
from consumer_kit.keys import validate_key
from consumer_kit.retry import RetryPolicy, is_retryable_status, parse_retry_after
from consumer_kit.tracing import current_headers
from consumer_kit.untrusted import loads_json

log = logging.getLogger("consumer_kit.coordinator.http")

TokenRefresher = Callable[[], Awaitable[str]]
"""An async callable returning a new bearer token after the coordinator rejected the current one."""

GENERATED_HEADER = "Idempotency-Key-Origin"
"""Request header ``generated`` marks a key the client made up (kept for the shorter retention)."""


class HttpCoordinator(SessionScope):
    """A :class:`~consumer_kit.coordinator.Coordinator` talking to a coordinator server.

    Network errors, 5xx, 408, 425 and 429 are retried within ``policy`` (attempts and total time;
    exponential backoff with full jitter; ``Retry-After`` honoured). A 401 refreshes the bearer once
    through ``refresh_token``. Any other 4xx raises at once: :class:`IdempotencyKeyConflict`,
    :class:`IdempotencyResultInactive`, :class:`ReceiptLimitExceeded` or :class:`CoordinatorRejected`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str,
        refresh_token: TokenRefresher | None = None,
        policy: RetryPolicy | None = None,
        client: httpx.AsyncClient | None = None,
        timeout: float = 10.0,
        max_connections: int = 100,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Parsed once: httpx parses a str URL on every request (~4% of the client's CPU per creation).
        self._creation_urls = {path: httpx.URL(self.base_url + path) for path in ("/v1/sessions", "/v1/delegations")}
        self._token = token
        self._refresh = refresh_token
        self.policy = policy or RetryPolicy()
        self._own_client = client is None
        # KeepAliveTransport: httpcore's own pool cost more CPU per request than everything else in
        # the client at 16 concurrent calls (see transport.py). A caller's client is used as given.
        self._timeout = httpx.Timeout(timeout).as_dict()
        if client is None:
            self._transport: KeepAliveTransport | None = KeepAliveTransport(
                limits=httpx.Limits(max_connections=max_connections))
            self._client = httpx.AsyncClient(timeout=timeout, transport=self._transport)
        else:
            self._transport, self._client = None, client

    async def aclose(self) -> None:
        """Close the HTTP client (only if this coordinator created it)."""
        if self._own_client:
            await self._client.aclose()

    async def open(self) -> None:
        """See :class:`~consumer_kit.coordinator.protocol.CoordinatorLifecycle`: nothing to prepare (the
        client connects on its first request)."""

    async def sweep(self) -> int:
        """See :class:`~consumer_kit.coordinator.protocol.CoordinatorLifecycle`: none (the receipts are
        the server's, which sweeps them)."""
        return 0

    async def close(self) -> None:
        """See :class:`~consumer_kit.coordinator.protocol.CoordinatorLifecycle`: :meth:`aclose`."""
        await self.aclose()

    async def create_session(
        self, request: SessionRequest, *, idempotency_key: str | None = None
    ) -> SessionReceipt:
        """See :meth:`Coordinator.create_session`."""
        body, replayed = await self._create("/v1/sessions", request.model_dump(mode="json"), idempotency_key)
        return SessionReceipt(str(body["session_id"]), str(body["status"]),
                              datetime.fromisoformat(str(body["expires_at"])), replayed)

    async def create_delegation(
        self, request: DelegationRequest, *, idempotency_key: str | None = None
    ) -> DelegationReceipt:
        """See :meth:`Coordinator.create_delegation`."""
        body, replayed = await self._create("/v1/delegations", request.model_dump(mode="json"), idempotency_key)
        return DelegationReceipt(str(body["delegation_id"]), str(body["status"]),
                                 datetime.fromisoformat(str(body["expires_at"])), replayed)

    async def end_session(self, session_id: str) -> None:
        """See :meth:`Coordinator.end_session` (idempotent, so retried like a creation)."""
        await self._call("POST", f"/v1/sessions/{quote(session_id, safe='')}/end", None, {})

    async def revoke_session(self, session_id: str) -> None:
        """See :meth:`Coordinator.revoke_session`."""
        await self._call("POST", f"/v1/sessions/{quote(session_id, safe='')}/revoke", None, {})

    async def _create(self, path: str, payload: dict[str, Any], key: str | None) -> tuple[dict[str, Any], bool]:
        headers: dict[str, bytes] = {}
        if key is None:
            key = generate_key()  # before the first attempt; every retry reuses it
            headers[GENERATED_HEADER] = b"generated"
        else:
            validate_key(key)
        headers["Idempotency-Key"] = key.encode("utf-8")
        response = await self._call("POST", path, payload, headers)
        try:
            body = loads_json(response.content, strict=False)
        except ValueError:  # the coordinator's fault, not the delivery's: an UnparseableJson would park it
            body = None
        if not isinstance(body, dict):
            raise CoordinatorUnavailable("the coordinator answered with an unreadable body")
        return body, (response.header("Idempotency-Replayed") or "").lower() == "true"

    async def _call(self, method: str, path: str, payload: dict[str, Any] | None,
                    headers: dict[str, bytes]) -> Answer:
        budget = self.policy.budget()
        refreshed = False
        while True:
            retry_after: float | None = None
            try:
                response = await self._send(method, self._creation_urls.get(path) or self.base_url + path,
                                            payload, headers)
            except httpx.TransportError as exc:
                failure = type(exc).__name__
            else:
                if response.status_code < 300:
                    return response
                if response.status_code == 401 and self._refresh is not None and not refreshed:
                    refreshed = True
                    self._token = await self._refresh()
                    continue
                code = _error_code(response)
                if response.status_code == 429 and code == ReceiptLimitExceeded.code:
                    raise ReceiptLimitExceeded()
                if not is_retryable_status(response.status_code):
                    raise _rejection(response.status_code, code)
                failure = f"HTTP {response.status_code}"
                retry_after = parse_retry_after(response.header("Retry-After"))
            delay = budget.next_delay(retry_after)
            if delay is None:
                raise CoordinatorUnavailable(
                    f"the coordinator did not answer usefully in {budget.attempt} attempt(s): {failure}",
                    delay=retry_after)
            log.info("coordinator call failed (%s); attempt %d in %.2fs", failure, budget.attempt, delay)
            await asyncio.sleep(delay)


    async def _send(self, method: str, url: httpx.URL | str, payload: dict[str, Any] | None,
                    headers: dict[str, bytes]) -> Answer:
        """One attempt. With our own client it goes to the transport directly: the client's layers
        (cookie jar, auth and redirect flows, event hooks) and its request and response models cost
        about half of a creation's CPU in bench/coordinator.py and do nothing for this protocol (no
        cookies, no redirects)."""
        pairs = [(name.encode("ascii"), value) for name, value in
                 {**headers, "Authorization": f"Bearer {self._token}".encode()}.items()]
        # The current span's context (a traced delivery's), so that the coordinator's side can join it.
        pairs += [(name.encode("ascii"), value.encode("latin-1")) for name, value in current_headers().items()]
        if self._transport is None:
            response = await self._client.request(method, url, json=payload, headers=pairs)
            return Answer(response.status_code, response.headers.raw, response.content)
        body = b""
        if payload is not None:
            body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
            pairs.append((b"Content-Type", b"application/json"))
        pairs += _FIXED_HEADERS
        return await self._transport.exchange(method.encode("ascii"), httpx.URL(url), pairs, body, self._timeout)


_FIXED_HEADERS = [(b"Accept", b"application/json"), (b"User-Agent", b"consumer-kit")]


def _error_code(response: Answer) -> str:
    try:
        body = loads_json(response.content, strict=False)
    except ValueError:
        return f"http_{response.status_code}"
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])[:64]
    return f"http_{response.status_code}"


def _rejection(status: int, code: str) -> CoordinatorRejected:
    if status == 409 and code == "idempotency_key_conflict":
        return IdempotencyKeyConflict()
    if status == 409 and code == "idempotency_result_inactive":
        return IdempotencyResultInactive()
    return CoordinatorRejected(status, code)
