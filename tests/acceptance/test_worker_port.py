"""``consumer-kit run module:app --port N`` serves /healthz, /readyz and /metrics for every worker, a
queue-only one included; without ``--port`` it listens nowhere; an app with HTTP sources needs it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import httpx
import pytest

from consumer_kit.testing.server import free_port
from tests.conftest import TEST_HMAC_KEY
from tests.integration.rabbit import AMQP_URL, TcpProxy, declare, publish, wait_until
from tests.processes import wait_until_served

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "consumer_kit.cli"]


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    name = f"ck-port-{secrets.token_hex(4)}"
    yield name
    # The example's queues by name (delete_queues lists them with rabbitmqctl, which takes seconds).
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        for suffix in ("", ".dlq", ".events", ".retry.500ms", ".retry.2000ms", ".retry.10000ms"):
            channel = await connection.channel()
            await channel.queue_delete(name + suffix)


def sample(exposition: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus exposition, or None when it is absent."""
    wanted = ",".join(f'{label}="{value}"' for label, value in sorted(labels.items()))
    pattern = re.escape(name + (f"{{{wanted}}}" if labels else "")) + r" (\S+)"
    found = re.search(f"^{pattern}$", exposition, re.MULTILINE)
    return float(found.group(1)) if found else None


def start(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """``command`` started in the repository, its output piped."""
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_a_rabbitmq_worker_with_port_answers_metrics_and_readiness(
        pg_database: str, queue: str, tmp_path: Path) -> None:
    broker = TcpProxy()  # the worker reaches the broker through it, so that the test can cut it off
    await broker.start()
    port = free_port()
    env = dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY, RABBITMQ_URL=broker.url,
               ORDERS_QUEUE=queue, EVENTS_QUEUE=f"{queue}.events", OUTBOX_POLL_SECONDS="0.2",
               SHUTDOWN_GRACE_SECONDS="5", DB_POOL_SIZE="3")
    init = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "examples.rabbitmq_worker", "init"],
                                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert init.returncode == 0, init.stderr
    await declare(queue)
    worker = start([*CLI, "--log-level", "WARNING", "run", "examples.rabbitmq_worker:app", "--port", str(port)], env)
    base = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_until_served, worker, f"{base}/readyz")
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/readyz")).json() == {"ready": True}
            await publish(queue, [("port-order-1", json.dumps({"order": "P-1", "amount": 3}).encode())])
            source = f"rabbitmq:{queue}"

            async def counted() -> bool:
                text = (await client.get("/metrics")).text
                return sample(text, "consumer_kit_deliveries_total", outcome="processed", source=source) == 1.0 \
                    and sample(text, "consumer_kit_outbox_published_total") == 1.0 \
                    and sample(text, "consumer_kit_outbox_pending") == 0.0

            await wait_until(counted, 30, "/metrics to count the processed order and its relayed event")
            await broker.stop()  # the broker is gone: not ready while the source cannot reconnect

            async def unready() -> bool:
                answer = await client.get("/readyz")
                return answer.status_code == 503 and answer.json() == {
                    "ready": False, "reason": "source_not_ready", "source": source, "detail": "broker_disconnected"}

            await wait_until(unready, 10, "/readyz to say the broker is disconnected")
            assert (await client.get("/healthz")).status_code == 200  # alive all the same
            await broker.start()  # back on the same port: aio-pika reconnects within its 5 s interval

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await wait_until(ready, 20, "/readyz to be ready again after the reconnect")
    finally:
        worker.send_signal(signal.SIGTERM)
        output, _ = await asyncio.to_thread(worker.communicate, timeout=30)
        await broker.stop()
    # (aiormq logs the dropped connection with a traceback of its own: not ours to log.)
    assert worker.returncode == 0, output


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (its socket inodes, looked up in /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_without_port_a_worker_listens_nowhere(tmp_path: Path) -> None:
    env = dict(os.environ, DATABASE_URL=f"sqlite:///{tmp_path}/w.db", IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY)
    log = tmp_path / "worker.log"
    with log.open("w") as output:
        worker = subprocess.Popen([*CLI, "run", "examples.quickstart:app"], cwd=ROOT, env=env, stdout=output,
                                  stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while "consumer-kit started" not in log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert listening_ports(worker.pid) == set()
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0, log.read_text()


def test_an_app_with_http_sources_needs_port(tmp_path: Path) -> None:
    env = dict(os.environ, DATABASE_URL=f"sqlite:///{tmp_path}/w.db", STRIPE_WEBHOOK_SECRET="whsec_test")
    done = subprocess.run([*CLI, "run", "examples.stripe_receiver:app"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "consumer-kit: examples.stripe_receiver:app has HTTP sources (/stripe/webhooks): give --port to serve them"]
    assert not (tmp_path / "w.db").exists()  # refused before anything was opened


def test_a_taken_port_is_one_clear_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, DATABASE_URL=f"sqlite:///{tmp_path}/w.db", IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY)
        done = subprocess.run([*CLI, "run", "examples.quickstart:app", "--port", str(port)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"consumer-kit: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert not (tmp_path / "w.db").exists()  # refused before the app opened anything
