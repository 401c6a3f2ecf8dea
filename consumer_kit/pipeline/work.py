"""One delivery in flight (:class:`Work`), the handler registration it belongs to, and the part both
paths share: running the handler inside the delivery's transaction."""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy.ext.asyncio import AsyncSession

from consumer_kit.context import Context
from consumer_kit.coordinator.protocol import SessionReceipt, SessionRequest
from consumer_kit.delivery import Delivery, Outcome, Source
from consumer_kit.errors import ConfigurationError
from consumer_kit.keys import KeyDigester, OperationKey, short
from consumer_kit.settings import Settings
from consumer_kit.store import Claim, DeadLetters, Inbox, OutboxWriter
from consumer_kit.store.connections import Database
from consumer_kit.store.executor import Executor
from consumer_kit.store.staged import StagedWrites
from consumer_kit.tracing import current_headers

if TYPE_CHECKING:
    from opentelemetry.trace import Link

    from consumer_kit.pipeline.batch import Batch
    from consumer_kit.tracing.spans import DeliveryTrace, DeliveryTracer

log = logging.getLogger("consumer_kit.pipeline")

Handler = Callable[[Context], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """A handler bound to its source, as ``@app.handler`` registered it."""

    func: Handler
    source: Source
    consumer: str  # the inbox scope; keep it stable across deploys
    single_transaction: bool = False
    max_deliveries: int | None = None
    labels: tuple[str, ...] = ()
    task: Callable[[Delivery], str] | str | None = None
    driver: str = "sqlalchemy"  # or "asyncpg": the handler uses ctx.connection (PostgreSQL on asyncpg)
    batch: Batch | None = None  # gather deliveries into one transaction (single_transaction only)

    @property
    def uses_db(self) -> bool:
        """Whether the handler may write through ``ctx.db`` (it was not registered ``driver="asyncpg"``)."""
        return self.driver != "asyncpg"

    @property
    def wants_session(self) -> bool:
        """Whether deliveries of this handler get a coordinator session."""
        return bool(self.labels or self.task)


@dataclass(slots=True)
class Work:
    """Everything the pipeline knows about one delivery, filled in as it goes."""

    spec: HandlerSpec
    delivery: Delivery
    key: OperationKey
    digests: Sequence[str]  # the key's digest under the current HMAC key, then the previous one
    fingerprint: str
    claim: Claim | None = None
    connection: Executor | None = None  # the one the delivery holds, once it holds one
    request: SessionRequest | None = None
    receipt: SessionReceipt | None = None
    trace: DeliveryTrace | None = None  # the delivery's span, when tracing is on
    _digest: str = field(default="")

    @property
    def digest(self) -> str:
        """The short keyed digest logs and results carry (never the key)."""
        if not self._digest:
            self._digest = short(self.claim.digest if self.claim is not None else self.digests[0])
        return self._digest

    @property
    def attempts(self) -> int:
        """Deliveries of this key so far, as the inbox counted them or the source did."""
        return max(self.claim.attempts if self.claim is not None else 0, self.delivery.attempt)

    def log(self, level: int, message: str) -> None:
        """Log with the key's namespace and digest, never the key itself."""
        if not log.isEnabledFor(level):  # most deliveries log at DEBUG: build nothing for them
            return
        log.log(level, "%s [%s:v%d %s]", message, self.key.namespace, self.key.version, self.digest,
                extra={"namespace": self.key.namespace, "key_digest": self.digest})


PROCESSED = Outcome.PROCESSED.value
"""The stored outcome of a delivery whose handler's effect committed (``Outcome.PROCESSED.value`` is an
enum property lookup, on every delivery)."""

TAKEN = frozenset({Outcome.DUPLICATE, Outcome.IN_PROGRESS, Outcome.CONFLICT})
"""Outcomes of a delivery whose claim found its key taken."""


class DuplicateShare:
    """A running estimate, per handler, of how many of its deliveries find their key taken (done,
    in progress, another request), over about the last fifty: a path reads the key before it claims
    it while that share is above ``threshold``, so that a duplicate costs one plain read, and claims
    straight away otherwise, so that a new key costs no read it does not need. ``always`` reads
    first whatever the share (SQLite: a claim there takes the database's one write lock)."""

    WEIGHT = 0.02

    def __init__(self, threshold: float, *, always: bool = False) -> None:
        self.threshold = threshold
        self.always = always
        self._shares: dict[str, float] = {}

    def read_first(self, consumer: str) -> bool:
        """Whether the next delivery of ``consumer`` should read before it claims."""
        return self.always or self._shares.get(consumer, self.threshold) > self.threshold

    def count(self, consumer: str, *, taken: bool) -> None:
        """Count one delivery of ``consumer``: its key was taken, or not."""
        share = self._shares.get(consumer, self.threshold)
        self._shares[consumer] = share + self.WEIGHT * ((1.0 if taken else 0.0) - share)


@dataclass(frozen=True, slots=True)
class Stores:
    """What both paths work with: the database and its stores, settings, and the handlers' helpers.
    ``on_fatal`` is told of a deployment error no delivery can get past (a missing table)."""

    settings: Settings
    database: Database
    inbox: Inbox
    dead_letters: DeadLetters
    digester: KeyDigester
    http: httpx.AsyncClient | None
    tracer: DeliveryTracer | None = None
    on_fatal: Callable[[ConfigurationError], None] | None = None

    def fatal(self, error: ConfigurationError) -> None:
        """Report ``error`` to whoever runs the pipeline (the app stops), or log it when nobody listens."""
        if self.on_fatal is not None:
            self.on_fatal(error)
        else:
            log.error("%s", error)


NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()
NO_COMMIT: contextlib.nullcontext[Callable[[], None]] = contextlib.nullcontext(lambda: None)


def span(work: Work, name: str) -> contextlib.AbstractContextManager[object]:
    """A child span of the delivery's named ``name``, current inside the block; nothing when tracing is off."""
    return NO_SPAN if work.trace is None else work.trace.child(name)


def commit_span(work: Work) -> contextlib.AbstractContextManager[Callable[[], None]]:
    """The ``commit`` span, to wrap a transaction: the block gets a function that starts the span
    (call it after the handler), which ends when the block is left; nothing when tracing is off."""
    return NO_COMMIT if work.trace is None else work.trace.commit()


@contextlib.asynccontextmanager
async def usable(stores: Stores, ex: Executor | None) -> AsyncIterator[Executor]:
    """``ex`` (the delivery's connection), or, when there is none or it was discarded (lost), one
    aside (:meth:`~consumer_kit.store.connections.Database.aside`): never a second connection of the
    pool the delivery holds one of, which every delivery could be holding while it waited for one."""
    if ex is not None and not ex.discarded:
        yield ex
        return
    async with stores.database.aside(ex) as own:
        yield own


async def run_handler(stores: Stores, ex: Executor, work: Work, links: Sequence[Link] | None = None,
                      staged: StagedWrites | None = None) -> None:
    """Run the handler inside ``ex``'s transaction, then write what it staged (``ctx.stage`` rows, outbox
    rows, ORM objects) in the same transaction. The caller completes the inbox row and commits.
    ``staged``: the batch's staged writes, which the batch writes once all its handlers ran. Traced, it
    runs in a ``handler`` span (``links``: to the batch it runs in), whose context each outbox row carries."""
    spec, claim = work.spec, work.claim
    assert claim is not None
    outbox = OutboxWriter(stores.digester, spec.consumer, work.key, clock=stores.inbox.clock,
                          trace_headers=None if work.trace is None else current_headers)
    writes = StagedWrites() if staged is None else staged
    ctx = Context(key=work.key, delivery=work.delivery, executor=ex, attempt=work.attempts,
                  key_digest=work.digest, outbox=outbox, session=work.receipt, http=stores.http,
                  staged=writes)
    with NO_SPAN if work.trace is None else work.trace.child(
            "handler", attributes={"consumer_kit.attempt": ctx.attempt}, links=links):
        await spec.func(ctx)
        if staged is None:
            if writes:
                await writes.write(ex)
            await ctx.outbox.flush(ex)
        else:  # in a batch: written with the batch's, once all its handlers ran
            staged.outbox(outbox.take())
        session: AsyncSession | None = ex.session_made()
        if session is not None and (session.new or session.dirty or session.deleted):  # ORM objects to write
            await session.flush()


def session_request(spec: HandlerSpec, delivery: Delivery, settings: Settings) -> SessionRequest:
    """The coordinator session a handler's delivery asks for: its labels, its task, the session TTL."""
    task = spec.task(delivery) if callable(spec.task) else spec.task
    return SessionRequest(labels=spec.labels, task=task, ttl_seconds=settings.coordinator_session_ttl_seconds)


def describe(exc: BaseException, key: OperationKey | None) -> str:
    """``Type: message`` of an exception, with the raw key redacted (user code may put it there)."""
    return redact(f"{type(exc).__name__}: {exc}", key)[:500]


def redact(text: str, key: OperationKey | None) -> str:
    """``text`` with the raw key and its id replaced by ``<key>``."""
    if key is None:
        return text
    text = text.replace(str(key), "<key>")
    # A short id (say "42") is no secret and would garble the text; longer ones are redacted too.
    return text.replace(key.id, "<key>") if len(key.id) >= 6 else text


def format_exception(exc: BaseException, key: OperationKey | None) -> str:
    """A traceback with the raw key redacted."""
    return redact("".join(traceback.format_exception(exc)), key)
