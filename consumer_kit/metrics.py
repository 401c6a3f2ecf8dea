"""Prometheus collectors. Labels carry source names, outcomes and reason codes: never a key.

A labelled series exists only once it is first counted, and Prometheus' ``increase()`` needs two samples
of a series to see it grow: a series born at 1 shows no increase, so its first event fires no alert.
:func:`declare` therefore makes, when the app starts, every series a worker can name then, at zero.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString  # the library's own `le` format, so that ours match it

from consumer_kit.delivery import Outcome, Source
from consumer_kit.errors import TerminalError

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
IDEMPOTENT_REQUESTS = Counter(
    "consumer_kit_http_idempotent_requests_total",
    "Requests to idempotent endpoints (an Idempotency-Key route), by endpoint name and outcome: processed,"
    " replayed, in_progress, key_reused, key_missing, key_malformed, key_repeated, key_expired, failed,"
    " too_large, timed_out, lease_lost, invalid_request, unavailable.",
    ["endpoint", "outcome"],
)
IDEMPOTENT_SECONDS = Histogram(
    "consumer_kit_http_idempotent_seconds",
    "Time from the claim of a key to its stored response, for requests that ran their route.", ["endpoint"],
)
IDEMPOTENT_OUTCOMES = ("processed", "replayed", "in_progress", "key_reused", "key_missing", "key_malformed",
                       "key_repeated", "key_expired", "failed", "too_large", "timed_out", "lease_lost",
                       "invalid_request", "unavailable")
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

    def declare(self, outcomes: Iterable[str]) -> None:
        """Export ``outcomes`` from now on, at zero until counted (a count already made is kept)."""
        for outcome in outcomes:
            if outcome not in self.outcomes:
                self.created[outcome] = time.time()
                self.outcomes[outcome] = 0

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


# The label values a worker can name when it starts (see declare). The reasons the pipeline parks with
# by name; the others are the ``reason`` of each TerminalError class (park_reasons). A unit test reads the
# code for every reason it parks with and finds each here or on an error class.
PIPELINE_PARK_REASONS = ("arrived_after_retention", "conflict", "handler_misconfigured", "invalid_session_request",
                         "retries_exhausted")
LATE_ACTIONS = ("parked", "processed")
# Outcome's values, and what a batch's delivery counts when the loop closes under it.
OUTCOMES = (*(outcome.value for outcome in Outcome), "cancelled")
SWEPT_TABLES = ("inbox",)
# Why our HTTP server closes a connection (consumer_kit.http.server): every worker with a port has one.
CUT_OFF_REASONS = ("request_header_too_large", "request_timeout")


@runtime_checkable
class DeclaresMetrics(Protocol):
    """A source with series of its own (an SQS source's settlements, a schedule's skipped ticks): it
    makes each of them, at zero, when :func:`declare` asks."""

    def declare_metrics(self) -> None:
        """Make every series of this source that can be named now, at zero."""


def park_reasons() -> list[str]:
    """Every reason a delivery can be parked with that is known now: the pipeline's own, and the
    ``reason`` of :class:`~consumer_kit.errors.TerminalError` and of each of its subclasses imported
    so far (the sources' and the app's own included). A reason a handler passes only as
    ``TerminalError(reason=...)`` is not known before its first park."""
    found, classes = set(PIPELINE_PARK_REASONS), [TerminalError]
    while classes:
        error = classes.pop()
        if isinstance(error.reason, str):
            found.add(error.reason)
        classes.extend(error.__subclasses__())
    return sorted(found)


def declare(sources: Iterable[Source]) -> None:
    """Make every series of these sources that can be named now, at zero, so that ``increase()`` sees
    the first parked delivery, takeover, late delivery or skipped tick; the app calls it as it starts.
    Counts already made are kept, so calling it again is harmless."""
    reasons = park_reasons()
    for table in SWEPT_TABLES:
        SWEPT.labels(table)
        SWEEP_FAILURES.labels(table)
    for cut_off in CUT_OFF_REASONS:
        HTTP_CUT_OFF.labels(cut_off)
    for source in sources:
        name = source.name
        for_source(name).declare(OUTCOMES)
        LEASE_TAKEOVERS.labels(name)
        for reason in reasons:
            DEAD_LETTERS.labels(name, reason)
        for action in LATE_ACTIONS:
            LATE_DELIVERIES.labels(name, action)
        if isinstance(source, DeclaresMetrics):
            source.declare_metrics()
