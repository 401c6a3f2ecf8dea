"""A handler's failure as an operator meets it: the worker (``consumer-kit run``, consuming RabbitMQ) logs
each failed attempt's traceback, with the file, the line and the stack but never the raw key, at
WARNING while the delivery is retried and at ERROR when it is parked; ``consumer-kit parked show`` (the
script, in a process of its own) prints that traceback for the parked delivery, named by the first
digits of its id, and refuses digits that name more than one with one line.

On SQLite with text logs, and on PostgreSQL with JSON logs (``LOG_FORMAT=json``)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from consumer_kit import ConsumerApp
from tests.acceptance import failing_app
from tests.conftest import TEST_HMAC_KEY, make_settings, truncate_all
from tests.integration.rabbit import AMQP_URL, declare, delete_queues, publish, wait_until
from tests.processes import terminated

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).with_name("consumer-kit"))
APP = "tests.acceptance.failing_app:app"
MESSAGE_ID = "pay-7f3a9c21e5"
RAW_KEY = f"payments:v1:{MESSAGE_ID}"
APP_FILE = Path(failing_app.__file__).resolve()
RAISED_AT = next(number for number, line in enumerate(APP_FILE.read_text().splitlines(), 1) if "RAISED HERE" in line)
FRAME = f'File "{APP_FILE}", line {RAISED_AT}, in charge'
TEXT_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<logger>\S+) (?P<message>.*)$")


@dataclass(frozen=True)
class Record:
    level: str
    logger: str
    message: str


def records(log: str, log_format: str) -> list[Record]:
    """The log's records, each with every line of its message (a traceback's too)."""
    if log_format == "json":
        parsed = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        return [Record(p["level"], p["logger"], p["message"]) for p in parsed]
    found: list[Record] = []
    for line in log.splitlines():
        start = TEXT_RECORD.match(line)
        if start:
            found.append(Record(start["level"], start["logger"], start["message"]))
        elif found:
            found[-1] = Record(found[-1].level, found[-1].logger, found[-1].message + "\n" + line)
    return found


@pytest.fixture(params=[("sqlite", "text"), pytest.param(("postgres", "json"), marks=pytest.mark.postgres)],
                ids=["sqlite-text", "postgres-json"])
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    """The worker's and the operator's environment: a database, a queue of the test's own, two
    attempts a delivery and two deliveries a key before it is parked."""
    database, log_format = request.param
    if database == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path}/failing.db"
    else:
        url = request.getfixturevalue("pg_url")
        await truncate_all(url)
    queue = f"ck-failing-{secrets.token_hex(4)}"
    await declare(queue)
    yield {**os.environ, "DATABASE_URL": url, "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY, "RABBITMQ_URL": AMQP_URL,
           "FAILING_TEST_QUEUE": queue, "RETRY_ATTEMPTS": "2", "MAX_DELIVERIES": "2",
           "RETRY_BACKOFF_SECONDS": "0.001", "LOG_FORMAT": log_format, "LOG_LEVEL": "INFO"}
    await delete_queues(queue)


def consumer_kit(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The ``consumer-kit`` script, as an operator runs it."""
    return subprocess.run([CLI, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``consumer-kit run`` the app, logging to ``log``."""
    with log.open("wb") as output:
        return subprocess.Popen([CLI, "run", APP], cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)


async def run_worker_until_parked(env: dict[str, str], log: Path) -> tuple[str, ConsumerApp]:
    """Run the worker until the payment is parked, stop it (SIGTERM), and return its log and an app
    that looks at the same database."""
    observer = ConsumerApp(make_settings(env["DATABASE_URL"], db_pool_size=2))
    worker = start_worker(env, log)
    try:
        await wait_until(lambda: asyncio.to_thread(lambda: b"consumer-kit started" in log.read_bytes()), 60,
                         "the worker to start")
        await publish(env["FAILING_TEST_QUEUE"], [(MESSAGE_ID, b'{"order": "O-1"}')])
        async with observer.running(sources=()):
            async def parked() -> bool:
                return await observer.dead_letters.count() == 1

            await wait_until(parked, 30, "the payment to be parked")
    finally:
        code = await terminated(worker)
    text = await asyncio.to_thread(log.read_text)
    assert code == 0, text[-3000:]
    return text, observer


def assert_shows_its_cause(traceback: str) -> None:
    """A traceback with the handler's file, line and the stack that called it; the key redacted."""
    assert traceback.startswith("Traceback (most recent call last):")
    assert FRAME in traceback
    assert 'consumer_kit/pipeline/running.py", line' in traceback and "await spec.func(ctx)" in traceback
    assert traceback.rstrip().endswith("KeyError: 'amount (payment <key>)'")
    assert RAW_KEY not in traceback and MESSAGE_ID not in traceback


async def test_a_failing_handler_logs_and_keeps_its_traceback_without_the_key(
        env: dict[str, str], tmp_path: Path) -> None:
    log, observer = await run_worker_until_parked(env, tmp_path / "worker.log")
    assert RAW_KEY not in log and MESSAGE_ID not in log  # the key and its id: nowhere in the log
    failures = [r for r in records(log, env["LOG_FORMAT"]) if "Traceback" in r.message]
    # Two attempts in each of two deliveries: four tracebacks, each once, in the record that says what
    # comes next (WARNING: retried in process, then by the broker; ERROR: parked).
    assert [(r.level, r.logger, r.message.split(" (")[0]) for r in failures] == [
        ("WARNING", "consumer_kit.pipeline", "handler failed, attempt 1; retrying in process"),
        ("WARNING", "consumer_kit.pipeline", "handler failed; delivery 1 of 2 will be retried"),
        ("WARNING", "consumer_kit.pipeline", "handler failed, attempt 1; retrying in process"),
        ("ERROR", "consumer_kit.pipeline", "delivery parked: retries_exhausted"),
    ]
    for record in failures:
        first, rest = record.message.split("\n", 1)
        assert "KeyError: 'amount (payment <key>)'" in first and "[payments:v1 " in first
        assert_shows_its_cause(rest)
    assert log.count("Traceback (most recent call last)") == 4

    async with observer.running(sources=()):
        [letter] = await observer.dead_letters.list()
    assert letter.traceback is not None
    assert_shows_its_cause(letter.traceback)

    table = consumer_kit("parked", "show", letter.id[:12], "--format", "table", env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines.index("reason: retries_exhausted") < lines.index("traceback:")
    printed = lines[lines.index("traceback:") + 1:]
    end = next(i for i, line in enumerate(printed) if not line.startswith("  "))
    assert_shows_its_cause("\n".join(line[2:] for line in printed[:end]))
    assert RAW_KEY not in table.stdout and MESSAGE_ID not in table.stdout
    shown = json.loads(consumer_kit("parked", "show", letter.id[:6].upper(), env=env).stdout)
    assert shown["id"] == letter.id and shown["traceback"] == letter.traceback

    # Digits that begin two ids or more are refused, saying how many; digits that begin none, too.
    async with observer.running(sources=()):
        for n in range(16):  # 17 ids, 16 hex digits: at least two begin with the same one
            await observer.dead_letters.park(consumer="payments", source="memory:other", namespace="other",
                                             version=1, key_digest=None, reason="missing_stable_id",
                                             body=b"{}", headers={}, attempts=1, detail=f"filler {n}")
        ids = [parked.id for parked in await observer.dead_letters.list(limit=100)]
    digit, many = Counter(i[0] for i in ids).most_common(1)[0]
    ambiguous = consumer_kit("parked", "show", digit, env=env)
    assert ambiguous.returncode == 2 and ambiguous.stdout == ""
    assert ambiguous.stderr.splitlines() == [
        f"consumer-kit: {many} parked deliveries have an id starting with '{digit}': give more of its digits "
        "(ids come from `consumer-kit parked list`)"]
    unknown = next(f"{n:04x}" for n in range(65536) if not any(i.startswith(f"{n:04x}") for i in ids))
    none = consumer_kit("parked", "show", unknown, env=env)
    assert none.returncode == 2 and none.stderr.splitlines() == [
        f"consumer-kit: no parked delivery '{unknown}' (ids come from `consumer-kit parked list`)"]
