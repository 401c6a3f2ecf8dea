"""One adapter per source the contract runs against (see ``tests/contract/base.py``)."""

from __future__ import annotations

from tests.contract.adapters.cloudevents import CloudEventsAdapter
from tests.contract.adapters.memory import MemoryAdapter
from tests.contract.adapters.nats import NatsAdapter
from tests.contract.adapters.rabbitmq import OrderedRabbitMQAdapter, RabbitMQAdapter
from tests.contract.adapters.redis import RedisStreamAdapter
from tests.contract.adapters.schedules import ScheduleAdapter
from tests.contract.adapters.sqs import FifoSqsAdapter, SqsAdapter
from tests.contract.adapters.webhooks import WebhookAdapter
from tests.contract.base import SourceAdapter

ADAPTERS: list[type[SourceAdapter]] = [
    MemoryAdapter, RabbitMQAdapter, OrderedRabbitMQAdapter, SqsAdapter, FifoSqsAdapter, WebhookAdapter,
    CloudEventsAdapter, ScheduleAdapter, NatsAdapter, RedisStreamAdapter,
]
