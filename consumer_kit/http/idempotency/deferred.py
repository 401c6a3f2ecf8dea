"""A request to a ``staged=True`` endpoint (:class:`StagedOperation`): nothing is held while its route
runs; once it has returned, its staged writes, the key and the response are written together.

::

    route(ctx)   ctx.stage(...), ctx.outbox.publish(...): kept; nothing is written yet
    one statement staged, PostgreSQL on asyncpg, the plain inbox, one HMAC key in use:
        WITH <the key's tombstone>, <the key's row, completed, with the response> <the staged statement>
          written      -> the response
          key taken    -> the row decides: its response replayed; 409 while a lease holds it; 422 for
                          another request; a row an earlier attempt left started: as below
          swept        -> 422 idempotency_key_expired, or (after_retention="run") the tombstone
                          forgotten and the statement sent again
    otherwise, the single-transaction path after the route:
        BEGIN; hold the key (a repeat: its answer); the staged writes; the row; COMMIT

Two requests with one key may both run the route; one's writes commit and the other gets its response.
That is why the route may only stage: a write through ``ctx.db`` or ``ctx.connection`` would be made by
both (here they raise), and so would a call out of the process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from consumer_kit.http.idempotency.held import NOTHING_HELD, Operation
from consumer_kit.http.idempotency.keys import Sent
from consumer_kit.http.idempotency.replies import Reply
from consumer_kit.keys import short
from consumer_kit.store import Claim, ClaimStatus, Executor, claimable, verdict
from consumer_kit.store.at_once import AtOnce, can_guard
from consumer_kit.store.unopened import Unopened

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from consumer_kit.http.idempotency.operation import Held, KeyRules
    from consumer_kit.http.idempotency.replies import RequestFacts
    from consumer_kit.keys import OperationKey

_PAUSES = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 0)
"""How long to wait, one try after another, for another request that holds the key (about 1.6 s in all)."""

_MISTAKE = ("this endpoint is IdempotencyKey(staged=True): its route stages its writes (ctx.stage, "
            "ctx.outbox), which are written with its key once it returns; it has no ctx.connection or ctx.db")
_UNOPENED = {uses_db: Unopened(uses_db, _MISTAKE) for uses_db in (True, False)}
"""A staged route's stand-in connection, by driver (it holds nothing of a request's: one each serves all)."""


class StagedOperation(Operation):
    """One request to a ``staged=True`` endpoint, from its route's start to its stored response."""

    def __init__(self, keys: KeyRules, key: OperationKey, fp: str, request: RequestFacts, digests: Sequence[str],
                 span: Span | None, *, sent: Sent | None = None) -> None:
        super().__init__(keys, key, fp, request, Claim(ClaimStatus.ACQUIRED, digests[0], 1), NOTHING_HELD,
                         cast(Executor, _UNOPENED[keys.uses_db]), span, transaction=NOTHING_HELD, sent=sent)
        self._digests = digests

    async def finish(self, reply: Reply) -> Reply:
        keys = self.keys
        limit = keys.response_limit or keys.app.settings.idempotent_response_limit_bytes
        if reply.status >= 500 or len(reply.body) > limit:
            return await super().finish(reply)  # not stored; nothing is held, nothing written
        self._writes.outbox(self.context.outbox_rows())  # written with the staged statements, or not at all
        staged = self._writes.alone()
        if staged is not None and can_guard(staged[0]) and self._one_statement():
            answer = await self._at_once(reply, *staged)
            if answer is not None:
                return answer
        try:
            held = await self._take()
        except BaseException as exc:
            await self._give_back(exc, "failed")
            raise
        if isinstance(held, Reply):
            return self._answered(held, taken=held.outcome != "key_expired")
        self.claim, self._connection, self._transaction, self.ex = held
        self.digest = short(held.claim.digest)
        return await super().finish(reply)

    async def _take(self) -> Reply | Held:
        """Hold the key in a transaction for the staged writes. Another request holding it (PostgreSQL:
        its advisory lock) is writing its own staged writes, which it ran its route before: it ends
        within moments, so it is waited for (a while) rather than answered 409."""
        for pause in _PAUSES:
            held = await self.keys.take(self._digests, self.fingerprint)
            if not (isinstance(held, Reply) and held.outcome == "in_progress"):
                break
            await asyncio.sleep(pause)
        return held

    def _one_statement(self) -> bool:
        """Whether the key and one staged statement can go in one statement here: PostgreSQL on the
        store's asyncpg pool, the plain inbox, and one HMAC key in use (a key under the previous one is a
        second look). On the partitioned inbox the statement's refusal of a key that has a row (the
        inbox's unique index) holds within a partition only: there the transaction path looks in every one."""
        keys = self.keys
        return keys.app.database.asyncpg and not keys.uses_db and len(self._digests) == 1 \
            and not keys.app.inbox.partitioned

    async def _at_once(self, reply: Reply, statement: str, args: tuple[Any, ...]) -> Reply | None:
        """Send the staged statement with the key: what to answer, or ``None`` where the
        single-transaction path must finish (the key's row was left started by an earlier attempt)."""
        keys, inbox = self.keys, self.keys.app.inbox
        stored = keys.stored(reply)
        try:
            for _ in range(2):  # again once a swept key's tombstone is forgotten (after_retention="run")
                try:
                    # With the other requests' writes under way, on a connection of the store's own.
                    done = await inbox.write_with_key(keys.consumer, self._digests[0], self.fingerprint,
                                                      namespace=self.key.namespace, version=self.key.version,
                                                      outcome="processed", result=stored, statement=statement,
                                                      args=args)
                except Exception as exc:
                    # The route's own row may be refused first (its unique index) by another request
                    # with this key that wrote a moment before: then the key's row answers.
                    if not _unique_violation(exc):
                        raise
                    async with keys.app.database.connect() as ex:
                        row = await inbox.lookup(ex, keys.consumer, self._digests)
                    if row is None or claimable(row, self.fingerprint, keys.app.clock()):
                        raise
                    return self._answered(keys.taken(verdict(row, self.fingerprint)))
                if done is AtOnce.WRITTEN:
                    keys.seen(taken=False)
                    return await self._stored(reply, stored)
                async with keys.app.database.connect() as ex:
                    if done is AtOnce.SWEPT:
                        refused = keys.late()
                        if refused is not None:
                            return self._answered(refused, taken=False)
                        await inbox.forget(ex, keys.consumer, self._digests)
                        continue
                    row = await inbox.lookup(ex, keys.consumer, self._digests)
                if row is None:  # swept since: its tombstone decides, the next time round
                    continue
                if claimable(row, self.fingerprint, keys.app.clock()):
                    return None
                return self._answered(keys.taken(verdict(row, self.fingerprint)))
        except BaseException as exc:
            await self._give_back(exc, "failed")
            raise
        return None

    def _answered(self, reply: Reply, *, taken: bool = True) -> Reply:
        """End the operation with ``reply``, the answer the key's record gave; the route's writes are
        dropped."""
        self._ended = True
        self.keys.seen(taken=taken)
        self.keys.count(reply.outcome)
        self._end_span(reply.status, reply.outcome)
        return reply


def _unique_violation(exc: Exception) -> bool:
    import asyncpg

    return isinstance(exc, asyncpg.UniqueViolationError)
