"""A PostgreSQL server of the chaos run's own, so that crashing it touches no other test's database.

``initdb`` into a temporary directory, listening on a free loopback port; :meth:`OwnServer.crash` stops
it the way a crash does (``pg_ctl stop -m immediate``: every process quits at once, without a
checkpoint, and the next start replays the WAL), losing whatever WAL was not yet handed to the kernel.
The binaries are the newest server's under ``/usr/lib/postgresql`` (Debian's layout), else those of
``pg_config --bindir``; as root, they run as the ``postgres`` user (``initdb`` refuses root).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def _version(bindir: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in bindir.parent.name.split(".") if part.isdigit())


def _bindir() -> Path:
    installed = [path for path in Path("/usr/lib/postgresql").glob("*/bin") if (path / "initdb").exists()]
    if installed:
        return max(installed, key=_version)  # Debian's layout: the newest server installed
    found = shutil.which("pg_config")
    if found is None:
        raise RuntimeError("no PostgreSQL server binaries (initdb) on this machine")
    return Path(subprocess.run([found, "--bindir"], capture_output=True, text=True, check=True).stdout.strip())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class OwnServer:
    """A throwaway PostgreSQL cluster: :meth:`start`, :meth:`crash`, :meth:`start` again, :meth:`remove`."""

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        """``settings``: server settings (``-c name=value``) on top of initdb's, for every start."""
        self.settings = settings or {}
        self.directory = Path(tempfile.mkdtemp(prefix="ck-own-pg-"))
        self.port = _free_port()
        self._bin = _bindir()
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as_postgres:
            shutil.chown(self.directory, "postgres")
        self._pg(["initdb", "-D", str(self.directory / "data"), "-A", "trust", "-U", "postgres", "--no-sync"])

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.directory} -c max_connections=100"
        options += "".join(f" -c {name}={value}" for name, value in self.settings.items())
        self._pg(["pg_ctl", "-D", str(self.directory / "data"), "-l", str(self.directory / "log"), "-o", options,
                  "-w", "-t", "60", "start"])

    def crash(self) -> None:
        """Stop every server process at once, as a crash would (the next start recovers from the WAL)."""
        self._pg(["pg_ctl", "-D", str(self.directory / "data"), "-m", "immediate", "-w", "stop"])

    def remove(self) -> None:
        subprocess.run([*self._as_postgres, str(self._bin / "pg_ctl"), "-D", str(self.directory / "data"), "-m",
                        "immediate", "stop"], capture_output=True, timeout=60, check=False)
        shutil.rmtree(self.directory, ignore_errors=True)

    def log(self) -> str:
        """The server's log, every start of it."""
        log = self.directory / "log"
        return log.read_text(errors="replace") if log.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def _pg(self, command: list[str]) -> None:
        done = subprocess.run([*self._as_postgres, str(self._bin / command[0]), *command[1:]], capture_output=True,
                              text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({done.returncode}): {done.stderr or done.stdout}\n"
                               f"{self.log_tail()}")
