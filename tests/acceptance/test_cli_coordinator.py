"""The `consumer-kit` command run as a user runs it: the demo, and the coordinator server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from consumer_kit.testing.server import free_port

CLI = [sys.executable, "-m", "consumer_kit.cli"]


def test_demo_runs_the_recipe_and_exits_zero(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("409 idempotency_key_conflict", "409 idempotency_result_inactive", "replayed",
                 "1 effect, all acked", "OK: retries are harmless"):
        assert line in done.stdout
    assert " NO" not in done.stdout


def test_coordinator_serve(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path}/coordinator.db",
           "IDEMPOTENCY_HMAC_KEY": "acceptance-hmac-key-0123456789",
           "COORDINATOR_TOKENS": json.dumps({"secret-token": "acme/tickets"})}
    server = subprocess.Popen([*CLI, "coordinator", "serve", "--port", str(port)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.1)
        headers = {"Authorization": "Bearer secret-token", "Idempotency-Key": "ticket-queue:v1:m-1"}
        first = httpx.post(f"{base}/v1/sessions", json={"task": "t"}, headers=headers)
        again = httpx.post(f"{base}/v1/sessions", json={"task": "t"}, headers=headers)
        assert first.status_code == again.status_code == 201
        assert again.headers["Idempotency-Replayed"] == "true" and again.json() == first.json()
        assert httpx.post(f"{base}/v1/sessions", json={}, headers={"Authorization": "Bearer x"}).status_code == 401
    finally:
        server.send_signal(signal.SIGTERM)
        output, _ = server.communicate(timeout=30)
    # A graceful stop on SIGTERM is a clean exit, as for `consumer-kit run`.
    assert server.returncode == 0, output
    assert "Traceback" not in output
    assert "secret-token" not in output and "ticket-queue:v1:m-1" not in output
