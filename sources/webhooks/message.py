"""A webhook's message reader: a request's headers and raw body, checked by the source's verifier
(:mod:`.verifiers`), become the :class:`~consumer_kit.delivery.Delivery` the pipeline keys by the
provider's stable id (:func:`to_delivery`)."""

from __future__ import annotations

from collections.abc import Mapping

from consumer_kit.delivery import Delivery
from consumer_kit.errors import TerminalError
from consumer_kit.sources.webhooks.verifiers import Verifier


def to_delivery(verifier: Verifier, headers: Mapping[str, str], body: bytes) -> Delivery:
    """The delivery of a verified request; the verifier raises for a malformed or unauthenticated one
    (answered 400 or 401, neither parked nor run). A verified request without a stable id is a
    delivery without one, which the pipeline parks."""
    attributes = verifier.verify(headers, body)
    try:
        stable_id: str | None = verifier.stable_id(headers, body)
    except TerminalError:
        stable_id = None  # the source's key() raises the same error inside the pipeline, which parks it
    return Delivery(id=stable_id, body=body, headers=headers, attributes=attributes)
