"""What ``consumer-kit run`` takes, as uvicorn's and FastStream's users expect: ``module:app`` or
``path/to/app.py:app``, ``--app-dir``, ``--env-file``; and what it refuses in one line with exit 2 (a file
or attribute that is not there, an app with no handlers, a port out of range, a URL of the wrong
scheme, a broker that refuses the login: no "Reconnecting" line before it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from consumer_kit.cli import load_app
from tests.acceptance.cli_run import cli
from tests.acceptance.test_cli_errors import SECRET, says_one_line
from tests.conftest import TEST_HMAC_KEY

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "consumer_kit.cli"]
APP = """\
from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.testing import InMemorySource
{imports}
app = ConsumerApp(Settings())
source = InMemorySource(namespace="{namespace}", version=1)


@app.handler(source)
async def handle(ctx: Context) -> None:
    {body}
"""


def write_app(path: Path, *, namespace: str = "targets", imports: str = "", body: str = "pass") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(APP.format(namespace=namespace, imports=imports, body=body))
    return path


def env(**extra: str) -> dict[str, str]:
    values = {k: v for k, v in os.environ.items()
              if not k.startswith(("DATABASE_URL", "IDEMPOTENCY_", "LOG_", "RABBITMQ_URL", "COORDINATOR_"))}
    return values | {"PYTHONPATH": str(ROOT), "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY} | extra


def run_until_started(argv: list[str], cwd: Path, environ: dict[str, str]) -> str:
    """Run the command until it logs that it started, then SIGTERM it; what it logged (exit 0 checked)."""
    with subprocess.Popen([*CLI, *argv], cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as process:
        assert process.stdout is not None
        seen = ""
        try:
            while "consumer-kit started" not in seen:
                line = process.stdout.readline()
                assert line, seen
                seen += line
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0, seen
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return seen


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty directory as the current one, the test HMAC key and a SQLite file there."""
    for name in list(os.environ):
        if name.startswith(("DATABASE_URL", "IDEMPOTENCY_", "APP_MIGRATIONS", "LOG_LEVEL", "RABBITMQ_URL")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("IDEMPOTENCY_HMAC_KEY", TEST_HMAC_KEY)
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path}/targets.db")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_run_a_file_path_then_drain(tmp_path: Path) -> None:
    write_app(tmp_path / "deploy" / "worker.py")
    seen = run_until_started(["run", "deploy/worker.py:app"], tmp_path,
                             env(DATABASE_URL=f"sqlite:///{tmp_path}/w.db"))
    assert "1 source(s)" in seen and (tmp_path / "w.db").exists()


def test_a_file_in_a_package_is_imported_by_its_dotted_name(shell: Path) -> None:
    (shell / "shop").mkdir()
    (shell / "shop" / "__init__.py").write_text("")
    (shell / "shop" / "names.py").write_text('NAMESPACE = "shop-orders"\n')
    write_app(shell / "shop" / "worker.py", namespace="shop-orders", imports="from .names import NAMESPACE")
    app = load_app(str(shell / "shop" / "worker.py") + ":app")  # an absolute path too
    assert type(app).__name__ == "ConsumerApp" and app.specs[0].source.namespace == "shop-orders"
    assert sys.modules["shop.worker"].app is app  # the relative import worked: a package module
    assert load_app("shop/worker.py:app") is app and load_app("shop.worker:app") is app


def test_app_dir_puts_a_folder_first_on_the_import_path(shell: Path) -> None:
    write_app(shell / "src" / "ck_app_dir_worker.py", namespace="app-dir")
    says_one_line(cli("run", "ck_app_dir_worker:nothing", "--app-dir", "src"),
                  "module 'ck_app_dir_worker' has no attribute 'nothing' (from ck_app_dir_worker:nothing)")
    assert load_app("ck_app_dir_worker:app", app_dir="src").specs[0].source.namespace == "app-dir"
    assert load_app("ck_app_dir_worker.py:app", app_dir=str(shell / "src")).specs[0].source.namespace == "app-dir"


@pytest.mark.parametrize(("target", "words"), [
    ("missing/worker.py:app", "there is no file missing/worker.py (from missing/worker.py:app)"),
    ("docs/notes.txt:app", "docs/notes.txt is not a Python file (from docs/notes.txt:app)"),
    ("ck_targets_worker.py:nothing", "module 'ck_targets_worker' has no attribute 'nothing'"),
    ("json.py:app", "json.py would be imported as 'json', which is another module"),
    ("ck_targets_empty.py:app", "ck_targets_empty.py:app has no handlers, so it has nothing to run"),
])
def test_a_target_that_cannot_run_is_one_line(shell: Path, target: str, words: str) -> None:
    write_app(shell / "ck_targets_worker.py")
    (shell / "docs").mkdir()
    (shell / "docs" / "notes.txt").write_text("app = 1\n")
    (shell / "json.py").write_text("app = 1\n")
    (shell / "ck_targets_empty.py").write_text("from consumer_kit import ConsumerApp, Settings\n"
                                               "app = ConsumerApp(Settings())\n")
    for name in ("ck_targets_worker", "ck_targets_empty"):
        sys.modules.pop(name, None)
    says_one_line(cli("run", target), words)
    assert not (shell / "targets.db").exists()  # refused before anything was opened


def test_env_file_is_read_before_the_settings_and_the_environment_wins(tmp_path: Path) -> None:
    write_app(tmp_path / "worker.py")
    env_file = tmp_path / "worker.env"
    env_file.write_text(f"DATABASE_URL=sqlite:///{tmp_path}/from-file.db\nLOG_LEVEL=WARNING\n")
    done = subprocess.run([*CLI, "db", "upgrade", "--env-file", str(env_file)], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "from-file.db").exists() and "INFO" not in done.stderr  # LOG_LEVEL=WARNING from the file
    seen = run_until_started(["--env-file", "worker.env", "--log-level", "info", "run", "worker.py:app"], tmp_path,
                             env(DATABASE_URL=f"sqlite:///{tmp_path}/from-env.db"))
    assert "consumer-kit started" in seen
    assert (tmp_path / "from-env.db").exists()  # a variable already set keeps its value


def test_a_wrong_url_in_an_env_file_names_the_variable_not_the_password(tmp_path: Path) -> None:
    write_app(tmp_path / "worker.py")
    (tmp_path / "worker.env").write_text(f"RABBITMQ_URL=http://guest:{SECRET}@127.0.0.1:5672/\n")
    done = subprocess.run([*CLI, "run", "worker.py:app", "--env-file", "worker.env"], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "consumer-kit: importing 'worker' failed: invalid setting: RABBITMQ_URL: must be an amqp:// or amqps:// "
        "URL (amqp://user:password@host:5672/vhost), not http://"]


def test_an_env_file_that_cannot_be_read_is_one_line(shell: Path) -> None:
    (shell / "latin1.env").write_bytes(b"NAME=caf\xe9\n")
    says_one_line(cli("--env-file", "latin1.env", "db", "check"), "--env-file latin1.env: cannot read it")
    says_one_line(cli("db", "check", "--env-file", "missing.env"), "argument --env-file: 'missing.env': no such file")


@pytest.mark.parametrize(("variable", "url", "words"), [
    ("DATABASE_URL", f"mysql://root:{SECRET}@127.0.0.1/ck", "DATABASE_URL: must be a SQLite URL"),
    ("COORDINATOR_URL", f"ftp://ck:{SECRET}@127.0.0.1/", "COORDINATOR_URL: must be an http:// or https:// URL"),
    ("SQS_ENDPOINT_URL", "127.0.0.1:4566", "SQS_ENDPOINT_URL: must be an http:// or https:// URL"),
    ("RABBITMQ_URL", f"redis://:{SECRET}@127.0.0.1:6379", "RABBITMQ_URL: must be an amqp://"),
])
def test_a_url_of_the_wrong_scheme_is_refused_by_every_command(shell: Path, monkeypatch: pytest.MonkeyPatch,
                                                                variable: str, url: str, words: str) -> None:
    monkeypatch.setenv(variable, url)
    write_app(shell / "ck_targets_worker.py")
    sys.modules.pop("ck_targets_worker", None)
    says_one_line(cli("db", "check"), f"invalid setting: {words}")
    says_one_line(cli("run", "ck_targets_worker.py:app"), f"invalid setting: {words}")
    says_one_line(cli("coordinator", "serve", "--port", "0"), f"invalid setting: {words}")
    assert not (shell / "targets.db").exists()


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_the_script_refuses_a_port_out_of_range(tmp_path: Path, port: str) -> None:
    done = subprocess.run([*CLI, "run", "examples.quickstart:app", "--port", port], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"consumer-kit run: argument --port: {port} is not a port: give 0 to 65535 "
                                        "(0: any free port) (see consumer-kit run --help)"]


@pytest.mark.rabbitmq
@pytest.mark.parametrize(("url", "words"), [
    (f"amqp://ck-nobody:{SECRET}@127.0.0.1:5672/", "refused the login of user 'ck-nobody'"),
    ("amqp://guest:guest@127.0.0.1:5672/ck-no-such-vhost", "virtual host 'ck-no-such-vhost' does not exist"),
    (f"amqp://guest:{SECRET}@127.0.0.1:1/", "connection refused"),
], ids=["bad login", "unknown vhost", "closed port"])
def test_a_broker_refusal_is_one_line_with_no_reconnecting_before_it(tmp_path: Path, url: str, words: str) -> None:
    done = subprocess.run(
        [*CLI, "run", "tests.acceptance.parked_app:app"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env=env(DATABASE_URL=f"sqlite:///{tmp_path}/w.db", PARKED_TEST_QUEUE="ck-never-declared", RABBITMQ_URL=url))
    assert done.returncode == 2, done.stderr
    refusals = [line for line in done.stderr.splitlines() if line.startswith("consumer-kit:")]
    assert len(refusals) == 1 and "cannot connect to RabbitMQ at" in refusals[0] and words in refusals[0]
    assert done.stderr.splitlines()[-1] == refusals[0]
    assert "Reconnect" not in done.stderr and "Traceback" not in done.stderr and SECRET not in done.stderr
