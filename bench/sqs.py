"""SQS: SQSSource (alone, and with the PostgreSQL inbox) against hand-rolled boto3 consumers, on one
moto server.

moto is the bottleneck (every receive and delete scans the queue), so every contender drains the same
number of messages from a queue of its own, filled the same way, on the same server:

- raw:         ``POLLERS`` loops, each ``ReceiveMessage`` (10, long poll) then ``DeleteMessageBatch``,
               on a thread pool: the peer of
- alone:       SQSSource whose dispatch acknowledges at once: the source's own receiving, batching and
               settling, without the pipeline;
- hand-rolled: as raw, plus one asyncpg transaction per receive that inserts each message id into an
               inbox table ``ON CONFLICT DO NOTHING`` and an effect row for each new one: the peer of
- one-txn:     SQSSource, handler with ``single_transaction=True`` and ``driver="asyncpg"`` (claim,
               effect and completion in one commit), and
- two-txn:     SQSSource, the default path (claim committed first, effect + completion after).

Besides throughput, each contender's CPU per message is printed (this process's CPU time, its threads
included; moto runs in a process of its own). Both are measured from the end of a contender's set-up
(boto3 client, pools, the app's start) to its last settled message. Rounds alternate the order; each
ratio is the median over rounds of that round's figure over that round's peer's.

Run: ``python -m bench sqs`` with PostgreSQL on 127.0.0.1 (``CK_BENCH_PG_ADMIN_URL``,
``CK_BENCH_SQS_MESSAGES``, ``CK_BENCH_ROUNDS`` override). A moto server and a database are started for
the run and removed afterwards.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import asyncpg
import boto3

from bench.common import queue_database, verdict
from consumer_kit import ConsumerApp, Context, Delivery, Outcome, Result, Settings, Settlement
from consumer_kit.sources.sqs import SQSSource
from consumer_kit.sources.sqs.source import SETTLEMENTS
from consumer_kit.testing.moto import moto_server

MESSAGES = int(os.environ.get("CK_BENCH_SQS_MESSAGES", "500"))
ROUNDS = int(os.environ.get("CK_BENCH_ROUNDS", "3"))
POLLERS = 2
IN_FLIGHT = 32
DB_CONNECTIONS = 10
REGION = "us-east-1"
TARGET = 0.9


def _fill(client: Any, label: str, count: int) -> tuple[str, str]:
    dlq = client.create_queue(QueueName=f"ck-bench-{label}-{time.time_ns()}-dlq")["QueueUrl"]
    url = client.create_queue(QueueName=dlq[:-4].rsplit("/", 1)[1])["QueueUrl"]
    for start in range(0, count, 10):
        client.send_message_batch(QueueUrl=url, Entries=[
            {"Id": str(i), "MessageBody": f"order-{start + i}"} for i in range(min(10, count - start))])
    return url, dlq


class Clock:
    """Wall and CPU time (this process, all threads) from :meth:`start` to :meth:`stop`: the drain
    only, without each contender's set-up (boto3 client, pools, the app's start)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.stopped = False

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


async def _hand_rolled(endpoint: str, url: str, count: int, dsn: str | None, clock: Clock) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=DB_CONNECTIONS, max_size=DB_CONNECTIONS) if dsn else None
    threads = ThreadPoolExecutor(max_workers=POLLERS + 1)
    loop = asyncio.get_running_loop()
    # A session of its own, as each SQSSource has: the default one is already warm from filling.
    client = await loop.run_in_executor(threads, lambda: boto3.session.Session().client(
        "sqs", endpoint_url=endpoint, region_name=REGION))
    done = 0

    async def consume() -> None:
        nonlocal done
        while done < count:
            messages = (await loop.run_in_executor(threads, lambda: client.receive_message(
                QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1, MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["ApproximateReceiveCount"]))).get("Messages", [])
            if not messages:
                continue
            if pool is not None:  # without one: receive and delete only, the peer of the source alone
                await _record(pool, messages)
            entries = [{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)]
            await loop.run_in_executor(threads, functools.partial(client.delete_message_batch, QueueUrl=url,
                                                                  Entries=entries))
            done += len(messages)
            if done >= count:
                clock.stop()

    clock.start()
    try:
        await asyncio.gather(*(consume() for _ in range(POLLERS)))
    finally:
        if pool is not None:
            await pool.close()
        threads.shutdown()


async def _record(pool: asyncpg.Pool, messages: list[dict[str, Any]]) -> None:
    async with pool.acquire() as conn, conn.transaction():
        for message in messages:
            inserted = await conn.execute("INSERT INTO bench_inbox (message_id) VALUES ($1) ON CONFLICT DO NOTHING",
                                          message["MessageId"])
            if inserted == "INSERT 0 1":
                await conn.execute("INSERT INTO bench_effects (body) VALUES ($1)", message["Body"])


async def _source_alone(endpoint: str, url: str, dlq: str, count: int, clock: Clock) -> None:
    """SQSSource with a dispatch that acknowledges at once: receiving, batching and settling only."""
    settings = Settings(sqs_endpoint_url=endpoint, sqs_region=REGION, sqs_wait_time_seconds=1)
    source = SQSSource(queue_url=url, namespace="bench", version=1, dead_letter_queue_url=dlq,
                       pollers=POLLERS, max_in_flight=IN_FLIGHT)

    async def ack(delivery: Delivery) -> Result:
        return Result(Outcome.PROCESSED, Settlement.ACK)

    await source.start(ack, settings)
    clock.start()  # the pollers are created, and have not run yet
    try:
        await _settlements(source, count, clock)
    finally:
        await source.stop()
        await source.close()


async def _framework(endpoint: str, url: str, dlq: str, count: int, db_url: str, clock: Clock, *,
                     single: bool) -> None:
    settings = Settings(database_url=db_url, idempotency_hmac_key="bench-hmac-key-0123456789abcdef",  # type: ignore[arg-type]
                        db_pool_size=DB_CONNECTIONS, sqs_endpoint_url=endpoint, sqs_region=REGION,
                        sqs_wait_time_seconds=1)
    app = ConsumerApp(settings)
    source = SQSSource(queue_url=url, namespace="bench", version=1, dead_letter_queue_url=dlq,
                       pollers=POLLERS, max_in_flight=IN_FLIGHT)

    @app.handler(source, single_transaction=single, driver="asyncpg")
    async def handle(ctx: Context) -> None:
        await ctx.connection.execute("INSERT INTO bench_effects (body) VALUES ($1)", ctx.delivery.text())

    async with app.running():
        clock.start()  # the source's pollers are created, and have not run yet
        await _settlements(source, count, clock)


async def _settlements(source: SQSSource, count: int, clock: Clock) -> None:
    """Return (and stop ``clock``) once ``source`` has settled ``count`` messages, counted when SQS
    confirmed the delete, as the peers count: the source's ``consumer_kit_sqs_settlements_total``,
    read every 5 ms from that metric alone (not the whole registry: the CPU per message is measured)."""
    wanted = {"source": source.name, "action": "delete"}

    def deleted() -> float:
        return next((sample.value for metric in SETTLEMENTS.collect() for sample in metric.samples
                     if sample.name.endswith("_total") and sample.labels == wanted), 0.0)

    before = deleted()
    while deleted() - before < count:  # noqa: ASYNC110 - a metric has nothing to await
        await asyncio.sleep(0.005)
    clock.stop()


async def main() -> bool:
    """Run the contenders in alternating rounds and print throughput, CPU per message and ratios;
    ``True`` when the throughput target is met."""
    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    count = MESSAGES
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    labels = ("raw", "alone", "hand-rolled", "one-txn", "two-txn")
    with moto_server() as endpoint:
        client = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)
        async with queue_database() as dsn:
            url = dsn.replace("postgresql://", "postgresql+asyncpg://")
            for round_ in range(ROUNDS):
                for label in labels[round_ % 2:] + labels[:round_ % 2]:  # alternate who goes first
                    queue, dlq = await asyncio.to_thread(_fill, client, label, count)
                    clock = Clock()
                    if label in ("raw", "hand-rolled"):
                        await _hand_rolled(endpoint, queue, count, dsn if label == "hand-rolled" else None, clock)
                    elif label == "alone":
                        await _source_alone(endpoint, queue, dlq, count, clock)
                    else:
                        await _framework(endpoint, queue, dlq, count, url, clock, single=label == "one-txn")
                    rates.setdefault(label, []).append(count / clock.wall)
                    cpus.setdefault(label, []).append(clock.cpu / count * 1000)
                    for queue_url in (queue, dlq):
                        await asyncio.to_thread(client.delete_queue, QueueUrl=queue_url)
    def ratio(series: dict[str, list[float]], label: str, peer: str) -> float:
        return statistics.median(value / base for value, base in zip(series[label], series[peer], strict=True))

    def row(name: str, label: str, peer: str | None, target: float | None = None) -> bool:
        rate, cpu = statistics.median(rates[label]), statistics.median(cpus[label])
        line = f"  {name:<40} {rate:6.1f} msg/s  {cpu:5.2f} ms CPU/msg"
        met = True
        if peer is None:
            line += f"  (rounds: {', '.join(f'{r:.1f}' for r in rates[label])})"
        else:
            value = ratio(rates, label, peer)
            line += f"  {value:5.2f}x peer throughput  {ratio(cpus, label, peer):5.2f}x peer CPU/msg"
            if target is not None:
                met = value >= target
                line += f"  (target >= {target}x: {verdict(value, target)})"
        print(line)
        return met

    print(f"sqs on one moto server + PostgreSQL: {count} messages a queue (filled before the drain), {POLLERS} "
          f"pollers, {ROUNDS} rounds (ratios: medians of per-round ratios; CPU: this process, threads included)")
    row("raw boto3 receive+delete (peer)", "raw", None)
    row("SQSSource alone, acks at once", "alone", "raw")
    row("hand-rolled boto3+asyncpg inbox (peer)", "hand-rolled", None)
    met = row("SQSSource + inbox, single transaction", "one-txn", "hand-rolled", TARGET)
    row("SQSSource + inbox, two transactions", "two-txn", "hand-rolled")
    return met


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main()) else 1)
