"""Helpers for tests that run a ``consumer-kit`` server as a subprocess, the way a user does."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import httpx
import pytest


def wait_until_served(process: subprocess.Popen[str], url: str, *, seconds: float = 60) -> None:
    """Poll ``url`` until it answers 200; fail the test if ``process`` exits or ``seconds`` pass first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{url} was never served: {process.args!r}")
        time.sleep(0.1)


def stop_cleanly(process: subprocess.Popen[str], *, seconds: float = 30) -> str:
    """SIGTERM, then the process's output, once it exited 0 without a traceback (else the test fails)."""
    process.send_signal(signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"still running {seconds} s after SIGTERM:\n{output}")
    assert process.returncode == 0, output
    assert "Traceback" not in output, output
    return output


async def terminated(process: subprocess.Popen[str], *, seconds: float = 30) -> int:
    """SIGTERM, then the exit code once the process ends, waited for off the event loop; a process still
    running ``seconds`` later is killed and the wait's timeout raised."""
    process.send_signal(signal.SIGTERM)
    try:
        return await asyncio.to_thread(process.wait, seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
