"""The shipped Prometheus files, checked by ``promtool``, and a real Prometheus scraping a real worker.

A worker exports, from its start and at zero, every series it can name then (consumer_kit.metrics.declare):
so the first parked delivery is an increase Prometheus sees, and fires ``ConsumerKitDeliveriesParked``
at the next evaluation of the shipped rules. The tests that need ``promtool`` or ``prometheus`` skip
only when the binary is not installed (``.ci/run`` installs Debian's ``prometheus``, which has both).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from consumer_kit import errors, metrics
from consumer_kit.testing.server import free_port
from tests.conftest import TEST_HMAC_KEY
from tests.processes import wait_until_served

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
RULES = ROOT / "deploy/prometheus/alerts.yml"
RULE_TESTS = ROOT / "tests/data/prometheus/alerts_test.yml"
APP = "tests.acceptance.prometheus_app:app"
SOURCE, OWN_REASON_SOURCE = "webhook:prometheus-park", "webhook:prometheus-park-own"
SCHEDULE = "prometheus-hourly"  # a schedule's source name is its own
SKIP_REASONS = ("coalesced", "misfire", "too_many", "overlap")
# The reasons consumer-kit itself parks with: the pipeline's and those of the error tree's classes.
CORE_REASONS = set(metrics.PIPELINE_PARK_REASONS) | {
    error.reason for error in vars(errors).values()
    if isinstance(error, type) and issubclass(error, errors.TerminalError)}
WAIT_SECONDS = 60.0

T = TypeVar("T")


def needs(binary: str) -> str:
    """The path of ``binary``; the test is skipped, saying why, when it is not installed."""
    found = shutil.which(binary)
    if found is None:
        pytest.skip(f"{binary} is not installed (Debian: apt-get install prometheus; .ci/run does)")
    return found


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([needs("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_shipped_config_as_shipped() -> None:
    # Run from elsewhere: the rule path must resolve against the config file's folder, as in the container.
    done = subprocess.run([needs("promtool"), "check", "config", str(CONFIG)], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout


def test_promtool_accepts_the_shipped_rules() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = [rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert f"SUCCESS: {len(alerts)} rules found" in done.stdout


def test_the_rules_fire_on_the_first_event_of_a_series_exported_at_zero() -> None:
    done = promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


# ---------------------------------------------------------------------------------------------------
# A worker, and a Prometheus scraping it


@dataclass
class Worker:
    """``consumer-kit run`` of the test app, on a SQLite file, serving ``base``."""

    base: str
    port: int
    secret: str

    def send(self, path: str, delivery_id: str) -> httpx.Response:
        """A signed delivery to ``path``."""
        body = json.dumps({"id": delivery_id}).encode()
        signature = hmac.new(self.secret.encode(), body, hashlib.sha256).hexdigest()
        return httpx.post(self.base + path, content=body, timeout=10,
                          headers={"X-Signature": f"sha256={signature}", "Content-Type": "application/json"})


@pytest.fixture
def worker(sqlite_url: str) -> Iterator[Worker]:
    port, secret = free_port(), secrets.token_urlsafe(16)
    env = dict(os.environ, DATABASE_URL=sqlite_url, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY,
               PROMETHEUS_TEST_SECRET=secret, SHUTDOWN_GRACE_SECONDS="2")
    process = subprocess.Popen([sys.executable, "-m", "consumer_kit.cli", "--log-level", "WARNING", "run", APP,
                                "--host", "127.0.0.1", "--port", str(port)],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_served(process, f"http://127.0.0.1:{port}/readyz")
        yield Worker(f"http://127.0.0.1:{port}", port, secret)
    finally:
        # Not tests.processes.stop_cleanly: a parked delivery's log shows its handler's traceback.
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
    assert process.returncode == 0, output


def exposed(worker: Worker) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The worker's /metrics: each sample's value by its name and labels."""
    text = httpx.get(worker.base + "/metrics", timeout=5).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_a_started_worker_exports_its_series_at_zero_before_any_delivery(worker: Worker) -> None:
    samples = exposed(worker)
    for source in (SOURCE, OWN_REASON_SOURCE, SCHEDULE):
        for reason in CORE_REASONS:
            assert value(samples, "consumer_kit_dead_letters_total", source=source, reason=reason) == 0, reason
        assert value(samples, "consumer_kit_inbox_takeovers_total", source=source) == 0
        for action in ("parked", "processed"):
            assert value(samples, "consumer_kit_late_deliveries_total", source=source, action=action) == 0
        for outcome in ("processed", "duplicate", "dead_lettered", "conflict", "inactive", "invalid", "retry"):
            assert value(samples, "consumer_kit_deliveries_total", source=source, outcome=outcome) == 0, outcome
    for reason in SKIP_REASONS:
        assert value(samples, "consumer_kit_schedule_skipped_ticks_total", schedule=SCHEDULE,
                     reason=reason) == 0, reason
    assert value(samples, "consumer_kit_swept_total", table="inbox") == 0
    # A reason only the handler names is not known before its first park; nothing was parked.
    parked = {labels: count for (name, labels), count in samples.items() if name == "consumer_kit_dead_letters_total"}
    assert ("reason", "not_ready") not in {label for labels in parked for label in labels}
    assert set(parked.values()) == {0.0}


class Prometheus:
    """A ``prometheus`` of the test's own (free port, storage in a temporary folder) that scrapes one
    worker every second and evaluates the shipped rules every second."""

    def __init__(self, folder: Path, target: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = folder / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],  # the shipped file, unchanged
            "scrape_configs": [{"job_name": "consumer-kit-workers", "static_configs": [{"targets": [target]}]}],
        }))
        self.process = subprocess.Popen(
            [needs("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def api(self, path: str, **params: str) -> Any:
        answer = httpx.get(f"{self.base}/api/v1/{path}", params=params, timeout=5)
        answer.raise_for_status()
        return answer.json()["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def alerts(self, name: str) -> list[dict[str, Any]]:
        return [alert for alert in self.api("alerts")["alerts"] if alert["labels"]["alertname"] == name]

    def stop(self) -> str:
        self.process.terminate()
        try:
            output, _ = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
        return output


@pytest.fixture
def prometheus(worker: Worker, tmp_path: Path) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path, f"127.0.0.1:{worker.port}")
    try:
        wait_until_served(server.process, f"{server.base}/-/ready")
        yield server
    finally:
        server.stop()


def eventually(what: str, find: Callable[[], T | None], seconds: float = WAIT_SECONDS) -> T:
    """Poll ``find`` until it returns something, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        found = find()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {seconds:.0f} s")
        time.sleep(0.25)


def firing(prometheus: Prometheus, **labels: str) -> list[dict[str, Any]]:
    return [alert for alert in prometheus.alerts("ConsumerKitDeliveriesParked") if alert["state"] == "firing"
            and all(alert["labels"].get(name) == wanted for name, wanted in labels.items())]


def test_the_first_parked_delivery_fires_its_alert_in_a_real_prometheus(
        worker: Worker, prometheus: Prometheus) -> None:
    # Scraped at zero: every series the alerts of the first events read, before any delivery.
    at_zero = eventually("the worker's series scraped at 0", lambda: prometheus.query(
        f'consumer_kit_dead_letters_total{{source="{SOURCE}",reason="terminal"}} == 0'))
    assert at_zero[0]["metric"]["job"] == "consumer-kit-workers"
    for expr, count in ((f'consumer_kit_inbox_takeovers_total{{source="{SOURCE}"}} == 0', 1),
                        (f'consumer_kit_late_deliveries_total{{source="{SOURCE}"}} == 0', 2),
                        (f'consumer_kit_schedule_skipped_ticks_total{{schedule="{SCHEDULE}"}} == 0', 4)):
        assert len(prometheus.query(expr)) == count, expr
    assert prometheus.alerts("ConsumerKitDeliveriesParked") == []

    answer = worker.send("/park", "first-parked")
    assert (answer.status_code, answer.json()) == (202, {"outcome": "dead_lettered", "reason": "terminal",
                                                        "parked": True})
    started = time.monotonic()
    alert = eventually("ConsumerKitDeliveriesParked firing for the first park",
                       lambda: firing(prometheus, source=SOURCE, reason="terminal"))[0]
    assert alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["summary"] == f"{SOURCE} parked deliveries (terminal)"
    assert float(alert["value"]) >= 1
    assert time.monotonic() - started < 30  # the next scrape and evaluation, not the rule's window

    # A reason only the handler names is born with its first park: the alert still fires, for the source.
    answer = worker.send("/park-own-reason", "first-own-reason")
    assert answer.status_code == 202 and answer.json()["reason"] == "not_ready"
    alert = eventually("ConsumerKitDeliveriesParked firing for a park of the handler's own reason",
                       lambda: firing(prometheus, source=OWN_REASON_SOURCE))[0]
    assert "reason" not in alert["labels"]
    assert alert["annotations"]["summary"] == f"{OWN_REASON_SOURCE} parked deliveries"
    # Nothing else fired: no rule took the zeros of a fresh worker for an event.
    others = [a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"]
              if a["labels"]["alertname"] != "ConsumerKitDeliveriesParked"]
    assert others == []
