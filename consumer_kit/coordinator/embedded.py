"""EmbeddedCoordinator: seed 000's receipt semantics in process, on the project's database."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from consumer_kit.coordinator import metrics
from consumer_kit.coordinator.protocol import (
    DelegationReceipt,
    DelegationRequest,
    Operation,
    SessionReceipt,
    SessionRequest,
    SessionScope,
    fingerprint,
)
from consumer_kit.coordinator.store import Creation, Found, ReceiptStore, Scope
from consumer_kit.errors import (
    CoordinatorRejected,
    IdempotencyKeyConflict,
    IdempotencyResultInactive,
    InvalidKey,
    ReceiptLimitExceeded,
)
from consumer_kit.keys import KeyDigester, short, validate_key
from consumer_kit.settings import Settings
from consumer_kit.store.inbox import Clock, utcnow
from consumer_kit.store.pglane import PgLane, Rider

log = logging.getLogger("consumer_kit.coordinator")

_METRIC_OUTCOME = {"created": "created", "replayed": "replayed", "conflict": "conflicts", "inactive": "expired"}


@dataclass(frozen=True, slots=True)
class PreparedSession:
    """A session creation prepared to ride on the inbox's claim (:meth:`EmbeddedCoordinator.prepare_session`)."""

    request: SessionRequest
    idempotency_key: str
    creation: Creation

    @property
    def rider(self) -> Rider:
        """What the inbox's claim carries."""
        return self.creation.rider


class EmbeddedCoordinator(SessionScope):
    """Creates sessions and delegations idempotently, with receipts in ``engine``'s database.

    Receipts are scoped by ``tenant`` and ``application`` (and the operation); :meth:`scoped` gives a
    view of the same store for another scope, which is how the server serves many bearers. A call
    without a key creates without a receipt (in process there is no network retry to protect); the
    server passes ``generated_key=True`` for keys a client generated, which are kept
    ``GENERATED_IDEMPOTENCY_RETENTION_SECONDS`` instead of ``IDEMPOTENCY_RETENTION_SECONDS``.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        settings: Settings,
        *,
        tenant: str = "local",
        application: str = "consumer-kit",
        digester: KeyDigester | None = None,
        clock: Clock = utcnow,
        lane: PgLane | None = None,
    ) -> None:
        self.settings = settings
        self.tenant = tenant
        self.application = application
        self.digester = digester or settings.digester()
        self.store = ReceiptStore(engine, clock=clock, lane=lane)

    async def open(self) -> None:
        """Prepare this coordinator's scope in the store (the receipt counts of its sessions and
        delegations), so that its first creations need no set-up of their own. Optional; idempotent."""
        for operation in ("session", "delegation"):
            await self.store.open_scope(Scope(self.tenant, self.application, operation))

    def scoped(self, tenant: str, application: str) -> EmbeddedCoordinator:
        """The same coordinator acting for another tenant and application."""
        view = object.__new__(EmbeddedCoordinator)
        view.settings, view.digester, view.store = self.settings, self.digester, self.store
        view.tenant, view.application = tenant, application
        return view

    async def create_session(
        self, request: SessionRequest, *, idempotency_key: str | None = None, generated_key: bool = False
    ) -> SessionReceipt:
        """See :meth:`Coordinator.create_session`."""
        found = await self._create("session", request, idempotency_key, generated_key)
        assert found.expires_at is not None
        return SessionReceipt(found.resource_id, found.status, found.expires_at,
                              replayed=found.verdict == "replayed")

    def prepare_session(self, request: SessionRequest, *, idempotency_key: str,
                        request_fingerprint: str | None = None) -> PreparedSession | None:
        """A session creation to carry on the inbox's claim (``Inbox.claim(rider=...)``), so that it
        commits in the claim's statement when, and only when, the claim takes the lease; finish it with
        :meth:`create_prepared`. ``None`` when it cannot ride (no asyncpg lane, an HMAC key rotation in
        progress, an invalid key): :meth:`create_session` then does all the work.
        ``request_fingerprint``: ``fingerprint("session", request)``, when the caller reuses a request
        for many deliveries and has it already."""
        if self.store.lane is None:
            return None
        try:
            validate_key(idempotency_key)
        except InvalidKey:
            return None
        digests = self.digester.candidates(idempotency_key)
        if len(digests) != 1:
            return None
        settings = self.settings
        creation = self.store.prepare(
            Scope(self.tenant, self.application, "session"), digests[0],
            request_fingerprint or fingerprint("session", request),
            kind="session", ttl=timedelta(seconds=request.ttl_seconds),
            retention=timedelta(seconds=settings.idempotency_retention_seconds), generated=False,
            cap=settings.idempotency_max_receipts_per_scope)
        return PreparedSession(request, idempotency_key, creation)

    async def create_prepared(self, prepared: PreparedSession, *, driver: Any = None) -> SessionReceipt:
        """:meth:`create_session` for a prepared creation: what its rider did when it was carried
        (created, replayed, a conflict, ...), else the whole creation now. ``driver``: the lane
        connection the caller holds, if any (so that the creation never waits for a second one)."""
        found = await self._create("session", prepared.request, prepared.idempotency_key, False,
                                   carried=prepared.creation, driver=driver)
        assert found.expires_at is not None
        return SessionReceipt(found.resource_id, found.status, found.expires_at,
                              replayed=found.verdict == "replayed")

    async def create_delegation(
        self, request: DelegationRequest, *, idempotency_key: str | None = None, generated_key: bool = False
    ) -> DelegationReceipt:
        """See :meth:`Coordinator.create_delegation`. ``request.from_session_id`` must be an active
        session of this tenant and application: ``CoordinatorRejected(404, "session_not_found")``
        otherwise, or ``(409, "session_inactive")`` once it ended, expired or was revoked; a replay whose
        session is no longer active is :class:`IdempotencyResultInactive` (seed 000: never replay an
        identity that can no longer be used)."""
        await self._check_delegation_source(request, idempotency_key)
        found = await self._create("delegation", request, idempotency_key, generated_key)
        assert found.expires_at is not None
        return DelegationReceipt(found.resource_id, found.status, found.expires_at,
                                 replayed=found.verdict == "replayed")

    async def _check_delegation_source(self, request: DelegationRequest, key: str | None) -> None:
        digests: Sequence[str] = ()
        if key is not None:
            try:
                digests = self.digester.candidates(validate_key(key))
            except InvalidKey:
                return  # refused (and counted) by _create
        session, receipt = await self.store.delegation_source(self.tenant, self.application,
                                                              request.from_session_id, digests)
        if receipt is not None:  # a replay or a conflict: the receipt's verdict, unless the session is gone
            if session != "active" and receipt == fingerprint("delegation", request):
                metrics.REQUESTS.labels(_METRIC_OUTCOME["inactive"]).inc()
                log.info("delegation key's session is no longer active [%s]", short(digests[0]))
                raise IdempotencyResultInactive()
            return
        if session is None:  # no such session, or another tenant's or application's: the same answer
            raise CoordinatorRejected(404, "session_not_found")
        if session != "active":
            raise CoordinatorRejected(409, "session_inactive")

    async def end_session(self, session_id: str) -> None:
        """See :meth:`Coordinator.end_session`; an unknown id is ``CoordinatorRejected(404)``."""
        await self._set_status(session_id, "ended")

    def shares_database(self, engine: AsyncEngine) -> bool:
        """Whether the receipts live on ``engine``'s database, so that a session can be ended inside a
        transaction on it (see :meth:`end_session_in`)."""
        return self.store.engine is engine

    def ending(self, session_id: str) -> Rider:
        """A rider that ends the session with the inbox's completion (``Inbox.complete(rider=...)``);
        then :meth:`ended_in` tells whether it did."""
        return self.store.ending(self.tenant, self.application, session_id, self.store.clock())

    async def ended_in(self, ending: Rider, session_id: str, *, conn: AsyncConnection | None = None,
                       driver: Any = None) -> bool:
        """Whether ``ending`` ended the session; when it was not carried (or found the session not
        active) :meth:`end_session_in` runs, in the same transaction."""
        if ending.row is not None and ending.row["ended"]:
            return True
        return await self.end_session_in(session_id, conn=conn, driver=driver)

    async def end_session_in(self, session_id: str, *, conn: AsyncConnection | None = None,
                             driver: Any = None) -> bool:
        """End the session inside the caller's transaction on this coordinator's database: through
        ``conn`` (SQLAlchemy) or ``driver`` (an asyncpg connection). The session then ends if and only
        if that transaction commits. ``False`` when no such session is in scope."""
        return await self.store.set_status(self.tenant, self.application, session_id, "ended",
                                           conn=conn, driver=driver)

    async def revoke_session(self, session_id: str) -> None:
        """See :meth:`Coordinator.revoke_session`; an unknown id is ``CoordinatorRejected(404)``."""
        await self._set_status(session_id, "revoked")

    async def sweep(self) -> int:
        """Delete expired receipts and resources in batches, then refresh the gauges."""
        try:
            cap = self.settings.idempotency_max_receipts_per_scope
            swept = await self.store.sweep(batch_size=self.settings.sweep_batch_size, cap=cap)
            await self.store.reopen(cap)
            count, oldest = await self.store.stats()
        except Exception:
            metrics.SWEEPER_FAILURES.inc()
            raise
        metrics.SWEPT.inc(swept)
        metrics.RECEIPTS.set(count)
        age = (self.store.clock() - oldest).total_seconds() if oldest is not None else 0.0
        metrics.OLDEST.set(max(0.0, age))
        return swept

    async def _set_status(self, resource_id: str, status: str) -> None:
        if not await self.store.set_status(self.tenant, self.application, resource_id, status):
            raise CoordinatorRejected(404, "session_not_found")

    async def _create(
        self, operation: Operation, request: SessionRequest | DelegationRequest, key: str | None,
        generated: bool, *, carried: Creation | None = None, driver: Any = None,
    ) -> Found:
        settings = self.settings
        digests: list[str] = []
        retention: timedelta | None = None
        if carried is not None:  # validated and digested when it was prepared
            digests = [carried.digest]
            retention = timedelta(seconds=settings.idempotency_retention_seconds)
        elif key is not None:
            try:
                validate_key(key)
            except InvalidKey:
                metrics.REQUESTS.labels("invalid").inc()
                raise
            digests = list(self.digester.candidates(key))
            seconds = (settings.generated_idempotency_retention_seconds if generated
                       else settings.idempotency_retention_seconds)
            retention = timedelta(seconds=seconds)
        found = await self.store.create(
            Scope(self.tenant, self.application, operation), digests,
            carried.fingerprint if carried is not None else fingerprint(operation, request),
            kind=operation, ttl=timedelta(seconds=request.ttl_seconds), retention=retention,
            generated=generated, cap=settings.idempotency_max_receipts_per_scope, carried=carried, driver=driver,
        )
        digest = short(digests[0]) if digests else "-"
        if found.verdict == "limit":
            metrics.LIMITED.inc()
            log.warning("%s refused: receipt limit of the scope reached [%s]", operation, digest)
            raise ReceiptLimitExceeded()
        if key is not None:
            metrics.REQUESTS.labels(_METRIC_OUTCOME[found.verdict]).inc()
        if found.verdict == "conflict":
            log.warning("%s key reused with different fields [%s]", operation, digest)
            raise IdempotencyKeyConflict()
        if found.verdict == "inactive":
            log.info("%s key's result is no longer active [%s]", operation, digest)
            raise IdempotencyResultInactive()
        log.debug("%s %s [%s]", operation, found.verdict, digest)
        return found
