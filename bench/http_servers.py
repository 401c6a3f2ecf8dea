"""The servers of the idempotent-HTTP benchmark (``python -m bench http``), as uvicorn factories
configured by the environment (``BENCH_PLAIN_URL``, ``BENCH_DATABASE_URL``, ``BENCH_HMAC_KEY``,
``BENCH_POOL``, ``BENCH_TABLE``, ``BENCH_KIT_VIA``, ``BENCH_KIT_STYLE``). Each serves the same FastAPI
endpoint, ``POST /orders`` with a JSON ``{"sku", "quantity"}``: make the order's id, insert one row into
its table (``BENCH_TABLE``, one a side, so that each side's rows can be counted) and answer 201 with it.

- ``floor``: no database at all (the cost of the HTTP stack alone).
- ``ceiling``: no idempotency at all; the row is inserted on the asyncpg pool and the dict returned.
- ``handwritten``: the Idempotency-Key rules as a careful user writes them on asyncpg, "atomic phases"
  in one transaction per request: take a transaction-scoped advisory lock on the key (not granted: the
  key is in flight, 409), look the key up (another request's hash: 422; stored: replay it), else insert
  the row and store the key with the response; commit. A request that fails rolls all of it back, so
  a retry runs again; two requests with one key never both run (the lock), and one that comes after
  the commit sees the stored row (PostgreSQL releases the lock only once the commit is visible).
- ``kit``: consumer-kit's ``IdempotencyKey`` and ``IdempotencyMiddleware``, configured as a user who
  wants this endpoint fast would: ``staged=True`` (the route only writes the row, and its answer needs
  nothing back from it: the row is staged with ``ctx.stage``, and the row, the key and the response go
  to PostgreSQL in one statement), ``driver="asyncpg"`` (on the store's asyncpg pool), and the
  middleware's prefix style (``keys=``, ``prefix=``: a replay is answered before FastAPI routes the
  request; the route reads its context with ``idempotency_context``). ``BENCH_KIT_TX=one`` takes one
  transaction instead (``single_transaction=True``: the key held, then the row written through
  ``ctx.connection`` inside that transaction, as the hand-written peer's is), ``BENCH_KIT_TX=two`` the
  default two transactions (a lease committed first); ``BENCH_KIT_STYLE=dependency`` claims in a route
  dependency, ``BENCH_KIT_VIA=db`` writes through ``ctx.db`` (SQLAlchemy; one transaction).
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations at run time, and
# ``Annotated[..., Depends(keys)]`` names a local.
import contextlib
import hashlib
import os
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any

import asyncpg
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, Text

from consumer_kit import ConsumerApp, Settings
from consumer_kit.http.asgi import lifespan
from consumer_kit.http.idempotency import (
    IdempotencyKey,
    IdempotencyMiddleware,
    IdempotentContext,
    context_of,
    idempotency_context,
)

POOL = int(os.environ.get("BENCH_POOL", "32"))
TABLE = os.environ.get("BENCH_TABLE", "bench_orders")
# Every side makes the order's id itself (a random 62-bit integer), as an API that names its objects
# before it writes them does: so that consumer-kit's staged route, whose answer cannot wait for the
# write, serves the same endpoint as the others.
INSERT = f"INSERT INTO {TABLE} (id, sku, quantity) VALUES ($1, $2, $3)"
KEYS_TABLE = "bench_idempotency_keys"


def schema(tables: list[str]) -> list[str]:
    """The statements that make the sides' tables: one orders table each, and the hand-written peer's
    keys, with what a replay needs and ``created_at`` (indexed) for its sweeper, as the inbox has
    ``expires_at``."""
    return [
        *(f"CREATE TABLE {t} (id bigint PRIMARY KEY, sku text NOT NULL, quantity integer NOT NULL)"
          for t in tables),
        f"CREATE TABLE {KEYS_TABLE} (key text PRIMARY KEY, request_hash bytea NOT NULL, status integer NOT NULL,"
        " body bytea NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
        f"CREATE INDEX ix_{KEYS_TABLE}_created_at ON {KEYS_TABLE} (created_at)",
    ]


orders = Table(
    TABLE,
    MetaData(),
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("sku", Text, nullable=False),
    Column("quantity", Integer, nullable=False),
)


class Order(BaseModel):
    sku: str
    quantity: int


async def _no_reset(_connection: asyncpg.Connection) -> None:
    """Pool reset: none beyond asyncpg's own (a transaction left open is ended). These endpoints leave
    no session state (the advisory lock is the transaction's), and asyncpg's default reset costs a
    round trip at every release; consumer-kit's own pool skips it too, so the peers do."""


@contextlib.asynccontextmanager
async def _pool(holder: dict[str, asyncpg.Pool]) -> AsyncIterator[None]:
    created = await asyncpg.create_pool(os.environ["BENCH_PLAIN_URL"], min_size=POOL, max_size=POOL,
                                        reset=_no_reset)
    assert created is not None
    holder["db"] = created
    try:
        yield
    finally:
        await created.close()


def floor() -> FastAPI:
    """No database at all: the endpoint answers 201 with what it was sent, and an id it counts itself.
    What uvicorn, FastAPI and the client cost a request by themselves (no side can answer faster)."""
    api = FastAPI()
    count = iter(range(1, 1 << 62))

    @api.post("/orders", status_code=201)
    async def create_order(order: Order) -> dict[str, Any]:
        return {"id": next(count), "sku": order.sku, "quantity": order.quantity}

    return api


def ceiling() -> FastAPI:
    """The endpoint without idempotency: insert, answer 201."""
    pool: dict[str, asyncpg.Pool] = {}
    api = FastAPI(lifespan=lambda _api: _pool(pool))

    @api.post("/orders", status_code=201)
    async def create_order(order: Order) -> dict[str, Any]:
        order_id = secrets.randbits(62)
        await pool["db"].execute(INSERT, order_id, order.sku, order.quantity)
        return {"id": order_id, "sku": order.sku, "quantity": order.quantity}

    return api


# The key's lock: transaction-scoped, so a commit or rollback (or a connection lost) releases it; a
# 64-bit hash of the key, whose collisions (a spurious 409) are vanishingly rare.
TRY_LOCK = "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))"
LOOKUP = f"SELECT request_hash, status, body FROM {KEYS_TABLE} WHERE key = $1"
STORE = f"INSERT INTO {KEYS_TABLE} (key, request_hash, status, body) VALUES ($1, $2, $3, $4)"


def _error(status: int, code: str, **headers: str) -> Response:
    return JSONResponse({"error": code}, status_code=status, headers=headers or None)


def _client_key(raw: str | None) -> str | None:
    """The header's key: an sf-string (``"abc"``), printable ASCII, at most 255 characters."""
    if raw is None or len(raw) < 3 or raw[0] != '"' or raw[-1] != '"':
        return None
    key = raw[1:-1]
    if not key or len(key) > 255 or not key.isascii() or not key.isprintable() or '"' in key or "\\" in key:
        return None
    return key


def handwritten() -> FastAPI:
    """The peer: the Idempotency-Key rules in one transaction a request, on asyncpg directly."""
    pool: dict[str, asyncpg.Pool] = {}
    api = FastAPI(lifespan=lambda _api: _pool(pool))

    @api.post("/orders", status_code=201)
    async def create_order(order: Order, request: Request) -> Response:
        raw = request.headers.getlist("idempotency-key")
        if len(raw) != 1:
            return _error(400, "idempotency_key_missing" if not raw else "idempotency_key_repeated")
        key = _client_key(raw[0])
        if key is None:
            return _error(400, "idempotency_key_malformed")
        # The same request: method, path, query and the body as the client sent it (FastAPI read it already).
        scope = request.scope
        request_hash = hashlib.sha256(b"\0".join((b"POST", scope["path"].encode(), scope["query_string"],
                                                  await request.body()))).digest()
        async with pool["db"].acquire() as conn, conn.transaction():
            if not await conn.fetchval(TRY_LOCK, key):
                return _error(409, "request_in_progress", **{"Retry-After": "1"})
            stored = await conn.fetchrow(LOOKUP, key)
            if stored is not None:
                if stored["request_hash"] != request_hash:
                    return _error(422, "idempotency_key_reused")
                return Response(stored["body"], status_code=stored["status"], media_type="application/json",
                                headers={"Idempotency-Replayed": "true"})
            order_id = secrets.randbits(62)
            await conn.execute(INSERT, order_id, order.sku, order.quantity)
            answer = JSONResponse({"id": order_id, "sku": order.sku, "quantity": order.quantity}, status_code=201)
            await conn.execute(STORE, key, request_hash, answer.status_code, answer.body)
        return answer

    return api


def kit() -> FastAPI:
    """consumer-kit: the rules, the middleware, the row written in the transaction that stores the
    response."""
    settings = Settings(
        database_url=os.environ["BENCH_DATABASE_URL"],
        idempotency_hmac_key=os.environ["BENCH_HMAC_KEY"],
        db_pool_size=POOL,
    )
    app = ConsumerApp(settings)
    api = FastAPI(lifespan=lifespan(app))
    via_db = os.environ.get("BENCH_KIT_VIA", "connection") == "db"
    tx = os.environ.get("BENCH_KIT_TX", "staged")
    keys = IdempotencyKey(app, namespace="orders", version=1, driver="sqlalchemy" if via_db else "asyncpg",
                          single_transaction=tx != "two", staged=tx == "staged")
    if os.environ.get("BENCH_KIT_STYLE", "prefix") == "prefix":
        api.add_middleware(IdempotencyMiddleware, keys=keys, prefix="/orders", methods=("POST",))
        context = Depends(idempotency_context)
    else:
        api.add_middleware(IdempotencyMiddleware)
        context = Depends(keys)

    if via_db and tx != "staged":

        @api.post("/orders", status_code=201)
        async def create_order_db(order: Order, ctx: Annotated[IdempotentContext, context]) -> dict[str, Any]:
            order_id = secrets.randbits(62)
            await ctx.db.execute(orders.insert().values(id=order_id, sku=order.sku, quantity=order.quantity))
            return {"id": order_id, "sku": order.sku, "quantity": order.quantity}

    elif tx == "staged" and os.environ.get("BENCH_KIT_CONTEXT") == "request":

        @api.post("/orders", status_code=201)
        async def create_order_staged_request(order: Order, request: Request) -> dict[str, Any]:
            ctx = context_of(request)
            order_id = secrets.randbits(62)
            ctx.stage(INSERT, order_id, order.sku, order.quantity)
            return {"id": order_id, "sku": order.sku, "quantity": order.quantity}

    elif tx == "staged":

        @api.post("/orders", status_code=201)
        async def create_order_staged(order: Order, ctx: Annotated[IdempotentContext, context]) -> dict[str, Any]:
            order_id = secrets.randbits(62)
            ctx.stage(INSERT, order_id, order.sku, order.quantity)
            return {"id": order_id, "sku": order.sku, "quantity": order.quantity}

    else:

        @api.post("/orders", status_code=201)
        async def create_order(order: Order, ctx: Annotated[IdempotentContext, context]) -> dict[str, Any]:
            order_id = secrets.randbits(62)
            await ctx.connection.execute(INSERT, order_id, order.sku, order.quantity)
            return {"id": order_id, "sku": order.sku, "quantity": order.quantity}

    return api


__all__ = ["INSERT", "ceiling", "floor", "handwritten", "kit", "schema"]
