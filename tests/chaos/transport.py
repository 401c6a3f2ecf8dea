"""What the chaos run needs of a broker, one small class per transport (RabbitMQ, NATS JetStream, Redis
Streams), so that one runner (tests/chaos/run.py) drives them all.

A :class:`Transport` owns the run's queue or stream (and, for NATS and Redis, a server of the run's own):
it publishes the messages as given (duplicates included, each to reach the consumer), counts what is
left over and what is held unsettled, carries out the broker fault once (RabbitMQ: the worker's
connection cut at a proxy of the run's own; NATS and Redis: the run's server killed with SIGKILL and
started again), and removes everything at the end.
"""

from __future__ import annotations

import abc
from typing import ClassVar


class Transport(abc.ABC):
    """One run's broker side; ``token`` makes its names unique."""

    name: ClassVar[str]
    fault_name: ClassVar[str]  # how the report line names the broker fault
    paths: ClassVar[tuple[str, ...]]  # the worker paths it runs by default

    def __init__(self, token: str) -> None:
        self.token = token

    async def start(self) -> None:
        """Start what the run needs before it publishes (a server of its own, the stream); RabbitMQ's is
        the shared broker, and its queues are declared as it publishes."""
        return None

    @abc.abstractmethod
    def env(self) -> dict[str, str]:
        """The worker's environment for this transport (``CHAOS_TRANSPORT``, the broker URL, names)."""

    @abc.abstractmethod
    async def publish(self, messages: list[str]) -> None:
        """Publish each id of ``messages`` (an id listed twice is a duplicate that must reach the
        consumer twice), in that order as far as the transport allows."""

    @abc.abstractmethod
    async def counts(self) -> tuple[int, int]:
        """(left over: not yet delivered, or dead-lettered on the broker; delivered and not settled)."""

    @abc.abstractmethod
    async def fault(self) -> None:
        """The broker fault, once, while the worker consumes; returns when the broker is back."""

    async def downstream_ids(self) -> set[str]:
        """The bodies the outbox path published downstream (only RabbitMQ runs that path)."""
        raise NotImplementedError(f"the outbox path does not run on {self.name}")

    @abc.abstractmethod
    async def remove(self) -> None:
        """Delete the run's queues or streams (and stop its server); never raises for what is gone."""


def transport_class(name: str) -> type[Transport]:
    """The transport called ``name`` (rabbitmq, nats, redis); imported here so a run loads only its own client."""
    if name == "rabbitmq":
        from tests.chaos.broker_rabbitmq import RabbitTransport
        return RabbitTransport
    if name == "nats":
        from tests.chaos.broker_nats import NatsTransport
        return NatsTransport
    if name == "redis":
        from tests.chaos.broker_redis import RedisTransport
        return RedisTransport
    raise ValueError(f"unknown transport {name!r} (rabbitmq, nats, redis)")


def transport(name: str, token: str) -> Transport:
    return transport_class(name)(token)
