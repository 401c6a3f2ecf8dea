"""Issue 3's benchmark: the coordinator's idempotent creation, on PostgreSQL and over HTTP.

1. ``EmbeddedCoordinator.create_session`` with an explicit key against its peer, a bare asyncpg
   ``INSERT`` of an equivalent row (a receipt-shaped row: digest, fingerprint, response, expiry), at the
   same concurrency, on the same server, in the same run. Target: at most 2x the peer's time per
   creation (throughput ratio >= 0.5).
2. ``HttpCoordinator`` against ``consumer-kit coordinator serve`` (a separate process, uvicorn on
   127.0.0.1) at concurrency 16, on the same database. Targets: >= 500 sessions/s, and >= 0.6x the
   embedded coordinator's creations (the median of the rounds' ratios: what the HTTP hop costs).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import signal
import statistics
import sys
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx

from bench.common import drive, scratch_database, verdict
from consumer_kit import Settings
from consumer_kit.coordinator import EmbeddedCoordinator, HttpCoordinator, SessionRequest
from consumer_kit.store import create_engine, upgrade
from consumer_kit.testing.server import free_port

N = int(os.environ.get("CK_BENCH_COORDINATOR_N", "5000"))
ROUNDS = int(os.environ.get("CK_BENCH_ROUNDS", "3"))
CONCURRENCY = 16
HTTP_TARGET = 0.6
HMAC_KEY = "bench-hmac-key-0123456789abcdef"
REQUEST = SessionRequest(labels=("research-agent",), task="Prepare the market risk report",
                         metadata={"ticket": "T-1"}, scopes=("reports:read",))


async def bare_insert(url: str, keys: list[str], *, table: str) -> float:
    pool = await asyncpg.create_pool(url, min_size=CONCURRENCY, max_size=CONCURRENCY)
    assert pool is not None
    await pool.execute(f"CREATE TABLE {table} (tenant text, application text, operation text, "
                       "key_digest text, fingerprint text NOT NULL, resource_id text NOT NULL, "
                       "response json NOT NULL, created_at timestamptz NOT NULL, expires_at timestamptz NOT NULL, "
                       "PRIMARY KEY (tenant, application, operation, key_digest))")
    now = datetime.now(UTC)

    async def insert(key: str) -> None:
        digest = hashlib.sha256(key.encode()).hexdigest()
        resource_id = secrets.token_hex(16)
        await pool.execute(
            f"INSERT INTO {table} VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            "bench", "bench", "session", digest, digest, resource_id,
            json.dumps({"id": resource_id, "status": "active", "expires_at": now.isoformat()}),
            now, now + timedelta(days=7))

    try:
        return await drive(keys, insert, CONCURRENCY)
    finally:
        await pool.close()


async def embedded(url: str, keys: list[str]) -> tuple[float, float]:
    settings = Settings(database_url=url, idempotency_hmac_key=HMAC_KEY,  # type: ignore[arg-type]
                        idempotency_max_receipts_per_scope=10 * N * ROUNDS)
    engine = create_engine(settings.database_url, pool_size=CONCURRENCY)
    coordinator = EmbeddedCoordinator(engine, settings, tenant="bench", application="embedded")

    async def create(key: str) -> None:
        await coordinator.create_session(REQUEST, idempotency_key=key)

    try:
        created = await drive(keys, create, CONCURRENCY)
        replayed = await drive(keys, create, CONCURRENCY)
        return created, replayed
    finally:
        await coordinator.close()
        await engine.dispose()


async def served(url: str, keys: list[str]) -> float:
    port = free_port()
    env = {**os.environ, "DATABASE_URL": url, "IDEMPOTENCY_HMAC_KEY": HMAC_KEY,
           "COORDINATOR_TOKENS": json.dumps({"bench-token": "bench/http"}),
           "IDEMPOTENCY_MAX_RECEIPTS_PER_SCOPE": str(10 * N * ROUNDS), "DB_POOL_SIZE": str(CONCURRENCY)}
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumer_kit.cli", "--log-level", "WARNING", "coordinator", "serve",
        "--port", str(port), env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=CONCURRENCY)) as http:
            for _ in range(300):
                try:
                    if (await http.get(f"{base}/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        # The coordinator's own client, as an application gets it (its pool is not httpcore's).
        coordinator = HttpCoordinator(base, token="bench-token", max_connections=CONCURRENCY)
        try:
            await drive(keys[:200], lambda k: coordinator.create_session(REQUEST), CONCURRENCY)  # warm up
            return await drive(keys, lambda k: coordinator.create_session(REQUEST, idempotency_key=k),
                               CONCURRENCY)
        finally:
            await coordinator.aclose()
    finally:
        server.send_signal(signal.SIGTERM)
        await asyncio.wait_for(server.wait(), timeout=30)


async def main() -> bool:
    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    peers: list[float] = []
    created: list[float] = []
    replayed: list[float] = []
    http_rates: list[float] = []
    async with scratch_database() as url:
        async_url = url.replace("postgresql://", "postgresql+asyncpg://")
        engine = create_engine(async_url)
        await upgrade(engine)
        await engine.dispose()
        # Alternating rounds, fresh keys each; a ratio is the median of the per-round ratios (single
        # runs on a small shared host swing by 20%).
        for round_ in range(ROUNDS):
            keys = [f"session:bench:v1:r{round_}-m-{i:08d}" for i in range(N)]
            peers.append(await bare_insert(url, keys, table=f"bare_receipts_{round_}"))
            made, again = await embedded(async_url, keys)
            created.append(made)
            replayed.append(again)
            http_rates.append(await served(url, [f"http-{k}" for k in keys]))
    ratio = statistics.median(c / p for c, p in zip(created, peers, strict=True))
    replay_ratio = statistics.median(r / p for r, p in zip(replayed, peers, strict=True))
    http_rate = statistics.median(http_rates)
    http_ratio = statistics.median(h / c for h, c in zip(http_rates, created, strict=True))
    print(f"coordinator on PostgreSQL: {N} creations, concurrency {CONCURRENCY}, {ROUNDS} rounds (medians)")
    print(f"  {'bare asyncpg INSERT of a receipt row (peer)':<44} {statistics.median(peers):9.0f} rows/s")
    print(f"  {'EmbeddedCoordinator.create_session':<44} {statistics.median(created):9.0f} sessions/s  "
          f"{ratio:5.2f}x peer  (overhead {1 / ratio:4.2f}x, target <= 2x: {verdict(ratio, 0.5)})")
    print(f"  {'EmbeddedCoordinator replays':<44} {statistics.median(replayed):9.0f} sessions/s  "
          f"{replay_ratio:5.2f}x peer")
    print(f"  {'HttpCoordinator -> served coordinator':<44} {http_rate:9.0f} sessions/s  "
          f"(rounds: {', '.join(f'{r:.0f}' for r in http_rates)}; target >= 500/s: {verdict(http_rate / 500, 1.0)})")
    print(f"  {'HttpCoordinator / EmbeddedCoordinator':<44} {http_ratio:9.2f}x       "
          f"(target >= {HTTP_TARGET}x: {verdict(http_ratio, HTTP_TARGET)})")
    return ratio >= 0.5 and http_rate >= 500 and http_ratio >= HTTP_TARGET
