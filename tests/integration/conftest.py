"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.sqs_env import Moto


@pytest.fixture
async def moto(moto_endpoint: str) -> AsyncIterator[Moto]:
    """Clients for the run's moto server; the queues a test creates are deleted after it."""
    kit = Moto(moto_endpoint)
    yield kit
    await kit.cleanup()
