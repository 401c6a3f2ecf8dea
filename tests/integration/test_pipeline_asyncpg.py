"""What is particular to handlers on PostgreSQL's asyncpg driver: the single-transaction path's row
waits, ctx.db and ctx.connection in one transaction, and SQLite refusing driver="asyncpg". (The
pipeline's common cases run for ctx.connection too, in test_pipeline.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from sqlalchemy import func, select, text

from consumer_kit import ConfigurationError, ConsumerApp, Context, Outcome, Settlement, TerminalError
from consumer_kit.store import outbox
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings

pytestmark = pytest.mark.postgres

Hook = Callable[[Context], Awaitable[None]] | None


def build(url: str, *, single: bool, before: Hook = None, after: Hook = None,
          **overrides: object) -> tuple[ConsumerApp, InMemorySource, list[int]]:
    app = ConsumerApp(make_settings(url, **overrides))
    source = InMemorySource(namespace="raw", version=1)
    runs: list[int] = []

    @app.handler(source, single_transaction=single, driver="asyncpg", name="raw")
    async def handle(ctx: Context) -> None:
        runs.append(ctx.attempt)
        if before is not None:
            await before(ctx)
        await ctx.connection.execute("INSERT INTO raw_effects (ticket) VALUES ($1)", ctx.delivery.json()["key"])
        ctx.outbox.publish("tickets.prepared", ctx.delivery.body)
        if after is not None:
            await after(ctx)

    return app, source, runs


async def prepare(app: ConsumerApp) -> None:
    async with app.engine.begin() as conn:
        await conn.exec_driver_sql("DROP TABLE IF EXISTS raw_effects")
        await conn.exec_driver_sql("CREATE TABLE raw_effects (id serial PRIMARY KEY, ticket text NOT NULL)")


def gate() -> tuple[asyncio.Event, asyncio.Event, Callable[[Context], Awaitable[None]]]:
    """A hook that holds the first handler run inside its transaction until ``release`` is set;
    ``entered`` is set once it is held. Later runs pass straight through."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def hold(ctx: Context) -> None:
        if not entered.is_set():
            entered.set()
            await release.wait()

    return entered, release, hold


async def counts(app: ConsumerApp) -> tuple[int, int]:
    async with app.engine.connect() as conn:
        effects = (await conn.exec_driver_sql("SELECT count(*) FROM raw_effects")).scalar_one()
        rows = (await conn.execute(select(func.count()).select_from(outbox))).scalar_one()
    return int(effects), int(rows)


async def test_one_txn_concurrent_repeat_waits_then_is_a_duplicate(pg_database: str) -> None:
    """Two workers claim one key on the single-transaction path at once: the second's claim waits for
    the first's uncommitted row, finds it completed after its snapshot, looks again: a duplicate."""
    entered, release, hold = gate()

    app1, source1, runs1 = build(pg_database, single=True, before=hold)
    app2, source2, runs2 = build(pg_database, single=True)
    async with app1.running(), app2.running():
        await prepare(app1)
        first = asyncio.create_task(source1.deliver(id="raw-0006", body=b'{"key": "T-6"}'))
        await asyncio.wait_for(entered.wait(), 10)
        second = asyncio.create_task(source2.deliver(id="raw-0006", body=b'{"key": "T-6"}'))
        await asyncio.sleep(0.3)
        assert not second.done()  # waiting on the first worker's row lock
        release.set()
        assert (await first).outcome is Outcome.PROCESSED
        assert (await second).outcome is Outcome.DUPLICATE
        assert (len(runs1), len(runs2)) == (1, 0)
        assert await counts(app1) == (1, 1)


async def test_one_txn_sees_a_live_lease_as_in_progress(pg_database: str) -> None:
    entered, release, hold = gate()

    holder, source1, _ = build(pg_database, single=False, before=hold)
    app2, source2, runs2 = build(pg_database, single=True)
    async with holder.running(), app2.running():
        await prepare(holder)
        first = asyncio.create_task(source1.deliver(id="raw-0007", body=b'{"key": "T-7"}'))
        await asyncio.wait_for(entered.wait(), 10)
        busy = await source2.deliver(id="raw-0007", body=b'{"key": "T-7"}')
        assert (busy.outcome, busy.settlement) == (Outcome.IN_PROGRESS, Settlement.RETRY_LATER)
        assert busy.delay is not None and busy.delay > 0
        release.set()
        assert (await first).outcome is Outcome.PROCESSED
        assert runs2 == []


@pytest.mark.parametrize("single", [False, True], ids=["two-txn", "one-txn"])
async def test_ctx_db_and_ctx_connection_are_one_transaction(pg_database: str, single: bool) -> None:
    """On the asyncpg driver a handler may write through both ``ctx.db`` (SQLAlchemy) and
    ``ctx.connection`` (asyncpg): one connection, one transaction, committed or rolled back together."""
    app = ConsumerApp(make_settings(pg_database, retry_attempts=1))
    source = InMemorySource(namespace="raw", version=1)

    @app.handler(source, single_transaction=single, name="both")
    async def handle(ctx: Context) -> None:
        ticket = ctx.delivery.json()["key"]
        await ctx.connection.execute("INSERT INTO raw_effects (ticket) VALUES ($1)", f"{ticket}-asyncpg")
        await ctx.db.execute(text("INSERT INTO raw_effects (ticket) VALUES (:t)"), {"t": f"{ticket}-orm"})
        await ctx.db.commit()  # a handler's own commit does not end the delivery's transaction
        if ctx.delivery.json().get("fail"):
            raise TerminalError("after both writes", reason="poison")

    async with app.running():
        await prepare(app)
        failed = await source.deliver(id="both-1", body=b'{"key": "F", "fail": true}')
        assert failed.outcome is Outcome.DEAD_LETTERED
        assert (await source.deliver(id="both-2", body=b'{"key": "K"}')).outcome is Outcome.PROCESSED
        async with app.engine.connect() as conn:
            tickets = sorted((await conn.exec_driver_sql("SELECT ticket FROM raw_effects")).scalars())
    assert tickets == ["K-asyncpg", "K-orm"]


@pytest.mark.parametrize("single", [False, True], ids=["two-txn", "one-txn"])
async def test_the_engine_is_transactional_again_after_ctx_db(pg_database: str, single: bool) -> None:
    """A connection that served ``ctx.db`` is in autocommit for the delivery (its transaction is the
    store's); back in the pool it is the engine's again: the app's own ``engine.begin()`` on that very
    connection (a pool of one) rolls back, and its isolation level is the engine's."""
    app = ConsumerApp(make_settings(pg_database, db_pool_size=1))
    source = InMemorySource(namespace="raw", version=1)

    @app.handler(source, single_transaction=single, name="orm")
    async def handle(ctx: Context) -> None:
        await ctx.db.execute(text("INSERT INTO raw_effects (ticket) VALUES (:t)"), {"t": ctx.delivery.json()["key"]})

    async with app.running():
        await prepare(app)
        assert (await source.deliver(id="orm-1", body=b'{"key": "A"}')).outcome is Outcome.PROCESSED
        with pytest.raises(ZeroDivisionError):
            async with app.engine.begin() as conn:
                await conn.exec_driver_sql("INSERT INTO raw_effects (ticket) VALUES ('rolled back')")
                1 / 0  # noqa: B018 - the block fails after its write
        async with app.engine.connect() as conn:
            pid = (await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar()
            assert await conn.get_isolation_level() == "READ COMMITTED"
            assert conn.in_transaction()  # autobegun, as on any engine connection
            tickets = sorted((await conn.exec_driver_sql("SELECT ticket FROM raw_effects")).scalars())
        assert (await source.deliver(id="orm-2", body=b'{"key": "B"}')).outcome is Outcome.PROCESSED
        async with app.engine.connect() as conn:  # the same connection served both deliveries and the probe
            assert (await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar() == pid
    assert tickets == ["A"]


async def test_an_engine_configured_for_autocommit_stays_so_after_a_ctx_db_checkout(pg_database: str) -> None:
    """The checkout hook puts a connection back to the engine's own setting, not to "transactional":
    on an engine made with ``isolation_level="AUTOCOMMIT"`` a write outside ``begin()`` is still committed
    at once, on the very connection (a pool of one) that served a ctx.db checkout."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from consumer_kit.store.connections import Database

    engine = create_async_engine(pg_database, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0)
    database = Database(engine)
    try:
        async with engine.begin() as conn:
            await conn.exec_driver_sql("DROP TABLE IF EXISTS raw_effects")
            await conn.exec_driver_sql("CREATE TABLE raw_effects (id serial PRIMARY KEY, ticket text NOT NULL)")
        async with database.connect(session=True) as ex, ex.begin():
            await ex.session.execute(text("INSERT INTO raw_effects (ticket) VALUES ('in the store transaction')"))
        async with engine.connect() as conn:  # never committed by the block: autocommit writes at once
            await conn.exec_driver_sql("INSERT INTO raw_effects (ticket) VALUES ('autocommitted')")
            await conn.rollback()
        async with engine.connect() as conn:
            tickets = sorted((await conn.exec_driver_sql("SELECT ticket FROM raw_effects")).scalars())
        assert tickets == ["autocommitted", "in the store transaction"]
    finally:
        await database.close()
        await engine.dispose()


async def test_sqlite_refuses_asyncpg_handlers(sqlite_url: str) -> None:
    app = ConsumerApp(make_settings(sqlite_url))

    @app.handler(InMemorySource(namespace="raw", version=1), driver="asyncpg")
    async def handle(ctx: Context) -> None:
        raise AssertionError("never runs: the app refuses to start")

    with pytest.raises(ConfigurationError, match="need PostgreSQL"):
        await app.start()
