"""The capability matrix, pinned: which source runs which case of the contract. An adapter that stops
claiming a case, or a source that loses its adapter, fails here rather than running fewer cases in
silence. Letters are the cases of ``test_contract.py`` (see :class:`~tests.contract.base.Capability`)."""

from __future__ import annotations

from tests.contract.adapters import ADAPTERS
from tests.contract.base import EVERY_SOURCE, Capability

MATRIX = {
    "memory": "a b c d e f i j k",
    "rabbitmq": "a b c d e f g i j k",
    "rabbitmq-ordered": "h",  # one consumer, prefetch 1, retries requeued: the order case only
    "sqs": "a b c d e f g i j k",
    "sqs-fifo": "h",  # one FIFO message group: the order case only
    "webhooks": "a b c d e f g i j k",
    "cloudevents": "a b c d e f g i j k",
    "schedules": "a b d e f i k",  # every tick has a stable id; no connection, no trace context
    "nats": "a b c d e f g i j k",  # a retry is a nak with a delay: later messages overtake it, no order case
    "redis": "a b c d e f g i j k",  # a retry stays pending and is claimed again later: no order case
}


def letters(capabilities: frozenset[Capability]) -> str:
    return " ".join(sorted(capability.value[0] for capability in capabilities))


def test_each_source_runs_the_cases_of_its_transport() -> None:
    assert {adapter.id: letters(adapter.capabilities) for adapter in ADAPTERS} == MATRIX
    sources = [adapter for adapter in ADAPTERS if MATRIX[adapter.id] != "h"]
    assert len(sources) == 8
    assert all(EVERY_SOURCE <= adapter.capabilities for adapter in sources), "a source skips what every source must do"
