"""EmbeddedCoordinator: the coordinator's idempotency receipts in process, on the project's database."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

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
from consumer_kit.errors import (
    CoordinatorRejected,
    IdempotencyKeyConflict,
    IdempotencyResultInactive,
    InvalidKey,
    ReceiptLimitExceeded,
)
from consumer_kit.keys import KeyDigester, short, validate_key
from consumer_kit.settings import Settings
from consumer_kit.store.connections import Database
from consumer_kit.store.executor import Executor, Row
from consumer_kit.store.inbox import Clock, utcnow
from consumer_kit.store.receipts import Creation, Ending, Found, ReceiptStore, Scope

log = logging.getLogger("consumer_kit.coordinator")

_METRIC_OUTCOME = {"created": "created", "replayed": "replayed", "conflict": "conflicts", "inactive": "expired"}


class EmbeddedCoordinator(SessionScope):
    """Creates sessions and delegations idempotently, with receipts in ``engine``'s database.

    Receipts are scoped by ``tenant`` and ``application`` (and the operation); :meth:`scoped` gives a
    view of the same store for another scope, which is how the server serves many bearers. A call
    without a key creates without a receipt (in process there is no network retry to protect); the
    server passes ``generated_key=True`` for keys a client generated, which are kept
    ``GENERATED_IDEMPOTENCY_RETENTION_SECONDS`` instead of ``IDEMPOTENCY_RETENTION_SECONDS``.

    It implements :class:`~consumer_kit.coordinator.protocol.SessionsInTransaction`: on the inbox's own
    database a delivery's session is created with its claim and ended with its completion.
    """

    def __init__(
        self,
        engine: AsyncEngine | Database,
        settings: Settings,
        *,
        tenant: str = "local",
        application: str = "consumer-kit",
        digester: KeyDigester | None = None,
        clock: Clock = utcnow,
    ) -> None:
        self.settings = settings
        self.tenant = tenant
        self.application = application
        self.digester = digester or settings.digester()
        self._owns_database = not isinstance(engine, Database)
        self.database = engine if isinstance(engine, Database) else Database(engine)
        self.store = ReceiptStore(self.database, clock=clock)

    async def close(self) -> None:
        """Close the connections this coordinator opened of its own (given an engine, not a
        ``Database``); the engine stays the caller's to dispose of."""
        if self._owns_database:
            await self.database.close()

    async def open(self) -> None:
        """Prepare this coordinator's scope in the store (the receipt counts of its sessions and
        delegations), so that its first creations need no set-up of their own. Optional; idempotent."""
        for operation in ("session", "delegation"):
            await self.store.open_scope(Scope(self.tenant, self.application, operation))

    def scoped(self, tenant: str, application: str) -> EmbeddedCoordinator:
        """The same coordinator acting for another tenant and application: on this one's connections
        (given as a ``Database``, which it does not own and so does not close)."""
        return EmbeddedCoordinator(self.database, self.settings, tenant=tenant, application=application,
                                   digester=self.digester, clock=self.store.clock)

    async def create_session(
        self, request: SessionRequest, *, idempotency_key: str | None = None, generated_key: bool = False
    ) -> SessionReceipt:
        """See :meth:`Coordinator.create_session`."""
        async with self.database.connect() as ex:
            found = await self.create_on(ex, "session", request, idempotency_key, generated_key)
        return _session_receipt(found)

    async def create_delegation(
        self, request: DelegationRequest, *, idempotency_key: str | None = None, generated_key: bool = False
    ) -> DelegationReceipt:
        """See :meth:`Coordinator.create_delegation`. ``request.from_session_id`` must be an active
        session of this tenant and application: ``CoordinatorRejected(404, "session_not_found")``
        otherwise, or ``(409, "session_inactive")`` once it ended, expired or was revoked; a replay whose
        session is no longer active is :class:`IdempotencyResultInactive` (an identity that can no longer
        be used is never replayed)."""
        async with self.database.connect() as ex:
            await self._check_delegation_source(ex, request, idempotency_key)
            found = await self.create_on(ex, "delegation", request, idempotency_key, generated_key)
        assert found.expires_at is not None
        return DelegationReceipt(found.resource_id, found.status, found.expires_at,
                                 replayed=found.verdict == "replayed")

    async def _check_delegation_source(self, ex: Executor, request: DelegationRequest, key: str | None) -> None:
        digests: Sequence[str] = ()
        if key is not None:
            try:
                digests = self.digester.candidates(validate_key(key))
            except InvalidKey:
                return  # refused (and counted) by create_on
        store, now = self.store, self.store.clock()
        session = await store.resource(ex, self.tenant, self.application, request.from_session_id)
        if session is not None and session["kind"] != "session":
            session = None  # a delegation is no source: the same answer as an unknown id
        active = session is not None and session["status"] == "active" and session["resource_expires_at"] > now
        receipt = await store.receipt(ex, Scope(self.tenant, self.application, "delegation"), digests) \
            if digests else None
        if receipt is not None:  # a replay or a conflict: the receipt's verdict, unless the session is gone
            if not active and receipt["fingerprint"] == fingerprint("delegation", request):
                metrics.REQUESTS.labels(_METRIC_OUTCOME["inactive"]).inc()
                log.info("delegation key's session is no longer active [%s]", short(digests[0]))
                raise IdempotencyResultInactive()
            return
        if session is None:  # no such session, or another tenant's or application's: the same answer
            raise CoordinatorRejected(404, "session_not_found")
        if not active:
            raise CoordinatorRejected(409, "session_inactive")

    async def end_session(self, session_id: str) -> None:
        """See :meth:`Coordinator.end_session`; an unknown id is ``CoordinatorRejected(404)``."""
        await self._set_status(session_id, "ended")

    async def revoke_session(self, session_id: str) -> None:
        """See :meth:`Coordinator.revoke_session`; an unknown id is ``CoordinatorRejected(404)``."""
        await self._set_status(session_id, "revoked")

    def session_step(self, database: Database) -> _SessionStep | None:
        """See :class:`~consumer_kit.coordinator.protocol.SessionsInTransaction`: a step when the
        receipts live in ``database``'s engine."""
        return _SessionStep(self) if database.engine is self.database.engine else None

    async def sweep(self) -> int:
        """Delete expired receipts and resources in batches, then refresh the gauges."""
        try:
            cap = self.settings.idempotency_max_receipts_per_scope
            swept = await self.store.sweep(batch_size=self.settings.sweep_batch_size)
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
        async with self.database.connect() as ex:
            known = await self.store.set_status(ex, self.tenant, self.application, resource_id, status)
        if not known:
            raise CoordinatorRejected(404, "session_not_found")

    async def create_on(
        self, ex: Executor, operation: Operation, request: SessionRequest | DelegationRequest, key: str | None,
        generated: bool, *, carried: tuple[Creation, Row] | None = None,
    ) -> Found:
        settings = self.settings
        digests: list[str] = []
        retention: timedelta | None = None
        if carried is not None:  # validated and digested when it was prepared
            digests = [carried[0].digest]
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
            ex, Scope(self.tenant, self.application, operation), digests,
            carried[0].fingerprint if carried is not None else fingerprint(operation, request),
            kind=operation, ttl=timedelta(seconds=request.ttl_seconds), retention=retention,
            generated=generated, cap=settings.idempotency_max_receipts_per_scope, carried=carried,
        )
        digest = short(digests[0]) if digests else "-"
        if found.verdict == "limit":
            metrics.LIMITED.inc()
            log.warning("%s refused: receipt limit of the scope reached [%s]", operation, digest)
            raise ReceiptLimitExceeded()
        if digests:
            metrics.REQUESTS.labels(_METRIC_OUTCOME[found.verdict]).inc()
        if found.verdict == "conflict":
            log.warning("%s key reused with different fields [%s]", operation, digest)
            raise IdempotencyKeyConflict()
        if found.verdict == "inactive":
            log.info("%s key's result is no longer active [%s]", operation, digest)
            raise IdempotencyResultInactive()
        log.debug("%s %s [%s]", operation, found.verdict, digest)
        return found


class _SessionStep:
    """:class:`~consumer_kit.coordinator.protocol.SessionStep` of an embedded coordinator."""

    def __init__(self, coordinator: EmbeddedCoordinator) -> None:
        self.coordinator = coordinator
        # Not on the partitioned inbox, whose claim carries no creation (yet): open() makes it on its own.
        self._rides = coordinator.database.can.writes_in_claim and not coordinator.settings.inbox_partition_seconds

    def prepare(self, request: SessionRequest, *, idempotency_key: str,
                request_fingerprint: str | None = None) -> Creation | None:
        """PostgreSQL: the creation's statement parts, to be carried by the claim's statement. ``None`` on
        SQLite, during an HMAC key rotation, or for an invalid key (:meth:`open` then does all the work,
        and reports)."""
        coordinator = self.coordinator
        if not self._rides:
            return None
        try:
            validate_key(idempotency_key)
        except InvalidKey:
            return None
        digests = coordinator.digester.candidates(idempotency_key)
        if len(digests) != 1:
            return None
        settings = coordinator.settings
        return coordinator.store.prepare(
            Scope(coordinator.tenant, coordinator.application, "session"), digests[0],
            request_fingerprint or fingerprint("session", request), kind="session",
            ttl=timedelta(seconds=request.ttl_seconds),
            retention=timedelta(seconds=settings.idempotency_retention_seconds), generated=False,
            cap=settings.idempotency_max_receipts_per_scope)

    async def open(self, ex: Executor, request: SessionRequest, *, idempotency_key: str,
                   carried: tuple[Creation, Row] | None) -> SessionReceipt:
        found = await self.coordinator.create_on(ex, "session", request, idempotency_key, False, carried=carried)
        return _session_receipt(found)

    def ending(self, session_id: str) -> Ending:
        return self.coordinator.store.ending(self.coordinator.tenant, self.coordinator.application, session_id)

    async def end(self, ex: Executor, ending: Ending, session_id: str) -> bool:
        if ending.ended:
            return True
        coordinator = self.coordinator
        return await coordinator.store.set_status(ex, coordinator.tenant, coordinator.application, session_id,
                                                  "ended")


def _session_receipt(found: Found) -> SessionReceipt:
    assert found.expires_at is not None
    return SessionReceipt(found.resource_id, found.status, found.expires_at, replayed=found.verdict == "replayed")
