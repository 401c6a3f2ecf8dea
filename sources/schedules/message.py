"""A schedule's message reader: a tick becomes the delivery a handler gets (:func:`tick_delivery`, a
:class:`ScheduleDelivery`), and a parked tick's delivery tells which tick it was (:func:`tick_of`).

The delivery id, and so the key, is the tick's intended instant as UTC ISO 8601 with a ``Z``; the body
(the schedule's name and version, and the tick) is the same on every replica and every attempt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from consumer_kit.delivery import Delivery
from consumer_kit.errors import MissingStableId
from consumer_kit.sources.schedules import timing


@dataclass(frozen=True, slots=True)
class ScheduleDelivery(Delivery):
    """A tick, as the handler gets it (``ctx.delivery``): ``scheduled_for`` is the intended fire instant
    (the key's id), ``late_by`` how long after it this attempt was dispatched. Neither is part of the
    fingerprint; the body (the schedule's name and version, and the tick) is the same on every replica
    and every attempt."""

    scheduled_for: datetime = datetime(1970, 1, 1, tzinfo=UTC)
    late_by: timedelta = timedelta(0)


def tick_delivery(name: str, version: int, tick: datetime, now: datetime) -> ScheduleDelivery:
    """The delivery of ``tick`` of schedule ``name`` (``version``), dispatched at ``now``."""
    scheduled = timing.key_id(tick)
    body = json.dumps({"schedule": name, "version": version, "scheduled_for": scheduled},
                      separators=(",", ":")).encode()
    return ScheduleDelivery(id=scheduled, body=body, headers={"content-type": "application/json"},
                            scheduled_for=tick, late_by=max(now - tick, timedelta(0)))


def tick_of(delivery: Delivery) -> datetime:
    """The tick a (parked) delivery of a schedule was; MissingStableId when its id is no tick."""
    try:
        return datetime.strptime(delivery.id or "", "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        raise MissingStableId("the parked delivery is not a tick of this schedule") from None
