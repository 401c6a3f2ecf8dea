"""One delivery in flight (:class:`Work`): what the pipeline knows of it, filled in as it goes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from consumer_kit.delivery import Delivery, Outcome
from consumer_kit.keys import OperationKey, short
from consumer_kit.pipeline.spec import HandlerSpec
from consumer_kit.store import Claim, Executor

if TYPE_CHECKING:
    from consumer_kit.coordinator.protocol import SessionReceipt, SessionRequest
    from consumer_kit.tracing.spans import DeliveryTrace

log = logging.getLogger("consumer_kit.pipeline")

PROCESSED = Outcome.PROCESSED.value
"""The stored outcome of a delivery whose handler's effect committed (``Outcome.PROCESSED.value`` is an
enum property lookup, on every delivery)."""

TAKEN = frozenset({Outcome.DUPLICATE, Outcome.IN_PROGRESS, Outcome.CONFLICT})
"""Outcomes of a delivery whose claim found its key taken."""


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

    def log(self, level: int, message: str, traceback: str | None = None) -> None:
        """Log with the key's namespace and digest, never the key itself; ``traceback`` (redacted) on
        the lines after the message, in the same record (not as ``exc_info``, which a formatter would
        print unredacted)."""
        if not log.isEnabledFor(level):  # most deliveries log at DEBUG: build nothing for them
            return
        log.log(level, "%s [%s:v%d %s]%s", message, self.key.namespace, self.key.version, self.digest,
                "" if traceback is None else "\n" + traceback.rstrip("\n"),
                extra={"namespace": self.key.namespace, "key_digest": self.digest})
