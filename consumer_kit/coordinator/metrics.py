"""The coordinator's Prometheus collectors, under the ``caracal_idempotency_*`` names of the Caracal
coordinator whose idempotency contract ours implements, so that its dashboards read ours. No label
carries a key."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

OUTCOMES = ("created", "replayed", "conflicts", "invalid", "expired")

REQUESTS = Counter(
    "caracal_idempotency_requests",
    "Idempotent creations by outcome: created, replayed, conflicts, invalid (key), expired (inactive result).",
    ["outcome"],
)
RECEIPTS = Gauge("caracal_idempotency_receipts", "Stored idempotency receipts, at the last sweep.")
OLDEST = Gauge("caracal_idempotency_oldest_seconds", "Age of the oldest stored receipt, at the last sweep.")
LIMITED = Counter(
    "caracal_idempotency_receipt_limit_rejections", "Creations refused at IDEMPOTENCY_MAX_RECEIPTS_PER_SCOPE."
)
SWEEPER_FAILURES = Counter("caracal_idempotency_sweeper_failures", "Receipt retention-cleaner runs that failed.")
SWEPT = Counter("caracal_idempotency_swept", "Expired receipts deleted by the retention cleaner.")

for _outcome in OUTCOMES:  # export every outcome from the start, at zero
    REQUESTS.labels(_outcome)
