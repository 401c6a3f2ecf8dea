"""``python -m bench console``: how long the operator's console takes to answer each of its pages with
100,000 parked deliveries on PostgreSQL (and 100,000 inbox rows, some of them leased), against the
target of 200 ms a page (p99).

The deliveries fall in 12 groups (reason x source), one of them holding 60% of them, with bodies of
~300 bytes. Each page is asked for over and over by a signed-in operator through the console's ASGI app
(httpx's ASGI transport: the time is the app's, from request to the last byte of the page, database
round trips and template included; no network): the overview, the groups, the largest group's first
page and a page 50,000 rows deep (keyset: it should cost what the first does), and one delivery.
"""

from __future__ import annotations

import json
import re
import statistics
import time

import httpx

from bench.common import scratch_database

PARKED = 100_000
ROUNDS = 60
WARMUP = 5
TARGET_MS = 200.0
TOKEN = "bench-operator-token-0123456789"

_SEED = """
INSERT INTO dead_letters (id, consumer, source, namespace, version, key_digest, reason, detail, body, headers,
                          attempts, created_at, delivery_id, attributes, fingerprint, replays, traceback)
SELECT md5('letter' || i), 'orders',
       CASE WHEN i % 10 < 6 THEN 'rabbitmq:orders' ELSE 'rabbitmq:orders-' || (i % 2) END,
       'orders', 1, encode(sha256(('key' || i)::bytea), 'hex'),
       CASE WHEN i % 10 < 6 THEN 'retries_exhausted' ELSE (ARRAY['not_ready', 'conflict', 'invalid_amount',
            'ledger_closed', 'missing_stable_id', 'inactive'])[1 + i % 6] END,
       'TerminalError: the ledger is closed for this period',
       convert_to(repeat('{"order": "' || i || '", "lines": [1, 2, 3]} ', 6), 'UTF8'),
       '{"content-type": "application/json"}'::json, 3, now() - (i || ' seconds')::interval,
       'm-' || i, NULL, md5('fp' || i), 0, NULL
FROM generate_series(1, $1) AS i
"""
_INBOX = """
INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, locked_until, lease_token, attempts,
                   outcome, result, last_error, created_at, updated_at, expires_at)
SELECT 'orders', encode(sha256(('inbox' || i)::bytea), 'hex'), 'orders', 1, md5('fp' || i),
       CASE WHEN i % 1000 = 0 THEN 'started' ELSE 'completed' END,
       CASE WHEN i % 1000 = 0 THEN now() + interval '30 seconds' END,
       CASE WHEN i % 1000 = 0 THEN md5('lease' || i) END, 1, 'processed', NULL, NULL, now(), now(),
       now() + interval '7 days'
FROM generate_series(1, $1) AS i
"""


async def seed(dsn: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(_SEED, PARKED)
        await conn.execute(_INBOX, PARKED)
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


async def deep_cursor(dsn: str) -> str:
    """The cursor of the page 50,000 rows into the largest group."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT created_at, id FROM dead_letters WHERE reason = 'retries_exhausted' AND source = 'rabbitmq:orders'"
            " ORDER BY created_at DESC, id DESC OFFSET 50000 LIMIT 1")
    finally:
        await conn.close()
    assert row is not None
    return f"{row['created_at'].isoformat()}_{row['id']}"


async def timed(client: httpx.AsyncClient, path: str) -> list[float]:
    """Milliseconds of each round of ``path`` (after the warm-up rounds)."""
    times = []
    for round_ in range(WARMUP + ROUNDS):
        start = time.perf_counter()
        answer = await client.get(path)
        elapsed = (time.perf_counter() - start) * 1000
        assert answer.status_code == 200, (path, answer.status_code)
        if round_ >= WARMUP:
            times.append(elapsed)
    return times


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def main() -> bool:
    from consumer_kit import ConsumerApp, Settings
    from consumer_kit.console import Console
    from consumer_kit.store import create_engine, upgrade
    from consumer_kit.testing import InMemorySource

    async with scratch_database() as dsn:
        url = dsn.replace("postgresql://", "postgresql+asyncpg://")
        engine = create_engine(url)
        try:
            await upgrade(engine)
        finally:
            await engine.dispose()
        await seed(dsn)
        cursor = await deep_cursor(dsn)
        settings = Settings(database_url=url, idempotency_hmac_key="bench-hmac-key-0123456789abcdef",
                            console_tokens=json.dumps({TOKEN: "bench:operator"}))
        app = ConsumerApp(settings)
        app.handler(InMemorySource(namespace="orders", version=1), name="orders")(_noop)
        async with app.running(sources=()):
            console = Console(settings, app=app)
            transport = httpx.ASGITransport(app=console.asgi())
            async with httpx.AsyncClient(transport=transport, base_url="http://console") as client:
                form = await client.get("/signin")
                csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
                assert csrf is not None
                await client.post("/signin", data={"csrf": csrf.group(1), "token": TOKEN})
                group = "/parked/group?reason=retries_exhausted&source=rabbitmq:orders"
                letter = re.search(r'href="/parked/([0-9a-f]{32})"', (await client.get(group)).text)
                assert letter is not None
                pages = {"overview": "/", "groups": "/parked", "group, first page": group,
                         "group, 50,000 rows deep": f"{group}&after={cursor}",
                         "one delivery": f"/parked/{letter.group(1)}"}
                results = {name: await timed(client, path) for name, path in pages.items()}
            await console.close()
    print(f"console pages with {PARKED:,} parked deliveries on PostgreSQL, {ROUNDS} rounds each "
          f"(the app's time per page, ASGI, no network):")
    ok = True
    for name, times in results.items():
        worst = p99(times)
        met = worst <= TARGET_MS
        ok = ok and met
        print(f"  {name:26} p50 {statistics.median(times):6.1f} ms   p99 {worst:6.1f} ms   "
              f"(target p99 <= {TARGET_MS:.0f} ms: {'ok' if met else 'ABOVE TARGET'})")
    return ok


async def _noop(ctx: object) -> None:
    return None
