"""One adapter per source the contract runs against (see ``tests/contract/base.py``)."""

from __future__ import annotations

from tests.contract.adapters.cloudevents import CloudEventsAdapter
from tests.contract.adapters.memory import MemoryAdapter
from tests.contract.adapters.rabbitmq import OrderedRabbitMQAdapter, RabbitMQAdapter
from tests.contract.adapters.webhooks import WebhookAdapter
from tests.contract.base import SourceAdapter

ADAPTERS: list[type[SourceAdapter]] = [
    MemoryAdapter, RabbitMQAdapter, OrderedRabbitMQAdapter, WebhookAdapter, CloudEventsAdapter,
]
