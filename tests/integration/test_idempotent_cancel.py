"""An idempotent request cancelled while its route awaits (a server shutting down cancels the requests
it still holds): the route's writes roll back, the key is given back at once (a retry runs, no 409 until
the lease runs out), and the connection goes back to the pool usable."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import Depends, FastAPI
from sqlalchemy import text
from sqlalchemy.pool import QueuePool

from consumer_kit import ConsumerApp
from consumer_kit.http.idempotency import IdempotencyKey, IdempotencyMiddleware, IdempotentContext
from tests.conftest import make_settings
from tests.integration.sleeping import sleeping_statement


@pytest.mark.parametrize("mode", ["two", "one", "staged"], ids=["two-transactions", "one-transaction", "staged"])
async def test_a_request_cancelled_inside_its_route_rolls_back_and_gives_its_key_back(
        database_url: str, mode: str) -> None:
    app = ConsumerApp(make_settings(database_url, inbox_lease_seconds=60))
    api = FastAPI()
    api.add_middleware(IdempotencyMiddleware)
    keys = IdempotencyKey(app, namespace="cancel", version=1, single_transaction=mode == "one",
                          staged=mode == "staged")
    inside, hold = asyncio.Event(), asyncio.Event()

    @api.post("/things", status_code=201)
    async def create(ctx: IdempotentContext = Depends(keys)) -> dict[str, int]:  # noqa: B008
        if mode == "staged":
            ctx.stage(text("INSERT INTO cancel_effects (n) VALUES (1)"))
        else:
            await ctx.db.execute(text("INSERT INTO cancel_effects (n) VALUES (1)"))
        inside.set()
        await hold.wait()  # cancelled here on the first attempt
        return {"n": 1}

    async with app.running():
        async with app.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS cancel_effects (n INTEGER)"))
            await conn.execute(text("DELETE FROM cancel_effects"))
        headers = {"Idempotency-Key": '"cancel-me"'}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://t") as client:
            first = asyncio.create_task(client.post("/things", headers=headers))
            await asyncio.wait_for(inside.wait(), 10)
            first.cancel()
            done, _ = await asyncio.wait([first], timeout=10)
            assert done and first.cancelled()
            async with app.engine.connect() as conn:
                assert (await conn.execute(text("SELECT count(*) FROM cancel_effects"))).scalar() == 0
            hold.set()
            retry = await client.post("/things", headers=headers)  # at once: not 409 for the 60 s lease
            again = await client.post("/things", headers=headers)
        assert retry.status_code == 201 and retry.headers.get("idempotency-replayed") is None
        assert again.status_code == 201 and again.headers["idempotency-replayed"] == "true"
        async with app.engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM cancel_effects"))).scalar() == 1
        pool = app.engine.pool
        assert isinstance(pool, QueuePool), type(pool)  # the async engines' default, on every driver
        assert pool.checkedout() == 0, pool.status()  # every connection back, none held by the cancel


@pytest.mark.postgres
async def test_a_staged_request_cancelled_during_its_one_statement_writes_nothing(pg_database: str) -> None:
    """The key, its answer and the staged write in one statement (PostgreSQL on asyncpg), cancelled while
    the statement runs: none of it is written, the store's connection goes back usable, a retry runs."""
    app = ConsumerApp(make_settings(pg_database))
    api = FastAPI()
    api.add_middleware(IdempotencyMiddleware)
    keys = IdempotencyKey(app, namespace="cancel-staged", version=1, staged=True, driver="asyncpg")
    slow = {"seconds": 3.0}

    @api.post("/things", status_code=201)
    async def create(ctx: IdempotentContext = Depends(keys)) -> dict[str, int]:  # noqa: B008
        ctx.stage("INSERT INTO cancel_effects (n) SELECT 1 FROM pg_sleep($1)", slow["seconds"])
        return {"n": 1}

    async with app.running():
        async with app.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE IF NOT EXISTS cancel_effects (n INTEGER)"))
            await conn.execute(text("DELETE FROM cancel_effects"))
        headers = {"Idempotency-Key": '"cancel-me-staged"'}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://t") as client:
            first = asyncio.create_task(client.post("/things", headers=headers))
            pool = await app.database.pool()
            await sleeping_statement(app.engine, first)
            first.cancel()
            done, _ = await asyncio.wait([first], timeout=10)
            assert done and first.cancelled()
            async with app.engine.connect() as conn:
                assert (await conn.execute(text("SELECT count(*) FROM cancel_effects"))).scalar() == 0
                assert (await conn.execute(text("SELECT count(*) FROM inbox WHERE consumer = 'http:cancel-staged'"))
                        ).scalar() == 0
            slow["seconds"] = 0.0
            retry = await client.post("/things", headers=headers)
            again = await client.post("/things", headers=headers)
        assert retry.status_code == 201 and retry.headers.get("idempotency-replayed") is None
        assert again.status_code == 201 and again.headers["idempotency-replayed"] == "true"
        async with app.engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM cancel_effects"))).scalar() == 1
        assert pool.get_size() - pool.get_idle_size() == 0  # every store connection back in the pool
