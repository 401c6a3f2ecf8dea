"""EmbeddedCoordinator against seed 000, on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from consumer_kit import InvalidKey, Settings
from consumer_kit.coordinator import (
    EmbeddedCoordinator,
    IdempotencyKeyConflict,
    IdempotencyResultInactive,
    ReceiptLimitExceeded,
    SessionRequest,
)
from consumer_kit.store import Database, create_engine, ensure_schema
from consumer_kit.store.receipts import Scope
from consumer_kit.store.tables import coordinator_resources, idempotency_receipts, idempotency_scopes
from tests.conftest import make_settings
from tests.integration.deadlocks import deadlocked

KEY = "ticket-queue:v1:m-1-session"
REQUEST = SessionRequest(labels=("research-agent", "reports"), task="Prepare T-1",
                         metadata={"b": 1, "a": [1, 2]}, scopes=("read", "write"))


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


_DATABASES: dict[AsyncEngine, Database] = {}
"""The store connections of each test's engine, which its coordinators share and the fixture closes."""


async def _engine(url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(url)
    await ensure_schema(engine)
    database = _DATABASES[engine] = Database(engine)
    yield engine
    del _DATABASES[engine]
    await database.close()
    await engine.dispose()


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    async for engine in _engine(database_url):
        yield engine


def coordinator(engine: AsyncEngine, settings: Settings, clock: Clock | None = None, **scope: str
                ) -> EmbeddedCoordinator:
    return EmbeddedCoordinator(_DATABASES[engine], settings, clock=clock or Clock(), **scope)


async def count(engine: AsyncEngine, table: object) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(table))).scalar_one())  # type: ignore[arg-type]


async def test_replay_conflict_inactive(engine: AsyncEngine, database_url: str) -> None:
    coord = coordinator(engine, make_settings(database_url))
    first = await coord.create_session(REQUEST, idempotency_key=KEY)
    assert not first.replayed and first.status == "active"
    # set-like fields and metadata compare canonically: reordering is the same request
    same = REQUEST.model_copy(update={"labels": ("reports", "research-agent"), "scopes": ("write", "read"),
                                      "metadata": {"a": [1, 2], "b": 1}})
    again = await coord.create_session(same, idempotency_key=KEY)
    assert again.replayed and again.session_id == first.session_id and again.expires_at == first.expires_at
    for change in ({"labels": ("research-agent",)}, {"task": "Prepare T-2"}, {"metadata": {"b": 2, "a": [1, 2]}},
                   {"ttl_seconds": 60}, {"scopes": ("read",)}, {"subject": "u-2"}, {"parent_session_id": "p"},
                   {"lifecycle": "durable"}, {"authority_mode": "delegated"}, {"resource": "resource://x"},
                   {"constraints": {"max": 1}}, {"invocation_parameters": {"p": 1}}):
        with pytest.raises(IdempotencyKeyConflict) as caught:
            await coord.create_session(REQUEST.model_copy(update=change), idempotency_key=KEY)
        assert caught.value.code == "idempotency_key_conflict" and caught.value.reason == "conflict"
    await coord.end_session(first.session_id)
    with pytest.raises(IdempotencyResultInactive) as inactive:
        await coord.create_session(REQUEST, idempotency_key=KEY)
    assert inactive.value.code == "idempotency_result_inactive" and inactive.value.reason == "inactive"
    assert await count(engine, coordinator_resources) == 1


async def test_revoked_and_expired_results_are_inactive(engine: AsyncEngine, database_url: str) -> None:
    clock = Clock()
    coord = coordinator(engine, make_settings(database_url), clock)
    revoked = await coord.create_session(REQUEST, idempotency_key="k:revoked")
    await coord.revoke_session(revoked.session_id)
    with pytest.raises(IdempotencyResultInactive):
        await coord.create_session(REQUEST, idempotency_key="k:revoked")
    await coord.create_session(REQUEST.model_copy(update={"ttl_seconds": 60}), idempotency_key="k:expiring")
    clock.now += timedelta(seconds=61)
    with pytest.raises(IdempotencyResultInactive):
        await coord.create_session(REQUEST.model_copy(update={"ttl_seconds": 60}), idempotency_key="k:expiring")


async def test_receipt_stores_digest_and_bounded_fields_only(engine: AsyncEngine, database_url: str) -> None:
    settings = make_settings(database_url)
    clock = Clock()
    coord = coordinator(engine, settings, clock)
    secret_meta = {"prompt": "very-secret-prompt-text"}
    await coord.create_session(REQUEST.model_copy(update={"metadata": secret_meta}), idempotency_key=KEY)
    await coord.create_session(REQUEST, idempotency_key="generated-key-1", generated_key=True)
    async with engine.connect() as conn:
        rows = [row._asdict() for row in await conn.execute(select(idempotency_receipts))]
    assert len(rows) == 2
    stored = repr(rows)
    assert KEY not in stored and "generated-key-1" not in stored and "very-secret" not in stored
    by_generated = {row["generated"]: row for row in rows}
    assert by_generated[False]["key_digest"] == settings.digester().digest(KEY)
    assert set(by_generated[False]["response"]) == {"id", "status", "expires_at"}
    assert by_generated[False]["expires_at"] - clock.now == timedelta(seconds=settings.idempotency_retention_seconds)
    assert by_generated[True]["expires_at"] - clock.now == timedelta(
        seconds=settings.generated_idempotency_retention_seconds)


async def test_isolation_across_tenant_and_application(engine: AsyncEngine, database_url: str) -> None:
    settings = make_settings(database_url)
    base = coordinator(engine, settings, tenant="t1", application="a1")
    first = await base.create_session(REQUEST, idempotency_key=KEY)
    other_app = await base.scoped("t1", "a2").create_session(REQUEST, idempotency_key=KEY)
    other_tenant = await base.scoped("t2", "a1").create_session(REQUEST, idempotency_key=KEY)
    assert not other_app.replayed and not other_tenant.replayed
    assert len({first.session_id, other_app.session_id, other_tenant.session_id}) == 3
    # a session of another scope cannot be ended from here
    with pytest.raises(Exception) as caught:
        await base.scoped("t2", "a1").end_session(first.session_id)
    assert getattr(caught.value, "status", None) == 404
    assert (await base.create_session(REQUEST, idempotency_key=KEY)).replayed


async def test_key_rotation(engine: AsyncEngine, database_url: str) -> None:
    old, new = "old-hmac-key-0123456789abcdef", "new-hmac-key-0123456789abcdef"
    clock = Clock()
    before = coordinator(engine, make_settings(database_url, idempotency_hmac_key=old), clock)
    first = await before.create_session(REQUEST, idempotency_key=KEY)
    rotating = coordinator(engine, make_settings(database_url, idempotency_hmac_key=new,
                                                 idempotency_hmac_key_previous=old), clock)
    replay = await rotating.create_session(REQUEST, idempotency_key=KEY)
    assert replay.replayed and replay.session_id == first.session_id
    with pytest.raises(IdempotencyKeyConflict):  # the old receipt still guards its fingerprint
        await rotating.create_session(REQUEST.model_copy(update={"task": "other"}), idempotency_key=KEY)
    rotated = coordinator(engine, make_settings(database_url, idempotency_hmac_key=new), clock)
    fresh = await rotated.create_session(REQUEST, idempotency_key=KEY)
    assert not fresh.replayed and fresh.session_id != first.session_id


async def test_receipt_cap(engine: AsyncEngine, database_url: str) -> None:
    clock = Clock()
    coord = coordinator(engine, make_settings(database_url, idempotency_max_receipts_per_scope=3,
                                              idempotency_retention_seconds=100), clock)
    for n in range(3):
        await coord.create_session(REQUEST, idempotency_key=f"k:{n}")
    resources = await count(engine, coordinator_resources)
    with pytest.raises(ReceiptLimitExceeded):
        await coord.create_session(REQUEST, idempotency_key="k:3")
    assert await count(engine, coordinator_resources) == resources  # nothing was created
    assert (await coord.create_session(REQUEST, idempotency_key="k:0")).replayed  # replays still work
    # other applications and operations have caps of their own
    await coord.scoped("local", "other").create_session(REQUEST, idempotency_key="k:3")
    clock.now += timedelta(seconds=101)  # the three receipts expire: their slots come back
    await coord.create_session(REQUEST, idempotency_key="k:3")


async def test_sweeper_deletes_expired_in_batches(engine: AsyncEngine, database_url: str) -> None:
    clock = Clock()
    settings = make_settings(database_url, sweep_batch_size=2, idempotency_retention_seconds=10)
    coord = coordinator(engine, settings, clock)
    for n in range(5):
        await coord.create_session(REQUEST, idempotency_key=f"k:{n}")
    clock.now += timedelta(seconds=5)
    await coord.create_session(REQUEST, idempotency_key="k:late")
    assert await coord.sweep() == 0
    clock.now += timedelta(seconds=6)
    assert await coord.sweep() == 5
    assert await count(engine, idempotency_receipts) == 1
    # a swept key is a new operation again
    assert not (await coord.create_session(REQUEST, idempotency_key="k:0")).replayed


async def test_invalid_keys(engine: AsyncEngine, database_url: str) -> None:
    coord = coordinator(engine, make_settings(database_url))
    for bad in ("", " padded", "x" * 256, "bell\x07"):
        with pytest.raises(InvalidKey):
            await coord.create_session(REQUEST, idempotency_key=bad)
    assert await count(engine, coordinator_resources) == 0


async def test_session_context_manager_ends_on_clean_exit(engine: AsyncEngine, database_url: str) -> None:
    coord = coordinator(engine, make_settings(database_url))
    async with coord.session(idempotency_key=KEY, labels=["a"], task="t") as receipt:
        assert not receipt.replayed
    with pytest.raises(IdempotencyResultInactive):
        await coord.create_session(SessionRequest(labels=("a",), task="t"), idempotency_key=KEY)
    with pytest.raises(RuntimeError):
        async with coord.session(idempotency_key="k:failing", task="t") as receipt:
            raise RuntimeError("boom")
    assert (await coord.create_session(SessionRequest(task="t"), idempotency_key="k:failing")).replayed


@pytest.mark.postgres
async def test_concurrent_creations_with_one_key_make_one_session(pg_database: str) -> None:
    """Real concurrency: 3 engines (separate pools), 24 simultaneous creations, one key."""
    engines = [create_engine(pg_database) for _ in range(3)]
    settings = make_settings(pg_database)
    coords = [EmbeddedCoordinator(e, settings) for e in engines]
    try:
        start = asyncio.Event()

        async def one(n: int) -> tuple[str, bool]:
            await start.wait()
            receipt = await coords[n % 3].create_session(REQUEST, idempotency_key=KEY)
            return receipt.session_id, receipt.replayed

        tasks = [asyncio.create_task(one(n)) for n in range(24)]
        await asyncio.sleep(0.05)
        start.set()
        results = await asyncio.gather(*tasks)
        assert len({session_id for session_id, _ in results}) == 1
        assert sorted(replayed for _, replayed in results) == [False] + [True] * 23
        assert await count(engines[0], coordinator_resources) == 1
        assert await count(engines[0], idempotency_receipts) == 1
    finally:
        for made in coords:
            await made.close()
        for engine in engines:
            await engine.dispose()


@pytest.mark.postgres
async def test_close_closes_only_the_connections_a_coordinator_opened(pg_database: str) -> None:
    """A coordinator made on an engine closes its own store connections; a scoped view of it, which
    runs on them, leaves them open; the engine's disposal is the caller's either way."""
    engine = create_engine(pg_database)
    coord = EmbeddedCoordinator(engine, make_settings(pg_database))
    try:
        view = coord.scoped("globex", "tickets")
        await view.create_session(REQUEST, idempotency_key=KEY)
        pool = await coord.database.pool()
        await view.close()
        assert await coord.database.pool() is pool and not pool.is_closing()
        await coord.close()
        assert pool.is_closing()
    finally:
        await coord.close()
        await engine.dispose()


@pytest.mark.postgres
async def test_concurrent_first_creations_of_a_scope_share_its_counter(pg_database: str) -> None:
    """The scope's counter row is created by one of many simultaneous first creations; none is refused."""
    engine = create_engine(pg_database)
    coord = EmbeddedCoordinator(engine, make_settings(pg_database, idempotency_max_receipts_per_scope=30))
    try:
        results = await asyncio.gather(*(coord.create_session(REQUEST, idempotency_key=f"k:{n}") for n in range(16)))
        assert not any(r.replayed for r in results)
        more = await asyncio.gather(*(coord.create_session(REQUEST, idempotency_key=f"k:{n}")
                                      for n in range(16, 40)), return_exceptions=True)
        refused = [r for r in more if isinstance(r, ReceiptLimitExceeded)]
        assert len(refused) == 10  # the cap holds exactly under concurrency: 30 live receipts
        assert await count(engine, idempotency_receipts) == 30
        assert await count(engine, coordinator_resources) == 30
    finally:
        await coord.close()
        await engine.dispose()


async def test_striped_cap_is_exact_and_reopens_after_sweep(engine: AsyncEngine, database_url: str) -> None:
    """A cap of 64 spreads over 16 stripes of 4: the fast path fills stripes, the exact path takes
    over when one is full, the 65th creation is refused, and after the receipts expire and the
    sweeper runs the scope takes creations again."""
    from consumer_kit.store.tables import idempotency_scopes

    clock = Clock()
    settings = make_settings(database_url, idempotency_max_receipts_per_scope=64, idempotency_retention_seconds=60)
    coord = coordinator(engine, settings, clock)
    results = await asyncio.gather(*(coord.create_session(REQUEST, idempotency_key=f"k:{n}") for n in range(90)),
                                   return_exceptions=True)
    assert not [r for r in results if isinstance(r, Exception) and not isinstance(r, ReceiptLimitExceeded)]
    assert sum(isinstance(r, ReceiptLimitExceeded) for r in results) == 26
    assert not [r for r in results if isinstance(r, Exception) and not isinstance(r, ReceiptLimitExceeded)]
    assert await count(engine, idempotency_receipts) == 64
    async with engine.connect() as conn:
        lives = [r.live for r in await conn.execute(select(idempotency_scopes.c.live, idempotency_scopes.c.closed))]
        closed = {r.closed for r in await conn.execute(select(idempotency_scopes.c.closed))}
    assert sum(lives) == 64 and closed == {True}
    clock.now += timedelta(seconds=61)
    assert await coord.sweep() == 64
    async with engine.connect() as conn:
        rows = (await conn.execute(select(idempotency_scopes.c.live, idempotency_scopes.c.closed))).all()
    assert {(r.live, r.closed) for r in rows} == {(0, False)}
    await coord.create_session(REQUEST, idempotency_key="k:after")


@pytest.fixture(params=["asyncpg", "psycopg"])
async def pg_engine(request: pytest.FixtureRequest, pg_database: str) -> AsyncIterator[AsyncEngine]:
    """The ``engine`` fixture on PostgreSQL only, through each executor."""
    async for engine in _engine(pg_database if request.param == "asyncpg" else
                                pg_database.replace("+asyncpg://", "+psycopg://")):
        yield engine


async def test_a_creation_that_loses_a_deadlock_is_run_again(pg_engine: AsyncEngine, pg_database: str) -> None:
    """A real deadlock: the one-statement creation holds its count row and waits for the same key's
    uncommitted receipt, whose transaction then asks for that count row. PostgreSQL aborts the
    creation (the other side's deadlock_timeout is long, so only the creation's backend checks); the
    store runs it again: one session, one receipt, one counted slot."""
    clock = Clock()
    coord = coordinator(pg_engine, make_settings(pg_database), clock)
    await coord.open()
    key = "k:deadlock"
    digest = next(iter(coord.digester.candidates(key)))
    receipt = await deadlocked(pg_database, Scope(coord.tenant, coord.application, "session"), digest, clock.now,
                               "WITH existing", coord.create_session(REQUEST, idempotency_key=key))
    assert not receipt.replayed
    assert await count(pg_engine, idempotency_receipts) == 1
    async with pg_engine.connect() as conn:
        live = (await conn.execute(select(func.sum(idempotency_scopes.c.live)))).scalar_one()
    assert live == 1


async def test_delegations_are_idempotent_too(engine: AsyncEngine, database_url: str) -> None:
    from consumer_kit.coordinator import DelegationRequest

    coord = coordinator(engine, make_settings(database_url))
    session = await coord.create_session(REQUEST)
    request = DelegationRequest(from_session_id=session.session_id, to_subject="agent-2", scopes=("read",))
    first = await coord.create_delegation(request, idempotency_key=KEY)
    again = await coord.create_delegation(request, idempotency_key=KEY)  # same key, other operation scope
    assert again.replayed and again.delegation_id == first.delegation_id
    with pytest.raises(IdempotencyKeyConflict):
        await coord.create_delegation(request.model_copy(update={"to_subject": "agent-3"}), idempotency_key=KEY)
    # the same key for a session is a different receipt (operation is part of the scope)
    assert not (await coord.create_session(REQUEST, idempotency_key=KEY)).replayed
