"""One idempotent endpoint's rules (:class:`KeyRules`) and one request that holds its key
(:class:`Operation`): the seed's two transactions around the route, on the inbox.

::

    key   = Idempotency-Key header (an sf-string)    missing -> 400 (if required); malformed, twice -> 400
    claim = inbox.claim(http:<name>, digest(caller, key), fingerprint)   committed at once
      completed       -> the stored response, with Idempotency-Replayed: true; the route does not run
      live lease      -> 409 request_in_progress, Retry-After: when the lease ends
      other request   -> 422 idempotency_key_reused
      swept (a tombstone says it was done) -> 422 idempotency_key_expired, or run again (after_retention)
      new / expired   -> we hold the lease: Operation
    BEGIN; route(ctx) (ctx.db, ctx.outbox inside); store its response; complete WHERE lease_token = ours; COMMIT
      lease lost      -> roll back, 409 (the retry gets the other attempt's answer)
      5xx or raised   -> roll back, release the key: a retry runs the route again (unlike Stripe, which stores 500s)
      too big to keep -> roll back, release, 500 idempotent_response_too_large (never half stored)

    single_transaction=True (a route whose every effect is in the database):
    BEGIN; hold the key (PostgreSQL: its advisory lock, not waited for: in flight -> 409); route(ctx);
           insert the row completed with the response; COMMIT      a crash or a 5xx leaves nothing behind

While many of an endpoint's requests are repeats, the key is first looked up (on PostgreSQL in a read
shared with the other requests under way, on no connection of the request's own): a repeat of finished
work then costs a share of one read.

The adapters that feed it requests (an ASGI middleware, a FastAPI dependency, a Starlette endpoint
decorator) are :mod:`consumer_kit.http.idempotency.asgi`. This module needs no web framework.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from consumer_kit import metrics
from consumer_kit.context import Context
from consumer_kit.delivery import Delivery
from consumer_kit.errors import InvalidKey
from consumer_kit.http import DEFAULT_BODY_LIMIT
from consumer_kit.http.idempotency.keys import KeyRefused, fingerprint, header_key
from consumer_kit.http.idempotency.replies import KEPT_HEADERS, Reply, RequestFacts, refusal, replay
from consumer_kit.keys import OperationKey, short
from consumer_kit.pipeline.duplicates import DuplicateShare
from consumer_kit.store import Claim, ClaimStatus, Executor, OutboxWriter, StagedWrites, claimable, verdict

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from consumer_kit.app import ConsumerApp

log = logging.getLogger("consumer_kit.http.idempotency")

class IdempotentContext(Context):
    """What the route gets: a :class:`~consumer_kit.Context` (``ctx.key``, ``ctx.db`` and
    ``ctx.connection`` inside the transaction that also stores the response, ``ctx.outbox``,
    ``ctx.derive``) and ``caller``, the scope the key was taken in. ``ctx.key`` is the operation's key:
    for a scoped endpoint its id is a keyed digest of the caller and the client's key, so that the keys
    derived from it (``ctx.derive("carrier")``) differ between two callers who sent the same key."""

    __slots__ = ("caller",)

    caller: str | None


READ_FIRST_ABOVE = 0.25
"""The share of an endpoint's requests that are repeats above which a key is looked up before it is claimed."""

PASS = object()
"""What :meth:`KeyRules.begin` answers for a request without a key to an endpoint that does not
require one: the route runs as if it were not idempotent."""


class KeyRules:
    """The rules of one idempotent endpoint (or a family of them), on ``app``'s inbox.

    ``namespace`` and ``version`` make the operation keys (``labels:v1:<client key>``); ``name`` (default
    the namespace) names the inbox scope (``http:<name>``), the metrics' ``endpoint`` label and the
    spans; keep it stable across deploys. The request's ``caller`` (which the adapter,
    :class:`~consumer_kit.http.idempotency.IdempotencyKey`, asks the endpoint's function for) scopes
    keys by principal. ``required``: a request without a key is refused (400) rather than run as is.
    ``fingerprint_headers``: request headers that are part of "the same request" besides the method,
    path, query and body. ``replay_headers``: response headers a replay repeats besides ``Content-Type``,
    ``Location`` and ``Content-Location``. ``bare_keys``: accept a key sent as a bare token as well as
    the draft's quoted string. ``after_retention``: what a key whose record was swept (its tombstone
    remains) gets: ``"refuse"`` (422 ``idempotency_key_expired``) or ``"run"`` (the route runs again).
    ``body_limit`` caps the request body (413), ``response_limit`` the response kept for replays
    (default ``IDEMPOTENT_RESPONSE_LIMIT_BYTES``), ``timeout_seconds`` the route's run (default the
    inbox lease, ``INBOX_LEASE_SECONDS``: the lease stays the request's while it runs).
    ``single_transaction=True``: the key, the route's writes and the response commit in one transaction,
    for a route whose every effect is in the database (``ctx.db``, ``ctx.connection``, ``ctx.outbox``): a
    route that calls out would call again after a rollback. It is faster, and a crash mid-request leaves
    nothing to wait for: the retry runs at once. ``driver="asyncpg"`` (PostgreSQL on asyncpg): the route
    writes through ``ctx.connection`` only, not ``ctx.db``, on the store's own asyncpg pool.
    """

    def __init__(self, app: ConsumerApp, *, namespace: str, version: int, name: str | None = None,
                 required: bool = True, fingerprint_headers: Sequence[str] = (), replay_headers: Sequence[str] = (),
                 bare_keys: bool = False, after_retention: Literal["refuse", "run"] = "refuse",
                 body_limit: int = DEFAULT_BODY_LIMIT, response_limit: int | None = None,
                 timeout_seconds: float | None = None, single_transaction: bool = False,
                 driver: Literal["sqlalchemy", "asyncpg"] = "sqlalchemy") -> None:
        OperationKey(namespace, version, "probe")  # fail at construction on a bad namespace or version
        if after_retention not in ("refuse", "run"):
            raise ValueError(f"after_retention must be 'refuse' or 'run', not {after_retention!r}")
        if driver not in ("sqlalchemy", "asyncpg"):
            raise ValueError(f"driver must be 'sqlalchemy' or 'asyncpg', not {driver!r}")
        self.app = app
        self.namespace = namespace
        self.version = version
        self.name = name or namespace
        self.consumer = f"http:{self.name}"
        self.required = required
        self.fingerprint_headers = tuple(h.lower().encode("latin-1") for h in fingerprint_headers)
        self.kept_headers = KEPT_HEADERS | {h.lower().encode("latin-1") for h in replay_headers}
        self.bare_keys = bare_keys
        self.after_retention = after_retention
        self.body_limit = body_limit
        self.response_limit = response_limit
        self._timeout = timeout_seconds
        self.single_transaction = single_transaction
        self.uses_db = driver == "sqlalchemy"
        self._repeats = DuplicateShare(READ_FIRST_ABOVE)
        self._counts = {outcome: metrics.IDEMPOTENT_REQUESTS.labels(self.name, outcome)
                        for outcome in metrics.IDEMPOTENT_OUTCOMES}
        self._seconds = metrics.IDEMPOTENT_SECONDS.labels(self.name)
        for action in ("refused", "processed"):
            metrics.LATE_DELIVERIES.labels(self.consumer, action)

    @property
    def timeout_seconds(self) -> float:
        """How long the route may run once it holds the key."""
        return self._timeout if self._timeout is not None else self.app.settings.inbox_lease_seconds

    def timed(self, seconds: float) -> None:
        """Observe one run's time from claim to stored response."""
        self._seconds.observe(seconds)

    def count(self, outcome: str) -> None:
        """Count one request's ``outcome`` (see ``consumer_kit_http_idempotent_requests_total``)."""
        self._counts[outcome].inc()

    def operation_key(self, stable_id: str, caller: str | None) -> OperationKey:
        """The operation's key: the client's, or for a scoped request the caller's keyed tag and the
        client's key (:class:`~consumer_kit.errors.InvalidKey` when together they are too long)."""
        if caller is None:
            return OperationKey(self.namespace, self.version, stable_id)
        tag = self.app.pipeline.digester.digest(f"idempotency-caller:{caller}")[:16]
        return OperationKey(self.namespace, self.version, f"{tag}.{stable_id}")

    async def begin(self, request: RequestFacts) -> Reply | Operation | object:
        """Claim the request's key (the first transaction): an :class:`Operation` that holds it, a
        :class:`Reply` to send without running the route, or :data:`PASS`. Traced, the request's span
        starts here; a reply ends it, an operation carries it to its end."""
        span = self._span(request)
        try:
            begun = await self._begin(request, span)
        except BaseException as exc:
            if span is not None:
                _end_span(span, 500, "failed", exc)
            raise
        if isinstance(begun, Reply):
            self.count(begun.outcome)
            if span is not None:
                _end_span(span, begun.status, begun.outcome)
        return begun

    def _span(self, request: RequestFacts) -> Span | None:
        try:
            tracer = self.app.pipeline.tracer
        except RuntimeError:  # not started: answered 503 below
            return None
        if tracer is None:
            return None
        headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in request.headers}
        return tracer.request(f"{request.method} {self.name}", {
            "http.request.method": request.method, "url.path": request.path, "consumer_kit.endpoint": self.name,
            "consumer_kit.key.namespace": self.namespace, "consumer_kit.key.version": self.version}, headers)

    async def _begin(self, request: RequestFacts, span: Span | None) -> Reply | Operation | object:
        try:
            stable_id = header_key(request.headers, bare=self.bare_keys)
        except KeyRefused as exc:
            return refusal(400, exc.code, outcome=exc.code.removeprefix("idempotency_"))
        if stable_id is None:
            return refusal(400, "idempotency_key_missing", outcome="key_missing") if self.required else PASS
        if len(request.body) > self.body_limit:
            return refusal(413, "payload_too_large", outcome="too_large")
        try:
            inbox, digester = self.app.inbox, self.app.pipeline.digester
        except RuntimeError:  # the app is not started (or is stopping)
            return refusal(503, "not_accepting", (b"retry-after", b"1"), outcome="unavailable")
        try:
            key = self.operation_key(stable_id, request.caller)
        except InvalidKey:
            return refusal(400, "idempotency_key_malformed", outcome="key_malformed")
        digests = digester.candidates(key)
        if span is not None:
            span.set_attribute("consumer_kit.key.digest", short(digests[0]))
        content_type = next((v.decode("latin-1") for n, v in request.headers if n.lower() == b"content-type"), None)
        named = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in request.headers
                 if n.lower() in self.fingerprint_headers]
        fp = fingerprint(request.method, request.path, request.query, request.body, content_type, named)
        read_first = self._repeats.read_first(self.consumer)
        if read_first and inbox.shares_reads:  # a repeat then takes no connection of its own
            seen = await inbox.look(self.consumer, digests)
            if seen is not None and not claimable(seen, fp, self.app.clock()):
                self._repeats.count(self.consumer, taken=True)
                return self._taken(verdict(seen, fp))
        if self.single_transaction:
            begun = await self._hold(request, key, digests, fp, span)
        else:
            begun = await self._lease(request, key, digests, fp, span)
        self._repeats.count(self.consumer, taken=isinstance(begun, Reply) and begun.outcome != "key_expired")
        return begun

    async def _lease(self, request: RequestFacts, key: OperationKey, digests: Sequence[str], fp: str,
                     span: Span | None) -> Reply | Operation:
        """The two-transaction path's claim, committed at once, then the route's transaction begun."""
        database, inbox = self.app.database, self.app.inbox
        connection = contextlib.AsyncExitStack()
        ex = await connection.enter_async_context(database.connect(session=self.uses_db))
        try:
            claim = await inbox.claim(ex, self.consumer, digests, fp, namespace=key.namespace, version=key.version)
            if claim.status is ClaimStatus.SWEPT:
                if self.after_retention == "refuse":
                    metrics.LATE_DELIVERIES.labels(self.consumer, "refused").inc()
                    await connection.aclose()
                    return refusal(422, "idempotency_key_expired", outcome="key_expired")
                metrics.LATE_DELIVERIES.labels(self.consumer, "processed").inc()
                await inbox.forget(ex, self.consumer, digests)
                claim = await inbox.claim(ex, self.consumer, digests, fp, namespace=key.namespace,
                                          version=key.version)
            if not claim.acquired:
                await connection.aclose()
                return self._taken(claim)
            operation = Operation(self, key, fp, request, claim, connection, ex, span)
        except BaseException:
            await connection.__aexit__(*sys.exc_info())
            raise
        await operation.open()
        return operation

    async def _hold(self, request: RequestFacts, key: OperationKey, digests: Sequence[str], fp: str,
                    span: Span | None) -> Reply | Operation:
        """The single-transaction path: begin the route's transaction and hold the key in it."""
        database, inbox = self.app.database, self.app.inbox
        connection = contextlib.AsyncExitStack()
        transaction = contextlib.AsyncExitStack()
        ex = await connection.enter_async_context(database.connect(session=self.uses_db))
        try:
            if not inbox.shares_reads:  # one writer (SQLite): a repeat must not wait for its write lock
                seen = await inbox.lookup(ex, self.consumer, digests)
                if seen is not None and not claimable(seen, fp, self.app.clock()):
                    await connection.aclose()
                    return self._taken(verdict(seen, fp))
            await transaction.enter_async_context(ex.begin(deferred=False))
            claim = await inbox.hold(ex, self.consumer, digests, fp)
            if claim.status is ClaimStatus.SWEPT:
                if self.after_retention == "refuse":
                    metrics.LATE_DELIVERIES.labels(self.consumer, "refused").inc()
                    await _roll_back(transaction, connection)
                    return refusal(422, "idempotency_key_expired", outcome="key_expired")
                metrics.LATE_DELIVERIES.labels(self.consumer, "processed").inc()
                await inbox.forget(ex, self.consumer, digests)
                claim = Claim(ClaimStatus.ACQUIRED, digests[0], 1)
            if not claim.acquired:
                await _roll_back(transaction, connection)
                return self._taken(claim)
            return Operation(self, key, fp, request, claim, connection, ex, span, transaction=transaction)
        except BaseException:
            await transaction.__aexit__(*sys.exc_info())
            await connection.__aexit__(*sys.exc_info())
            raise

    def _taken(self, claim: Claim) -> Reply:
        """The answer to a request whose key another attempt holds or finished."""
        if claim.status is ClaimStatus.COMPLETED and isinstance(claim.result, dict):
            return replay(claim.result)
        if claim.status is ClaimStatus.IN_PROGRESS:
            seconds = 1
            if claim.locked_until is not None:
                seconds = max(1, math.ceil((claim.locked_until - self.app.clock()).total_seconds()))
            return refusal(409, "request_in_progress", (b"retry-after", str(seconds).encode()), outcome="in_progress")
        return refusal(422, "idempotency_key_reused", outcome="key_reused")

    def stored(self, reply: Reply) -> dict[str, Any]:
        """The row's ``result``: what a replay answers (status, the kept headers, the body)."""
        headers = [[n.decode("latin-1"), v.decode("latin-1")] for n, v in reply.headers
                   if n.lower() in self.kept_headers]
        return {"status": reply.status, "headers": headers, "body": base64.b64encode(reply.body).decode("ascii")}


_GIVEN_BACK_STATUS = {"timed_out": 503, "lease_lost": 409, "invalid_request": 422}
"""The answer to a request whose key was given back, by outcome (others: 500), for its span."""


class _Abandoned(Exception):
    """Handed to the transaction's exit to roll it back when the route failed without an exception of
    its own (a 5xx it returned, a response too big to keep)."""


async def _roll_back(transaction: contextlib.AsyncExitStack, connection: contextlib.AsyncExitStack) -> None:
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
                 transaction: contextlib.AsyncExitStack | None = None) -> None:
        self.keys = keys
        self.key = key
        self.fingerprint = fp
        self.claim = claim
        self.single = transaction is not None
        """Whether the key is held in the route's transaction (``single_transaction``), not by a lease."""
        self.digest = short(claim.digest)
        self._connection = connection
        self._transaction = transaction or contextlib.AsyncExitStack()
        self.ex = ex
        app = keys.app
        self._started = asyncio.get_running_loop().time()
        self._writes = StagedWrites()
        outbox = OutboxWriter(app.pipeline.digester, keys.consumer, key, clock=app.clock)
        headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in request.headers
                   if n.lower() not in (b"authorization", b"cookie", b"proxy-authorization", b"idempotency-key")}
        delivery = Delivery(id=None, body=request.body, headers=headers, attempt=claim.attempts,
                            attributes={"method": request.method, "path": request.path})
        self.context = IdempotentContext(key=key, delivery=delivery, executor=ex, attempt=claim.attempts,
                                         key_digest=self.digest, outbox=outbox, staged=self._writes,
                                         http=app.http)
        self.context.caller = request.caller
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
            if self._writes:
                await self._writes.write(ex)
            await self.context.outbox.flush(ex)
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
        self._ended = True
        await self._connection.aclose()
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
            _end_span(self.span, status, outcome, exc, self.key)
            self.span = None


def _end_span(span: Span, status: int, outcome: str, exc: BaseException | None = None,
              key: OperationKey | None = None) -> None:
    from consumer_kit.tracing.spans import end_request  # only ever imported with tracing on

    end_request(span, status, outcome, exc, key)
