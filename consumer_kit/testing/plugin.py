"""The pytest plugin consumer-kit installs (entry point ``pytest11``).

Fixtures for a user's own suite:

- ``consumer_kit_settings``: a temporary SQLite database and a test HMAC key, so nothing is written
  to the working directory;
- ``consumer_kit_app``: a :class:`ConsumerApp` on those settings (embedded coordinator), not started:
  register handlers, then ``async with consumer_kit_app.running():``;
- ``consumer_kit_source``: an :class:`InMemorySource` (namespace ``test``, version 1);
- ``embedded_coordinator``: an :class:`EmbeddedCoordinator` on its own migrated temporary database.

The async fixture needs pytest-asyncio (``asyncio_mode = "auto"``, or strict mode: it is declared
with ``pytest_asyncio.fixture`` when pytest-asyncio is installed).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
from pydantic import SecretStr

from consumer_kit.app import ConsumerApp
from consumer_kit.coordinator.embedded import EmbeddedCoordinator
from consumer_kit.settings import Settings
from consumer_kit.store import create_engine, ensure_schema
from consumer_kit.testing.source import InMemorySource

F = TypeVar("F", bound=Callable[..., Any])


def async_fixture(func: F) -> F:
    """``pytest_asyncio.fixture`` when pytest-asyncio is installed (works in its strict mode too)."""
    try:
        import pytest_asyncio
    except ImportError:  # pragma: no cover - async fixtures then need another async plugin
        return cast(F, pytest.fixture(func))
    return cast(F, pytest_asyncio.fixture(func))


@pytest.fixture
def consumer_kit_settings(tmp_path: Path) -> Settings:
    """Settings on a SQLite file of the test's own, with a random HMAC key and fast retries."""
    return Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/consumer-kit.db",
        idempotency_hmac_key=SecretStr(secrets.token_urlsafe(32)),
        retry_backoff_seconds=0.001,
        retry_backoff_max_seconds=0.01,
        shutdown_grace_seconds=5,
        sweep_interval_seconds=3600,
    )


@pytest.fixture
def consumer_kit_app(consumer_kit_settings: Settings) -> ConsumerApp:
    """An app on ``consumer_kit_settings`` with the embedded coordinator; register handlers, then run it."""
    return ConsumerApp(consumer_kit_settings)


@pytest.fixture
def consumer_kit_source() -> InMemorySource:
    """A broker-less source: ``await consumer_kit_source.deliver(id=..., body=...)``."""
    return InMemorySource(namespace="test", version=1)


@async_fixture
async def embedded_coordinator(consumer_kit_settings: Settings) -> AsyncIterator[EmbeddedCoordinator]:
    """An embedded coordinator on the temporary database, migrated; closed, and its engine disposed, afterwards."""
    engine = create_engine(consumer_kit_settings.database_url, pooler=consumer_kit_settings.database_pooler)
    coordinator = EmbeddedCoordinator(engine, consumer_kit_settings)
    try:
        await ensure_schema(engine)
        yield coordinator
    finally:
        await coordinator.close()
        await engine.dispose()
