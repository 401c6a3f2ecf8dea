"""Errors a person can read: every ``consumer-kit`` command, given a database it cannot use, a missing
schema, a bad ``module:app``, a bad ``--log-level`` (before or after the sub-command) or a bad setting,
ends with exit code 2 and ONE line on stderr that says what is wrong: no traceback, no password from a
URL, and no file created by a command that only reads.

Run through the command's entry function (in this process: the same parser and error handling, without
a Python start-up per case); the few cases that are about the process itself run the script."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.cli_run import Ran, cli
from tests.conftest import PG_ADMIN_URL, TEST_HMAC_KEY, _admin, run_in_thread

ROOT = Path(__file__).resolve().parents[2]
SECRET = "secretpw"
QUICKSTART = "examples.quickstart:app"
SCHEDULES = "tests.acceptance.schedule_app:app"
APPS = ("examples.quickstart", "tests.acceptance.schedule_app")

# Every command that opens the database, with arguments that are right but for the database.
DATABASE_COMMANDS = {
    "run": ["run", QUICKSTART],
    "db upgrade": ["db", "upgrade"],
    "db check": ["db", "check"],
    "parked list": ["parked", "list"],
    "parked groups": ["parked", "groups"],
    "parked show": ["parked", "show", "0" * 32],
    "parked replay": ["parked", "replay", QUICKSTART],
    "parked discard": ["parked", "discard", "--all", "--yes"],
    "dead-letters list": ["dead-letters", "list"],
    "coordinator serve": ["coordinator", "serve", "--port", "0"],
    "outbox relay": ["outbox", "relay"],
    "schedule run": ["schedule", "run", SCHEDULES, "report"],
    "schedule list": ["schedule", "list", SCHEDULES],
}
READ_ONLY = ["db check", "parked list", "parked groups", "parked show", "parked replay", "parked discard",
             "dead-letters list", "schedule list"]
APP_COMMANDS = {
    "run": lambda target: ["run", target],
    "parked replay": lambda target: ["parked", "replay", target],
    "schedule run": lambda target: ["schedule", "run", target, "report"],
    "schedule list": lambda target: ["schedule", "list", target],
    "outbox relay": lambda target: ["outbox", "relay", "--app", target],
}
EVERY_COMMAND = [*DATABASE_COMMANDS.values(), ["demo"], ["db", "revision", "-m", "x"]]


def says_one_line(ran: Ran, *words: str, code: int = 2) -> None:
    """Exit ``code``, one line on stderr holding each of ``words``; no traceback, no password."""
    assert ran.code == code, (ran.code, ran.err)
    assert len(ran.err_lines) == 1, ran.err
    assert ran.err_lines[0].startswith("consumer-kit"), ran.err
    for word in words:
        assert word in ran.err, (word, ran.err)
    assert "Traceback" not in ran.err + ran.out and SECRET not in ran.err + ran.out


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An operator's shell in an empty directory: the test HMAC key and a broker URL, nothing else set."""
    for name in list(os.environ):
        if name.startswith(("DATABASE_URL", "IDEMPOTENCY_", "APP_MIGRATIONS", "LOG_LEVEL", "PARKED_TEST")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("IDEMPOTENCY_HMAC_KEY", TEST_HMAC_KEY)
    monkeypatch.setenv("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def run(*argv: str) -> Ran:
    return cli(*argv, fresh=APPS)


BAD_DATABASES = {
    "closed port": (f"postgresql://postgres:{SECRET}@127.0.0.1:1/ck", "connection refused"),
    "unknown user": (f"postgresql://ck_no_such_role:{SECRET}@127.0.0.1:5432/postgres",
                     "refused the login of user 'ck_no_such_role'"),
    "missing database": (f"postgresql://postgres:{SECRET}@127.0.0.1:5432/ck_no_such_db",
                         "database 'ck_no_such_db' does not exist"),
    "unparseable URL": (f"postgresql://postgres:{SECRET}@@:x/", "does not parse"),
}


# Every command with a database that is not there; every kind of bad database with a few commands (the
# translation is the store's, shared by all).
DATABASE_CASES = [("closed port", command) for command in DATABASE_COMMANDS] + [
    (bad, command) for bad in BAD_DATABASES if bad != "closed port" for command in ("run", "db upgrade", "parked list")]


@pytest.mark.postgres
@pytest.mark.parametrize(("bad", "command"), DATABASE_CASES)
def test_a_database_that_cannot_be_used(shell: Path, monkeypatch: pytest.MonkeyPatch, command: str,
                                        bad: str) -> None:
    url, words = BAD_DATABASES[bad]
    monkeypatch.setenv("DATABASE_URL", url)
    says_one_line(run(*DATABASE_COMMANDS[command]), words)
    assert list(shell.iterdir()) == []


@pytest.fixture(scope="module")
def empty_database() -> Iterator[str]:
    """A PostgreSQL database without consumer-kit's tables."""
    name = f"ck_test_empty_{secrets.token_hex(4)}"
    run_in_thread(_admin(f'CREATE DATABASE "{name}"'))
    yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    run_in_thread(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.postgres
@pytest.mark.parametrize("command", [c for c in DATABASE_COMMANDS if c not in ("db upgrade", "db check")])
def test_a_database_without_the_schema(shell: Path, monkeypatch: pytest.MonkeyPatch, empty_database: str,
                                       command: str) -> None:
    monkeypatch.setenv("DATABASE_URL", empty_database)
    says_one_line(run(*DATABASE_COMMANDS[command]), "consumer-kit db upgrade")


@pytest.mark.postgres
def test_db_check_on_a_database_without_the_schema_says_so_and_exits_1(
        shell: Path, monkeypatch: pytest.MonkeyPatch, empty_database: str) -> None:
    monkeypatch.setenv("DATABASE_URL", empty_database)
    checked = run("db", "check")
    assert checked.code == 1 and checked.out.startswith("schema revision none") and checked.err == ""


@pytest.mark.parametrize("command", READ_ONLY)
def test_a_command_that_reads_creates_no_sqlite_file(shell: Path, command: str) -> None:
    says_one_line(run(*DATABASE_COMMANDS[command]), "there is no database")
    assert list(shell.iterdir()) == []  # neither consumer-kit.db nor its HMAC key file


BAD_TARGETS = {
    "nocolon": "expected module:app",
    "ck_no_such_module:app": "cannot import 'ck_no_such_module'",
    "os:ck_nothing": "module 'os' has no attribute 'ck_nothing'",
    "os:path": "os:path is a module, not a consumer_kit.ConsumerApp",
    "broken_ck:app": "importing 'broken_ck' failed: RuntimeError: boom (broken_ck.py, line 2)",
}


TARGET_CASES = [("run", target) for target in BAD_TARGETS] + [
    (command, "broken_ck:app") for command in APP_COMMANDS if command != "run"]


@pytest.mark.parametrize(("command", "target"), TARGET_CASES)
def test_a_bad_module_app(shell: Path, command: str, target: str) -> None:
    (shell / "broken_ck.py").write_text("# an app whose import fails\nraise RuntimeError('boom')\n")
    sys.modules.pop("broken_ck", None)
    says_one_line(run(*APP_COMMANDS[command](target)), BAD_TARGETS[target])
    assert [p.name for p in shell.iterdir() if p.name != "__pycache__"] == ["broken_ck.py"]


@pytest.mark.parametrize("argv", EVERY_COMMAND, ids=lambda argv: " ".join(argv[:2]))
def test_a_bad_log_level_before_or_after_the_command(shell: Path, argv: list[str]) -> None:
    says_one_line(run("--log-level", "LOUD", *argv), "invalid level 'LOUD'")
    says_one_line(run(*argv, "--log-level", "loud"), "invalid level 'loud'")
    assert list(shell.iterdir()) == []


def test_a_bad_log_level_in_the_environment(shell: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOG_LEVEL", "chatty")
    says_one_line(run("parked", "list"), "LOG_LEVEL", "invalid level 'chatty'")


def test_a_bad_setting(shell: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INBOX_LEASE_SECONDS", "soon")
    says_one_line(run("db", "check"), "invalid setting: INBOX_LEASE_SECONDS")
    says_one_line(run("run", QUICKSTART), "importing 'examples.quickstart' failed: invalid setting: "
                                          "INBOX_LEASE_SECONDS")


def test_a_usage_error_is_one_line(shell: Path) -> None:
    says_one_line(run("parked", "list", "--since", "yesterday"), "neither a duration")
    says_one_line(run("parked", "replay", QUICKSTART, "--max", "0"), "must be more than 0")
    says_one_line(run("parked", "nonsense"), "invalid choice")


@pytest.mark.postgres
def test_the_hmac_key_advice_and_check_agree(shell: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", f"postgresql://postgres:{SECRET}@127.0.0.1:1/ck")
    monkeypatch.delenv("IDEMPOTENCY_HMAC_KEY")
    says_one_line(run("run", QUICKSTART), "IDEMPOTENCY_HMAC_KEY is not set", "at least 16 bytes")
    monkeypatch.setenv("IDEMPOTENCY_HMAC_KEY", "x" * 15)
    says_one_line(run("run", QUICKSTART), "IDEMPOTENCY_HMAC_KEY is 15 bytes long", "at least 16 bytes")
    monkeypatch.setenv("IDEMPOTENCY_HMAC_KEY", "x" * 16)
    says_one_line(run("run", QUICKSTART), "connection refused")  # 16 bytes pass: on to the database


@pytest.mark.rabbitmq
@pytest.mark.parametrize(("url", "words"), [
    ("amqp://guest:guest@127.0.0.1:5672/ck-no-such-vhost", "virtual host 'ck-no-such-vhost' does not exist"),
    (f"amqp://guest:{SECRET}@127.0.0.1:1/", "connection refused"),
    (f"amqp://ck-nobody:{SECRET}@127.0.0.1:5672/", "refused the login of user 'ck-nobody'"),
], ids=["unknown vhost", "closed port", "bad login"])
def test_a_broker_that_cannot_be_used(shell: Path, monkeypatch: pytest.MonkeyPatch, url: str, words: str) -> None:
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{shell}/worker.db")
    monkeypatch.setenv("PARKED_TEST_QUEUE", "ck-never-declared")
    monkeypatch.setenv("RABBITMQ_URL", url)
    says_one_line(cli("run", "tests.acceptance.parked_app:app", fresh=("tests.acceptance.parked_app",)),
                  "cannot connect to RabbitMQ at", words)


def test_the_script_says_one_line_and_leaves_no_file(tmp_path: Path) -> None:
    """The real process: its own logging, its own exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "IDEMPOTENCY_", "LOG_LEVEL"))}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "consumer_kit.cli", "parked", "list"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "consumer-kit: there is no database at sqlite+aiosqlite:///consumer-kit.db (no file 'consumer-kit.db'): "
        "nothing has run with this DATABASE_URL here yet, or it points elsewhere"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.rabbitmq
def test_the_relay_says_at_once_that_it_cannot_publish_then_retries_with_a_logged_backoff(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "IDEMPOTENCY_", "LOG_LEVEL"))}
    env.update(PYTHONPATH=str(ROOT), DATABASE_URL=f"sqlite:///{tmp_path}/relay.db",
               RABBITMQ_URL=f"amqp://guest:{SECRET}@127.0.0.1:1/", OUTBOX_BACKOFF_SECONDS="0.5")
    started = time.monotonic()
    with subprocess.Popen([sys.executable, "-m", "consumer_kit.cli", "outbox", "relay"], cwd=tmp_path, env=env,
                          stderr=subprocess.PIPE, text=True) as relay:
        assert relay.stderr is not None
        seen: list[str] = []
        try:
            while sum("cannot publish" in line for line in seen) < 2:
                line = relay.stderr.readline()
                assert line, "".join(seen)
                seen.append(line)
            took = time.monotonic() - started
        finally:
            relay.send_signal(signal.SIGTERM)
            code = relay.wait(30)
            seen += relay.stderr.read().splitlines(keepends=True)
    said = [line for line in seen if "cannot publish" in line]
    assert took < 10, took  # the first attempt is said at once (Python's start-up included), the second 0.5 s on
    assert "connection refused" in said[0] and "trying again in 0.5 s" in said[0]
    assert "trying again in 1.0 s" in said[1]
    assert code == 0 and SECRET not in "".join(seen) and "Traceback" not in "".join(seen)
