"""Issue 31's large store: the claim of a new key and the look-up of a duplicate, with the inbox
bulk-loaded from 10,000 rows up to 50 million (``CK_BENCH_STORE_ROWS``), against a scratch PostgreSQL
database migrated to head, through the store's own pool and ``Inbox`` as a worker calls it.

The rows are shaped like a worker's: completed, one consumer, a 64-character key digest and
fingerprint (random, as HMAC digests are), retention ending anywhere in the next seven days, so the
key index and ``ix_inbox_expires_at`` are as wide and as spread as in production. Each size past the
first is reached by dropping the inbox's indexes, loading the new rows with ``INSERT .. SELECT`` in
transactions of a million, building the indexes again from their own definitions (``pg_indexes``), and
``VACUUM ANALYZE``, as a restore would; then ``CK_BENCH_STORE_WARMUP`` claims run unmeasured (a bulk-built
index is packed tighter than one grown by inserts: its first inserts split pages), with the key index
read into the server's buffers first (``pg_prewarm``: where a server that has run a while keeps it), then,
``CK_BENCH_STORE_ROUNDS`` times (3; each p99 printed is the median of the rounds'):

- **claim, new key**: ``CK_BENCH_STORE_PROBES`` claims of keys never seen, each through
  ``Inbox.claim`` in autocommit, one after another on one connection (the statement's own time);
- **duplicate, recent**: the same keys again, through ``Inbox.lookup``: what a redelivery does;
- **duplicate, old** (no target): keys from anywhere in the loaded rows, whose pages are cold in
  PostgreSQL's buffers.

The target: each of the first two p99s at the largest size within 1.5x of the 10,000-row one. The
run prints the database's settings that bear on it and the sizes of the table and its indexes.

The server: by default one of the run's own (``initdb`` in a temporary directory, as the chaos suite's
crash runs do), configured as a production server for a store this size is: ``shared_buffers`` a
quarter of the host's memory (at most 8 GB), ``effective_cache_size`` half, ``max_wal_size`` 8 GB and
``checkpoint_timeout`` 15 minutes, autovacuum on, and ``wal_compression = lz4``: past a checkpoint, the
first change to a page writes the whole page to the WAL, and a new key's claim changes a random page of
the key index, which at 50 M rows is nearly always one not changed since (``CK_BENCH_STORE_WAL_COMPRESSION``
sets another). pg_stat_statements is loaded, so that each operation's blocks read from outside
``shared_buffers``, blocks written back and full-page images are printed with its times.
``CK_BENCH_STORE_SERVER=shared`` runs on the machine's
server instead (``CK_BENCH_PG_ADMIN_URL``) as it is configured; with Debian's 128 MB of
``shared_buffers``, a claim then reads and writes back a page of the key index from the kernel's cache.

Run: ``python -m bench store`` (the 50 M step takes about ~20 minutes and ~20 GB of disk here).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import random
import secrets
import statistics
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg

from bench.common import bench_server, migrated_database
from consumer_kit.keys import KeyDigester
from consumer_kit.store import Database, Inbox, create_engine

SIZES = [int(n) for n in os.environ.get("CK_BENCH_STORE_ROWS", "10000,1000000,10000000,50000000").split(",")]
PROBES = int(os.environ.get("CK_BENCH_STORE_PROBES", "5000"))
WARMUP = int(os.environ.get("CK_BENCH_STORE_WARMUP", "5000"))
ROUNDS = int(os.environ.get("CK_BENCH_STORE_ROUNDS", "3"))
CHUNK = 1_000_000
CONSUMER = "store"
HMAC_KEY = "bench-hmac-key-0123456789abcdef"
SERVER = os.environ.get("CK_BENCH_STORE_SERVER", "own")
WAL_COMPRESSION = os.environ.get("CK_BENCH_STORE_WAL_COMPRESSION", "lz4")
# Where a statement's time goes, from pg_stat_statements (the own server loads it): blocks read from outside
# shared_buffers (the kernel's cache or the disk) and the time those reads took, blocks it wrote back to make room,
# and the full-page images its WAL carried (a page's first change after a checkpoint).
_IO = ("SELECT coalesce(sum(calls), 0), coalesce(sum(shared_blks_read), 0), coalesce(sum(blk_read_time), 0),"
       " coalesce(sum(shared_blks_written), 0), coalesce(sum(wal_fpi), 0) FROM pg_stat_statements"
       " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
       " AND query NOT LIKE '%pg_stat_statements%'")
SETTINGS = ("shared_buffers", "effective_cache_size", "maintenance_work_mem", "checkpoint_timeout", "max_wal_size",
            "wal_compression", "synchronous_commit", "autovacuum", "server_version")

# A loaded row: digest and fingerprint are 64 hex characters, as HMAC-SHA256 gives; md5 is only the
# cheapest way to make them here.
_LOAD = (
    "INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts, outcome,"
    " created_at, updated_at, expires_at) SELECT $1, md5(i::text) || md5((-i)::text), 'orders', 1,"
    " md5((i * 7)::text) || md5((i * 13)::text), 'completed', 1, 'processed', now() - interval '1 day', now(),"
    " now() + make_interval(secs => i % 604800) FROM generate_series($2::bigint, $3::bigint) i"
)


def _loaded_digest(i: int) -> str:
    """The key digest :data:`_LOAD` gave row ``i``."""
    return hashlib.md5(str(i).encode()).hexdigest() + hashlib.md5(str(-i).encode()).hexdigest()


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(len(ordered) * q) - 1)]


def _p50(rounds: list[list[float]]) -> float:
    return statistics.median(x for r in rounds for x in r)


def _p99(rounds: list[list[float]]) -> float:
    """The median of the rounds' p99s: one round that met a checkpoint or the host's other work does not
    decide it alone."""
    return statistics.median(_p(r, 0.99) for r in rounds)


async def _grow(admin: asyncpg.Connection, loaded: int, rows: int) -> None:
    """Load rows ``loaded + 1 .. rows``: indexes dropped, then built again as they were."""
    indexes = await admin.fetch("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'inbox'")
    constraint = await admin.fetchval(
        "SELECT conname FROM pg_constraint WHERE conrelid = 'inbox'::regclass AND contype = 'p'")
    await admin.execute(f'ALTER TABLE inbox DROP CONSTRAINT "{constraint}"')
    for index in indexes:
        await admin.execute(f'DROP INDEX IF EXISTS "{index["indexname"]}"')
    for first in range(loaded + 1, rows + 1, CHUNK):
        await admin.execute(_LOAD, CONSUMER, first, min(rows, first + CHUNK - 1))
    await admin.execute("SET maintenance_work_mem = '2GB'")
    for index in indexes:
        await admin.execute(index["indexdef"])
    await admin.execute(f'ALTER TABLE inbox ADD CONSTRAINT "{constraint}" PRIMARY KEY USING INDEX "{constraint}"')
    await admin.execute("VACUUM (ANALYZE) inbox")


async def _measure(inbox: Inbox, database: Database, digests: Sequence[Sequence[str]], *, claim: bool) -> list[float]:
    samples = []
    async with database.connect() as ex:
        for candidates in digests:
            began = time.perf_counter()
            if claim:
                found = await inbox.claim(ex, CONSUMER, candidates, "f" * 64, namespace="orders", version=1)
                assert found.acquired, found.status
            else:
                assert await inbox.lookup(ex, CONSUMER, candidates) is not None
            samples.append((time.perf_counter() - began) * 1000)
    return samples


async def main() -> bool:
    async with bench_server(SERVER, wal_compression=WAL_COMPRESSION) as admin_url:
        return await _run(admin_url)


async def _run(admin_url: str) -> bool:
    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    digester = KeyDigester(HMAC_KEY.encode())
    measured: dict[int, dict[str, list[list[float]]]] = {}
    sizes: dict[int, tuple[int, int, int]] = {}
    timings: dict[int, float] = {}
    io_spent: dict[int, dict[str, list[float]]] = {n: {} for n in SIZES}
    print(f"inbox at scale ({datetime.now(UTC):%Y-%m-%d}): {PROBES} operations each, after {WARMUP} unmeasured "
          f"claims, sizes {', '.join(f'{n:,}' for n in SIZES)}", flush=True)
    async with migrated_database(admin_url) as dsn:
        engine = create_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"), pool_size=2)
        database = Database(engine)
        inbox = Inbox(database, lease_seconds=30, retention_seconds=604_800, tombstone_seconds=2_592_000)
        admin = await asyncpg.connect(dsn, command_timeout=None)
        try:
            await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
            statements = "pg_stat_statements" in await admin.fetchval("SHOW shared_preload_libraries")
            if statements:
                await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            settings = {name: await admin.fetchval(f"SHOW {name}") for name in SETTINGS}
            print("  " + ", ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
            loaded = 0
            for rows in SIZES:
                began = time.perf_counter()
                if loaded == 0:
                    await admin.execute(_LOAD, CONSUMER, 1, rows)
                    await admin.execute("VACUUM (ANALYZE) inbox")
                else:
                    await _grow(admin, loaded, rows)
                loaded = rows
                timings[rows] = time.perf_counter() - began
                # A server that has run for a while holds the key index in its buffers (every claim
                # touches a random page of it); a restored one reads it in over the first hours.
                await admin.execute("SELECT pg_prewarm('pk_inbox')")
                # Measured right after a checkpoint, as some claims always are: the first change to a
                # page after one writes the whole page to the WAL (whether one fell inside a run's few
                # seconds of claims was chance before: 0.82 full-page images a claim at 50 M rows, or none).
                await admin.execute("CHECKPOINT")
                tag = f"{rows}-{secrets.token_hex(3)}"
                warm = [digester.candidates(f"orders:v1:warm-{tag}-{i}") for i in range(WARMUP)]
                await _measure(inbox, database, warm, claim=True)
                measured[rows] = {}
                for round_ in range(ROUNDS):
                    probe = [digester.candidates(f"orders:v1:probe-{tag}-{round_}-{i}") for i in range(PROBES)]
                    old = [[_loaded_digest(random.randint(1, rows))] for _ in range(PROBES)]
                    for op, keys, claim in (("claim, new key", probe, True), ("duplicate, recent", probe, False),
                                            ("duplicate, old", old, False)):
                        if statements:
                            await admin.execute("SELECT pg_stat_statements_reset()")
                        measured[rows].setdefault(op, []).append(await _measure(inbox, database, keys, claim=claim))
                        if statements:
                            io = await admin.fetchrow(_IO)
                            spent = io_spent[rows].setdefault(op, [0.0] * len(io))
                            io_spent[rows][op] = [a + float(b) for a, b in zip(spent, io, strict=True)]
                sizes[rows] = (await admin.fetchval("SELECT pg_relation_size('inbox')"),
                               await admin.fetchval("SELECT pg_relation_size('pk_inbox')"),
                               await admin.fetchval("SELECT pg_relation_size('ix_inbox_expires_at')"))
                heap, key, expiry = (s / 1_048_576 for s in sizes[rows])
                line = ", ".join(f"{op} p50 {_p50(s):.3f} p99 {_p99(s):.3f}" for op, s in measured[rows].items())
                print(f"  {rows:>12,} rows (loaded in {timings[rows]:.0f} s; heap {heap:,.0f} MB, key index "
                      f"{key:,.0f} MB, expiry index {expiry:,.0f} MB): {line}", flush=True)
                for op, (calls, read, read_ms, written, fpi) in io_spent[rows].items():
                    print(f"    {op:<18} a statement: {read / calls:.3f} blocks read from outside shared_buffers"
                          f" ({read_ms / max(read, 1) * 1000:.0f} us each), {written / calls:.3f} written back,"
                          f" {fpi / calls:.3f} full-page images", flush=True)
        finally:
            await admin.close()
            await database.close()
            await engine.dispose()
    return _report(measured)


def _report(measured: dict[int, dict[str, list[list[float]]]]) -> bool:
    smallest, largest = SIZES[0], SIZES[-1]
    print(f"  p50 / p99 in ms{'':<8}" + "".join(f"{n:>22,}" for n in SIZES))
    for op in ("claim, new key", "duplicate, recent", "duplicate, old"):
        cells = "".join(f"{_p50(measured[n][op]):>12.3f} /{_p99(measured[n][op]):>7.3f}"
                        for n in SIZES)
        print(f"  {op:<22}{cells}")
    flat = True
    for op in ("claim, new key", "duplicate, recent"):
        ratio = _p99(measured[largest][op]) / _p99(measured[smallest][op])
        ok = ratio <= 1.5
        flat &= ok
        print(f"  {op}: p99 at {largest:,} rows / at {smallest:,}: {ratio:.2f}x (target <= 1.5x: "
              f"{'ok' if ok else 'NOT FLAT'})")
    return flat


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main()) else 1)
