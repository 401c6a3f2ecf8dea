"""Idempotent HTTP endpoints: the same FastAPI endpoint (insert one row whose id it makes, answer 201)
several ways, on PostgreSQL over asyncpg, each a uvicorn process of its own (one worker, ``--http
httptools``, no access log) on a fresh database (see :mod:`bench.http_servers`):

- ceiling: no idempotency at all;
- hand-written: an idempotency-key table a careful user writes on asyncpg, all in one transaction;
- consumer-kit: ``IdempotencyKey(staged=True, driver="asyncpg")`` in ``IdempotencyMiddleware``'s prefix
  style, the row staged (``ctx.stage``): the row, the key and the response go in one statement;
- consumer-kit, 1 txn: ``IdempotencyKey(single_transaction=True, driver="asyncpg")``, the row written
  through ``ctx.connection`` inside the transaction that holds the key (a route that must read first).

A round starts each side's server in turn (one at a time: each holds up to ``POOL`` connections),
warms it up, empties the tables, gives it ``N`` requests with fresh keys, then the same ``N``
requests again (replays: the route does not run), and stops it; the order alternates round to round.
A ratio is the median over rounds of that round's ratio, so that a minute in which the host's other
work (it is shared) weighs on one side does not decide it. The client is a small HTTP/1.1 client on
keep-alive connections (a protocol on the event loop, one request in flight per connection,
``CONCURRENCY`` connections, every request built before the clock starts): it costs a fraction of
what a server costs per request, printed with the server's own CPU and its database backends' (found
by the server's sockets), so that what limits a side shows.
Targets: consumer-kit >= 1.0x the hand-written peer on new keys, its replays >= 3.0x the ceiling,
its new keys >= 0.7x the ceiling.

``CK_BENCH_N``, ``CK_BENCH_ROUNDS``; ``CK_BENCH_HTTP_EXTRA=kit-db,kit-dependency,kit-two,floor`` adds
consumer-kit in one transaction through ``ctx.db``, staged but claiming in a route dependency, on its
default two transactions (in a dependency), and the endpoint without a database (what FastAPI and
uvicorn cost by themselves).
``CK_BENCH_PROFILE=<dir>`` runs consumer-kit's servers under cProfile (a ``.prof`` a turn, warm-up included,
written when it stops;
the rates are then not comparable).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import signal
import socket
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import asyncpg

from bench.common import cpu_seconds, host_jiffies, local_ports, migrated_database, verdict
from bench.http_servers import schema

N = int(os.environ.get("CK_BENCH_N", "3000"))
WARMUP = 400
ROUNDS = int(os.environ.get("CK_BENCH_ROUNDS", "5"))
CONCURRENCY = 32
POOL = 32
TARGET_HANDWRITTEN = 1.0
TARGET_REPLAY = 3.0
TARGET_CEILING = 0.7
PROFILE = os.environ.get("CK_BENCH_PROFILE")
ROOT = Path(__file__).resolve().parents[1]
PG_PORT = 5432


@dataclass(frozen=True)
class Side:
    """One contender: its server's factory and environment, whether a repeat is a replay, and how many
    rows it writes a request (a replay none)."""

    name: str
    label: str
    factory: str
    env: dict[str, str]
    replays: bool
    rows: int = 1

    @property
    def table(self) -> str:
        return "bench_orders_" + self.name.replace("-", "_")


SIDES = {side.name: side for side in (
    Side("floor", "floor: no database (HTTP stack alone)", "bench.http_servers:floor", {}, False, rows=0),
    Side("ceiling", "ceiling: no idempotency", "bench.http_servers:ceiling", {}, False),
    Side("handwritten", "hand-written key table, 1 txn", "bench.http_servers:handwritten", {}, True),
    Side("kit", "consumer-kit, staged, prefix", "bench.http_servers:kit", {"BENCH_KIT_TX": "staged"}, True),
    Side("kit-one", "consumer-kit, 1 txn, prefix", "bench.http_servers:kit", {"BENCH_KIT_TX": "one"}, True),
    Side("kit-db", "consumer-kit, 1 txn, prefix, ctx.db", "bench.http_servers:kit",
         {"BENCH_KIT_TX": "one", "BENCH_KIT_VIA": "db"}, True),
    Side("kit-request", "consumer-kit, staged, context_of", "bench.http_servers:kit",
         {"BENCH_KIT_CONTEXT": "request"}, True),
    Side("kit-dependency", "consumer-kit, staged, dependency", "bench.http_servers:kit",
         {"BENCH_KIT_STYLE": "dependency"}, True),
    Side("kit-two", "consumer-kit, 2 txns, dependency", "bench.http_servers:kit",
         {"BENCH_KIT_STYLE": "dependency", "BENCH_KIT_TX": "two"}, True),
)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _requests(port: int, count: int) -> list[bytes]:
    """``count`` raw HTTP/1.1 requests, each with a key of its own: a random UUID, as the draft advises
    clients and as they send them (so a key table's index takes them at random places, not in order)."""
    built = []
    for i in range(count):
        body = json.dumps({"sku": f"sku-{i % 97}", "quantity": 1 + i % 5}).encode()
        built.append(b"".join((
            b"POST /orders HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port,
            b"Content-Type: application/json\r\n",
            b'Idempotency-Key: "%s"\r\n' % str(uuid.uuid4()).encode(),
            b"Content-Length: %d\r\n\r\n" % len(body), body)))
    return built


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time: the status, the lower-cased head, the body."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            waiter.set_exception(RuntimeError("a response without content-length"))
            return
        stop = head.find(b"\r\n", at + 2)
        total = end + 4 + int(head[at + 17:stop if stop >= 0 else len(head)])
        if len(self.buffer) < total:
            return
        body = bytes(self.buffer[end + 4:total])
        del self.buffer[:total]
        self.waiter = None
        waiter.set_result((int(head[9:12]), head, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("the server closed the connection"))

    def send(self, raw: bytes) -> asyncio.Future[tuple[int, bytes, bytes]]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.waiter


@dataclass
class Phase:
    """One timed batch of requests against one server; CPU as cores busy over the phase."""

    rate: float
    statuses: Counter[int]
    replayed: int
    client_cpu: float
    server_cpu: float
    db_cpu: float
    host_busy: float
    """Everyone's work on the host, not only this run's."""
    connections: int

    def per_request(self, cores: float) -> float:
        """CPU milliseconds a request, for ``cores`` busy over the phase."""
        return 1000 * cores / self.rate


@dataclass
class Run:
    """One side's turn in one round: its new keys and its replays."""

    new: Phase
    replay: Phase
    notes: list[str] = field(default_factory=list)


class Server:
    """One side's uvicorn process."""

    def __init__(self, side: Side, process: asyncio.subprocess.Process, port: int, profiled: bool) -> None:
        self.side = side
        self.process = process
        self.port = port
        self.profiled = profiled

    @classmethod
    async def start(cls, side: Side, env: dict[str, str], tag: str) -> Server:
        port = _free_port()
        command = [sys.executable]
        profile = PROFILE and side.name.startswith("kit")
        if profile:
            assert PROFILE is not None
            command += ["-m", "cProfile", "-o", str(Path(PROFILE) / f"{side.name}-{tag}.prof")]
        command += ["-m", "uvicorn", "--factory", side.factory, "--host", "127.0.0.1", "--port", str(port),
                    "--http", "httptools", "--no-access-log", "--log-level", "warning", "--lifespan", "on"]
        process = await asyncio.create_subprocess_exec(
            *command, cwd=ROOT, env={**os.environ, **env, **side.env, "BENCH_TABLE": side.table})
        server = cls(side, process, port, bool(profile))
        for _ in range(300):
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                await writer.wait_closed()
                return server
            if process.returncode is not None:
                break
            await asyncio.sleep(0.1)
        await server.stop()
        raise RuntimeError(f"the {side.name} server did not start")

    async def stop(self) -> None:
        if self.process.returncode is None:
            # uvicorn raises the signal again once it has shut down; SIGINT's is an exception, after which
            # cProfile still writes its file (SIGTERM's would end the process first).
            self.process.send_signal(signal.SIGINT if self.profiled else signal.SIGTERM)
        await asyncio.wait_for(self.process.wait(), timeout=60)

    async def backends(self, stats: asyncpg.Connection) -> list[int]:
        """The pids of this server's database backends."""
        ports = local_ports(self.process.pid, PG_PORT)
        rows = await stats.fetch("SELECT pid, client_port FROM pg_stat_activity WHERE datname = current_database()")
        return [int(r["pid"]) for r in rows if r["client_port"] in ports]

    async def phase(self, requests: list[bytes], stats: asyncpg.Connection) -> Phase:
        loop = asyncio.get_running_loop()
        connections = []
        for _ in range(CONCURRENCY):
            _, protocol = await loop.create_connection(_Connection, "127.0.0.1", self.port)
            connections.append(protocol)
        statuses: Counter[int] = Counter()
        replayed = 0
        at = 0

        async def worker(connection: _Connection) -> None:
            nonlocal at, replayed
            while at < len(requests):
                raw = requests[at]
                at += 1
                status, head, _ = await connection.send(raw)
                statuses[status] += 1
                replayed += b"\r\nidempotency-replayed: true" in head

        pid = self.process.pid
        backends = await self.backends(stats)
        db_before = {backend: cpu_seconds(backend) for backend in backends}
        server_before, host_before = cpu_seconds(pid), host_jiffies()
        client_before, started = time.process_time(), time.perf_counter()
        try:
            await asyncio.gather(*(worker(c) for c in connections))
        finally:
            for connection in connections:
                assert connection.transport is not None
                connection.transport.close()
        elapsed = time.perf_counter() - started
        client = time.process_time() - client_before
        server, host_after = cpu_seconds(pid) - server_before, host_jiffies()
        after = await self.backends(stats)
        db = sum(cpu_seconds(backend) - db_before.get(backend, 0.0) for backend in set(backends) | set(after))
        busy = (host_after[0] - host_before[0]) / max(1, host_after[1] - host_before[1]) * (os.cpu_count() or 1)
        return Phase(len(requests) / elapsed, statuses, replayed, client / elapsed, server / elapsed, db / elapsed,
                     busy, max(len(backends), len(after)))

    async def turn(self, count: int, stats: asyncpg.Connection) -> Run:
        """New keys, then the same requests again; checked: every answer 201, every repeat of a side
        with idempotency a replay, its rows a key (the ceiling: a request)."""
        measured = _requests(self.port, count)
        run = Run(await self.phase(measured, stats), await self.phase(measured, stats))
        rows = int(await stats.fetchval(f"SELECT count(*) FROM {self.side.table}"))
        wanted = count * self.side.rows * (1 if self.side.replays else 2)
        if rows != wanted:
            run.notes.append(f"{rows} rows written, {wanted} expected")
        for kind, phase in (("new", run.new), ("repeat", run.replay)):
            if set(phase.statuses) != {201}:
                run.notes.append(f"{kind}: statuses {dict(phase.statuses)}")
        if self.side.replays and run.replay.replayed != count:
            run.notes.append(f"replay: {run.replay.replayed} of {count} marked Idempotency-Replayed")
        return run


async def _empty(stats: asyncpg.Connection, tables: list[str]) -> None:
    await stats.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY")
    await stats.execute("VACUUM ANALYZE")


def _profile_dir() -> None:
    if PROFILE:
        Path(PROFILE).mkdir(parents=True, exist_ok=True)


async def _measure(names: list[str], dsn: str) -> dict[str, list[Run]]:
    env = {"BENCH_PLAIN_URL": dsn, "BENCH_DATABASE_URL": dsn.replace("postgresql://", "postgresql+asyncpg://"),
           "BENCH_HMAC_KEY": base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(), "BENCH_POOL": str(POOL)}
    tables = [SIDES[n].table for n in names] + ["bench_idempotency_keys", "inbox", "inbox_tombstones"]
    runs: dict[str, list[Run]] = {name: [] for name in names}
    _profile_dir()
    stats = await asyncpg.connect(dsn)
    try:
        for round_ in range(ROUNDS):  # alternate the order, so that no side always follows the same one
            for name in names if round_ % 2 == 0 else names[::-1]:
                server = await Server.start(SIDES[name], env, f"{round_}")
                try:
                    await server.turn(WARMUP, stats)
                    await _empty(stats, tables)
                    runs[name].append(await server.turn(N, stats))
                finally:
                    await server.stop()
    finally:
        await stats.close()
    return runs


async def main() -> bool:
    """Run every side for ``ROUNDS`` rounds, print requests/s, CPU and the ratios; True when every
    target is met and every request was answered as it should be."""
    extra = [n for n in os.environ.get("CK_BENCH_HTTP_EXTRA", "").split(",") if n]
    names = ["ceiling", "handwritten", "kit", "kit-one", *extra]
    async with migrated_database() as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            for statement in schema([SIDES[n].table for n in names]):
                await conn.execute(statement)
        finally:
            await conn.close()
        runs = await _measure(names, dsn)
    _report(names, runs)
    failed = [note for name in names for run in runs[name] for note in run.notes]
    return not failed and all(value >= target for _, value, target in _checks(runs))


def _checks(runs: dict[str, list[Run]]) -> list[tuple[str, float, float]]:
    return [
        ("consumer-kit / hand-written, new keys", _ratio(runs, "kit", "new", "handwritten"), TARGET_HANDWRITTEN),
        ("consumer-kit replays / ceiling", _ratio(runs, "kit", "replay", "ceiling"), TARGET_REPLAY),
        ("consumer-kit new keys / ceiling", _ratio(runs, "kit", "new", "ceiling"), TARGET_CEILING),
    ]


def _ratio(runs: dict[str, list[Run]], name: str, kind: str, peer: str, peer_kind: str = "new") -> float:
    """The median over rounds of ``name``'s ``kind`` rate over ``peer``'s ``peer_kind`` rate that round."""
    return statistics.median(float(getattr(a, kind).rate / getattr(b, peer_kind).rate)
                             for a, b in zip(runs[name], runs[peer], strict=True))


def _report(names: list[str], runs: dict[str, list[Run]]) -> None:
    def line(name: str, kind: str) -> str:
        phases: list[Phase] = [getattr(r, kind) for r in runs[name]]

        def med(values: list[float]) -> float:
            return statistics.median(values)

        return (f"{med([p.rate for p in phases]):6.0f} req/s  cpu ms/req: server "
                f"{med([p.per_request(p.server_cpu) for p in phases]):.2f} db "
                f"{med([p.per_request(p.db_cpu) for p in phases]):.2f} client "
                f"{med([p.per_request(p.client_cpu) for p in phases]):.2f}; busy: server "
                f"{med([p.server_cpu for p in phases]):.2f} host {med([p.host_busy for p in phases]):.2f}; "
                f"conns {max(p.connections for p in phases)}")

    print(f"http: FastAPI POST /orders (insert one row); {N} requests with new keys, then the same {N} again; "
          f"concurrency {CONCURRENCY}, pools of {POOL}; uvicorn (httptools, 1 worker) a side on 127.0.0.1, "
          f"PostgreSQL on asyncpg; {ROUNDS} alternating rounds, medians. CPU: the server process, its database "
          f"backends and the client, per request; busy: cores, the server's and the whole host's (everyone's)")
    for name in names:
        side = SIDES[name]
        print(f"  {side.label:<34} new    {line(name, 'new')}")
        print(f"  {'':<34} {'replay' if side.replays else 'again '} {line(name, 'replay')}")
        for i, run in enumerate(runs[name]):
            for note in run.notes:
                print(f"    round {i}: {note}")
    for name in names:
        print(f"  per round, {name}: " + " ".join(f"{r.new.rate:.0f}/{r.replay.rate:.0f}" for r in runs[name]))
    for label, value, target in _checks(runs):
        print(f"  {label:<44} {value:5.2f}  target >= {target}: {verdict(value, target)}")
    others = [("hand-written / ceiling, new keys", "handwritten", "new", "ceiling", "new"),
              ("hand-written replays / ceiling", "handwritten", "replay", "ceiling", "new"),
              ("consumer-kit / hand-written, replays", "kit", "replay", "handwritten", "replay")]
    others += [(f"{n} / consumer-kit, new keys", n, "new", "kit", "new") for n in names[3:]]
    others += [(f"{n} / consumer-kit, replays", n, "replay", "kit", "replay") for n in names[3:]]
    others += [(f"{n} / hand-written, new keys", n, "new", "handwritten", "new") for n in names[3:]]
    others += [(f"{n} / ceiling, new keys", n, "new", "ceiling", "new") for n in names[3:]]
    for label, name, kind, peer, peer_kind in others:
        print(f"  {label:<44} {_ratio(runs, name, kind, peer, peer_kind):5.2f}")
    failed = sum(len(run.notes) for name in names for run in runs[name])
    if failed:
        print(f"  {failed} wrong answer(s) or counts (see above)")
