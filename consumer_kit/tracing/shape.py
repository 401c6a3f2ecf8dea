"""How a source's deliveries look as spans (a value a source declares, with no OpenTelemetry in it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class SpanShape:
    """How a source's deliveries look as spans; a source declares it as its ``span_shape`` attribute
    (optional: a source without one is traced ``internal``, with no messaging attributes).

    ``kind`` is the span kind (``consumer`` for queues, ``server`` for HTTP sources, ``internal``),
    ``system`` the ``messaging.system`` (``rabbitmq``, ``aws_sqs``), ``destination`` the
    ``messaging.destination.name`` (the queue), and ``attributes`` any others (``http.route``).
    """

    kind: Literal["consumer", "server", "internal"] = "internal"
    system: str | None = None
    destination: str | None = None
    attributes: Mapping[str, str] = field(default_factory=dict)


INTERNAL = SpanShape()
