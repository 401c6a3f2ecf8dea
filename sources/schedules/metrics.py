"""The schedules' Prometheus collectors. Labels carry schedule names and reasons: never a key."""

from __future__ import annotations

from prometheus_client import Counter

SKIPPED = Counter(
    "consumer_kit_schedule_skipped_ticks_total",
    "Schedule ticks skipped, by schedule and reason (coalesced, misfire, too_many, overlap); each tick is "
    "counted once, by the replica that decided it.",
    ["schedule", "reason"],
)
