"""The store on its own: sweeper, key rotation, schema management and migrations."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, func, select, text

from consumer_kit import ConsumerApp, Context, Outcome, SchemaOutOfDate
from consumer_kit.store import ClaimStatus, Inbox, create_engine, ensure_schema, inbox, metadata, upgrade
from consumer_kit.store.database import VERSION_TABLE
from consumer_kit.store.pglane import PgLane, Rider
from consumer_kit.testing import InMemorySource
from tests.conftest import TEST_HMAC_KEY, make_settings, run_in_thread


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


async def test_sweeper_deletes_expired_rows_in_batches(database_url: str) -> None:
    engine = create_engine(database_url)
    await ensure_schema(engine)
    clock = Clock()
    store = Inbox(engine, lease_seconds=30, retention_seconds=3600, clock=clock)
    try:
        for i in range(25):  # completed an hour and more ago: expired
            claim = await store.claim("c", [f"old{i:04d}".ljust(64, "0")], "fp", namespace="ns", version=1)
            async with engine.begin() as conn:
                assert claim.lease_token is not None
                assert await store.complete(conn, "c", claim.digest, claim.lease_token, outcome="processed")
        clock.now += timedelta(minutes=30)
        for i in range(5):  # completed half an hour later: still live when the sweep runs
            claim = await store.claim("c", [f"new{i:04d}".ljust(64, "0")], "fp", namespace="ns", version=1)
            async with engine.begin() as conn:
                assert claim.lease_token is not None
                assert await store.complete(conn, "c", claim.digest, claim.lease_token, outcome="processed")
        clock.now += timedelta(minutes=40)  # first 25 expired (70 min old), last 5 not (40 min old)
        # A started row with a live lease is kept whatever its expiry.
        held = await store.claim("c", ["held".ljust(64, "0")], "fp", namespace="ns", version=1)
        async with engine.begin() as conn:
            await conn.execute(inbox.update().where(inbox.c.key_digest == held.digest)
                               .values(expires_at=clock.now - timedelta(days=1)))

        assert await store.sweep(batch_size=10, max_batches=1) == 10
        assert await store.sweep(batch_size=10) == 15
        async with engine.connect() as conn:
            left = sorted(r[0][:4] for r in await conn.execute(select(inbox.c.key_digest)))
        assert left == ["held"] + ["new0"] * 5
    finally:
        await engine.dispose()


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


async def test_many_concurrent_claims_one_winner(database_url: str) -> None:
    engine = create_engine(database_url)
    await ensure_schema(engine)
    stores = [Inbox(engine, lease_seconds=30, retention_seconds=3600) for _ in range(2)]
    try:
        claims = await asyncio.gather(*(
            stores[i % 2].claim("c", ["race".ljust(64, "0")], "fp", namespace="ns", version=1) for i in range(20)
        ))
        statuses = [c.status for c in claims]
        assert statuses.count(ClaimStatus.ACQUIRED) == 1
        assert statuses.count(ClaimStatus.IN_PROGRESS) == 19
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_a_rider_commits_with_the_claim_and_the_completion_only(pg_database: str) -> None:
    """A Rider's writes share the inbox statement: made when the claim takes the lease, skipped
    when it does not, and rolled back with a completion whose lease was lost."""
    engine = create_engine(pg_database)
    await ensure_schema(engine)
    lane = await PgLane.for_engine(engine, size=2)
    assert lane is not None
    store = Inbox(engine, lease_seconds=30, retention_seconds=3600, lane=lane)

    def marking(value: str) -> Rider:
        return Rider("marks AS (INSERT INTO rider_marks (v) SELECT $1 WHERE EXISTS (SELECT 1 FROM anchor)"
                     " RETURNING 1)", "(SELECT count(*) FROM marks) AS marked", "(SELECT 1) AS one", (value,))

    async def marks() -> list[str]:
        async with engine.connect() as conn:
            return list((await conn.execute(text("SELECT v FROM rider_marks ORDER BY v"))).scalars())

    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE rider_marks (v text NOT NULL)"))
        digest = "rider".ljust(64, "0")
        first = marking("claimed")
        claim = await store.claim("c", [digest], "fp", namespace="ns", version=1, rider=first)
        assert claim.acquired and first.row is not None and first.row["marked"] == 1
        second = marking("not ours")
        busy = await store.claim("c", [digest], "fp", namespace="ns", version=1, rider=second)
        assert busy.status is ClaimStatus.IN_PROGRESS
        assert second.row is not None and second.row["marked"] == 0
        assert await marks() == ["claimed"]

        assert claim.lease_token is not None
        lost = marking("lost")
        async with engine.connect() as conn:
            transaction = await conn.begin()
            assert not await store.complete(conn, "c", digest, "not-the-token", outcome="processed", rider=lost)
            assert lost.row is not None and lost.row["anchor_rows"] == 0
            await transaction.rollback()  # what the pipeline does on LeaseLost
        done = marking("done")
        async with engine.begin() as conn:
            assert await store.complete(conn, "c", digest, claim.lease_token, outcome="processed", rider=done)
        assert await marks() == ["claimed", "done"]
    finally:
        await lane.close()
        await engine.dispose()


@pytest.mark.postgres
async def test_completion_keeps_a_recent_expiry_and_renews_an_old_one(pg_database: str) -> None:
    """On the lane the completion leaves the claim's expiry alone when it is within a lease of the
    completion's own (so the row is updated in place, without index entries), else renews it."""
    engine = create_engine(pg_database)
    await ensure_schema(engine)
    lane = await PgLane.for_engine(engine, size=2)
    assert lane is not None
    clock = Clock()
    store = Inbox(engine, lease_seconds=30, retention_seconds=3600, clock=clock, lane=lane)

    async def complete_after(name: str, seconds: float) -> datetime:
        digest = name.ljust(64, "0")
        claim = await store.claim("c", [digest], "fp", namespace="ns", version=1)
        assert claim.lease_token is not None
        clock.now += timedelta(seconds=seconds)
        async with engine.begin() as conn:
            assert await store.complete(conn, "c", digest, claim.lease_token, outcome="processed")
            expires: datetime = (await conn.execute(
                select(inbox.c.expires_at).where(inbox.c.key_digest == digest))).scalar_one()
        return expires

    try:
        claimed_at = clock.now
        assert await complete_after("quick", 5) == claimed_at + timedelta(seconds=3600)
        completed_at = clock.now + timedelta(seconds=90)
        assert await complete_after("slow", 90) == completed_at + timedelta(seconds=3600)
    finally:
        await lane.close()
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
