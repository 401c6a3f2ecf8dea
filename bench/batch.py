"""Issue 16's benchmark: batched deliveries end to end through RabbitMQ, and the inbox at scale.

Throughput, every contender draining the same number of messages from a queue of its own:

- per-message peer: aio-pika + asyncpg, one transaction a message (``bench.rabbitmq``'s peer);
- batched peer:     aio-pika + asyncpg, what a careful team writes for batches: up to 64 messages (or
                    what came within 5 ms), one ``INSERT .. SELECT unnest() .. ON CONFLICT DO NOTHING
                    RETURNING`` into the inbox, the effect rows of the new ones, one commit, then one
                    ``basic.ack(multiple=True)``; one batch at a time (a multiple ack must not cover a
                    batch still running);
- the same, a statement each: its effect rows one INSERT a message in the batch's transaction, as a
                    per-delivery handler writes them (printed for comparison, no target);
- consumer-kit:     RabbitMQSource + ``single_transaction=True, batch=Batch(64, 5)``, the handler
                    staging its row with ``ctx.stage`` (one ``executemany`` a batch: judged against both
                    peers), and the same handler writing its row through ``ctx.connection.execute`` (a
                    statement a delivery: compared with the peer writing a statement each).

Scale: the latency of a claim (a new key) and of a duplicate's lookup with the inbox at 10k rows and
then at 1M (bulk-loaded), through the same pool, so that plans chosen on the small table are the ones
measured on the large one.

Run: ``python -m bench batch`` (``CK_BENCH_BATCH_MESSAGES``, ``CK_BENCH_ROUNDS``, ``CK_BENCH_SCALE_ROWS``,
``CK_BENCH_BATCH_CONCURRENT``: ``Batch.max_concurrent``, 2 by default; 3 and 4 measured no faster here).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import statistics
import time
from datetime import UTC, datetime

import aio_pika
import asyncpg
from sqlalchemy import text

from bench.common import queue_database, verdict
from bench.rabbitmq import AMQP_URL, DB_CONNECTIONS, _delete, _fill, _hand_rolled
from consumer_kit import Batch, ConsumerApp, Context, Settings
from consumer_kit.keys import KeyDigester
from consumer_kit.sources.rabbitmq import RabbitMQSource
from consumer_kit.store import Database, Inbox, create_engine

MESSAGES = int(os.environ.get("CK_BENCH_BATCH_MESSAGES", "20000"))
ROUNDS = int(os.environ.get("CK_BENCH_ROUNDS", "3"))
SCALE_ROWS = int(os.environ.get("CK_BENCH_SCALE_ROWS", "1000000"))
BATCH, WAIT = 64, 0.005
CONCURRENT = int(os.environ.get("CK_BENCH_BATCH_CONCURRENT", "2"))  # Batch.max_concurrent (its default: 2)
HMAC_KEY = "bench-hmac-key-0123456789abcdef"


async def _batched_peer(queue: str, count: int, dsn: str, *, statement_each: bool = False) -> float:
    """The batched peer; ``statement_each``: its effect rows written one statement a message, as a
    per-delivery handler writes them (consumer-kit's handler stays a function of one delivery)."""
    pool = await asyncpg.create_pool(dsn, min_size=4, max_size=DB_CONNECTIONS)
    assert pool is not None
    connection = await aio_pika.connect(AMQP_URL)
    done = asyncio.Event()
    seen = 0
    pending: list[aio_pika.abc.AbstractIncomingMessage] = []
    flusher: asyncio.TimerHandle | None = None
    running: set[asyncio.Task[None]] = set()

    one_at_a_time = asyncio.Lock()

    async def commit(messages: list[aio_pika.abc.AbstractIncomingMessage]) -> None:
        async with one_at_a_time:
            await commit_alone(messages)

    async def commit_alone(messages: list[aio_pika.abc.AbstractIncomingMessage]) -> None:
        nonlocal seen
        ids = [m.message_id or "" for m in messages]
        async with pool.acquire() as conn, conn.transaction():
            new = {r[0] for r in await conn.fetch(
                "INSERT INTO bench_inbox (message_id) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING"
                " RETURNING message_id", ids)}
            bodies = [m.body.decode() for m in messages if m.message_id in new]
            if statement_each:
                for body in bodies:
                    await conn.execute("INSERT INTO bench_effects (body) VALUES ($1)", body)
            else:
                await conn.execute("INSERT INTO bench_effects (body) SELECT unnest($1::text[])", bodies)
        await max(messages, key=lambda m: m.delivery_tag or 0).ack(multiple=True)
        seen += len(messages)
        if seen >= count:
            done.set()

    def flush() -> None:
        nonlocal pending, flusher
        if flusher is not None:
            flusher.cancel()
            flusher = None
        if pending:
            batch, pending = pending, []
            task = asyncio.ensure_future(commit(batch))
            running.add(task)
            task.add_done_callback(running.discard)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal flusher
        pending.append(message)
        if len(pending) >= BATCH:
            flush()
        elif flusher is None:
            flusher = asyncio.get_running_loop().call_later(WAIT, flush)

    try:
        async with connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=4 * BATCH)
            declared = await channel.declare_queue(queue, durable=True)
            started = time.perf_counter()
            await declared.consume(on_message, no_ack=False)
            await done.wait()
            return count / (time.perf_counter() - started)
    finally:
        await pool.close()


async def _framework(queue: str, count: int, url: str, *, staged: bool = True) -> float:
    settings = Settings(database_url=url, idempotency_hmac_key=HMAC_KEY,  # type: ignore[arg-type]
                        db_pool_size=int(os.environ.get("CK_BENCH_POOL", str(DB_CONNECTIONS - 1))))
    app = ConsumerApp(settings)
    source = RabbitMQSource(queue=queue, namespace="bench", version=1, url=AMQP_URL, prefetch=4 * BATCH)
    done = asyncio.Event()
    seen = 0

    @app.handler(source, single_transaction=True, driver="asyncpg",
                 batch=Batch(max_size=BATCH, max_wait_ms=5, max_concurrent=CONCURRENT))
    async def handle(ctx: Context) -> None:
        nonlocal seen
        if staged:
            ctx.stage("INSERT INTO bench_effects (body) VALUES ($1)", ctx.delivery.text())
        else:
            await ctx.connection.execute("INSERT INTO bench_effects (body) VALUES ($1)", ctx.delivery.text())
        seen += 1
        if seen >= count:
            done.set()

    started = time.perf_counter()
    async with app.running():
        await done.wait()
        elapsed = time.perf_counter() - started
    return count / elapsed


async def _latencies(inbox: Inbox, database: Database, digester: KeyDigester, keys: list[str],
                     *, claim: bool) -> tuple[float, float]:
    """p50 and p99, in ms, of claiming ``keys`` (new) or looking them up (existing)."""
    samples = []
    async with database.connect() as ex:
        for key in keys:
            digests = digester.candidates(key)
            started = time.perf_counter()
            if claim:
                found = await inbox.claim(ex, "scale", digests, "fp", namespace="bench", version=1)
                assert found.acquired
            else:
                assert await inbox.lookup(ex, "scale", digests) is not None
            samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


async def _scale(url: str) -> dict[str, tuple[float, float]]:
    engine = create_engine(url, pool_size=2)
    database = Database(engine)
    inbox = Inbox(database, lease_seconds=30, retention_seconds=604_800)
    digester = KeyDigester(HMAC_KEY.encode())
    measured: dict[str, tuple[float, float]] = {}
    loaded = 0

    async def load(rows: int) -> None:
        nonlocal loaded
        async with engine.begin() as conn:
            await conn.execute(text(
                "INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts,"
                " outcome, created_at, updated_at, expires_at) SELECT 'scale', md5(i::text) || md5((-i)::text),"
                " 'bench', 1, 'fp', 'completed', 1, 'processed', now(), now(), now() + interval '7 days'"
                " FROM generate_series(CAST(:first AS integer), CAST(:last AS integer)) i"),
                {"first": loaded + 1, "last": rows})
        loaded = rows

    try:
        await load(10_000)
        async with engine.begin() as conn:
            await conn.execute(text("ANALYZE inbox"))  # a young deployment's statistics
        for size in (10_000, SCALE_ROWS):
            await load(size)
            probe = [f"scale:v1:{size}-{i}" for i in range(2000)]
            measured[f"claim at {size}"] = await _latencies(inbox, database, digester, probe, claim=True)
            measured[f"duplicate at {size}"] = await _latencies(inbox, database, digester, probe, claim=False)
    finally:
        await database.close()
        await engine.dispose()
    return measured


async def main() -> bool:
    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    results: dict[str, list[float]] = {}
    queues: list[str] = []
    async with queue_database() as dsn:
        url = dsn.replace("postgresql://", "postgresql+asyncpg://")
        try:
            for _ in range(ROUNDS):
                for label in ("per-message peer", "batched peer", "batched peer, a statement each",
                              "consumer-kit batched", "consumer-kit batched, a statement each"):
                    queue = f"ck-bench-batch-{secrets.token_hex(3)}"
                    queues.append(queue)
                    await _fill(queue, MESSAGES)
                    if label == "per-message peer":
                        rate = await _hand_rolled(queue, MESSAGES, 64, dsn)
                    elif label.startswith("batched peer"):
                        rate = await _batched_peer(queue, MESSAGES, dsn, statement_each=label != "batched peer")
                    else:
                        rate = await _framework(queue, MESSAGES, url, staged=label == "consumer-kit batched")
                    results.setdefault(label, []).append(rate)
        finally:
            await _delete(queues)
        scale = await _scale(url)

    def ratio(label: str, peer: str) -> float:
        return statistics.median(r / p for r, p in zip(results[label], results[peer], strict=True))

    print(f"batch end to end through RabbitMQ on PostgreSQL: {MESSAGES} messages, batches of {BATCH} "
          f"(waiting at most {WAIT * 1000:.0f} ms), {ROUNDS} rounds (ratios: medians of per-round ratios)")
    for label, rates in results.items():
        print(f"  {label:<40} {statistics.median(rates):9.0f} msg/s  (rounds: {', '.join(f'{r:.0f}' for r in rates)})")
    per_message = ratio("consumer-kit batched", "per-message peer")
    batched = ratio("consumer-kit batched", "batched peer")
    print(f"  consumer-kit batched: {per_message:5.2f}x the per-message peer (target >= 2x: "
          f"{verdict(per_message, 2.0)}), {batched:5.2f}x the batched peer (target >= 0.8x: {verdict(batched, 0.8)})")
    each = ratio("consumer-kit batched, a statement each", "batched peer, a statement each")
    print(f"  consumer-kit batched, a statement each: {each:5.2f}x the batched peer writing a statement a message"
          " (no target)")
    print(f"inbox at scale ({datetime.now(UTC):%Y-%m-%d}): p50 / p99 in ms, 2000 operations each")
    for label, (p50, p99) in scale.items():
        print(f"  {label:<32} {p50:7.3f} / {p99:7.3f}")
    flat = all(scale[f"{op} at {SCALE_ROWS}"][1] <= 1.5 * scale[f"{op} at 10000"][1] for op in ("claim", "duplicate"))
    print(f"  p99 at {SCALE_ROWS} within 1.5x of p99 at 10000: {'ok' if flat else 'NOT FLAT'}")
    return per_message >= 2.0 and batched >= 0.8 and flat


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main()) else 1)
