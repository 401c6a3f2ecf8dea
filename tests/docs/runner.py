"""Runs one page's blocks in order, in a fresh directory, by the conventions of :mod:`tests.docs.blocks`."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from consumer_kit import Settings
from tests.docs.blocks import (
    DATABASE,
    FILES,
    PORTS,
    ROOT,
    Block,
    console_commands,
    mismatch,
    names_default_vhost,
    parse,
    substitute,
)

VENV_BIN = Path(sys.executable).parent
PG_ADMIN_URL = os.environ.get("CK_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_API = os.environ.get("CK_TEST_RABBITMQ_API", "http://127.0.0.1:15672")
DEFAULT_TIMEOUT = 60.0
_BACKGROUND = re.compile(r"(?<![&|>])&\s*(#[^'\"]*)?$")
_DOTENV_LINE = re.compile(r"^(export )?[A-Za-z_][A-Za-z0-9_]*=.*$")
# What a user's shell would not have: the suite's own configuration, and consumer-kit's settings (each
# page sets what it needs, as a user would).
_OWN = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "LOG_LEVEL", "LOG_FORMAT", "STARTER_WEBHOOK_SECRET"}


class BlockFailed(AssertionError):
    """A block that did not do what its page says; the message names the page and the line."""


@dataclass
class Report:
    """What a page's run did with its blocks, each by ``page:line``."""

    ran: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # the expected outputs compared
    shown: list[str] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)  # "page:line: reason"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def base_env() -> dict[str, str]:
    """The environment of a user's shell with the package installed: the virtualenv first on PATH."""
    settings = {name.upper() for name in Settings.model_fields}
    env = {name: value for name, value in os.environ.items()
           if name not in settings | _OWN and not name.startswith(("PYTEST_", "CK_", "AWS_", "COV_"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


class PageRun:
    """One page's run: ``run()`` runs every block, raises :class:`BlockFailed` at the first that fails,
    and always cleans up (background processes, the page's database and virtual host)."""

    def __init__(self, page: Path, workdir: Path, root: Path = ROOT) -> None:
        self.page = page
        self.root = root
        self.blocks = parse(page, root)
        self.dir = workdir / "project"
        self.private = workdir / "runner"  # the runner's own files, out of the user's directory
        self.checkout = workdir / "checkout"  # made by the first block annotated docs: checkout
        self.ports = {port: free_port() for port in PORTS}
        text = (root / page).read_text(encoding="utf-8")
        # A page that names the local NATS or Redis server gets a server of its own in its place (a
        # stream, a consumer group or a durable consumer of one page then never meets another's).
        self.servers = [OwnServer(kind, documented) for kind, documented in OWN_SERVERS.items()
                        if re.search(rf"127\.0\.0\.1:{documented}(?!\d)", text)]
        self.ports.update({server.documented: server.port for server in self.servers})
        uses_database = re.search(rf"/{DATABASE}(?!\w)", text) is not None
        self.database = f"{DATABASE}_{uuid.uuid4().hex[:12]}" if uses_database else None
        self.vhost = f"{DATABASE}_{uuid.uuid4().hex[:12]}" if names_default_vhost(text) else None
        self.groups: list[int] = []  # process groups of blocks that left something in the background
        self.report = Report()

    def run(self) -> Report:
        self.dir.mkdir(parents=True)
        self.private.mkdir(parents=True)
        (self.private / "cwd").write_text(str(self.dir))
        if self.database:
            _psql(f'CREATE DATABASE "{self.database}"')
        try:
            for server in self.servers:
                server.start(self.private)
            if self.vhost:
                rabbitmq_vhost(self.vhost, create=True)
            for block in self.blocks:
                self._one(block)
        finally:
            self._stop_background()  # first: a worker still connected holds the vhost's queues
            for server in self.servers:
                server.stop()
            try:
                if self.vhost:
                    rabbitmq_vhost(self.vhost, create=False)
            finally:
                if self.database:
                    _psql(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
        return self.report

    def _text(self, text: str) -> str:
        return substitute(text, self.ports, self.database, self.vhost)

    def _one(self, block: Block) -> None:
        kind = block.kind
        if kind == "not-run":
            self.report.not_run.append(f"{block.where}: {block.not_run}")
        elif kind == "shown":
            self.report.shown.append(block.where)
        elif kind == "output":
            pass  # compared when the block before it ran
        elif kind == "write":
            self._write(block)
            self.report.written.append(block.where)
        elif kind == "check":
            _check(block, self._text(block.text))
            self.report.checked.append(block.where)
        else:
            self._execute(block)
            self.report.ran.append(block.where)

    def _write(self, block: Block) -> None:
        assert block.filename is not None
        if ".." in Path(block.filename).parts:
            raise BlockFailed(f"{block.where}: {block.filename} is outside the page's directory")
        path = self.dir / block.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        text = self._text(block.text)
        path.write_text(text.split("\n", 1)[1] if block.lang == "json" else text, encoding="utf-8")

    def _execute(self, block: Block) -> None:
        expected = block.expected.text if block.expected else None
        if block.lang == "console":
            script, expected = console_commands(block)
        elif block.lang == "python":
            source = self.private / f"block-{block.line}.py"
            source.write_text(self._text(block.text), encoding="utf-8")
            script = f"python - < {shlex.quote(str(source))}\n"
        else:
            script = block.text
        script = self._text(script)
        output, code = self._bash(block, script)
        wanted = int(block.annotation("exit") or 0)
        if code != wanted:
            raise BlockFailed(f"{block.where}: exited {code}, not {wanted}; its output:\n{output.read_text()}")
        url = block.annotation("wait")
        if url is not None:
            self._wait(block, self._text(url), output)
        if expected is not None and expected.strip():
            printed = output.read_text()
            missing = mismatch(self._text(expected), printed)
            if missing is not None:
                raise BlockFailed(f"{block.where}: its output lacks the line {missing!r} (in order); it printed:\n"
                                  f"{printed}")
            self.report.outputs.append((block.expected or block).where)

    def _bash(self, block: Block, script: str) -> tuple[Path, int]:
        env_state, cwd_state = self.private / "env", self.private / "cwd"
        start, keep_cwd = f'"$(cat {cwd_state})"', f"pwd > {cwd_state}; "
        if block.annotation("checkout") is not None:
            if not self.checkout.exists():
                copy_checkout(self.root, self.checkout)
            start, keep_cwd = shlex.quote(str(self.checkout)), ""  # the page's directory stays the page's
        names = [note.split("=", 1) for kind, note in block.annotations if kind == "env"]
        keep = "".join(f'__ck_{i}=${{{name}-__ck_unset}}; export {name}={shlex.quote(self._text(value))}\n'
                       for i, (name, value) in enumerate(names))
        restore = "".join(f'if [ "$__ck_{i}" = __ck_unset ]; then unset {name}; else export {name}="$__ck_{i}"; fi; '
                          for i, (name, _) in enumerate(names))
        path = self.private / f"block-{block.line}.sh"
        path.write_text(
            f"if [ -f {env_state} ]; then source {env_state}; fi\n"
            f"cd {start}\n{keep}"
            f"trap '__ck_rc=$?; {restore}export -p > {env_state}; {keep_cwd}exit $__ck_rc' EXIT\n"
            "set -euo pipefail\n" + script, encoding="utf-8")
        output = self.private / f"block-{block.line}.out"
        background = any(_BACKGROUND.search(line) for line in script.splitlines())
        timeout = float(block.annotation("timeout") or DEFAULT_TIMEOUT)
        with output.open("wb") as sink:
            process = subprocess.Popen(["bash", str(path)], cwd=self.dir, env=base_env(), stdin=subprocess.DEVNULL,
                                       stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
            if background:
                self.groups.append(process.pid)
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(process.pid)
                process.wait()
                raise BlockFailed(f"{block.where}: still running after {timeout:g} s; its output:\n"
                                  f"{output.read_text()}") from None
        return output, code

    def _wait(self, block: Block, url: str, output: Path) -> None:
        deadline = time.monotonic() + float(block.annotation("timeout") or DEFAULT_TIMEOUT)
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:
                    if 200 <= answer.status < 300:
                        return
            except urllib.error.HTTPError as exc:
                last = f"{exc.code} {exc.read()[:200]!r}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise BlockFailed(f"{block.where}: {url} did not answer 2xx in time (last: {last}); the block's output:\n"
                          f"{output.read_text()}")

    def _stop_background(self) -> None:
        for group in self.groups:
            _kill_group(group)


OWN_SERVERS = {"nats": 4222, "redis": 6379}


class OwnServer:
    """A ``nats-server -js`` or a ``redis-server`` of one page's own, on a free port, its data in the
    runner's directory of the page (gone with it)."""

    def __init__(self, kind: str, documented: int) -> None:
        self.kind, self.documented, self.port = kind, documented, free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, directory: Path) -> None:
        data = directory / self.kind
        data.mkdir()
        command = (["nats-server", "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(data)]
                   if self.kind == "nats" else
                   ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(data), "--save", "",
                    "--appendonly", "yes", "--appendfsync", "always"])
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited ({self.process.returncode}) before it listened")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    time.sleep(0.2)  # listening; JetStream and the AOF are ready a moment later
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{command[0]} did not listen on {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=20)
            self.process = None


def _kill_group(group: int) -> None:
    """SIGTERM to a block's process group, as Ctrl-C or a supervisor would stop it; SIGKILL after 10 s."""
    for sig, patience in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            try:
                os.waitpid(-group, os.WNOHANG)
            except ChildProcessError:
                pass  # not our child (a background job of the block's shell): it is reaped by init
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def _check(block: Block, text: str) -> None:
    try:
        if block.lang == "toml":
            tomllib.loads(text)
        elif block.lang == "yaml":
            yaml.safe_load(text)
        elif block.lang == "json":
            json.loads(text)
        elif block.lang == "ini":
            configparser.ConfigParser().read_string(text)
        else:
            bad = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
                   and not _DOTENV_LINE.match(line)]
            if bad:
                raise ValueError(f"not NAME=value: {bad[0]!r}")
    except (ValueError, yaml.YAMLError, configparser.Error) as exc:
        raise BlockFailed(f"{block.where}: not valid {block.lang}: {exc}") from None
    assert block.lang in FILES


def copy_checkout(root: Path, into: Path) -> None:
    """A checkout of the repository at ``root`` in ``into``: the files git tracks, as the working tree has
    them (so a change not yet committed is what a page's block reads); every file of ``root`` when it is
    no git work tree (the runner's own tests)."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=60)
    if listed.returncode != 0:
        shutil.copytree(root, into, symlinks=True)
        return
    into.mkdir(parents=True)
    for name in filter(None, listed.stdout.decode("utf-8").split("\0")):
        source = root / name
        if not source.is_symlink() and not source.exists():
            continue  # deleted in the working tree, not yet in a commit
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, into / name, follow_symlinks=False)


def rabbitmq_vhost(name: str, *, create: bool) -> None:
    """Create RabbitMQ's virtual host ``name``, with every permission for guest, or delete it with all it
    holds: through the management HTTP API when it answers, else with ``rabbitmqctl``."""
    api, quoted = f"{RABBITMQ_API.rstrip('/')}/api", urllib.parse.quote(name, safe="")
    try:
        with httpx.Client(auth=("guest", "guest"), timeout=30) as client:
            if create:
                client.put(f"{api}/vhosts/{quoted}").raise_for_status()
                client.put(f"{api}/permissions/{quoted}/guest",
                           json={"configure": ".*", "write": ".*", "read": ".*"}).raise_for_status()
            else:
                gone = client.delete(f"{api}/vhosts/{quoted}")
                if gone.status_code != 404:
                    gone.raise_for_status()
        return
    except httpx.ConnectError:
        pass  # no management plugin on this broker: its command line below
    except httpx.HTTPError as exc:
        raise BlockFailed(f"RabbitMQ's management API at {RABBITMQ_API}, virtual host {name}: {exc}") from None
    steps = ([["add_vhost", name], ["set_permissions", "-p", name, "guest", ".*", ".*", ".*"]] if create
             else [["delete_vhost", name]])
    for step in steps:
        try:
            done = subprocess.run(["rabbitmqctl", *step], capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise BlockFailed(f"the page's virtual host {name}: RabbitMQ's management API does not answer at "
                              f"{RABBITMQ_API}, and rabbitmqctl is not installed") from None
        if done.returncode != 0 and not (step[0] == "delete_vhost" and "does not exist" in done.stderr):
            raise BlockFailed(f"rabbitmqctl {' '.join(step)}: {(done.stderr or done.stdout).strip()}")


def _psql(statement: str) -> None:
    done = subprocess.run(["psql", PG_ADMIN_URL, "-v", "ON_ERROR_STOP=1", "-qc", statement],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise BlockFailed(f"{statement}: {done.stderr.strip()}")
