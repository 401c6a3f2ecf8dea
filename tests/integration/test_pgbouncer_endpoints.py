"""Idempotent HTTP endpoints through PgBouncer in transaction pool mode, on asyncpg and on psycopg.

Their PostgreSQL tests that make up the default path (the first request runs once and repeats replay
it; a repeat while the first runs, on both paths: a lease, or in one transaction the key's advisory
lock; one transaction's failure leaving nothing; 200 requests at once with one key) are collected here
a second time, unchanged, on a database of this module's own reached through the run's PgBouncer, with
``DATABASE_POOLER=transaction`` in the environment as a user sets it (see ``test_pgbouncer.py`` for the
store's default path).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import migrated_database
from tests.integration import test_idempotent_endpoints
from tests.integration.test_idempotent_endpoints import (  # noqa: F401
    client,
    served,
    test_200_requests_at_once_with_one_key_run_it_once,
    test_a_repeat_while_the_first_runs_is_a_409_with_retry_after,
    test_in_one_transaction_a_failure_leaves_nothing_behind,
    test_in_one_transaction_a_repeat_while_the_first_runs,
    test_in_one_transaction_the_first_request_runs_once_and_repeats_replay,
    test_the_first_request_runs_once_and_every_repeat_gets_its_response,
)
from tests.pgbouncer import through

pytestmark = pytest.mark.postgres


class Bounced(test_idempotent_endpoints.Database):
    """The app's database through the bouncer (``url``, on either driver); the effects are read
    straight from PostgreSQL (``direct``), by a client of the test's own."""

    def __init__(self, url: str, direct: str) -> None:
        super().__init__(url)
        self._direct = test_idempotent_endpoints.Database(direct)

    def effects(self, ticket: str) -> list[tuple[str, str | None, int]]:
        return self._direct.effects(ticket)

    def advisory_locks(self) -> int:
        return self._direct.advisory_locks()


@pytest.fixture(scope="module", params=["asyncpg", "psycopg"])
def database(request: pytest.FixtureRequest, pgbouncer_port: int) -> Iterator[Bounced]:
    """A database of the module's own, migrated, reached through the bouncer with
    ``DATABASE_POOLER=transaction``, for the module's tests on each driver."""
    with pytest.MonkeyPatch.context() as patch, migrated_database("ck_bounced") as direct:
        url = through(direct, pgbouncer_port).replace("+asyncpg://", f"+{request.param}://")
        patch.setenv("DATABASE_URL", url)
        patch.setenv("DATABASE_POOLER", "transaction")
        yield Bounced(url, direct)
