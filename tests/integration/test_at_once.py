"""The key and one staged write in a single statement (``consumer_kit.store.at_once``), on the real
PostgreSQL server through the store's asyncpg pool: written together or not at all."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from consumer_kit.store import Database, Inbox, create_engine
from consumer_kit.store.at_once import AtOnce, can_guard, write_at_once

pytestmark = pytest.mark.postgres

CONSUMER = "http:at-once"
TABLE = "CREATE TABLE IF NOT EXISTS at_once_effects (ticket text PRIMARY KEY, amount integer NOT NULL)"
INSERT = "INSERT INTO at_once_effects (ticket, amount) VALUES ($1, $2)"


@pytest.fixture
async def store(pg_database: str) -> AsyncIterator[tuple[Database, Inbox]]:
    engine = create_engine(pg_database)
    database = Database(engine)
    try:
        async with database.connect() as ex:
            assert ex.driver is not None
            await ex.driver.execute(TABLE)
            await ex.driver.execute("TRUNCATE at_once_effects")
        yield database, Inbox(database, lease_seconds=30, retention_seconds=60, tombstone_seconds=600)
    finally:
        await database.close()
        await engine.dispose()


async def write(database: Database, inbox: Inbox, digest: str, statement: str, *args: object) -> AtOnce:
    async with database.connect() as ex:
        return await write_at_once(ex, inbox, CONSUMER, digest.ljust(64, "0"), "f" * 64, namespace="orders",
                                   version=1, outcome="processed", result={"status": 201, "body": "e30="},
                                   statement=statement, args=args)


async def effects(database: Database) -> list[tuple[str, int]]:
    async with database.connect() as ex:
        assert ex.driver is not None
        return [(r["ticket"], r["amount"]) for r in await ex.driver.fetch(
            "SELECT ticket, amount FROM at_once_effects ORDER BY ticket")]


async def test_the_key_and_its_write_commit_together_and_a_repeat_writes_nothing(
        store: tuple[Database, Inbox]) -> None:
    database, inbox = store
    assert await write(database, inbox, "a1", INSERT, "t-1", 5) is AtOnce.WRITTEN
    async with database.connect() as ex:
        row = await inbox.lookup(ex, CONSUMER, ["a1".ljust(64, "0")])
    assert row is not None and (row["state"], row["result"]) == ("completed", {"status": 201, "body": "e30="})
    # the same key again, with another write: the key's row stops the statement, the write with it
    assert await write(database, inbox, "a1", INSERT, "t-2", 7) is AtOnce.TAKEN
    assert await effects(database) == [("t-1", 5)]


async def test_a_swept_keys_tombstone_stops_the_write(store: tuple[Database, Inbox]) -> None:
    database, inbox = store
    digest = "b1".ljust(64, "0")
    async with database.connect() as ex:
        assert ex.driver is not None
        await ex.driver.execute("INSERT INTO inbox_tombstones (consumer, key_digest, swept_at, expires_at)"
                                " VALUES ($1, $2, now(), now() + interval '1 hour')", CONSUMER, digest)
    assert await write(database, inbox, "b1", INSERT, "t-3", 1) is AtOnce.SWEPT
    assert await effects(database) == []
    async with database.connect() as ex:
        assert await inbox.lookup(ex, CONSUMER, [digest]) is None
        assert ex.driver is not None
        assert await ex.driver.fetchval("SELECT count(*) FROM inbox_tombstones WHERE key_digest = $1", digest) == 1
    # a store with tombstones off does not look
    no_tombstones = Inbox(database, lease_seconds=30, retention_seconds=60, tombstone_seconds=0)
    assert await write(database, no_tombstones, "b1", INSERT, "t-3", 1) is AtOnce.WRITTEN


async def test_a_write_that_fails_leaves_the_key_new(store: tuple[Database, Inbox]) -> None:
    database, inbox = store
    assert await write(database, inbox, "c1", INSERT, "t-4", 1) is AtOnce.WRITTEN
    import asyncpg

    with pytest.raises(asyncpg.UniqueViolationError):  # the route's own table refuses the row
        await write(database, inbox, "c2", INSERT, "t-4", 2)
    async with database.connect() as ex:
        assert await inbox.lookup(ex, CONSUMER, ["c2".ljust(64, "0")]) is None
    assert await write(database, inbox, "c2", INSERT, "t-5", 2) is AtOnce.WRITTEN
    assert await effects(database) == [("t-4", 1), ("t-5", 2)]


async def test_statements_with_a_with_of_their_own_and_updates(store: tuple[Database, Inbox]) -> None:
    database, inbox = store
    own_with = ("WITH wanted(ticket, amount) AS (VALUES ($1::text, $2::integer))"
                " INSERT INTO at_once_effects (ticket, amount) SELECT ticket, amount FROM wanted")
    assert await write(database, inbox, "d1", own_with, "t-6", 3) is AtOnce.WRITTEN
    assert await write(database, inbox, "d2", "  update at_once_effects SET amount = amount + $2 WHERE ticket = $1",
                       "t-6", 10) is AtOnce.WRITTEN
    assert await write(database, inbox, "d2", "UPDATE at_once_effects SET amount = amount + $2 WHERE ticket = $1",
                       "t-6", 10) is AtOnce.TAKEN
    assert await effects(database) == [("t-6", 13)]


def test_which_statements_can_be_guarded() -> None:
    assert can_guard(INSERT) and can_guard("update t set a = 1") and can_guard("DELETE FROM t")
    assert can_guard("WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x")
    assert can_guard("with recursive x AS (SELECT 1) DELETE FROM t")
    for other in ("SELECT 1", "-- a comment\nINSERT INTO t VALUES (1)", "COPY t FROM STDIN", "insertion"):
        assert not can_guard(other), other


async def test_a_route_whose_own_row_is_refused_first_gets_the_answer_written(pg_database: str) -> None:
    """Concurrent requests with one key to a staged route whose row has a unique index of its own: the
    statements after the first may be refused on that index before the key's; each then reads the key's
    row and is answered with its response (a replay), not a 500."""
    import asyncio
    import uuid

    import httpx
    from fastapi import Depends, FastAPI

    from consumer_kit import ConsumerApp
    from consumer_kit.http.asgi import lifespan
    from consumer_kit.http.idempotency import IdempotencyKey, IdempotencyMiddleware, IdempotentContext
    from consumer_kit.testing.server import served_asgi
    from tests.conftest import make_settings

    app = ConsumerApp(make_settings(pg_database))
    refunds = IdempotencyKey(app, namespace="refunds", version=1, staged=True, driver="asyncpg")
    api = FastAPI(lifespan=lifespan(app))
    api.add_middleware(IdempotencyMiddleware)

    @api.post("/refunds", status_code=201)
    async def refund(body: dict[str, str], ctx: IdempotentContext = Depends(refunds)) -> dict[str, str]:  # noqa: B008
        await asyncio.sleep(0.01)  # every request inside the route together
        ctx.stage(INSERT, body["ticket"], 1)
        return {"ticket": body["ticket"]}

    async with served_asgi(api) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
        async with app.database.connect() as ex:
            assert ex.driver is not None
            await ex.driver.execute(TABLE)
        ticket = f"r-{uuid.uuid4()}"
        answers = await asyncio.gather(*(http.post("/refunds", json={"ticket": ticket},
                                                   headers={"Idempotency-Key": f'"{ticket}"'}) for _ in range(20)))
        assert [a.status_code for a in answers] == [201] * 20, [a.text for a in answers if a.status_code != 201]
        assert sum(a.headers.get("idempotency-replayed") == "true" for a in answers) == 19
        async with app.database.connect() as ex:
            assert ex.driver is not None
            assert await ex.driver.fetchval("SELECT count(*) FROM at_once_effects WHERE ticket = $1", ticket) == 1


async def test_a_staged_route_that_publishes_writes_its_message_with_its_row(pg_database: str) -> None:
    """A staged route that stages one statement and publishes to the outbox: the message is written with
    the row and the key (the single statement is not taken: it carries no outbox rows)."""
    import httpx
    from fastapi import Depends, FastAPI

    from consumer_kit import ConsumerApp
    from consumer_kit.http.asgi import lifespan
    from consumer_kit.http.idempotency import IdempotencyKey, IdempotencyMiddleware, IdempotentContext
    from consumer_kit.testing.server import served_asgi
    from tests.conftest import make_settings

    app = ConsumerApp(make_settings(pg_database))
    tickets = IdempotencyKey(app, namespace="tickets", version=1, staged=True, driver="asyncpg")
    api = FastAPI(lifespan=lifespan(app))
    api.add_middleware(IdempotencyMiddleware)

    @api.post("/tickets", status_code=201)
    async def book(body: dict[str, str], ctx: IdempotentContext = Depends(tickets)) -> dict[str, str]:  # noqa: B008
        ctx.stage(INSERT, body["ticket"], 1)
        ctx.outbox.publish("ticket-events", b'{"booked": true}')
        return {"ticket": body["ticket"]}

    async with served_asgi(api) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
        async with app.database.connect() as ex:
            assert ex.driver is not None
            await ex.driver.execute(TABLE)
        for _ in range(2):
            answer = await http.post("/tickets", json={"ticket": "t-pub"}, headers={"Idempotency-Key": '"pub-1"'})
            assert answer.status_code == 201
        async with app.database.connect() as ex:
            assert ex.driver is not None
            assert await ex.driver.fetchval("SELECT count(*) FROM at_once_effects WHERE ticket = 't-pub'") == 1
            assert await ex.driver.fetchval("SELECT count(*) FROM outbox WHERE destination = 'ticket-events'") == 1
