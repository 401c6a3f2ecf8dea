"""Migration 0007 on a database already in use (SQLite, PostgreSQL): a delivery parked before it keeps
everything it had and has no traceback; one parked after it keeps its traceback; its downgrade drops
the column again."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Connection, inspect, text

from consumer_kit.store import Database, DeadLetters, create_engine, upgrade
from consumer_kit.store.database import alembic_config
from tests.conftest import PG_ADMIN_URL, _admin

BEFORE = "0006_parked_replays"
OLD_ID = "0f" * 16


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database with nothing in it yet."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/before.db"
        return
    name = f"ck_test_0007_{secrets.token_hex(4)}"
    await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await _admin(f'CREATE DATABASE "{name}"')
    yield PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://") + f"/{name}"
    await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _columns(connection: Connection) -> list[str]:
    return [column["name"] for column in inspect(connection).get_columns("dead_letters")]


def _downgrade(connection: Connection) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.downgrade(config, BEFORE)


async def test_0007_runs_forward_on_a_database_with_parked_deliveries(empty_url: str) -> None:
    engine = create_engine(empty_url)
    try:
        await upgrade(engine, BEFORE)
        async with engine.begin() as conn:  # parked by the consumer-kit of 0006, with its columns only
            assert "traceback" not in await conn.run_sync(_columns)
            await conn.execute(text(
                "INSERT INTO dead_letters (id, consumer, source, namespace, version, key_digest, reason, detail,"
                " body, headers, attempts, created_at, delivery_id, attributes, fingerprint, replays)"
                " VALUES (:id, 'orders', 'memory:orders', 'orders', 1, :digest, 'retries_exhausted',"
                " 'KeyError: ''amount''', :body, '{\"h\": \"1\"}', 10, :at, 'order-1', NULL, :digest, 0)"),
                {"id": OLD_ID, "digest": "ab" * 32, "body": b'{"order": 1}', "at": datetime(2026, 11, 30)})
        await upgrade(engine)
        database = Database(engine)
        letters = DeadLetters(database)
        old = await letters.get(OLD_ID)
        assert old is not None and old.traceback is None
        assert (old.reason, old.detail, old.body, dict(old.headers), old.attempts) == (
            "retries_exhausted", "KeyError: 'amount'", b'{"order": 1}', {"h": "1"}, 10)
        assert await letters.matching(OLD_ID[:3]) == (1, old)

        new_id = await letters.park(consumer="orders", source="memory:orders", namespace="orders", version=1,
                                    key_digest="cd" * 32, reason="retries_exhausted", body=b"{}", headers={},
                                    attempts=10, detail="KeyError: 'amount'",
                                    traceback="Traceback (most recent call last):\n  ...\nKeyError: 'amount'\n")
        new = await letters.get(new_id)
        assert new is not None and new.traceback == "Traceback (most recent call last):\n  ...\nKeyError: 'amount'\n"
        assert (await letters.matching(""))[0] == 0  # an empty prefix names nothing, not everything

        async with engine.begin() as conn:  # and back
            await conn.run_sync(_downgrade)
            assert "traceback" not in await conn.run_sync(_columns)
        await database.close()
    finally:
        await engine.dispose()

