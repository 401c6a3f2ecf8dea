"""Many workers on one queue and one database: 1, 2 and 4 ``consumer-kit run`` processes (the command as
users run it, the app :mod:`bench.scaleout_app`) drain one RabbitMQ queue into one PostgreSQL database,
and where the time goes is measured, so that a fleet can be sized from it.

A run declares a fresh queue, publishes a backlog of ``N`` messages (persistent, with confirms, each
with an AMQP ``message_id`` of its own), starts ``n`` workers and waits until the broker counts ``n``
consumers on the queue: the window starts there (no publishing and no start-up inside it) and ends at
the last effect row's commit time. Over the window:

- throughput: effect rows committed in the window over its length; efficiency = the rate over ``n``
  times the one-worker rate;
- CPU per message: the workers' processes (summed), their database backends (found by their sockets'
  ports in ``pg_stat_activity.client_port``) and RabbitMQ's ``beam.smp`` (it serves the host's other
  users too), from ``/proc``; and how many cores each kept busy, with the whole host's (everyone's);
- database work per message, over the whole run (start-up included, a few dozen statements a worker,
  the workers stopped first so that their backends have reported): commits (``xact_commit``; a
  statement outside a transaction is a commit of its own) and rows inserted, updated and deleted, from
  ``pg_stat_database`` for the scratch database.

Round trips and statements a message are counted apart, by one worker through a counting proxy in front
of PostgreSQL (it reads the server's replies: one ReadyForQuery ends a round trip, one CommandComplete a
statement) on a smaller backlog: the proxy costs time, so its run's rate is not in the table.

Checked every run: every message's effect happened exactly once (rows = messages, one row an id, every
id published), every inbox row is completed, nothing is left in the queue or parked on its dead-letter
queue, and every worker exits 0 on SIGTERM.

``CK_BENCH_N`` (messages a run, default 20000), ``CK_BENCH_SCALEOUT_WORKERS`` (``1,2,4``),
``CK_BENCH_SCALEOUT_PATHS`` (``two``; ``two,single`` adds ``single_transaction=True``),
``CK_BENCH_SCALEOUT_COUNTED`` (the proxied run's messages, default 2000; 0 skips it),
``CK_BENCH_POOL`` (``DB_POOL_SIZE`` a worker, default 8), ``CK_BENCH_SCALEOUT_PREFETCH`` (32),
``CK_BENCH_PG_ADMIN_URL``, ``CK_BENCH_AMQP_URL``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import signal
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aio_pika
import asyncpg

from bench.common import cpu_seconds, host_jiffies, local_ports, migrated_database
from bench.scaleout_app import EFFECTS_DDL
from consumer_kit.sources.rabbitmq import DEFAULT_RETRY_DELAYS

AMQP_URL = os.environ.get("CK_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
N = int(os.environ.get("CK_BENCH_N", "20000"))
WORKERS = tuple(int(n) for n in os.environ.get("CK_BENCH_SCALEOUT_WORKERS", "1,2,4").split(","))
PATHS = tuple(os.environ.get("CK_BENCH_SCALEOUT_PATHS", "two").split(","))
COUNTED = int(os.environ.get("CK_BENCH_SCALEOUT_COUNTED", "2000"))
POOL = int(os.environ.get("CK_BENCH_POOL", "8"))
PREFETCH = int(os.environ.get("CK_BENCH_SCALEOUT_PREFETCH", "32"))
DRAIN_TIMEOUT = 600.0
ROOT = Path(__file__).resolve().parents[1]
CORES = os.cpu_count() or 1
PATH_LABELS = {"two": "default path (two transactions)", "single": "single_transaction=True"}


# --- what /proc says ----------------------------------------------------------------------------------


def _broker_pid() -> int | None:
    """RabbitMQ's Erlang VM (``beam.smp``) on this host, if there is one to see."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{entry}/comm").read_text().strip() == "beam.smp":
                    return int(entry)
    return None


# --- counting round trips ------------------------------------------------------------------------------


@dataclass
class Counts:
    """What the counting proxy saw PostgreSQL answer."""

    round_trips: int = 0
    statements: int = 0


class CountingProxy:
    """A TCP proxy in front of PostgreSQL that counts, in the server's replies, ReadyForQuery messages
    (one a round trip: a simple query or an extended-protocol Sync) and CommandComplete messages (one a
    statement). Hand-written: a few lines of the wire protocol's framing (a type byte, a length), where a
    protocol library would be a dependency for a benchmark; it needs TLS off (``ssl`` is off here)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.counts = Counts()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[CountingProxy]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        try:
            yield self
        finally:
            self._server.close()
            for task in list(self._pipes):
                task.cancel()
            await asyncio.gather(*self._pipes, return_exceptions=True)
            await self._server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.target)
        up = asyncio.create_task(self._pipe(client_reader, server_writer, count=False))
        down = asyncio.create_task(self._pipe(server_reader, client_writer, count=True))
        self._pipes |= {up, down}
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            self._pipes -= {up, down}
            for writer in (client_writer, server_writer):
                writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: bool) -> None:
        pending = b""
        first = True
        while data := await reader.read(65536):
            writer.write(data)
            if count:
                pending += data
                if first and pending[:1] == b"N":  # the answer to asyncpg's SSLRequest: no TLS, one byte
                    pending = pending[1:]
                first = False
                pending = self._count(pending)
            await writer.drain()

    def _count(self, buffer: bytes) -> bytes:
        at = 0
        while len(buffer) - at >= 5:
            kind = buffer[at : at + 1]
            (length,) = struct.unpack_from("!i", buffer, at + 1)
            if len(buffer) - at < 1 + length:
                break
            if kind == b"Z":
                self.counts.round_trips += 1
            elif kind == b"C":
                self.counts.statements += 1
            at += 1 + length
        return buffer[at:]


# --- one run ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One drain of ``messages`` by ``workers`` workers."""

    path: str
    workers: int
    messages: int
    window: float = 0.0
    in_window: int = 0
    worker_cpu: float = 0.0
    db_cpu: float = 0.0
    broker_cpu: float | None = None
    host_busy: float = 0.0
    backends: int = 0
    backends_seen: int = 0
    database: dict[str, int] = field(default_factory=dict)
    counted: Counts | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.in_window / self.window if self.window > 0 else 0.0

    def per_message(self, seconds: float) -> float:
        """CPU milliseconds a message."""
        return 1000 * seconds / max(1, self.in_window)

    def cores(self, seconds: float) -> float:
        return seconds / self.window if self.window > 0 else 0.0


DATABASE_COUNTERS = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_deleted")


async def _database_counters(stats: asyncpg.Connection) -> dict[str, int]:
    await stats.execute("SELECT pg_stat_clear_snapshot()")  # a fresh read, not this transaction's cached one
    row = await stats.fetchrow(
        f"SELECT {', '.join(DATABASE_COUNTERS)} FROM pg_stat_database WHERE datname = current_database()"
    )
    assert row is not None
    return {name: int(row[name]) for name in DATABASE_COUNTERS}


async def _publish(queue: str, count: int) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True)
        for start in range(0, count, 1000):
            await asyncio.gather(
                *(
                    channel.default_exchange.publish(
                        aio_pika.Message(
                            b'{"order": %d}' % i,
                            message_id=f"{queue}-{i}",
                            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        ),
                        routing_key=queue,
                    )
                    for i in range(start, min(count, start + 1000))
                )
            )


async def _queue_state(channel: aio_pika.abc.AbstractChannel, queue: str) -> tuple[int, int]:
    """(ready messages, consumers) of ``queue``."""
    declared = await channel.declare_queue(queue, passive=True)
    result = declared.declaration_result
    return int(result.message_count or 0), int(result.consumer_count or 0)


async def _delete_queues(queue: str) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        for suffix in ("", ".dlq", *(f".retry.{round(d * 1000)}ms" for d in DEFAULT_RETRY_DELAYS)):
            await channel.queue_delete(queue + suffix, if_unused=False, if_empty=False)


def _worker_env(dsn: str, queue: str, path: str, hmac_key: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": dsn,
        "IDEMPOTENCY_HMAC_KEY": hmac_key,
        "RABBITMQ_URL": AMQP_URL,
        "DB_POOL_SIZE": str(POOL),
        "SCALEOUT_QUEUE": queue,
        "SCALEOUT_PATH": path,
        "SCALEOUT_PREFETCH": str(PREFETCH),
        "SHUTDOWN_GRACE_SECONDS": "10",
    }


async def _start_workers(count: int, env: dict[str, str], logs: Path) -> list[asyncio.subprocess.Process]:
    """``count`` workers, each logging to a file of its own in ``logs`` (a folder for this run)."""
    command = [
        str(Path(sys.executable).with_name("consumer-kit")),
        "run",
        "--log-level",
        "WARNING",
        "bench.scaleout_app:app",
    ]
    workers = []
    for i in range(count):
        with (logs / f"worker-{i}.log").open("ab") as log:
            workers.append(await asyncio.create_subprocess_exec(*command, cwd=ROOT, env=env, stdout=log, stderr=log))
    return workers


async def _stop_workers(workers: list[asyncio.subprocess.Process], run: Run, logs: Path) -> None:
    for worker in workers:
        if worker.returncode is None:
            worker.send_signal(signal.SIGTERM)
    for i, worker in enumerate(workers):
        try:
            code = await asyncio.wait_for(worker.wait(), timeout=60)
        except TimeoutError:
            worker.kill()
            code = await worker.wait()
        if code != 0:
            run.problems.append(f"worker {i} exited {code}: {_tail(logs)}")


def _tail(logs: Path) -> str:
    """The last lines the workers logged, for an error."""
    return " | ".join(
        line
        for log in sorted(logs.glob("worker-*.log"))
        for line in log.read_text(errors="replace").strip().splitlines()[-3:]
    )


class BackendCpu:
    """The CPU of the workers' database backends over the window, sampled every tenth of a second: a
    pool may open and close connections under way (SQLAlchemy's overflow), so a backend first seen
    after the window opened counts from its start, and one that ended counts up to its last sample (the
    last tenth of a second of a backend that ends is missed)."""

    def __init__(self) -> None:
        self.seen: dict[int, list[float]] = {}  # pid: [CPU when the window opened (0 if later), last seen]
        self.peak = 0

    async def sample(
        self, stats: asyncpg.Connection, workers: list[asyncio.subprocess.Process], *, opening: bool = False
    ) -> None:
        ports: set[int] = set()
        for worker in workers:
            ports |= local_ports(worker.pid, 5432)
        rows = await stats.fetch("SELECT pid, client_port FROM pg_stat_activity WHERE datname = current_database()")
        pids = [int(r["pid"]) for r in rows if r["client_port"] in ports]
        self.peak = max(self.peak, len(pids))
        for pid in pids:
            used = cpu_seconds(pid)
            if used:
                self.seen.setdefault(pid, [used if opening else 0.0, used])[1] = used

    @property
    def seconds(self) -> float:
        return sum(last - first for first, last in self.seen.values())


async def _drain(
    path: str,
    count: int,
    workers_wanted: int,
    dsn: str,
    stats: asyncpg.Connection,
    hmac_key: str,
    logs: Path,
    proxy: CountingProxy | None = None,
) -> Run:
    """Publish ``count`` messages, let ``workers_wanted`` workers drain them, measure and check."""
    run = Run(path, workers_wanted, count)
    await stats.execute("TRUNCATE scaleout_effects, inbox, inbox_tombstones")
    await stats.execute("VACUUM ANALYZE scaleout_effects, inbox, inbox_tombstones")
    queue = f"ck-bench-scaleout-{secrets.token_hex(3)}"
    worker_dsn = dsn if proxy is None else dsn.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    logs = logs / queue
    logs.mkdir()
    await _publish(queue, count)
    connection = await aio_pika.connect(AMQP_URL)
    broker = _broker_pid()
    before = await _database_counters(stats)
    workers = await _start_workers(workers_wanted, _worker_env(worker_dsn, queue, path, hmac_key), logs)
    try:
        async with connection:
            channel = await connection.channel()
            deadline = time.monotonic() + 120
            while (await _queue_state(channel, queue))[1] < workers_wanted:
                if time.monotonic() > deadline or any(w.returncode is not None for w in workers):
                    raise RuntimeError(f"the workers did not all start consuming: {_tail(logs)}")
                await asyncio.sleep(0.02)
            # the window opens: every worker consumes
            started_at = await stats.fetchval("SELECT clock_timestamp()")
            backends = BackendCpu()
            await backends.sample(stats, workers, opening=True)
            cpu = {w.pid: cpu_seconds(w.pid) for w in workers}
            broker_cpu = cpu_seconds(broker) if broker else 0.0
            host = host_jiffies()
            counted = Counts(proxy.counts.round_trips, proxy.counts.statements) if proxy else None
            deadline = time.monotonic() + DRAIN_TIMEOUT
            while int(await stats.fetchval("SELECT count(*) FROM scaleout_effects")) < count:
                if time.monotonic() > deadline or any(w.returncode is not None for w in workers):
                    raise RuntimeError(f"the backlog was not drained: {_tail(logs)}")
                await backends.sample(stats, workers)
                await asyncio.sleep(0.1)
            # the window closes at the last effect's commit time; CPU is read now (the workers are idle)
            worker_cpu = sum(cpu_seconds(w.pid) - cpu[w.pid] for w in workers)
            await backends.sample(stats, workers)
            run.db_cpu, run.backends, run.backends_seen = backends.seconds, backends.peak, len(backends.seen)
            run.broker_cpu = cpu_seconds(broker) - broker_cpu if broker else None
            host_after = host_jiffies()
            if proxy is not None and counted is not None:
                run.counted = Counts(
                    proxy.counts.round_trips - counted.round_trips, proxy.counts.statements - counted.statements
                )
            window = await stats.fetchrow(
                "SELECT count(*) AS n, extract(epoch FROM max(done_at) - $1) AS seconds FROM scaleout_effects"
                " WHERE done_at > $1",
                started_at,
            )
            assert window is not None
            run.in_window, run.window = int(window["n"]), float(window["seconds"] or 0.0)
            run.worker_cpu = worker_cpu
            run.host_busy = (host_after[0] - host[0]) / max(1, host_after[1] - host[1]) * CORES
            await asyncio.sleep(0.5)  # the last acks
            ready, _ = await _queue_state(channel, queue)
            parked, _ = await _queue_state(channel, f"{queue}.dlq")
            if ready or parked:
                run.problems.append(f"{ready} message(s) left on the queue, {parked} parked")
    finally:
        await _stop_workers(workers, run, logs)
        await _delete_queues(queue)
    # the workers' backends have ended, so they have reported their counters
    await asyncio.sleep(0.5)
    end = await _database_counters(stats)
    run.database = {name: end[name] - before[name] for name in DATABASE_COUNTERS}
    await _check_exactly_once(stats, queue, count, run)
    return run


async def _check_exactly_once(stats: asyncpg.Connection, queue: str, count: int, run: Run) -> None:
    rows, ids, published = await stats.fetchrow(
        "SELECT count(*), count(DISTINCT message_id), count(DISTINCT message_id) FILTER (WHERE message_id = ANY($1))"
        " FROM scaleout_effects",
        [f"{queue}-{i}" for i in range(count)],
    )
    if not rows == ids == published == count:
        run.problems.append(f"{rows} effect rows, {ids} ids, {published} of them published, for {count} messages")
    completed = await stats.fetchval("SELECT count(*) FROM inbox WHERE state = 'completed'")
    if completed != count:
        run.problems.append(f"{completed} completed inbox rows for {count} messages")


# --- the whole benchmark -----------------------------------------------------------------------------


async def main() -> bool:
    """Drain the backlog with 1, 2 and 4 workers on each path, print the table; ``True`` when every
    message's effect happened exactly once in every run (the rates have no target: they are for sizing)."""
    hmac_key = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
    runs: dict[str, list[Run]] = {}
    counted: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="ck-bench-scaleout-") as folder:
        logs = Path(folder)
        async with migrated_database() as dsn:
            stats = await asyncpg.connect(dsn)
            try:
                await stats.execute(EFFECTS_DDL)
                for path in PATHS:
                    for workers in WORKERS:
                        runs.setdefault(path, []).append(await _drain(path, N, workers, dsn, stats, hmac_key, logs))
                    if COUNTED:
                        async with CountingProxy("127.0.0.1", 5432).running() as proxy:
                            counted[path] = await _drain(path, COUNTED, 1, dsn, stats, hmac_key, logs, proxy)
            finally:
                await stats.close()
    _report(runs, counted)
    return not any(run.problems for run in [*(r for rs in runs.values() for r in rs), *counted.values()])


def _report(runs: dict[str, list[Run]], counted: dict[str, Run]) -> None:
    print(
        f"scaleout: {N} messages a run on one RabbitMQ queue, drained by n `consumer-kit run` workers into one "
        f"PostgreSQL database (prefetch {PREFETCH}, DB_POOL_SIZE {POOL}); one effect row a message through "
        f"ctx.db. This host has {CORES} cores, shared by the workers, PostgreSQL, RabbitMQ, this driver and "
        f"the host's other users: with more workers than cores the table measures contention, not capacity."
    )
    print(
        "  CPU in ms a message (workers summed, their database backends, RabbitMQ's beam.smp); busy in cores "
        "over the window (host: everyone's); per message over the whole run: commits and rows written; "
        "rollbacks in the whole run (start-up's included); database connections: most at once, and how many "
        "backends were seen in the window"
    )
    header = (
        f"  {'path':<32} {'n':>2} {'msg/s':>6} {'eff':>5} | {'cpu ms/msg: wrk':>15} {'db':>5} {'mq':>5}"
        f" | {'busy: wrk':>9} {'db':>4} {'mq':>4} {'host':>4} | {'commit':>6} {'ins':>4} {'upd':>4} {'del':>4}"
        f" {'rb':>3} | {'conns':>5} {'seen':>4}"
    )
    print(header)
    for path, path_runs in runs.items():
        base = path_runs[0].rate / path_runs[0].workers if path_runs and path_runs[0].rate else 0.0
        for run in path_runs:
            efficiency = run.rate / (run.workers * base) if base else 0.0
            broker = run.broker_cpu or 0.0
            per = {name: value / run.messages for name, value in run.database.items()}
            print(
                f"  {PATH_LABELS.get(path, path):<32} {run.workers:>2} {run.rate:6.0f} {efficiency:5.2f} | "
                f"{run.per_message(run.worker_cpu):15.2f} {run.per_message(run.db_cpu):5.2f} "
                f"{run.per_message(broker):5.2f} | {run.cores(run.worker_cpu):9.2f} {run.cores(run.db_cpu):4.2f} "
                f"{run.cores(broker):4.2f} {run.host_busy:4.2f} | {per['xact_commit']:6.2f} "
                f"{per['tup_inserted']:4.2f} {per['tup_updated']:4.2f} {per['tup_deleted']:4.2f} | "
                f"{run.database['xact_rollback']:>3} | {run.backends:>5} {run.backends_seen:>4}"
            )
    for path, run in counted.items():
        if run.counted:
            print(
                f"  {PATH_LABELS.get(path, path)}, counted through a proxy (1 worker, {run.in_window} messages): "
                f"{run.counted.round_trips / max(1, run.in_window):.2f} round trips and "
                f"{run.counted.statements / max(1, run.in_window):.2f} statements a message"
            )
    for run in [*(r for rs in runs.values() for r in rs), *counted.values()]:
        for problem in run.problems:
            print(f"  {run.path}, {run.workers} worker(s): {problem}")
    if not any(run.problems for rs in runs.values() for run in rs) and not any(r.problems for r in counted.values()):
        print(
            "  every run: each message's effect exactly once (rows = messages, one an id), every inbox row "
            "completed, nothing left or parked, every worker exited 0"
        )


if __name__ == "__main__":
    from consumer_kit.cli import run_async

    raise SystemExit(0 if run_async(main()) else 1)
