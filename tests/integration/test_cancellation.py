"""A delivery cancelled at each of its await points in turn, on every path: nothing acknowledged is lost.

aio-pika cancels in-flight consumer tasks when the broker connection drops, ``stop()`` cancels what
outlives the grace period and an HTTP client that disconnects cancels its request: a delivery can be
cancelled at any point where it waits. :class:`CancelAt` runs one delivery and cancels its task at its
k-th suspension (every await that actually yields to the event loop); the test sweeps k from the
first suspension to the last. After each cancellation:

- no backend of the test database is left ``idle in transaction`` (a connection whose transaction
  outlived its delivery would be pooled, and every later "transaction" on it would be a savepoint
  inside one that never commits);
- the same message delivered again is processed or a duplicate, never lost;
- a round of new deliveries through every pooled connection is processed, and each one reported
  PROCESSED has its effect visible from another connection.

At the end every message's effect and outbox row exist exactly once, and (with a coordinator
session) no session is left active.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Generator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import text

from consumer_kit import ConsumerApp, Context, Delivery, Outcome, Result
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings

POOL = 2  # small, so that the probe rounds go through every pooled connection


class CancelAt:
    """Awaits ``coro`` in the current task and cancels that task at ``coro``'s ``k``-th suspension.

    Each value the coroutine yields is one suspension of the task (a future it waits on, or a bare
    yield). Cancelling the task just before the value is handed to it makes the task cancel that very
    future, so the ``CancelledError`` is thrown in at exactly that await: deterministic, with no hook
    in the code under test. ``suspensions`` counts the yields seen (the whole run when ``k`` is 0).
    """

    def __init__(self, coro: Coroutine[Any, Any, Result], k: int) -> None:
        self.coro = coro
        self.k = k
        self.suspensions = 0

    def __await__(self) -> Generator[Any, Any, Result]:
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                yielded = self.coro.throw(thrown) if thrown is not None else self.coro.send(sent)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            self.suspensions += 1
            if self.suspensions == self.k:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
            try:
                sent, thrown = (yield yielded), None
            except BaseException as exc:
                sent, thrown = None, exc


@dataclass(frozen=True)
class Path:
    single: bool = False
    driver: str = "sqlalchemy"
    session: bool = False
    writes: bool = True  # an effect row through ctx.db / ctx.connection
    outbox: bool = True  # and an outbox row (neither: the inbox completion is the transaction's only write)
    staged: bool = False  # the effect row staged with ctx.stage (written after the handler returns)

    @property
    def id(self) -> str:
        return "-".join([
            "one-txn" if self.single else "two-txn", self.driver,
            "session" if self.session else "no-session",
            ("staged" if self.staged else "writes") if self.writes else
            ("outbox-only" if self.outbox else "writes-nothing"),
        ])


PG_PATHS = [
    Path(),
    Path(writes=False),
    Path(writes=False, outbox=False),
    Path(single=True, writes=False, outbox=False),
    Path(session=True),
    Path(single=True),
    Path(driver="asyncpg"),
    Path(driver="asyncpg", session=True),
    Path(driver="asyncpg", single=True),
    Path(staged=True),
    Path(driver="asyncpg", single=True, staged=True),
]
SQLITE_PATHS = [Path(), Path(session=True), Path(single=True), Path(single=True, staged=True)]


def build(url: str, path: Path) -> tuple[ConsumerApp, InMemorySource]:
    app = ConsumerApp(make_settings(url, db_pool_size=POOL, inbox_lease_seconds=1.0, retry_attempts=1))
    source = InMemorySource(namespace="cancel", version=1)
    session: dict[str, Any] = {"labels": ["cancel-test"]} if path.session else {}

    @app.handler(source, name="cancel", single_transaction=path.single, driver=path.driver,  # type: ignore[arg-type]
                 **session)
    async def handle(ctx: Context) -> None:
        ticket = ctx.delivery.json()["key"]
        if path.writes and path.staged:
            if path.driver == "asyncpg":
                ctx.stage("INSERT INTO cancel_effects (ticket) VALUES ($1)", ticket)
            else:
                ctx.stage("INSERT INTO cancel_effects (ticket) VALUES (:t)", t=ticket)
        elif path.writes:
            if path.driver == "asyncpg":
                await ctx.connection.execute("INSERT INTO cancel_effects (ticket) VALUES ($1)", ticket)
            else:
                await ctx.db.execute(text("INSERT INTO cancel_effects (ticket) VALUES (:t)"), {"t": ticket})
        if path.outbox:
            ctx.outbox.publish("cancel.out", ticket)

    return app, source


async def prepare(app: ConsumerApp) -> None:
    async with app.engine.begin() as conn:
        await conn.exec_driver_sql("DROP TABLE IF EXISTS cancel_effects")
        await conn.exec_driver_sql(
            "CREATE TABLE cancel_effects (id INTEGER PRIMARY KEY, ticket VARCHAR(64) NOT NULL)"
            if app.engine.dialect.name == "sqlite" else
            "CREATE TABLE cancel_effects (id serial PRIMARY KEY, ticket text NOT NULL)")


async def effects(app: ConsumerApp, path: Path) -> dict[str, int]:
    """Committed effects per ticket, read on a connection of its own (the outbox row when the handler
    writes nothing else; the inbox's completed rows, by their key's digest, when it writes nothing)."""
    if not path.writes and not path.outbox:
        return await completions(app)
    query = ("SELECT ticket, count(*) FROM cancel_effects GROUP BY ticket" if path.writes else
             "SELECT body, count(*) FROM outbox GROUP BY body")
    async with app.engine.connect() as conn:
        rows = (await conn.exec_driver_sql(query)).all()
    return {(r[0].decode() if isinstance(r[0], bytes) else r[0]): int(r[1]) for r in rows}


async def completions(app: ConsumerApp) -> dict[str, int]:
    """Tickets whose inbox row is completed (matched by the digest of their key)."""
    source = app.specs[0].source
    digester = app.settings.digester()
    async with app.engine.connect() as conn:
        done = {r[0] for r in (await conn.exec_driver_sql(
            "SELECT key_digest FROM inbox WHERE consumer = 'cancel' AND state = 'completed'")).all()}
    found: dict[str, int] = {}
    for ticket in _DELIVERED:
        key = source.key(Delivery(id=f"msg-{ticket}", body=b""))
        if digester.candidates(key)[0] in done:
            found[ticket] = 1
    return found


_DELIVERED: list[str] = []


async def outbox_rows(app: ConsumerApp) -> dict[str, int]:
    async with app.engine.connect() as conn:
        rows = (await conn.exec_driver_sql("SELECT body, count(*) FROM outbox GROUP BY body")).all()
    return {bytes(r[0]).decode(): int(r[1]) for r in rows}


async def stuck_backends(app: ConsumerApp) -> int:
    """Backends of this database idle inside a transaction, after giving a rollback in flight a moment."""
    if app.engine.dialect.name != "postgresql":
        return 0
    count = 0
    for _ in range(40):
        async with app.engine.connect() as conn:
            count = (await conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()")).scalar_one()
        if count == 0:
            return 0
        await asyncio.sleep(0.05)
    return int(count)


async def deliver(source: InMemorySource, ticket: str, k: int = 0) -> tuple[Result | None, int]:
    """Deliver ``ticket``, cancelled at its k-th suspension (never when 0); ``(result or None if
    cancelled, suspensions seen)``."""
    body = json.dumps({"key": ticket}).encode()
    _DELIVERED.append(ticket)
    probe = CancelAt(source.deliver(id=f"msg-{ticket}", body=body), k)

    async def run() -> Result:
        return await probe

    task = asyncio.create_task(run())
    done, _ = await asyncio.wait([task], timeout=30)
    assert done, f"the delivery of {ticket} hung"
    return (None if task.cancelled() else task.result()), probe.suspensions


async def settle(source: InMemorySource, ticket: str) -> Result:
    """Deliver ``ticket`` until it is done (a lease a cancelled attempt could not give back expires
    within a second)."""
    for _ in range(50):
        result, _ = await deliver(source, ticket)
        assert result is not None
        if result.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            return result
        assert result.outcome is Outcome.IN_PROGRESS, result
        await asyncio.sleep(0.1)
    raise AssertionError(f"{ticket} never settled")


async def sweep_cancellations(app: ConsumerApp, source: InMemorySource, path: Path, *,
                              duplicates_common: bool = False) -> None:
    """``duplicates_common``: before each cancelled delivery, a done message is delivered again and
    again, so that the path looks its key up first (on PostgreSQL in a read shared with others, before
    it takes a connection): the sweep then covers that await too."""
    await prepare(app)
    processed: set[str] = set()
    probes = 0
    k = 1
    if duplicates_common:
        await settle(source, "D0")
        processed.add("D0")
    while True:
        ticket = f"T{k}"
        for _ in range(40 if duplicates_common else 0):
            again, _ = await deliver(source, "D0")
            assert again is not None and again.outcome is Outcome.DUPLICATE, again
        result, seen = await deliver(source, ticket, k)
        if result is not None and seen < k:
            assert result.outcome is Outcome.PROCESSED, result
            processed.add(ticket)
            break  # finished before its k-th suspension: every point has been tried
        if result is not None:
            assert result.outcome is Outcome.PROCESSED, result
            processed.add(ticket)
        assert await stuck_backends(app) == 0, f"k={k}: a transaction outlived its cancelled delivery"
        await settle(source, ticket)  # processed now, or a duplicate of a commit made before the cancel
        processed.add(ticket)
        for _ in range(2 * POOL):  # through every pooled connection
            probes += 1
            probe = f"P{probes}"
            probe_result, _ = await deliver(source, probe)
            assert probe_result is not None and probe_result.outcome is Outcome.PROCESSED, (k, probe_result)
            processed.add(probe)
        visible = await effects(app, path)
        missing = sorted(t for t in processed if visible.get(t) != 1)
        assert not missing, f"k={k}: reported processed, effect not committed once: {missing}"
        assert await stuck_backends(app) == 0, f"k={k}: a transaction left open after the probes"
        k += 1
    assert k > 3, "the sweep should have found several await points"
    final = await effects(app, path)
    assert final == {t: 1 for t in processed}
    if path.outbox:
        assert await outbox_rows(app) == {t: 1 for t in processed}
    if path.session:
        async with app.engine.connect() as conn:
            active = (await conn.exec_driver_sql(
                "SELECT count(*) FROM coordinator_resources WHERE status = 'active'")).scalar_one()
        assert active == 0, "a session outlived its committed delivery"


@pytest.mark.postgres
@pytest.mark.parametrize("path", PG_PATHS, ids=lambda p: p.id)
async def test_cancelled_at_every_await_point_postgres(pg_database: str, path: Path) -> None:
    app, source = build(pg_database, path)
    async with app.running():
        await sweep_cancellations(app, source, path)


@pytest.mark.postgres
@pytest.mark.parametrize("path", [PG_PATHS[0], PG_PATHS[5], PG_PATHS[8]], ids=lambda p: p.id)
async def test_cancelled_at_every_await_point_with_duplicates_common_postgres(pg_database: str, path: Path) -> None:
    app, source = build(pg_database, path)
    async with app.running():
        await sweep_cancellations(app, source, path, duplicates_common=True)


@pytest.mark.parametrize("path", SQLITE_PATHS, ids=lambda p: p.id)
async def test_cancelled_at_every_await_point_sqlite(sqlite_url: str, path: Path) -> None:
    app, source = build(sqlite_url, path)
    async with app.running():
        await sweep_cancellations(app, source, path)
