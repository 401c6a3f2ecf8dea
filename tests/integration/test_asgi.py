"""``app.asgi()``: health, readiness, metrics, mounting inside another app, and its lifespan."""

from __future__ import annotations

import secrets

import httpx
import pytest
from sqlalchemy import text
from starlette.applications import Starlette
from starlette.routing import Mount

from consumer_kit import ConsumerApp, Context
from consumer_kit.http.asgi import lifespan
from consumer_kit.sources.webhooks import GitHubVerifier, WebhookSource
from consumer_kit.store import create_engine, schema_revisions, upgrade
from consumer_kit.store.database import VERSION_TABLE
from consumer_kit.testing import InMemorySource
from tests.conftest import _admin, make_settings
from tests.signing import github_headers


def build(database_url: str) -> tuple[ConsumerApp, list[str]]:
    app = ConsumerApp(make_settings(database_url))
    source = WebhookSource(path="/github", namespace="gh-asgi", version=1, verifier=GitHubVerifier("s3cret"))
    runs: list[str] = []

    @app.handler(source)
    async def on_push(ctx: Context) -> None:
        runs.append(ctx.key_digest)

    return app, runs


async def test_health_readiness_and_metrics(database_url: str) -> None:
    app, _runs = build(database_url)
    async with app.running():
        transport = httpx.ASGITransport(app=app.asgi())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/healthz")).status_code == 200
            ready = await client.get("/readyz")
            assert ready.status_code == 200 and ready.json() == {"ready": True}
            assert (
                await client.post(
                    "/github",
                    content=b"{}",
                    headers={
                        "x-hub-signature-256": "sha256=00",
                        "x-github-event": "push",
                        "x-github-hook-id": "1",
                        "x-github-delivery": "d",
                    },
                )
            ).status_code == 401
            exposition = (await client.get("/metrics")).text
            assert (
                'consumer_kit_http_rejected_total{reason="unauthenticated",source="webhook:gh-asgi"}'
                in exposition
            )
            current, _head = await schema_revisions(app.engine)
            async with app.engine.begin() as conn:  # the schema falls behind this package
                await conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'older'"))
            try:
                stale = await client.get("/readyz")
                assert stale.status_code == 503 and stale.json()["reason"] == "schema_out_of_date"
            finally:  # the PostgreSQL database is shared by the whole run
                async with app.engine.begin() as conn:
                    await conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = :v"), {"v": current})


async def test_mounted_in_a_parent_app_with_its_lifespan(sqlite_url: str) -> None:
    app, runs = build(sqlite_url)
    parent = Starlette(routes=[Mount("/hooks", app=app.asgi())], lifespan=lifespan(app))
    body = b'{"ref": "main"}'
    async with parent.router.lifespan_context(parent):
        transport = httpx.ASGITransport(app=parent)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = github_headers("s3cret", body, hook_id="9", delivery="d-1")
            assert (await client.post("/hooks/github", content=body, headers=headers)).status_code == 200
            assert (await client.get("/hooks/readyz")).status_code == 200
    assert len(runs) == 1
    assert (await _not_running_ready(app)) == 503


async def _not_running_ready(app: ConsumerApp) -> int:
    transport = httpx.ASGITransport(app=app.asgi())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return (await client.get("/readyz")).status_code


class Flaky(InMemorySource):
    """A source that says it is not ready while ``broken`` is set, as a RabbitMQ source does while its
    connection is being re-established."""

    broken = False

    def unready_reason(self) -> str | None:
        return "broker_disconnected" if self.broken else None


@pytest.mark.postgres
async def test_readiness_follows_the_sources_and_the_database(pg_url: str) -> None:
    # A database of its own, dropped under the running app: the database becomes unreachable.
    name = f"ck_ready_{secrets.token_hex(4)}"
    await _admin(f'CREATE DATABASE "{name}"')
    url = pg_url.rsplit("/", 1)[0] + f"/{name}"
    engine = create_engine(url)
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()
    app = ConsumerApp(make_settings(url, db_pool_size=1))
    source = Flaky(namespace="flaky", version=1, name="flaky")
    app.handler(source)(lambda ctx: None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.asgi()), base_url="http://t") as client:
        async def ready() -> tuple[int, dict[str, object]]:
            answer = await client.get("/readyz")
            return answer.status_code, answer.json()

        assert await ready() == (503, {"ready": False, "reason": "not_started"})
        try:
            async with app.running():
                assert await ready() == (200, {"ready": True})
                source.broken = True
                assert await ready() == (503, {"ready": False, "reason": "source_not_ready", "source": "flaky",
                                               "detail": "broker_disconnected"})
                source.broken = False
                await _admin(f'DROP DATABASE "{name}" WITH (FORCE)')
                status, answer = await ready()
                assert status == 503 and answer["reason"] == "database_unreachable"
                assert (await client.get("/healthz")).status_code == 200  # alive: only not ready
        finally:
            await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        assert await ready() == (503, {"ready": False, "reason": "not_started"})  # stopped
