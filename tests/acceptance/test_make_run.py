"""``make run`` on a machine with no secrets configured: the starter worker (examples/starter.py) on the
embedded defaults prints its start-up message once it serves; the curl in it, run the moment it
appears, is processed once, and sent again is answered as a duplicate; every other command it prints
runs as printed from the repository's root, with no virtualenv activated."""

from __future__ import annotations

import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from consumer_kit.testing.server import free_port

ROOT = Path(__file__).resolve().parents[2]
# Nothing that configures consumer-kit or the example is passed on: a fresh machine has none of it.
CONFIGURATION = re.compile(r"^(IDEMPOTENCY_|COORDINATOR_|STARTER_|RABBITMQ_|DATABASE_URL$)")
VENV = Path(sys.prefix)  # this interpreter's virtualenv: make must not set one up again


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


def unactivated(env: dict[str, str]) -> dict[str, str]:
    """``env`` as a shell where no virtualenv is activated has it: no VIRTUAL_ENV, nor its bin/ on PATH."""
    path = [entry for entry in env.get("PATH", "").split(os.pathsep)
            if entry and Path(entry).resolve() != (VENV / "bin").resolve()]
    return {**{k: v for k, v in env.items() if k != "VIRTUAL_ENV"}, "PATH": os.pathsep.join(path)}


def shell(command: str, env: dict[str, str]) -> str:
    """Run a printed command as a user pastes it into a shell at the repository's root; its output."""
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout}{done.stderr}"
    return done.stdout


def wait_for_message(make: subprocess.Popen[bytes], log: Path, *, seconds: float = 120) -> str:
    """The log once the start-up message is whole in it (it is printed in one write)."""
    deadline = time.monotonic() + seconds
    while "Stop it with Ctrl-C." not in (printed := log.read_text()):
        if make.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"make run printed no start-up message:\n{printed}")
        time.sleep(0.02)
    return printed


def test_make_run_serves_a_signed_delivery_once(tmp_path: Path) -> None:
    port = free_port()
    env = unactivated({name: value for name, value in os.environ.items() if not CONFIGURATION.match(name)})
    # The database where a fresh checkout keeps it is the repository's own directory: here, a file of the
    # test's own (DATABASE_URL only moves it; the secrets it needs are still made by the example).
    database = tmp_path / "consumer-kit.db"
    env["DATABASE_URL"] = f"sqlite:///{database}"
    log = tmp_path / "make-run.log"
    with log.open("w") as output:
        # -o: the run set counts as installed (make test may have run with another pyproject.toml).
        make = subprocess.Popen(["make", "-s", "-o", str(VENV / ".installed-run"), "run", f"VENV={VENV}",
                                 f"PORT={port}"], cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        printed = wait_for_message(make, log)
        # At once, with no wait for the server: the message comes only once the port is bound and served.
        command = next(line.strip() for line in printed.splitlines() if line.strip().startswith("curl -s http"))
        assert shell(command, env) == '{"outcome":"processed"}'
        assert shell(command, env) == '{"outcome":"duplicate"}'
        url, headers, body = request_of(command)
        assert url == f"http://127.0.0.1:{port}/orders"
        forged = httpx.post(url, headers={**headers, "X-Signature": "sha256=" + "0" * 64}, content=body, timeout=10)
        assert forged.status_code == 401
        assert f"webhook secret: generated into {database}.webhook-secret (STARTER_WEBHOOK_SECRET unset)" in printed
        assert (database.parent / "consumer-kit.db.webhook-secret").stat().st_mode & 0o777 == 0o600
        run_the_other_commands(printed.split("\nThen:\n", 1)[1].split("Stop it with Ctrl-C.")[0], env)
        with sqlite3.connect(database) as db:
            rows = db.execute("SELECT order_ref, amount, session_id FROM starter_orders ORDER BY id").fetchall()
        assert [row[:2] for row in rows] == [("order-1", 12), ("order-2", 5)] and all(row[2] for row in rows)
    finally:
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it: to make and the worker
        try:
            make.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            pytest.fail(f"make run still running 30 s after Ctrl-C:\n{log.read_text()}")
    logged = log.read_text()
    assert "Traceback" not in logged, logged
    # make dies of the Ctrl-C, once the worker (which drains on it) has exited.
    assert make.returncode in (0, -signal.SIGINT) and "Finished server process" in logged, logged


def run_the_other_commands(listed: str, env: dict[str, str]) -> None:
    """Each command the start-up message lists after the first curl, run as printed, in its order."""
    commands = [line.strip() for line in listed.splitlines() if line.strip()]
    metrics, another, parked, demo = commands
    counts = shell(metrics, env)
    source = 'source="webhook:starter-orders"'
    assert f'consumer_kit_deliveries_total{{outcome="processed",{source}}} 1.0' in counts
    assert f'consumer_kit_deliveries_total{{outcome="duplicate",{source}}} 1.0' in counts

    order = shell(another, env).strip()
    assert order.startswith("curl -s http") and "order-2" in order, order
    assert shell(order, env) == '{"outcome":"processed"}'
    # The same command for an order without an id (its body argument changed): verified, unkeyable, parked.
    unkeyable = shell(another.replace(shlex.quote('{"id": "order-2", "amount": 5}'), shlex.quote('{"amount": 5}')),
                      env).strip()
    assert "order-2" not in unkeyable, unkeyable
    assert shell(unkeyable, env) == '{"outcome":"invalid","reason":"missing_stable_id","parked":true}'
    listing = shell(parked, env)
    assert "missing_stable_id" in listing and "webhook:starter-orders" in listing, listing

    assert "OK: retries are harmless" in shell(demo, env)
