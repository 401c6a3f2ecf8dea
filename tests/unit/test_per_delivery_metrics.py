"""The per-delivery series are counted in plain Python and exposed at scrape time: they expose what
prometheus_client's own Counter and Histogram would for the same deliveries."""

from __future__ import annotations

import secrets

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from consumer_kit import metrics

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(registry: CollectorRegistry, family: str, source: str) -> Series:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in registry.collect() if metric.name == family
            for s in metric.samples if s.labels.get("source") == source and not s.name.endswith("_created")}


def test_the_series_match_prometheus_clients_own_for_the_same_observations() -> None:
    source = f"src-{secrets.token_hex(4)}"
    counted = metrics.for_source(source)
    assert metrics.for_source(source) is counted  # one set per source name, shared by every pipeline
    reference = CollectorRegistry()
    deliveries = Counter("consumer_kit_deliveries", "d", ["source", "outcome"], registry=reference)
    handler = Histogram("consumer_kit_handler_duration_seconds", "h", ["source"], registry=reference)
    age = Histogram("consumer_kit_delivery_age_seconds", "a", ["source"], registry=reference,
                    buckets=(0.1, 1, 10, 60, 600, 3600, 21600, 86400, 259200, 604800, 2592000, float("inf")))
    handler.labels(source)
    age.labels(source)
    # On the bounds too: a value equal to a bound falls in that bucket (le), as in Prometheus.
    for seconds in (0.0, 0.004, 0.005, 0.0051, 0.3, 0.75, 9.9, 10.0, 11.0, 1e9):
        counted.handler_seconds.observe(seconds)
        handler.labels(source).observe(seconds)
    for seconds in (0.1, 61.0, 2592000.0, 3e6):
        counted.age.observe(seconds)
        age.labels(source).observe(seconds)
    for outcome in ("processed", "processed", "duplicate", "retry"):
        counted.delivered(outcome)
        deliveries.labels(source, outcome).inc()
    for family in ("consumer_kit_deliveries", "consumer_kit_handler_duration_seconds",
                   "consumer_kit_delivery_age_seconds"):
        ours = samples(REGISTRY, family, source)
        assert ours == samples(reference, family, source), family
        assert ours  # the family is there, with this source's series
    assert REGISTRY.get_sample_value("consumer_kit_deliveries_total", {"source": source, "outcome": "processed"}) == 2
    assert REGISTRY.get_sample_value("consumer_kit_handler_duration_seconds_count", {"source": source}) == 10
    assert REGISTRY.get_sample_value("consumer_kit_deliveries_created",
                                     {"source": source, "outcome": "retry"}) is not None
