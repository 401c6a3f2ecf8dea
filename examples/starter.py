"""What ``make run`` runs: a worker that needs no broker, on the embedded defaults.

A webhook receiver and a schedule in one app, on a SQLite file with the in-process coordinator::

    python -m examples.starter [--port 8000]        # make run (PORT=8000)

- ``POST /orders``: an order, signed with an HMAC-SHA-256 of its body (``X-Signature: sha256=<hex>``)
  and keyed by its ``id``. The handler records it in ``starter_orders`` inside a coordinator session
  (the record of one task, here "Record order <id>"); the same order sent again is answered
  ``duplicate`` and recorded once.
- ``order-summary``: every minute, a row in ``starter_summaries`` with how many orders there are, once
  per minute however many replicas run.
- ``/healthz``, ``/readyz`` and ``/metrics``.

Once it serves (its ``/readyz`` answers), it prints a ``curl`` command that sends a signed order, and
commands to look further written with this interpreter's path (``.venv/bin/...``): they work as printed,
with no virtualenv activated. The signing secret comes from ``STARTER_WEBHOOK_SECRET``; when that is
unset and the database is a SQLite file (the default ``consumer-kit.db``), a random one is written
beside it once (``consumer-kit.db.webhook-secret``, mode 0600) and used from then on, as the HMAC key is
(``consumer-kit.db.hmac-key``). On any other database the secret must be set. ``python -m
examples.starter curl '{"id": "order-2", "amount": 5}'`` prints the command for another body; ``python
-m examples.starter init`` only creates the example's tables (what a deployment runs once, beside
``consumer-kit db upgrade``), and ``consumer-kit run examples.starter:app --port 8000`` runs the app
without the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import shlex
import sys
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, func, select

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.settings import local_secret
from consumer_kit.sources.schedules import Schedule, ScheduleDelivery
from consumer_kit.sources.webhooks import HmacVerifier, WebhookSource
from examples import create_tables

log = logging.getLogger("examples.starter")

SECRET_VARIABLE = "STARTER_WEBHOOK_SECRET"
SAMPLE_ORDER = '{"id": "order-1", "amount": 12}'

metadata = MetaData()
orders = Table(
    "starter_orders",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_ref", String(100), nullable=False, unique=True),
    Column("amount", Integer, nullable=False),
    Column("session_id", String(100), nullable=True),
)
summaries = Table(
    "starter_summaries",
    metadata,
    Column("scheduled_for", DateTime(timezone=True), primary_key=True),
    Column("orders", Integer, nullable=False),
)

settings = Settings()
_given = os.environ.get(SECRET_VARIABLE)
if _given:
    SECRET, SECRET_ORIGIN = _given, f"from {SECRET_VARIABLE}"
else:  # the embedded defaults keep one beside the database; elsewhere this refuses, naming the variable
    _local = local_secret(settings.database_url, "webhook-secret", variable=SECRET_VARIABLE)
    SECRET = _local.value
    SECRET_ORIGIN = f"{'generated into' if _local.created else 'read from'} {_local.path} ({SECRET_VARIABLE} unset)"

app = ConsumerApp(settings)
webhook = WebhookSource(
    path="/orders", namespace="starter-orders", version=1,
    verifier=HmacVerifier(SECRET, header="X-Signature", prefix="sha256=", id_field="id"),
)
summary = Schedule("order-summary", every=timedelta(minutes=1))


@app.handler(webhook, name="record-order", labels=["orders"], task=lambda d: f"Record order {d.json()['id']}")
async def record_order(ctx: Context) -> None:
    """Record the order; the row commits with the inbox record and the session's end, or not at all."""
    order = ctx.delivery.json()
    await ctx.db.execute(orders.insert().values(
        order_ref=str(order["id"]), amount=int(order.get("amount", 0)),
        session_id=ctx.session.session_id if ctx.session else None))
    log.info("order recorded [%s]", ctx.key_digest)


@app.handler(summary, name="order-summary")
async def summarise(ctx: Context) -> None:
    """Count the orders at the tick's intended minute (never the clock's: a late tick reports its own)."""
    tick = ctx.delivery
    assert isinstance(tick, ScheduleDelivery)
    count = (await ctx.db.execute(select(func.count()).select_from(orders))).scalar_one()
    await ctx.db.execute(summaries.insert().values(scheduled_for=tick.scheduled_for, orders=int(count)))
    log.info("%d order(s) at %s", count, tick.scheduled_for.isoformat())


def signed_curl(body: str, port: int, host: str = "127.0.0.1") -> str:
    """A ready-to-paste ``curl`` command that POSTs ``body`` to ``/orders``, signed with the secret."""
    signature = hmac.new(SECRET.encode("utf-8"), body.encode("utf-8"), hashlib.sha256).hexdigest()
    return (f"curl -s http://{host}:{port}/orders -H 'Content-Type: application/json' "
            f"-H 'X-Signature: sha256={signature}' --data-raw {shlex.quote(body)}")


async def init() -> None:
    """Create the example's tables (consumer-kit's own come from the migrations)."""
    await create_tables(settings, metadata)


def command_path(path: str) -> str:
    """``path`` as it can be typed where this runs: relative below the current directory (a virtualenv's
    ``.venv/bin/python``), absolute elsewhere; either way it needs no activated virtualenv."""
    relative = os.path.relpath(path)
    return shlex.quote(path if relative.startswith("..") else relative)


def own_commands() -> tuple[str, str]:
    """How to run this interpreter and the ``consumer-kit`` command of its environment, as typed."""
    python = command_path(sys.executable)
    script = Path(sys.executable).with_name("consumer-kit")
    return python, command_path(str(script)) if script.exists() else f"{python} -m consumer_kit.cli"


def startup_message(host: str, port: int) -> str:
    """What ``run`` prints once it is serving: where, and commands that work as printed."""
    where = settings.database_url.split("///", 1)[-1] if settings.is_sqlite else "the database"
    coordinator = settings.coordinator_url or "the in-process coordinator"
    python, consumer_kit = own_commands()
    another = shlex.quote('{"id": "order-2", "amount": 5}')
    return f"""
consumer-kit starter: a webhook receiver and a schedule on {where}, with {coordinator}
  webhook secret: {SECRET_ORIGIN}
  http://{host}:{port}/orders  (and /healthz, /readyz, /metrics)

Send it a signed order (send it again: the answer is "duplicate", and nothing new is recorded):

  {signed_curl(SAMPLE_ORDER, port, host)}

Then:

  curl -s http://{host}:{port}/metrics | grep consumer_kit_deliveries_total
  {python} -m examples.starter curl {another} --port {port}   # the command for another order
  {consumer_kit} parked list --format table   # what was parked and why (a signed order without an id is)
  {consumer_kit} demo   # the retry-safety table of the coordinator's recipe

Stop it with Ctrl-C.
"""


def announce_when_ready(url: str, message: str, *, first: float = 0.05, longest: float = 0.25) -> threading.Thread:
    """Print ``message`` once ``url`` (the worker's ``/readyz``) answers 200, from a thread of its own:
    the curl it holds then reaches a bound port and a started app. The thread dies with the process."""
    # urllib rather than httpx: httpx logs every request at INFO, and this polls. No proxy for loopback.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def wait_then_print() -> None:
        pause = first
        while True:
            try:
                with opener.open(url, timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:  # refused (not listening yet), or 503 (not ready yet)
                pass
            time.sleep(pause)
            pause = min(pause * 2, longest)  # a worker that stays unready is asked (and logs) 4 times a second
        print(message, flush=True)

    thread = threading.Thread(target=wait_then_print, name="starter-announce", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> int:
    """``[--host H] [--port N]``: init, run, and print how to send an order once it serves; ``curl
    BODY``; ``init``."""
    parser = argparse.ArgumentParser(prog="python -m examples.starter", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", nargs="?", choices=["run", "curl", "init"], default="run")
    parser.add_argument("body", nargs="?", default=SAMPLE_ORDER, help="curl: the order to sign")
    parser.add_argument("--host", default="127.0.0.1", help="where to listen (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.action == "curl":
        print(signed_curl(args.body, args.port))
        return 0
    asyncio.run(init())
    if args.action == "init":
        return 0
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    announce_when_ready(f"http://{host}:{args.port}/readyz", startup_message(host, args.port))
    from consumer_kit.cli import main as consumer_kit

    return consumer_kit(["run", "examples.starter:app", "--host", args.host, "--port", str(args.port)])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
