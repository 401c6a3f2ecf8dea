"""PostgreSQL backends terminated under a working app on asyncpg: every statement that meets a terminated
connection fails as a lost connection, never with asyncpg's ``InternalClientError: cannot switch to
state N; another operation (2) is in progress``, and every message's effect commits exactly once.

Why it happened: PostgreSQL tells a connection it terminates so (a FATAL ``ErrorResponse``) and then
closes it. asyncpg reads the two in separate turns of the event loop; when the notice comes while no
statement is running, asyncpg takes it for an operation's error in progress (protocol state 2,
``ERROR_CONSUME``, waiting for a ``ReadyForQuery`` that never comes), and until it reads the end of the
connection, every public check says the connection is open. A statement issued in that turn (state 11
prepare, 12 bind/execute, 15 a simple query such as ``BEGIN``) is the "other operation".
:func:`test_a_statement_between_the_notice_and_the_end` puts one connection in that turn on purpose;
the other tests terminate every backend of the database again and again while deliveries run, on the
single-transaction path and on the outbox path (two transactions; the relay publishing to RabbitMQ in
the same app).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from consumer_kit import ConsumerApp, Context, Settlement
from consumer_kit.sources.rabbitmq import AmqpPublisher
from consumer_kit.store import Database, create_engine
from consumer_kit.store.sql import Statement
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings, run_in_thread
from tests.integration.rabbit import AMQP_URL, declare, delete_queues, drain

pytestmark = [pytest.mark.postgres]

MESSAGES = {"single": 600, "outbox": 200}  # the outbox path's deliveries cost more: two transactions, a lease
CONCURRENCY = 16
ENOUGH_KILLED = 30  # backends terminated in a run, for it to prove anything
MAX_WAVES = 10
TERMINATE_EVERY = (0.1, 0.3)  # seconds between two rounds of pg_terminate_backend
SIGNS = ("InternalClientError", "another operation", "cannot switch to state")
_ONE = Statement("SELECT 1 AS one")


@dataclass(eq=False)
class Seen(logging.Handler):
    """Log records and exceptions the event loop was told of that show asyncpg's state error."""

    texts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        logging.Handler.__init__(self, logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        self.note(record.getMessage() + "\n" + said(record.exc_info[1] if record.exc_info else None))

    def note(self, shown: str) -> None:
        if any(sign in shown for sign in SIGNS):
            self.texts.append(shown)

    def loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        self.note(f"{context.get('message')} {context.get('exception')!r}")
        loop.default_exception_handler(context)


def said(exc: BaseException | None) -> str:
    """An exception and what it was raised from or during. Not the driver's error SQLAlchemy keeps under
    the one it raises (it chains one under every error, and the store's hook cannot unchain it): that
    the statement failed as a lost connection is what the error raised says."""
    shown: list[str] = []
    while exc is not None:
        shown.append(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, DBAPIError) and isinstance(getattr(exc.orig, "__cause__", None),
                                                      asyncpg.ConnectionDoesNotExistError):
            break
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return "\n".join(shown)


@contextlib.contextmanager
def watching() -> Iterator[Seen]:
    seen = Seen()
    root = logging.getLogger()
    root.addHandler(seen)
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(seen.loop_exception)
    try:
        yield seen
    finally:
        loop.set_exception_handler(previous)
        root.removeHandler(seen)


def dsn_of(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


async def terminate_all(connection: asyncpg.Connection) -> int:
    killed = await connection.fetchval(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()) AS terminated")
    return int(killed)


async def terminating(dsn: str, stop: asyncio.Event, killed: list[int]) -> None:
    """Terminate every other backend of the database, at random short intervals, until ``stop``."""
    connection = await asyncpg.connect(dsn)
    try:
        while not stop.is_set():
            await asyncio.sleep(random.uniform(*TERMINATE_EVERY))
            killed.append(await terminate_all(connection))
    finally:
        await connection.close()


async def until_acknowledged(source: InMemorySource, ids: list[str], seen: Seen) -> Counter[str]:
    """Deliver every id until it settles ACK, ``CONCURRENCY`` at a time, as a broker redelivers; the
    reasons of the settlements that were not ACK."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for message_id in ids:
        queue.put_nowait(message_id)
    reasons: Counter[str] = Counter()

    async def worker() -> None:
        while not queue.empty():
            message_id = queue.get_nowait()
            while True:
                try:
                    result = await source.deliver(id=message_id, body=message_id.encode())
                except Exception as exc:  # noted (the state error must not surface here either), delivered again
                    seen.note(repr(exc))
                    reasons[type(exc).__name__] += 1
                else:
                    if result.settlement is Settlement.ACK:
                        break
                    reasons[result.reason or result.outcome.value] += 1
                await asyncio.sleep(0.01)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return reasons


def build(url: str, destination: str | None) -> tuple[ConsumerApp, InMemorySource]:
    """The single-transaction path without ``destination``; with one, the outbox path."""
    app = ConsumerApp(make_settings(
        url, db_pool_size=4, inbox_lease_seconds=0.5, retry_attempts=2, max_deliveries=10_000,
        retry_later_seconds=0.01, outbox_poll_seconds=0.05, outbox_backoff_seconds=0.02,
        outbox_backoff_max_seconds=0.1, outbox_batch_size=50))
    source = InMemorySource(namespace="terminated", version=1, record=False)

    @app.handler(source, name="terminated", single_transaction=destination is None)
    async def handle(ctx: Context) -> None:
        message_id = ctx.delivery.id
        await ctx.db.execute(text("INSERT INTO terminated_effects (message_id) VALUES (:m)"), {"m": message_id})
        if destination is not None:
            ctx.outbox.publish(destination, (message_id or "").encode())

    if destination is not None:
        app.relay_outbox(AmqpPublisher(AMQP_URL))
    return app, source


async def effects(dsn: str) -> Counter[str]:
    connection = await asyncpg.connect(dsn)  # not the app's pools, which the last round may have hit
    try:
        rows = await connection.fetch("SELECT message_id, count(*) FROM terminated_effects GROUP BY message_id")
    finally:
        await connection.close()
    return Counter({r[0]: int(r[1]) for r in rows})


async def pending(dsn: str) -> int:
    connection = await asyncpg.connect(dsn)
    try:
        return int(await connection.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL"))
    finally:
        await connection.close()


@dataclass
class Run:
    ids: list[str]
    seen: Seen
    done: Counter[str]
    killed: list[int]
    reasons: Counter[str]
    unpublished: int = 0


async def under_terminations(url: str, destination: str | None = None) -> Run:
    app, source = build(url, destination)
    wave = MESSAGES["outbox" if destination else "single"]
    ids: list[str] = []
    killed: list[int] = []
    dsn = dsn_of(url)
    with watching() as seen:
        async with app.running():
            async with app.engine.begin() as conn:
                await conn.exec_driver_sql("DROP TABLE IF EXISTS terminated_effects")
                await conn.exec_driver_sql(
                    "CREATE TABLE terminated_effects (id serial PRIMARY KEY, message_id text NOT NULL)")
            stop = asyncio.Event()
            killer = asyncio.create_task(terminating(dsn, stop, killed))
            reasons: Counter[str] = Counter()
            try:
                # Waves of new ids until the terminations have hit enough backends: a fast host settles
                # one wave before the killer's first few rounds (the faults are timed, the work counted).
                while not ids or (sum(killed) < ENOUGH_KILLED and len(ids) < MAX_WAVES * wave):
                    new = [f"m-{len(ids) + i}" for i in range(wave)]
                    ids += new
                    reasons += await until_acknowledged(source, new, seen)
            finally:
                stop.set()
                await killer
            run = Run(ids, seen, await effects(dsn), killed, reasons)
            if destination is not None:  # the relay publishes what is left, on connections it makes again
                deadline = time.monotonic() + 15
                run.unpublished = await pending(dsn)
                while run.unpublished and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    run.unpublished = await pending(dsn)
    print(f"{'outbox' if destination else 'single'}: {len(ids)} ids, {len(killed)} rounds, {sum(killed)} backends "
          f"terminated, not acknowledged {dict(reasons)}, state errors {len(seen.texts)}")
    return run


def check(run: Run) -> None:
    assert sum(run.killed) >= ENOUGH_KILLED, "the backends were hardly terminated: the run proves nothing"
    assert not run.seen.texts, f"{len(run.seen.texts)} times asyncpg's state error, the first:\n{run.seen.texts[0]}"
    assert run.done == Counter(dict.fromkeys(run.ids, 1))  # every effect, each exactly once


async def test_single_transaction_path_under_terminated_backends(pg_database: str) -> None:
    check(await under_terminations(pg_database))


@pytest.fixture
async def out_queue() -> AsyncIterator[str]:
    name = f"ck-terminated-{secrets.token_hex(4)}"
    await declare(name)
    yield name
    await delete_queues(name)


@pytest.mark.rabbitmq
async def test_outbox_path_under_terminated_backends(pg_database: str, out_queue: str) -> None:
    run = await under_terminations(pg_database, out_queue)
    check(run)
    assert run.unpublished == 0
    published = {bytes(m.body).decode() for m in await drain(out_queue)}
    assert published == set(run.ids)  # each message reached the queue (a repeat is the consumer's to absorb)


def end_and_wait(dsn: str, pid: int) -> None:
    """Terminate backend ``pid`` and wait until it is gone, from another thread, blocking this event
    loop meanwhile: the server's notice and the connection's end then both wait in its socket, unread."""

    async def terminate() -> None:
        connection = await asyncpg.connect(dsn)
        try:
            assert await connection.fetchval("SELECT pg_terminate_backend($1, 5000)", pid)
        finally:
            await connection.close()

    run_in_thread(terminate())


async def between_the_notice_and_the_end(dsn: str, pid: int) -> None:
    end_and_wait(dsn, pid)
    await asyncio.sleep(0)  # one turn: asyncpg reads the notice, while no statement runs
    await asyncio.sleep(0)  # the next: this task runs before asyncpg reads the connection's end


async def test_a_statement_between_the_notice_and_the_end(pg_database: str) -> None:
    """A connection put, on purpose, in the turn between asyncpg reading the server's notice that it ends
    the connection and reading its end: the store's statement (on its own pool and on a connection
    that serves ctx.db) and a statement through SQLAlchemy fail as a lost connection, and the next
    checkout gets a working connection."""
    dsn = dsn_of(pg_database)
    engine = create_engine(pg_database, pool_size=2)
    database = Database(engine)
    try:
        for session in (False, True):
            async with database.connect(session=session) as executor:
                await executor.fetch_one(_ONE, {})  # prepared: the next run is a bind/execute (state 12)
                await between_the_notice_and_the_end(dsn, executor.driver.get_server_pid())
                with pytest.raises(asyncpg.ConnectionDoesNotExistError, match="the server ended the connection"):
                    await executor.fetch_one(_ONE, {})
                assert executor.discarded
            async with database.connect(session=session) as executor:
                assert (await executor.fetch_one(_ONE, {}) or {}).get("one") == 1
        async with engine.connect() as conn:
            raw = await conn.get_raw_connection()
            await between_the_notice_and_the_end(dsn, raw.driver_connection.get_server_pid())
            with pytest.raises(DBAPIError) as caught:
                await conn.exec_driver_sql("SELECT 1")  # its BEGIN first (state 15)
        assert caught.value.connection_invalidated
        assert isinstance(caught.value.orig.__cause__, asyncpg.ConnectionDoesNotExistError)
        assert "the server ended the connection" in str(caught.value)
        async with engine.connect() as conn:
            assert (await conn.exec_driver_sql("SELECT 1")).scalar_one() == 1
    finally:
        await database.close()
        await engine.dispose()


async def test_every_caller_waiting_on_a_failed_pool_opening_gets_its_error() -> None:
    """Five deliveries ask a worker's store for its pool while the database is down: each gets the
    database's error (not an AttributeError of the first one's clean-up), and the next asks again."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once the probe is closed
    database = Database(create_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{port}/nowhere"))
    try:
        for _ in range(2):
            errors = await asyncio.gather(*(database.pool() for _ in range(5)), return_exceptions=True)
            assert [type(error).__name__ for error in errors] == ["ConnectionRefusedError"] * 5, errors
    finally:
        await database.close()
