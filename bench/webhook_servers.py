"""The two servers of the webhook benchmark, configured by the environment (``BENCH_DATABASE_URL``,
``BENCH_SECRET``, ``BENCH_SINGLE_TRANSACTION``, ``BENCH_DRIVER``).

- ``app`` (for ``consumer-kit run bench.webhook_servers:app --port ...``, as a user serves a receiver;
  ``receiver`` is the same as a uvicorn factory): consumer-kit's ``WebhookSource`` with
  ``StandardWebhooksVerifier``: verify, claim the inbox on PostgreSQL, run a handler that inserts one
  row, complete; with ``BENCH_STAGED=1`` the handler stages its row (``staged=True``), which goes with
  the key in one statement.
- ``bare``: a plain Starlette endpoint that verifies with the ``standardwebhooks`` library and inserts
  one row with asyncpg: what a receiver without dedup looks like.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from sqlalchemy import Column, Integer, MetaData, String, Table
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.webhooks import StandardWebhooksVerifier, WebhookSource

POOL = 32
rows = Table(
    "bench_hook_rows",
    MetaData(),
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("event", String(64), nullable=False),
)


def receiver() -> Any:
    """consumer-kit's receiver as a uvicorn factory (``app.asgi()``)."""
    return receiver_app().asgi()


def __getattr__(name: str) -> Any:
    if name == "app":  # bench.webhook_servers:app, made from the environment when it is first asked for
        return receiver_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def receiver_app() -> ConsumerApp:
    """consumer-kit's receiver, the app itself."""
    settings = Settings(
        database_url=os.environ["BENCH_DATABASE_URL"],
        idempotency_hmac_key=os.environ["BENCH_HMAC_KEY"],
        db_pool_size=POOL,
    )
    app = ConsumerApp(settings)
    source = WebhookSource(
        path="/hooks",
        namespace="bench-hooks",
        version=1,
        verifier=StandardWebhooksVerifier(os.environ["BENCH_SECRET"]),
    )

    driver = os.environ.get("BENCH_DRIVER", "sqlalchemy")
    staged = os.environ.get("BENCH_STAGED") == "1"

    @app.handler(source, single_transaction=os.environ.get("BENCH_SINGLE_TRANSACTION") == "1", staged=staged,
                 driver="asyncpg" if driver == "asyncpg" else "sqlalchemy")
    async def on_hook(ctx: Context) -> None:
        if staged:  # the row staged: written with the key in one statement once the handler returns
            ctx.stage("INSERT INTO bench_hook_rows (event) VALUES ($1)", ctx.delivery.json()["type"])
        elif driver == "asyncpg":
            await ctx.connection.execute("INSERT INTO bench_hook_rows (event) VALUES ($1)",
                                         ctx.delivery.json()["type"])
        else:
            await ctx.db.execute(rows.insert().values(event=ctx.delivery.json()["type"]))

    return app


def bare() -> Starlette:
    """The peer: verify, insert one row, answer 200."""
    webhook = Webhook(os.environ["BENCH_SECRET"])
    pool: dict[str, asyncpg.Pool] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        created = await asyncpg.create_pool(os.environ["BENCH_PLAIN_URL"], min_size=POOL, max_size=POOL)
        assert created is not None
        pool["db"] = created
        yield
        await created.close()

    async def hooks(request: Request) -> Response:
        body = await request.body()
        try:
            payload = webhook.verify(body, dict(request.headers))
        except WebhookVerificationError:
            return JSONResponse({"error": "unauthenticated"}, status_code=401)
        await pool["db"].execute("INSERT INTO bench_bare_rows (event) VALUES ($1)", payload["type"])
        return JSONResponse({"outcome": "processed"})

    return Starlette(routes=[Route("/hooks", hooks, methods=["POST"])], lifespan=lifespan)
