"""The chaos run: a real worker on a broker (RabbitMQ, NATS JetStream or Redis Streams) and PostgreSQL,
killed and cut off while it works.

For one transport and path (RabbitMQ: ``default``, ``single``, ``batch``, ``staged``, ``outbox``; NATS and Redis:
``default``, ``single``): publish ``messages`` distinct messages plus 10% duplicates (the same business
id sent again: AMQP ``message_id``, ``Nats-Msg-Id``, Redis field ``chaos-id``), run ``consumer-kit run
tests.chaos.worker:app``, and while it consumes: SIGKILL it ``kills`` times at random points of its
progress (starting it again each time), hit the broker once (RabbitMQ: the worker's connections cut at a proxy;
the NATS or Redis server, one of the run's own, is killed with SIGKILL and started again), and terminate
its database backends once (or, ``--crash``, crash the database server, one of the run's own, and start
it again). Then let it finish, stop it with SIGTERM and count: effects lost and doubled, messages left
over (not yet delivered, or on a dead-letter queue or stream), messages delivered and unsettled, parked
deliveries, and (outbox) the distinct message ids that reached the downstream queue. What differs by
transport is in tests/chaos/transport.py and its three broker_*.py.

``python -m tests.chaos.run [--transport rabbitmq|nats|redis] [--messages 10000] [--kills 6] [--runs 3]
[--paths default,single,outbox] [--crash]`` prints one line per run; the test suite runs a small size of
it (tests/chaos/test_chaos.py).
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

import asyncpg

from tests.chaos.server import OwnServer
from tests.chaos.transport import Transport, transport, transport_class

ROOT = Path(__file__).resolve().parents[2]
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
HMAC_KEY = "chaos-hmac-key-0123456789abcdef"
# An effect row and its key's row written by one statement: the same transaction (xmin) and the same
# command in it (cmin). The transaction path writes them in two statements (two commands).
ONE_STATEMENT = ("SELECT count(*) FROM chaos_effects e JOIN inbox i ON i.xmin::text = e.xmin::text"
                 " AND i.cmin::text = e.cmin::text WHERE i.consumer = 'chaos'")


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
    done_at_cut: int = 0  # effects committed when the broker fault (cut or server restart) was over
    recovered: bool = False  # the crashed server replayed its WAL as it started again (crash runs)
    transport: str = "rabbitmq"
    broker_fault: str = "broker cut"  # the transport's fault: "broker cut" (RabbitMQ), "server restart"
    one_statement: int | None = None  # staged: effects written by the same statement as their key's row

    @property
    def clean(self) -> bool:
        return (self.lost, self.doubled, self.left_in_queue, self.unacked, self.parked) == (0, 0, 0, 0, 0) and \
            self.downstream_distinct in (None, self.messages)

    def line(self) -> str:
        downstream = "" if self.downstream_distinct is None else f" downstream distinct ids {self.downstream_distinct}"
        if self.one_statement is not None:
            downstream += f"; {self.one_statement} effects in one statement with their key"
        label = self.path if self.transport == "rabbitmq" else f"{self.transport} {self.path}"
        return (f"{label:8s} {self.messages} messages ({self.published} published with duplicates),"
                f" {self.kills} SIGKILLs + 1 {self.broker_fault} + 1 database {'crash' if self.crashed else 'cut'}:"
                f" lost {self.lost}, doubled"
                f" {self.doubled}, left in queue {self.left_in_queue}, unacked {self.unacked}, parked"
                f" {self.parked}{downstream}; the {self.broker_fault} came after {self.done_at_cut} effects, the"
                f" database fault after {self.done_at_fault}"
                f" ({self.seconds:.0f} s) -> {'OK' if self.clean else 'FAILED'}")


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


async def _done(db: asyncpg.Connection, at_least: float, *, of: int, patience: float = 120) -> int:
    """Wait until ``at_least`` effects are committed, or all ``of`` them (or ``patience`` seconds pass:
    the final count then tells what was lost); the count."""
    deadline = time.monotonic() + patience
    while True:
        done = int(await db.fetchval("SELECT count(*) FROM chaos_effects"))
        if done >= min(at_least, of) or time.monotonic() > deadline:
            return done
        await asyncio.sleep(0.05)


async def _broker_fault(url: str, broker: Transport) -> int:
    """The transport's broker fault (a cut, or a server restart); the effects committed by then, counted
    on a connection of its own (the database may be down for a moment)."""
    await broker.fault()
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


async def _faults(db: asyncpg.Connection, url: str, worker: Worker, broker: Transport, server: OwnServer | None,
                  rng: random.Random, messages: int, kills: int) -> tuple[asyncpg.Connection, int, int, bool]:
    """SIGKILL the worker ``kills`` times, the broker fault once, the database fault once (see run());
    the counting connection (a new one after the database fault), the effects done at the database and
    the broker fault, and whether a crashed server recovered."""
    # Each fault fires when a share of the work is done, not after a time: on a fast host a timed
    # fault came after the last message and proved nothing. Kill i near i/(kills + 2) of the way;
    # the broker fault half a step after kill 2, the database fault half a step or more after kill 3.
    # Every fault also waits for the worker started last to have done a little of the work, so
    # that it hits a worker that is consuming, not one still starting (a broker cut then found no
    # connection to close).
    step = messages / (kills + 2)
    cut_after, db_cut_after = min(2, kills), min(3, kills)
    done_at_fault = done_at_cut = restarted_at = 0
    recovered = False
    for number in range(1, kills + 1):
        await _done(db, max(step * (number + rng.uniform(-0.3, 0.3)), restarted_at + step / 5), of=messages)
        await asyncio.to_thread(worker.kill)
        restarted_at = await _done(db, 0, of=messages)
        worker.start()
        if number == cut_after:  # awaited: the next kill must not come while the broker is down
            await _done(db, max(step * (number + 0.5), restarted_at + step / 5), of=messages)
            done_at_cut = await _broker_fault(url, broker)
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
    return db, done_at_fault, done_at_cut, recovered


async def run(path: str, messages: int, kills: int, *, settle_seconds: float = 900, log_dir: Path | None = None,
              seed: int | None = None, crash: bool = False, transport_name: str = "rabbitmq",
              pgbouncer_port: int | None = None) -> Report:
    """One chaos run (see the module docstring) on ``transport_name``; ``crash``: on a database server of
    its own (:class:`OwnServer`), crashed and started again instead of having its backends terminated.
    ``pgbouncer_port``: the worker (and its migration) reaches the database through the PgBouncer in
    transaction mode there (:mod:`tests.pgbouncer`), with ``DATABASE_POOLER=transaction``; the run's own
    counting stays on the server, and the database fault terminates the bouncer's server connections."""
    rng = random.Random(seed)
    token = secrets.token_hex(4)
    broker = transport(transport_name, token)
    database = f"ck_chaos_{token}"
    server = OwnServer() if crash else None
    if server is not None:
        await asyncio.to_thread(server.start)
    admin_url = PG_ADMIN if server is None else server.admin_url
    admin = await asyncpg.connect(admin_url)
    await admin.execute(f'CREATE DATABASE "{database}"')
    url = admin_url.rsplit("/", 1)[0] + f"/{database}"
    log = (log_dir or Path("/tmp")) / f"chaos-{transport_name}-{path}-{token}.log"
    started = time.monotonic()
    worker: Worker | None = None
    try:
        await broker.start()
        env = dict(os.environ, DATABASE_URL=url, IDEMPOTENCY_HMAC_KEY=HMAC_KEY, CHAOS_PATH=path,
                   INBOX_LEASE_SECONDS="2", SHUTDOWN_GRACE_SECONDS="5", DB_POOL_SIZE="8",
                   OUTBOX_POLL_SECONDS="0.2", RETRY_LATER_SECONDS="0.5", **broker.env())
        if pgbouncer_port is not None:
            env.update(DATABASE_URL=url.replace("@127.0.0.1:5432/", f"@127.0.0.1:{pgbouncer_port}/"),
                       DATABASE_POOLER="transaction")
            assert env["DATABASE_URL"] != url, "the worker's DATABASE_URL does not name the bouncer"
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
        await broker.publish(everything)

        worker = Worker(env, log)
        worker.start()
        db, done_at_fault, done_at_cut, recovered = await _faults(db, url, worker, broker, server, rng, messages,
                                                                  kills)
        await _settle(db, broker, settle_seconds)
        ended_before = worker.process is not None and worker.process.poll() is not None
        # In a thread: the loop must go on serving the run's broker proxy while the worker closes its connection.
        exit_code = await asyncio.to_thread(worker.stop)
        if exit_code != 0:  # the log is gone with the run's temporary directory: say its end here
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise AssertionError(f"the worker {'had ended before the stop' if ended_before else 'did not stop cleanly'}"
                                 f" ({exit_code}); the end of {log}:\n{tail}")
        rows, distinct = await db.fetchrow("SELECT count(*), count(DISTINCT message_id) FROM chaos_effects")
        parked = await db.fetchval("SELECT count(*) FROM dead_letters")
        one_statement = await db.fetchval(ONE_STATEMENT) if path == "staged" else None
        await db.close()
        ready, unacked = await broker.counts()
        downstream = len(await broker.downstream_ids() & set(ids)) if path == "outbox" else None
        return Report(path, messages, len(everything), kills, messages - distinct, rows - distinct, ready,
                      unacked, parked, downstream, time.monotonic() - started, crash, done_at_fault,
                      done_at_cut, recovered, broker.name, broker.fault_name, one_statement)
    finally:
        if worker is not None and worker.process is not None and worker.process.poll() is None:
            worker.kill()  # the run failed on the way: leave no worker behind
        await broker.remove()
        if server is not None:
            admin.terminate()
            await asyncio.to_thread(server.remove)
        else:
            await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            await admin.close()


async def _settle(db: asyncpg.Connection, broker: Transport, settle_seconds: float) -> None:
    """Wait until nothing is left on the broker, held unsettled or waiting in the outbox (or the time is up)."""
    deadline = time.monotonic() + settle_seconds
    while True:
        ready, unacked = await broker.counts()
        pending = await db.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
        if ready == unacked == pending == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    await asyncio.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=("rabbitmq", "nats", "redis"), default="rabbitmq")
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--paths", default=None,
                        help="comma-separated; default: every path of the transport (rabbitmq: default,single,"
                             "batch,staged,outbox; nats and redis: default,single)")
    parser.add_argument("--crash", action="store_true", help="crash the database server instead of cutting it")
    args = parser.parse_args()
    paths = args.paths.split(",") if args.paths else list(transport_class(args.transport).paths)
    clean = True
    for number in range(1, args.runs + 1):
        for path in paths:
            report = asyncio.run(run(path, args.messages, args.kills, crash=args.crash, transport_name=args.transport))
            print(f"run {number}: {report.line()}", flush=True)
            clean &= report.clean
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
