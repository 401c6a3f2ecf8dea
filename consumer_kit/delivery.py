"""What a source hands to the pipeline, and what the pipeline decides about it."""

from __future__ import annotations

import enum
import functools
import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from consumer_kit.errors import MissingStableId
from consumer_kit.keys import OperationKey
from consumer_kit.untrusted import loads_json

if TYPE_CHECKING:
    from consumer_kit.settings import Settings
    from consumer_kit.source_store import SourceStore


class Outcome(enum.StrEnum):
    """What happened to a delivery."""

    PROCESSED = "processed"  # the handler ran and its effect committed
    DUPLICATE = "duplicate"  # already completed: acknowledged without running the handler
    IN_PROGRESS = "in_progress"  # another attempt holds the lease
    CONFLICT = "conflict"  # same key, different request: parked
    INACTIVE = "inactive"  # the coordinator's result for this key is no longer active: parked
    INVALID = "invalid"  # cannot be keyed (no stable id, invalid key): parked
    RETRY = "retry"  # failed in a way that may pass: deliver again later
    DEAD_LETTERED = "dead_lettered"  # terminal failure or retries exhausted: parked
    LEASE_LOST = "lease_lost"  # another attempt took over; this one's writes were rolled back


class Settlement(enum.StrEnum):
    """What the source must do with the delivery: the pipeline decides, the source carries it out."""

    ACK = "ack"
    RETRY_LATER = "retry_later"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery of a piece of work, as a source received it.

    ``id`` is the source's immutable delivery id (AMQP ``message_id``, SQS ``MessageId``, the
    webhook's event id); ``None`` when the source had none, which parks the delivery.
    ``attributes`` are the security-relevant fields besides the body that a redelivery must repeat
    exactly (a CloudEvent's ``type``, an AMQP routing key); per-attempt headers do not belong there.
    """

    id: str | None
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    attributes: Mapping[str, str] = field(default_factory=dict)
    attempt: int = 1
    received_at: datetime = field(default_factory=functools.partial(datetime.now, UTC))
    sent_at: datetime | None = None
    """When the work was sent, by the source's own clock (AMQP ``timestamp``, SQS ``SentTimestamp``,
    a CloudEvent's ``time``, a schedule's intended time); ``None`` when the source does not say. A
    delivery older than the inbox's retention may repeat one whose record was swept."""

    def json(self) -> Any:
        """The body parsed as JSON; a body that is not JSON (or nests deeper than any real one) raises
        :class:`~consumer_kit.untrusted.UnparseableJson`, a ``ValueError`` that parks the delivery."""
        return loads_json(self.body, strict=False)

    def text(self, encoding: str = "utf-8") -> str:
        """The body decoded as text."""
        return self.body.decode(encoding)

    def fingerprint(self) -> str:
        """SHA-256 over the body and the security-relevant attributes: what "the same request" means."""
        digest = hashlib.sha256(len(self.body).to_bytes(8, "big"))
        digest.update(self.body)
        for name in sorted(self.attributes) if self.attributes else ():
            for part in (name, self.attributes[name]):
                raw = part.encode("utf-8")
                digest.update(len(raw).to_bytes(4, "big"))
                digest.update(raw)
        return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Replayed(Delivery):
    """A parked delivery handed over again by a replay (``ctx.delivery`` is one: a handler may tell).

    ``parked_id`` is the parked row it came from; ``parked_fingerprint`` the fingerprint it had when it
    was parked, which it keeps (a CloudEvent's fingerprint, say, is of its canonical form, not of the
    body as stored), so that the replay is the same request to the inbox."""

    parked_id: str = ""
    parked_fingerprint: str = ""

    def fingerprint(self) -> str:
        """The fingerprint it had when parked (computed from the body when that was not kept)."""
        return self.parked_fingerprint or Delivery.fingerprint(self)


@dataclass(frozen=True, slots=True)
class RefusedReplay(Delivery):
    """A message whose replay header did not verify (``why``); the pipeline parks it ``invalid_replay``."""

    why: str = "the replay header does not verify"


@dataclass(frozen=True, slots=True)
class Result:
    """The pipeline's verdict on one delivery."""

    outcome: Outcome
    settlement: Settlement
    reason: str | None = None  # a code such as "conflict" or "retries_exhausted"; never a key
    delay: float | None = None  # for RETRY_LATER: how long the source should wait
    key_digest: str | None = None  # a short keyed digest, for correlating with logs


Dispatch = Callable[[Delivery], Awaitable[Result]]
"""What a source calls for each delivery; it settles as the returned :class:`Result` says."""

Decided = Callable[["Result | None"], None]
"""Told a delivery's :class:`Result` once it is known; ``None``: nothing was decided (the delivery was
cancelled, say by a shutdown), so the source leaves it unsettled and its broker delivers it again."""


@runtime_checkable
class DispatchSoon(Protocol):
    """A :data:`Dispatch` that can also take a delivery without the caller waiting for it.

    ``soon(delivery, then)`` hands the delivery over and returns True when its path needs no coroutine
    of its own (a batched handler's delivery waits for its batch, which runs in a task of its own):
    ``then`` is called with its result, from the batch's task. It returns False, having done nothing,
    when the delivery must be dispatched the usual way. A source that receives many deliveries from a
    broker saves a task, a future and a chain of coroutines a delivery by asking first."""

    def __call__(self, delivery: Delivery) -> Awaitable[Result]: ...

    def soon(self, delivery: Delivery, then: Decided) -> bool: ...

KeyMapper = Callable[[Delivery], "str | None"]
"""Picks the stable id out of a delivery (``None`` when there is none); never a hash of the payload."""


@runtime_checkable
class Source(Protocol):
    """The seam between a transport and the pipeline.

    A source turns what its transport received into :class:`Delivery` values, hands each to
    ``dispatch``, and carries out the returned settlement (ack, delayed retry, dead letter).
    """

    name: str
    namespace: str
    version: int

    def key(self, delivery: Delivery) -> OperationKey:
        """The operation key of a delivery; raises MissingStableId or InvalidKey."""
        ...

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        """Begin intake, handing every delivery to ``dispatch``; ``settings`` are the app's (a source
        reads its connection URLs and limits there, never from the environment on its own)."""
        ...

    async def stop(self) -> None:
        """Stop intake; deliveries already dispatched go on."""
        ...

    async def close(self) -> None:
        """Release connections, after in-flight deliveries have settled."""
        ...


@runtime_checkable
class ReportsReadiness(Protocol):
    """A source that can say it is not taking deliveries although it was started (a broker connection
    being re-established, say); ``/readyz`` answers 503 while any source says so."""

    def unready_reason(self) -> str | None:
        """``None`` while the source takes deliveries, else a short reason (``broker_disconnected``)."""
        ...


@runtime_checkable
class StoreSource(Protocol):
    """A source that keeps state of its own in the store (a schedule: how far its ticks are decided).

    When the app starts, before any source starts, it calls :meth:`use_store` on each such source of
    its handlers with ready objects (:class:`~consumer_kit.source_store.SourceStore`: the consumer, the
    inbox scope of the source's handler; the schedules' store; the app's inbox; the app's settings). A
    source never builds a store object or opens a database of its own.
    """

    def use_store(self, store: SourceStore) -> None:
        """Take the store objects the app hands over."""
        ...


class KeyedSource:
    """The key mapping every source shares: ``namespace:v<version>:<stable id>``.

    ``key_mapper`` picks the stable id; the default takes :attr:`Delivery.id`. A missing id raises
    :class:`MissingStableId`, an unusable one :class:`InvalidKey`: both park the delivery.
    """

    def __init__(self, *, namespace: str, version: int, key_mapper: KeyMapper | None = None) -> None:
        self.namespace = namespace
        self.version = version
        self.key_mapper = key_mapper
        OperationKey(namespace, version, "probe")  # fail at construction on a bad namespace or version

    def key(self, delivery: Delivery) -> OperationKey:
        """See the class docstring."""
        stable_id = self.key_mapper(delivery) if self.key_mapper is not None else delivery.id
        if stable_id is None:
            raise MissingStableId()
        return OperationKey(self.namespace, self.version, stable_id)


class CallIntake:
    """``start``/``stop``/``close`` for a source whose deliveries arrive by call (an HTTP request, a
    test's ``deliver``) rather than from a broker connection: it holds ``dispatch`` while running.
    ``_dispatch`` is ``None`` when stopped; the source answers "unavailable" then."""

    _dispatch: Dispatch | None = None

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        """Accept deliveries."""
        self._dispatch = dispatch

    async def stop(self) -> None:
        """Refuse further deliveries; those already dispatched go on."""
        self._dispatch = None

    async def close(self) -> None:
        """Nothing to release."""
