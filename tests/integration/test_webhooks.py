"""The webhook receiver end to end through ``app.asgi()``, on SQLite and the real PostgreSQL server."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from consumer_kit import ConsumerApp, Context, TerminalError
from consumer_kit.sources.webhooks import (
    GitHubVerifier,
    HmacVerifier,
    StandardWebhooksVerifier,
    StripeVerifier,
    WebhookSource,
)
from tests.conftest import make_settings
from tests.signing import github_headers, standard_headers, stripe_signature

SW_SECRET = "whsec_" + base64.b64encode(b"standard-webhooks-secret-0123456").decode()
SW_OLD_SECRET = "whsec_" + base64.b64encode(b"the-previous-secret-abcdefghijkl").decode()
STRIPE_SECRET = "whsec_stripe_test_secret_value"
GITHUB_SECRET = "github-hook-secret"

rows_metadata = MetaData()
received = Table(
    "test_received_hooks",
    rows_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("source", String(50), nullable=False),
)


class Harness:
    def __init__(self, database_url: str) -> None:
        self.app = ConsumerApp(make_settings(database_url, inbox_lease_seconds=2.0))
        self.runs: dict[str, int] = {}
        self.sources = {
            "standard": WebhookSource(
                path="/hooks/standard",
                namespace="acme-hooks",
                version=1,
                verifier=StandardWebhooksVerifier([SW_SECRET, SW_OLD_SECRET]),
            ),
            "stripe": WebhookSource(
                path="/hooks/stripe",
                namespace="stripe-events",
                version=1,
                verifier=StripeVerifier(STRIPE_SECRET),
            ),
            "github": WebhookSource(
                path="/hooks/github", namespace="github", version=1, verifier=GitHubVerifier(GITHUB_SECRET)
            ),
            "hmac": WebhookSource(
                path="/hooks/hmac",
                namespace="shop",
                version=1,
                body_limit=1024,
                verifier=HmacVerifier(
                    "shop-secret", header="X-Shop-Signature", encoding="base64", id_field="event.id"
                ),
            ),
        }
        for name, source in self.sources.items():
            self.app.handler(source, name=name)(self._handler(name))

    def _handler(self, name: str):  # type: ignore[no-untyped-def]
        async def handle(ctx: Context) -> None:
            self.runs[name] = self.runs.get(name, 0) + 1
            if ctx.delivery.json().get("fail") == "terminal":
                raise TerminalError("refused by the handler", reason="refused")
            await ctx.db.execute(received.insert().values(source=name))

        handle.__name__ = name
        return handle

    async def row_count(self) -> int:
        async with self.app.engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(received))).scalar_one())


@pytest.fixture
async def hooks(database_url: str) -> AsyncIterator[tuple[Harness, httpx.AsyncClient]]:
    harness = Harness(database_url)
    async with harness.app.running():
        async with harness.app.engine.begin() as conn:
            await conn.run_sync(rows_metadata.drop_all)
            await conn.run_sync(rows_metadata.create_all)
        transport = httpx.ASGITransport(app=harness.app.asgi())
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            yield harness, client


async def test_standard_webhook_processed_once_and_provider_retry_is_2xx(
    hooks: tuple[Harness, httpx.AsyncClient],
) -> None:
    harness, client = hooks
    body = b'{"type": "invoice.paid", "data": {"n": 1}}'
    first = await client.post(
        "/hooks/standard", content=body, headers=standard_headers(SW_SECRET, "msg_2Kq1", body)
    )
    assert first.status_code == 200 and first.json()["outcome"] == "processed"
    # The provider's retry: same id, a later timestamp, hence a different signature.
    retry_headers = standard_headers(SW_SECRET, "msg_2Kq1", body, timestamp=int(time.time()) + 7)
    retry = await client.post("/hooks/standard", content=body, headers=retry_headers)
    assert retry.status_code == 200 and retry.json()["outcome"] == "duplicate"
    svix = await client.post(
        "/hooks/standard", content=body, headers=standard_headers(SW_SECRET, "msg_2Kq1", body, prefix="svix")
    )
    assert svix.status_code == 200 and svix.json()["outcome"] == "duplicate"
    assert harness.runs == {"standard": 1}
    assert await harness.row_count() == 1


async def test_secret_rotation_accepts_old_and_new(hooks: tuple[Harness, httpx.AsyncClient]) -> None:
    harness, client = hooks
    for i, secret in enumerate([SW_SECRET, SW_OLD_SECRET]):
        body = json.dumps({"n": i}).encode()
        answer = await client.post(
            "/hooks/standard", content=body, headers=standard_headers(secret, f"msg_rot_{i}", body)
        )
        assert answer.status_code == 200
    unknown = "whsec_" + base64.b64encode(b"a-secret-nobody-configured-00000").decode()
    body = b'{"n": 9}'
    answer = await client.post(
        "/hooks/standard", content=body, headers=standard_headers(unknown, "msg_x", body)
    )
    assert answer.status_code == 401
    assert harness.runs == {"standard": 2}


async def test_github_two_hooks_one_guid_are_two_deliveries(hooks: tuple[Harness, httpx.AsyncClient]) -> None:
    harness, client = hooks
    body = b'{"action": "opened", "number": 7}'
    guid = "72d3162e-cc78-11e3-81ab-4c9367dc0958"
    for hook_id in ("111", "222", "111"):
        answer = await client.post(
            "/hooks/github",
            content=body,
            headers=github_headers(GITHUB_SECRET, body, hook_id=hook_id, delivery=guid),
        )
        assert answer.status_code == 200
    assert harness.runs == {"github": 2}
    assert await harness.row_count() == 2


async def test_hmac_verifier_keys_by_body_field(hooks: tuple[Harness, httpx.AsyncClient]) -> None:
    import hashlib
    import hmac

    harness, client = hooks
    body = b'{"event": {"id": "shop-ev-1"}}'
    signature = base64.b64encode(hmac.new(b"shop-secret", body, hashlib.sha256).digest()).decode()
    for _ in range(2):
        answer = await client.post("/hooks/hmac", content=body, headers={"x-shop-signature": signature})
        assert answer.status_code == 200
    assert harness.runs == {"hmac": 1}


@pytest.mark.parametrize(
    ("mutate", "status"),
    [
        (lambda h: {k: v for k, v in h.items() if k != "webhook-signature"}, 400),
        (lambda h: {k: v for k, v in h.items() if k != "webhook-id"}, 400),
        (lambda h: {**h, "webhook-timestamp": "yesterday"}, 400),
        (lambda h: {**h, "webhook-signature": "v1"}, 400),
        (lambda h: {**h, "webhook-signature": "v1," + base64.b64encode(b"x" * 32).decode()}, 401),
        (lambda h: {**h, "webhook-timestamp": str(int(time.time()) - 301)}, 401),  # stale
        (lambda h: {**h, "webhook-timestamp": str(int(time.time()) + 301)}, 401),  # from the future
    ],
    ids=[
        "no-signature",
        "no-id",
        "bad-timestamp",
        "malformed-signature",
        "wrong-signature",
        "stale",
        "future",
    ],
)
async def test_bad_requests_get_their_status_and_run_nothing(
    hooks: tuple[Harness, httpx.AsyncClient], mutate, status: int
) -> None:  # type: ignore[no-untyped-def]
    harness, client = hooks
    body = b'{"n": 1}'
    answer = await client.post(
        "/hooks/standard", content=body, headers=mutate(standard_headers(SW_SECRET, "msg_bad", body))
    )
    assert answer.status_code == status
    if status == 401:
        assert answer.json() == {"error": "unauthenticated"}  # never which check failed
        assert "www-authenticate" not in answer.headers  # no challenge a signature scheme could answer
    assert harness.runs == {}
    assert await harness.app.dead_letters.count() == 0  # unverified input is not parked


async def test_tampered_body_is_401(hooks: tuple[Harness, httpx.AsyncClient]) -> None:
    harness, client = hooks
    headers = standard_headers(SW_SECRET, "msg_t", b'{"amount": 1}')
    answer = await client.post("/hooks/standard", content=b'{"amount": 1000}', headers=headers)
    assert answer.status_code == 401 and harness.runs == {}


async def test_repeated_signature_header_is_400(hooks: tuple[Harness, httpx.AsyncClient]) -> None:
    harness, client = hooks
    body = b'{"n": 1}'
    headers = list(standard_headers(SW_SECRET, "msg_rep", body).items())
    headers.append(("webhook-signature", "v1,AAAA"))
    answer = await client.post("/hooks/standard", content=body, headers=headers)
    assert answer.status_code == 400 and harness.runs == {}


async def test_too_large_is_413_before_verification(hooks: tuple[Harness, httpx.AsyncClient]) -> None:
    harness, client = hooks
    body = b'{"pad": "' + b"x" * 2000 + b'"}'
    answer = await client.post("/hooks/hmac", content=body, headers={"x-shop-signature": "AAAA"})
    assert answer.status_code == 413 and harness.runs == {}


async def test_lying_content_length_is_413(hooks: tuple[Harness, httpx.AsyncClient]) -> None:
    harness, _client = hooks
    asgi = harness.app.asgi()
    chunks = [b"x" * 600, b"y" * 600]
    messages: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict[str, object]) -> None:
        messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/hooks/hmac",
        "raw_path": b"/hooks/hmac",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-length", b"10"), (b"x-shop-signature", b"AAAA")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await asgi(scope, receive, send)
    assert messages[0]["status"] == 413
    assert harness.runs == {}


async def test_verified_but_unparseable_is_400_and_parked(hooks: tuple[Harness, httpx.AsyncClient]) -> None:
    harness, client = hooks
    body = b"this is not json"
    answer = await client.post(
        "/hooks/stripe", content=body, headers={"stripe-signature": stripe_signature(STRIPE_SECRET, body)}
    )
    assert answer.status_code == 400 and answer.json()["parked"] is True
    [parked] = await harness.app.dead_letters.list()
    assert (parked.reason, parked.body) == ("unparseable", body)
    no_id = b'{"object": "event"}'
    answer = await client.post(
        "/hooks/stripe", content=no_id, headers={"stripe-signature": stripe_signature(STRIPE_SECRET, no_id)}
    )
    assert answer.status_code == 400
    assert await harness.app.dead_letters.count(reason="missing_stable_id") == 1
    assert harness.runs == {}


async def test_conflict_and_terminal_are_parked_and_answered_202(
    hooks: tuple[Harness, httpx.AsyncClient],
) -> None:
    harness, client = hooks
    first, changed = b'{"id": "evt_c1", "amount": 1}', b'{"id": "evt_c1", "amount": 2}'
    for body in (first, changed):
        answer = await client.post(
            "/hooks/stripe", content=body, headers={"stripe-signature": stripe_signature(STRIPE_SECRET, body)}
        )
    assert answer.status_code == 202 and answer.json() == {
        "outcome": "conflict",
        "reason": "conflict",
        "parked": True,
    }
    refused = b'{"id": "evt_c2", "fail": "terminal"}'
    answer = await client.post(
        "/hooks/stripe",
        content=refused,
        headers={"stripe-signature": stripe_signature(STRIPE_SECRET, refused)},
    )
    assert answer.status_code == 202 and answer.json()["reason"] == "refused"
    again = await client.post(
        "/hooks/stripe",
        content=refused,
        headers={"stripe-signature": stripe_signature(STRIPE_SECRET, refused)},
    )
    assert again.status_code == 200  # a parked key is acknowledged, not run again
    assert harness.runs == {"stripe": 2}
    assert {p.reason for p in await harness.app.dead_letters.list()} == {"conflict", "refused"}


async def test_in_progress_is_503_with_retry_after(database_url: str) -> None:
    import asyncio

    app = ConsumerApp(make_settings(database_url, inbox_lease_seconds=5.0))
    source = WebhookSource(
        path="/hooks/slow", namespace="slow", version=1, verifier=StandardWebhooksVerifier(SW_SECRET)
    )
    entered, release = asyncio.Event(), asyncio.Event()

    @app.handler(source)
    async def slow(ctx: Context) -> None:
        entered.set()
        await release.wait()

    body = b'{"n": 1}'
    async with app.running():
        transport = httpx.ASGITransport(app=app.asgi())
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            first = asyncio.create_task(
                client.post(
                    "/hooks/slow", content=body, headers=standard_headers(SW_SECRET, "msg_slow", body)
                )
            )
            await entered.wait()
            second = await client.post(
                "/hooks/slow", content=body, headers=standard_headers(SW_SECRET, "msg_slow", body)
            )
            assert second.status_code == 503 and int(second.headers["retry-after"]) >= 1
            release.set()
            assert (await first).status_code == 200


async def test_not_started_is_503(sqlite_url: str) -> None:
    app = ConsumerApp(make_settings(sqlite_url))
    source = WebhookSource(path="/h", namespace="n", version=1, verifier=GitHubVerifier(GITHUB_SECRET))
    app.handler(source)(lambda ctx: None)  # type: ignore[arg-type,return-value]
    transport = httpx.ASGITransport(app=app.asgi())
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        assert (await client.post("/h", content=b"{}")).status_code == 503
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.get("/healthz")).status_code == 200
