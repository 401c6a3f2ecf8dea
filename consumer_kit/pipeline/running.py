"""What every path works with, and the part they share: running the handler inside the delivery's
transaction (:class:`HandlerRunner`), on the connection the delivery holds (:func:`usable`), in the
spans of its trace when tracing is on (:func:`span`, :func:`commit_span`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import httpx

from consumer_kit.context import Context
from consumer_kit.keys import KeyDigester
from consumer_kit.pipeline.work import Work
from consumer_kit.store import Clock, Database, DeadLetters, Executor, Inbox, OutboxWriter, StagedWrites
from consumer_kit.store.unopened import Unopened
from consumer_kit.tracing import current_headers

if TYPE_CHECKING:
    from opentelemetry.trace import Link
    from sqlalchemy.ext.asyncio import AsyncSession


@dataclass(frozen=True, slots=True)
class Stores:
    """The store side of every path: the database, and the inbox and dead letters on it."""

    database: Database
    inbox: Inbox
    dead_letters: DeadLetters


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
async def usable(database: Database, ex: Executor | None) -> AsyncIterator[Executor]:
    """``ex`` (the delivery's connection), or, when there is none or it was discarded (lost), one
    aside (:meth:`~consumer_kit.store.Database.aside`): never a second connection of the pool the
    delivery holds one of, which every delivery could be holding while it waited for one."""
    if ex is not None and not ex.discarded:
        yield ex
        return
    async with database.aside(ex) as own:
        yield own


class HandlerRunner:
    """Runs a delivery's handler with its :class:`~consumer_kit.Context`: the outbox keyed by
    ``digester``, timed by ``clock``, and ``http``, the client handlers call out with."""

    __slots__ = ("clock", "digester", "http")

    def __init__(self, digester: KeyDigester, clock: Clock, http: httpx.AsyncClient | None) -> None:
        self.digester = digester
        self.clock = clock
        self.http = http

    async def run(self, ex: Executor, work: Work, links: Sequence[Link] | None = None,
                  staged: StagedWrites | None = None) -> None:
        """Run the handler inside ``ex``'s transaction, then write what it staged (``ctx.stage`` rows,
        outbox rows, ORM objects) in the same transaction. The caller completes the inbox row and
        commits. ``staged``: the batch's staged writes, which the batch writes once all its handlers
        ran. Traced, it runs in a ``handler`` span (``links``: to the batch it runs in), whose context
        each outbox row carries."""
        spec, claim = work.spec, work.claim
        assert claim is not None
        outbox = OutboxWriter(self.digester, spec.consumer, work.key, clock=self.clock,
                              trace_headers=None if work.trace is None else current_headers)
        writes = StagedWrites() if staged is None else staged
        ctx = Context(key=work.key, delivery=work.delivery, executor=ex, attempt=work.attempts,
                      key_digest=work.digest, outbox=outbox, session=work.receipt, http=self.http,
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

    async def stage(self, work: Work) -> StagedWrites:
        """Run a ``staged=True`` handler with nothing held (no claim, no connection): what it staged,
        its outbox rows among them. ``ctx.connection`` and ``ctx.db`` raise there (the delivery is
        parked ``handler_misconfigured``)."""
        spec = work.spec
        outbox = OutboxWriter(self.digester, spec.consumer, work.key, clock=self.clock,
                              trace_headers=None if work.trace is None else current_headers)
        writes = StagedWrites()
        ctx = Context(key=work.key, delivery=work.delivery, executor=cast(Executor, Unopened(spec.uses_db, _MISTAKE)),
                      attempt=work.attempts, key_digest=work.digest, outbox=outbox, session=None, http=self.http,
                      staged=writes)
        with NO_SPAN if work.trace is None else work.trace.child(
                "handler", attributes={"consumer_kit.attempt": ctx.attempt}):
            await spec.func(ctx)
        writes.outbox(outbox.take())
        return writes


_MISTAKE = ("this handler is registered staged=True: it stages its writes (ctx.stage, ctx.outbox), which are "
            "written with its key once it returns; it has no ctx.connection or ctx.db")
