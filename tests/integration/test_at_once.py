"""The key and one staged write in a single statement (``consumer_kit.store.at_once``), on the real
PostgreSQL server through the store's asyncpg pool: written together or not at all; and the writes under
way at once written as a group (``Inbox.write_with_key``), a group that fails sent again alone."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from consumer_kit.store import Database, Inbox, create_engine
from consumer_kit.store.at_once import AtOnce, can_guard, write_at_once
from tests.integration.sleeping import sleeping_statement

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



def staged_api(database_url: str, namespace: str) -> tuple[Any, Any, Any]:
    """A ConsumerApp, a staged endpoint's rules on it (asyncpg) and a FastAPI app with the middleware."""
    from fastapi import FastAPI

    from consumer_kit import ConsumerApp
    from consumer_kit.http.asgi import lifespan
    from consumer_kit.http.idempotency import IdempotencyKey, IdempotencyMiddleware
    from tests.conftest import make_settings

    app = ConsumerApp(make_settings(database_url))
    keys = IdempotencyKey(app, namespace=namespace, version=1, staged=True, driver="asyncpg")
    api = FastAPI(lifespan=lifespan(app))
    api.add_middleware(IdempotencyMiddleware)
    return app, keys, api


async def test_a_route_whose_own_row_is_refused_first_gets_the_answer_written(pg_database: str) -> None:
    """Concurrent requests with one key to a staged route whose row has a unique index of its own: the
    statements after the first may be refused on that index before the key's; each then reads the key's
    row and is answered with its response (a replay), not a 500."""
    import asyncio
    import uuid

    import httpx
    from fastapi import Depends

    from consumer_kit.http.idempotency import IdempotentContext
    from consumer_kit.testing.server import served_asgi

    app, refunds, api = staged_api(pg_database, "refunds")

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


# --- written together (Inbox.write_with_key) -------------------------------------------------------------

# One statement text for every write of a test, so that they share a group; the first sleeps, so that the
# others come while it runs and wait for it.
SLOW = "INSERT INTO at_once_effects (ticket, amount) SELECT $1, $2 FROM pg_sleep($3)"


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The size of every group asyncpg is asked to write (its executemany)."""
    sizes: list[int] = []
    executemany = asyncpg.Connection.executemany

    async def counted(self: asyncpg.Connection, command: str, args: Any, **kwargs: Any) -> None:
        args = list(args)
        sizes.append(len(args))
        await executemany(self, command, args, **kwargs)

    monkeypatch.setattr(asyncpg.Connection, "executemany", counted)
    yield sizes


def named(name: str) -> str:
    """A digest of its own for each name (``ljust`` would make ``g1`` and ``g10`` one)."""
    return hashlib.sha256(name.encode()).hexdigest()


def shared(inbox: Inbox, name: str, *args: object, statement: str = SLOW) -> asyncio.Task[AtOnce]:
    return asyncio.ensure_future(inbox.write_with_key(
        CONSUMER, named(name), "f" * 64, namespace="orders", version=1, outcome="processed",
        result={"status": 201, "body": "e30="}, statement=statement, args=args))


async def leased(database: Database) -> int:
    pool = await database.pool()
    return pool.get_size() - pool.get_idle_size()


async def test_writes_under_way_at_once_go_as_one_group_each_written_once(
        store: tuple[Database, Inbox], groups: list[int]) -> None:
    database, inbox = store
    first = shared(inbox, "g0", "t-0", 0, 0.3)
    await asyncio.sleep(0.05)  # the first is written alone, at once; the others wait for it
    others = [shared(inbox, f"g{i}", f"t-{i}", i, 0.0) for i in range(1, 21)]
    assert await asyncio.gather(first, *others) == [AtOnce.WRITTEN] * 21
    assert groups == [20]  # one round trip and one commit for the twenty
    assert sorted(await effects(database)) == sorted((f"t-{i}", i) for i in range(21))
    async with database.connect() as ex:
        assert ex.driver is not None
        assert await ex.driver.fetchval("SELECT count(*) FROM inbox WHERE consumer = $1 AND state = 'completed'",
                                        CONSUMER) == 21
    assert await leased(database) == 0


async def test_a_group_that_fails_is_sent_again_alone_each_meeting_its_own(
        store: tuple[Database, Inbox], groups: list[int]) -> None:
    """One write of the group has a key taken, another a row its table refuses: the group writes nothing;
    sent again alone, each of the others is written, the taken one is TAKEN, the refused one fails alone."""
    database, inbox = store
    assert await shared(inbox, "taken", "t-taken", 0, 0.0) is AtOnce.WRITTEN
    first = shared(inbox, "h0", "t-h0", 0, 0.3)
    await asyncio.sleep(0.05)
    fine = [shared(inbox, f"h{i}", f"t-h{i}", i, 0.0) for i in range(1, 6)]
    taken = shared(inbox, "taken", "t-other", 9, 0.0)
    refused = shared(inbox, "h9", "t-h1", 9, 0.0)  # t-h1 is another write's row in this group
    done = await asyncio.gather(first, *fine, taken, refused, return_exceptions=True)
    assert done[:6] == [AtOnce.WRITTEN] * 6 and done[6] is AtOnce.TAKEN
    assert isinstance(done[7], asyncpg.UniqueViolationError) and done[7].constraint_name != "pk_inbox"
    assert groups == [7]  # the group, once; then each alone
    written = [("t-taken", 0), ("t-h0", 0), *((f"t-h{i}", i) for i in range(1, 6))]
    assert sorted(await effects(database)) == sorted(written)
    async with database.connect() as ex:
        assert await inbox.lookup(ex, CONSUMER, [named("h9")]) is None  # its key is new still
    assert await leased(database) == 0


async def test_a_write_cancelled_while_it_waits_is_never_written(store: tuple[Database, Inbox]) -> None:
    database, inbox = store
    first = shared(inbox, "w0", "t-w0", 0, 0.3)
    await asyncio.sleep(0.05)
    waiting = shared(inbox, "w1", "t-w1", 1, 0.0)
    after = shared(inbox, "w2", "t-w2", 2, 0.0)
    await asyncio.sleep(0.01)
    waiting.cancel()
    assert await asyncio.gather(first, after) == [AtOnce.WRITTEN] * 2
    assert waiting.cancelled()
    assert sorted(await effects(database)) == [("t-w0", 0), ("t-w2", 2)]
    async with database.connect() as ex:
        assert await inbox.lookup(ex, CONSUMER, [named("w1")]) is None
    assert await leased(database) == 0


async def test_a_write_cancelled_while_its_group_writes_leaves_the_group_unwritten_and_the_others_alone(
        store: tuple[Database, Inbox], groups: list[int]) -> None:
    """A request cancelled while its group's statement runs cancels that statement: nothing of the group is
    written (so the cancelled one writes nothing), and the others are sent again alone and written."""
    database, inbox = store
    first = shared(inbox, "x0", "t-x0", 0, 0.3)
    await asyncio.sleep(0.05)
    slow = shared(inbox, "x1", "t-x1", 1, 2.0)  # the group's statement runs for two seconds
    cancelled = shared(inbox, "x2", "t-x2", 2, 0.0)
    rest = [shared(inbox, f"x{i}", f"t-x{i}", i, 0.0) for i in range(3, 6)]
    assert await first is AtOnce.WRITTEN
    await sleeping_statement(database.engine, slow)  # the group's statement is under way
    cancelled.cancel()
    assert await asyncio.gather(slow, *rest) == [AtOnce.WRITTEN] * 4
    assert cancelled.cancelled()
    assert groups == [5]
    assert sorted(await effects(database)) == sorted([("t-x0", 0), ("t-x1", 1), *((f"t-x{i}", i) for i in range(3, 6))])
    async with database.connect() as ex:
        assert await inbox.lookup(ex, CONSUMER, [named("x2")]) is None
    assert await leased(database) == 0


async def test_a_staged_route_that_publishes_writes_its_message_with_its_row(pg_database: str) -> None:
    """A staged route that stages one statement and publishes to the outbox: the message is written with
    the row and the key (the single statement is not taken: it carries no outbox rows)."""
    import httpx
    from fastapi import Depends

    from consumer_kit.http.idempotency import IdempotentContext
    from consumer_kit.testing.server import served_asgi

    app, tickets, api = staged_api(pg_database, "tickets")

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
