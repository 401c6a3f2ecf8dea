"""The chaos run: a real worker on RabbitMQ and PostgreSQL, killed and cut off while it works.

For one path (``default``, ``single``, ``batch``, ``outbox``): publish ``messages`` distinct messages
plus 10% duplicates (the same ``message_id`` sent again), run ``consumer-kit run
tests.chaos.worker:app``, and while it consumes: SIGKILL it ``kills`` times at random points of its
progress (starting it again each time), have the broker close its connections once, and terminate its
database backends once (or, ``--crash``, crash the database server, one of the run's own, and start it
again). Then let it finish, stop it with SIGTERM and count: effects lost and doubled, messages left in
the queues, messages unacked, parked deliveries, and (outbox) the distinct message ids that reached the
downstream queue.

``python -m tests.chaos.run [--messages 10000] [--kills 6] [--runs 3] [--paths default,single,outbox] [--crash]``
prints one line per run; the test suite runs a small size of it (tests/chaos/test_chaos.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import asyncpg

from tests.chaos.server import OwnServer
from tests.integration.rabbit import close_connections_named

ROOT = Path(__file__).resolve().parents[2]
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
HMAC_KEY = "chaos-hmac-key-0123456789abcdef"


@dataclass(frozen=True)
class Report:
    path: str
    messages: int
    published: int
    kills: int
    lost: int
    doubled: int
    left_in_queue: int
    unacked: int
    parked: int
    downstream_distinct: int | None
    seconds: float
    crashed: bool = False  # the database server was crashed, not its backends terminated
    done_at_fault: int = 0  # effects committed when the database was cut or crashed
    done_at_cut: int = 0  # effects committed when the broker had closed the worker's connection
    recovered: bool = False  # the crashed server replayed its WAL as it started again (crash runs)

    @property
    def clean(self) -> bool:
        return (self.lost, self.doubled, self.left_in_queue, self.unacked, self.parked) == (0, 0, 0, 0, 0) and \
            self.downstream_distinct in (None, self.messages)

    def line(self) -> str:
        downstream = "" if self.downstream_distinct is None else f" downstream distinct ids {self.downstream_distinct}"
        return (f"{self.path:8s} {self.messages} messages ({self.published} published with duplicates),"
                f" {self.kills} SIGKILLs + 1 broker cut + 1 database {'crash' if self.crashed else 'cut'}:"
                f" lost {self.lost}, doubled"
                f" {self.doubled}, left in queue {self.left_in_queue}, unacked {self.unacked}, parked"
                f" {self.parked}{downstream}; the broker cut came after {self.done_at_cut} effects, the"
                f" database fault after {self.done_at_fault}"
                f" ({self.seconds:.0f} s) -> {'OK' if self.clean else 'FAILED'}")


def _queue_counts(prefix: str) -> tuple[int, int]:
    """(ready, unacked) over ``prefix`` and every ``prefix.*`` queue (retry queues, the DLQ)."""
    out = subprocess.run(["rabbitmqctl", "list_queues", "name", "messages_ready", "messages_unacknowledged",
                          "-q", "--no-table-headers"], capture_output=True, text=True, timeout=60, check=True).stdout
    ready = unacked = 0
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and (parts[0] == prefix or parts[0].startswith(prefix + ".")) \
                and not parts[0].endswith(".out"):
            ready += int(parts[1])
            unacked += int(parts[2])
    return ready, unacked


class Worker:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [str(Path(sys.executable).with_name("consumer-kit")), "--log-level", "WARNING",
                   "run", "tests.chaos.worker:app"]
        with self.log.open("ab") as output:
            self.process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=output, stderr=output)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return -9


async def _publish(queue: str, ids: list[str]) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True)
        await channel.declare_queue(f"{queue}.out", durable=True)
        for start in range(0, len(ids), 500):
            await asyncio.gather(*(channel.default_exchange.publish(
                aio_pika.Message(message_id.encode(), message_id=message_id,
                                 delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=queue)
                for message_id in ids[start:start + 500]))


async def _downstream_ids(queue: str) -> set[str]:
    ids: set[str] = set()
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(f"{queue}.out", durable=True)
        while (message := await declared.get(fail=False, timeout=5)) is not None:
            await message.ack()
            ids.add(message.body.decode())
    return ids


async def _delete_queues(queue: str) -> None:
    command = ["rabbitmqctl", "list_queues", "name", "-q", "--no-table-headers"]
    listing = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60,
                                      check=True)
    out = listing.stdout
    names = [n.strip() for n in out.splitlines() if n.strip() == queue or n.strip().startswith(queue + ".")]
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        for name in names:
            channel = await connection.channel()
            try:
                await channel.queue_delete(name)
            except Exception:
                pass


async def _done(db: asyncpg.Connection, at_least: float, *, of: int, patience: float = 120) -> int:
    """Wait until ``at_least`` effects are committed, or all ``of`` them (or ``patience`` seconds pass:
    the final count then tells what was lost); the count."""
    deadline = time.monotonic() + patience
    while True:
        done = int(await db.fetchval("SELECT count(*) FROM chaos_effects"))
        if done >= min(at_least, of) or time.monotonic() > deadline:
            return done
        await asyncio.sleep(0.05)


async def _cut_broker(url: str, name: str) -> int:
    """Have the broker close the worker's connection (rabbitmqctl takes a second or two); the effects
    committed by then, counted on a connection of its own (the database may be down for a moment)."""
    closed = await asyncio.to_thread(close_connections_named, name)
    assert closed > 0, f"no broker connection named {name} to close"
    for attempt in range(20):
        try:
            counter = await asyncpg.connect(url)
            try:
                return int(await counter.fetchval("SELECT count(*) FROM chaos_effects"))
            finally:
                await counter.close()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            if attempt == 19:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def run(path: str, messages: int, kills: int, *, settle_seconds: float = 900, log_dir: Path | None = None,
              seed: int | None = None, crash: bool = False) -> Report:
    """One chaos run (see the module docstring); ``crash``: on a server of its own (:class:`OwnServer`),
    crashed and started again instead of having its backends terminated."""
    rng = random.Random(seed)
    token = secrets.token_hex(4)
    database, queue = f"ck_chaos_{token}", f"ck-chaos-{token}"
    server = OwnServer() if crash else None
    if server is not None:
        await asyncio.to_thread(server.start)
    admin_url = PG_ADMIN if server is None else server.admin_url
    admin = await asyncpg.connect(admin_url)
    await admin.execute(f'CREATE DATABASE "{database}"')
    url = admin_url.rsplit("/", 1)[0] + f"/{database}"
    log = (log_dir or Path("/tmp")) / f"chaos-{path}-{token}.log"
    started = time.monotonic()
    worker: Worker | None = None
    try:
        env = dict(os.environ, DATABASE_URL=url, IDEMPOTENCY_HMAC_KEY=HMAC_KEY, RABBITMQ_URL=AMQP_URL,
                   CHAOS_PATH=path, CHAOS_QUEUE=queue, INBOX_LEASE_SECONDS="2", SHUTDOWN_GRACE_SECONDS="5",
                   DB_POOL_SIZE="8", OUTBOX_POLL_SECONDS="0.2", RETRY_LATER_SECONDS="0.5")
        migrate = await asyncio.to_thread(
            subprocess.run, [str(Path(sys.executable).with_name("consumer-kit")), "db", "upgrade"], cwd=ROOT,
            env=env, capture_output=True, timeout=120)
        assert migrate.returncode == 0, migrate.stderr.decode()
        db = await asyncpg.connect(url)
        await db.execute("CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, message_id text NOT NULL)")
        ids = [f"m-{i:06d}" for i in range(messages)]
        resent = rng.sample(ids, messages // 10)
        everything = ids + resent
        rng.shuffle(everything)
        await _publish(queue, everything)

        worker = Worker(env, log)
        worker.start()
        # Each fault fires when a share of the work is done, not after a time: on a fast host a timed
        # fault came after the last message and proved nothing. Kill i near i/(kills + 2) of the way;
        # the broker cut half a step after kill 2, the database fault half a step or more after kill 3.
        # Every fault also waits for the worker started last to have done a little of the work, so
        # that it hits a worker that is consuming, not one still starting (a broker cut then found no
        # connection to close).
        step = messages / (kills + 2)
        cut_after, db_cut_after = min(2, kills), min(3, kills)
        done_at_fault = 0
        done_at_cut = 0
        recovered = False
        restarted_at = 0
        for number in range(1, kills + 1):
            await _done(db, max(step * (number + rng.uniform(-0.3, 0.3)), restarted_at + step / 5), of=messages)
            worker.kill()
            restarted_at = await _done(db, 0, of=messages)
            worker.start()
            if number == cut_after:  # awaited: the next kill must not come while rabbitmqctl looks
                await _done(db, max(step * (number + 0.5), restarted_at + step / 5), of=messages)
                done_at_cut = await _cut_broker(url, f"{queue}-worker")
            if number == db_cut_after:
                done_at_fault = await _done(db, max(step * (number + rng.uniform(0.5, 0.9)),
                                                    restarted_at + step / 5), of=messages)
                if server is not None:  # every server process quits at once; the start replays the WAL
                    await asyncio.to_thread(server.crash)
                    db.terminate()
                    await asyncio.to_thread(server.start)
                    # the whole log: reconnecting workers' "starting up" lines can bury the line
                    recovered = "automatic recovery in progress" in server.log()
                else:
                    await db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                     " WHERE datname = current_database() AND pid <> pg_backend_pid()")
                    await db.close()
                db = await asyncpg.connect(url)

        deadline = time.monotonic() + settle_seconds
        while True:
            ready, unacked = _queue_counts(queue)
            pending = await db.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            if ready == unacked == pending == 0:
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        await asyncio.sleep(1)
        ended_before = worker.process is not None and worker.process.poll() is not None
        exit_code = worker.stop()
        if exit_code != 0:  # the log is gone with the run's temporary directory: say its end here
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise AssertionError(f"the worker {'had ended before the stop' if ended_before else 'did not stop cleanly'}"
                                 f" ({exit_code}); the end of {log}:\n{tail}")
        rows, distinct = await db.fetchrow("SELECT count(*), count(DISTINCT message_id) FROM chaos_effects")
        parked = await db.fetchval("SELECT count(*) FROM dead_letters")
        await db.close()
        ready, unacked = _queue_counts(queue)
        downstream = len(await _downstream_ids(queue) & set(ids)) if path == "outbox" else None
        return Report(path, messages, len(everything), kills, messages - distinct, rows - distinct, ready,
                      unacked, parked, downstream, time.monotonic() - started, crash, done_at_fault,
                      done_at_cut, recovered)
    finally:
        if worker is not None and worker.process is not None and worker.process.poll() is None:
            worker.kill()  # the run failed on the way: leave no worker behind
        await _delete_queues(queue)
        if server is not None:
            admin.terminate()
            await asyncio.to_thread(server.remove)
        else:
            await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            await admin.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--paths", default="default,single,batch,outbox")
    parser.add_argument("--crash", action="store_true", help="crash the database server instead of cutting it")
    args = parser.parse_args()
    clean = True
    for number in range(1, args.runs + 1):
        for path in args.paths.split(","):
            report = asyncio.run(run(path, args.messages, args.kills, crash=args.crash))
            print(f"run {number}: {report.line()}", flush=True)
            clean &= report.clean
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
