"""RabbitMQ end to end: RabbitMQSource + the PostgreSQL inbox against a hand-rolled consumer.

Every contender consumes the same number of messages from a queue of its own, with the same prefetch:

- raw:         aio-pika consume + ack, nothing else (the ceiling);
- hand-rolled: aio-pika + an asyncpg pool: ``INSERT .. ON CONFLICT DO NOTHING`` into an inbox table
               and an effect row in one transaction, ack after commit;
- one-txn:     RabbitMQSource, handler with ``single_transaction=True`` (claim, effect and completion
               in one commit);
- two-txn:     RabbitMQSource, the default path (claim committed first, effect + completion after),
               with a coordinator session per delivery from the embedded coordinator (the handler
               declares ``labels``): create or replay, run, end with the transaction.

consumer-kit's handlers write their row through ``driver="asyncpg"`` (``ctx.connection``), as the
hand-rolled consumer does. Rounds alternate the contenders; each ratio is the median over rounds of
that round's rate over that round's hand-rolled rate.

Run: ``python -m bench rabbitmq`` with PostgreSQL and RabbitMQ on 127.0.0.1 (``CK_BENCH_PG_ADMIN_URL``,
``CK_BENCH_AMQP_URL``, ``CK_BENCH_RABBITMQ_MESSAGES``, ``CK_BENCH_RABBITMQ_PREFETCH``,
``CK_BENCH_ROUNDS``, ``CK_BENCH_POOL`` override). A database and queues are created for the run and dropped afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable

import aio_pika
import asyncpg

from bench.common import PeakConnections, queue_database, verdict
from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.coordinator import EmbeddedCoordinator
from consumer_kit.sources.rabbitmq import DEFAULT_RETRY_DELAYS, RabbitMQSource

AMQP_URL = os.environ.get("CK_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
MESSAGES = int(os.environ.get("CK_BENCH_RABBITMQ_MESSAGES", "20000"))
PREFETCH = int(os.environ.get("CK_BENCH_RABBITMQ_PREFETCH", "64"))
ROUNDS = int(os.environ.get("CK_BENCH_ROUNDS", "3"))
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


async def _consume_all(queue: str, count: int, prefetch: int,
                       work: Callable[[aio_pika.abc.AbstractIncomingMessage], Awaitable[None]]) -> float:
    """Consume ``count`` messages with plain aio-pika, running ``work`` before each ack; messages/s."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        declared = await channel.declare_queue(queue, durable=True)
        done = asyncio.Event()
        seen = 0

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal seen
            await work(message)
            await message.ack()
            seen += 1
            if seen == count:
                done.set()

        started = time.perf_counter()
        await declared.consume(on_message)
        await done.wait()
        return count / (time.perf_counter() - started)


async def _raw(queue: str, count: int, prefetch: int) -> float:
    async def nothing(_: aio_pika.abc.AbstractIncomingMessage) -> None:
        return None

    return await _consume_all(queue, count, prefetch, nothing)


async def _hand_rolled(queue: str, count: int, prefetch: int, dsn: str) -> float:
    pool = await asyncpg.create_pool(dsn, min_size=DB_CONNECTIONS, max_size=DB_CONNECTIONS)

    async def inbox(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        async with pool.acquire() as conn, conn.transaction():
            inserted = await conn.execute(
                "INSERT INTO bench_inbox (message_id) VALUES ($1) ON CONFLICT DO NOTHING", message.message_id)
            if inserted == "INSERT 0 1":
                await conn.execute("INSERT INTO bench_effects (body) VALUES ($1)", message.body.decode())

    try:
        return await _consume_all(queue, count, prefetch, inbox)
    finally:
        await pool.close()


async def _framework(queue: str, count: int, prefetch: int, url: str, *, single: bool) -> float:
    settings = Settings(database_url=url, idempotency_hmac_key="bench-hmac-key-0123456789abcdef",  # type: ignore[arg-type]
                        # as many as the peer: the store's pool (every statement of a driver='asyncpg'
                        # delivery), and one kept by SQLAlchemy's (see the printed peaks)
                        db_pool_size=int(os.environ.get("CK_BENCH_POOL", str(DB_CONNECTIONS - 1))),
                        idempotency_max_receipts_per_scope=100 * count)
    app = ConsumerApp(settings)
    source = RabbitMQSource(queue=queue, namespace="bench", version=1, url=AMQP_URL, prefetch=prefetch)
    done = asyncio.Event()
    seen = 0
    # The two-transaction path opens a coordinator session per delivery (labels), as issue 4 asks.
    @app.handler(source, single_transaction=single, driver="asyncpg", labels=() if single else ("bench-worker",))
    async def handle(ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO bench_effects (body) VALUES ($1)", ctx.delivery.text())

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
        if not single:
            assert isinstance(app.coordinator, EmbeddedCoordinator)
            receipts, _oldest = await app.coordinator.store.stats()
            assert receipts >= count, f"{receipts} receipts for {count} deliveries"
    return count / elapsed


def _count_settlements(source: RabbitMQSource, after: Callable[[object], Awaitable[None]]) -> None:
    settle = source._settle  # counted where the broker is told: after the ack, as the peers are

    async def counted(*args: object) -> None:
        await settle(*args)  # type: ignore[arg-type]
        await after(None)

    source._settle = counted  # type: ignore[method-assign]


async def main() -> bool:
    """Run every contender in alternating rounds and print throughput and ratios; ``True`` when both
    targets are met."""
    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    count, prefetch = MESSAGES, PREFETCH
    results: dict[str, list[float]] = {}
    queues: list[str] = []
    peaks: dict[str, int] = {}
    async with queue_database() as dsn:
        watcher = PeakConnections(dsn)
        url = dsn.replace("postgresql://", "postgresql+asyncpg://")
        try:
            for round_ in range(ROUNDS):
                for label in ("raw", "hand-rolled", "one-txn", "two-txn"):
                    if label == "raw" and round_:
                        continue  # the ceiling, once
                    queue = f"ck-bench-{label}-{secrets.token_hex(3)}"
                    queues.append(queue)
                    await _fill(queue, count)
                    async with watcher.watch():
                        if label == "raw":
                            rate = await _raw(queue, count, prefetch)
                        elif label == "hand-rolled":
                            rate = await _hand_rolled(queue, count, prefetch, dsn)
                        else:
                            rate = await _framework(queue, count, prefetch, url, single=label == "one-txn")
                    results.setdefault(label, []).append(rate)
                    peaks[label] = max(peaks.get(label, 0), watcher.peak)
        finally:
            await _delete(queues)
    hands = results["hand-rolled"]
    hand = statistics.median(hands)

    def ratio(label: str) -> float:
        return statistics.median(rate / peer for rate, peer in zip(results[label], hands, strict=True))

    rows = [("single-transaction path", "one-txn", 0.8),
            ("two-transaction path + coordinator", "two-txn", 0.5)]
    print(f"rabbitmq end to end on PostgreSQL: {count} messages, prefetch {prefetch}, {DB_CONNECTIONS} database "
          f"connections for the peer, {ROUNDS} rounds (ratios: medians of per-round ratios)")
    ceiling = results["raw"][0]
    print(f"  {'raw aio-pika consume+ack (ceiling)':<36} {ceiling:9.0f} msg/s  {ceiling / hand:5.2f}x peer")
    print(f"  {'hand-rolled aio-pika+asyncpg (peer)':<36} {hand:9.0f} msg/s  peak connections "
          f"{peaks['hand-rolled']:2d}  (rounds: {', '.join(f'{h:.0f}' for h in hands)})")
    for label, name, target in rows:
        value = ratio(name)
        print(f"  {label:<36} {statistics.median(results[name]):9.0f} msg/s  peak connections {peaks[name]:2d}  "
              f"{value:5.2f}x peer  (target >= {target}x: {verdict(value, target)})")
    return all(ratio(name) >= target for _, name, target in rows)


async def _delete(queues: list[str]) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        for queue in queues:
            for suffix in ("", ".dlq", *(f".retry.{round(d * 1000)}ms" for d in DEFAULT_RETRY_DELAYS)):
                await channel.queue_delete(queue + suffix, if_unused=False, if_empty=False)


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main()) else 1)
