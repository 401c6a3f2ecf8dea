"""The source contract's seam: what a source's adapter must offer so that the cases in
``test_contract.py`` can drive its transport, and the harness the cases run in.

An adapter (one module per source under ``adapters/``) knows its transport: how a producer sends a
delivery with a stable id and one without, what a redelivery is, how to tell from the outside that a
delivery was acknowledged or dead-lettered, what a producer or the transport does with work that was
not acknowledged, and how the connection is cut. It declares the :class:`Capability` values it claims;
each case runs against exactly the adapters that claim its capability (``conftest.py``), so nothing
is skipped and a source that claims a case must pass it.

The harness (:class:`Contract`) builds apps on one SQLite file of the test's own, registers the
handler the :class:`Script` drives on the adapter's source, and reads the handler's committed effects
from a table of its own.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY
from sqlalchemy import Column, Integer, MetaData, String, Table, select
from sqlalchemy.ext.asyncio import create_async_engine

from consumer_kit import ConsumerApp, Context, RetryableError, Settings, Source, TerminalError
from tests.integration.rabbit import wait_until

REFUSED = "contract_refused"
"""The reason the script's :class:`~consumer_kit.TerminalError` parks a delivery with."""


class Capability(enum.Enum):
    """A case of the contract; an adapter claims those its transport has."""

    NEW_ID = "a: a new stable id is processed once"
    REDELIVERY = "b: a redelivery is acknowledged without running the handler"
    UNKEYABLE = "c: a delivery without a stable id is parked"
    RETRY = "d: a retryable error comes back under the same key"
    TERMINAL = "e: a terminal error parks the delivery"
    STOP = "f: a delivery in flight at stop is redelivered, once"
    CUT = "g: a connection cut while the handler runs loses nothing"
    ORDER = "h: settlements keep the order the transport promises"
    REPLAY = "i: a parked delivery replays under its key"
    TRACE = "j: the transport's trace context is the delivery span's parent"
    METRICS = "k: every outcome is counted"


EVERY_SOURCE = frozenset({Capability.NEW_ID, Capability.REDELIVERY, Capability.RETRY, Capability.TERMINAL,
                          Capability.STOP, Capability.REPLAY, Capability.METRICS})
"""What every source must do, whatever its transport."""


def needs(capability: Capability) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a case as the check of ``capability`` (``conftest.py`` runs it on the adapters claiming it)."""

    def mark(case: Callable[..., Any]) -> Callable[..., Any]:
        case.contract_needs = capability  # type: ignore[attr-defined]
        return case

    return mark


@dataclass
class Sent:
    """One piece of work a producer sent (and, for senders that wait for an answer, sends again).

    ``key_id`` is the stable id the source must key it by (``None``: it has none). ``attempts`` holds,
    for transports where the sender waits for the answer (a call, an HTTP request), the task of each
    send, the newest last; ``detail`` is the adapter's own (a schedule's tick, a raw header)."""

    key_id: str | None
    attempts: list[asyncio.Task[Any]] = field(default_factory=list)
    detail: Any = None

    @property
    def answer(self) -> Any:
        """The newest attempt's answer, or ``None`` while it runs or when it got none (cancelled, failed)."""
        if not self.attempts:
            return None
        last = self.attempts[-1]
        if not last.done() or last.cancelled() or last.exception() is not None:
            return None
        return last.result()

    async def finished(self) -> bool:
        """Whether the newest attempt is over, answered or not."""
        return bool(self.attempts) and self.attempts[-1].done()


class SourceAdapter(abc.ABC):
    """Drives one source's transport for the contract (see the module docstring)."""

    id: ClassVar[str]
    capabilities: ClassVar[frozenset[Capability]]
    marks: ClassVar[tuple[pytest.MarkDecorator, ...]] = ()
    span_kind: ClassVar[SpanKind] = SpanKind.CONSUMER
    database: ClassVar[str] = "sqlite"  # or "postgres": the run's PostgreSQL database (then mark it postgres)
    unkeyable_reason: ClassVar[str] = "missing_stable_id"

    def __init__(self) -> None:
        self.current: Any = None  # the source of the app serving now (a restarted worker has a new one)

    @classmethod
    @contextlib.asynccontextmanager
    async def prepared(cls, request: pytest.FixtureRequest) -> AsyncIterator[Self]:
        """An adapter on a transport of its own (new queues, paths, names), torn down after."""
        yield cls()

    @abc.abstractmethod
    def settings(self, database_url: str, **overrides: object) -> Settings:
        """The app's settings: the database, and what the transport needs."""

    @abc.abstractmethod
    def make_source(self) -> Source:
        """A new source object on this adapter's transport (each app gets its own)."""

    def source(self) -> Source:
        """:meth:`make_source`, remembered as the one deliveries go to now."""
        source = self.current = self.make_source()
        return source

    @contextlib.asynccontextmanager
    async def serving(self, app: ConsumerApp) -> AsyncIterator[None]:
        """Run ``app`` (its source taking deliveries) for the block; leaving it stops the app."""
        async with app.running():
            yield

    @abc.abstractmethod
    async def send(self, stable_id: str, *, traceparent: str | None = None) -> Sent:
        """Send new work whose stable id is ``stable_id`` (with a W3C ``traceparent``, if given);
        returns without waiting for its settlement."""

    async def send_in_order(self, stable_ids: Sequence[str]) -> list[Sent]:
        """Send several, in this order (as one batch where the transport has them)."""
        return [await self.send(stable_id) for stable_id in stable_ids]

    @abc.abstractmethod
    async def send_again(self, sent: Sent) -> Sent:
        """A redelivery: the same work, under the same stable id, the way the transport repeats it."""

    async def send_unkeyed(self) -> Sent:
        """Work that carries no stable id (adapters claiming UNKEYABLE)."""
        raise NotImplementedError(f"{self.id} does not claim {Capability.UNKEYABLE}")

    @abc.abstractmethod
    async def acked(self, sent: Sent) -> bool:
        """Whether the transport shows ``sent`` settled as acknowledged (deleted, answered 200, done)."""

    @abc.abstractmethod
    async def dead_lettered(self, sent: Sent, reason: str) -> bool:
        """Whether the transport shows ``sent`` dead-lettered with ``reason`` (copied to the dead-letter
        queue and gone from its queue, answered as parked, its tick parked): never to come back."""

    async def retry_as_told(self, sent: Sent) -> None:
        """What happens on the transport's side after a ``RETRY_LATER``, once it has come: nothing for a
        broker (it redelivers by itself); a sender that was told to come back sends again; a manual
        clock moves past the retry's delay."""
        return None

    async def resend_unsettled(self, sent: Sent) -> None:
        """What a sender does with work that got no acknowledgement (the worker stopped, the connection
        was cut): send it again. A broker redelivers by itself (nothing to do)."""
        return None

    async def cut(self) -> None:
        """Cut the connection between the transport and the running source, from the other side
        (adapters claiming CUT); returns once the source has lost it."""
        raise NotImplementedError(f"{self.id} does not claim {Capability.CUT}")

    async def restore(self) -> None:
        """Undo :meth:`cut`, where the transport does not come back by itself."""
        return None

    async def left_over(self) -> int:
        """After the app stopped: messages still on the transport (its queue, and what is on its way
        back to it). Work a source did not acknowledge shows here; transports that hold nothing say 0."""
        return 0


class Act(enum.Enum):
    """What the script's handler does on one run."""

    COMMIT = "commit"  # write the effect, return
    RETRY = "retry"  # raise RetryableError
    TERMINAL = "terminal"  # raise TerminalError(reason=REFUSED)
    BLOCK = "block"  # wait for Script.release, then commit (or be cancelled meanwhile)


@dataclass
class Run:
    """One run of the handler."""

    key_id: str
    namespace: str
    act: Act
    returned: bool = False  # the handler returned (its effect is in the transaction)
    cancelled: bool = False


Plan = Callable[[int, int], Act]
"""``(which key, in the order keys were first seen: 1, 2, ...; which run of that key: 1, 2, ...) -> Act``."""

effects_metadata = MetaData()
effects = Table(
    "contract_effects", effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("stable_id", String(300), nullable=False),
)


class Script:
    """The handler every case registers, and what it saw: one :class:`Run` per run, in order."""

    def __init__(self) -> None:
        self.plan: Plan = lambda index, number: Act.COMMIT
        self.runs: list[Run] = []
        self.release = asyncio.Event()
        self._seen: list[str] = []

    def first_run(self, act: Act, *, of_key: int | None = None) -> None:
        """The first run of every key (or of the ``of_key``-th key seen) does ``act``; the rest commit."""
        self.plan = lambda index, number: act if number == 1 and of_key in (None, index) else Act.COMMIT

    async def handle(self, ctx: Context) -> None:
        key = ctx.key
        if key.id not in self._seen:
            self._seen.append(key.id)
        number = 1 + sum(1 for run in self.runs if run.key_id == key.id)
        run = Run(key.id, key.namespace, self.plan(self._seen.index(key.id) + 1, number))
        self.runs.append(run)
        try:
            if run.act is Act.BLOCK:
                await self.release.wait()
            elif run.act is Act.RETRY:
                raise RetryableError("the contract's downstream is busy")
            elif run.act is Act.TERMINAL:
                raise TerminalError("the contract refuses this one", reason=REFUSED)
            await ctx.db.execute(effects.insert().values(stable_id=key.id))
            run.returned = True
        except asyncio.CancelledError:
            run.cancelled = True
            raise

    def runs_of(self, key_id: str | None) -> list[Run]:
        return [run for run in self.runs if run.key_id == key_id]

    def returned(self, key_id: str | None) -> int:
        """Runs of ``key_id`` whose handler returned."""
        return sum(1 for run in self.runs_of(key_id) if run.returned)

    async def started(self, count: int = 1) -> bool:
        return len(self.runs) >= count


class Contract:
    """What a case runs in: the adapter, the script, apps on the test's database, and the effects."""

    def __init__(self, adapter: SourceAdapter, database_url: str, tracer_provider: TracerProvider | None) -> None:
        self.adapter = adapter
        self.database_url = database_url
        self.tracer_provider = tracer_provider
        self.script = Script()
        self.source: Source | None = None
        self.patience = 1.0  # scales every wait (a test that expects a case to fail need not wait long)
        self._engine = create_async_engine(database_url)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, adapter: SourceAdapter, database_url: str,
                   tracer_provider: TracerProvider | None = None) -> AsyncIterator[Contract]:
        contract = cls(adapter, database_url, tracer_provider)
        try:
            async with contract._engine.begin() as conn:
                await conn.run_sync(effects_metadata.create_all)
                await conn.execute(effects.delete())  # a PostgreSQL database is the run's, not the test's
            yield contract
        finally:
            await contract._engine.dispose()

    def app(self, **settings: object) -> ConsumerApp:
        """A new app (a worker) whose handler ``contract`` is the script's, on a new source object of the
        adapter's transport; ``settings`` override the adapter's."""
        app = ConsumerApp(self.adapter.settings(self.database_url, **settings), tracer_provider=self.tracer_provider)
        self.source = self.adapter.source()
        app.handler(self.source, name="contract")(self.script.handle)
        return app

    def serving(self, app: ConsumerApp) -> contextlib.AbstractAsyncContextManager[None]:
        return self.adapter.serving(app)

    async def effects(self) -> list[str]:
        """The stable ids of the committed effects, in the order they committed."""
        async with self._engine.connect() as conn:
            return [row[0] for row in await conn.execute(select(effects.c.stable_id).order_by(effects.c.id))]

    async def effect_count(self, key_id: str | None) -> int:
        return (await self.effects()).count(str(key_id))

    async def wait(self, check: Callable[[], Awaitable[bool]], what: str, seconds: float = 20) -> None:
        await wait_until(check, seconds * self.patience, what)

    async def wait_acked(self, sent: Sent, what: str = "the delivery to be acknowledged", seconds: float = 20) -> None:
        async def acked() -> bool:
            # and none of the source's deliveries still in the pipeline: a transport may count a delivery
            # handed to the consumer as gone (RabbitMQ's ready count) while its transaction is still open
            return await self.adapter.acked(sent) and self.in_flight() == 0

        await self.wait(acked, what, seconds)

    def in_flight(self) -> float:
        """How many deliveries of the serving source the pipeline is processing now."""
        if self.source is None:
            return 0.0
        return REGISTRY.get_sample_value("consumer_kit_in_flight", {"source": self.source.name}) or 0.0

    async def wait_dead_lettered(self, sent: Sent, reason: str, seconds: float = 20) -> None:
        async def dead() -> bool:
            return await self.adapter.dead_lettered(sent, reason)

        await self.wait(dead, f"the transport to show it dead-lettered ({reason})", seconds)
