"""The `consumer-kit` command, run as a subprocess the way a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "consumer_kit.cli"]


def env(**extra: str) -> dict[str, str]:
    values = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "IDEMPOTENCY_"))}
    values["PYTHONPATH"] = str(ROOT)
    values.update(extra)
    return values


def test_demo_runs_the_recipe_on_embedded_defaults(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "demo"], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "destination effect count: 1" in done.stdout
    assert "OK: retries are harmless" in done.stdout
    assert "NO" not in done.stdout.split()


def test_run_starts_and_drains_on_sigterm(tmp_path: Path) -> None:
    with subprocess.Popen(
        [*CLI, "run", "examples.quickstart:app"], cwd=ROOT, env=env(DATABASE_URL=f"sqlite:///{tmp_path}/w.db"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    ) as process:
        _drain_on_sigterm(process, tmp_path)


def _drain_on_sigterm(process: subprocess.Popen[str], tmp_path: Path) -> None:
    try:
        deadline = time.monotonic() + 60
        assert process.stdout is not None
        seen = ""
        while "consumer-kit started" not in seen:
            assert time.monotonic() < deadline, seen
            line = process.stdout.readline()
            assert line or process.poll() is None, seen
            seen += line
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert (tmp_path / "w.db").exists() and (tmp_path / "w.db.hmac-key").exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_bad_target_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "run", "nomodule"], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "expected module:app" in done.stderr


def test_postgres_without_hmac_key_refuses_to_start(tmp_path: Path) -> None:
    done = subprocess.run(
        [*CLI, "run", "examples.quickstart:app"], cwd=ROOT,
        env=env(DATABASE_URL="postgresql://postgres@127.0.0.1:5432/postgres"), capture_output=True, text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "IDEMPOTENCY_HMAC_KEY is not set" in done.stderr


@pytest.mark.postgres
def test_db_upgrade_then_check(pg_url: str) -> None:
    done = subprocess.run([*CLI, "db", "upgrade"], env=env(DATABASE_URL=pg_url, IDEMPOTENCY_HMAC_KEY="x" * 32),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*CLI, "db", "check"], env=env(DATABASE_URL=pg_url), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "schema revision" in done.stdout


def test_quickstart_example(tmp_path: Path) -> None:
    code = "import asyncio, examples.quickstart as q; print(asyncio.run(q.main()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(DATABASE_URL=f"sqlite:///{tmp_path}/q.db"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['processed', 'duplicate', 'processed', 'dead_lettered']"


def test_dead_letters_list(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/q.db"
    code = "import asyncio, examples.quickstart as q; asyncio.run(q.main())"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(DATABASE_URL=url), check=True,
                   capture_output=True, timeout=60)
    done = subprocess.run([*CLI, "dead-letters", "list", "--bodies"], cwd=ROOT, env=env(DATABASE_URL=url),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    letter = json.loads(line)
    assert letter["reason"] == "malformed_ticket" and letter["body"] == "{}" and len(letter["key_digest"]) == 16
    assert "m-3" not in line  # the delivery id is part of the key: never printed
