"""Runs each case of ``test_contract.py`` against every adapter that claims its capability."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.conftest import Spans, truncate_all
from tests.contract.adapters import ADAPTERS
from tests.contract.base import Contract, SourceAdapter


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    capability = getattr(metafunc.function, "contract_needs", None)
    if capability is None or "adapter_class" not in metafunc.fixturenames:
        return
    metafunc.parametrize("adapter_class", [pytest.param(adapter, id=adapter.id, marks=adapter.marks)
                                           for adapter in ADAPTERS if capability in adapter.capabilities])


@pytest.fixture
async def adapter(adapter_class: type[SourceAdapter], request: pytest.FixtureRequest) -> AsyncIterator[SourceAdapter]:
    async with adapter_class.prepared(request) as prepared:
        yield prepared


@pytest.fixture
async def contract(adapter: SourceAdapter, request: pytest.FixtureRequest, spans: Spans) -> AsyncIterator[Contract]:
    """The case's harness on a SQLite file of the test's own, or on the run's PostgreSQL database, emptied."""
    if adapter.database == "postgres":
        url: str = request.getfixturevalue("pg_url")
        await truncate_all(url)
    else:
        url = request.getfixturevalue("sqlite_url")
    async with Contract.open(adapter, url, spans.provider) as opened:
        yield opened
