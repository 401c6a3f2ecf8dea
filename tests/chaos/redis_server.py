"""A ``redis-server`` of the chaos run's own, so that killing it touches no other test's data.

It listens on a free loopback port and keeps its data in a temporary directory as an append-only file
written with ``appendfsync always`` (no RDB snapshots): an entry or acknowledgement the server answered
for is in the file before the answer, so :meth:`RedisServer.kill` (SIGKILL) and :meth:`start` lose
nothing the worker was told had happened.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """:meth:`start`, :meth:`kill` (as a crash), :meth:`start` again on the same files, :meth:`stop` (and remove)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian's package redis-server)")
        self.binary = binary
        self.directory = Path(tempfile.mkdtemp(prefix="ck-own-redis-"))
        self.port = _free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis-server.log"

    def start(self) -> None:
        self._process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
             "--logfile", str(self.log_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self._process.returncode}): {self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):  # -LOADING while it reads its file back
                    return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not get ready: {self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: the server stops as a crash stops it (the next start reads its append-only file back)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(timeout=20)
            self._process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stop it and remove its files."""
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])
