"""One idempotent endpoint's rules (:class:`KeyRules`), which begin each request: the seed's two
transactions around the route, on the inbox (the request that holds its key is an
:class:`~consumer_kit.http.idempotency.held.Operation`).

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

    staged=True (a route that only stages its writes): nothing held while it runs; then its writes, the
    key and the response together (:mod:`~consumer_kit.http.idempotency.deferred`)

A repeat of a key this process finished is answered from memory (:mod:`.remembered`). While many of an
endpoint's requests are repeats, the key is first looked up (on PostgreSQL in a read shared with the
other requests under way, on no connection of the request's own): a repeat of finished work then costs
a share of one read.

The adapters that feed it requests (an ASGI middleware, a FastAPI dependency, a Starlette endpoint
decorator) are :mod:`consumer_kit.http.idempotency.asgi`. This module needs no web framework.
"""

from __future__ import annotations

import base64
import contextlib
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from consumer_kit import metrics
from consumer_kit.errors import InvalidKey
from consumer_kit.http import DEFAULT_BODY_LIMIT
from consumer_kit.http.idempotency.deferred import StagedOperation
from consumer_kit.http.idempotency.held import IdempotentContext, Operation, end_span, end_unwritten
from consumer_kit.http.idempotency.keys import KeyRefused, Sent, fingerprint, key_of, request_headers, sent_form
from consumer_kit.http.idempotency.remembered import Finished
from consumer_kit.http.idempotency.replies import KEPT_HEADERS, Reply, RequestFacts, refusal, replay
from consumer_kit.keys import OperationKey, short
from consumer_kit.pipeline.duplicates import DuplicateShare
from consumer_kit.store import Claim, ClaimStatus, Executor, claimable, verdict

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from consumer_kit.app import ConsumerApp

__all__ = ["PASS", "READ_FIRST_ABOVE", "Held", "IdempotentContext", "KeyRules", "Operation"]

READ_FIRST_ABOVE = 0.25
"""The share of an endpoint's requests that are repeats above which a key is looked up before it is claimed."""

REMEMBER_BYTES = 8 * 1024 * 1024
"""How much of its finished keys' answers an endpoint keeps in memory by default, to answer repeats
without a read (see :mod:`~consumer_kit.http.idempotency.remembered`)."""


class Held(NamedTuple):
    """A key held in a transaction (:meth:`KeyRules.take`)."""

    claim: Claim
    connection: contextlib.AsyncExitStack
    transaction: contextlib.AsyncExitStack
    ex: Executor


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
    nothing to wait for: the retry runs at once. ``staged=True``: the route only stages its writes
    (``ctx.stage``, ``ctx.outbox``) and reads nothing through ``ctx.db`` or ``ctx.connection``; nothing is
    held while it runs, and once it returns its writes, the key and the response are written together,
    on PostgreSQL on asyncpg in a single statement when the route staged one statement (the plain inbox; see
    :class:`~consumer_kit.http.idempotency.deferred.StagedOperation`). ``driver="asyncpg"`` (PostgreSQL
    on asyncpg): the route writes through ``ctx.connection`` only, not ``ctx.db``, on the store's own
    asyncpg pool. ``remember_bytes``: how much of its finished keys' answers the endpoint keeps in this
    process to answer their repeats without a read, each until its record's expiry (0: none).
    """

    def __init__(self, app: ConsumerApp, *, namespace: str, version: int, name: str | None = None,
                 required: bool = True, fingerprint_headers: Sequence[str] = (), replay_headers: Sequence[str] = (),
                 bare_keys: bool = False, after_retention: Literal["refuse", "run"] = "refuse",
                 body_limit: int = DEFAULT_BODY_LIMIT, response_limit: int | None = None,
                 timeout_seconds: float | None = None, single_transaction: bool = False, staged: bool = False,
                 driver: Literal["sqlalchemy", "asyncpg"] = "sqlalchemy", remember_bytes: int = REMEMBER_BYTES) -> None:
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
        self.single_transaction = single_transaction or staged
        self.staged = staged
        self.uses_db = driver == "sqlalchemy"
        self._repeats = DuplicateShare(READ_FIRST_ABOVE)
        self.finished = Finished(remember_bytes)
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
                end_span(span, 500, "failed", exc)
            raise
        if isinstance(begun, Reply):
            self.count(begun.outcome)
            if span is not None:
                end_span(span, begun.status, begun.outcome)
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
        values, content_type, named = request_headers(request.headers, self.fingerprint_headers)
        try:
            stable_id = key_of(values, bare=self.bare_keys)
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
        sent = sent_form(request.method, request.path, request.query, request.body, content_type, named)
        now = self.app.clock()
        remembered = self.finished.recall(digests, now)
        if remembered is not None and remembered.same(sent):  # a repeat, as sent before, of a key finished here
            self.seen(taken=True)
            return remembered.replay()
        fp = fingerprint(request.method, request.path, request.query, request.body,
                         None if content_type is None else content_type.decode("latin-1"),
                         [(n.decode("latin-1"), v.decode("latin-1")) for n, v in named])
        if remembered is not None:  # a repeat of a key this process has seen finished: no read
            self.seen(taken=True)
            if remembered.row["fingerprint"] == fp:
                self.finished.learn(remembered, sent)
                return remembered.replay()
            return self.taken(verdict(remembered.row, fp))
        read_first = self._repeats.read_first(self.consumer)
        if read_first and inbox.shares_reads:  # a repeat then takes no connection of its own
            seen = await inbox.look(self.consumer, digests)
            if seen is not None and not claimable(seen, fp, now):
                self.finished.keep(seen, sent=sent if seen["fingerprint"] == fp else None)
                self.seen(taken=True)
                return self.taken(verdict(seen, fp))
        if self.staged:
            return StagedOperation(self, key, fp, request, digests, span, sent=sent)
        if self.single_transaction:
            begun = await self._hold(request, key, digests, fp, span, sent)
        else:
            begun = await self._lease(request, key, digests, fp, span, sent)
        self.seen(taken=isinstance(begun, Reply) and begun.outcome != "key_expired")
        return begun

    def seen(self, *, taken: bool) -> None:
        """Count a request whose key was found ``taken`` (a repeat) or not, for the read-first share."""
        self._repeats.count(self.consumer, taken=taken)

    async def _lease(self, request: RequestFacts, key: OperationKey, digests: Sequence[str], fp: str,
                     span: Span | None, sent: Sent) -> Reply | Operation:
        """The two-transaction path's claim, committed at once, then the route's transaction begun."""
        database, inbox = self.app.database, self.app.inbox
        connection = contextlib.AsyncExitStack()
        ex = await connection.enter_async_context(database.connect(session=self.uses_db))
        try:
            claim = await inbox.claim(ex, self.consumer, digests, fp, namespace=key.namespace, version=key.version)
            if claim.status is ClaimStatus.SWEPT:
                refused = self.late()
                if refused is not None:
                    await connection.aclose()
                    return refused
                await inbox.forget(ex, self.consumer, digests)
                claim = await inbox.claim(ex, self.consumer, digests, fp, namespace=key.namespace,
                                          version=key.version)
            if not claim.acquired:
                await connection.aclose()
                return self.taken(claim)
            operation = Operation(self, key, fp, request, claim, connection, ex, span, sent=sent)
        except BaseException:
            await connection.__aexit__(*sys.exc_info())
            raise
        await operation.open()
        return operation

    async def _hold(self, request: RequestFacts, key: OperationKey, digests: Sequence[str], fp: str,
                    span: Span | None, sent: Sent) -> Reply | Operation:
        """The single-transaction path: begin the route's transaction and hold the key in it."""
        held = await self.take(digests, fp)
        if isinstance(held, Reply):
            return held
        return Operation(self, key, fp, request, held.claim, held.connection, held.ex, span,
                         transaction=held.transaction, sent=sent)

    async def take(self, digests: Sequence[str], fp: str) -> Reply | Held:
        """A connection, a transaction begun on it, and the key held in it (what the single-transaction
        path writes in); or, with nothing left open, the answer for a key another request holds or
        finished."""
        database, inbox = self.app.database, self.app.inbox
        connection = contextlib.AsyncExitStack()
        transaction = contextlib.AsyncExitStack()
        ex = await connection.enter_async_context(database.connect(session=self.uses_db))
        try:
            if not inbox.shares_reads:  # one writer (SQLite): a repeat must not wait for its write lock
                seen = await inbox.lookup(ex, self.consumer, digests)
                if seen is not None and not claimable(seen, fp, self.app.clock()):
                    await connection.aclose()
                    return self.taken(verdict(seen, fp))
            await transaction.enter_async_context(ex.begin(deferred=False))
            claim = await inbox.hold(ex, self.consumer, digests, fp)
            if claim.status is ClaimStatus.SWEPT:
                refused = self.late()
                if refused is not None:
                    await end_unwritten(transaction, connection)
                    return refused
                await inbox.forget(ex, self.consumer, digests)
                claim = Claim(ClaimStatus.ACQUIRED, digests[0], 1)
            if not claim.acquired:
                await end_unwritten(transaction, connection)
                return self.taken(claim)
            return Held(claim, connection, transaction, ex)
        except BaseException:
            await transaction.__aexit__(*sys.exc_info())
            await connection.__aexit__(*sys.exc_info())
            raise

    def late(self) -> Reply | None:
        """Count a key whose record was swept (its tombstone remains) as late: the answer with
        ``after_retention="refuse"``, ``None`` when the route is to run again."""
        if self.after_retention == "refuse":
            metrics.LATE_DELIVERIES.labels(self.consumer, "refused").inc()
            return refusal(422, "idempotency_key_expired", outcome="key_expired")
        metrics.LATE_DELIVERIES.labels(self.consumer, "processed").inc()
        return None

    def taken(self, claim: Claim) -> Reply:
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


