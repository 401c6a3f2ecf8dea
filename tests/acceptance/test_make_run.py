"""``make run`` on a machine with no secrets configured: the starter worker (examples/starter.py) on the
embedded defaults prints a curl command; the delivery it sends is processed once, and sent again it
is answered as a duplicate."""

from __future__ import annotations

import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from consumer_kit.testing.server import free_port
from tests.processes import wait_until_served

ROOT = Path(__file__).resolve().parents[2]
# Nothing that configures consumer-kit or the example is passed on: a fresh machine has none of it.
CONFIGURATION = re.compile(r"^(IDEMPOTENCY_|COORDINATOR_|STARTER_|RABBITMQ_|DATABASE_URL$)")


def request_of(command: str) -> tuple[str, dict[str, str], bytes]:
    """The URL, headers and body of a printed ``curl -s URL -H 'Name: value' ... --data-raw BODY``."""
    words = shlex.split(command)
    assert words[:2] == ["curl", "-s"], command
    url, headers, body = words[2], {}, b""
    rest = iter(words[3:])
    for word in rest:
        if word == "-H":
            name, _, value = next(rest).partition(": ")
            headers[name] = value
        elif word == "--data-raw":
            body = next(rest).encode("utf-8")
        else:
            raise AssertionError(f"unexpected curl argument {word!r}")
    return url, headers, body


def test_make_run_serves_a_signed_delivery_once(tmp_path: Path) -> None:
    port = free_port()
    env = {name: value for name, value in os.environ.items() if not CONFIGURATION.match(name)}
    # The database where a fresh checkout keeps it is the repository's own directory: here, a file of the
    # test's own (DATABASE_URL only moves it; the secrets it needs are still made by the example).
    database = tmp_path / "consumer-kit.db"
    env["DATABASE_URL"] = f"sqlite:///{database}"
    venv = Path(sys.prefix)  # this interpreter's virtualenv: make must not set one up again
    log = tmp_path / "make-run.log"
    with log.open("w") as output:
        # -o: the virtualenv counts as up to date (make test may have run with another pyproject.toml).
        make = subprocess.Popen(["make", "-s", "-o", str(venv / ".installed"), "run", f"VENV={venv}", f"PORT={port}"],
                                cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_served(make, f"http://127.0.0.1:{port}/readyz")  # type: ignore[arg-type]
        printed = log.read_text()
        assert f"webhook secret: generated into {database}.webhook-secret (STARTER_WEBHOOK_SECRET unset)" in printed
        assert (database.parent / "consumer-kit.db.webhook-secret").stat().st_mode & 0o777 == 0o600
        command = next(line.strip() for line in printed.splitlines() if line.strip().startswith("curl -s http"))
        url, headers, body = request_of(command)
        assert url == f"http://127.0.0.1:{port}/orders"
        first = httpx.post(url, headers=headers, content=body, timeout=10)
        assert (first.status_code, first.json()) == (200, {"outcome": "processed"})
        again = httpx.post(url, headers=headers, content=body, timeout=10)
        assert (again.status_code, again.json()) == (200, {"outcome": "duplicate"})
        forged = httpx.post(url, headers={**headers, "X-Signature": "sha256=" + "0" * 64}, content=body, timeout=10)
        assert forged.status_code == 401
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        source = 'source="webhook:starter-orders"'
        assert f'consumer_kit_deliveries_total{{outcome="processed",{source}}} 1.0' in metrics
        assert f'consumer_kit_deliveries_total{{outcome="duplicate",{source}}} 1.0' in metrics
        with sqlite3.connect(database) as db:
            rows = db.execute("SELECT order_ref, amount, session_id FROM starter_orders").fetchall()
        assert len(rows) == 1 and rows[0][:2] == ("order-1", 12) and rows[0][2]  # recorded once, in a session
    finally:
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it: to make and the worker
        try:
            make.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            pytest.fail(f"make run still running 30 s after Ctrl-C:\n{log.read_text()}")
    output = log.read_text()
    assert "Traceback" not in output, output
    # make dies of the Ctrl-C, once the worker (which drains on it) has exited.
    assert make.returncode in (0, -signal.SIGINT) and "Finished server process" in output, output
