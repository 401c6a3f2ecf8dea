"""ctx.stage: writes run after the handler, in the delivery's transaction, one statement for a batch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Column, MetaData, String, Table, insert

from consumer_kit import Batch, ConsumerApp, Context, Outcome
from consumer_kit.store.staged import StagedWrites
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings
from tests.integration.sleeping import sleeping_statement

effects_table = Table("staged_effects", MetaData(), Column("ticket", String(40), nullable=False))
INSERT = insert(effects_table)  # built once: the batch groups rows by the statement object


async def prepare(app: ConsumerApp) -> None:
    async with app.engine.begin() as conn:
        await conn.exec_driver_sql("DROP TABLE IF EXISTS staged_effects")
        await conn.exec_driver_sql("CREATE TABLE staged_effects (ticket VARCHAR(40) NOT NULL UNIQUE)")


async def effects(app: ConsumerApp) -> dict[str, int]:
    async with app.engine.connect() as conn:
        rows = (await conn.exec_driver_sql("SELECT ticket, count(*) FROM staged_effects GROUP BY ticket")).all()
    return {r[0]: int(r[1]) for r in rows}


def bisections() -> float:
    return REGISTRY.get_sample_value("consumer_kit_batch_bisections_total") or 0.0


def stage(ctx: Context, style: str, ticket: str) -> None:
    """The effect row, staged as a handler of ``style`` writes it."""
    if style == "asyncpg":
        ctx.stage("INSERT INTO staged_effects (ticket) VALUES ($1)", ticket)
    elif style == "text":
        ctx.stage("INSERT INTO staged_effects (ticket) VALUES (:t)", t=ticket)
    else:
        ctx.stage(INSERT, ticket=ticket)


@pytest.mark.parametrize("style", ["text", "core"])
async def test_a_batch_writes_its_staged_rows_and_a_failing_row_is_isolated(style: str, database_url: str) -> None:
    """48 deliveries stage a row each through SQLAlchemy; three more stage the same row, which a unique
    constraint allows once. Batches holding two of them fail at the staged write and are halved until
    each stands alone: one of the three commits, the other two are parked, every other row is
    written once and its delivery processed without a redelivery."""
    await batch_with_clashes(database_url, style)


@pytest.mark.postgres
async def test_a_batch_writes_its_staged_asyncpg_rows_and_a_failing_row_is_isolated(pg_database: str) -> None:
    """The same with asyncpg's positional arguments (``driver="asyncpg"``): one executemany a batch."""
    await batch_with_clashes(pg_database, "asyncpg")


async def batch_with_clashes(database_url: str, style: str) -> None:
    app = ConsumerApp(make_settings(database_url, retry_attempts=1, max_deliveries=1))
    source = InMemorySource(namespace="staged", version=1)

    @app.handler(source, name="staged", single_transaction=True, batch=Batch(max_size=16, max_wait_ms=20),
                 driver="asyncpg" if style == "asyncpg" else "sqlalchemy")
    async def handle(ctx: Context) -> None:
        ticket = ctx.delivery.text()
        stage(ctx, style, "clash" if ticket.startswith("clash") else ticket)

    tickets = [f"t-{i}" for i in range(48)]
    tickets[10:10] = ["clash-1"]
    tickets[30:30] = ["clash-2", "clash-3"]
    before = bisections()
    async with app.running():
        await prepare(app)
        # Bounded: a batch halved on connections of their own once emptied the pool and hung here.
        results = await asyncio.wait_for(
            asyncio.gather(*(source.deliver(id=f"m-{t}", body=t) for t in tickets)), 60)
        seen = await effects(app)
        parked = await app.dead_letters.list()
    outcomes = dict(zip(tickets, (r.outcome for r in results), strict=True))
    assert seen == {"clash": 1, **{f"t-{i}": 1 for i in range(48)}}
    assert all(outcomes[t] is Outcome.PROCESSED for t in tickets if not t.startswith("clash"))
    clashes = [outcomes[t] for t in ("clash-1", "clash-2", "clash-3")]
    assert sorted(clashes) == sorted([Outcome.PROCESSED, Outcome.DEAD_LETTERED, Outcome.DEAD_LETTERED])
    assert len(parked) == 2 and {p.body for p in parked} < {b"clash-1", b"clash-2", b"clash-3"}
    assert bisections() > before


@pytest.mark.parametrize("single", [True, False], ids=["single-transaction", "two-transactions"])
async def test_staged_rows_commit_with_the_delivery_and_roll_back_with_it(single: bool, database_url: str) -> None:
    """Without a batch, the staged rows are written when the handler returns, in its transaction: a
    handler that raises after staging leaves nothing; its retry writes the row once."""
    app = ConsumerApp(make_settings(database_url, retry_attempts=2))
    source = InMemorySource(namespace="staged-one", version=1)
    failed: set[str] = set()

    @app.handler(source, name="staged-one", single_transaction=single)
    async def handle(ctx: Context) -> None:
        ticket = ctx.delivery.text()
        ctx.stage(INSERT, ticket=ticket)
        ctx.stage("INSERT INTO staged_effects (ticket) VALUES (:t)", t=f"{ticket}-text")
        if ticket.startswith("flaky") and ticket not in failed:
            failed.add(ticket)
            raise ConnectionError("once, after staging")

    async with app.running():
        await prepare(app)
        results = [await source.deliver(id=f"m-{t}", body=t) for t in ("plain", "flaky")]
        again = await source.deliver(id="m-plain", body="plain")
        seen = await effects(app)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.PROCESSED]
    assert again.outcome is Outcome.DUPLICATE
    assert seen == {"plain": 1, "plain-text": 1, "flaky": 1, "flaky-text": 1}


async def test_positional_arguments_need_the_asyncpg_driver(sqlite_url: str) -> None:
    """``ctx.stage(sql, *args)`` is asyncpg's; on SQLite (no asyncpg connection), or mixed with
    keyword parameters, the delivery is parked with the reason, not retried."""
    app = ConsumerApp(make_settings(sqlite_url))
    source = InMemorySource(namespace="staged-wrong", version=1)

    @app.handler(source, name="staged-wrong")
    async def handle(ctx: Context) -> None:
        if ctx.delivery.text() == "both":
            ctx.stage("INSERT INTO staged_effects (ticket) VALUES ($1)", "x", t="x")
        ctx.stage("INSERT INTO staged_effects (ticket) VALUES ($1)", "x")

    async with app.running():
        await prepare(app)
        results = [await source.deliver(id=f"m-{b}", body=b) for b in ("positional", "both")]
        parked = await app.dead_letters.list()
    assert [r.outcome for r in results] == [Outcome.DEAD_LETTERED] * 2
    assert {p.reason for p in parked} == {"handler_misconfigured"}
    assert any("not both" in (p.detail or "") for p in parked)
    assert any("driver='asyncpg'" in (p.detail or "") for p in parked)


class _Recorder:
    """An executor double that records what the staged writes send."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []
        self.driver = self
        self.session = self

    async def executemany(self, statement: str, rows: list[tuple[Any, ...]]) -> None:
        self.calls.append(("executemany", statement, rows))

    async def execute(self, statement: Any, params: Any = None) -> None:
        self.calls.append(("execute", str(statement), params))


async def test_staged_writes_group_rows_by_statement_in_first_staged_order() -> None:
    staged, recorder = StagedWrites(), _Recorder()
    for i in range(3):
        staged.driver("INSERT INTO b VALUES ($1)", (i,))
        staged.driver("INSERT INTO a VALUES ($1)", (i,))
    staged.session("INSERT INTO c VALUES (:v)", {"v": 1})
    staged.session("INSERT INTO c VALUES (:v)", {"v": 2})
    staged.session("DELETE FROM d", {})
    assert staged
    await staged.write(recorder)  # type: ignore[arg-type]
    assert recorder.calls == [
        ("executemany", "INSERT INTO b VALUES ($1)", [(0,), (1,), (2,)]),
        ("executemany", "INSERT INTO a VALUES ($1)", [(0,), (1,), (2,)]),
        ("execute", "INSERT INTO c VALUES (:v)", [{"v": 1}, {"v": 2}]),
        ("execute", "DELETE FROM d", None),
    ]
    assert not staged  # written once: nothing is left to write again


# --- staged=True: the handler runs with nothing held, then its write and the key go together ----------


def counted_at_once(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each single statement the pipeline sent came to (``AtOnce`` values)."""
    from consumer_kit.store import Inbox

    done: list[str] = []
    original = Inbox.write_with_key

    async def counted(inbox: Inbox, *args: Any, **kw: Any) -> Any:
        result = await original(inbox, *args, **kw)
        done.append(result.value)
        return result

    monkeypatch.setattr(Inbox, "write_with_key", counted)
    return done


async def test_a_staged_handler_writes_once_with_its_key(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row a delivery, and none for its redeliveries, on every store; on PostgreSQL on asyncpg the
    row and the key go in one statement each time (a repeat finds the key and writes nothing)."""
    at_once = counted_at_once(monkeypatch)
    asyncpg = database_url.startswith("postgresql+asyncpg")
    app = ConsumerApp(make_settings(database_url))
    source = InMemorySource(namespace="staged-at-once", version=1)

    @app.handler(source, name="staged-at-once", staged=True, driver="asyncpg" if asyncpg else "sqlalchemy")
    async def handle(ctx: Context) -> None:
        stage(ctx, "asyncpg" if asyncpg else "text", ctx.delivery.text())

    async with app.running():
        await prepare(app)
        first = [await source.deliver(id=f"m-{t}", body=t) for t in ("a", "b")]
        again = [await source.deliver(id=f"m-{t}", body=t) for t in ("a", "b")]
        assert [r.outcome for r in first] == [Outcome.PROCESSED] * 2
        assert [r.outcome for r in again] == [Outcome.DUPLICATE] * 2
        assert await effects(app) == {"a": 1, "b": 1}
        async with app.engine.connect() as conn:
            rows = (await conn.exec_driver_sql("SELECT state, outcome, result FROM inbox")).all()
        assert sorted(tuple(r) for r in rows) == [("completed", "processed", None)] * 2
    assert at_once.count("written") == (2 if asyncpg else 0)  # elsewhere, the transaction: the same rows


@pytest.mark.postgres
async def test_concurrent_deliveries_of_one_staged_key_write_once(pg_database: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty deliveries of one id at once all run the handler; one statement writes, the rest find the key
    (or, when the effect's own unique index refuses their row first, the transaction path finds it)."""
    at_once = counted_at_once(monkeypatch)
    app = ConsumerApp(make_settings(pg_database))
    source = InMemorySource(namespace="staged-race", version=1)
    ran = 0

    @app.handler(source, name="staged-race", staged=True, driver="asyncpg")
    async def handle(ctx: Context) -> None:
        nonlocal ran
        ran += 1
        await asyncio.sleep(0.01)  # all of them inside the handler together
        stage(ctx, "asyncpg", "once")

    async with app.running():
        await prepare(app)
        results = await asyncio.gather(*(source.deliver(id="m-race", body="once") for _ in range(20)))
        assert sorted(r.outcome.value for r in results) == ["duplicate"] * 19 + ["processed"]
        assert await effects(app) == {"once": 1}
    assert ran == 20 and at_once.count("written") == 1


@pytest.mark.postgres
async def test_a_staged_handler_falls_back_to_one_transaction(pg_database: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two statements staged, a handler that raised once, a staged write that fails, and a handler that
    reaches for ctx.connection: each settles as on the single-transaction path (the write and the key in
    one transaction; retried; parked with its reason), with nothing written twice."""
    at_once = counted_at_once(monkeypatch)
    app = ConsumerApp(make_settings(pg_database, retry_attempts=2, max_deliveries=1))
    source = InMemorySource(namespace="staged-back", version=1)
    failed: set[str] = set()

    @app.handler(source, name="staged-back", staged=True, driver="asyncpg")
    async def handle(ctx: Context) -> None:
        ticket = ctx.delivery.text()
        if ticket == "flaky" and ticket not in failed:
            failed.add(ticket)
            raise RuntimeError("a moment's failure")
        if ticket == "reaches":
            await ctx.connection.execute("SELECT 1")
        stage(ctx, "asyncpg", "taken" if ticket.startswith("clash") else ticket)
        if ticket == "two":
            stage(ctx, "asyncpg", "two-more")

    async with app.running():
        await prepare(app)
        results = {t: await source.deliver(id=f"m-{t}", body=t) for t in ("two", "flaky", "clash-1", "clash-2",
                                                                           "reaches")}
        assert {t: r.outcome for t, r in results.items()} == {
            "two": Outcome.PROCESSED, "flaky": Outcome.PROCESSED, "clash-1": Outcome.PROCESSED,
            "clash-2": Outcome.DEAD_LETTERED, "reaches": Outcome.DEAD_LETTERED}
        assert results["reaches"].reason == "handler_misconfigured"
        assert await effects(app) == {"two": 1, "two-more": 1, "flaky": 1, "taken": 1}
        async with app.engine.connect() as conn:
            parked = dict((await conn.exec_driver_sql(
                "SELECT state, count(*) FROM inbox GROUP BY state")).all())
        assert parked == {"completed": 3, "dead": 2}
    # clash-1's; flaky ran again on the transaction path, and clash-2's statement failed, writing nothing
    assert at_once == ["written"]


async def test_a_staged_handler_cannot_be_batched() -> None:
    from consumer_kit.errors import ConfigurationError

    app = ConsumerApp(make_settings("sqlite+aiosqlite:///:memory:"))
    with pytest.raises(ConfigurationError, match="staged=True and batch="):
        app.handler(InMemorySource(namespace="x", version=1), staged=True, batch=Batch())


@pytest.mark.postgres
async def test_a_staged_delivery_cancelled_during_its_one_statement_writes_nothing(pg_database: str) -> None:
    """A staged handler's row and key in one statement, the delivery cancelled while it runs (a shutdown,
    a broker's reconnect): neither is written, the connection goes back to the pool, and the redelivery
    is processed once."""
    from sqlalchemy import text

    app = ConsumerApp(make_settings(pg_database))
    source = InMemorySource(namespace="staged-cancel", version=1)
    slow = {"seconds": 3.0}

    @app.handler(source, name="staged-cancel", staged=True, driver="asyncpg")
    async def handle(ctx: Context) -> None:
        ctx.stage("INSERT INTO staged_effects (ticket) SELECT $1 FROM pg_sleep($2)", ctx.delivery.text(),
                  slow["seconds"])

    async with app.running():
        await prepare(app)
        first = asyncio.create_task(source.deliver(id="m-cancel", body="cancel"))
        pool = await app.database.pool()
        await sleeping_statement(app.engine, first)
        first.cancel()
        done, _ = await asyncio.wait([first], timeout=10)
        assert done and first.cancelled()
        assert await effects(app) == {}
        async with app.engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM inbox"))).scalar() == 0
        slow["seconds"] = 0.0
        redelivered = await source.deliver(id="m-cancel", body="cancel")
        again = await source.deliver(id="m-cancel", body="cancel")
        assert (redelivered.outcome, again.outcome) == (Outcome.PROCESSED, Outcome.DUPLICATE)
        assert await effects(app) == {"cancel": 1}
        assert pool.get_size() - pool.get_idle_size() == 0  # every store connection back in the pool
