"""SIGTERM, whenever it comes, stops ``consumer-kit run`` cleanly (exit 0, what was opened closed): while
the app's module is being imported, while a source's start is waiting, and once it serves (for an app
with and without HTTP sources). The served coordinator's SIGTERM is in test_cli_coordinator.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from consumer_kit.testing.server import free_port
from tests.conftest import TEST_HMAC_KEY
from tests.processes import stop_cleanly

ROOT = Path(__file__).resolve().parents[2]

APP_MODULE = '''
import asyncio, os, time
from pathlib import Path

from consumer_kit import ConsumerApp, Settings
from consumer_kit.testing import InMemorySource

MARKS = Path(os.environ["MARKS"])


def mark(text):
    with MARKS.open("a") as marks:
        marks.write(text + "\\n")


if os.environ.get("SLOW_IMPORT"):
    mark("importing")
    time.sleep(60)


class Recorded(InMemorySource):
    async def start(self, dispatch, settings):
        await super().start(dispatch, settings)
        mark(f"{self.name} started")

    async def stop(self):
        mark(f"{self.name} stopped")
        await super().stop()

    async def close(self):
        mark(f"{self.name} closed")
        await super().close()


class WaitingForItsBroker(Recorded):
    async def start(self, dispatch, settings):
        mark(f"{self.name} starting")
        try:
            await asyncio.Event().wait()  # a broker that never answers
        except asyncio.CancelledError:
            mark(f"{self.name} start cancelled")
            raise


app = ConsumerApp(Settings())
sources = [Recorded(namespace="first", version=1, name="first")]
if os.environ.get("HTTP"):
    from consumer_kit.sources.webhooks import HmacVerifier, WebhookSource

    sources.append(WebhookSource(path="/hooks", verifier=HmacVerifier("s" * 32, header="X-Signature", id_header="X-Id"),
                                 namespace="hooks", version=1))
if os.environ.get("SLOW_START"):
    sources.append(WaitingForItsBroker(namespace="slow", version=1, name="slow"))
for source in sources:
    app.handler(source)(lambda ctx: None)
'''


class Worker:
    """``consumer-kit run workerapp:app`` in ``tmp_path``; its sources write what happens to MARKS."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        (tmp_path / "workerapp.py").write_text(APP_MODULE)
        self.marks = tmp_path / "marks.txt"
        self.marks.touch()
        environment = {**os.environ, "PYTHONPATH": str(ROOT), "MARKS": str(self.marks),
                       "DATABASE_URL": f"sqlite:///{tmp_path}/w.db", "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY, **env}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "consumer_kit.cli", "run", "workerapp:app", "--port", str(free_port())],
            cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_for(self, mark: str) -> None:
        deadline = time.monotonic() + 60
        while mark not in self.lines():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                pytest.fail(f"never saw {mark!r}: {self.lines()}\n{self.process.communicate()[0]}")
            time.sleep(0.05)

    def lines(self) -> list[str]:
        return self.marks.read_text().splitlines()

    def terminate(self) -> str:
        """SIGTERM; the output, once the process exited 0 without a traceback."""
        return stop_cleanly(self.process)


def test_sigterm_while_the_app_module_is_imported(tmp_path: Path) -> None:
    worker = Worker(tmp_path, SLOW_IMPORT="1")
    worker.wait_for("importing")
    worker.terminate()
    assert worker.lines() == ["importing"]  # nothing was started, so nothing to close


@pytest.mark.parametrize("http", [False, True], ids=["queue-worker", "http-worker"])
def test_sigterm_while_a_source_is_starting(tmp_path: Path, http: bool) -> None:
    worker = Worker(tmp_path, SLOW_START="1", **({"HTTP": "1"} if http else {}))
    worker.wait_for("slow starting")
    worker.terminate()
    # The waiting start was cancelled; the source started before it was stopped and closed again.
    assert worker.lines() == ["first started", "slow starting", "slow start cancelled", "first stopped",
                              "first closed"]


@pytest.mark.parametrize("http", [False, True], ids=["queue-worker", "http-worker"])
def test_sigterm_once_serving(tmp_path: Path, http: bool) -> None:
    worker = Worker(tmp_path, **({"HTTP": "1"} if http else {}))
    worker.wait_for("first started")
    time.sleep(0.5)  # past the start-up, into serving
    output = worker.terminate()
    assert worker.lines() == ["first started", "first stopped", "first closed"]
    assert "consumer-kit started" in output
