"""Redis Streams end to end: RedisStreamSource + the PostgreSQL inbox against FastStream with a
hand-written inbox.

Every contender consumes the same number of entries from a stream of its own through a consumer
group; each entry has a ``body`` and a ``message-id`` field (the business id every contender keys by):

- raw:        redis-py ``XREADGROUP`` (``COUNT`` ``IN_FLIGHT``) then one ``XACK`` of what it read, nothing
              else (the ceiling);
- faststream: FastStream's stream subscriber (``StreamSub`` with the group, ``max_records=IN_FLIGHT``,
              ``max_workers=IN_FLIGHT`` handlers at once: without ``max_workers`` it runs one entry at a
              time), ``AckPolicy.MANUAL``; its handler takes an asyncpg pool connection and, in one
              transaction, inserts the ``message-id`` into an inbox table ``ON CONFLICT DO NOTHING`` and an
              effect row for a new one, then acks (``XACK``) after the commit;
- one-txn:    RedisStreamSource keyed by ``message-id``, handler with ``single_transaction=True``;
- two-txn:    RedisStreamSource keyed by ``message-id``, the default path (two transactions);
- duplicates: the two-txn stream's entries added again (new entry ids, the same ``message-id``s) and read
              by the same group through the default path: each is acknowledged as a duplicate.

FastStream's reading is bounded by its handlers, not by what is unacknowledged (Redis has no such
bound): it may hold up to about three times ``IN_FLIGHT`` entries read and not acknowledged (those
running, its buffer, the rest of a read), consumer-kit ``IN_FLIGHT``. Timing, CPU, pools, rounds and
ratios are as in :mod:`bench.nats` (whose helpers this module shares), FastStream with
``apply_types=False`` unless ``CK_BENCH_FASTSTREAM_DI=1``.

Run: ``python -m bench redis`` with PostgreSQL and Redis on 127.0.0.1 (``CK_BENCH_PG_ADMIN_URL``,
``CK_BENCH_REDIS_URL``, ``CK_BENCH_REDIS_MESSAGES``, ``CK_BENCH_REDIS_IN_FLIGHT``, ``CK_BENCH_ROUNDS``,
``CK_BENCH_POOL`` override). A database and streams are created for the run and removed afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

import redis.asyncio

from bench.common import queue_database
from bench.nats import (
    DB_CONNECTIONS,
    FASTSTREAM_DI,
    GROUPS,
    ROUNDS,
    Tally,
    peer_pool,
    record,
    report,
    rounds,
    run_consumer_kit,
)
from consumer_kit import Outcome

REDIS_URL = os.environ.get("CK_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
MESSAGES = int(os.environ.get("CK_BENCH_REDIS_MESSAGES", "10000"))
IN_FLIGHT = int(os.environ.get("CK_BENCH_REDIS_IN_FLIGHT", "32"))
ID_FIELD = "message-id"


@dataclass
class Stream:
    name: str
    group: str


async def _create(client: redis.asyncio.Redis, label: str) -> Stream:
    token = secrets.token_hex(3)
    stream = Stream(f"ck-bench:{label}:{token}", f"ck-bench-{label}")
    await client.xgroup_create(stream.name, stream.group, id="0", mkstream=True)
    return stream


async def _fill(client: redis.asyncio.Redis, stream: Stream, count: int) -> None:
    for start in range(0, count, 1000):
        async with client.pipeline(transaction=False) as pipe:
            for i in range(start, min(count, start + 1000)):
                pipe.xadd(stream.name, {"body": f"order-{i}", ID_FIELD: f"{stream.name}-{i}"})
            await pipe.execute()


async def _raw(stream: Stream, tally: Tally) -> None:
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        tally.clock.start()
        while not tally.done.is_set():
            reply = await client.xreadgroup(stream.group, "raw", {stream.name: ">"}, count=IN_FLIGHT, block=1000)
            ids = [entry_id for _, entries in reply or [] for entry_id, _ in entries]
            if ids:
                await client.xack(stream.name, stream.group, *ids)
            for _ in ids:
                tally.acked()
    finally:
        await client.aclose()


async def _faststream(stream: Stream, dsn: str, tally: Tally) -> None:
    from faststream import AckPolicy
    from faststream.redis import RedisBroker, StreamSub
    from faststream.redis.annotations import RedisStreamMessage

    broker = RedisBroker(REDIS_URL, logger=None, apply_types=FASTSTREAM_DI)
    async with peer_pool(dsn) as pool:
        async def consume(message: Any) -> None:
            fields = message.raw_message["data"]
            await record(pool, fields[ID_FIELD.encode()].decode(), fields[b"body"].decode())
            await message.ack()  # XACK after the commit: AckPolicy.MANUAL leaves it to us
            tally.acked()

        subscriber = broker.subscriber(
            stream=StreamSub(stream.name, group=stream.group, consumer="faststream", max_records=IN_FLIGHT,
                             polling_interval=1000),
            max_workers=IN_FLIGHT, ack_policy=AckPolicy.MANUAL)
        if FASTSTREAM_DI:
            @subscriber
            async def handle_di(msg: RedisStreamMessage) -> None:
                await consume(msg)
        else:
            @subscriber
            async def handle(_: Any) -> None:
                await consume(broker.context.get_local("message"))

        await broker.start()
        try:
            tally.clock.start()
            await tally.done.wait()
        finally:
            await broker.stop()


async def main() -> bool:
    """Run every contender in rotating rounds and print rates, CPU and ratios; ``True`` when every
    target is met."""
    from consumer_kit.sources.redis import RedisStreamSource

    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    count = MESSAGES
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    streams: list[Stream] = []
    last_two: list[Stream] = []
    try:
        async with queue_database() as dsn:
            url = dsn.replace("postgresql://", "postgresql+asyncpg://")

            def source(stream: Stream) -> RedisStreamSource:
                return RedisStreamSource(stream=stream.name, group=stream.group, namespace="bench", version=1,
                                         url=REDIS_URL, key=ID_FIELD, max_in_flight=IN_FLIGHT)

            async def run(label: str, tally: Tally) -> None:
                if label == "duplicates":  # the last two-txn stream, its entries added again
                    stream = last_two.pop()
                else:
                    stream = await _create(client, label)
                    streams.append(stream)
                await _fill(client, stream, count)
                if label == "raw":
                    await _raw(stream, tally)
                elif label == "faststream":
                    await _faststream(stream, dsn, tally)
                else:
                    await run_consumer_kit(source(stream), url, tally, single=label == "one-txn",
                                           expect=Outcome.DUPLICATE if label == "duplicates" else Outcome.PROCESSED)
                    if label == "two-txn":
                        last_two.append(stream)
                await _check_settled(client, stream)

            results = await rounds(dsn, GROUPS, run, count)
    finally:
        if streams:
            await client.delete(*(s.name for s in streams), *(f"{s.name}:dead-letter" for s in streams))
        await client.aclose()
    print(f"redis streams end to end on PostgreSQL: {count} entries, {IN_FLIGHT} in flight, {DB_CONNECTIONS} "
          f"database connections for the peer, {ROUNDS} rounds (ratios: medians of per-round ratios)")
    return report(results, {
        "raw": "raw redis-py XREADGROUP+XACK (ceiling)",
        "faststream": f"FastStream StreamSub + asyncpg inbox (peer{', DI' if FASTSTREAM_DI else ''})",
        "one-txn": "RedisStreamSource, single-transaction path",
        "two-txn": "RedisStreamSource, default path (two txns)",
        "duplicates": "RedisStreamSource, duplicates (default path)",
    })


async def _check_settled(client: redis.asyncio.Redis, stream: Stream) -> None:
    """Nothing left pending in the group: every entry read was acknowledged."""
    pending = await client.xpending(stream.name, stream.group)
    assert pending["pending"] == 0, f"{stream.name}: {pending['pending']} entries left unacknowledged"


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main()) else 1)
