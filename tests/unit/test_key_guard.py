"""The suite-wide guard against raw keys in logs and metric labels must be able to fail."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from consumer_kit import OperationKey
from tests.conftest import _Capture, raw_keys_in


def test_guard_sees_a_logged_key(no_raw_keys_in_logs_or_metrics: _Capture) -> None:
    key = OperationKey("guard", 1, "guard-secret-id-0001")
    logging.getLogger("consumer_kit.test").info("oops %s", key)
    assert raw_keys_in(no_raw_keys_in_logs_or_metrics.texts) == [str(key)]
    no_raw_keys_in_logs_or_metrics.texts.clear()  # or the guard fails this test, as it should


def test_guard_sees_a_derived_key_in_a_label() -> None:
    key = OperationKey("guard", 1, "guard-secret-id-0002")
    derived = key.derive("carrier")
    registry = CollectorRegistry()
    Counter("guard_total", "test", ["k"], registry=registry).labels(derived).inc()
    values = [v for f in registry.collect() for s in f.samples for v in s.labels.values()]
    assert raw_keys_in(values) == sorted([derived, str(key)])  # the derived key contains the key
