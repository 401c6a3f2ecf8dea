"""Fixtures of the browser tests: a worker (``consumer-kit run --port``, a subprocess) on a RabbitMQ queue
and a PostgreSQL database of the module's own, serving the console under /console, and Debian's
chromium, headless, driven by Playwright through its executable path (Playwright's own browser builds
are not used). Each test parks deliveries of its own, so the tests do not depend on one another's
order (or on running in the same pytest-xdist worker)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from playwright.async_api import Browser, BrowserContext, async_playwright

from consumer_kit.store import create_engine
from tests.browser.console_app import metadata
from tests.browser.helpers import CHROMIUM, OPERATOR_TOKEN, ROOT, VIEWER_TOKEN, Worker
from tests.conftest import TEST_HMAC_KEY, migrated_database, run_in_thread
from tests.integration.rabbit import AMQP_URL, delete_queues
from tests.processes import wait_until_served


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _create_effects(url: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    folder = tmp_path_factory.mktemp("console")
    queue = f"ck-test-console-{secrets.token_hex(4)}"
    port = _free_port()
    with migrated_database("ck_console") as url:
        run_in_thread(_create_effects(url))
        fixed = folder / "fixed"
        fixed.mkdir()
        log = folder / "worker.log"
        env = {**os.environ, "DATABASE_URL": url, "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY, "RABBITMQ_URL": AMQP_URL,
               "CONSOLE_PATH": "/console", "CONSOLE_TEST_QUEUE": queue, "CONSOLE_TEST_FIXED_DIR": str(fixed),
               "CONSOLE_TOKENS": json.dumps({OPERATOR_TOKEN: "ann:operator", VIEWER_TOKEN: "vic:viewer"}),
               "DB_POOL_SIZE": "4", "RETRY_BACKOFF_SECONDS": "0.01"}
        with log.open("w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "consumer_kit.cli", "run", "tests.browser.console_app:app",
                 "--port", str(port)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                start_new_session=True)
        try:
            wait_until_served(process, f"http://127.0.0.1:{port}/readyz", seconds=60)
            yield Worker(f"http://127.0.0.1:{port}", queue, fixed, url, log)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            run_in_thread(delete_queues(queue))
    assert process.returncode == 0, log.read_text()[-4000:]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield launched
        finally:
            await launched.close()


@pytest_asyncio.fixture(loop_scope="module")
async def context(browser: Browser) -> AsyncIterator[BrowserContext]:
    """A fresh browser profile (no cookies) for one test."""
    made = await browser.new_context(viewport={"width": 1200, "height": 760}, device_scale_factor=1)
    try:
        yield made
    finally:
        await made.close()
