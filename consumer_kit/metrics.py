"""Prometheus collectors. Labels carry source names, outcomes and reason codes: never a key."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

DELIVERIES = Counter(
    "consumer_kit_deliveries_total", "Deliveries by source and outcome.", ["source", "outcome"]
)
HANDLER_SECONDS = Histogram(
    "consumer_kit_handler_duration_seconds",
    "Time from claim to settlement decision for deliveries that ran the handler.",
    ["source"],
)
DEAD_LETTERS = Counter(
    "consumer_kit_dead_letters_total", "Deliveries parked, by source and reason.", ["source", "reason"]
)
IN_FLIGHT = Gauge("consumer_kit_in_flight", "Deliveries being processed now.", ["source"])
LEASE_TAKEOVERS = Counter(
    "consumer_kit_inbox_takeovers_total",
    "Claims that took over a lease that ran out (its holder crashed or froze), not one given back.", ["source"]
)
DELIVERY_AGE = Histogram(
    "consumer_kit_delivery_age_seconds",
    "Age of a delivery when it arrived, from its source's own send time (where the source has one).",
    ["source"], buckets=(0.1, 1, 10, 60, 600, 3600, 21600, 86400, 259200, 604800, 2592000, float("inf")),
)
LATE_DELIVERIES = Counter(
    "consumer_kit_late_deliveries_total",
    "Deliveries older than the inbox's retention, or of a key whose record was swept (a tombstone), by "
    "source and what LATE_DELIVERY_POLICY did with them (parked, processed).",
    ["source", "action"],
)
BATCH_SIZE = Histogram(
    "consumer_kit_batch_size", "Deliveries run in one transaction by batched handlers.",
    buckets=(1, 2, 4, 8, 16, 32, 48, 64),
)
BATCH_BISECTIONS = Counter(
    "consumer_kit_batch_bisections_total", "Batches whose commit failed as a whole and were halved.")
SWEPT = Counter("consumer_kit_swept_total", "Expired rows deleted by the sweeper.", ["table"])
SWEEP_FAILURES = Counter("consumer_kit_sweeper_failures_total", "Sweeper runs that failed.", ["table"])
HTTP_REJECTED = Counter(
    "consumer_kit_http_rejected_total",
    "HTTP requests refused before they became deliveries (unverified, malformed, too large), by reason.",
    ["source", "reason"],
)
HTTP_CUT_OFF = Counter(
    "consumer_kit_http_cut_off_total",
    "HTTP connections our servers closed for a request head over HTTP_MAX_HEADER_BYTES or a request not "
    "received whole within HTTP_REQUEST_TIMEOUT_SECONDS, by reason.",
    ["reason"],
)
OUTBOX_PENDING = Gauge("consumer_kit_outbox_pending", "Outbox rows not yet published.")
OUTBOX_OLDEST_AGE = Gauge(
    "consumer_kit_outbox_oldest_age_seconds", "Age of the oldest unpublished outbox row (0 when none)."
)
OUTBOX_PUBLISHED = Counter("consumer_kit_outbox_published_total", "Outbox rows published and confirmed.")
OUTBOX_FAILURES = Counter("consumer_kit_outbox_publish_failures_total", "Outbox publishes that failed.")


class SourceMetrics:
    """The labelled children of one source, looked up once: ``labels()`` takes a lock and a dict
    lookup per call, several times per delivery otherwise. ``in_flight`` is a plain count the gauge
    reads when scraped (the event loop's thread is the only writer, so it needs no lock)."""

    def __init__(self, source: str) -> None:
        self.in_flight = 0
        IN_FLIGHT.labels(source).set_function(lambda: self.in_flight)
        self.handler_seconds = HANDLER_SECONDS.labels(source)
        self.age = DELIVERY_AGE.labels(source)
        self._source = source
        self._outcomes: dict[str, Any] = {}

    def delivered(self, outcome: str) -> None:
        """Count one delivery with ``outcome``."""
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = DELIVERIES.labels(self._source, outcome)
        child.inc()
