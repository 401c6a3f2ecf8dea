"""A label service on FastAPI: ``POST /labels`` books a shipping label once per ``Idempotency-Key``.

Run it the way production would::

    export DATABASE_URL=postgresql://app@db/app IDEMPOTENCY_HMAC_KEY=... RABBITMQ_URL=amqp://...
    consumer-kit db upgrade
    python -m examples.idempotent_api init          # the labels table and the label-events queue
    python -m examples.idempotent_api --port 8000   # or: uvicorn examples.idempotent_api:api --port 8000

A client sends ``POST /labels`` with ``{"order": "A-1001", "carrier": "ups", "weight_grams": 1200}`` and
an ``Idempotency-Key: "<a key of its own>"`` header (a quoted string), and sends the same request with
the same key again whenever it does not get an answer. The route runs once per key and tenant: it
books the label with the carrier (``CARRIER_URL``, when set: ``POST <CARRIER_URL>/shipments``, with a
key derived from the request's, so that the carrier deduplicates too; unset, a made-up tracking
number), inserts one ``example_labels`` row and stages a ``label.created`` event for
``LABEL_EVENTS_QUEUE`` (default ``label-events``) in the transaction that also stores the answer. A
repeat gets the stored ``201`` back, marked ``Idempotency-Replayed: true``; the relay inside the
process publishes the event with a stable message id.

The tenant a key belongs to comes from ``Authorization: Bearer <token>`` when ``LABEL_API_TOKENS``
is set (JSON, ``{"<token>": "<tenant>"}``), otherwise from the ``X-Tenant`` header, which a gateway in
front sets once it has authenticated the caller (the Compose service runs so). Two tenants sending
the same key get two labels. ``GET /labels/status`` (with the key) says what became of a request,
``GET /labels/<id>`` reads a label back, and ``/healthz``, ``/readyz`` and ``/metrics`` are
consumer-kit's.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import secrets
import signal
import sys
from datetime import UTC, datetime
from types import FrameType
from typing import Annotated, Any

import aio_pika
import httpx
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from pydantic import BaseModel, Field
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, select

from consumer_kit import ConfigurationError, ConsumerApp, Settings, logs
from consumer_kit.http.asgi import lifespan
from consumer_kit.http.idempotency import IdempotencyKey, IdempotencyMiddleware, IdempotentContext
from consumer_kit.sources.rabbitmq import AmqpPublisher
from examples import create_tables

log = logging.getLogger("examples.idempotent_api")

LABEL_EVENTS_QUEUE = os.environ.get("LABEL_EVENTS_QUEUE", "label-events")
CARRIER_URL = os.environ.get("CARRIER_URL", "").rstrip("/")
TOKENS: dict[str, str] = json.loads(os.environ.get("LABEL_API_TOKENS") or "{}")

metadata = MetaData()
labels_table = Table(
    "example_labels",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("tenant", String(200), nullable=False),
    Column("order_ref", String(100), nullable=False),
    Column("carrier", String(50), nullable=False),
    Column("weight_grams", Integer, nullable=False),
    Column("tracking_number", String(100), nullable=False),
    Column("key_digest", String(16), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

settings = Settings()
app = ConsumerApp(settings)
app.relay_outbox(AmqpPublisher(settings=settings))


def tenant(request: Request) -> str:
    """The tenant of the request: its bearer token's (``LABEL_API_TOKENS``), or the gateway's
    ``X-Tenant`` header when no tokens are configured; 401 when there is none."""
    if TOKENS:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            for token, name in TOKENS.items():  # compared in constant time, every token
                if hmac.compare_digest(given.encode(), token.encode()):
                    return name
    else:
        name = request.headers.get("x-tenant", "").strip()
        if name:
            return name
    raise HTTPException(401, "unauthenticated")


# The key is scoped by tenant: the same key from two tenants is two operations, and neither is
# answered with the other's label.
labels = IdempotencyKey(app, namespace="labels", version=1, caller=tenant)

api = FastAPI(title="labels", lifespan=lifespan(app))  # the lifespan runs the ConsumerApp with the API
api.add_middleware(IdempotencyMiddleware)  # it stores each answer before it is sent


class LabelRequest(BaseModel):
    order: str = Field(min_length=1, max_length=100)
    carrier: str = Field(min_length=1, max_length=50)
    weight_grams: int = Field(gt=0, le=70_000)


async def book(ctx: IdempotentContext, label: LabelRequest) -> str:
    """The carrier's tracking number for ``label``. The carrier is called with a key derived from this
    request's, the same on every retry, so that it books once too; it failing or not answering is a
    503, which gives the key back: the client's retry books again."""
    if not CARRIER_URL:
        return "TRK" + secrets.token_hex(6).upper()
    assert ctx.http is not None
    try:
        answer = await ctx.http.post(f"{CARRIER_URL}/shipments", headers=ctx.idempotency_headers("carrier"),
                                     json={"order": label.order, "weight_grams": label.weight_grams}, timeout=10)
    except httpx.HTTPError as exc:
        log.warning("the carrier did not answer (%s) [%s]", type(exc).__name__, ctx.key_digest)
        raise HTTPException(503, "carrier_unavailable", headers={"Retry-After": "5"}) from None
    if answer.status_code != 200:
        log.warning("the carrier answered %d [%s]", answer.status_code, ctx.key_digest)
        raise HTTPException(503, "carrier_unavailable", headers={"Retry-After": "5"})
    return str(answer.json()["tracking_number"])


@api.post("/labels", status_code=201)
async def create_label(label: LabelRequest, response: Response,
                       ctx: Annotated[IdempotentContext, Depends(labels)]) -> dict[str, Any]:
    """Book the label, record it and announce it: the row, the event and the stored answer commit
    together, or not at all."""
    assert ctx.caller is not None
    tracking = await book(ctx, label)
    label_id = (await ctx.db.execute(labels_table.insert().values(
        tenant=ctx.caller, order_ref=label.order, carrier=label.carrier, weight_grams=label.weight_grams,
        tracking_number=tracking, key_digest=ctx.key_digest, created_at=datetime.now(UTC),
    ).returning(labels_table.c.id))).scalar_one()
    body = {"label": label_id, "order": label.order, "carrier": label.carrier, "tracking_number": tracking}
    ctx.outbox.publish(LABEL_EVENTS_QUEUE, json.dumps({"type": "label.created", "tenant": ctx.caller, **body}).encode(),
                       headers={"content-type": "application/json"})
    response.headers["Location"] = f"/labels/{label_id}"
    log.info("label %d booked [%s]", label_id, ctx.key_digest)
    return body


api.add_route("/labels/status", labels.status, methods=["GET"])


@api.get("/labels/{label_id}")
async def read_label(label_id: int, caller: Annotated[str, Depends(tenant)]) -> dict[str, Any]:
    """A label of the caller's tenant (404 for another tenant's)."""
    async with app.engine.connect() as conn:
        row = (await conn.execute(select(labels_table).where(
            labels_table.c.id == label_id, labels_table.c.tenant == caller))).mappings().first()
    if row is None:
        raise HTTPException(404, "no such label")
    return {"label": row["id"], "order": row["order_ref"], "carrier": row["carrier"],
            "tracking_number": row["tracking_number"]}


api.mount("/", app.asgi())  # /healthz, /readyz and /metrics, after the API's own routes


async def init() -> None:
    """Create the example's table and the events queue (consumer-kit's own tables come from
    ``consumer-kit db upgrade``)."""
    await create_tables(settings, metadata)
    connection = await aio_pika.connect(settings.require_rabbitmq_url())
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(LABEL_EVENTS_QUEUE, durable=True)


def main(argv: list[str]) -> int:
    """``init``, or serve the API (``--host``, ``--port``) until SIGTERM or SIGINT, behind the request
    bounds consumer-kit's own servers have (``HTTP_MAX_HEADER_BYTES``, ``HTTP_REQUEST_TIMEOUT_SECONDS``)."""
    parser = argparse.ArgumentParser(prog="python -m examples.idempotent_api", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", nargs="?", choices=["run", "init"], default="run")
    parser.add_argument("--host", default="127.0.0.1", help="where to listen (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.action == "init":
            asyncio.run(init())
            return 0
        settings.require_rabbitmq_url()  # the relay's broker: refused here in one line, not at the first label
    except ConfigurationError as exc:
        print(f"python -m examples.idempotent_api {args.action}: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from consumer_kit.http.server import server_config

    logs.configure(os.environ.get("LOG_LEVEL", "INFO"), os.environ.get("LOG_FORMAT", "text"))  # as the command logs
    own_logging = {"log_config": None} if logs.json_configured() else {}  # JSON: uvicorn's records too
    server = uvicorn.Server(server_config(api, settings, host=args.host, port=args.port, lifespan="on",
                                          timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) or None,
                                          **own_logging))
    # uvicorn takes SIGTERM and SIGINT while it serves: it stops accepting, finishes the requests under
    # way, and the lifespan drains the app. Then it raises the signal again for the handler it found,
    # this one: a stop asked for is a clean exit (0), not a death by the signal.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _stopped)
    server.run()
    return 0 if server.started else 3  # 3: the app did not start (uvicorn logged why)


def _stopped(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
