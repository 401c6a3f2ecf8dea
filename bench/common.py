"""Shared benchmark plumbing: a throw-away PostgreSQL database, a fixed-concurrency driver, and what
``/proc`` says of a process's CPU and its TCP connections."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import asyncpg

PG_ADMIN = os.environ.get("CK_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

T = TypeVar("T")


@contextlib.asynccontextmanager
async def scratch_database(admin_url: str = PG_ADMIN) -> AsyncIterator[str]:
    """A new PostgreSQL database for one benchmark run (on the server of ``admin_url``); yields its plain
    URL and drops it after."""
    name = f"ck_bench_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        admin = await asyncpg.connect(admin_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


def production_settings(wal_compression: str = "lz4") -> dict[str, str]:
    """A production server's settings for this host: ``shared_buffers`` a quarter of its memory (at most
    8 GB), ``effective_cache_size`` half, ``max_wal_size`` 8 GB and ``checkpoint_timeout`` 15 minutes,
    autovacuum on, ``wal_compression`` (past a checkpoint, a page's first change writes the whole page to the
    WAL), and pg_stat_statements loaded with I/O timing, so that a run can say where a statement's time went."""
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1_048_576
    return {"shared_buffers": f"{min(8192, max(128, memory_mb // 4))}MB",
            "effective_cache_size": f"{memory_mb // 2}MB", "max_wal_size": "8GB", "checkpoint_timeout": "15min",
            "autovacuum": "on", "wal_compression": wal_compression,
            "shared_preload_libraries": "pg_stat_statements", "track_io_timing": "on"}


@contextlib.asynccontextmanager
async def bench_server(kind: str, *, wal_compression: str = "lz4") -> AsyncIterator[str]:
    """The PostgreSQL server a store benchmark runs on; yields its admin URL. ``own``: a throwaway cluster of
    the run's own (``initdb`` in a temporary directory, as the chaos suite's crash runs do) with
    :func:`production_settings`; ``shared``: the machine's server (``CK_BENCH_PG_ADMIN_URL``) as it is
    configured (Debian's 128 MB of ``shared_buffers``; CI's has autovacuum off)."""
    if kind == "shared":
        yield PG_ADMIN
        return
    if kind != "own":
        raise ValueError(f"a benchmark server is 'own' or 'shared', not {kind!r}")
    from tests.chaos.server import OwnServer  # the repository's throwaway cluster, as for the crash runs

    server = OwnServer(production_settings(wal_compression))
    await asyncio.to_thread(server.start)
    try:
        yield server.admin_url
    finally:
        await asyncio.to_thread(server.remove)


@contextlib.asynccontextmanager
async def migrated_database(admin_url: str = PG_ADMIN) -> AsyncIterator[str]:
    """:func:`scratch_database` with consumer-kit's schema at head; yields its plain URL."""
    from consumer_kit.store import create_engine, upgrade

    async with scratch_database(admin_url) as dsn:
        engine = create_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"))
        try:
            await upgrade(engine)
        finally:
            await engine.dispose()
        yield dsn


@contextlib.asynccontextmanager
async def queue_database() -> AsyncIterator[str]:
    """:func:`scratch_database` migrated to head, with the hand-rolled peers' inbox and effect tables
    (the queue benchmarks' handlers all write one ``bench_effects`` row); yields its plain URL."""
    from sqlalchemy import text

    from consumer_kit.store import create_engine, upgrade

    async with scratch_database() as dsn:
        engine = create_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"))
        try:
            await upgrade(engine)
            async with engine.begin() as conn:
                await conn.execute(text("CREATE TABLE bench_inbox (message_id text PRIMARY KEY)"))
                await conn.execute(text("CREATE TABLE bench_effects (id bigserial PRIMARY KEY, body text NOT NULL)"))
        finally:
            await engine.dispose()
        yield dsn


class PeakConnections:
    """The most connections seen at once on one database while the block runs (sampled every 10 ms,
    the sampler's own excluded): how benchmarks show that contenders used alike many. ``apart``: the
    ``application_name`` of connections counted apart (``apart_peak``), for two contenders running
    side by side."""

    def __init__(self, dsn: str, *, apart: str | None = None) -> None:
        self.dsn = dsn
        self.apart = apart
        self.peak = 0
        self.apart_peak = 0

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[PeakConnections]:
        self.peak = self.apart_peak = 0
        sampler = await asyncpg.connect(self.dsn)
        stop = asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                total, apart = await sampler.fetchrow(
                    "SELECT count(*), count(*) FILTER (WHERE application_name = $1) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()", self.apart)
                self.peak = max(self.peak, int(total) - int(apart))
                self.apart_peak = max(self.apart_peak, int(apart))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.01)

        task = asyncio.create_task(sample())
        try:
            yield self
        finally:
            stop.set()
            await task
            await sampler.close()


async def drive(items: Sequence[T], work: Callable[[T], Awaitable[object]], concurrency: int) -> float:
    """Run ``work`` over ``items`` with ``concurrency`` workers; return items per second."""
    queue: asyncio.Queue[T] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)

    async def worker() -> None:
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await work(item)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(items) / (time.perf_counter() - started)


def verdict(ratio: float, target: float) -> str:
    """``ok`` or ``BELOW TARGET``, for a ratio against its target."""
    return "ok" if ratio >= target else "BELOW TARGET"


# --- what /proc says ----------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def host_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host so far."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def local_ports(pid: int, remote_port: int) -> set[int]:
    """The local ports of ``pid``'s TCP connections to ``remote_port`` (its sockets' inodes, looked up in
    the kernel's tables): what ``pg_stat_activity.client_port`` names a process's backends by."""
    inodes = set()
    with contextlib.suppress(FileNotFoundError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as lines:
            next(lines)
            for line in lines:
                parts = line.split()
                if parts[9] in inodes and int(parts[2].rsplit(":", 1)[1], 16) == remote_port:
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports
