"""A FastAPI app with idempotent endpoints in each of the three styles, for the tests of that feature over
real HTTP. Configured by environment, as a user's app is (``Settings()``: ``DATABASE_URL``,
``IDEMPOTENCY_HMAC_KEY``, ``INBOX_LEASE_SECONDS``, ...), it is served with::

    python -m uvicorn tests.integration.idempotent_app:create --factory --host 127.0.0.1 --port N

and in-process with :func:`build` (which also takes a tracer provider).

What a route does is the request body's to say (``Order``), so that a test's retry, which must send the
same body, gets the same behaviour: every route writes one row into ``idem_effects`` in the request's
transaction, then may sleep, wait at a gate, raise, answer 503 or a 4xx of its own, or answer a body
of a given size. An effect that happened twice shows as two rows of one ticket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi.telemetry import TelemetryConfig
from pydantic import BaseModel
from sqlalchemy import text
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from consumer_kit import ConsumerApp, Settings, logs
from consumer_kit.http.idempotency import IdempotencyKey, IdempotencyMiddleware, IdempotentContext, idempotency_context

EFFECTS_DDL = ("CREATE TABLE IF NOT EXISTS idem_effects (ticket VARCHAR(200) NOT NULL, route VARCHAR(50) NOT NULL,"
               " caller VARCHAR(100), attempt INTEGER NOT NULL)")
TOKENS = {"token-a": "tenant-a", "token-b": "tenant-b"}
"""Bearer tokens and the tenants they stand for (the caller an endpoint scopes keys by)."""
GATE_SECONDS = 15
SIGNAL_DIR = "IDEM_SIGNAL_DIR"
"""Environment: a directory where every route run writes ``<ticket>.<attempt>`` once its row is written
(a file, outside the transaction), so that a test in another process knows it is inside the route."""


class Order(BaseModel):
    """What the route is asked to do (all but ``ticket`` optional)."""

    ticket: str
    sleep: float = 0
    sleep_first: float = 0  # only on the operation's first attempt (ctx.attempt == 1)
    hang_once: bool = False  # hang the first run of the ticket in any process (SIGNAL_DIR says which)
    gate: bool = False  # wait until POST /_test/gates/<ticket>
    raise_times: int = 0  # raise on this process's first n runs of the ticket
    unavailable_times: int = 0  # answer 503 on this process's first n runs of the ticket
    status: int | None = None  # answer this status of the route's own choosing
    size: int = 0  # pad the answer to about this many bytes
    stage_twice: bool = False  # a staged route: stage a second statement too (no single statement then)
    use_connection: bool = False  # a staged route: use ctx.connection / ctx.db, which it may not
    show_delivery: bool = False  # answer with what ctx.delivery shows of the request


async def tenant(request: Request) -> str | None:
    """The caller, from a bearer token (none: keys unscoped); an unknown token is a 401."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    if token not in TOKENS:
        raise HTTPException(401)
    return TOKENS[token]


def build(settings: Settings, *, tracer_provider: Any = None, telemetry: TelemetryConfig | None = None) -> FastAPI:
    """The app on ``settings``' database; ``tracer_provider``: OpenTelemetry's, for the app's spans;
    ``telemetry``: FastAPI's own (its server spans: on by default when a tracer provider is set globally)."""
    app = ConsumerApp(settings, tracer_provider=tracer_provider)
    gates: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
    runs: Counter[tuple[str, str, str | None]] = Counter()
    signal_dir = os.environ.get(SIGNAL_DIR)

    @contextlib.asynccontextmanager
    async def lifespan(_api: FastAPI) -> AsyncIterator[None]:
        async with app.running():
            async with app.engine.begin() as conn:
                await conn.execute(text(EFFECTS_DDL))
            yield

    api = FastAPI(lifespan=lifespan, telemetry=telemetry)
    labels = IdempotencyKey(app, namespace="labels", version=1, caller=tenant)
    slow = IdempotencyKey(app, namespace="slow", version=1, timeout_seconds=0.5)
    jobs = IdempotencyKey(app, namespace="jobs", version=1, timeout_seconds=60)  # may outlive its lease
    late_refuse = IdempotencyKey(app, namespace="late-refuse", version=1, after_retention="refuse")
    late_run = IdempotencyKey(app, namespace="late-run", version=1, after_retention="run")
    payments = IdempotencyKey(app, namespace="payments", version=1)
    receipts = IdempotencyKey(app, namespace="receipts", version=1, bare_keys=True, replay_headers=("x-receipt",))
    api.add_middleware(IdempotencyMiddleware, keys=payments, prefix="/payments", methods=("POST",))
    # The single-transaction path: per route, for a prefix (its route writes through ctx.connection on
    # PostgreSQL on asyncpg, the bench's way), and for a key seen after its record was swept.
    one = IdempotencyKey(app, namespace="one", version=1, caller=tenant, single_transaction=True)
    one_late = IdempotencyKey(app, namespace="one-late", version=1, single_transaction=True, after_retention="refuse")
    one_late_run = IdempotencyKey(app, namespace="one-late-run", version=1, single_transaction=True,
                                  after_retention="run")
    on_asyncpg = settings.database_url.startswith("postgresql+asyncpg")
    fast = IdempotencyKey(app, namespace="fast", version=1, single_transaction=True,
                          driver="asyncpg" if on_asyncpg else "sqlalchemy")
    api.add_middleware(IdempotencyMiddleware, keys=fast, prefix="/fast", methods=("POST",))
    # Staged routes: nothing held while the route runs; its one staged statement goes with the key in a
    # single statement on PostgreSQL on asyncpg, else (two statements, SQLite) in one transaction after it.
    driver = "asyncpg" if on_asyncpg else "sqlalchemy"
    staged = IdempotencyKey(app, namespace="staged", version=1, caller=tenant, staged=True, driver=driver)
    staged_run = IdempotencyKey(app, namespace="staged-run", version=1, staged=True, after_retention="run",
                                driver=driver)

    async def perform(order: Order, ctx: IdempotentContext, route: str) -> Response:
        runs[(route, order.ticket, ctx.caller)] += 1
        run = runs[(route, order.ticket, ctx.caller)]
        if route.startswith("staged"):
            stage(order, ctx, route)
        elif route == "fast-orders" and not fast.uses_db:
            await ctx.connection.execute("INSERT INTO idem_effects (ticket, route, caller, attempt)"
                                         " VALUES ($1, $2, $3, $4)", order.ticket, route, ctx.caller, ctx.attempt)
        else:
            await ctx.db.execute(text("INSERT INTO idem_effects (ticket, route, caller, attempt)"
                                      " VALUES (:ticket, :route, :caller, :attempt)"),
                                 {"ticket": order.ticket, "route": route, "caller": ctx.caller, "attempt": ctx.attempt})
        if signal_dir:
            (Path(signal_dir) / f"{order.ticket}.{ctx.attempt}").write_text(str(os.getpid()))
            if order.hang_once and not (hung := Path(signal_dir) / f"{order.ticket}.hung").exists():
                hung.write_text(str(os.getpid()))
                await asyncio.sleep(GATE_SECONDS * 4)
        if order.sleep_first and ctx.attempt == 1:
            await asyncio.sleep(order.sleep_first)
        if order.sleep:
            await asyncio.sleep(order.sleep)
        if order.gate:
            await asyncio.wait_for(gates[order.ticket].wait(), GATE_SECONDS)
        if run <= order.raise_times:
            raise RuntimeError("the route failed on purpose")
        if run <= order.unavailable_times:
            return JSONResponse({"error": "busy"}, status_code=503)
        if order.status is not None:
            return JSONResponse({"error": "no_such_order", "ticket": order.ticket}, status_code=order.status)
        made = uuid.uuid4().hex
        if order.show_delivery:
            delivery = ctx.delivery
            return JSONResponse({"headers": dict(delivery.headers), "attributes": dict(delivery.attributes),
                                 "body": delivery.json(), "attempt": delivery.attempt, "id": delivery.id,
                                 "received_at": delivery.received_at.isoformat()}, status_code=201)
        body = {"ticket": order.ticket, "id": made, "caller": ctx.caller, "attempt": ctx.attempt,
                "pad": "x" * order.size}
        return JSONResponse(body, status_code=201, headers={"Location": f"/{route}/{made}",
                                                            "X-Run": uuid.uuid4().hex, "X-Receipt": made[:8]})

    def stage(order: Order, ctx: IdempotentContext, route: str) -> None:
        values = (order.ticket, route, ctx.caller, ctx.attempt)
        if order.use_connection:
            if staged.uses_db:
                ctx.db.add  # noqa: B018 - raises: a staged route has no session to use
            ctx.connection.execute  # noqa: B018 - raises likewise
        for _ in range(2 if order.stage_twice else 1):
            if staged.uses_db:
                ctx.stage(text("INSERT INTO idem_effects (ticket, route, caller, attempt)"
                               " VALUES (:ticket, :route, :caller, :attempt)"),
                          **dict(zip(("ticket", "route", "caller", "attempt"), values, strict=True)))
            else:
                ctx.stage("INSERT INTO idem_effects (ticket, route, caller, attempt) VALUES ($1, $2, $3, $4)",
                          *values)
            values = (order.ticket, f"{route}-again", ctx.caller, ctx.attempt)

    def route(path: str, keys: Callable[..., Any]) -> None:
        name = path.strip("/").replace("/", "-")

        # A default, not Annotated[..., Depends(keys)]: FastAPI would read the (postponed) annotation in
        # the module's globals, where this route's keys are not.
        async def endpoint(order: Order, ctx: IdempotentContext = Depends(keys)) -> Response:  # noqa: B008
            return await perform(order, ctx, name)

        api.post(path, status_code=201)(endpoint)

    for path, keys in (("/labels", labels), ("/slow", slow), ("/jobs", jobs), ("/late/refuse", late_refuse),
                       ("/late/run", late_run), ("/payments/charges", idempotency_context),
                       ("/payments/refunds", idempotency_context), ("/one", one), ("/one/late", one_late),
                       ("/one/late-run", one_late_run), ("/fast/orders", idempotency_context), ("/staged", staged),
                       ("/staged/run", staged_run)):
        route(path, keys)
    for path, keys in (("/labels", labels), ("/slow", slow), ("/jobs", jobs), ("/late/refuse", late_refuse),
                       ("/one", one), ("/staged", staged)):
        api.add_route(f"{path}/status", keys.status, methods=["GET"])

    async def make_receipt(request: Request, ctx: IdempotentContext | None) -> Response:
        assert ctx is not None
        order = Order.model_validate(await request.json())
        return await perform(order, ctx, "receipts")

    api.add_route("/receipts", receipts.endpoint(make_receipt), methods=["POST"])

    @api.get("/payments/charges/{charge}")
    async def read_charge(charge: str) -> dict[str, str]:
        return {"charge": charge}

    @api.post("/plain", status_code=201)
    async def plain(order: Order) -> dict[str, str]:
        async with app.engine.begin() as conn:
            await conn.execute(text("INSERT INTO idem_effects (ticket, route, caller, attempt)"
                                    " VALUES (:ticket, 'plain', NULL, 0)"), {"ticket": order.ticket})
        return {"ticket": order.ticket}

    @api.post("/_test/gates/{ticket}")
    async def open_gate(ticket: str) -> dict[str, bool]:
        gates[ticket].set()
        return {"open": True}

    @api.post("/_test/sweep")
    async def sweep() -> dict[str, int]:
        return {"swept": await app.sweep()}

    api.mount("/ops", app.asgi())  # /ops/healthz, /ops/readyz, /ops/metrics
    return api


def create() -> FastAPI:
    """The app as uvicorn's ``--factory`` makes it: configured by environment, logging as the
    ``consumer-kit`` command does (``LOG_LEVEL``, default INFO), to stderr."""
    logs.configure(os.environ.get("LOG_LEVEL", "INFO"), "text")
    return build(Settings())
