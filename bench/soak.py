"""Issue 31's soak: the inbox at a fixed rate for a long while, with the sweeper running as in
production and one long transaction in the middle, printed minute by minute.

What runs, against a scratch PostgreSQL database migrated to head, on a server of the run's own configured as
production would be (``bench.common.production_settings``: ``shared_buffers`` a quarter of the host's memory,
autovacuum on, checkpoints every 15 minutes or 8 GB of WAL, ``wal_compression``), or with
``CK_BENCH_SOAK_SERVER=shared`` on the machine's server as it is configured:

- **the load**: new keys at a fixed rate (open loop: a key is started when its time comes, whether or
  not the ones before it have finished, at most ``CK_BENCH_SOAK_CONCURRENCY`` at once), each through the
  default path's statements: the claim in autocommit, then the completion in a transaction of its own,
  on one connection of the store's pool, as a delivery does;
- **the rate**: without ``CK_BENCH_SOAK_RATE``, a probe first drives keys as fast as they go (closed
  loop) for ``CK_BENCH_SOAK_PROBE_SECONDS``; the soak then runs at the seed's peak of 2,000 keys/s when
  85% of the probe's rate reaches it, and otherwise at 85% of the probe's rate (the highest this machine
  sustains, with room for the sweeper and autovacuum), rounded down to 50;
- **retention, scaled down**: ``INBOX_RETENTION_SECONDS`` of ``CK_BENCH_SOAK_RETENTION`` (120 s) and
  tombstones for ``CK_BENCH_SOAK_TOMBSTONE`` (240 s), so that the inbox and its tombstones reach their
  steady size within the run; the sweeper is the worker's own (``Inbox.sweep`` every
  ``SWEEP_INTERVAL_SECONDS``, batches of ``SWEEP_BATCH_SIZE``, paced by ``SWEEP_SHARE``, the settings'
  defaults; ``SWEEP_SHARE=1`` for batches back to back);
- **the long transaction**: from minute ``CK_BENCH_SOAK_LONG`` (``start,end``; by default from 45% to 65%
  of the run) a REPEATABLE READ transaction, as a report query opens, reads another table and stays
  open: its snapshot holds back what vacuum may remove in every table of the database;
- **autovacuum** as PostgreSQL ships it, with whatever the migrations set on the tables. Where the
  server runs with ``autovacuum = off`` (this machine's CI configuration does), the soak stands in for
  it on the two tables: every ``autovacuum_naptime`` it runs ``VACUUM`` (and ``ANALYZE``) on a table whose
  dead, inserted or changed rows passed autovacuum's thresholds (the server's settings, or the table's
  own storage parameters), throttled by the same cost delay and limit autovacuum uses.

Every minute: keys/s started and completed, claim p50/p99 (the claim statement's time, ms), rows swept
a second, the inbox's live and dead rows (``pg_stat_user_tables``), the inbox's heap and index size,
the tombstones' rows and total size, the longest sweep of the minute (seconds), the vacuums run on
either so far, the checkpoints so far, and the share of the
minute's completions that were heap-only updates (no index entries written). At the end, the steady-state
verdicts the issue names: every minute's claim p99 within 1.5x of the first minute's; the size flat
after the first retention period (the last five minutes grow by at most 5%); and rows swept at least
rows inserted, over the minutes after the first retention period.

``CK_BENCH_SOAK_LAYOUT=partitioned`` runs it on the partitioned inbox (``consumer_kit.store.partitions``), made
from the migrated plain table, with generations of ``CK_BENCH_SOAK_PARTITION_SECONDS`` (60), rotated by the
sweep; its sweep drops whole generations instead of deleting rows.

Run: ``python -m bench soak`` (``CK_BENCH_SOAK_MINUTES``, 20 by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field

import asyncpg

from bench.common import bench_server, migrated_database
from consumer_kit import Settings
from consumer_kit.keys import KeyDigester
from consumer_kit.store import Database, Inbox, create_engine, partitions, utcnow
from consumer_kit.store.pace import Pace

MINUTES = int(os.environ.get("CK_BENCH_SOAK_MINUTES", "20"))
RATE = int(os.environ.get("CK_BENCH_SOAK_RATE", "0"))
PROBE_SECONDS = float(os.environ.get("CK_BENCH_SOAK_PROBE_SECONDS", "30"))
RETENTION = int(os.environ.get("CK_BENCH_SOAK_RETENTION", "120"))
TOMBSTONE = int(os.environ.get("CK_BENCH_SOAK_TOMBSTONE", "240"))
CONCURRENCY = int(os.environ.get("CK_BENCH_SOAK_CONCURRENCY", "32"))
SERVER = os.environ.get("CK_BENCH_SOAK_SERVER", "own")
LAYOUT = os.environ.get("CK_BENCH_SOAK_LAYOUT", "plain")
PARTITION_SECONDS = float(os.environ.get("CK_BENCH_SOAK_PARTITION_SECONDS", "60"))
SEED_PEAK = 2000
HEADROOM = 0.85
CONSUMER = "soak"
HMAC_KEY = "bench-hmac-key-0123456789abcdef"


def _long_window() -> tuple[float, float]:
    """The long transaction's minutes (start, end)."""
    spec = os.environ.get("CK_BENCH_SOAK_LONG")
    if spec:
        start, end = (float(part) for part in spec.split(","))
        return start, end
    return round(MINUTES * 0.45, 1), round(MINUTES * 0.65, 1)


@dataclass
class Minute:
    """What one minute of the load did."""

    started: int = 0
    completed: int = 0
    claims: list[float] = field(default_factory=list)
    swept: int = 0
    sweep_seconds: float = 0.0  # the longest sweep that ended in the minute


class Load:
    """Keys through claim and completion, counted per minute."""

    def __init__(self, database: Database, inbox: Inbox) -> None:
        self.database = database
        self.inbox = inbox
        self.digester = KeyDigester(HMAC_KEY.encode())
        self.sequence = 0
        self.minute = Minute()
        self.failures = 0

    async def one(self) -> None:
        self.sequence += 1
        self.minute.started += 1
        digests = self.digester.candidates(f"soak:v1:{self.sequence}")
        async with self.database.connect() as ex:
            began = time.perf_counter()
            claim = await self.inbox.claim(ex, CONSUMER, digests, "fp", namespace="soak", version=1)
            self.minute.claims.append((time.perf_counter() - began) * 1000)
            assert claim.acquired and claim.lease_token is not None, claim.status
            async with ex.begin():
                done = await self.inbox.complete(ex, CONSUMER, claim.digest, claim.lease_token, outcome="processed")
        assert done, "a completion lost its lease"
        self.minute.completed += 1

    async def closed_loop(self, seconds: float) -> float:
        """Keys as fast as ``CONCURRENCY`` workers take them; keys a second."""
        deadline = time.perf_counter() + seconds
        count = 0

        async def worker() -> None:
            nonlocal count
            while time.perf_counter() < deadline:
                await self.one()
                count += 1

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return count / (time.perf_counter() - began)

    async def open_loop(self, rate: float, stop: asyncio.Event) -> None:
        """Start key ``n`` at ``n / rate`` seconds, at most ``CONCURRENCY`` at once, until ``stop``."""
        room = asyncio.Semaphore(CONCURRENCY)
        running: set[asyncio.Task[None]] = set()

        async def guarded() -> None:
            try:
                await self.one()
            except Exception:
                self.failures += 1
                logging.getLogger("bench.soak").exception("a key failed")
            finally:
                room.release()

        began = time.perf_counter()
        due = 0
        while not stop.is_set():
            target = int(rate * (time.perf_counter() - began))
            while due < target and not stop.is_set():
                await room.acquire()  # at the cap, the load falls behind: a minute's started rate shows it
                due += 1
                task = asyncio.create_task(guarded())
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(0.002)
        await asyncio.gather(*running, return_exceptions=True)


async def _sweep_forever(inbox: Inbox, load: Load, settings: _Defaults) -> None:
    """The sweep a worker runs every SWEEP_INTERVAL_SECONDS (``Inbox.sweep``), counted into the load's minute."""
    loop, interval = asyncio.get_running_loop(), settings.sweep_interval_seconds
    due = loop.time() + interval
    while True:  # from one sweep's start to the next, as the worker's
        await asyncio.sleep(max(0.0, due - loop.time()))
        due = loop.time() + interval
        began = time.perf_counter()
        swept = await inbox.sweep(batch_size=settings.sweep_batch_size,
                                  pace=Pace(settings.sweep_share, settings.sweep_interval_seconds / 2))
        load.minute.swept += swept
        load.minute.sweep_seconds = max(load.minute.sweep_seconds, time.perf_counter() - began)


class Autovacuum:
    """What autovacuum would do to the inbox and its tombstones, for a server that runs without it: the
    same thresholds (a table's storage parameters over the server's settings), checked every naptime,
    and the same cost-based throttle. Counts the vacuums it ran."""

    TABLES = ("inbox", "inbox_tombstones")

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.vacuums = 0

    async def forever(self) -> None:
        conn = await asyncpg.connect(self.dsn, command_timeout=None)
        try:
            server = {r["name"]: float(r["setting"]) for r in await conn.fetch(
                "SELECT name, setting FROM pg_settings"
                " WHERE name LIKE 'autovacuum%' AND vartype IN ('integer', 'real')")}
            limit = int(server["autovacuum_vacuum_cost_limit"])
            await conn.execute(f"SET vacuum_cost_delay = {server['autovacuum_vacuum_cost_delay']}")
            if limit > 0:
                await conn.execute(f"SET vacuum_cost_limit = {limit}")
            while True:
                await asyncio.sleep(server["autovacuum_naptime"])
                for table in self.TABLES:
                    await self._visit(conn, table, server)
        finally:
            await conn.close()

    async def _visit(self, conn: asyncpg.Connection, table: str, server: dict[str, float]) -> None:
        row = await conn.fetchrow(
            "SELECT c.reltuples, c.reloptions, s.n_dead_tup, s.n_ins_since_vacuum, s.n_mod_since_analyze"
            " FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.relname = $1", table)
        if row is None:  # the partitioned inbox's parent: its partitions are autovacuum's
            return
        own = dict(option.split("=", 1) for option in row["reloptions"] or [])

        def setting(name: str) -> float:
            return float(own.get(name, server[f"autovacuum_{name}"]))

        rows = max(0.0, float(row["reltuples"]))
        vacuum = (row["n_dead_tup"] > setting("vacuum_threshold") + setting("vacuum_scale_factor") * rows
                  or row["n_ins_since_vacuum"] > setting("vacuum_insert_threshold")
                  + setting("vacuum_insert_scale_factor") * rows)
        analyze = row["n_mod_since_analyze"] > setting("analyze_threshold") + setting("analyze_scale_factor") * rows
        if vacuum or analyze:
            await conn.execute(f"{'VACUUM' if vacuum else ''} ANALYZE {table}".strip())
            self.vacuums += vacuum


async def _autovacuum(stats: asyncpg.Connection, dsn: str) -> Autovacuum | None:
    """The stand-in for autovacuum, started, when the server runs without it."""
    if await stats.fetchval("SHOW autovacuum") == "on":
        return None
    return Autovacuum(dsn)


async def _long_transaction(dsn: str, opens_at: float, closes_at: float, began: float) -> None:
    """A report's transaction: REPEATABLE READ, one read, then open until ``closes_at`` (seconds into the run)."""
    await asyncio.sleep(max(0.0, began + opens_at - time.perf_counter()))
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await conn.fetchval("SELECT count(*) FROM soak_report")
        await asyncio.sleep(max(0.0, began + closes_at - time.perf_counter()))
        await conn.execute("COMMIT")
    finally:
        await conn.close()


class _Defaults:
    """The settings' defaults for the sweeper and the lease (the soak's own retention replaces theirs)."""

    def __init__(self) -> None:
        fields = Settings.model_fields
        self.sweep_interval_seconds = float(fields["sweep_interval_seconds"].default)
        self.sweep_batch_size = int(fields["sweep_batch_size"].default)
        self.sweep_share = float(os.environ.get("SWEEP_SHARE", fields["sweep_share"].default))
        self.inbox_lease_seconds = float(fields["inbox_lease_seconds"].default)


# The partitioned inbox's partitions count as the inbox (its parent holds no rows); counters are summed
# over the partitions there now, so the HOT share is taken from those there in both minutes.
_TABLES = """
SELECT relname, n_live_tup, n_dead_tup, autovacuum_count, n_tup_upd, n_tup_hot_upd, pg_relation_size(relid) AS heap,
       pg_indexes_size(relid) AS indexes
FROM pg_stat_user_tables WHERE relname IN ('inbox', 'inbox_tombstones') OR relname ~ '^inbox_p[0-9]+$'
"""
_SUMMED = ("n_live_tup", "n_dead_tup", "autovacuum_count", "heap", "indexes")


def _tables(rows: list[asyncpg.Record]) -> dict[str, dict[str, int]]:
    """``inbox`` (its partitions summed) and ``inbox_tombstones``."""
    tables: dict[str, dict[str, int]] = {name: dict.fromkeys(_SUMMED, 0) for name in ("inbox", "inbox_tombstones")}
    for row in rows:
        into = tables["inbox_tombstones" if row["relname"] == "inbox_tombstones" else "inbox"]
        for name in _SUMMED:
            into[name] += int(row[name])
    return tables


def _updates(rows: list[asyncpg.Record]) -> dict[str, tuple[int, int]]:
    """The inbox's (or each partition's) updates and heap-only ones so far."""
    return {r["relname"]: (int(r["n_tup_upd"]), int(r["n_tup_hot_upd"])) for r in rows
            if r["relname"] != "inbox_tombstones"}


def _hot_share(before: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]]) -> float:
    common = now.keys() & before.keys()
    updates = sum(now[n][0] - before[n][0] for n in common) + sum(now[n][0] for n in now.keys() - common)
    hot = sum(now[n][1] - before[n][1] for n in common) + sum(now[n][1] for n in now.keys() - common)
    return hot / max(1, updates)


_CHECKPOINTS = "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
_SETTINGS = ("shared_buffers", "max_wal_size", "checkpoint_timeout", "wal_compression", "synchronous_commit",
             "autovacuum", "autovacuum_vacuum_cost_delay", "autovacuum_vacuum_cost_limit", "server_version")


def _mb(size: int) -> str:
    return f"{size / 1_048_576:7.1f}"


async def main() -> bool:
    logging.getLogger("consumer_kit").setLevel(logging.WARNING)
    settings = _Defaults()
    opens, closes = _long_window()
    async with bench_server(SERVER) as admin_url, migrated_database(admin_url) as dsn:
        engine = create_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"), pool_size=CONCURRENCY)
        database = Database(engine)
        stats = await asyncpg.connect(dsn)
        if LAYOUT == "partitioned":
            await partitions.partition(stats, seconds=PARTITION_SECONDS, now=utcnow())
        inbox = Inbox(database, lease_seconds=settings.inbox_lease_seconds, retention_seconds=RETENTION,
                      tombstone_seconds=TOMBSTONE, partitioned=LAYOUT == "partitioned")
        await stats.execute("CREATE TABLE soak_report AS SELECT i AS id FROM generate_series(1, 1000) i")
        load = Load(database, inbox)
        try:
            probed = None
            if RATE:
                rate = RATE
            else:
                probed = await load.closed_loop(PROBE_SECONDS)
                rate = SEED_PEAK if probed * HEADROOM >= SEED_PEAK else math.floor(probed * HEADROOM / 50) * 50
                # The probe's rows are old news: start the soak on an empty inbox.
                await stats.execute("TRUNCATE inbox, inbox_tombstones")
                load.minute = Minute()
            rows = await _soak(dsn, load, inbox, settings, rate, stats, opens, closes)
        finally:
            await stats.close()
            await database.close()
            await engine.dispose()
    return _report(rows, rate, probed, settings, opens, closes, load.failures)


@dataclass
class Row:
    minute: int
    started: float
    completed: float
    p50: float
    p99: float
    swept: float
    live: int
    dead: int
    heap: int
    indexes: int
    tomb_rows: int
    tomb_size: int
    sweep_seconds: float
    vacuums: int
    checkpoints: int
    hot: float
    long_open: bool

    def line(self) -> str:
        cells = (f"{self.minute:3d} {self.started:9.0f} {self.completed:7.0f} {self.p50:9.3f} {self.p99:7.3f}"
                 f" {self.swept:8.0f} {self.live:8d} {self.dead:8d} {_mb(self.heap)} {_mb(self.indexes)}"
                 f" {self.tomb_rows:8d} {_mb(self.tomb_size)} {self.sweep_seconds:7.1f} {self.vacuums:4d}"
                 f" {self.checkpoints:4d} {self.hot:4.0%}")
        return f"  {cells}{'  long transaction' if self.long_open else ''}"


_COLUMNS = (("min", 3), ("started/s", 9), ("done/s", 7), ("claim p50", 9), ("p99 ms", 7), ("swept/s", 8),
            ("live", 8), ("dead", 8), ("heap MB", 7), ("idx MB", 7), ("tombs", 8), ("tomb MB", 7), ("sweep s", 7),
            ("vac", 4), ("ckpt", 4), ("hot", 4))


async def _soak(dsn: str, load: Load, inbox: Inbox, settings: _Defaults, rate: int,
                stats: asyncpg.Connection, opens: float, closes: float) -> list[Row]:
    print(f"soak: {rate} keys/s for {MINUTES} min; retention {RETENTION} s, tombstones {TOMBSTONE} s, sweep every "
          f"{settings.sweep_interval_seconds:.0f} s in batches of {settings.sweep_batch_size} (working "
          f"{settings.sweep_share:.0%} of its time, SWEEP_SHARE); a REPEATABLE READ "
          f"transaction open from minute {opens:g} to {closes:g}", flush=True)
    shown = [f"{name} {await stats.fetchval(f'SHOW {name}')}" for name in _SETTINGS]
    where = "the run's own server" if SERVER == "own" else "the machine's server"
    print(f"  {where}: {', '.join(shown)}", flush=True)
    if inbox.partitioned:
        print(f"  the partitioned inbox: generations of {PARTITION_SECONDS:g} s (rotated by the sweep), which leave"
              " whole; its tombstones are its expired rows (the tombs columns count the old table's)", flush=True)
    vacuum = await _autovacuum(stats, dsn)
    if vacuum is not None:
        print("  autovacuum is off on this server: the soak runs VACUUM where autovacuum would (see its docstring)",
              flush=True)
    print("  " + " ".join(f"{name:>{width}}" for name, width in _COLUMNS), flush=True)
    stop = asyncio.Event()
    began = time.perf_counter()
    driver = asyncio.create_task(load.open_loop(rate, stop))
    tasks = [asyncio.create_task(_sweep_forever(inbox, load, settings)),
             asyncio.create_task(_long_transaction(dsn, opens * 60, closes * 60, began))]
    if vacuum is not None:
        tasks.append(asyncio.create_task(vacuum.forever()))
    rows: list[Row] = []
    hot: dict[str, tuple[int, int]] = {}  # the inbox's updates and heap-only ones, so far
    checkpoints = await stats.fetchval(_CHECKPOINTS)
    try:
        for minute in range(1, MINUTES + 1):
            await asyncio.sleep(max(0.0, began + minute * 60 - time.perf_counter()))
            done, load.minute = load.minute, Minute()
            seen = await stats.fetch(_TABLES)
            tables = _tables(seen)
            ibx, tmb = tables["inbox"], tables["inbox_tombstones"]
            claims = sorted(done.claims) or [0.0]
            row = Row(minute, done.started / 60, done.completed / 60, statistics.median(claims),
                      claims[max(0, math.ceil(len(claims) * 0.99) - 1)], done.swept / 60, ibx["n_live_tup"],
                      ibx["n_dead_tup"], ibx["heap"], ibx["indexes"], tmb["n_live_tup"], tmb["heap"] + tmb["indexes"],
                      done.sweep_seconds,
                      ibx["autovacuum_count"] + tmb["autovacuum_count"] + (vacuum.vacuums if vacuum else 0),
                      await stats.fetchval(_CHECKPOINTS) - checkpoints,
                      _hot_share(hot, _updates(seen)), long_open=minute - 1 < closes and minute > opens)
            rows.append(row)
            hot = _updates(seen)
            print(row.line(), flush=True)
    finally:
        stop.set()
        await driver
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return rows


def _report(rows: list[Row], rate: int, probed: float | None, settings: _Defaults, opens: float, closes: float,
            failures: int) -> bool:
    if probed is not None:
        why = "the seed's peak" if rate == SEED_PEAK else f"{HEADROOM:.0%} of it"
        print(f"  probe: {probed:.0f} keys/s as fast as {CONCURRENCY} at once go (closed loop, {PROBE_SECONDS:.0f} s);"
              f" soak rate {rate} keys/s ({why})")
    first = rows[0].p99
    worst = max(rows, key=lambda r: r.p99)
    p99_ok = worst.p99 <= 1.5 * first
    print(f"  claim p99: first minute {first:.3f} ms, worst {worst.p99:.3f} ms (minute {worst.minute}), "
          f"{worst.p99 / first:.2f}x (target <= 1.5x: {'ok' if p99_ok else 'NOT STEADY'})")
    # The first retention period, swept; the partitioned inbox's first generation leaves only once its
    # tombstones are over too (a generation and a sweep interval later at most).
    interval = settings.sweep_interval_seconds
    kept = RETENTION + (TOMBSTONE + PARTITION_SECONDS + interval if LAYOUT == "partitioned" else 0)
    settled = math.ceil((kept + settings.sweep_interval_seconds) / 60)
    after = rows[settled:]
    size = [r.heap + r.indexes + r.tomb_size for r in rows]
    tail = size[-5:]
    growth = tail[-1] / tail[0] - 1 if len(tail) > 1 else 0.0
    size_ok = growth <= 0.05
    steady = min(settled, len(size) - 1)
    print(f"  size (inbox, its indexes and tombstones): {size[steady] / 1_048_576:.1f} MB after minute {steady + 1}"
          f", peak {max(size) / 1_048_576:.1f} MB, end {size[-1] / 1_048_576:.1f} MB; the last five "
          f"minutes grew {growth:+.1%} (target <= +5%: {'ok' if size_ok else 'NOT FLAT'})")
    inserted = sum(r.completed for r in after) * 60
    swept = sum(r.swept for r in after) * 60
    # In a steady state the rows that expire in a window are the ones inserted a retention before it, at
    # the same rate; the sweep's last batch of the run may still be due, hence the 5%.
    sweep_ok = bool(after) and swept >= 0.95 * inserted
    print(f"  after minute {settled}: {swept:.0f} rows swept for {inserted:.0f} inserted "
          f"({swept / max(inserted, 1):.2f}; target >= 0.95: {'ok' if sweep_ok else 'BEHIND'})")
    behind = [r.minute for r in rows if r.started < 0.98 * rate]
    print(f"  load: {'every minute at rate' if not behind else f'below 98% of the rate in minutes {behind}'}"
          f"; {failures} keys failed")
    return p99_ok and size_ok and sweep_ok and not behind and failures == 0


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main()) else 1)
