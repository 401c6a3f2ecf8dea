"""Property-based tests over HTTP: arbitrary headers and bodies thrown at every webhook verifier's
endpoint and at the CloudEvents sink never get a 5xx, and never run a handler without a valid
signature (or, for CloudEvents, without the bearer token)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer_kit import ConsumerApp, Context
from consumer_kit.sources.cloudevents import CloudEventsSource
from consumer_kit.sources.webhooks import (
    GitHubVerifier,
    HmacVerifier,
    StandardWebhooksVerifier,
    StripeVerifier,
    WebhookSource,
)
from tests.conftest import make_settings
from tests.webhook_headers import VERIFIER_HEADERS

SW_SECRET = "whsec_" + base64.b64encode(b"property-test-secret-0123456789ab").decode()
TOKEN = "property-bearer"
PATHS = ["/standard", "/stripe", "/github", "/hmac", "/events"]
NAMES = [
    *VERIFIER_HEADERS,
    "content-length",
    "ce-id",
    "ce-source",
    "ce-type",
    "ce-specversion",
    "ce-time",
    "authorization",
    "webhook-request-origin",
]
CONTENT_TYPES = [
    "application/json",
    "application/cloudevents+json",
    "application/cloudevents-batch+json",
    "application/cloudevents+xml",
    "text/plain",
    "application/x-www-form-urlencoded",
]
SPECIAL = ["1.0", "Bearer nope", "v1,AAAA", "t=1,v1=00", "sha256=00", "-1", "1700000000", "9" * 20]
values = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60),
    st.sampled_from([*CONTENT_TYPES, *SPECIAL]),
)
header_lists = st.lists(st.tuples(st.sampled_from(NAMES), values), max_size=10)
bodies = st.one_of(
    st.binary(max_size=400),
    st.sampled_from(
        [b"{}", b"[]", b'{"id": "evt_1"}', b'[{"specversion": "1.0"}]', b'{"specversion": "1.0", "id": "1"}']
    ),
)


@dataclass
class Client:
    """Requests from this (test) thread to the app running on a loop in a portal thread."""

    portal: BlockingPortal
    http: httpx.AsyncClient

    def request(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        return self.portal.call(lambda: self.http.request(method, path, **kwargs))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def client_and_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, list[str]]]:
    path: Path = tmp_path_factory.mktemp("props")
    app = ConsumerApp(make_settings(f"sqlite+aiosqlite:///{path}/ck.db"))
    runs: list[str] = []
    sources = [
        WebhookSource(
            path="/standard", namespace="p-standard", version=1, verifier=StandardWebhooksVerifier(SW_SECRET)
        ),
        WebhookSource(path="/stripe", namespace="p-stripe", version=1, verifier=StripeVerifier("whsec_p")),
        WebhookSource(path="/github", namespace="p-github", version=1, verifier=GitHubVerifier("gh")),
        WebhookSource(
            path="/hmac",
            namespace="p-hmac",
            version=1,
            body_limit=256,
            verifier=HmacVerifier("h", header="x-sig", id_field="id"),
        ),
        CloudEventsSource(
            path="/events",
            namespace="p-events",
            version=1,
            batch=True,
            bearer_tokens=TOKEN,
            allowed_origins=["https://ok.example"],
        ),
    ]
    for source in sources:

        async def handle(ctx: Context) -> None:
            runs.append(ctx.key.namespace)

        app.handler(source, name=source.namespace)(handle)
    asgi = app.asgi()
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(app.running()):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://testserver")
        try:
            yield Client(portal, http), runs
        finally:
            portal.call(http.aclose)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(PATHS),
    method=st.sampled_from(["POST", "POST", "OPTIONS"]),
    headers=header_lists,
    body=bodies,
)
def test_arbitrary_requests(
    client_and_runs: tuple[Client, list[str]],
    path: str,
    method: str,
    headers: list[tuple[str, str]],
    body: bytes,
) -> None:
    client, runs = client_and_runs
    before = len(runs)
    # No Authorization header survives unless it is the right one: the CloudEvents sink must refuse.
    headers = [(n, v) for n, v in headers if n != "content-length"]
    answer = client.request(method, path, content=body, headers=headers)
    assert answer.status_code < 500, answer.text
    assert len(runs) == before, "a handler ran for an unsigned or unauthenticated request"
