"""The coordinator: creates sessions (its record of one task an agent may carry out) and delegations,
idempotently: a retried creation under the same key is replayed, not made again.

``Coordinator`` is the protocol; ``EmbeddedCoordinator`` implements it in process on the project's
database (the default), ``HttpCoordinator`` speaks the wire protocol to ``consumer-kit coordinator
serve`` (``consumer_kit.coordinator.server``, which needs the ``coordinator`` extra).
"""

from consumer_kit.coordinator.embedded import EmbeddedCoordinator
from consumer_kit.coordinator.http import HttpCoordinator, TokenRefresher
from consumer_kit.coordinator.protocol import (
    Coordinator,
    DelegationReceipt,
    DelegationRequest,
    SessionReceipt,
    SessionRequest,
    fingerprint,
    generate_key,
)
from consumer_kit.errors import (
    CoordinatorRejected,
    CoordinatorUnavailable,
    IdempotencyKeyConflict,
    IdempotencyResultInactive,
    ReceiptLimitExceeded,
)

__all__ = [
    "Coordinator",
    "CoordinatorRejected",
    "CoordinatorUnavailable",
    "DelegationReceipt",
    "DelegationRequest",
    "EmbeddedCoordinator",
    "HttpCoordinator",
    "IdempotencyKeyConflict",
    "IdempotencyResultInactive",
    "ReceiptLimitExceeded",
    "SessionReceipt",
    "SessionRequest",
    "TokenRefresher",
    "fingerprint",
    "generate_key",
]
