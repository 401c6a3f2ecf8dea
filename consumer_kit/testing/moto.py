"""moto's server (``moto[server]``) as an SQS endpoint for tests and benchmarks, in a process of its own.

:func:`moto_server` starts it on a free loopback port and yields its URL::

    with moto_server() as endpoint:
        settings = Settings(sqs_endpoint_url=endpoint, sqs_region="us-east-1", ...)

A process rather than moto's in-process ``ThreadedMotoServer``: moto does most of the work in an SQS
test (it scans the queue on every receive), and inside the test's process it would contend for the
GIL with the event loop and the source's boto3 threads.

The server runs with one fix (:func:`_serialise_deletes`): moto's ``Queue.delete_message`` builds a new
message list and assigns it without the queue's lock, while ``SendMessage`` appends to the list under
that lock; a message sent by one request thread while another deletes is appended to the old list
and lost. Real SQS loses nothing; without the fix a test that sends while a consumer deletes (a live
producer) sometimes ends a message short with the queue empty, which is moto's loss, not the
consumer's. Run as ``python -m consumer_kit.testing.moto`` it takes ``moto.server``'s arguments.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def moto_server(*, timeout: float = 60.0) -> Iterator[str]:
    """moto's server on a free loopback port, in a process of its own; yields its URL. boto3's
    credentials default to moto's dummies (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``) if unset."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    with tempfile.NamedTemporaryFile(prefix="consumer-kit-moto-", suffix=".log") as log:
        server = subprocess.Popen([sys.executable, "-m", "consumer_kit.testing.moto", "-H", "127.0.0.1", "-p", "0"],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while not (found := re.search(rb"Running on http://127\.0\.0\.1:(\d+)", _read(log.name))):
                if server.poll() is not None or time.monotonic() > deadline:
                    tail = _read(log.name)[-2000:].decode(errors="replace")
                    raise RuntimeError(f"moto server did not start: {tail}")
                time.sleep(0.1)
            yield f"http://127.0.0.1:{int(found.group(1))}"
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def _serialise_deletes() -> None:
    """Make moto's delete hold the queue's lock, as its send already does (see the module's text)."""
    from moto.sqs.models import Queue

    delete = Queue.delete_message

    def delete_message(self: Any, receipt_handle: str) -> None:
        with self._messages_lock:  # a threading.Condition on an RLock; send_message appends under it
            delete(self, receipt_handle)

    Queue.delete_message = delete_message  # type: ignore[method-assign]


def main() -> None:
    """``moto.server`` with the fix applied."""
    _serialise_deletes()
    from moto.server import main as serve

    serve(sys.argv[1:])


if __name__ == "__main__":
    main()
