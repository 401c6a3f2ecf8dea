"""The pytest plugin consumer-kit installs (entry point ``pytest11``).

Fixtures for a user's own suite: ``consumer_kit_settings`` (a temporary SQLite database and a test
HMAC key, so nothing is written to the working directory). Tests that use them are async; run them
with pytest-asyncio or anyio.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from pydantic import SecretStr

from consumer_kit.settings import Settings


@pytest.fixture
def consumer_kit_settings(tmp_path: Path) -> Settings:
    """Settings on a SQLite file of the test's own, with a random HMAC key and fast retries."""
    return Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/consumer-kit.db",
        idempotency_hmac_key=SecretStr(secrets.token_urlsafe(32)),
        retry_backoff_seconds=0.001,
        retry_backoff_max_seconds=0.01,
        shutdown_grace_seconds=5,
    )
