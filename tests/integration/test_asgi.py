"""``app.asgi()``: health, readiness, metrics, mounting inside another app, and its lifespan."""

from __future__ import annotations

import httpx
from sqlalchemy import text
from starlette.applications import Starlette
from starlette.routing import Mount

from consumer_kit import ConsumerApp, Context
from consumer_kit.asgi import lifespan
from consumer_kit.store import schema_revisions
from consumer_kit.store.database import VERSION_TABLE
from sources.webhooks import GitHubVerifier, WebhookSource
from tests.conftest import make_settings
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
