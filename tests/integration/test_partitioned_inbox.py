"""The partitioned inbox (PostgreSQL on asyncpg): made from the plain table with its rows, one row a key
across partitions under concurrent claims (single, batched and an endpoint's held ones) and rotations, the
dedup window at a partition's boundary, partitions leaving under a long transaction, a row past its time
left alone by every change of a key's row, batch handlers through the app, and what it refuses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from sqlalchemy import text

from consumer_kit import Batch, ConfigurationError, ConsumerApp, Context, OperationKey, Outcome, RetryableError
from consumer_kit.cli import main
from consumer_kit.store import BatchKey, Claim, ClaimStatus, Database, Inbox, create_engine, partitions
from consumer_kit.testing import InMemorySource
from tests.clock import Clock
from tests.conftest import TEST_HMAC_KEY, make_settings, migrated_database

pytestmark = pytest.mark.postgres

RETENTION = timedelta(hours=1)
TOMBSTONE = timedelta(hours=2)
PARTITION = timedelta(minutes=10)


@pytest.fixture
def url() -> Iterator[str]:
    """A database of its own: the layout is changed in it."""
    with migrated_database("ck_part") as url:
        yield url


@pytest.fixture
async def database(url: str) -> AsyncIterator[Database]:
    engine = create_engine(url)
    database = Database(engine)
    try:
        yield database
    finally:
        await database.close()
        await engine.dispose()


def store(database: Database, clock: Clock, *, partitioned: bool = True, tombstones: bool = True) -> Inbox:
    return Inbox(database, lease_seconds=30, retention_seconds=RETENTION.total_seconds(), clock=clock,
                 tombstone_seconds=TOMBSTONE.total_seconds() if tombstones else 0, partitioned=partitioned)


async def partition(database: Database, clock: Clock) -> bool:
    async with (await database.pool()).acquire() as conn:
        return await partitions.partition(conn, seconds=PARTITION.total_seconds(), now=clock())


@contextlib.asynccontextmanager
async def rotating(database: Database, clock: Clock) -> AsyncIterator[list[int]]:
    """The generation rotating as fast as it can (every 5 ms) while the block runs; yields ``[rotations]``,
    counted until it ends."""
    rotations = [0]
    running = True

    async def rotate() -> None:
        async with (await database.pool()).acquire() as conn:
            while running:
                await partitions.make_ahead(conn)
                rotations[0] += await partitions.rotate(conn, clock()) is not None
                await asyncio.sleep(0.005)

    rotator = asyncio.create_task(rotate())
    try:
        yield rotations
    finally:
        running = False
        await rotator


async def claim(database: Database, inbox: Inbox, name: str, fp: str = "fp") -> Claim:
    async with database.connect() as ex:
        return await inbox.claim(ex, "c", [digest(name)], fp, namespace="ns", version=1)


async def complete(database: Database, inbox: Inbox, found: Claim) -> bool:
    async with database.transaction() as ex:
        return await inbox.complete(ex, "c", found.digest, found.lease_token or "", outcome="processed")


async def claim_completed(database: Database, inbox: Inbox, name: str) -> Claim:
    async with database.transaction() as ex:
        return await inbox.claim_completed(ex, "c", [digest(name)], "fp", namespace="ns", version=1,
                                           outcome="processed")


async def claim_batch(database: Database, inbox: Inbox, names: list[str]) -> list[Claim]:
    async with database.transaction() as ex:
        return await inbox.claim_batch(ex, "c", [BatchKey(digest(n), "ns", 1, "fp") for n in names],
                                       outcome="processed")


async def held(database: Database, inbox: Inbox, name: str, fp: str = "fp") -> Claim | None:
    """An idempotent endpoint's single transaction: the key held, its row written at the end; the claim, or
    ``None`` when its row was refused at the end (another request's row there after all: rolled back)."""
    async with database.connect() as ex:
        try:
            async with ex.begin():
                found = await inbox.hold(ex, "c", [digest(name)], fp)
                if found.acquired and not await inbox.finish_held(ex, "c", found, fp, namespace="ns", version=1,
                                                                  outcome="processed", result={"status": 201}):
                    raise _Refused()
        except _Refused:
            return None
    return found


class _Refused(Exception):
    """Rolls :func:`held`'s transaction back when its row was refused at the end."""


def digest(name: str) -> str:
    return name.ljust(64, "x")


async def rows_by_generation(database: Database) -> dict[str, list[int]]:
    async with (await database.pool()).acquire() as conn:
        rows = await conn.fetch("SELECT key_digest, generation FROM inbox ORDER BY generation")
    found: dict[str, list[int]] = {}
    for row in rows:
        found.setdefault(row["key_digest"].rstrip("x"), []).append(row["generation"])
    return found


async def test_the_plain_inbox_becomes_generations_and_its_keys_are_still_known(database: Database) -> None:
    clock = Clock()
    plain = store(database, clock, partitioned=False)
    done = await claim(database, plain, "before")
    assert await complete(database, plain, done)
    started = await claim(database, plain, "running")  # its lease is held across the change
    assert await partition(database, clock)
    assert not await partition(database, clock)  # once
    async with (await database.pool()).acquire() as conn:
        assert await partitions.layout(conn) == "partitioned"
        assert await conn.fetchval("SELECT current FROM inbox_rotation") == 1
    inbox = store(database, clock)
    assert (await claim(database, inbox, "before")).status is ClaimStatus.COMPLETED
    assert (await claim(database, inbox, "running")).status is ClaimStatus.IN_PROGRESS
    assert await complete(database, inbox, started)  # the lease taken on the plain table completes
    assert (await claim(database, inbox, "running")).status is ClaimStatus.COMPLETED
    new = await claim(database, inbox, "after")
    assert new.status is ClaimStatus.ACQUIRED and await complete(database, inbox, new)
    assert await rows_by_generation(database) == {"before": [0], "running": [0], "after": [1]}


async def test_one_key_is_one_row_under_concurrent_claims_and_rotations(database: Database) -> None:
    """Claims of the same keys from many tasks (each key claimed by all at once, on both paths) while the
    generation rotates as fast as it can: every key is acquired once and has one row, though its claims
    straddled rotations and the keys ended up in many partitions."""
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock)
    names = [f"k{i:04d}" for i in range(400)]
    acquired: dict[str, int] = dict.fromkeys(names, 0)
    async def claimer(seed: int) -> None:
        for name in names:  # all in the same order: each key is claimed by all of them at once
            if seed % 2:
                found = await claim(database, inbox, name)
                if found.status is ClaimStatus.ACQUIRED:
                    acquired[name] += 1
                    assert await complete(database, inbox, found)
            elif (await claim_completed(database, inbox, name)).status is ClaimStatus.ACQUIRED:
                acquired[name] += 1

    async with rotating(database, clock) as rotations:
        await asyncio.gather(*(claimer(seed) for seed in range(8)))
    assert [name for name, times in acquired.items() if times != 1] == []
    rows = await rows_by_generation(database)
    assert [name for name in names if len(rows[name]) != 1] == []
    assert rotations[0] >= 10, rotations
    assert len({generations[0] for generations in rows.values()}) >= 5  # the keys straddle partitions


async def test_one_key_is_one_row_under_batches_and_single_and_held_claims_and_rotations(database: Database) -> None:
    """Batches of the same keys (each a transaction of one statement, in chunks of three sizes) against single
    claims on both paths and an endpoint's held claims (its row written at the end of its transaction), a dozen
    keys at a time so that every claimer meets the others on each key, while the generation rotates as fast as it
    can: every key is acquired once and has one row. (With the batch's statement unguarded, its generation read
    without the rotation's check, 8 to 32 keys of the 400 had two rows in every one of six runs.)"""
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock)
    names = [f"k{i:04d}" for i in range(400)]
    acquired: dict[str, int] = dict.fromkeys(names, 0)
    async def batches(keys: list[str], size: int) -> None:
        for start in range(0, len(keys), size):  # in the others' order (two batches never wait for each other)
            chunk = keys[start:start + size]
            for name, found in zip(chunk, await claim_batch(database, inbox, chunk), strict=True):
                acquired[name] += found.acquired and found.attempts == 1

    async def singles(keys: list[str], way: str) -> None:
        for name in keys:
            if way == "leased":
                found: Claim | None = await claim(database, inbox, name)
                if found is not None and found.acquired:
                    assert await complete(database, inbox, found)
            elif way == "completed":
                found = await claim_completed(database, inbox, name)
            else:
                found = await held(database, inbox, name)
            acquired[name] += found is not None and found.acquired

    async with rotating(database, clock) as rotations:
        for start in range(0, len(names), 12):  # claimers that keep together meet on each key
            keys = names[start:start + 12]
            await asyncio.gather(batches(keys, 12), batches(keys, 5), batches(keys, 3), singles(keys, "leased"),
                                 singles(keys, "completed"), singles(keys, "held"), singles(keys, "leased"))
    assert [name for name, times in acquired.items() if times != 1] == []
    rows = await rows_by_generation(database)
    assert [name for name in names if len(rows[name]) != 1] == []
    assert rotations[0] >= 10, rotations
    assert len({generations[0] for generations in rows.values()}) >= 5  # the keys straddle partitions


async def test_batch_handlers_on_the_partitioned_inbox(database: Database, url: str) -> None:
    """A batch= handler on the partitioned inbox, as on the plain table: new keys run once (a key twice in one
    batch too); their repeats in later batches are duplicates, after a rotation too (their rows in the generation
    before); late keys (the old table's tombstone, a row past its retention) are parked as
    arrived_after_retention; a key an earlier failed attempt left started runs again, out of the batch. Every key
    has one row, in the generation that was current when it was first claimed."""
    clock = Clock()
    await partition(database, clock)
    settings = make_settings(url, inbox_partition_seconds=PARTITION.total_seconds(),
                             inbox_retention_seconds=int(RETENTION.total_seconds()),
                             inbox_tombstone_seconds=int(TOMBSTONE.total_seconds()), retry_attempts=1)
    async with (await database.pool()).acquire() as conn:
        await conn.execute("CREATE TABLE effects (id varchar(20) NOT NULL)")

    def build(*, failing: bool) -> tuple[ConsumerApp, InMemorySource]:
        app = ConsumerApp(settings, clock=clock)
        source = InMemorySource(namespace="b", version=1)

        @app.handler(source, name="b", single_transaction=True, batch=Batch(max_size=16, max_wait_ms=20))
        async def handle(ctx: Context) -> None:
            if failing and ctx.delivery.id == "flaky":
                raise RetryableError("not yet")
            await ctx.db.execute(text("INSERT INTO effects (id) VALUES (:id)"), {"id": ctx.delivery.id})

        return app, source

    async def deliver(source: InMemorySource, *ids: str) -> list[tuple[Outcome, str | None]]:
        results = await asyncio.gather(*(source.deliver(id=i, body=b"x") for i in ids))
        return [(r.outcome, r.reason if r.outcome is Outcome.DEAD_LETTERED else None) for r in results]

    processed, duplicate = (Outcome.PROCESSED, None), (Outcome.DUPLICATE, None)
    late = (Outcome.DEAD_LETTERED, "arrived_after_retention")
    app, source = build(failing=True)
    async with app.running():
        first = await deliver(source, "m-1", "m-2", "m-3", "m-1", "flaky")
        assert sorted(first[::3], key=str) == sorted([processed, duplicate], key=str)  # m-1 twice in one batch
        assert first[1:3] == [processed, processed] and first[4] == (Outcome.RETRY, None)
        assert await deliver(source, "m-1", "m-2", "m-4") == [duplicate, duplicate, processed]
        clock.now += PARTITION
        await app.sweep()  # rotates: the next generation takes the new keys
        assert await deliver(source, "m-1", "m-4", "m-5") == [duplicate, duplicate, processed]
        consumer = app.specs[0].consumer
        old = settings.digester().candidates(OperationKey("b", 1, "m-old"))[0]
        async with app.engine.begin() as conn:  # a tombstone the plain table's sweeper left
            await conn.execute(text("INSERT INTO inbox_tombstones (consumer, key_digest, swept_at, expires_at)"
                                    " VALUES (:c, :d, :now, :until)"),
                               {"c": consumer, "d": old, "now": clock.now, "until": clock.now + TOMBSTONE})
        assert await deliver(source, "m-old", "m-6") == [late, processed]
    again, source = build(failing=False)  # a new process: it does not know flaky failed in a batch
    async with again.running():
        assert await deliver(source, "flaky", "m-7") == [processed, processed]
        clock.now += RETENTION - PARTITION / 2  # past the first generation's rows' retention only
        assert await deliver(source, "m-2", "m-5", "m-8", "m-8") in (
            [late, duplicate, processed, duplicate], [late, duplicate, duplicate, processed])
    async with (await database.pool()).acquire() as conn:
        effects = sorted(r["id"] for r in await conn.fetch("SELECT id FROM effects"))
    assert effects == ["flaky", "m-1", "m-2", "m-3", "m-4", "m-5", "m-6", "m-7", "m-8"]  # each once
    rows = await rows_by_generation(database)
    assert sorted(map(len, rows.values())) == [1] * 9  # every key one row (m-old none)
    assert sorted(g for (g,) in rows.values()) == [1, 1, 1, 1, 1, 2, 2, 2, 2]  # flaky first failed in 1


async def test_a_batch_claim_cancelled_while_it_waits_leaves_the_pool_clean(database: Database) -> None:
    """A batch's claim waiting for another transaction's insert of one of its keys, cancelled (its caller gone):
    its transaction rolls back, its connection goes back without it or the rotation lock, and the keys are claimed
    once the other transaction has ended."""
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock)
    pool = await database.pool()
    async with database.connect() as other, other.begin():
        assert (await inbox.claim_completed(other, "c", [digest("b")], "fp", namespace="ns", version=1,
                                            outcome="processed")).acquired
        waiting = asyncio.create_task(claim_batch(database, inbox, ["a", "b", "c"]))
        for _ in range(250):  # until the batch's statement waits for the other's row
            async with pool.acquire() as conn:
                if await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                       " AND wait_event_type = 'Lock'"):
                    break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the batch did not wait")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
                                   " WHERE l.locktype = 'advisory' AND d.datname = current_database()") == 0
        assert await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                   " AND state LIKE 'idle in transaction%'") == 0
        assert await partitions.rotate(conn, clock()) == 2  # nothing holds the rotation back
    claims = await claim_batch(database, inbox, ["a", "b", "c"])
    assert [(c.status, c.attempts) for c in claims] == [
        (ClaimStatus.ACQUIRED, 1), (ClaimStatus.COMPLETED, 1), (ClaimStatus.ACQUIRED, 1)]
    assert await rows_by_generation(database) == {"b": [1], "a": [2], "c": [2]}



async def test_a_key_is_known_for_its_retention_then_late_until_its_partition_leaves(database: Database) -> None:
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock)
    first = await claim(database, inbox, "key")
    assert await complete(database, inbox, first)
    clock.now += PARTITION
    await inbox.sweep()  # rotates: the key's generation has ended
    async with (await database.pool()).acquire() as conn:
        ended = await conn.fetchval("SELECT ended_at FROM inbox_generations WHERE generation = 1")
    assert ended == clock.now
    clock.now = datetime(2026, 1, 1, tzinfo=UTC) + RETENTION - timedelta(seconds=1)
    assert (await claim(database, inbox, "key")).status is ClaimStatus.COMPLETED  # within retention: a duplicate
    clock.now += timedelta(seconds=2)
    assert (await claim(database, inbox, "key")).status is ClaimStatus.SWEPT  # past it: late
    async with database.connect() as ex:
        assert await inbox.swept(ex, "c", [digest("key")])
    clock.now = ended + RETENTION + TOMBSTONE - timedelta(seconds=1)
    assert await inbox.sweep() == 0  # its partition may not leave yet
    assert (await claim(database, inbox, "key")).status is ClaimStatus.SWEPT
    clock.now += timedelta(seconds=2)
    assert await inbox.sweep() == 1  # it leaves, with its one row
    assert 1 not in await _attached(database)
    assert (await claim(database, inbox, "key")).status is ClaimStatus.ACQUIRED  # a new key now


async def test_a_row_completed_late_moves_on_when_its_partition_leaves(database: Database) -> None:
    """A lease renewed past its generation's time, then completed: its row is moved into the current
    generation when its own leaves, and is known for its retention from the completion."""
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock)
    held = await claim(database, inbox, "slow")
    for _ in range(int((RETENTION + TOMBSTONE + PARTITION) / timedelta(seconds=20)) + 1):
        clock.now += timedelta(seconds=20)  # the handler runs long, renewing its lease
        async with database.connect() as ex:
            assert await inbox.renew(ex, "c", held.digest, held.lease_token or "")
        if clock.now.second == 0:
            await inbox.sweep()
    assert 1 not in await _attached(database)  # its first generation left...
    assert await complete(database, inbox, held)  # ...but the row is there, moved on, lease and all
    clock.now += RETENTION - timedelta(seconds=1)
    await inbox.sweep()
    assert (await claim(database, inbox, "slow")).status is ClaimStatus.COMPLETED
    assert len((await rows_by_generation(database))["slow"]) == 1


async def test_a_partition_leaves_under_a_long_transaction_without_holding_claims(database: Database,
                                                                                 url: str) -> None:
    """A REPEATABLE READ transaction that read the inbox holds back the partition's detach; claims and
    completions go on meanwhile, and the partition leaves once the transaction ends."""
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock)
    assert await complete(database, inbox, await claim(database, inbox, "old"))
    clock.now += PARTITION
    await inbox.sweep()
    report = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        transaction = report.transaction(isolation="repeatable_read")
        await transaction.start()
        assert await report.fetchval("SELECT count(*) FROM inbox") == 1
        clock.now += RETENTION + TOMBSTONE + PARTITION
        sweep = asyncio.create_task(inbox.sweep())
        for i in range(20):
            found = await asyncio.wait_for(claim(database, inbox, f"new{i}"), 5)
            assert found.status is ClaimStatus.ACQUIRED
            assert await asyncio.wait_for(complete(database, inbox, found), 5)
        await asyncio.sleep(0.5)
        assert not sweep.done()  # the detach waits for the report
        await transaction.rollback()
        assert await asyncio.wait_for(sweep, 30) == 1
    finally:
        await report.close()
    assert 1 not in await _attached(database)


async def test_what_the_partitioned_inbox_refuses(database: Database, url: str) -> None:
    """A key written in a transaction of another isolation than READ COMMITTED, and SQLite."""
    clock = Clock()
    await partition(database, clock)
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        async with conn.transaction(isolation="repeatable_read"):
            with pytest.raises(asyncpg.FeatureNotSupportedError, match="READ COMMITTED"):
                await conn.execute(f"SELECT {partitions.GENERATION}")
    finally:
        await conn.close()
    with pytest.raises(ValueError, match="asyncpg"):
        sqlite = Database(create_engine("sqlite+aiosqlite:///:memory:"))
        store(sqlite, clock)


async def _attached(database: Database) -> list[int]:
    async with (await database.pool()).acquire() as conn:
        return await partitions.attached(conn)


async def test_a_worker_on_the_partitioned_inbox(url: str, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Refused in one line on the plain table; `consumer-kit db partition-inbox` makes the layout; then a
    worker's deliveries, on the default path (with a coordinator session too, ended by the completion) and in
    one transaction, and their repeats, and its sweep rotating the generation. An app without the setting is
    refused on the partitioned table."""
    settings = make_settings(url, inbox_partition_seconds=600)
    with pytest.raises(ConfigurationError, match="db partition-inbox"):
        async with ConsumerApp(settings).running():
            pass
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("INBOX_PARTITION_SECONDS", "600")
    monkeypatch.setenv("IDEMPOTENCY_HMAC_KEY", TEST_HMAC_KEY)
    assert await asyncio.to_thread(main, ["db", "partition-inbox"]) == 0
    assert "the inbox is now partitioned: generations of 600 s, new keys in generation 1" in capsys.readouterr().out
    app = ConsumerApp(settings)
    ran: list[str] = []
    two, one = InMemorySource(namespace="two", version=1), InMemorySource(namespace="one", version=1)
    agent = InMemorySource(namespace="agent", version=1)

    @app.handler(two, name="two")
    async def leased(ctx: Context) -> None:
        ran.append(f"two {ctx.delivery.id}")

    @app.handler(one, name="one", single_transaction=True)
    async def single(ctx: Context) -> None:
        ran.append(f"one {ctx.delivery.id}")

    @app.handler(agent, name="agent", labels=["research-agent"], task="Prepare")
    async def with_session(ctx: Context) -> None:
        assert ctx.session is not None
        ran.append(f"agent {ctx.delivery.id}")

    async with app.running():
        for source in (two, one, agent):
            assert (await source.deliver(id="m-1", body=b"x")).outcome is Outcome.PROCESSED
            assert (await source.deliver(id="m-1", body=b"x")).outcome is Outcome.DUPLICATE
            assert (await source.deliver(id="m-1", body=b"y")).outcome is Outcome.CONFLICT
        async with app.engine.connect() as conn:
            assert (await conn.execute(text("SELECT status FROM coordinator_resources"))).scalars().all() == ["ended"]
        async with app.engine.begin() as conn:
            await conn.execute(text("UPDATE inbox_generations SET started_at = started_at - interval '1 hour'"))
        await app.sweep()  # the generation has taken keys for longer than its 600 s: the next one takes over
        assert (await two.deliver(id="m-2", body=b"x")).outcome is Outcome.PROCESSED
        assert (await two.deliver(id="m-1", body=b"x")).outcome is Outcome.DUPLICATE
    assert ran == ["two m-1", "one m-1", "agent m-1", "two m-2"]
    database = Database(create_engine(url))
    try:  # m-1 of the three consumers in the first generation, m-2 in the next
        assert sorted(g for gens in (await rows_by_generation(database)).values() for g in gens) == [1, 1, 1, 2]
    finally:
        await database.close()
        await database.engine.dispose()
    with pytest.raises(ConfigurationError, match="set INBOX_PARTITION_SECONDS"):
        async with ConsumerApp(make_settings(url, inbox_partition_seconds=0)).running():
            pass


async def test_a_lapsed_lease_is_taken_over_where_its_row_is(database: Database) -> None:
    """A started row whose lease ran out, in a generation that has ended: the next claim takes it over in
    place (attempts 2, still one row), and the attempt that lost it cannot complete."""
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock)
    lost = await claim(database, inbox, "lapsed")
    clock.now += PARTITION
    await inbox.sweep()  # a new generation takes the new keys
    clock.now += timedelta(seconds=31)  # past the 30 s lease
    again = await claim(database, inbox, "lapsed")
    assert (again.status, again.attempts, again.took_over) == (ClaimStatus.ACQUIRED, 2, True)
    assert not await complete(database, inbox, lost)
    assert await complete(database, inbox, again)
    assert (await rows_by_generation(database))["lapsed"] == [1]
    assert (await claim(database, inbox, "lapsed", fp="other")).status is ClaimStatus.CONFLICT


async def test_a_sweep_cancelled_in_its_detach_leaves_the_pool_clean_and_the_next_one_finishes(
        database: Database, url: str) -> None:
    """A worker stopping while a generation's detach waits for a report: the sweep is cancelled there, its
    connection goes back without the upkeep's lock or a transaction, and the next sweep (any worker's)
    finishes the pending detach and drops the generation."""
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock)
    assert await complete(database, inbox, await claim(database, inbox, "old"))
    clock.now += PARTITION
    await inbox.sweep()
    report = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        transaction = report.transaction(isolation="repeatable_read")
        await transaction.start()
        await report.fetchval("SELECT count(*) FROM inbox")
        clock.now += RETENTION + TOMBSTONE + PARTITION
        sweep = asyncio.create_task(inbox.sweep())
        async with (await database.pool()).acquire() as conn:
            for _ in range(200):  # until the detach is under way (pending, waiting for the report)
                if await conn.fetchval("SELECT count(*) FROM pg_inherits WHERE inhdetachpending"):
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the detach did not start")
        sweep.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sweep
        await transaction.rollback()
    finally:
        await report.close()
    async with (await database.pool()).acquire() as conn:
        assert await conn.fetchval(f"SELECT pg_try_advisory_lock({partitions.MAINTENANCE_LOCK})")
        await conn.execute(f"SELECT pg_advisory_unlock({partitions.MAINTENANCE_LOCK})")
    found = await claim(database, inbox, "new")  # the pool's connections are usable
    assert found.status is ClaimStatus.ACQUIRED
    # The cancelled detach was generation 0's (the plain table's, empty); the next sweep finishes it, then
    # generation 1 leaves with its row.
    assert await inbox.sweep() == 1
    assert {0, 1}.isdisjoint(await _attached(database))
    async with (await database.pool()).acquire() as conn:
        assert await conn.fetchval("SELECT to_regclass('inbox_p0')") is None
        assert await conn.fetchval("SELECT to_regclass('inbox_p1')") is None
        assert not await conn.fetchval("SELECT count(*) FROM pg_inherits WHERE inhdetachpending")


async def test_a_row_past_its_time_is_not_changed_as_the_keys_record(database: Database) -> None:
    """With tombstones on, a key's row past its time without a live lease is its tombstone: the lease that ran
    out cannot renew, release, park, withdraw or complete it, a parked key's replay cannot reopen it, and a failed
    attempt's row cannot be parked (on the plain table the sweeper deleted such a row: they find none). So none of
    them makes it matter again in a generation that may be leaving, its rows that still matter moved on already.
    The key stays late until its generation leaves, then is new."""
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock)
    lost = await claim(database, inbox, "lapsed")
    parked = await claim(database, inbox, "parked")
    async with database.transaction() as ex:
        assert await inbox.mark_dead(ex, "c", parked.digest, parked.lease_token, reason="poison")
        assert await inbox.record_failure(ex, "c", [digest("failed")], "fp", namespace="ns", version=1,
                                          error="boom") == 1
    before = await _rows(database)
    clock.now += RETENTION + timedelta(seconds=1)  # the lease ran out long ago, and the rows' retention with it
    token = lost.lease_token or ""
    async with database.connect() as ex:
        assert not await inbox.renew(ex, "c", lost.digest, token)
        assert not await inbox.release(ex, "c", lost.digest, token)
        assert not await inbox.mark_dead(ex, "c", lost.digest, token, reason="poison")
        assert not await inbox.withdraw(ex, "c", lost.digest, token)
        assert not await inbox.mark_dead(ex, "c", digest("failed"), None, reason="retries_exhausted")
    assert not await complete(database, inbox, lost)
    assert await _rows(database) == before
    for name in ("lapsed", "failed"):
        assert (await claim(database, inbox, name)).status is ClaimStatus.SWEPT
    async with database.transaction() as ex:  # the replay of the parked key: a key like any other again
        assert not await inbox.reopen(ex, "c", [parked.digest])
    assert (await claim(database, inbox, "parked")).status is ClaimStatus.ACQUIRED
    await inbox.sweep()  # rotates
    clock.now += RETENTION + TOMBSTONE
    assert await inbox.sweep() == 3  # generation 1 leaves with its three rows, all past their time
    assert (await claim(database, inbox, "lapsed")).status is ClaimStatus.ACQUIRED


async def test_without_tombstones_a_lapsed_started_row_gives_way_to_a_new_claim(database: Database) -> None:
    """With tombstones off (LATE_DELIVERY_POLICY=process) a started row past its time without a live lease is one
    the plain table's sweeper deletes, and nothing here takes it over where it is (its generation may be leaving):
    the claim that meets it, on each path and an endpoint's, deletes it and writes the key anew in the current
    generation; the lease that ran out cannot complete."""
    clock = Clock()
    await partition(database, clock)
    inbox = store(database, clock, tombstones=False)
    lost = await claim(database, inbox, "leased")
    async with database.transaction() as ex:
        for name in ("single", "endpoint"):
            await inbox.record_failure(ex, "c", [digest(name)], "fp", namespace="ns", version=1, error="boom")
    clock.now += PARTITION
    await inbox.sweep()  # rotates: generation 2 takes the new keys
    clock.now += RETENTION
    assert not await complete(database, inbox, lost)
    again = await claim(database, inbox, "leased")
    assert (again.status, again.attempts, again.took_over) == (ClaimStatus.ACQUIRED, 1, False)
    assert await complete(database, inbox, again)
    single = await claim_completed(database, inbox, "single")
    assert (single.status, single.attempts) == (ClaimStatus.ACQUIRED, 1)
    endpoint = await held(database, inbox, "endpoint")
    assert endpoint is not None and (endpoint.status, endpoint.attempts, endpoint.carried) == (
        ClaimStatus.ACQUIRED, 1, None)
    assert await rows_by_generation(database) == {"leased": [2], "single": [2], "endpoint": [2]}
    assert (await claim(database, inbox, "endpoint")).status is ClaimStatus.COMPLETED


async def _rows(database: Database) -> list[tuple[object, ...]]:
    async with (await database.pool()).acquire() as conn:
        return [tuple(r) for r in await conn.fetch("SELECT * FROM inbox ORDER BY key_digest")]
