"""A PgBouncer of the test run's own, in transaction pool mode, in front of the test PostgreSQL.

Debian's ``pgbouncer`` (``apt-get install pgbouncer``; ``.ci/run`` installs it) is started on a free
loopback port with its own ini, auth, pid and log files in a temporary directory, and stopped when the
run ends. Every database of the PostgreSQL server is reachable through it under its own name (the
``*`` entry), with trust authentication as the server itself has here.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.engine import make_url

MISSING = "pgbouncer is not installed (apt-get install -y pgbouncer; .ci/run installs it)"
"""The reason the PgBouncer tests are skipped, the only one they are skipped for."""


def executable() -> str | None:
    """The ``pgbouncer`` program, if it is installed (Debian puts it in /usr/sbin)."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(directory: Path, port: int, upstream_host: str, upstream_port: int) -> str:
    return f"""\
[databases]
* = host={upstream_host} port={upstream_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {directory}/users.txt
pool_mode = transaction
; the test apps share the server's 100 connections with the rest of the run: at most 20 a database,
; given back after 10 s idle
default_pool_size = 20
max_db_connections = 20
server_idle_timeout = 10
max_client_conn = 400
logfile = {directory}/pgbouncer.log
pidfile = {directory}/pgbouncer.pid
admin_users = postgres
"""


@contextlib.contextmanager
def pgbouncer(upstream: str) -> Iterator[int]:
    """Run a PgBouncer in transaction pool mode in front of the PostgreSQL server of ``upstream`` (a
    URL of it); yields its port. PgBouncer refuses to run as root: as root it is started as the
    ``postgres`` user (``-u``), which then owns its directory."""
    program = executable()
    assert program is not None, MISSING
    url = make_url(upstream)
    with tempfile.TemporaryDirectory(prefix="ck-pgbouncer-") as name:
        directory = Path(name)
        port = _free_port()
        (directory / "users.txt").write_text(f'"{url.username or "postgres"}" ""\n')
        ini = directory / "pgbouncer.ini"
        ini.write_text(_config(directory, port, url.host or "127.0.0.1", url.port or 5432))
        command = [program, str(ini)]
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(directory, user.pw_uid, user.pw_gid)
            for path in directory.iterdir():
                os.chown(path, user.pw_uid, user.pw_gid)
            command[1:1] = ["-u", "postgres"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_until_listening(process, port, directory / "pgbouncer.log")
            yield port
        finally:
            process.send_signal(signal.SIGINT)  # PgBouncer's "shut down at once"
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_until_listening(process: subprocess.Popen[bytes], port: int, log: Path, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if process.poll() is not None or time.monotonic() > deadline:
            said = log.read_text() if log.exists() else "(no log)"
            raise RuntimeError(f"pgbouncer did not come up on 127.0.0.1:{port}:\n{said}")
        time.sleep(0.05)


def through(url: str, port: int) -> str:
    """``url`` (a PostgreSQL URL of the test server) with the bouncer at ``port`` in its place."""
    return make_url(url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
