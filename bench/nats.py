"""NATS JetStream end to end: NatsSource + the PostgreSQL inbox against FastStream with a hand-written
inbox.

Every contender consumes the same number of messages from a stream of its own (each published with a
``Nats-Msg-Id``), with at most ``IN_FLIGHT`` messages delivered and not acknowledged at once:

- raw:        nats-py pull consumer, ``fetch(IN_FLIGHT)`` then ``msg.ack()`` each, nothing else (the ceiling);
- faststream: FastStream's JetStream pull subscriber (``PullSub(batch_size=IN_FLIGHT)``, the consumer's
              ``max_ack_pending`` the same), ``AckPolicy.MANUAL``; its handler takes an asyncpg pool
              connection and, in one transaction, inserts the ``Nats-Msg-Id`` into an inbox table
              ``ON CONFLICT DO NOTHING`` and an effect row for a new one, then acks after the commit;
- one-txn:    NatsSource, handler with ``single_transaction=True`` (claim, effect and completion in one
              commit);
- two-txn:    NatsSource, the default path (claim committed first, effect + completion after);
- duplicates: the two-txn stream's messages published again with the same ``Nats-Msg-Id`` (after the
              stream's one-second duplicate window, so JetStream stores them) and consumed by the same
              durable through the default path: each is acknowledged as a duplicate, the handler not run.

consumer-kit's handlers write their row through ``driver="asyncpg"`` (``ctx.connection``), as the peer
does; its pool is one smaller than the peer's, for the connection SQLAlchemy keeps (the printed peaks
show both). Each contender is timed from the end of its set-up (connections, pools, the app's start) to
its last acknowledgement; the CPU is this process's (nats-server and PostgreSQL run apart). Rounds
rotate the order; each ratio is the median over rounds of that round's figure over that round's peer's
(for duplicates: over that round's two-txn first deliveries).

FastStream runs with ``apply_types=False`` (the handler reads the message from the broker's context):
the peer at its fastest. Its documented form, the message as an annotated handler argument, resolves
that argument in a worker thread for every message; ``CK_BENCH_FASTSTREAM_DI=1`` runs that form instead.

Run: ``python -m bench nats`` with PostgreSQL and nats-server (JetStream) on 127.0.0.1
(``CK_BENCH_PG_ADMIN_URL``, ``CK_BENCH_NATS_URL``, ``CK_BENCH_NATS_MESSAGES``, ``CK_BENCH_NATS_IN_FLIGHT``,
``CK_BENCH_ROUNDS``, ``CK_BENCH_POOL`` override). A database and streams are created for the run and
removed afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import nats
from nats.js.api import ConsumerConfig, StreamConfig
from nats.js.errors import NotFoundError

from bench.common import PeakConnections, queue_database, verdict
from consumer_kit import ConsumerApp, Context, Outcome, Settings
from consumer_kit.sources.pulling import PullingSource

NATS_URL = os.environ.get("CK_BENCH_NATS_URL", "nats://127.0.0.1:4222")
MESSAGES = int(os.environ.get("CK_BENCH_NATS_MESSAGES", "10000"))
IN_FLIGHT = int(os.environ.get("CK_BENCH_NATS_IN_FLIGHT", "32"))
ROUNDS = int(os.environ.get("CK_BENCH_ROUNDS", "3"))
DB_CONNECTIONS = 20  # the peer's pool; consumer-kit's store gets one fewer (SQLAlchemy keeps one)
FASTSTREAM_DI = os.environ.get("CK_BENCH_FASTSTREAM_DI", "") == "1"
DUPLICATE_WINDOW = 1.0  # seconds: the same Nats-Msg-Id published later than this is stored again
TARGETS = {"one-txn": 1.0, "two-txn": 0.8, "duplicates": 3.0}
GROUPS = (("faststream",), ("one-txn",), ("two-txn", "duplicates"))  # rotated each round
INSERT_INBOX = "INSERT INTO bench_inbox (message_id) VALUES ($1) ON CONFLICT DO NOTHING"
INSERT_EFFECT = "INSERT INTO bench_effects (body) VALUES ($1)"


# -------------------------------------------------------------------------------------------------
# shared with bench.redis: the clock, the consumer-kit contender, the report


class Clock:
    """Wall and CPU time (this process) from :meth:`start` to :meth:`stop`: the drain only."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.running = False

    def start(self) -> None:
        self.running = True
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


@dataclass
class Tally:
    """Counts acknowledgements up to ``count``; stops the clock and sets ``done`` at the last."""

    count: int
    clock: Clock
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    seen: int = 0

    def acked(self, outcome: str = "peer") -> None:
        self.outcomes[outcome] += 1
        self.seen += 1
        if self.seen == self.count:
            self.clock.stop()
            self.done.set()


def ck_settings(url: str, count: int) -> Settings:
    return Settings(database_url=url, idempotency_hmac_key="bench-hmac-key-0123456789abcdef",  # type: ignore[arg-type]
                    db_pool_size=int(os.environ.get("CK_BENCH_POOL", str(DB_CONNECTIONS - 1))),
                    idempotency_max_receipts_per_scope=100 * count)


async def run_consumer_kit(source: PullingSource[Any], url: str, tally: Tally, *, single: bool,
                           expect: Outcome = Outcome.PROCESSED) -> None:
    """Run ``source`` in a ConsumerApp until ``tally`` has counted its messages, each counted where
    the broker is told (after the source's settlement), as the peers count theirs."""
    app = ConsumerApp(ck_settings(url, tally.count))
    ran = 0

    @app.handler(source, single_transaction=single, driver="asyncpg")
    async def handle(ctx: Context) -> None:
        nonlocal ran
        ran += 1
        await ctx.connection.execute(INSERT_EFFECT, ctx.delivery.text())

    settle = source._settle

    async def counted(message: Any, delivery: Any, result: Any) -> None:
        await settle(message, delivery, result)
        tally.acked(str(result.outcome))

    source._settle = counted  # type: ignore[method-assign]
    async with app.running():
        tally.clock.start()  # the poller is created; set-up is over
        await tally.done.wait()
    assert tally.outcomes == {str(expect): tally.count}, f"outcomes {dict(tally.outcomes)}, handler ran {ran}"
    assert ran == (tally.count if expect is Outcome.PROCESSED else 0), f"handler ran {ran} times"


@contextlib.asynccontextmanager
async def peer_pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(dsn, min_size=DB_CONNECTIONS, max_size=DB_CONNECTIONS)
    try:
        yield pool
    finally:
        await pool.close()


async def record(pool: asyncpg.Pool, message_id: str, body: str) -> None:
    """The peer's inbox: the id claimed and the effect written in one transaction, committed on return."""
    async with pool.acquire() as conn, conn.transaction():
        if await conn.execute(INSERT_INBOX, message_id) == "INSERT 0 1":
            await conn.execute(INSERT_EFFECT, body)


async def effects(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM bench_effects"))
    finally:
        await conn.close()


Contender = Callable[[str, Tally], Awaitable[None]]  # (label, tally) -> drains one stream/queue


@dataclass
class Results:
    rates: dict[str, list[float]] = field(default_factory=dict)
    cpus: dict[str, list[float]] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)

    def add(self, label: str, clock: Clock, count: int, peak: int) -> None:
        self.rates.setdefault(label, []).append(count / clock.wall)
        self.cpus.setdefault(label, []).append(clock.cpu / count * 1e6)
        self.peaks[label] = max(self.peaks.get(label, 0), peak)

    def ratio(self, label: str, over: str) -> float:
        return statistics.median(a / b for a, b in zip(self.rates[label], self.rates[over], strict=True))

    def cpu_ratio(self, label: str, over: str) -> float:
        return statistics.median(a / b for a, b in zip(self.cpus[label], self.cpus[over], strict=True))


def report(results: Results, names: dict[str, str]) -> bool:
    """Print a line per contender (rate, CPU per message, peak connections, ratio and verdict) and
    return whether every target is met. ``names``: label -> what the line calls it."""
    met = True
    for label, name in names.items():
        rates = results.rates[label]
        rate, cpu = statistics.median(rates), statistics.median(results.cpus[label])
        line = f"  {name:<46} {rate:6.0f} msg/s {cpu:6.0f} us CPU/msg  peak conns {results.peaks[label]:2d}"
        if label == "raw":  # once: over the peer's median
            line += f"  {rate / statistics.median(results.rates['faststream']):5.2f}x peer"
        elif label != "faststream":
            over = "two-txn" if label == "duplicates" else "faststream"
            value = results.ratio(label, over)
            line += f"  {value:5.2f}x {'first' if label == 'duplicates' else 'peer '}"
            line += f" (CPU {results.cpu_ratio(label, over):4.2f}x)"
            if label in TARGETS:
                met = met and value >= TARGETS[label]
                line += f"  target >= {TARGETS[label]}x: {verdict(value, TARGETS[label])}"
        if len(rates) > 1:
            line += f"  (rounds: {', '.join(f'{r:.0f}' for r in rates)})"
        print(line)
    return met


async def rounds(dsn: str, groups: Sequence[Sequence[str]], run: Contender, count: int) -> Results:
    """"raw" once, then every group of contenders once a round, the groups' order rotated each round (a
    group's contenders run in their order: duplicates right after the first deliveries they repeat); a
    first-delivery contender must add ``count`` effect rows, raw and duplicates none."""
    results = Results()
    watcher = PeakConnections(dsn)
    plan = [["raw"]]
    for round_ in range(ROUNDS):
        shift = round_ % len(groups)
        plan.append([label for group in [*groups[shift:], *groups[:shift]] for label in group])
    for labels in plan:
        for label in labels:
            tally = Tally(count, Clock())
            before = await effects(dsn)
            async with watcher.watch():
                await run(label, tally)
            added = await effects(dsn) - before
            wanted = 0 if label in ("raw", "duplicates") else count
            assert added == wanted, f"{label}: {added} effect rows for {count} messages (expected {wanted})"
            results.add(label, tally.clock, count, watcher.peak)
    return results


# -------------------------------------------------------------------------------------------------
# NATS


@dataclass
class Stream:
    name: str
    subject: str  # the one subject messages are published to; the stream captures <prefix>.>
    durable: str


async def _create(js: Any, label: str) -> Stream:
    token = secrets.token_hex(3)
    prefix = f"ck-bench.{label}.{token}"
    name = f"CK_BENCH_{label.upper().replace('-', '_')}_{token}"
    await js.add_stream(StreamConfig(name=name, subjects=[f"{prefix}.>"], duplicate_window=DUPLICATE_WINDOW))
    return Stream(name, f"{prefix}.orders", durable=f"ck-bench-{label}-{token}")


async def _fill(js: Any, stream: Stream, count: int) -> None:
    for start in range(0, count, 1000):
        await asyncio.gather(*(
            js.publish(stream.subject, f"order-{i}".encode(), headers={"Nats-Msg-Id": f"{stream.name}-{i}"})
            for i in range(start, min(count, start + 1000))))


async def _raw(stream: Stream, tally: Tally) -> None:
    client = await nats.connect(NATS_URL)
    try:
        js = client.jetstream()
        sub = await js.pull_subscribe(stream.subject, durable=stream.durable, stream=stream.name,
                                      config=ConsumerConfig(max_ack_pending=IN_FLIGHT))
        tally.clock.start()
        while not tally.done.is_set():
            try:
                messages = await sub.fetch(IN_FLIGHT, timeout=1)
            except nats.errors.TimeoutError:
                continue
            for message in messages:
                await message.ack()
                tally.acked()
    finally:
        await client.close()


async def _faststream(stream: Stream, dsn: str, tally: Tally) -> None:
    from faststream import AckPolicy
    from faststream.nats import JStream, NatsBroker, PullSub
    from faststream.nats.annotations import NatsMessage

    broker = NatsBroker(NATS_URL, logger=None, apply_types=FASTSTREAM_DI)
    async with peer_pool(dsn) as pool:
        async def consume(message: Any) -> None:
            await record(pool, message.headers["Nats-Msg-Id"], message.body.decode())
            await message.ack()  # after the commit: AckPolicy.MANUAL leaves it to us
            tally.acked()

        subscriber = broker.subscriber(
            stream.subject, stream=JStream(stream.name, declare=False), durable=stream.durable,
            config=ConsumerConfig(max_ack_pending=IN_FLIGHT), pull_sub=PullSub(batch_size=IN_FLIGHT, timeout=1.0),
            ack_policy=AckPolicy.MANUAL)
        if FASTSTREAM_DI:
            @subscriber
            async def handle_di(msg: NatsMessage) -> None:
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


async def _all_acknowledged(js: Any, stream: Stream, label: str) -> None:
    """The durable has nothing left to deliver or to be acknowledged (acks are sent without waiting, so
    the server may count the last ones a moment after the contender closed its connection)."""
    deadline = time.monotonic() + 5
    while True:
        info = await js.consumer_info(stream.name, stream.durable)
        if (info.num_pending, info.num_ack_pending) == (0, 0):
            return
        assert time.monotonic() < deadline, \
            f"{label}: {info.num_pending} not delivered, {info.num_ack_pending} not acknowledged"
        await asyncio.sleep(0.05)


async def main() -> bool:
    """Run every contender in rotating rounds and print rates, CPU and ratios; ``True`` when every
    target is met."""
    from consumer_kit.sources.nats import NatsSource

    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    count = MESSAGES
    client = await nats.connect(NATS_URL)
    js = client.jetstream()
    streams: list[Stream] = []
    last_two: list[Stream] = []
    try:
        async with queue_database() as dsn:
            url = dsn.replace("postgresql://", "postgresql+asyncpg://")

            def source(stream: Stream) -> NatsSource:
                return NatsSource(stream=stream.name, subject=stream.subject, namespace="bench", version=1,
                                  durable=stream.durable, url=NATS_URL, max_in_flight=IN_FLIGHT)

            async def run(label: str, tally: Tally) -> None:
                if label == "duplicates":  # the last two-txn stream, its messages published again
                    stream = last_two.pop()
                    await asyncio.sleep(DUPLICATE_WINDOW)
                else:
                    stream = await _create(js, label)
                    streams.append(stream)
                await _fill(js, stream, count)
                if label == "raw":
                    await _raw(stream, tally)
                elif label == "faststream":
                    await _faststream(stream, dsn, tally)
                else:
                    await run_consumer_kit(source(stream), url, tally, single=label == "one-txn",
                                           expect=Outcome.DUPLICATE if label == "duplicates" else Outcome.PROCESSED)
                    if label == "two-txn":
                        last_two.append(stream)
                await _all_acknowledged(js, stream, label)

            results = await rounds(dsn, GROUPS, run, count)
    finally:
        for stream in streams:
            for name in (stream.name, f"{stream.name}_DEAD_LETTER"):
                with contextlib.suppress(NotFoundError):
                    await js.delete_stream(name)
        await client.close()
    print(f"nats jetstream end to end on PostgreSQL: {count} messages, {IN_FLIGHT} in flight, {DB_CONNECTIONS} "
          f"database connections for the peer, {ROUNDS} rounds (ratios: medians of per-round ratios)")
    return report(results, {
        "raw": "raw nats-py fetch+ack (ceiling)",
        "faststream": f"FastStream PullSub + asyncpg inbox (peer{', DI' if FASTSTREAM_DI else ''})",
        "one-txn": "NatsSource, single-transaction path",
        "two-txn": "NatsSource, default path (two transactions)",
        "duplicates": "NatsSource, duplicates (default path)",
    })


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main()) else 1)
