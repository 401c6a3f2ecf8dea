"""The coordinator seam: requests, receipts, the protocol, and the request fingerprint.

A request carries every field the coordinator's idempotency contract calls security-relevant;
:func:`fingerprint` reduces them to one canonical digest, so "the same request" means the same thing
in process, on the server and in tests. Set-like fields (labels, scopes) compare order-insensitively;
mappings are serialised with sorted keys and no insignificant whitespace.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from consumer_kit.store.connections import Database
    from consumer_kit.store.executor import Executor, Row
    from consumer_kit.store.receipts import Creation, Ending

Operation = Literal["session", "delegation"]


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def canonical(self) -> dict[str, Any]:
        """The fields as compared: set-like fields sorted and de-duplicated."""
        data = self.model_dump(mode="json")
        for name in ("labels", "scopes"):
            if name in data:
                data[name] = sorted(set(data[name]))
        return data


class SessionRequest(_Request):
    """A session to create: the coordinator's record of one task an agent may carry out (its subject,
    labels, task, authority and lifetime). Every field is security-relevant: reusing a key with any of
    them changed is an ``idempotency_key_conflict``."""

    subject: str | None = Field(None, max_length=255, description="The subject authority record id.")
    parent_session_id: str | None = Field(None, max_length=255)
    lifecycle: str = Field("ephemeral", max_length=64)
    labels: tuple[str, ...] = ()
    task: str | None = Field(None, max_length=4096)
    metadata: dict[str, Any] = Field(default_factory=dict)
    authority_mode: str | None = Field(None, max_length=64)
    ttl_seconds: int = Field(3600, gt=0, le=30 * 86_400)
    resource: str | None = Field(None, max_length=2048)
    scopes: tuple[str, ...] = ()
    constraints: dict[str, Any] = Field(default_factory=dict)
    invocation_parameters: dict[str, Any] = Field(default_factory=dict)


class DelegationRequest(_Request):
    """A delegation from a session to a subject; its endpoints and grants are security-relevant."""

    from_session_id: str = Field(..., max_length=255)
    to_subject: str = Field(..., max_length=255)
    authority_mode: str | None = Field(None, max_length=64)
    ttl_seconds: int = Field(3600, gt=0, le=30 * 86_400)
    resource: str | None = Field(None, max_length=2048)
    scopes: tuple[str, ...] = ()
    constraints: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


def fingerprint(operation: Operation, request: SessionRequest | DelegationRequest) -> str:
    """SHA-256 hex over the canonical JSON of ``request`` and the operation it is for."""
    canonical = json.dumps(
        {"operation": operation, "request": request.canonical()},
        sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def generate_key() -> str:
    """A fresh operation id of 128 random bits, for one logical call and all its retries."""
    return secrets.token_urlsafe(16)


@dataclass(frozen=True, slots=True)
class SessionReceipt:
    """The coordinator's answer to a session creation. ``replayed`` is true when the key had already
    created this session and the original response was returned."""

    session_id: str
    status: str
    expires_at: datetime
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class DelegationReceipt:
    """The coordinator's answer to a delegation creation; ``replayed`` as for sessions."""

    delegation_id: str
    status: str
    expires_at: datetime
    replayed: bool = False


@runtime_checkable
class Coordinator(Protocol):
    """What creates sessions and delegations, idempotently under an optional key."""

    async def create_session(
        self, request: SessionRequest, *, idempotency_key: str | None = None
    ) -> SessionReceipt:
        """Create a session, or replay the one this key created. 409 ``idempotency_key_conflict`` when
        the key came with other fields, 409 ``idempotency_result_inactive`` when its session ended."""
        ...

    async def end_session(self, session_id: str) -> None:
        """End a session (idempotent). A later replay of its key is ``idempotency_result_inactive``."""
        ...

    async def revoke_session(self, session_id: str) -> None:
        """Revoke a session (idempotent)."""
        ...

    async def create_delegation(
        self, request: DelegationRequest, *, idempotency_key: str | None = None
    ) -> DelegationReceipt:
        """Create a delegation, or replay the one this key created."""
        ...

    def session(
        self, *, idempotency_key: str | None = None, **fields: Any
    ) -> contextlib.AbstractAsyncContextManager[SessionReceipt]:
        """Create (or replay) a session from ``fields``, yield its receipt, end it on a clean exit."""
        ...


class SessionScope(abc.ABC):
    """The ``session(...)`` context manager, for any class with ``create_session`` and ``end_session``.

    On an exception inside the block the session is left active: a retry of the same work replays it
    (a replay of an active session still enters the block), and it expires at its TTL.
    """

    @abc.abstractmethod
    async def create_session(
        self, request: SessionRequest, *, idempotency_key: str | None = None
    ) -> SessionReceipt:
        """Create (or replay) a session; see :class:`Coordinator`."""

    @abc.abstractmethod
    async def end_session(self, session_id: str) -> None:
        """End a session; see :class:`Coordinator`."""

    @contextlib.asynccontextmanager
    async def session(self, *, idempotency_key: str | None = None, **fields: Any) -> AsyncIterator[SessionReceipt]:
        """See :meth:`Coordinator.session`."""
        receipt = await self.create_session(SessionRequest(**fields), idempotency_key=idempotency_key)
        yield receipt
        await self.end_session(receipt.session_id)


class SessionStep(Protocol):
    """A coordinator's sessions kept in the inbox's own database, seen from the pipeline.

    The session of a delivery is created in the statement that claims it (:meth:`prepare`: only when
    the claim takes the lease) and ended in the transaction that completes it (:meth:`ending`, then
    :meth:`end`): the session ends if and only if the delivery's effect commits.
    """

    def prepare(self, request: SessionRequest, *, idempotency_key: str,
                request_fingerprint: str | None = None) -> Creation | None:
        """A creation to carry on the delivery's claim (written by the claim's own statement); ``None``
        when it cannot be carried (:meth:`open` then makes the whole creation)."""
        ...

    async def open(self, ex: Executor, request: SessionRequest, *, idempotency_key: str,
                   carried: tuple[Creation, Row] | None) -> SessionReceipt:
        """The session of a claimed delivery: what a carried creation did, or the creation now on
        ``ex`` (outside a transaction). Raises as :meth:`Coordinator.create_session` does."""
        ...

    def ending(self, session_id: str) -> Ending:
        """The session's ending, to carry on the delivery's completion."""
        ...

    async def end(self, ex: Executor, ending: Ending, session_id: str) -> bool:
        """Inside the delivery's transaction, after the completion: whether the session ended (the
        completion carried the ending, or it is ended now); ``False`` when no such session exists."""
        ...


@runtime_checkable
class SessionsInTransaction(Protocol):
    """An optional protocol: a coordinator that can create and end sessions inside a delivery's
    transaction, when the delivery's database is its own. The pipeline asks once, at start."""

    def session_step(self, database: Database) -> SessionStep | None:
        """The step for deliveries on ``database``, or ``None`` when this coordinator's sessions live
        elsewhere (the pipeline then creates them before the handler and ends them after the commit)."""
        ...


@runtime_checkable
class CoordinatorLifecycle(Protocol):
    """An optional protocol: a coordinator with work of its own over the app's life. The app calls
    :meth:`open` as it starts (when a handler asks for sessions), :meth:`sweep` with each sweep of the
    inbox, and :meth:`close` as it stops (only a coordinator it made itself: one a user passes in
    stays the user's to close)."""

    async def open(self) -> None:
        """Get ready for the first creations (idempotent)."""
        ...

    async def sweep(self) -> int:
        """Delete what this coordinator keeps past its retention; how many records went."""
        ...

    async def close(self) -> None:
        """Release what this coordinator opened of its own."""
        ...
