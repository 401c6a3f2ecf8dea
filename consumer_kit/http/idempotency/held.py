"""A request to an idempotent endpoint that holds its key while its route runs (:class:`Operation`):
the connection it claimed on, the transaction the route writes in, and the route's
:class:`IdempotentContext`; its end, stored or given back. :mod:`.operation` makes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from consumer_kit.context import Context
from consumer_kit.delivery import Delivery
from consumer_kit.http.idempotency.keys import Sent
from consumer_kit.http.idempotency.replies import Reply, RequestFacts, refusal
from consumer_kit.keys import OperationKey, short
from consumer_kit.store import Claim, Executor, OutboxWriter, StagedWrites

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from consumer_kit.http.idempotency.operation import KeyRules

log = logging.getLogger("consumer_kit.http.idempotency")


class IdempotentContext(Context):
    """What the route gets: a :class:`~consumer_kit.Context` (``ctx.key``, ``ctx.db`` and
    ``ctx.connection`` inside the transaction that also stores the response, ``ctx.outbox``,
    ``ctx.derive``) and ``caller``, the scope the key was taken in. ``ctx.key`` is the operation's key:
    for a scoped endpoint its id is a keyed digest of the caller and the client's key, so that the keys
    derived from it (``ctx.derive("carrier")``) differ between two callers who sent the same key."""

    __slots__ = ("_made", "_made_outbox", "_operation", "_received_at", "_request", "caller")

    def __init__(self, request: RequestFacts, received_at: datetime, operation: Operation, **context: Any) -> None:
        self._made: Delivery | None = None
        self._made_outbox: OutboxWriter | None = None
        self._operation = operation
        super().__init__(delivery=cast(Delivery, None), outbox=cast(OutboxWriter, None), **context)
        self._request = request
        self._received_at = received_at
        self.caller = request.caller

    @property  # Context's slot, made when first used (most routes publish nothing)
    def outbox(self) -> OutboxWriter:
        """Stages messages in the transaction that stores the response (see :class:`~consumer_kit.Context`)."""
        if self._made_outbox is None:
            operation = self._operation
            app = operation.keys.app
            self._made_outbox = OutboxWriter(app.pipeline.digester, operation.keys.consumer, operation.key,
                                             clock=app.clock)
        return self._made_outbox

    @outbox.setter
    def outbox(self, made: OutboxWriter | None) -> None:
        self._made_outbox = made

    def outbox_rows(self) -> list[dict[str, Any]]:
        """The messages the route published (taken: none are left staged)."""
        return [] if self._made_outbox is None else self._made_outbox.take()

    @property
    def delivery(self) -> Delivery:
        """The request as a :class:`~consumer_kit.Delivery`: its body, its headers (without the
        credentials and the key) and its method and path as attributes; made when first asked for,
        since most routes read the request through their framework instead."""
        if self._made is None:
            request = self._request
            headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in request.headers
                       if n.lower() not in _UNSHOWN}
            self._made = Delivery(id=None, body=request.body, headers=headers, attempt=self.attempt,
                                  attributes={"method": request.method, "path": request.path},
                                  received_at=self._received_at)
        return self._made

    @delivery.setter
    def delivery(self, made: Delivery | None) -> None:
        self._made = made


_UNSHOWN = (b"authorization", b"cookie", b"proxy-authorization", b"idempotency-key")
"""Request headers a route's ``ctx.delivery`` does not show: credentials and the client's key."""


_GIVEN_BACK_STATUS = {"timed_out": 503, "lease_lost": 409, "invalid_request": 422}
"""The answer to a request whose key was given back, by outcome (others: 500), for its span."""


class _Abandoned(Exception):
    """Handed to the transaction's exit to roll it back when the route failed without an exception of
    its own (a 5xx it returned, a response too big to keep)."""


class _Nothing:
    """The connection and transaction of an operation that holds none (a staged route's, until it writes):
    closing it is nothing to do. (An empty ``AsyncExitStack`` a request, made and closed, cost more than
    the rest of a staged request's bookkeeping.)"""

    __slots__ = ()

    async def aclose(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        return None


NOTHING_HELD: Any = _Nothing()
"""What a :class:`StagedOperation` holds while its route runs (see :class:`_Nothing`)."""


async def end_unwritten(transaction: contextlib.AsyncExitStack, connection: contextlib.AsyncExitStack) -> None:
    """End a transaction that wrote nothing (a key found taken) and give its connection back."""
    try:
        await transaction.__aexit__(_Abandoned, _Abandoned(), None)
    finally:
        await connection.aclose()


class Operation:
    """One request that holds its key: the connection it claimed on, the transaction the route writes
    in (opened by :meth:`open`), and the route's :class:`IdempotentContext`. End it exactly once: with
    :meth:`finish` and the route's answer, or :meth:`abort`."""

    def __init__(self, keys: KeyRules, key: OperationKey, fp: str, request: RequestFacts, claim: Claim,
                 connection: contextlib.AsyncExitStack, ex: Executor, span: Span | None, *,
                 transaction: contextlib.AsyncExitStack | None = None, sent: Sent | None = None) -> None:
        self.keys = keys
        self.key = key
        self.fingerprint = fp
        self.sent = sent
        """The request as sent (:func:`~.keys.sent_form`), remembered with its stored answer."""
        self.claim = claim
        self.single = transaction is not None
        """Whether the key is held in the route's transaction (``single_transaction``), not by a lease."""
        self.digest = short(claim.digest)
        self._connection = connection
        self._transaction = transaction or contextlib.AsyncExitStack()
        self.ex = ex
        app = keys.app
        self._started = asyncio.get_running_loop().time()
        self._began_at = app.clock()
        self._writes = StagedWrites()
        self.context = IdempotentContext(request, self._began_at, self, key=key, executor=ex,
                                         attempt=claim.attempts, key_digest=self.digest, staged=self._writes,
                                         http=app.http)
        self.span = span
        self._ended = False

    async def open(self) -> None:
        """Begin the route's transaction; on a failure, give the key back. On SQLite it takes the write
        lock at once (``BEGIN IMMEDIATE``): a route that reads before it writes would otherwise fail
        ("database is locked") whenever another request writes meanwhile, and a request cannot be
        delivered again later as a queue's message can."""
        try:
            await self._transaction.enter_async_context(self.ex.begin(deferred=False))
        except BaseException as exc:
            await self._give_back(exc, "failed")
            raise

    async def finish(self, reply: Reply) -> Reply:
        """Store ``reply`` with the route's writes and complete the key, in one commit; what to send.
        A 5xx is not stored (the key is released for a retry), nor is a reply over the response limit."""
        keys = self.keys
        if reply.status >= 500:
            await self._give_back(None, "failed", status=reply.status)
            return reply
        limit = keys.response_limit or keys.app.settings.idempotent_response_limit_bytes
        if len(reply.body) > limit:
            log.error("an idempotent response of %d bytes is over the %d byte limit; not stored, and the "
                      "route's writes were rolled back [%s %s]", len(reply.body), limit, keys.name, self.digest)
            await self._give_back(None, "too_large")
            return refusal(500, "idempotent_response_too_large", outcome="too_large")
        try:
            ex = self.ex
            self._writes.outbox(self.context.outbox_rows())
            if self._writes:
                await self._writes.write(ex)
            session = ex.session_made()
            if session is not None and (session.new or session.dirty or session.deleted):
                await session.flush()
            inbox, stored = keys.app.inbox, keys.stored(reply)
            if self.single:
                completed = await inbox.finish_held(ex, keys.consumer, self.claim, self.fingerprint,
                                                    namespace=self.key.namespace, version=self.key.version,
                                                    outcome="processed", result=stored)
            else:
                completed = await inbox.complete(ex, keys.consumer, self.claim.digest, self.claim.lease_token or "",
                                                 outcome="processed", result=stored)
            if not completed:  # another attempt took over, or committed first: ours writes nothing
                await self._give_back(None, "lease_lost", release=False)
                return refusal(409, "request_in_progress", (b"retry-after", b"1"), outcome="lease_lost")
            await self._transaction.aclose()  # COMMIT
        except BaseException as exc:
            await self._give_back(exc, "failed")
            raise
        return await self._stored(reply, stored)

    async def _stored(self, reply: Reply, stored: dict[str, Any]) -> Reply:
        """End the operation whose response was just stored (as ``stored``): ``reply`` is what to send.
        The endpoint remembers it, for its repeats, until the earliest expiry its row can have."""
        self._ended = True
        await self._connection.aclose()
        keys, inbox = self.keys, self.keys.app.inbox
        keys.finished.written(self.claim.digest, self.fingerprint, self.claim.attempts, stored,
                              until=self._began_at + inbox.retention - inbox.lease, sent=self.sent)
        keys.count("processed")
        keys.timed(asyncio.get_running_loop().time() - self._started)
        self._end_span(reply.status, "processed")
        return reply

    async def withdraw(self) -> None:
        """The request was refused as invalid before its route ran: roll back and delete the claim, so
        that the key is new again (the corrected request has another fingerprint)."""
        await self._give_back(None, "invalid_request", withdraw=True)

    async def abort(self, exc: BaseException | None = None, outcome: str = "failed") -> None:
        """Roll the route's writes back and give the key back (the route raised, timed out, or its
        request was cancelled); safe to call after :meth:`finish`, when it does nothing."""
        if not self._ended:
            await self._give_back(exc, outcome)

    async def _give_back(self, exc: BaseException | None, outcome: str, *, release: bool = True,
                         status: int | None = None, withdraw: bool = False) -> None:
        """Roll back, release the lease (on this connection, or one aside when it was lost), close:
        shielded, so that a second cancellation cannot leave the key held until its lease runs out.
        ``status``: what the client is answered (the span says it), by default the outcome's.
        ``withdraw``: delete the claim instead of releasing it."""
        if self._ended:
            return
        self._ended = True
        await asyncio.shield(self._roll_back(exc, release, withdraw))
        self.keys.count(outcome)
        self._end_span(status or _GIVEN_BACK_STATUS.get(outcome, 500), outcome, exc)

    async def _roll_back(self, exc: BaseException | None, release: bool, withdraw: bool) -> None:
        keys, ex = self.keys, self.ex
        failure = exc if exc is not None else _Abandoned()
        try:
            with contextlib.suppress(Exception):  # a connection lost mid-transaction rolled back already
                await self._transaction.__aexit__(type(failure), failure, failure.__traceback__)
            if release and self.claim.lease_token is not None:
                try:
                    database = keys.app.database
                    async with (database.aside(ex) if ex.discarded else contextlib.nullcontext(ex)) as on:
                        if withdraw:
                            await keys.app.inbox.withdraw(on, keys.consumer, self.claim.digest, self.claim.lease_token)
                        else:
                            await keys.app.inbox.release(on, keys.consumer, self.claim.digest,
                                                         self.claim.lease_token, error=type(failure).__name__)
                except Exception as gone:  # the lease then runs out by itself (INBOX_LEASE_SECONDS)
                    log.warning("giving an idempotency key back failed (%s) [%s %s]", type(gone).__name__,
                                keys.name, self.digest)
        finally:
            with contextlib.suppress(Exception):
                await self._connection.aclose()

    def _end_span(self, status: int, outcome: str, exc: BaseException | None = None) -> None:
        if self.span is not None:
            end_span(self.span, status, outcome, exc, self.key)
            self.span = None


def end_span(span: Span, status: int, outcome: str, exc: BaseException | None = None,
              key: OperationKey | None = None) -> None:
    from consumer_kit.tracing.spans import end_request  # only ever imported with tracing on

    end_request(span, status, outcome, exc, key)
