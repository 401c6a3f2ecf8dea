"""Issue 5's benchmark: signed Standard Webhooks deliveries over loopback against uvicorn.

consumer-kit's receiver (verify + inbox on PostgreSQL + a one-row handler) against a bare Starlette
endpoint that verifies with the ``standardwebhooks`` library and inserts one row. Each is served as its
users serve it, in a process of its own on 127.0.0.1, both on uvicorn's httptools protocol and uvloop:
the receiver by ``consumer-kit run bench.webhook_servers:app --port`` (uvicorn behind consumer-kit's
bounded HTTP gate, consumer_kit/http/server.py), the bare app by ``uvicorn --factory``; the receiver
under plain ``uvicorn --factory`` too, for the record. All are driven by the same client at the same
concurrency (httpx on consumer-kit's keep-alive transport), with every request signed before the
clock starts. The receiver's handler
writes its row through ``driver="asyncpg"``, as the bare endpoint does; it runs ``staged=True`` (the
opt-in for a handler that only writes: its staged row and the key go in one statement, the target's
side), with ``single_transaction=True`` (the opt-in for handlers whose only effect is in the database)
and with the default two-transaction path, and, for the record, with ``ctx.db`` (SQLAlchemy). Rounds
alternate the sides; a ratio is the median over rounds of that round's rate over that round's bare
rate. Target: the staged receiver >= 0.9x the bare endpoint.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import socket
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx
from standardwebhooks.webhooks import Webhook

from bench.common import drive, scratch_database, verdict
from consumer_kit.coordinator.transport import KeepAliveTransport
from consumer_kit.store import create_engine, upgrade

N = int(os.environ.get("CK_BENCH_N", "4000"))
WARMUP = 300
ROUNDS = int(os.environ.get("CK_BENCH_ROUNDS", "3"))
CONCURRENCY = 32
TARGET = 0.9
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signed(secret: str, prefix: str, count: int) -> list[tuple[bytes, dict[str, str]]]:
    webhook = Webhook(secret)
    now = datetime.now(UTC)
    requests = []
    for i in range(count):
        msg_id = f"msg_{prefix}_{i}"
        body = json.dumps({"type": "invoice.paid", "data": {"invoice": f"in_{i}", "amount": 1200}})
        headers = {
            "webhook-id": msg_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": webhook.sign(msg_id, now, body),
            "content-type": "application/json",
        }
        requests.append((body.encode(), headers))
    return requests


async def _drive(port: int, requests: list[tuple[bytes, dict[str, str]]]) -> tuple[float, int]:
    """Requests per second, and how many attempts failed (transport error or not 200)."""
    failures = 0
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    transport = KeepAliveTransport(limits=limits)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", transport=transport, timeout=30) as client:

        async def post(request: tuple[bytes, dict[str, str]]) -> None:
            nonlocal failures
            try:
                answer = await client.post("/hooks", content=request[0], headers=request[1])
            except httpx.TransportError:
                # A keep-alive connection closed under the request; a provider redelivers, so do we.
                failures += 1
                answer = await client.post("/hooks", content=request[0], headers=request[1])
            failures += answer.status_code != 200

        return await drive(requests, post, CONCURRENCY), failures


async def _serve_and_drive(served: str, env: dict[str, str], label: str) -> tuple[float, int]:
    """``served``: ``uvicorn:<factory>`` or ``consumer-kit:<app>``."""
    port = _free_port()
    how, _, target = served.partition(":")
    if how == "consumer-kit":
        command = ["-m", "consumer_kit.cli", "--log-level", "WARNING", "run", target,
                   "--host", "127.0.0.1", "--port", str(port)]
    else:
        command = ["-m", "uvicorn", "--factory", target, "--host", "127.0.0.1", "--port", str(port),
                   "--no-access-log", "--log-level", "warning", "--lifespan", "on"]
    process = await asyncio.create_subprocess_exec(sys.executable, *command, cwd=ROOT, env={**os.environ, **env})
    try:
        async with httpx.AsyncClient() as probe:
            for _ in range(300):
                with contextlib.suppress(httpx.TransportError):
                    await probe.get(f"http://127.0.0.1:{port}/hooks")
                    break
                await asyncio.sleep(0.1)
        await _drive(port, _signed(env["BENCH_SECRET"], f"{label}-warm", WARMUP))
        return await _drive(port, _signed(env["BENCH_SECRET"], label, N))
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), timeout=30)


async def main() -> bool:
    """Run both sides and print requests/s and the ratios; True when the target is met."""
    async with scratch_database() as plain_url:
        engine = create_engine(plain_url.replace("postgresql://", "postgresql+asyncpg://"))
        try:
            await upgrade(engine)
        finally:
            await engine.dispose()
        conn = await asyncpg.connect(plain_url)
        try:
            await conn.execute(
                "CREATE TABLE bench_hook_rows (id serial PRIMARY KEY, event varchar(64) NOT NULL)"
            )
            await conn.execute("CREATE TABLE bench_bare_rows (id serial PRIMARY KEY, event text NOT NULL)")
        finally:
            await conn.close()
        env = {
            "BENCH_DATABASE_URL": plain_url,
            "BENCH_PLAIN_URL": plain_url,
            "BENCH_SECRET": "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode(),
            "BENCH_HMAC_KEY": secrets.token_urlsafe(32),
        }
        asyncpg_env = {**env, "BENCH_DRIVER": "asyncpg"}
        single_env = {**asyncpg_env, "BENCH_SINGLE_TRANSACTION": "1"}
        sides = {
            "bare": ("uvicorn:bench.webhook_servers:bare", env),
            "staged": ("consumer-kit:bench.webhook_servers:app", {**asyncpg_env, "BENCH_STAGED": "1"}),
            "single": ("consumer-kit:bench.webhook_servers:app", single_env),
            "double": ("consumer-kit:bench.webhook_servers:app", asyncpg_env),
            "single-db": ("consumer-kit:bench.webhook_servers:app", {**env, "BENCH_SINGLE_TRANSACTION": "1"}),
            "single-uvicorn": ("uvicorn:bench.webhook_servers:receiver", single_env),
        }
        rates: dict[str, list[float]] = {name: [] for name in sides}
        failures = dict.fromkeys(sides, 0)
        for round_ in range(ROUNDS):  # alternate the sides, so that a noisy minute does not pick one
            for name, (factory, side_env) in sides.items():
                rate, failed = await _serve_and_drive(factory, side_env, f"{name}{round_}")
                rates[name].append(rate)
                failures[name] += failed

    def ratio(name: str) -> float:
        return statistics.median(r / b for r, b in zip(rates[name], rates["bare"], strict=True))

    print(f"webhooks: {N} signed Standard Webhooks deliveries, concurrency {CONCURRENCY}, "
          f"uvicorn on 127.0.0.1, PostgreSQL; {ROUNDS} alternating rounds, medians")
    labels = {
        "bare": "bare Starlette (verify + insert)",
        "staged": "receiver, staged (row and key: 1 statement)",
        "single": "receiver, single transaction",
        "double": "receiver, two transactions",
        "single-db": "receiver, single transaction, ctx.db",
        "single-uvicorn": "receiver, single transaction, plain uvicorn",
    }
    for name, label in labels.items():
        line = f"  {label:<44} {statistics.median(rates[name]):8.0f} req/s  failed: {failures[name]}"
        if name != "bare":
            line += f"  ratio {ratio(name):.2f}"
        print(line)
    failed = sum(failures.values())
    print(f"  target >= {TARGET}x (staged, asyncpg driver: the path for a handler that writes one row): "
          f"{verdict(ratio('staged'), TARGET)}" + (f"; {failed} requests failed" if failed else ""))
    return ratio("staged") >= TARGET and not failed
