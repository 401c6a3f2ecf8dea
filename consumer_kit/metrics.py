"""Prometheus collectors. Labels carry source names, outcomes and reason codes: never a key."""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString  # the library's own `le` format, so that ours match it

DEAD_LETTERS = Counter(
    "consumer_kit_dead_letters_total", "Deliveries parked, by source and reason.", ["source", "reason"]
)
IN_FLIGHT = Gauge("consumer_kit_in_flight", "Deliveries being processed now.", ["source"])
LEASE_TAKEOVERS = Counter(
    "consumer_kit_inbox_takeovers_total",
    "Claims that took over a lease that ran out (its holder crashed or froze), not one given back.", ["source"]
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


# The per-delivery series (deliveries, handler duration, delivery age) are counted by the pipeline in
# plain Python and turned into samples when scraped (PerDelivery): prometheus_client's Counter.inc and
# Histogram.observe take a lock each and search the buckets in Python, ~200 bytecodes a delivery, where
# an int in a dict and a bisect are ~20. The event loop's thread is the only writer; a scrape copies.
_DELIVERIES = ("consumer_kit_deliveries", "Deliveries by source and outcome.")
_HANDLER_SECONDS = ("consumer_kit_handler_duration_seconds",
                    "Time from claim to settlement decision for deliveries that ran the handler.")
_HANDLER_BUCKETS = (.005, .01, .025, .05, .075, .1, .25, .5, .75, 1.0, 2.5, 5.0, 7.5, 10.0, math.inf)  # the library's
_DELIVERY_AGE = ("consumer_kit_delivery_age_seconds",
                 "Age of a delivery when it arrived, from its source's own send time (where the source has one).")
_AGE_BUCKETS = (0.1, 1, 10, 60, 600, 3600, 21600, 86400, 259200, 604800, 2592000, math.inf)


class Buckets:
    """One histogram series: ``observe`` counts a value in the first bucket whose bound is at least it
    (Prometheus' ``le``); the scrape makes the counts cumulative."""

    __slots__ = ("bounds", "counts", "created", "les", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.les = [floatToGoString(bound) for bound in bounds]  # type: ignore[no-untyped-call]
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add_to(self, family: HistogramMetricFamily, source: str) -> None:
        """Add this series, labelled with its ``source``, to ``family``."""
        counts, total, cumulative = list(self.counts), self.sum, 0
        buckets = []
        for le, count in zip(self.les, counts, strict=True):
            cumulative += count
            buckets.append((le, float(cumulative)))
        family.add_metric([source], buckets, total)
        family.add_sample(f"{family.name}_created", {"source": source}, self.created)


class SourceMetrics:
    """What the pipeline counts of one source's deliveries, shared by every pipeline of that source
    (:func:`for_source`). ``in_flight`` is a plain count the gauge reads when scraped."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.in_flight = 0
        IN_FLIGHT.labels(source).set_function(lambda: self.in_flight)
        self.handler_seconds = Buckets(_HANDLER_BUCKETS)
        self.age = Buckets(_AGE_BUCKETS)
        self.outcomes: dict[str, int] = {}
        self.created: dict[str, float] = {}

    def delivered(self, outcome: str) -> None:
        """Count one delivery with ``outcome``."""
        outcomes = self.outcomes
        if outcome in outcomes:
            outcomes[outcome] += 1
        else:
            self.created[outcome] = time.time()
            outcomes[outcome] = 1


class PerDelivery(Collector):
    """The samples of every source's :class:`SourceMetrics`, made at scrape time."""

    def __init__(self) -> None:
        self.sources: dict[str, SourceMetrics] = {}

    def collect(self) -> Iterator[Metric]:
        deliveries = CounterMetricFamily(*_DELIVERIES, labels=["source", "outcome"])
        handler_seconds = HistogramMetricFamily(*_HANDLER_SECONDS, labels=["source"])
        age = HistogramMetricFamily(*_DELIVERY_AGE, labels=["source"])
        for source, counted in list(self.sources.items()):
            created = dict(counted.created)
            for outcome, count in list(counted.outcomes.items()):
                deliveries.add_metric([source, str(outcome)], count, created=created.get(outcome))
            counted.handler_seconds.add_to(handler_seconds, source)
            counted.age.add_to(age, source)
        yield from (deliveries, handler_seconds, age)


PER_DELIVERY = PerDelivery()
REGISTRY.register(PER_DELIVERY)


def for_source(source: str) -> SourceMetrics:
    """The counts of ``source``'s deliveries (one set per source name in the process, as labelled
    series are)."""
    counted = PER_DELIVERY.sources.get(source)
    if counted is None:
        counted = PER_DELIVERY.sources[source] = SourceMetrics(source)
    return counted
