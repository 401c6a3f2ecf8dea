"""The contract fails sources that break it: each broken source of ``broken.py`` is run through the
contract case it breaks, which must fail with the assertion that names what went wrong."""

from __future__ import annotations

import pytest

from tests.contract import test_contract as cases
from tests.contract.base import Contract, SourceAdapter
from tests.contract.broken import AcknowledgingFirstMemory, AcknowledgingFirstRabbitMQ, DroppingUnkeyableMemory

PATIENCE = 0.1  # the failing case's waits, cut to a tenth: it is known not to be waiting for nothing


async def test_acknowledging_before_the_commit_fails_the_stop_case(request: pytest.FixtureRequest,
                                                                   sqlite_url: str) -> None:
    async with AcknowledgingFirstMemory.prepared(request) as adapter, Contract.open(adapter, sqlite_url) as contract:
        contract.patience = PATIENCE
        with pytest.raises(AssertionError, match=r"redelivered and done after the restart \(lost\?\)"):
            await cases.test_a_delivery_in_flight_at_stop_is_redelivered_once(contract)
        assert await contract.effects() == []  # the work is gone: acknowledged, never done
        assert [run.cancelled for run in contract.script.runs] == [True]


@pytest.mark.rabbitmq
async def test_a_rabbitmq_source_acknowledging_before_the_commit_fails_the_stop_case(
        request: pytest.FixtureRequest, sqlite_url: str) -> None:
    adapter: SourceAdapter
    async with AcknowledgingFirstRabbitMQ.prepared(request) as adapter, \
            Contract.open(adapter, sqlite_url) as contract:
        contract.patience = PATIENCE
        with pytest.raises(AssertionError, match=r"redelivered and done after the restart \(lost\?\)"):
            await cases.test_a_delivery_in_flight_at_stop_is_redelivered_once(contract)
        assert await contract.effects() == []
        assert await adapter.left_over() == 0  # the broker was told it was done: nothing to redeliver


async def test_dropping_what_cannot_be_keyed_fails_the_unkeyable_case(request: pytest.FixtureRequest,
                                                                      sqlite_url: str) -> None:
    async with DroppingUnkeyableMemory.prepared(request) as adapter, Contract.open(adapter, sqlite_url) as contract:
        contract.patience = PATIENCE
        with pytest.raises(AssertionError, match="the unkeyable delivery is not in the dead-letter store"):
            await cases.test_a_delivery_without_a_stable_id_is_parked_never_dropped(contract)
