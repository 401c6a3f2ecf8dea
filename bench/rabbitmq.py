"""RabbitMQ end to end: RabbitMQSource + the PostgreSQL inbox against a hand-rolled consumer.

Every contender consumes the same number of messages from a queue of its own, with the same prefetch:

- raw:         aio-pika consume + ack, nothing else (the ceiling);
- hand-rolled: aio-pika + an asyncpg pool: ``INSERT .. ON CONFLICT DO NOTHING`` into an inbox table
               and an effect row in one transaction, ack after commit;
- one-txn:     RabbitMQSource, handler with ``single_transaction=True`` (claim, effect and completion
               in one commit);
- two-txn:     RabbitMQSource, the default path (claim committed first, effect + completion after).

Run: ``python -m bench rabbitmq`` with PostgreSQL and RabbitMQ on 127.0.0.1 (``CK_BENCH_PG_ADMIN_URL``,
``CK_BENCH_AMQP_URL``, ``CK_BENCH_RABBITMQ_MESSAGES``, ``CK_BENCH_RABBITMQ_PREFETCH`` override). A
database and queues are created for the run and dropped afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable

import aio_pika
import asyncpg
from sqlalchemy import text

from bench.common import scratch_database, verdict
from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.store import create_engine, upgrade
from sources.rabbitmq import DEFAULT_RETRY_DELAYS, RabbitMQSource

AMQP_URL = os.environ.get("CK_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
MESSAGES = int(os.environ.get("CK_BENCH_RABBITMQ_MESSAGES", "20000"))
PREFETCH = int(os.environ.get("CK_BENCH_RABBITMQ_PREFETCH", "64"))
DB_CONNECTIONS = 20  # at most, for every contender (the server is shared)


async def _fill(queue: str, count: int) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True)
        for start in range(0, count, 1000):
            await asyncio.gather(*(
                channel.default_exchange.publish(
                    aio_pika.Message(f"order-{i}".encode(), message_id=f"{queue}-{i}",
                                     delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=queue)
                for i in range(start, min(count, start + 1000))))


async def _raw(queue: str, count: int, prefetch: int) -> float:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        declared = await channel.declare_queue(queue, durable=True)
        done = asyncio.Event()
        seen = 0

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal seen
            await message.ack()
            seen += 1
            if seen == count:
                done.set()

        started = time.perf_counter()
        await declared.consume(on_message)
        await done.wait()
        return count / (time.perf_counter() - started)


async def _hand_rolled(queue: str, count: int, prefetch: int, dsn: str) -> float:
    pool = await asyncpg.create_pool(dsn, min_size=DB_CONNECTIONS, max_size=DB_CONNECTIONS)
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        declared = await channel.declare_queue(queue, durable=True)
        done = asyncio.Event()
        seen = 0

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal seen
            async with pool.acquire() as conn, conn.transaction():
                inserted = await conn.execute(
                    "INSERT INTO bench_inbox (message_id) VALUES ($1) ON CONFLICT DO NOTHING",
                    message.message_id)
                if inserted == "INSERT 0 1":
                    await conn.execute("INSERT INTO bench_effects (body) VALUES ($1)", message.body.decode())
            await message.ack()
            seen += 1
            if seen == count:
                done.set()

        started = time.perf_counter()
        await declared.consume(on_message)
        await done.wait()
        return count / (time.perf_counter() - started)
    finally:
        await connection.close()
        await pool.close()


async def _framework(queue: str, count: int, prefetch: int, url: str, *, single: bool) -> float:
    settings = Settings(database_url=url, idempotency_hmac_key="bench-hmac-key-0123456789abcdef",  # type: ignore[arg-type]
                        db_pool_size=DB_CONNECTIONS // 2)  # pool + overflow = DB_CONNECTIONS
    app = ConsumerApp(settings)
    source = RabbitMQSource(queue=queue, namespace="bench", version=1, url=AMQP_URL, prefetch=prefetch)
    done = asyncio.Event()
    seen = 0

    @app.handler(source, single_transaction=single)
    async def handle(ctx: Context) -> None:
        await ctx.db.execute(text("INSERT INTO bench_effects (body) VALUES (:body)"),
                             {"body": ctx.delivery.text()})

    async def after(_: object) -> None:
        nonlocal seen
        seen += 1
        if seen == count:
            done.set()

    started = time.perf_counter()
    async with app.running():
        _count_settlements(source, after)
        await done.wait()
        elapsed = time.perf_counter() - started
    return count / elapsed


def _count_settlements(source: RabbitMQSource, after: Callable[[object], Awaitable[None]]) -> None:
    settle = source._settle  # counted where the broker is told: after the ack, as the peers are

    async def counted(*args: object) -> None:
        await settle(*args)  # type: ignore[arg-type]
        await after(None)

    source._settle = counted  # type: ignore[method-assign]


async def main() -> bool:
    """Run every contender once and print throughput and ratios; ``True`` when both targets are met."""
    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    count, prefetch = MESSAGES, PREFETCH
    results: dict[str, float] = {}
    queues: list[str] = []
    async with scratch_database() as dsn:
        url = dsn.replace("postgresql://", "postgresql+asyncpg://")
        engine = create_engine(url)
        await upgrade(engine)
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE bench_inbox (message_id text PRIMARY KEY)"))
            await conn.execute(text("CREATE TABLE bench_effects (id bigserial PRIMARY KEY, body text NOT NULL)"))
        await engine.dispose()
        try:
            for label in ("raw", "hand-rolled", "one-txn", "two-txn"):
                queue = f"ck-bench-{label}-{secrets.token_hex(3)}"
                queues.append(queue)
                await _fill(queue, count)
                if label == "raw":
                    results[label] = await _raw(queue, count, prefetch)
                elif label == "hand-rolled":
                    results[label] = await _hand_rolled(queue, count, prefetch, dsn)
                else:
                    results[label] = await _framework(queue, count, prefetch, url, single=label == "one-txn")
        finally:
            await _delete(queues)
    hand = results["hand-rolled"]
    rows = [("single-transaction path", results["one-txn"], 0.8),
            ("two-transaction path", results["two-txn"], 0.5)]
    print(f"rabbitmq end to end on PostgreSQL: {count} messages, prefetch {prefetch}, "
          f"at most {DB_CONNECTIONS} database connections each")
    ceiling = results["raw"]
    print(f"  {'raw aio-pika consume+ack (ceiling)':<36} {ceiling:9.0f} msg/s  {ceiling / hand:5.2f}x peer")
    print(f"  {'hand-rolled aio-pika+asyncpg (peer)':<36} {hand:9.0f} msg/s")
    for label, rate, target in rows:
        ratio = rate / hand
        print(f"  {label:<36} {rate:9.0f} msg/s  {ratio:5.2f}x peer  (target >= {target}x: {verdict(ratio, target)})")
    return all(rate / hand >= target for _, rate, target in rows)


async def _delete(queues: list[str]) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        for queue in queues:
            for suffix in ("", ".dlq", *(f".retry.{round(d * 1000)}ms" for d in DEFAULT_RETRY_DELAYS)):
                await channel.queue_delete(queue + suffix, if_unused=False, if_empty=False)


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main()) else 1)
