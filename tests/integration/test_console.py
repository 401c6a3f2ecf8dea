"""The operator's console over HTTP (httpx on its ASGI app, no browser: tests/browser has that), on
SQLite and PostgreSQL: off unless configured, bounded keyset pages that miss and repeat nothing, the
rules of ``parked replay`` (a conflict only with the new body accepted, a group's dry run first),
discards confirmed and audited, and the user's own sign-in function."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from html import unescape

import httpx
import pytest
from starlette.requests import Request

from consumer_kit import ConsumerApp, Context, Settings, TerminalError
from consumer_kit.console import Console, Principal, Role
from consumer_kit.errors import ConfigurationError
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings

OPERATOR = "operator-token-0123456789"
VIEWER = "viewer-token-0123456789ab"
TOKENS = json.dumps({OPERATOR: "ann:operator", VIEWER: "vic:viewer"})


class Browser:
    """An httpx client of a console app that signs in through its form and posts forms with its token."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.csrf = ""

    async def get(self, path: str) -> httpx.Response:
        answer = await self.client.get(path)
        found = re.search(r'name="csrf" value="([^"]+)"', answer.text)
        if found:
            self.csrf = found.group(1)
        return answer

    async def sign_in(self, token: str) -> None:
        await self.get("/signin")
        answer = await self.client.post("/signin", data={"csrf": self.csrf, "token": token})
        assert answer.status_code == 303, answer.text
        await self.get("/")

    async def post(self, path: str, **fields: str | list[str]) -> httpx.Response:
        return await self.client.post(path, data={"csrf": self.csrf, **fields})


def text_of(answer: httpx.Response, element_id: str) -> str:
    found = re.search(rf'id="{element_id}"[^>]*>(.*?)</', answer.text, re.S)
    assert found, answer.text[-2000:]
    return unescape(found.group(1))


def ids_on(answer: httpx.Response) -> list[str]:
    return re.findall(r'<tr class="letter">.*?href="/parked/([0-9a-f]{32})"', answer.text, re.S)


@pytest.fixture
async def parked_app(database_url: str) -> AsyncIterator[tuple[ConsumerApp, InMemorySource, Console]]:
    settings = make_settings(database_url, console_tokens=TOKENS, console_page_size=3)
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="orders", version=1)
    fixed: set[str] = set()

    @app.handler(source, name="orders")
    async def handle(ctx: Context) -> None:
        order = ctx.delivery.json()["order"]
        if order not in fixed:
            raise TerminalError("not yet", reason="not_ready")

    async with app.running():
        console = Console(settings, app=app)
        app.fixed = fixed  # type: ignore[attr-defined]
        try:
            yield app, source, console
        finally:
            await console.close()


def browser(console: Console) -> Browser:
    return Browser(httpx.AsyncClient(transport=httpx.ASGITransport(app=console.asgi()), base_url="http://console"))


def test_the_console_is_off_unless_configured_and_has_no_default_credentials(sqlite_url: str) -> None:
    app = ConsumerApp(make_settings(sqlite_url))
    assert not any(getattr(route, "path", "") == "/console" for route in app.asgi().routes)
    with pytest.raises(ConfigurationError, match=r"CONSOLE_TOKENS .* or CONSOLE_AUTH"):
        ConsumerApp(make_settings(sqlite_url, console_path="/console")).asgi()
    with pytest.raises(ConfigurationError, match="shorter than 16") as refused:
        Console(make_settings(sqlite_url, console_tokens='{"short": "ann:operator"}'), database=object())  # type: ignore[arg-type]
    assert "short" not in str(refused.value).replace("shorter", "")  # the token itself is never echoed
    with pytest.raises(ConfigurationError, match="viewer"):
        Console(make_settings(sqlite_url, console_tokens=json.dumps({OPERATOR: "ann:admin"})), database=object())  # type: ignore[arg-type]
    served = ConsumerApp(make_settings(sqlite_url, console_path="/console", console_tokens=TOKENS)).asgi()
    assert any(getattr(route, "path", "") == "/console" for route in served.routes)


async def test_pages_are_bounded_keyset_pages_that_miss_and_repeat_nothing(
        parked_app: tuple[ConsumerApp, InMemorySource, Console]) -> None:
    app, source, console = parked_app
    for i in range(7):
        await source.deliver(id=f"m-{i}", body=json.dumps({"order": f"o-{i}"}).encode())
    parked = {letter.id for letter in await app.dead_letters.list()}
    assert len(parked) == 7
    client = browser(console)
    await client.sign_in(VIEWER)
    page = await client.get("/parked/group?reason=not_ready&source=" + source.name)
    seen: list[str] = []
    while True:
        shown = ids_on(page)
        assert 0 < len(shown) <= 3  # CONSOLE_PAGE_SIZE
        seen += shown
        older = re.search(r'rel="next" href="([^"]+)"', page.text)
        if older is None:
            break
        page = await client.get(unescape(older.group(1)))
    assert len(seen) == 7 and set(seen) == parked  # newest first, each once
    newest_first = [letter.id for letter in await app.dead_letters.list()]
    assert seen == newest_first
    assert (await client.get("/parked/group?reason=not_ready&source=x&after=garbage")).status_code == 200


async def test_a_conflict_replays_only_with_the_new_body_accepted_and_each_replay_is_audited(
        parked_app: tuple[ConsumerApp, InMemorySource, Console]) -> None:
    app, source, console = parked_app
    app.fixed.update({"first", "second"})  # type: ignore[attr-defined]
    assert (await source.deliver(id="m-1", body=b'{"order": "first"}')).outcome.value == "processed"
    await source.deliver(id="m-1", body=b'{"order": "second"}')  # same key, another body: a conflict
    [letter] = await app.dead_letters.list(reason="conflict")
    client = browser(console)
    await client.sign_in(OPERATOR)
    await client.get(f"/parked/{letter.id}")
    preview = await client.post("/parked/replay", id=letter.id)
    assert "1 skipped" in text_of(preview, "dry-run") and 'id="accept-new-body"' in preview.text
    assert "accept-new-body" in unescape(preview.text)
    refused = await client.post("/parked/replay", id=letter.id, step="confirm")
    assert "1 skipped" in text_of(refused, "result")
    accepted = await client.post("/parked/replay", id=letter.id, step="confirm", accept_new_body="yes")
    assert "1 processed" in text_of(accepted, "result")
    history = await app.dead_letters.history(letter.id)
    assert [(h.action, h.actor, h.outcome) for h in history] == [("replay", "ann", "processed")]  # skips send nothing


async def test_a_group_replay_shows_its_dry_run_first_and_a_discard_is_confirmed(
        parked_app: tuple[ConsumerApp, InMemorySource, Console]) -> None:
    app, source, console = parked_app
    for i in range(3):
        await source.deliver(id=f"g-{i}", body=json.dumps({"order": f"g-{i}"}).encode())
    app.fixed.update({"g-0", "g-1"})  # type: ignore[attr-defined]
    client = browser(console)
    await client.sign_in(OPERATOR)
    await client.get("/parked")
    preview = await client.post("/parked/replay", reason="not_ready", source=source.name)
    assert "3 would_run" in text_of(preview, "dry-run")
    assert await app.dead_letters.history((await app.dead_letters.list())[0].id) == []  # a dry run records nothing
    chosen = re.findall(r'name="id" value="([0-9a-f]{32})"', preview.text)
    done = await client.post("/parked/replay", id=chosen, step="confirm")
    assert text_of(done, "result").split(", ") == ["1 parked", "2 processed"]

    left = [letter for letter in await app.dead_letters.list(reason="not_ready") if letter.replays == 0]
    asked = await client.post("/parked/discard", id=[letter.id for letter in left])
    assert "Discard" in asked.text and await app.dead_letters.get(left[0].id) is not None  # asked, not done
    gone = await client.post("/parked/discard", id=[letter.id for letter in left], step="confirm")
    assert "discarded" in text_of(gone, "result")
    assert await app.dead_letters.get(left[0].id) is None
    assert [(h.action, h.actor) for h in await app.dead_letters.history(left[0].id)] == [("discard", "ann")]


async def test_a_viewer_reads_without_bodies_and_may_not_act(
        parked_app: tuple[ConsumerApp, InMemorySource, Console]) -> None:
    app, source, console = parked_app
    await source.deliver(id="v-1", body=b'{"order": "<b>bold</b>"}')
    [letter] = await app.dead_letters.list()
    client = browser(console)
    await client.sign_in(VIEWER)
    page = await client.get(f"/parked/{letter.id}")
    assert "bold" not in page.text and 'id="replay"' not in page.text
    for action in ("replay", "discard"):
        refused = await client.post(f"/parked/{action}", id=letter.id, step="confirm")
        assert refused.status_code == 403
    assert await app.dead_letters.history(letter.id) == []
    operator = browser(console)
    await operator.sign_in(OPERATOR)
    shown = await operator.get(f"/parked/{letter.id}")
    assert "&lt;b&gt;bold&lt;/b&gt;" in shown.text and "<b>bold</b>" not in shown.text
    assert "default-src 'none'" in shown.headers["content-security-policy"]


async def test_the_users_own_sign_in_function_decides_each_request(sqlite_url: str) -> None:
    async def auth(request: Request) -> Principal | None:
        user = request.headers.get("x-user")  # say, set by an authenticating proxy
        return Principal(user, Role.OPERATOR if user == "ann" else Role.VIEWER) if user else None

    settings: Settings = make_settings(sqlite_url)
    app = ConsumerApp(settings)
    app.handler(InMemorySource(namespace="n", version=1), name="n")(_noop)
    async with app.running():
        console = Console(settings, app=app, auth=auth)
        transport = httpx.ASGITransport(app=console.asgi())
        async with httpx.AsyncClient(transport=transport, base_url="http://console") as client:
            assert (await client.get("/")).status_code == 401
            assert (await client.get("/", headers={"x-user": "ann"})).status_code == 200
            page = await client.get("/parked", headers={"x-user": "vic"})
            assert "vic" in page.text and "Sign out" not in page.text
        await console.close()


async def _noop(ctx: Context) -> None:
    return None
