"""ConsumerApp: the handler registry and the lifecycle (start, drain, stop) of a worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import httpx
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from consumer_kit import metrics, tracing
from consumer_kit.coordinator.default import default_coordinator
from consumer_kit.coordinator.protocol import Coordinator, CoordinatorLifecycle, SessionRequest
from consumer_kit.delivery import Decided, Delivery, ReportsReadiness, Result, Source, StoreSource
from consumer_kit.errors import ConfigurationError, InvalidKey
from consumer_kit.keys import OperationKey
from consumer_kit.outbox import OutboxRelay, Publisher
from consumer_kit.pipeline import Batch, Handler, HandlerSpec, Pipeline
from consumer_kit.settings import Settings
from consumer_kit.source_store import ScheduleStore, SourceStore
from consumer_kit.store import DeadLetters, Inbox, Outbox, create_engine, ensure_schema, partitions, schema_revisions
from consumer_kit.store.connections import Database
from consumer_kit.store.database import AppMigrations
from consumer_kit.store.inbox import Clock, utcnow
from consumer_kit.store.pace import Pace

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = logging.getLogger("consumer_kit.app")

# After the grace period, cancelled deliveries get this long to roll back and give their leases back.
SETTLE_AFTER_CANCEL_SECONDS = 5.0
# A readiness probe that waits longer than this for the database calls it unreachable (probes time out).
READINESS_DATABASE_SECONDS = 5.0

H = TypeVar("H", bound=Handler)


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the app takes work now (what ``/readyz`` answers) and, if not, why: ``not_started``
    (starting, or stopping), ``database_unreachable``, ``schema_out_of_date``, or ``source_not_ready``
    with the source's name and its own reason."""

    ready: bool
    reason: str | None = None
    source: str | None = None
    detail: str | None = None


def check_source(source: object) -> None:
    """Refuse, with a message that says what is missing, an object that cannot be a source: the
    pipeline keys every delivery with its ``namespace`` and ``version`` and labels metrics with its
    ``name``, and the app starts, stops and closes it."""
    problems = []
    name = getattr(source, "name", None)
    if not isinstance(name, str) or not name:
        problems.append("a non-empty str 'name'")
    namespace, version = getattr(source, "namespace", None), getattr(source, "version", None)
    if not isinstance(namespace, str) or not isinstance(version, int) or isinstance(version, bool):
        problems.append("a str 'namespace' and an int 'version'")
    else:
        try:
            OperationKey(namespace, version, "probe")
        except InvalidKey as exc:
            problems.append(f"a valid namespace and version ({exc})")
    missing = [m for m in ("key", "start", "stop", "close") if not callable(getattr(source, m, None))]
    if missing:
        problems.append(f"the methods {', '.join(missing)}")
    if problems:
        raise ConfigurationError(f"{type(source).__name__} is not a source: it needs {'; '.join(problems)} "
                                 "(see consumer_kit.Source)")


class ConsumerApp:
    """A worker: sources, the handler of each, and the shared store.

    ``async with app.running():`` starts every source; leaving the block stops intake, waits for
    in-flight deliveries up to ``SHUTDOWN_GRACE_SECONDS``, gives back the leases of those that did not
    finish, and closes the sources and the database.
    """

    def __init__(self, settings: Settings | None = None, *, clock: Clock = utcnow,
                 coordinator: Coordinator | None = None, tracer_provider: Any = None) -> None:
        self.settings = settings or Settings()
        self.clock = clock
        # OpenTelemetry's: None = the global one, as it is when the app starts (consumer_kit.tracing).
        self.tracer_provider = tracer_provider
        # None: an HttpCoordinator when COORDINATOR_URL is set, else the embedded one on our database.
        self._given_coordinator = coordinator
        self._coordinator: Coordinator | None = None
        self.specs: list[HandlerSpec] = []
        self._engine: AsyncEngine | None = None
        self._database: Database | None = None
        self._pipeline: Pipeline | None = None
        self._http: httpx.AsyncClient | None = None
        self._in_flight: set[asyncio.Task[Any]] = set()  # the tasks inside a dispatch now
        self._drained: asyncio.Event | None = None  # set whenever _in_flight is empty (made in start())
        self._sweeper: asyncio.Task[None] | None = None
        self._started: list[Source] = []
        self._serving = False  # every source started, and stop() not called yet
        self._publisher: Publisher | None = None
        self._relay: asyncio.Task[None] | None = None
        self._relay_stop = asyncio.Event()
        self._failure: ConfigurationError | None = None
        self._stop_on_failure: list[asyncio.Event] = []

    def handler(
        self,
        source: Source,
        *,
        name: str | None = None,
        single_transaction: bool = False,
        max_deliveries: int | None = None,
        labels: list[str] | tuple[str, ...] = (),
        task: Callable[[Delivery], str] | str | None = None,
        driver: Literal["sqlalchemy", "asyncpg"] = "sqlalchemy",
        batch: Batch | None = None,
        staged: bool = False,
    ) -> Callable[[H], H]:
        """Register the handler of ``source``.

        ``name`` scopes the inbox (default: the function's name); keep it stable across deploys, since
        a new name forgets which deliveries were done. ``single_transaction=True`` claims, runs and
        completes in one commit: faster, and only for handlers whose every effect is in ``ctx.db``.
        ``driver="asyncpg"`` (PostgreSQL) gives the handler ``ctx.connection``, the asyncpg connection
        inside the delivery's transaction, instead of ``ctx.db``: the same guarantee at asyncpg's speed.
        ``batch=Batch(max_size=64, max_wait_ms=5)`` (with ``single_transaction=True``) gathers deliveries
        that arrive together and runs them in one transaction (see :mod:`consumer_kit.pipeline.batch`).
        ``staged=True`` (single-transaction; a handler that only stages its writes, ``ctx.stage``): the
        handler runs with nothing held, then its one staged statement and the key's row go in a single
        statement on PostgreSQL with ``driver="asyncpg"`` (see :mod:`consumer_kit.pipeline.single`).
        ``labels`` and ``task`` describe the coordinator session: a handler with either gets one
        (``ctx.session``), created under ``ctx.key.derive("session")``; one with neither runs without.
        """
        check_source(source)
        if any(spec.source is source for spec in self.specs):
            raise ConfigurationError(f"source {source.name!r} already has a handler; one settles each delivery")
        single_transaction = _checked_options(single_transaction, driver, batch, staged, labels, task)

        def register(func: H) -> H:
            self.specs.append(HandlerSpec(
                func=func, source=source, consumer=name or func.__name__,
                single_transaction=single_transaction, max_deliveries=max_deliveries,
                labels=tuple(labels), task=task, driver=driver, batch=batch, staged=staged,
            ))
            return func

        return register

    def relay_outbox(self, publisher: Publisher) -> None:
        """Run an outbox relay with ``publisher`` while the app runs (``consumer-kit run`` included);
        ``consumer-kit outbox relay`` uses it too when given this app."""
        self._publisher = publisher

    @property
    def publisher(self) -> Publisher | None:
        """The outbox publisher registered with :meth:`relay_outbox`."""
        return self._publisher

    @property
    def outbox(self) -> Outbox:
        """The outbox store (available once started)."""
        return Outbox(self.database, clock=self.clock, trace_headers=tracing.current_headers)

    @property
    def database(self) -> Database:
        """The store's database: the engine and the executor chosen for its driver (once started)."""
        if self._database is None:
            raise RuntimeError("the app is not started")
        return self._database

    @property
    def engine(self) -> AsyncEngine:
        """The database engine (available once started)."""
        if self._engine is None:
            raise RuntimeError("the app is not started")
        return self._engine

    @property
    def pipeline(self) -> Pipeline:
        """The per-delivery algorithm (available once started)."""
        if self._pipeline is None:
            raise RuntimeError("the app is not started")
        return self._pipeline

    @property
    def http(self) -> httpx.AsyncClient | None:
        """The HTTP client handlers call out with (``ctx.http``); ``None`` until the app starts."""
        return self._http

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator the pipeline creates sessions with (available once started)."""
        if self._coordinator is None:
            raise RuntimeError("the app is not started")
        return self._coordinator

    @property
    def inbox(self) -> Inbox:
        """The inbox store."""
        return self.pipeline.inbox

    @property
    def dead_letters(self) -> DeadLetters:
        """Parked deliveries."""
        return self.pipeline.dead_letters

    async def start(self, *, sources: Collection[Source] | None = None) -> None:
        """Open the database (migrating SQLite, checking PostgreSQL), then start every source, or only
        those in ``sources`` (``consumer-kit schedule run`` starts none: it fires one tick by hand).
        Sources that keep state in the store (:class:`~consumer_kit.delivery.StoreSource`) are handed
        the database first, started or not."""
        if self._pipeline is not None:
            raise RuntimeError("the app is already started")
        settings = self.settings
        digester = settings.digester()  # fails fast on a missing production HMAC key
        database = await self._open_database()
        # Asked once: with no tracer provider configured, no delivery pays for tracing.
        tracer = tracing.start(self.tracer_provider)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(20.0), event_hooks={
            "request": [tracing.inject_request] if tracer is not None else []})
        self._coordinator = self._given_coordinator or default_coordinator(settings, database, clock=self.clock)
        if isinstance(self._coordinator, CoordinatorLifecycle) and any(s.wants_session for s in self.specs):
            await self._coordinator.open()
        self._pipeline = Pipeline(
            settings=settings,
            database=database,
            inbox=Inbox(database, lease_seconds=settings.inbox_lease_seconds,
                        retention_seconds=settings.inbox_retention_seconds, clock=self.clock,
                        tombstone_seconds=settings.inbox_tombstone_seconds
                        if settings.late_delivery_policy == "park" else 0,
                        partitioned=settings.inbox_partition_seconds > 0),
            dead_letters=DeadLetters(database, clock=self.clock),
            digester=digester,
            http=self._http,
            coordinator=self._coordinator,
            tracer=tracer,
            on_fatal=self._fail,
        )
        metrics.declare(spec.source for spec in self.specs)  # every series it can name, at 0 (see metrics)
        self._drained = asyncio.Event()
        self._drained.set()
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="consumer-kit-sweeper")
        if self._publisher is not None:
            self._relay_stop = asyncio.Event()
            relay = OutboxRelay(self.outbox, self._publisher, settings, tracer_provider=self.tracer_provider)
            self._relay = asyncio.create_task(relay.run(self._relay_stop), name="consumer-kit-relay")
        for spec in self.specs:
            if isinstance(spec.source, StoreSource):
                spec.source.use_store(SourceStore(consumer=spec.consumer, schedules=ScheduleStore(database),
                                                  inbox=self.inbox, settings=settings))
        try:
            for spec in self.specs:
                if sources is None or any(spec.source is chosen for chosen in sources):
                    await spec.source.start(self._dispatcher(spec), settings)
                    self._started.append(spec.source)
        except BaseException:
            await self.stop(grace=0)
            raise
        self._serving = True
        log.info("consumer-kit started: %d source(s) on %s", len(self.specs), database.dialect)

    async def _open_database(self) -> Database:
        """The engine and the store's database on it, the schema checked (SQLite: migrated)."""
        settings = self.settings
        engine = create_engine(settings.database_url, pool_size=settings.db_pool_size,
                               pooler=settings.database_pooler)
        try:
            await ensure_schema(engine, app=AppMigrations.from_settings(settings))
        except BaseException:
            await engine.dispose()
            raise
        database = Database(engine)
        try:
            if any(spec.driver == "asyncpg" for spec in self.specs) and not database.asyncpg:
                raise ConfigurationError("driver='asyncpg' handlers need PostgreSQL on the asyncpg driver; "
                                         f"DATABASE_URL is {engine.dialect.name}+{engine.dialect.driver}")
            await partitions.check_layout(database, settings.inbox_partition_seconds)
        except BaseException:
            await database.close()
            await engine.dispose()
            raise
        self._engine, self._database = engine, database
        return database

    @property
    def failure(self) -> ConfigurationError | None:
        """The deployment error that stopped deliveries (a missing table), if one did; ``consumer-kit
        run`` stops the app and exits with it."""
        return self._failure

    def stop_on_failure(self, stop: asyncio.Event) -> None:
        """Set ``stop`` when a deployment error comes up (at once if one did already)."""
        self._stop_on_failure.append(stop)
        if self._failure is not None:
            stop.set()

    def _fail(self, error: ConfigurationError) -> None:
        if self._failure is not None:
            return  # reported once; the deliveries that meet it meanwhile go back to their sources
        self._failure = error
        log.error("%s; deliveries go back to their sources until it is fixed%s", error,
                  ", and the worker stops" if self._stop_on_failure else "")
        for stop in self._stop_on_failure:
            stop.set()

    def _dispatcher(self, spec: HandlerSpec) -> _Dispatch:
        assert self._drained is not None
        return _Dispatch(spec, self.pipeline, self._in_flight, self._drained)

    async def stop(self, grace: float | None = None) -> None:
        """Stop intake, drain in-flight deliveries for ``grace`` seconds, release the rest, close."""
        grace = self.settings.shutdown_grace_seconds if grace is None else grace
        self._serving = False
        for source in self._started:
            with contextlib.suppress(Exception):
                await source.stop()
        if self._in_flight and self._drained is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), grace)
            pending = self._in_flight - {asyncio.current_task()}
            if pending:
                log.warning("shutdown grace over: abandoning %d in-flight deliveries", len(pending))
                for task in pending:
                    task.cancel()  # the pipeline releases each lease on cancellation
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drained.wait(), SETTLE_AFTER_CANCEL_SECONDS)
        if self._pipeline is not None:  # the batches gathered and under way (their deliveries are no tasks)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pipeline.close(), max(grace, SETTLE_AFTER_CANCEL_SECONDS))
        for source in reversed(self._started):
            try:
                await source.close()
            except Exception as exc:
                log.warning("closing source %s failed: %s", source.name, type(exc).__name__)
        self._started.clear()
        if self._relay is not None:
            self._relay_stop.set()
            await asyncio.gather(self._relay, return_exceptions=True)
            self._relay = None
        if self._publisher is not None:
            with contextlib.suppress(Exception):
                await self._publisher.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if isinstance(self._coordinator, CoordinatorLifecycle) and self._given_coordinator is None:
            await self._coordinator.close()
        self._coordinator = None
        if self._database is not None:
            await self._database.close()
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = self._database = None
        self._pipeline = None

    @contextlib.asynccontextmanager
    async def running(self, *, sources: Collection[Source] | None = None) -> AsyncIterator[ConsumerApp]:
        """Start on entry (every source, or those in ``sources``); stop gracefully on exit."""
        await self.start(sources=sources)
        try:
            yield self
        finally:
            await self.stop()

    async def readiness(self) -> Readiness:
        """Whether the app takes work now: started (every source, and not stopping), the database
        answering within a few seconds with its schema at head, and no source saying it is not ready
        (a RabbitMQ source whose connection is being re-established)."""
        if not self._serving or self._engine is None:
            return Readiness(False, "not_started")
        try:
            async with asyncio.timeout(READINESS_DATABASE_SECONDS):
                current, head = await schema_revisions(self._engine)
        except Exception as exc:
            return Readiness(False, "database_unreachable", detail=type(exc).__name__)
        if current != head:
            return Readiness(False, "schema_out_of_date", detail=f"at {current or 'none'}, needs {head}")
        for source in self._started:
            if isinstance(source, ReportsReadiness):
                reason = source.unready_reason()
                if reason is not None:
                    return Readiness(False, "source_not_ready", source=source.name, detail=reason)
        return Readiness(True)

    async def sweep(self) -> int:
        """Delete expired inbox rows now, in batches; returns how many went."""
        settings = self.settings
        swept = await self.inbox.sweep(batch_size=settings.sweep_batch_size,
                                       pace=Pace(settings.sweep_share, settings.sweep_interval_seconds / 2))
        metrics.SWEPT.labels("inbox").inc(swept)
        if isinstance(self._coordinator, CoordinatorLifecycle):
            swept += await self._coordinator.sweep()
        return swept

    async def _sweep_forever(self) -> None:
        """A sweep every SWEEP_INTERVAL_SECONDS, from one's start to the next (a paced sweep takes a while)."""
        loop, interval = asyncio.get_running_loop(), self.settings.sweep_interval_seconds
        due = loop.time() + interval
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            due = loop.time() + interval
            try:
                await self.sweep()
            except Exception as exc:
                metrics.SWEEP_FAILURES.labels("inbox").inc()
                log.error("inbox sweep failed: %s", type(exc).__name__)

    def asgi(self) -> Starlette:
        """An ASGI app (Starlette) serving the HTTP sources, ``/healthz``, ``/readyz`` and ``/metrics``;
        its lifespan runs this app. See :mod:`consumer_kit.http.asgi`."""
        from consumer_kit.http.asgi import build  # Starlette is an optional dependency

        return build(self)

    async def serve(self) -> None:
        """Run until SIGTERM or SIGINT, then shut down gracefully (what ``consumer-kit run`` does); a
        signal during the start-up cancels it and closes what it had opened."""
        from consumer_kit.signals import run_app, stop_event

        await run_app(self, stop_event())


class _Dispatch:
    """What the app gives each source for its handler's deliveries (a
    :class:`~consumer_kit.delivery.DispatchSoon`).

    Awaited, a delivery is processed in the caller's task (the source's per-message task, the request's
    task). A task of its own, shielded from the caller, would cost every delivery two more trips
    through the event loop (measured: a third of the pipeline's own CPU); and a delivery cancelled
    halfway is safe: its transaction rolls back, its lease is released and the source redelivers it.
    stop() cancels what outlasts the grace period the same way. ``soon`` hands a batched handler's
    delivery to its batch with no task at all; stop() waits for the batches."""

    __slots__ = ("_drained", "_in_flight", "_pipeline", "spec")

    def __init__(self, spec: HandlerSpec, pipeline: Pipeline, in_flight: set[asyncio.Task[Any]],
                 drained: asyncio.Event) -> None:
        self.spec, self._pipeline, self._in_flight, self._drained = spec, pipeline, in_flight, drained

    async def __call__(self, delivery: Delivery) -> Result:
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        self._drained.clear()
        try:
            return await self._pipeline.process(self.spec, delivery)
        finally:
            self._in_flight.discard(task)
            if not self._in_flight:
                self._drained.set()

    def soon(self, delivery: Delivery, then: Decided) -> bool:
        return self._pipeline.soon(self.spec, delivery, then)


def _checked_options(single_transaction: bool, driver: str, batch: Batch | None, staged: bool,
                     labels: list[str] | tuple[str, ...], task: Callable[[Delivery], str] | str | None) -> bool:
    """:meth:`ConsumerApp.handler`'s options checked together (:class:`ConfigurationError` for a
    combination that cannot work); whether the handler is single-transaction (``staged`` is)."""
    if staged and batch is not None:
        raise ConfigurationError("staged=True and batch= are two ways to write a handler's rows together; "
                                 "a batch stages them already (ctx.stage): pick one")
    if batch is not None and not single_transaction:
        raise ConfigurationError("batch= needs single_transaction=True: a batch's deliveries commit in one "
                                 "transaction, which only handlers whose every effect is in the database share")
    if driver not in ("sqlalchemy", "asyncpg"):
        raise ConfigurationError(f"driver must be 'sqlalchemy' or 'asyncpg', not {driver!r}")
    single_transaction = single_transaction or staged
    if single_transaction and (labels or task):
        # The session would be created inside the claiming transaction, which on SQLite holds the
        # write lock the embedded coordinator needs: keep coordinator work on the two-transaction path.
        raise ConfigurationError("single_transaction handlers cannot have a coordinator session "
                                 "(labels/task); use the default two-transaction path")
    if labels or isinstance(task, str):
        try:  # the fixed part of the session request, checked now rather than at every delivery
            SessionRequest(labels=tuple(labels), task=task if isinstance(task, str) else None)
        except ValidationError as exc:
            raise ConfigurationError(f"labels/task do not make a valid session request: "
                                     f"{exc.errors(include_input=False)}") from None
    return single_transaction
