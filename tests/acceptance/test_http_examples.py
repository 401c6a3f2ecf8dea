"""The HTTP examples as a user runs them: ``consumer-kit run examples.x:app --port N`` under uvicorn
on a free loopback port, real HTTP with httpx, then SIGTERM and a clean exit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import TEST_HMAC_KEY
from tests.processes import stop_cleanly, wait_until_served
from tests.signing import stripe_signature

ROOT = Path(__file__).resolve().parents[2]
STRIPE_SECRET = "whsec_example_secret_for_tests"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_example(target: str, tmp_path: Path, **env: str) -> Iterator[str]:
    port = free_port()
    environment = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path}/example.db",
        "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY,
        **env,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "consumer_kit.cli", "run", target, "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_served(process, f"{base}/readyz", seconds=30)
        yield base
    finally:
        stop_cleanly(process, seconds=20)


@pytest.fixture
def stripe_example(tmp_path: Path) -> Iterator[str]:
    yield from run_example("examples.stripe_receiver:app", tmp_path, STRIPE_WEBHOOK_SECRET=STRIPE_SECRET)


@pytest.fixture
def cloudevents_example(tmp_path: Path) -> Iterator[str]:
    yield from run_example(
        "examples.cloudevents_sink:app",
        tmp_path,
        CLOUDEVENTS_TOKEN="sink-token",
        CLOUDEVENTS_ALLOWED_ORIGINS="https://sender.example",
    )


def test_stripe_receiver_under_uvicorn(stripe_example: str) -> None:
    body = json.dumps({"id": "evt_3OqLkJ2eZvKYlo2C1", "object": "event", "type": "charge.succeeded"}).encode()
    with httpx.Client(base_url=stripe_example) as client:
        first = client.post(
            "/stripe/webhooks",
            content=body,
            headers={"stripe-signature": stripe_signature(STRIPE_SECRET, body)},
        )
        retry = client.post(
            "/stripe/webhooks",
            content=body,
            headers={"stripe-signature": stripe_signature(STRIPE_SECRET, body, int(time.time()) + 5)},
        )
        forged = client.post(
            "/stripe/webhooks",
            content=body,
            headers={"stripe-signature": stripe_signature("whsec_wrong", body)},
        )
        big = client.post(
            "/stripe/webhooks", content=b"x" * 300_000, headers={"stripe-signature": "t=1,v1=0"}
        )
        metrics = client.get("/metrics").text
    assert (first.status_code, first.json()["outcome"]) == (200, "processed")
    assert (retry.status_code, retry.json()["outcome"]) == (200, "duplicate")
    assert (forged.status_code, big.status_code) == (401, 413)
    assert 'stripe_example_events_total{type="charge.succeeded"} 1.0' in metrics


def test_cloudevents_sink_under_uvicorn(cloudevents_example: str) -> None:
    headers = {
        "ce-specversion": "1.0",
        "ce-id": "ord-77",
        "ce-source": "/shop",
        "ce-type": "order.created",
        "content-type": "application/json",
        "authorization": "Bearer sink-token",
    }
    with httpx.Client(base_url=cloudevents_example) as client:
        handshake = client.options("/events", headers={"webhook-request-origin": "https://sender.example"})
        first = client.post("/events", content=b'{"order": 77}', headers=headers)
        again = client.post("/events", content=b'{"order": 77}', headers=headers)
        unauthenticated = client.post(
            "/events", content=b"{}", headers={**headers, "authorization": "Bearer x"}
        )
        metrics = client.get("/metrics").text
    assert handshake.headers["webhook-allowed-origin"] == "https://sender.example"
    assert (first.json()["outcome"], again.json()["outcome"]) == ("processed", "duplicate")
    assert unauthenticated.status_code == 401
    assert 'cloudevents_example_events_total{type="order.created"} 1.0' in metrics
