"""The store on its own: sweeper, key rotation, schema management and migrations."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, func, select, text

from consumer_kit import ConsumerApp, Context, Outcome, SchemaOutOfDate
from consumer_kit.store import (
    Claim,
    ClaimStatus,
    Database,
    Inbox,
    create_engine,
    ensure_schema,
    inbox,
    metadata,
    upgrade,
)
from consumer_kit.store.database import VERSION_TABLE
from consumer_kit.store.executor import Executor
from consumer_kit.store.pace import Pace
from consumer_kit.store.receipts import Creation, ReceiptStore, Scope
from consumer_kit.store.sql import Statement
from consumer_kit.testing import InMemorySource
from tests.clock import Clock
from tests.conftest import TEST_HMAC_KEY, make_settings, run_in_thread
from tests.integration.deadlocks import deadlocked


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[Database]:
    """The store's database on each executor: SQLite, PostgreSQL on asyncpg and on psycopg."""
    engine = create_engine(database_url)
    await ensure_schema(engine)
    database = Database(engine)
    try:
        yield database
    finally:
        await database.close()
        await engine.dispose()


async def claim(database: Database, store: Inbox, name: str, **kw: object) -> Claim:
    async with database.connect() as ex:
        return await store.claim(ex, "c", [name.ljust(64, "0")], "fp", namespace="ns", version=1, **kw)  # type: ignore[arg-type]


async def complete(database: Database, store: Inbox, found: Claim, token: str | None = None, **kw: object) -> bool:
    async with database.transaction() as ex:
        return await store.complete(ex, "c", found.digest, token or found.lease_token or "", outcome="processed",
                                    **kw)  # type: ignore[arg-type]


async def test_sweeper_deletes_expired_rows_in_batches(database: Database) -> None:
    clock = Clock()
    store = Inbox(database, lease_seconds=30, retention_seconds=3600, clock=clock)
    for i in range(25):  # completed an hour and more ago: expired
        assert await complete(database, store, await claim(database, store, f"old{i:04d}"))
    clock.now += timedelta(minutes=30)
    for i in range(5):  # completed half an hour later: still live when the sweep runs
        assert await complete(database, store, await claim(database, store, f"new{i:04d}"))
    clock.now += timedelta(minutes=40)  # first 25 expired (70 min old), last 5 not (40 min old)
    # A started row with a live lease is kept whatever its expiry.
    held = await claim(database, store, "held")
    async with database.engine.begin() as conn:
        await conn.execute(inbox.update().where(inbox.c.key_digest == held.digest)
                           .values(expires_at=clock.now - timedelta(days=1)))

    assert await store.sweep(batch_size=10, max_batches=1) == 10
    assert await store.sweep(batch_size=10) == 15
    async with database.engine.connect() as conn:
        left = sorted(r[0][:4] for r in await conn.execute(select(inbox.c.key_digest)))
    assert left == ["held"] + ["new0"] * 5
    # Once its lease ran out it goes too, although every batch of the sweep before went on past its expiry.
    clock.now += timedelta(seconds=31)
    assert await store.sweep(batch_size=10) == 1


async def expired(database: Database, count: int) -> Inbox:
    """An inbox with ``count`` completed rows, all expired by its clock."""
    clock = Clock()
    store = Inbox(database, lease_seconds=30, retention_seconds=3600, clock=clock)
    for i in range(count):
        assert await complete(database, store, await claim(database, store, f"old{i:04d}"))
    clock.now += timedelta(minutes=70)
    return store


async def test_a_paced_sweep_pauses_between_its_batches_and_deletes_as_much(database: Database) -> None:
    store = await expired(database, 25)
    pauses: list[float] = []

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)

    assert await store.sweep(batch_size=10, pace=Pace(0.5, within=60, sleep=sleep)) == 25
    assert len(pauses) == 2 and all(p > 0 for p in pauses)  # after each full batch (10, 10), not after the last (5)
    async with database.engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(inbox))).scalar_one() == 0


async def test_a_sweep_cancelled_in_its_pause_holds_nothing_and_the_next_one_goes_on(database: Database) -> None:
    store = await expired(database, 25)
    pausing = asyncio.Event()

    async def sleep(_seconds: float) -> None:  # the first pause: the sweep is cancelled there (a worker stopping)
        pausing.set()
        await asyncio.Event().wait()

    sweeping = asyncio.create_task(store.sweep(batch_size=10, pace=Pace(0.5, within=60, sleep=sleep)))
    await asyncio.wait_for(pausing.wait(), 10)
    sweeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sweeping
    assert database.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    if database.asyncpg:  # the store's own pool, which its statements use there
        pool = await database.pool()
        assert pool.get_idle_size() == pool.get_size()
    async with database.engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(inbox))).scalar_one() == 15  # its first batch
    assert await store.sweep(batch_size=10) == 15


async def test_rows_written_before_an_hmac_rotation_are_still_found(database_url: str) -> None:
    new_key = "rotated-hmac-key-fedcba9876543210"
    before = make_settings(database_url)
    after = make_settings(database_url, idempotency_hmac_key=new_key, idempotency_hmac_key_previous=TEST_HMAC_KEY)
    forgotten = make_settings(database_url, idempotency_hmac_key=new_key)
    runs: list[int] = []

    def build(settings: object) -> tuple[ConsumerApp, InMemorySource]:
        app = ConsumerApp(settings)  # type: ignore[arg-type]
        source = InMemorySource(namespace="rotation", version=1)

        @app.handler(source, name="rotation")
        async def handle(ctx: Context) -> None:
            runs.append(1)

        return app, source

    app, source = build(before)
    async with app.running():
        assert (await source.deliver(id="rot-0001", body=b"x")).outcome is Outcome.PROCESSED
    app, source = build(after)
    async with app.running():
        assert (await source.deliver(id="rot-0001", body=b"x")).outcome is Outcome.DUPLICATE
    app, source = build(forgotten)
    async with app.running():  # once the previous key is removed, old records are out of reach
        assert (await source.deliver(id="rot-0001", body=b"x")).outcome is Outcome.PROCESSED
    assert len(runs) == 2


async def test_many_concurrent_claims_one_winner(database: Database) -> None:
    stores = [Inbox(database, lease_seconds=30, retention_seconds=3600) for _ in range(2)]
    claims = await asyncio.gather(*(claim(database, stores[i % 2], "race") for i in range(20)))
    statuses = [c.status for c in claims]
    assert statuses.count(ClaimStatus.ACQUIRED) == 1
    assert statuses.count(ClaimStatus.IN_PROGRESS) == 19


async def test_the_claim_and_completion_answer_every_state(database: Database) -> None:
    """One store, every verdict: new, held, taken over after its lease, lost lease, done, conflict,
    parked; and the single-transaction claim of a new, a done and a failed key."""
    clock = Clock()
    store = Inbox(database, lease_seconds=30, retention_seconds=3600, clock=clock)
    first = await claim(database, store, "k1")
    assert first.acquired and first.attempts == 1 and not first.took_over
    assert (await claim(database, store, "k1")).status is ClaimStatus.IN_PROGRESS
    clock.now += timedelta(seconds=31)  # the holder crashed: its lease runs out
    second = await claim(database, store, "k1")
    assert second.acquired and second.attempts == 2 and second.took_over  # a takeover, counted as one
    assert not await complete(database, store, first)  # the old holder's completion: lease lost
    assert await complete(database, store, second)
    assert (await claim(database, store, "k1")).status is ClaimStatus.COMPLETED
    async with database.connect() as ex:
        other = await store.claim(ex, "c", ["k1".ljust(64, "0")], "other", namespace="ns", version=1)
        assert other.status is ClaimStatus.CONFLICT
        given_back = await store.claim(ex, "c", ["k5".ljust(64, "0")], "fp", namespace="ns", version=1)
        assert given_back.lease_token is not None
        assert await store.release(ex, "c", given_back.digest, given_back.lease_token, error="failed")
        again = await store.claim(ex, "c", ["k5".ljust(64, "0")], "fp", namespace="ns", version=1)
        assert again.acquired and again.attempts == 2 and not again.took_over  # a retry, not a takeover
        parked = await store.claim(ex, "c", ["k2".ljust(64, "0")], "fp", namespace="ns", version=1)
        assert await store.mark_dead(ex, "c", parked.digest, parked.lease_token, reason="poison")
        assert (await claim(database, store, "k2")).status is ClaimStatus.DEAD
        # Single transaction: a new key is written completed; a failed attempt is counted, then finished.
        assert await store.record_failure(ex, "c", ["k3".ljust(64, "0")], "fp", namespace="ns", version=1,
                                          error="boom") == 1
    async with database.transaction() as ex:
        done = await store.claim_completed(ex, "c", ["k3".ljust(64, "0")], "fp", namespace="ns", version=1,
                                           outcome="processed")
        assert done.acquired and done.attempts == 2
        fresh = await store.claim_completed(ex, "c", ["k4".ljust(64, "0")], "fp", namespace="ns", version=1,
                                            outcome="processed")
        assert fresh.acquired and fresh.attempts == 1
    async with database.transaction() as ex:
        again = await store.claim_completed(ex, "c", ["k4".ljust(64, "0")], "fp", namespace="ns", version=1,
                                            outcome="processed")
        assert again.status is ClaimStatus.COMPLETED


async def test_a_transaction_rolls_back_on_error_and_on_cancellation(database: Database) -> None:
    """Both executors: a raise inside ``begin()`` rolls back, a cancellation too, and the connection
    goes back to the pool usable."""
    store = Inbox(database, lease_seconds=30, retention_seconds=3600)
    with pytest.raises(RuntimeError):
        async with database.transaction() as ex:
            await store.claim_completed(ex, "c", ["rb1".ljust(64, "0")], "fp", namespace="ns", version=1,
                                        outcome="processed")
            raise RuntimeError("handler failed")

    entered = asyncio.Event()

    async def hang() -> None:
        async with database.transaction() as ex:
            await store.claim_completed(ex, "c", ["rb2".ljust(64, "0")], "fp", namespace="ns", version=1,
                                        outcome="processed")
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(hang())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with database.connect() as ex:
        for name in ("rb1", "rb2"):
            assert await store.lookup(ex, "c", [name.ljust(64, "0")]) is None


@pytest.mark.postgres
async def test_a_session_rides_on_the_claim_and_the_completion_only(pg_database: str) -> None:
    """The coordinator's creation commits in the claim's statement when the claim takes the lease,
    and not at all when it does not; its ending rolls back with a completion whose lease was lost."""
    engine = create_engine(pg_database)
    await ensure_schema(engine)
    database = Database(engine)
    store = Inbox(database, lease_seconds=30, retention_seconds=3600)
    receipts = ReceiptStore(database, clock=datetime.now)  # type: ignore[arg-type]
    scope = Scope("t", "a", "session")

    def creation(digest: str) -> Creation:
        return receipts.prepare(scope, digest.encode().hex().ljust(64, "0"), "request-fp", kind="session",
                                ttl=timedelta(hours=1), retention=timedelta(days=1), generated=False, cap=1600)

    async def resources(status: str) -> int:
        async with engine.connect() as conn:
            return int((await conn.execute(text(
                "SELECT count(*) FROM coordinator_resources WHERE status = :s"), {"s": status})).scalar_one())

    try:
        await receipts.open_scope(scope)
        first = creation("s1")
        won = await claim(database, store, "ride", creation=first)
        assert won.acquired and won.carried is not None and won.carried["created"] == 1
        lost = await claim(database, store, "ride", creation=creation("s2"))
        assert lost.status is ClaimStatus.IN_PROGRESS
        assert await resources("active") == 1  # no lease, no session

        with pytest.raises(LookupError):
            async with database.transaction() as ex:
                ending = receipts.ending("t", "a", first.resource_id)
                assert not await store.complete(ex, "c", won.digest, "not-the-token", outcome="processed",
                                                ending=ending)
                assert ending.ended is False
                raise LookupError("what the pipeline does on LeaseLost: roll back")
        assert await resources("active") == 1
        ending = receipts.ending("t", "a", first.resource_id)
        assert await complete(database, store, won, ending=ending)
        assert ending.ended is True
        assert (await resources("active"), await resources("ended")) == (0, 1)
    finally:
        await database.close()
        await engine.dispose()


@pytest.mark.postgres
async def test_completion_keeps_a_recent_expiry_and_renews_an_old_one(pg_database: str) -> None:
    """The completion leaves the claim's expiry alone when it is within a lease of the completion's
    own (so PostgreSQL updates the row in place, without index entries), else renews it."""
    engine = create_engine(pg_database)
    await ensure_schema(engine)
    database = Database(engine)
    clock = Clock()
    store = Inbox(database, lease_seconds=30, retention_seconds=3600, clock=clock)

    async def complete_after(name: str, seconds: float) -> datetime:
        found = await claim(database, store, name)
        clock.now += timedelta(seconds=seconds)
        assert await complete(database, store, found)
        async with engine.connect() as conn:
            expires: datetime = (await conn.execute(
                select(inbox.c.expires_at).where(inbox.c.key_digest == found.digest))).scalar_one()
        return expires

    try:
        claimed_at = clock.now
        assert await complete_after("quick", 5) == claimed_at + timedelta(seconds=3600)
        completed_at = clock.now + timedelta(seconds=90)
        assert await complete_after("slow", 90) == completed_at + timedelta(seconds=3600)
    finally:
        await database.close()
        await engine.dispose()


def _ours(name: str | None, type_: str, parent_names: object) -> bool:
    # Other tests leave tables of their own in the shared database; only consumer-kit's are compared.
    return type_ != "table" or name in metadata.tables


def _diff(connection: Connection) -> list[object]:
    context = MigrationContext.configure(connection, opts={
        "compare_type": True, "version_table": VERSION_TABLE, "include_name": _ours})
    return list(compare_metadata(context, metadata))


async def test_migrations_match_the_table_definitions(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.begin() as conn:  # start from nothing
            await conn.run_sync(metadata.drop_all)
            await conn.execute(text("DROP TABLE IF EXISTS consumer_kit_alembic_version"))
        await upgrade(engine)
        async with engine.connect() as conn:
            assert await conn.run_sync(_diff) == []
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_postgres_refuses_an_out_of_date_schema(tmp_path: object) -> None:
    from tests.conftest import PG_ADMIN_URL, _admin

    name = "ck_test_empty_schema"
    run_in_thread(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    run_in_thread(_admin(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://") + f"/{name}"
    try:
        app = ConsumerApp(make_settings(url))
        with pytest.raises(SchemaOutOfDate, match="consumer-kit db upgrade"):
            await app.start()
        engine = create_engine(url)
        await upgrade(engine)
        async with engine.connect() as conn:
            count = (await conn.execute(select(func.count()).select_from(inbox))).scalar_one()
        await engine.dispose()
        assert count == 0
        async with ConsumerApp(make_settings(url)).running():
            pass
    finally:
        run_in_thread(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.postgres
@pytest.mark.parametrize("name", ["LOOKUP", "FIND_RECEIPT", "CLAIM", "CLAIM_BATCH", "LOOKUP_MANY"])
async def test_hot_statements_find_their_row_by_the_whole_key(pg_database: str, name: str) -> None:
    """PostgreSQL plans a prepared statement once for every later run (a generic plan), and on the
    empty tables of a new deployment. Each hot statement must find its row through the whole primary
    key then, or a lookup becomes a scan of every row as the table grows (it did, with IN (...))."""
    from consumer_kit.store import sql
    from consumer_kit.store.executor import numbered

    statement = getattr(sql, name)
    text_with_dollars, names, _ = numbered(statement)
    engine = create_engine(pg_database)
    try:
        async with engine.connect() as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            assert driver is not None
            await driver.execute("SET plan_cache_mode = force_generic_plan")
            types = ", ".join("unknown" for _ in names)
            await driver.execute(f"PREPARE hot ({types}) AS {text_with_dollars}")
            plan = "\n".join(row[0] for row in await driver.fetch(
                f"EXPLAIN EXECUTE hot ({', '.join('NULL' for _ in names)})"))
            await driver.execute("DEALLOCATE hot")
            await conn.rollback()
    finally:
        await engine.dispose()
    # With key_digest IN ($2, $3) the plan's index condition was the consumer alone, key_digest a filter.
    assert any("Index Cond" in line and "key_digest" in line for line in plan.splitlines()), plan


@pytest.fixture(params=["asyncpg", "psycopg"])
async def pg_store(request: pytest.FixtureRequest, pg_database: str) -> AsyncIterator[Database]:
    """The store's database on PostgreSQL through each executor (shared reads are PostgreSQL's)."""
    engine = create_engine(pg_database if request.param == "asyncpg" else
                           pg_database.replace("+asyncpg://", "+psycopg://"))
    await ensure_schema(engine)
    database = Database(engine)
    try:
        yield database
    finally:
        await database.close()
        await engine.dispose()


async def session_creation(database: Database) -> tuple[Scope, Creation]:
    """A coordinator session's creation, ready for a claim to carry (its scope opened)."""
    receipts = ReceiptStore(database, clock=lambda: datetime.now(UTC))
    scope = Scope("t", "a", "session")
    await receipts.open_scope(scope)
    return scope, receipts.prepare(scope, "d".ljust(64, "0"), "request-fp", kind="session",
                                   ttl=timedelta(hours=1), retention=timedelta(days=1), generated=False, cap=1600)


async def test_a_claim_carrying_a_creation_that_loses_a_deadlock_is_run_again(pg_store: Database) -> None:
    """The claim's statement, carrying a session's creation, is aborted by PostgreSQL for a real deadlock
    (see :func:`~tests.integration.deadlocks.deadlocked`) and run again: the lease is taken, and the
    session created and counted once."""
    store = Inbox(pg_store, lease_seconds=30, retention_seconds=3600)
    scope, creation = await session_creation(pg_store)
    won = await deadlocked(pg_store.engine.url, scope, creation.digest, datetime.now(UTC), "WITH inbox_row",
                           claim(pg_store, store, "ride", creation=creation))
    assert won.acquired and won.carried is not None and won.carried["created"] == 1
    async with pg_store.engine.connect() as conn:
        counts = (await conn.execute(text(
            "SELECT (SELECT count(*) FROM inbox), (SELECT count(*) FROM idempotency_receipts),"
            " (SELECT sum(live) FROM idempotency_scopes)"))).one()
    assert tuple(counts) == (1, 1, 1)


async def test_the_schema_check_opens_again_a_connection_the_server_ended(
        pg_store: Database, caplog: pytest.LogCaptureFixture) -> None:
    """A worker's start-up meets a database cut (an administrator's, a failover's): the pooled connection
    its first statement takes was terminated by the server. The check opens a connection again, with a
    warning, instead of ending the worker with a traceback."""
    engine = create_engine(pg_store.engine.url.render_as_string(hide_password=False), pool_size=1)
    try:
        async with engine.connect() as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        async with pg_store.engine.connect() as admin:  # the pooled connection is idle now: end it
            assert (await admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})).scalar_one()
        with caplog.at_level(logging.WARNING, logger="consumer_kit.store"):
            await ensure_schema(engine)
    finally:
        await engine.dispose()
    said = [r.getMessage() for r in caplog.records if r.name == "consumer_kit.store"]
    assert len(said) == 1, said
    assert "opening a connection again" in said[0] and \
        ("ended the connection" in said[0] or "connection was lost" in said[0]), said


async def test_a_lease_alone_commits_without_waiting_for_its_flush(pg_store: Database) -> None:
    """The claim turns ``synchronous_commit`` off for its own transaction and for nothing after it: the
    delivery's second transaction (its effect and completion) on the same connection commits durably.
    A claim carrying a session's creation stays durable."""
    store = Inbox(pg_store, lease_seconds=30, retention_seconds=3600)
    _, creation = await session_creation(pg_store)
    setting = Statement("SELECT current_setting('synchronous_commit') AS mode")

    async def claimed(ex: Executor, name: str, **kw: object) -> str:
        """Claim ``name`` in a transaction of its own; the setting the claim left in it."""
        async with ex.begin():
            found = await store.claim(ex, "c", [name.ljust(64, "0")], "fp", namespace="ns", version=1,
                                      **kw)  # type: ignore[arg-type]
            assert found.acquired
            return str((await ex.fetch_one(setting, {}))["mode"])  # type: ignore[index]

    async with pg_store.connect() as ex:
        assert await claimed(ex, "lease") == "off"
        assert (await ex.fetch_one(setting, {}))["mode"] == "on"  # type: ignore[index]
        # In autocommit, as the pipeline claims: the statement's own transaction ends with it.
        assert (await store.claim(ex, "c", ["auto".ljust(64, "0")], "fp", namespace="ns", version=1)).acquired
        assert (await ex.fetch_one(setting, {}))["mode"] == "on"  # type: ignore[index]
        assert await claimed(ex, "ride", creation=creation) == "on"


async def test_lookups_under_way_at_once_are_read_together(pg_store: Database) -> None:
    store = Inbox(pg_store, lease_seconds=30, retention_seconds=3600)
    assert store.shares_reads
    done = [await claim(pg_store, store, f"k{i:03d}") for i in range(40)]
    for found in done[:20]:
        assert await complete(pg_store, store, found)
    digests = [found.digest for found in done]
    statements = 0
    counting = pg_store.connect

    def connect(**kw: object) -> object:
        nonlocal statements
        statements += 1
        return counting(**kw)  # type: ignore[arg-type]

    pg_store.connect = connect  # type: ignore[method-assign]
    # 60 deliveries at once: 40 keys (20 done, 20 started), 10 unknown, and 10 whose row was written
    # under the previous HMAC key (their second candidate digest).
    asks = [[d] for d in digests] + [[f"u{i:03d}".ljust(64, "0")] for i in range(10)] + \
           [[f"n{i:03d}".ljust(64, "0"), digests[i]] for i in range(10)]
    rows = await asyncio.gather(*(store.look("c", ask) for ask in asks))
    assert statements < len(asks) / 5  # read together: the first alone, then the rest at once
    assert [r["state"] for r in rows[:20]] == ["completed"] * 20
    assert [r["state"] for r in rows[20:40]] == ["started"] * 20
    assert rows[40:50] == [None] * 10
    assert [r["key_digest"] for r in rows[50:]] == digests[:10]


async def test_a_cancelled_lookup_leaves_the_others_their_answers(pg_store: Database) -> None:
    store = Inbox(pg_store, lease_seconds=30, retention_seconds=3600)
    found = await claim(pg_store, store, "k")
    looks = [asyncio.ensure_future(store.look("c", [found.digest])) for _ in range(5)]
    await asyncio.sleep(0)
    looks[2].cancel()
    answers = await asyncio.gather(*looks, return_exceptions=True)
    assert isinstance(answers[2], asyncio.CancelledError)
    assert all(a["key_digest"] == found.digest for i, a in enumerate(answers) if i != 2)  # type: ignore[index]
    assert (await store.look("c", [found.digest]))["key_digest"] == found.digest  # type: ignore[index]


async def test_a_failed_shared_read_fails_its_callers_and_the_next_read_works(pg_store: Database) -> None:
    store = Inbox(pg_store, lease_seconds=30, retention_seconds=3600)
    found = await claim(pg_store, store, "k")
    async with pg_store.engine.begin() as conn:
        await conn.execute(text("ALTER TABLE inbox RENAME TO inbox_away"))
    try:
        answers = await asyncio.gather(*(store.look("c", [found.digest]) for _ in range(3)), return_exceptions=True)
        assert all(isinstance(a, Exception) for a in answers)
    finally:
        async with pg_store.engine.begin() as conn:
            await conn.execute(text("ALTER TABLE inbox_away RENAME TO inbox"))
    assert (await store.look("c", [found.digest]))["key_digest"] == found.digest  # type: ignore[index]
