"""The store's default path through PgBouncer in transaction pool mode, on asyncpg and on psycopg.

The PostgreSQL integration tests that make up that path (claims and completions, leases and takeovers,
the single-transaction and two-transaction paths, batches with their outbox writes, two outbox relays
sharing the table) are collected here a second time, unchanged, with their database reached through
the run's PgBouncer (:func:`tests.conftest.pgbouncer_port`) and ``DATABASE_POOLER=transaction`` set as a
user sets it: in the environment, which every ``Settings`` reads, and given to ``create_engine`` as the
app gives it. Not the whole suite: a second pass of it through a bouncer would double ``make test``.
(The idempotent HTTP endpoints: ``test_pgbouncer_endpoints.py``.)

Then what is PgBouncer's own: a pooler that DATABASE_POOLER does not announce is refused at start-up in
one line, the outbox relay does not rely on LISTEN behind it, and two apps' claims and completions,
sharing one bouncer's few server connections, meet no prepared-statement error.
"""

from __future__ import annotations

import asyncio
import functools

import pytest

from consumer_kit import ConfigurationError
from consumer_kit.store import Database, Inbox, Outbox, create_engine, ensure_schema
from consumer_kit.store.claims import ClaimStatus
from tests.conftest import truncate_all
from tests.integration import test_pipeline, test_store

# The tests that run here again, through the bouncer; the fixtures below hand them its URL.
from tests.integration.test_batch import (  # noqa: F401
    test_a_key_twice_in_one_batch_runs_once,
    test_poison_and_flaky_deliveries_do_not_fail_their_batch,
)
from tests.integration.test_outbox_relay import (  # noqa: F401
    app,
    queue,
    test_a_relay_killed_mid_batch_loses_nothing,
    test_two_relays_publish_every_row_once,
)
from tests.integration.test_pipeline import (  # noqa: F401
    test_a_lease_the_database_lost_rolls_the_effect_back,
    test_concurrent_instances_run_once,
    test_conflict_is_parked_and_writes_nothing,
    test_duplicate_runs_once,
    test_heartbeat_keeps_a_long_handler_alive,
    test_orm_objects_commit_with_the_inbox_record,
    test_takeover_after_crash_and_late_completion_rolls_back,
)
from tests.integration.test_store import (  # noqa: F401
    database,
    test_a_session_rides_on_the_claim_and_the_completion_only,
    test_a_transaction_rolls_back_on_error_and_on_cancellation,
    test_completion_keeps_a_recent_expiry_and_renews_an_old_one,
    test_many_concurrent_claims_one_winner,
    test_sweeper_deletes_expired_rows_in_batches,
    test_the_claim_and_completion_answer_every_state,
)
from tests.pgbouncer import through

pytestmark = pytest.mark.postgres
for _relayed in (test_a_relay_killed_mid_batch_loses_nothing, test_two_relays_publish_every_row_once):
    pytest.mark.rabbitmq(_relayed)  # their own module marks them so; marks do not travel with an import

POOLED = functools.partial(create_engine, pooler="transaction")
"""``create_engine`` as consumer-kit's own entry points call it with ``DATABASE_POOLER=transaction``."""




def announced(patch: pytest.MonkeyPatch, *modules: object) -> None:
    """``DATABASE_POOLER=transaction`` for the ``Settings`` made from now on, and for the engines
    ``modules`` make themselves."""
    patch.setenv("DATABASE_POOLER", "transaction")
    for module in modules:
        patch.setattr(module, "create_engine", POOLED)


@pytest.fixture(autouse=True)
def _announced(monkeypatch: pytest.MonkeyPatch) -> None:
    announced(monkeypatch, test_store)


@pytest.fixture(params=["asyncpg", "psycopg"])
async def bounced(request: pytest.FixtureRequest, pg_url: str, pgbouncer_port: int,
                  monkeypatch: pytest.MonkeyPatch) -> str:
    """The run's database, emptied, through the bouncer, on each driver (in the environment too, beside
    DATABASE_POOLER, for the ``Settings()`` made without a URL)."""
    await truncate_all(pg_url)
    url = through(pg_url, pgbouncer_port).replace("+asyncpg://", f"+{request.param}://")
    monkeypatch.setenv("DATABASE_URL", url)
    return url


@pytest.fixture
def database_url(bounced: str) -> str:
    return bounced


@pytest.fixture
async def pg_database(pg_url: str, pgbouncer_port: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """As the suite's ``pg_database``: on asyncpg (the tests that take it are asyncpg's), through the bouncer."""
    await truncate_all(pg_url)
    url = through(pg_url, pgbouncer_port)
    monkeypatch.setenv("DATABASE_URL", url)
    return url


@pytest.fixture
def target(bounced: str) -> test_pipeline.Target:
    return test_pipeline.Target(bounced)


# --- what is PgBouncer's own ---------------------------------------------------------------------------


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_pooler_that_database_pooler_does_not_announce_is_refused_in_one_line(
        pg_url: str, pgbouncer_port: int, driver: str) -> None:
    url = through(pg_url, pgbouncer_port).replace("+asyncpg://", f"+{driver}://")
    unannounced = create_engine(url)
    try:
        with pytest.raises(ConfigurationError) as refused:
            await ensure_schema(unannounced)
    finally:
        await unannounced.dispose()
    said = str(refused.value)
    assert "\n" not in said and said.endswith("set DATABASE_POOLER=transaction"), said
    assert "pool_mode = transaction" in said
    # Announced, the same database starts; and straight to PostgreSQL nothing is refused.
    for engine in (POOLED(url), create_engine(pg_url.replace("+asyncpg://", f"+{driver}://"))):
        try:
            await ensure_schema(engine)
        finally:
            await engine.dispose()


async def test_behind_the_pooler_the_relay_does_not_listen(bounced: str) -> None:
    engine = POOLED(bounced)
    store = Database(engine)
    try:
        async with Outbox(store).listen(lambda: None) as listening:
            assert listening is False
    finally:
        await store.close()
        await engine.dispose()


async def test_two_apps_on_few_server_connections_claim_and_complete_without_a_statement_error(
        bounced: str) -> None:
    # Two engines and their pools share the bouncer's server connections (20 for the database): each
    # transaction lands on whichever is free, so a statement prepared and kept by one client would be met
    # by another (42P05) or missed by its own (26000).
    engines = [POOLED(bounced, pool_size=6) for _ in range(2)]
    stores = [Database(engine) for engine in engines]
    inboxes = [Inbox(store, lease_seconds=30, retention_seconds=3600) for store in stores]
    try:
        await ensure_schema(engines[0])

        async def one(n: int, inbox: Inbox) -> bool:
            digest = f"{n:064x}"
            async with inbox.database.connect() as ex:
                found = await inbox.claim(ex, "bounced", [digest], "fp", namespace="ns", version=1)
            assert found.status is ClaimStatus.ACQUIRED and found.lease_token is not None, found
            async with inbox.database.transaction() as ex:
                return await inbox.complete(ex, "bounced", found.digest, found.lease_token, outcome="processed")

        assert await asyncio.gather(*(one(n, inboxes[n % 2]) for n in range(300))) == [True] * 300

        async def again(n: int, inbox: Inbox) -> ClaimStatus:
            async with inbox.database.connect() as ex:
                return (await inbox.claim(ex, "bounced", [f"{n:064x}"], "fp", namespace="ns", version=1)).status

        # Every key again, from the other app: each one a duplicate now.
        assert set(await asyncio.gather(*(again(n, inboxes[1 - n % 2]) for n in range(300)))) == {
            ClaimStatus.COMPLETED}
    finally:
        for store in stores:
            await store.close()
        for engine in engines:
            await engine.dispose()
