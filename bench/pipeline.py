"""Issue 2's benchmark: the inbox pipeline on PostgreSQL against a hand-rolled asyncpg inbox consumer.

Both sides do the same work per delivery: dedupe on an inbox row and insert one effect row, at the
same concurrency, on the same server, in the same run. The hand-rolled consumer is what a careful
team writes without a framework: ``INSERT ... ON CONFLICT DO NOTHING`` into an inbox table plus the
effect row, one transaction per message.
"""

from __future__ import annotations

import logging
import os
import statistics
from typing import Literal

import asyncpg
from sqlalchemy import Column, Integer, MetaData, String, Table, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from bench.common import PeakConnections, drive, scratch_database, verdict
from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.store import create_engine, upgrade
from consumer_kit.testing import InMemorySource

N = int(os.environ.get("CK_BENCH_N", "20000"))
ROUNDS = int(os.environ.get("CK_BENCH_ROUNDS", "3"))
CONCURRENCY = 32

_metadata = MetaData()
effects = Table(
    "bench_effects", _metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ticket", String(50), nullable=False),
)


async def hand_rolled(url: str, ids: list[str], bodies: dict[str, bytes]) -> float:
    pool = await asyncpg.create_pool(url, min_size=CONCURRENCY, max_size=CONCURRENCY)
    assert pool is not None
    await pool.execute("DROP TABLE IF EXISTS hr_inbox, hr_effects")
    await pool.execute("CREATE TABLE hr_inbox (consumer text, message_id text, PRIMARY KEY (consumer, message_id))")
    await pool.execute("CREATE TABLE hr_effects (id serial PRIMARY KEY, ticket text NOT NULL)")

    async def consume(message_id: str) -> None:
        async with pool.acquire() as conn, conn.transaction():
            status = await conn.execute(
                "INSERT INTO hr_inbox (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                "bench", message_id,
            )
            if status == "INSERT 0 1":
                await conn.execute("INSERT INTO hr_effects (ticket) VALUES ($1)", bodies[message_id][:20].decode())

    try:
        rate = await drive(ids, consume, CONCURRENCY)
        assert await pool.fetchval("SELECT count(*) FROM hr_effects") == len(ids)
        return rate
    finally:
        await pool.close()


async def hand_rolled_sqlalchemy(async_url: str, ids: list[str], bodies: dict[str, bytes]) -> float:
    """The same consumer written with an SQLAlchemy ``AsyncSession``, as consumer-kit's handlers write:
    it shows how much of the gap to the asyncpg peer is SQLAlchemy's own cost, not the pipeline's."""
    engine = create_async_engine(async_url, pool_size=CONCURRENCY // 2, max_overflow=CONCURRENCY // 2)
    claim = text("INSERT INTO hr_inbox (consumer, message_id) VALUES (:c, :m) ON CONFLICT DO NOTHING")
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE hr_inbox, hr_effects"))

    async def consume(message_id: str) -> None:
        async with AsyncSession(engine) as session, session.begin():
            if (await session.execute(claim, {"c": "bench", "m": message_id})).rowcount == 1:  # type: ignore[attr-defined]
                await session.execute(
                    text("INSERT INTO hr_effects (ticket) VALUES (:t)"), {"t": bodies[message_id][:20].decode()})

    try:
        return await drive(ids, consume, CONCURRENCY)
    finally:
        await engine.dispose()


async def framework(url: str, ids: list[str], bodies: dict[str, bytes], *, single: bool,
                    round_: int, driver: Literal["sqlalchemy", "asyncpg"] = "sqlalchemy") -> tuple[float, float]:
    settings = Settings(
        database_url=url, idempotency_hmac_key="bench-hmac-key-0123456789abcdef",  # type: ignore[arg-type]
        # Half the peer's connections (the printed peaks): on a 2-core host both paths measured faster
        # with 16 than with 31 (fewer backends contending for the cores); CK_BENCH_POOL overrides.
        db_pool_size=int(os.environ.get("CK_BENCH_POOL", str(CONCURRENCY // 2))),
    )
    app = ConsumerApp(settings)
    source = InMemorySource(namespace="bench", version=1 if single else 2)

    @app.handler(source, single_transaction=single, driver=driver,
                 name=f"{'single' if single else 'double'}-{driver}-{round_}")
    async def handle(ctx: Context) -> None:
        if driver == "asyncpg":
            await ctx.connection.execute("INSERT INTO bench_effects (ticket) VALUES ($1)",
                                         ctx.delivery.body[:20].decode())
        else:
            await ctx.db.execute(effects.insert().values(ticket=ctx.delivery.body[:20].decode()))

    async with app.running():
        async with app.engine.begin() as conn:
            await conn.run_sync(_metadata.create_all)

        async def deliver(message_id: str) -> None:
            result = await source.deliver(id=message_id, body=bodies[message_id])
            assert result.outcome.value in ("processed", "duplicate"), result

        first = await drive(ids, deliver, CONCURRENCY)
        again = await drive(ids, deliver, CONCURRENCY)
        async with app.engine.begin() as conn:
            await conn.run_sync(lambda c: _metadata.drop_all(c))
    return first, again


async def main() -> bool:
    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    ids = [f"m-{i:08d}" for i in range(N)]
    bodies = {i: f'{{"key": "T-{i}"}}'.encode() for i in ids}
    # Each round runs the peer and then every consumer-kit path back to back, and each path's ratio
    # is that round's rate over that round's peer; the reported ratio is the median over rounds. On
    # a small shared host the rate of one run swings by 20%, and pairing runs that are seconds apart
    # keeps a slow minute from deciding a ratio either way.
    peers: list[float] = []
    rates: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    async with scratch_database() as url:
        watcher = PeakConnections(url)
        async_url = url.replace("postgresql://", "postgresql+asyncpg://")
        engine = create_engine(async_url)
        await upgrade(engine)
        await engine.dispose()
        for round_ in range(ROUNDS):
            async with watcher.watch():
                peers.append(await hand_rolled(url, ids, bodies))
            peaks["peer"] = max(peaks.get("peer", 0), watcher.peak)
            for single in (False, True):
                path = "single" if single else "two"
                async with watcher.watch():
                    first, again = await framework(async_url, ids, bodies, single=single, round_=round_,
                                                   driver="asyncpg")
                peaks[path] = peaks[f"{path}-dup"] = max(peaks.get(path, 0), watcher.peak)
                rates.setdefault(f"{path}", []).append(first)
                rates.setdefault(f"{path}-dup", []).append(again)
        # SQLAlchemy's share, for the record (no target): one round of each.
        sqlalchemy_peer = await hand_rolled_sqlalchemy(async_url, ids, bodies)
        two_db = (await framework(async_url, ids, bodies, single=False, round_=ROUNDS))[0]
        one_db = (await framework(async_url, ids, bodies, single=True, round_=ROUNDS))[0]

    def ratio(name: str) -> float:
        return statistics.median(rate / peer for rate, peer in zip(rates[name], peers, strict=True))

    rows = [
        ("two-transaction path", "two", 0.5),
        ("single-transaction path", "single", 0.9),
        ("duplicates, two-transaction path", "two-dup", 2.0),
        ("duplicates, single-transaction path", "single-dup", None),
    ]
    peer = statistics.median(peers)
    print(f"pipeline on PostgreSQL: {N} deliveries, concurrency {CONCURRENCY}, {ROUNDS} rounds; "
          "ratios are medians of per-round ratios; handlers write through driver='asyncpg' as the peer does")
    print(f"  {'hand-rolled asyncpg inbox (peer)':<38} {peer:9.0f} msg/s  peak connections {peaks['peer']:2d}  "
          f"(rounds: {', '.join(f'{p:.0f}' for p in peers)})")
    for label, name, target in rows:
        value = ratio(name)
        goal = f"(target >= {target}x: {verdict(value, target)})" if target else "(no target)"
        print(f"  {label:<38} {statistics.median(rates[name]):9.0f} msg/s  peak connections {peaks[name]:2d}  "
              f"{value:5.2f}x peer  {goal}")
    print(f"  {'SQLAlchemy AsyncSession consumer':<38} {sqlalchemy_peer:9.0f} msg/s  "
          f"{sqlalchemy_peer / peer:5.2f}x peer  (one round, no target: SQLAlchemy's own cost)")
    for label, rate in (("two-transaction path, ctx.db", two_db), ("single-transaction path, ctx.db", one_db)):
        print(f"  {label:<38} {rate:9.0f} msg/s  {rate / peer:5.2f}x peer  "
              f"{rate / sqlalchemy_peer:5.2f}x the SQLAlchemy consumer (one round, no target)")
    return all(ratio(name) >= target for _, name, target in rows if target)
